//! Frames for transfers with no open state (finished, retired or never known): late and
//! parked reservations, their REJECTs, and acknowledgements of stray ABORTs.

use std::time::Instant;

use super::{SenderEvent, SenderSession};
use crate::history::Finished;
use crate::scope::FrameError;
use crate::wire::{ErrorCode, Frame, Reserve, TransferId, TransferRef};

/// How long a parked RESERVE outlives its own deadline (SPEC.md §5.1): time for the receiver's
/// ABORT, sent when that deadline passes, to arrive and end the park.
pub(super) const PARK_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

impl SenderSession {
    pub(super) fn reject_reservation(&mut self, r: &Reserve, code: ErrorCode, detail: String) {
        self.out.reject(r, code, detail);
    }

    pub(super) fn handle_closed_transfer(
        &mut self,
        now: Instant,
        frame: Frame,
        tref: TransferRef,
    ) -> Result<(), FrameError> {
        let id = tref.transfer_id;
        match (frame, self.history.get(id).cloned()) {
            // A new reservation after the receiver aborted a parked one: it starts afresh.
            (Frame::Reserve(r), Some(f)) if f.aborted_while_parked && f.nonce != r.nonce => {
                self.history.remove(id);
                self.park(now, r);
                Ok(())
            }
            (Frame::Reserve(r), Some(f)) => {
                let (code, detail) = f.failure.unwrap_or((
                    ErrorCode::DUPLICATE_TRANSFER,
                    "transfer already verified".into(),
                ));
                self.reject_reservation(&r, code, detail);
                Ok(())
            }
            (Frame::Reserve(r), None) => {
                self.park(now, r);
                Ok(())
            }
            (Frame::Abort(a), finished) => {
                let parked_nonce = self.parked.get(&id).map(|(r, _, _)| r.nonce);
                if let Some(nonce) = parked_nonce.filter(|&n| tref.nonce == n || tref.nonce == 0) {
                    // The receiver gave up on a reservation we hold parked: drop it, and
                    // remember the abort so a later submit of the id fails at once (SPEC §5.1).
                    self.parked.remove(&id);
                    self.remember_refusal(id, nonce, a.code, a.detail);
                } else if parked_nonce.is_none() && finished.is_none() {
                    // The receiver refused a request it never reserved (its pool or context
                    // is too small, its engine cancelled it): the request was on its way
                    // here, so it fails at once when the engine submits it (SPEC §5.1).
                    self.remember_refusal(id, tref.nonce, a.code, a.detail);
                }
                self.out.transmit.push_back(Frame::AbortAck(tref));
                Ok(())
            }
            (other, f) => {
                self.out.stats.dropped_frames += 1;
                let what = if f.is_some() { "finished" } else { "unknown" };
                Err(FrameError::frame(format!(
                    "{} for a {what} transfer",
                    other.frame_type()
                )))
            }
        }
    }

    /// Records that the receiver gave up on (or refused) request `id` before the engine
    /// submitted it: a later `submit`/`open` fails at once with the ABORT's code.
    fn remember_refusal(&mut self, id: TransferId, nonce: u64, code: ErrorCode, detail: String) {
        self.history.insert(
            id,
            Finished {
                nonce,
                failure: Some((code, detail)),
                aborted_while_parked: true,
            },
        );
        self.out.events.push_back(SenderEvent::Announced {
            transfer_id: id,
            refusal: Some(code),
        });
    }

    /// Parks a RESERVE naming no request this session knows (it may be on its way): a
    /// newer one for the same id supersedes it; beyond `max_parked` it is refused at once.
    fn park(&mut self, now: Instant, r: Reserve) {
        if let Some((old, _, _)) = self.parked.remove(&r.transfer_id) {
            self.reject_reservation(&old, ErrorCode::DUPLICATE_TRANSFER, "superseded".into());
        } else if self.parked.len() >= self.config.max_parked {
            self.reject_reservation(
                &r,
                ErrorCode::PARKED_LIMIT,
                format!(
                    "{} reservations already parked for requests this sender does not know",
                    self.parked.len()
                ),
            );
            return;
        }
        // The receiver says how long its reservation lives, and its own ABORT ends the park
        // when that passes: the park outlives it by PARK_GRACE, so the receiver's verdict is its
        // own (TIMEOUT), not a REJECT racing it. The sender bounds it.
        let lifetime = (std::time::Duration::from_millis(r.deadline_ms.into()) + PARK_GRACE)
            .min(self.config.parked_reservation_timeout);
        let deadline = now + lifetime;
        let id = r.transfer_id;
        self.timers.arm(deadline, id);
        self.parked.insert(id, (r, deadline, now));
        self.out.events.push_back(SenderEvent::Announced {
            transfer_id: id,
            refusal: None,
        });
    }
}
