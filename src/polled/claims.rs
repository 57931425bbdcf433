//! Which requests have a sender on a manager (a second admission of one is refused at
//! `init`), and what a prefill's sender needs of its node before a decode named its request.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvwire_proto::wire::{ErrorCode, TransferId};

use super::{Conn, Error, Manager};

impl Manager {
    /// Claims request `room` to `peer` (`None`: routed by the decode) for one sender of
    /// this manager: a second claim while the first is held is refused
    /// ([`ErrorKind::InvalidState`](super::ErrorKind::InvalidState)): a duplicate admission.
    pub(super) fn claim_room(
        &self,
        room: TransferId,
        peer: Option<u64>,
    ) -> Result<RoomClaim, Error> {
        let key = (room, peer);
        let mut claimed = self.inner.claimed.lock().unwrap_or_else(|p| p.into_inner());
        if !claimed.insert(key) {
            return Err(Error::state(format!(
                "request {} was already admitted on this node (a duplicate admission)",
                room.0
            )));
        }
        Ok(RoomClaim {
            claimed: self.inner.claimed.clone(),
            key,
        })
    }

    /// Cancels request `room` (`tokens` tokens) on every decode connected now, for a
    /// prefill that gives it up before any decode named it: whichever decode reserves it
    /// gets REJECT(CANCELLED) at once (each connection remembers the cancelled id).
    pub(super) fn cancel_everywhere(&self, room: TransferId, tokens: u32) {
        let conns: Vec<Conn> = self
            .inner
            .peers
            .lock()
            .conns
            .iter()
            .map(|(_, c)| c.clone())
            .collect();
        for c in conns {
            if let Conn::Sender(c) = c {
                let req = kvwire_proto::admission::Request {
                    transfer_id: room,
                    tokens: tokens.into(),
                };
                if let Ok(admitted) = c.admit(req) {
                    c.open(admitted).abort(ErrorCode::CANCELLED);
                }
            }
        }
    }

    /// The node's admission policy (its pool, context length and page size).
    pub(super) fn admission(&self) -> kvwire_proto::admission::AdmissionPolicy {
        self.inner.node.admission_policy()
    }

    /// How long a prefill's request waits for its decode's reservation.
    pub(super) fn reservation_wait(&self) -> Duration {
        self.inner.node.config().sender.reservation_timeout
    }
}

/// The requests (with their peer, `None` when routed by the decode) that have a sender on a
/// manager.
pub(super) type Claimed = Arc<Mutex<HashSet<(TransferId, Option<u64>)>>>;

/// A request id claimed by one transfer of a manager, until dropped.
#[derive(Debug)]
pub(super) struct RoomClaim {
    claimed: Claimed,
    key: (TransferId, Option<u64>),
}

impl Drop for RoomClaim {
    fn drop(&mut self) {
        self.claimed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.key);
    }
}
