//! A transfer's state, shared between the handle and the runtime's tasks that advance it.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{Error, KvPoll};

/// A transfer's state, shared with the runtime's tasks that advance it.
#[derive(Debug)]
pub(super) struct Shared<T> {
    st: Mutex<State<T>>,
    changed: Condvar,
}

#[derive(Debug)]
pub(super) struct State<T> {
    pub(super) poll: KvPoll,
    pub(super) error: Option<Error>,
    /// Whether the engine API's outcome arrived (or nothing was ever started): only then
    /// can the pages be checked for release.
    pub(super) settled: bool,
    /// What a verified transfer delivered.
    pub(super) result: Option<T>,
}

impl<T> Shared<T> {
    pub(super) fn new() -> Arc<Self> {
        Arc::new(Self {
            st: Mutex::new(State {
                poll: KvPoll::Bootstrapping,
                error: None,
                settled: true,
                result: None,
            }),
            changed: Condvar::new(),
        })
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, State<T>> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn poll(&self) -> KvPoll {
        self.lock().poll
    }

    /// Moves to `to` unless the transfer already ended.
    pub(super) fn advance(&self, to: KvPoll) {
        let mut s = self.lock();
        if !s.poll.is_final() {
            s.poll = to;
            self.changed.notify_all();
        }
    }

    /// Fails the transfer unless it already ended (the first verdict stands).
    pub(super) fn fail(&self, e: Error) {
        let mut s = self.lock();
        if !s.poll.is_final() {
            s.poll = KvPoll::Failed;
            s.error = Some(e);
        }
        self.changed.notify_all();
    }

    /// The engine API's outcome arrived: `Ok` with what was delivered, or the failure.
    /// What arrives after the transfer already ended (an abort won) is dropped.
    pub(super) fn settle(&self, outcome: Result<T, Error>) {
        let mut s = self.lock();
        s.settled = true;
        if !s.poll.is_final() {
            match outcome {
                Ok(v) => {
                    s.poll = KvPoll::Success;
                    s.result = Some(v);
                }
                Err(e) => {
                    s.poll = KvPoll::Failed;
                    s.error = Some(e);
                }
            }
        }
        self.changed.notify_all();
    }

    /// Waits until `done(state)` or `timeout`; `tick` (if any) is called between waits
    /// of at most 5 ms (to advance a transfer still bootstrapping).
    pub(super) fn wait_until(
        &self,
        timeout: Duration,
        done: impl Fn(&State<T>) -> bool,
        tick: &dyn Fn(),
    ) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            tick();
            let s = self.lock();
            if done(&s) {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            let step = if s.poll == KvPoll::Bootstrapping {
                Duration::from_millis(5).min(deadline - now)
            } else {
                deadline - now
            };
            let (s, _) = self
                .changed
                .wait_timeout(s, step)
                .unwrap_or_else(|p| p.into_inner());
            if done(&s) {
                return true;
            }
        }
    }
}
