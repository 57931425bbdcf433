//! Frames for transfers with no open state (finished or never known): ABORTs answered
//! with ABORT_ACK or a repeated VERIFIED, COMMITs for unknown transfers NACKed.

use super::ReceiverSession;
use crate::scope::FrameError;
use crate::wire::{ErrorCode, Frame, Nack, TransferRef, NONE_INDEX};

impl ReceiverSession {
    /// A frame for a transfer with no open state: finished or never known.
    pub(super) fn handle_closed_transfer(
        &mut self,
        frame: Frame,
        tref: TransferRef,
    ) -> Result<(), FrameError> {
        let known = self.history.get(tref.transfer_id).is_some();
        match frame {
            Frame::Abort(_) => {
                let verified = self
                    .history
                    .get(tref.transfer_id)
                    .is_some_and(|f| f.failure.is_none() && f.nonce == tref.nonce);
                if verified {
                    // We delivered before this ABORT arrived (the sender timed out on a lost
                    // or slow VERIFIED): say so again, so both sides agree on the outcome.
                    self.out.transmit.push_back(Frame::Verified(tref));
                } else {
                    // Idempotent: a late or crossed abort still gets its acknowledgement.
                    self.out.transmit.push_back(Frame::AbortAck(tref));
                }
                Ok(())
            }
            Frame::Commit(c) if !known => {
                self.out.transmit.push_back(Frame::Nack(Nack {
                    transfer: c.transfer,
                    code: ErrorCode::UNKNOWN_TRANSFER,
                    buffer: NONE_INDEX,
                    page: NONE_INDEX,
                    detail: "no reservation for this transfer".into(),
                }));
                self.out.stats.dropped_frames += 1;
                Err(FrameError::frame("COMMIT for an unknown transfer"))
            }
            Frame::Commit(c) => {
                // A COMMIT for a finished transfer (SPEC §7.3): the same reservation gets its
                // outcome again (VERIFIED, or NACK with the code it failed with); another
                // reservation of the id gets STALE_NONCE. Never silence: the sender would
                // wait out its verdict deadline.
                let finished = self.history.get(tref.transfer_id).cloned();
                let reply = match finished {
                    Some(f) if f.nonce == c.transfer.nonce => match f.failure {
                        None => Frame::Verified(c.transfer),
                        Some((code, detail)) => Frame::Nack(Nack {
                            transfer: c.transfer,
                            code,
                            buffer: NONE_INDEX,
                            page: NONE_INDEX,
                            detail: format!("transfer already failed: {detail}"),
                        }),
                    },
                    _ => Frame::Nack(Nack {
                        transfer: c.transfer,
                        code: ErrorCode::STALE_NONCE,
                        buffer: NONE_INDEX,
                        page: NONE_INDEX,
                        detail: "nonce names no current reservation (the transfer has ended)"
                            .into(),
                    }),
                };
                self.out.transmit.push_back(reply);
                self.out.stats.dropped_frames += 1;
                Err(FrameError::frame("COMMIT for a finished transfer"))
            }
            other => {
                self.out.stats.dropped_frames += 1;
                let what = if known { "finished" } else { "unknown" };
                Err(FrameError::frame(format!(
                    "{} for a {what} transfer",
                    other.frame_type()
                )))
            }
        }
    }
}
