//! Fixtures the protocol's tests share (`spec_rules.rs`, `ambiguities.rs`, `sessions.rs`,
//! `bad_input.rs`): one layout, a connection as either role sees it, the admission policy, a
//! reservation, the COMMIT that matches it, and drains of a session's outputs. Each test binary
//! uses some of them.
#![allow(dead_code)]

use kvwire_proto::admission::AdmissionPolicy;
use kvwire_proto::handshake::Established;
use kvwire_proto::receiver::{ReceiverAction, ReceiverEvent, ReceiverSession, ReservationRequest};
use kvwire_proto::sender::{SenderAction, SenderEvent, SenderSession};
use kvwire_proto::wire::{
    Commit, Digest128, DigestAlgorithm, Frame, Hello, KvLayout, Reserve, Role, TransferId,
    TransferRef,
};

pub const ID: TransferId = TransferId(1);

pub fn layout() -> KvLayout {
    KvLayout {
        tokens_per_page: 16,
        buffer_page_bytes: vec![4096],
        fingerprint: b"m".to_vec(),
    }
}

pub fn hello(role: Role, max_aux: u32) -> Hello {
    Hello {
        node_id: 1,
        role,
        layout: layout(),
        digests: vec![DigestAlgorithm::XXH3_64],
        transport_params: vec![],
        max_aux,
    }
}

/// A connection as `role` sees it; the receiver's `max_aux` is `max_aux` (the sender's 0).
pub fn established(role: Role, max_aux: u32) -> Established {
    let (local, peer) = if role == Role::SENDER {
        (hello(Role::SENDER, 0), hello(Role::RECEIVER, max_aux))
    } else {
        (hello(Role::RECEIVER, max_aux), hello(Role::SENDER, 0))
    };
    Established {
        local,
        peer,
        digests: vec![DigestAlgorithm::XXH3_64],
    }
}

pub fn policy() -> AdmissionPolicy {
    AdmissionPolicy {
        tokens_per_page: 16,
        pool_pages: 64,
        max_context_tokens: 1024,
    }
}

pub fn reserve_for(id: TransferId, nonce: u64) -> Reserve {
    Reserve {
        transfer_id: id,
        nonce,
        tokens: 32,
        digest: DigestAlgorithm::XXH3_64,
        page_digests: false,
        deadline_ms: 1000,
        pages: vec![5, 6],
        access: vec![],
    }
}

/// A receiver's request to reserve pages 3 and 4 for 32 tokens of `id` (1 s to deliver).
pub fn reservation_request(id: TransferId) -> ReservationRequest {
    ReservationRequest {
        transfer_id: id,
        tokens: 32,
        pages: vec![3, 4],
        digest: None,
        page_digests: false,
        timeout: std::time::Duration::from_secs(1),
        access: vec![],
    }
}

/// The COMMIT of a reservation of two 4 KiB pages (32 tokens, one buffer) with `aux`, its
/// buffer digest 5 and aux digest 6 (whatever the pages hold: tests that verify supply their
/// own digests).
pub fn commit_of(t: TransferRef, aux: Vec<u8>) -> Commit {
    Commit {
        transfer: t,
        tokens: 32,
        pages: 2,
        bytes: 2 * 4096,
        digest: DigestAlgorithm::XXH3_64,
        buffer_digests: vec![Digest128::from_u128(5)],
        page_digests: vec![],
        aux_digest: Digest128::from_u128(6),
        aux,
    }
}

pub fn tref(nonce: u64) -> TransferRef {
    TransferRef {
        transfer_id: ID,
        nonce,
    }
}

pub fn frames_s(s: &mut SenderSession) -> Vec<Frame> {
    std::iter::from_fn(|| s.poll_transmit()).collect()
}

pub fn frames_r(r: &mut ReceiverSession) -> Vec<Frame> {
    std::iter::from_fn(|| r.poll_transmit()).collect()
}

pub fn actions_s(s: &mut SenderSession) -> Vec<SenderAction> {
    std::iter::from_fn(|| s.poll_action()).collect()
}

pub fn actions_r(r: &mut ReceiverSession) -> Vec<ReceiverAction> {
    std::iter::from_fn(|| r.poll_action()).collect()
}

pub fn events_s(s: &mut SenderSession) -> Vec<SenderEvent> {
    std::iter::from_fn(|| s.poll_event()).collect()
}

pub fn events_r(r: &mut ReceiverSession) -> Vec<ReceiverEvent> {
    std::iter::from_fn(|| r.poll_event()).collect()
}
