//! Frames for transfers with no open state (finished, retired or never known): late and
//! parked reservations, their REJECTs, and acknowledgements of stray ABORTs.

use std::time::Instant;

use super::SenderSession;
use crate::scope::FrameError;
use crate::wire::{ErrorCode, Frame, Reject, Reserve, TransferRef};

impl SenderSession {
    pub(super) fn reject_reservation(&mut self, r: &Reserve, code: ErrorCode, detail: String) {
        self.out.stats.rejected_reservations += 1;
        self.out.transmit.push_back(Frame::Reject(Reject {
            transfer: TransferRef {
                transfer_id: r.transfer_id,
                nonce: r.nonce,
            },
            code,
            detail,
        }));
    }

    pub(super) fn handle_closed_transfer(
        &mut self,
        now: Instant,
        frame: Frame,
        tref: TransferRef,
    ) -> Result<(), FrameError> {
        match (frame, self.history.get(tref.transfer_id).cloned()) {
            (Frame::Reserve(r), Some(f)) => {
                let (code, detail) = f.failure.unwrap_or((
                    ErrorCode::DUPLICATE_TRANSFER,
                    "transfer already verified".into(),
                ));
                self.reject_reservation(&r, code, detail);
                Ok(())
            }
            (Frame::Reserve(r), None) => {
                if let Some((old, _)) = self.parked.remove(&r.transfer_id) {
                    self.reject_reservation(
                        &old,
                        ErrorCode::DUPLICATE_TRANSFER,
                        "superseded".into(),
                    );
                }
                let deadline = now + self.config.parked_reservation_timeout;
                self.timers.arm(deadline, r.transfer_id);
                self.parked.insert(r.transfer_id, (r, deadline));
                Ok(())
            }
            (Frame::Abort(_), _) => {
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
}
