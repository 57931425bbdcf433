//! Admitted requests entering the sender session: whole ([`SenderSession::submit`]) or in
//! chunks as chunked prefill produces them ([`SenderSession::open`], then
//! [`SenderSession::submit_chunk`]), SPEC.md §5.3.

use std::time::Instant;

use super::state::{AwaitingReservation, State};
use super::transfer::{Next, Transfer};
use super::{ChunkError, SenderSession, SubmitError};
use crate::admission::Admitted;
use crate::wire::{Frame, TransferId, TransferRef, MAX_AUX};

impl SenderSession {
    /// Submits an admitted request whose KV pages are all in `source` (sender pool page
    /// indices, in token order), with an empty auxiliary record: one chunk that is also the
    /// final one. It waits for the receiver's reservation.
    pub fn submit(
        &mut self,
        now: Instant,
        admitted: Admitted,
        source: Vec<u32>,
    ) -> Result<(), SubmitError> {
        if self.lost {
            return Err(SubmitError::PeerLost(admitted));
        }
        if self.transfers.contains_key(&admitted.transfer_id()) {
            return Err(SubmitError::DuplicateTransfer(admitted));
        }
        if source.len() as u64 != u64::from(admitted.pages()) {
            return Err(SubmitError::SourcePageCount {
                given: source.len(),
                admitted,
            });
        }
        self.start(now, admitted, source, Some(Vec::new()))
    }

    /// Opens an admitted request whose pages will come in chunks
    /// ([`SenderSession::submit_chunk`]): it waits for the receiver's reservation as
    /// [`SenderSession::submit`] does, with no source page yet. The reservation's deadline
    /// (`deadline_ms`) covers every chunk's writes and digests.
    pub fn open(&mut self, now: Instant, admitted: Admitted) -> Result<(), SubmitError> {
        self.start(now, admitted, Vec::new(), None)
    }

    fn start(
        &mut self,
        now: Instant,
        admitted: Admitted,
        source: Vec<u32>,
        aux: Option<Vec<u8>>,
    ) -> Result<(), SubmitError> {
        if self.lost {
            return Err(SubmitError::PeerLost(admitted));
        }
        let id = admitted.transfer_id();
        if self.transfers.contains_key(&id) {
            return Err(SubmitError::DuplicateTransfer(admitted));
        }
        // Admitted under another tokens-per-page than the layout: every reservation would
        // be refused (SPEC §5.1). Refused here, at once, naming both numbers.
        let layout_pages =
            u64::from(admitted.tokens()).div_ceil(u64::from(self.tokens_per_page.max(1)));
        if layout_pages != u64::from(admitted.pages()) {
            return Err(SubmitError::LayoutMismatch {
                admitted,
                layout_pages,
            });
        }
        // The receiver aborted a reservation for this id while it was parked: it has given
        // up on this request; fail at once rather than wait for a reservation (SPEC §5.1).
        if let Some(f) = self.history.get(id) {
            if f.aborted_while_parked {
                let code = f
                    .failure
                    .as_ref()
                    .map_or(crate::wire::ErrorCode::CANCELLED, |(c, _)| *c);
                self.history.remove(id);
                return Err(SubmitError::AbortedByPeer { admitted, code });
            }
        }
        self.history.remove(id);
        let deadline = now + self.config.reservation_timeout;
        let t = Transfer {
            admitted,
            source,
            aux,
            transfer: TransferRef {
                transfer_id: id,
                nonce: 0,
            },
            state: State::AwaitingReservation(AwaitingReservation { deadline }),
            armed: None,
            moves: 0,
        };
        self.settle(
            t,
            Next::Stay(State::AwaitingReservation(AwaitingReservation { deadline })),
        );
        if let Some((r, _, received)) = self.parked.remove(&id) {
            // Processed as if it had just arrived, except that its `deadline_ms` counts from
            // its receipt, as the receiver's deadline does (SPEC §5.1). Cannot fail with a
            // connection-scope error: it is a RESERVE for an open transfer.
            if let Some(t) = self.transfers.remove(&id) {
                let mut cx = self.ctx(now);
                cx.reserve_received = received;
                let (next, t, _) = t.on_frame(Frame::Reserve(r), &mut cx);
                self.settle(t, next);
            }
        }
        Ok(())
    }

    /// Appends the next chunk of an opened transfer's source pages (in ordinal order). The
    /// chunk that brings the total to [`Admitted::pages`] is the final one; `aux` (the
    /// auxiliary record delivered with the pages, `None` = empty) may be given only with it.
    /// Once the reservation is accepted, each chunk is written and digested as it comes.
    ///
    /// On error nothing changes. A transfer that is being abandoned refuses chunks
    /// ([`ChunkError::TransferEnding`]); its outcome comes as a failure event.
    pub fn submit_chunk(
        &mut self,
        now: Instant,
        transfer_id: TransferId,
        source: Vec<u32>,
        aux: Option<Vec<u8>>,
    ) -> Result<(), ChunkError> {
        let max_aux = self.peer_max_aux.min(MAX_AUX as u32);
        let Some(t) = self.transfers.get(&transfer_id) else {
            if self.lost {
                return Err(ChunkError::PeerLost);
            }
            return Err(ChunkError::UnknownTransfer(transfer_id));
        };
        if t.has_final_chunk() {
            return Err(ChunkError::AfterFinal(transfer_id));
        }
        let takes_chunks = match &t.state {
            State::AwaitingReservation(_) | State::Writing(_) | State::AwaitingMove(_) => true,
            // Drained to move (SPEC §9.2): the pages wait for the new reservation.
            State::Draining(d) => d.after.moves(),
            State::AwaitingVerdict(_) | State::AwaitingAbortAck(_) => false,
        };
        if !takes_chunks {
            return Err(ChunkError::TransferEnding(transfer_id));
        }
        if source.is_empty() {
            return Err(ChunkError::EmptyChunk);
        }
        let remaining = t.admitted.pages() - t.source.len() as u32;
        if source.len() as u64 > u64::from(remaining) {
            return Err(ChunkError::TooManyPages {
                given: source.len(),
                remaining,
            });
        }
        let is_final = source.len() as u32 == remaining;
        match &aux {
            Some(_) if !is_final => return Err(ChunkError::AuxBeforeFinal),
            Some(a) if a.len() > max_aux as usize => {
                return Err(ChunkError::AuxTooLarge {
                    len: a.len(),
                    max: max_aux,
                })
            }
            _ => {}
        }
        let Some(mut t) = self.transfers.remove(&transfer_id) else {
            return Err(ChunkError::UnknownTransfer(transfer_id));
        };
        t.source.extend_from_slice(&source);
        if is_final {
            t.aux = Some(aux.unwrap_or_default());
        }
        let state = t.take_state(now);
        let next = match state {
            State::Writing(mut w) => {
                let mut cx = self.ctx(now);
                cx.post_available(&t, &mut w);
                Next::Stay(State::Writing(w))
            }
            other => Next::Stay(other),
        };
        self.settle(t, next);
        Ok(())
    }
}
