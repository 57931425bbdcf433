//! The decode end of the fault injector: [`FaultyReceiver`], and the damage it does to a
//! page right after it landed.

use super::*;

impl<T> FaultyReceiver<T> {
    /// Wraps the decode end of a connection; `pool` is its destination memory (damaged by
    /// the corruption and truncation faults after a page lands).
    pub fn new(inner: T, plan: Arc<Mutex<FaultPlan>>, pool: Arc<PagePool>) -> Self {
        Self(Core::new(inner, Side::Receiver, plan, Some(pool)))
    }

    /// The wrapped transport.
    pub fn inner(&self) -> &T {
        &self.0.inner
    }

    /// The wrapped transport, mutably.
    pub fn inner_mut(&mut self) -> &mut T {
        &mut self.0.inner
    }

    /// Marks this side crashed: nothing more leaves it.
    pub fn crash(&mut self) {
        self.0.crash();
    }
}

impl<T: ReceiverTransport> Transport for FaultyReceiver<T> {
    fn send_frame(&mut self, now: Instant, frame: &Frame) {
        send_frame(&mut self.0, now, frame, |_, _| {});
    }

    fn poll_event(&mut self, cx: &mut Context<'_>, now: Instant) -> Poll<TransportEvent> {
        let slow = &mut self.0.slow_fences;
        for f in slow.iter_mut() {
            f.at.get_or_insert(now + f.delay);
        }
        if let Some(i) = slow
            .iter()
            .position(|f| f.inner_done && f.at.is_some_and(|at| now >= at))
        {
            return Poll::Ready(TransportEvent::Fenced(slow.swap_remove(i).transfer));
        }
        let Some(mut e) = poll_common(&mut self.0, cx, now) else {
            return Poll::Pending;
        };
        if let TransportEvent::Fenced(t) = &e {
            if let Some(f) = self.0.slow_fences.iter_mut().find(|f| f.transfer == *t) {
                // The inner fence completed; it is reported when the delay is over.
                f.inner_done = true;
                return self.poll_event(cx, now);
            }
        }
        if let TransportEvent::Landed {
            transfer,
            ordinal,
            page,
            digests,
        } = &mut e
        {
            let (transfer, ordinal, page) = (*transfer, *ordinal, *page);
            let damage = {
                let mut plan = self.0.plan();
                let i = plan
                    .damage
                    .iter()
                    .position(|&(id, o, _)| id == transfer.transfer_id && o == ordinal);
                i.map(|i| plan.damage.swap_remove(i).2)
            };
            if let (Some(d), Some(pool)) = (damage, &self.0.pool) {
                damage_page(pool, page, d);
                // The damage stands for bytes that landed altered: digests the transport
                // took of what it wrote are not those of what landed.
                *digests = None;
            }
        }
        Poll::Ready(e)
    }

    fn close(&mut self, now: Instant) {
        self.0.inner.close(now);
    }

    fn poll_timeout(&self) -> Option<Instant> {
        timeout(&self.0)
    }

    // What the wrapped transport knows of the peer's reading and writing reaches the driver's
    // liveness (SPEC §8.3) as it would without the wrapper.
    fn write_blocked_since(&self) -> Option<Instant> {
        self.0.inner.write_blocked_since()
    }

    fn last_read(&self) -> Option<Instant> {
        self.0.inner.last_read()
    }

    fn failed_lanes(&self) -> usize {
        self.0.inner.failed_lanes()
    }

    fn moves_transfers(&self) -> bool {
        self.0.inner.moves_transfers()
    }

    fn log_state(&self) {
        self.0.inner.log_state()
    }
}

impl<T: ReceiverTransport> ReceiverTransport for FaultyReceiver<T> {
    fn open_scope(
        &mut self,
        transfer_id: TransferId,
        pages: &[u32],
    ) -> Result<Vec<u8>, ScopeError> {
        self.0.inner.open_scope(transfer_id, pages)
    }

    fn bind_scope(&mut self, transfer: TransferRef) {
        self.0.inner.bind_scope(transfer);
    }

    fn abandon_scope(&mut self, transfer_id: TransferId) {
        self.0.inner.abandon_scope(transfer_id);
    }

    fn open_scopes(&self) -> usize {
        self.0.inner.open_scopes()
    }

    fn reports_landings(&self) -> bool {
        self.0.inner.reports_landings()
    }

    fn digest_landings(&mut self, transfer_id: TransferId, alg: DigestAlgorithm) {
        self.0.inner.digest_landings(transfer_id, alg);
    }

    fn fence(&mut self, transfer: TransferRef) -> Fence {
        let slow = self
            .0
            .plan()
            .take(transfer.transfer_id, |f| matches!(f, Fault::SlowFence(_)));
        let done = self.0.inner.fence(transfer) == Fence::Done;
        match slow {
            Some(Fault::SlowFence(delay)) => {
                self.0.slow_fences.push(SlowFence {
                    transfer,
                    delay,
                    at: None,
                    inner_done: done,
                });
                Fence::Pending
            }
            _ if done => Fence::Done,
            _ => Fence::Pending,
        }
    }
}

fn damage_page(pool: &PagePool, page: u32, damage: Damage) {
    match damage {
        Damage::CorruptByte { buffer, offset } => {
            if let Some(mut bytes) = pool.raw_page_mut(page, buffer) {
                if offset < bytes.len() {
                    bytes[offset] ^= 0x01;
                }
            }
        }
        Damage::Truncated { keep } => {
            for b in 0..pool.buffers() {
                if let Some(mut bytes) = pool.raw_page_mut(page, b) {
                    for (i, x) in bytes.iter_mut().enumerate().skip(keep) {
                        *x = 0xA0 | (i as u8 & 0x0f);
                    }
                }
            }
        }
    }
}
