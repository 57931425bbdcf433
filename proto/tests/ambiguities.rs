//! Places where a second implementation, written from SPEC.md alone, had to guess (issue 37,
//! SPEC §12.1 Q26): one test per decision, each naming the section of the SPEC body that now
//! states it. The TCP stream's decisions are pinned in `src/transport/tcp/reader/tests.rs`.

use std::time::{Duration, Instant};

use kvwire_proto::admission::Request;
use kvwire_proto::auth::{AuthChannel, AuthError, Nonce, OpenError, Psk};
use kvwire_proto::handshake::{Established, Handshake, HandshakeError};
use kvwire_proto::receiver::{
    ReceiverAction, ReceiverConfig, ReceiverEvent, ReceiverSession, ReservationRequest,
};
use kvwire_proto::sender::{SenderAction, SenderConfig, SenderEvent, SenderSession, WriteOutcome};
use kvwire_proto::wire::{
    Abort, DecodeError, Digest128, ErrorCode, Frame, FrameType, HelloReject, Nack, Role,
    TransferDigests, TransferId, TransferRef, MAX_AUX, NONE_INDEX, TRAILER_LEN,
};
use kvwire_proto::{FailureReason, Scope};

mod common;
use common::*;

fn abort(t: TransferRef, code: ErrorCode) -> Frame {
    Frame::Abort(Abort {
        transfer: t,
        code,
        completed_pages: 0,
        detail: String::new(),
    })
}

fn commit(t: TransferRef, aux: Vec<u8>) -> Frame {
    Frame::Commit(commit_of(t, aux))
}

fn admitted(id: TransferId) -> kvwire_proto::admission::Admitted {
    policy()
        .admit(Request {
            transfer_id: id,
            tokens: 32,
        })
        .unwrap()
}

/// A sender (with `config`) with one two-page transfer of [`ID`] submitted; `nonce` (if any)
/// is a RESERVE accepted at `now`, after which it is Writing with its writes and one digest
/// job posted.
fn sender_with(now: Instant, nonce: Option<u64>, config: SenderConfig) -> SenderSession {
    let mut s = SenderSession::new(&established(Role::SENDER, 0), config);
    s.submit(now, admitted(ID), vec![0, 1]).unwrap();
    if let Some(n) = nonce {
        s.handle_frame(now, Frame::Reserve(reserve_for(ID, n)))
            .unwrap();
        actions_s(&mut s);
    }
    s
}

fn sender(now: Instant, nonce: Option<u64>) -> SenderSession {
    sender_with(now, nonce, SenderConfig::default())
}

fn request(id: TransferId) -> ReservationRequest {
    reservation_request(id)
}

fn receiver_with_max_aux(now: Instant, max_aux: u32) -> (ReceiverSession, TransferRef) {
    let mut r = ReceiverSession::new(
        &established(Role::RECEIVER, max_aux),
        ReceiverConfig::default(),
        0x6b76_7769_7265_0026,
    );
    let t = r.reserve(now, request(ID)).unwrap();
    frames_r(&mut r);
    actions_r(&mut r);
    (r, t)
}

fn receiver(now: Instant) -> (ReceiverSession, TransferRef) {
    receiver_with_max_aux(now, 0)
}

fn psk() -> Psk {
    Psk::new((0x40u8..0x60).collect()).unwrap()
}

fn nonce(start: u8) -> Nonce {
    core::array::from_fn(|i| start + i as u8)
}

/// Replaces the CRC of a whole frame after an edit.
fn fix_crc(frame: &mut [u8]) {
    let n = frame.len() - TRAILER_LEN;
    let crc = crc32fast::hash(&frame[..n]);
    frame[n..].copy_from_slice(&crc.to_le_bytes());
}

/// SPEC §5.2.5 #9 (and §3.5.5, §7.3): a COMMIT whose aux record is longer than the receiver's
/// `max_aux` (but within `MAX_AUX`) is a Transfer-scope failure: NACK(ref, AUX_TOO_LARGE,
/// NONE_INDEX, NONE_INDEX), checked before the aux digest (#10) and before anything digests
/// the record; quarantine and fence, release after the fence, `Failed(AuxTooLarge)`, and no
/// ABORT. An aux length above `MAX_AUX` is not a COMMIT at all: a decode error (`TooMany`),
/// which closes the connection (§3.3, §7.2).
#[test]
fn an_aux_record_beyond_max_aux_is_nacked_aux_too_large_and_beyond_the_wire_limit_does_not_decode()
{
    let now = Instant::now();
    let (mut r, t) = receiver_with_max_aux(now, 16);
    // 17 bytes against a max_aux of 16, and an all-zero aux digest (#10): #9 answers first.
    let mut bad = commit(t, vec![0xA5; 17]);
    if let Frame::Commit(c) = &mut bad {
        c.aux_digest = Digest128::from_u128(0);
    }
    let e = r.handle_frame(now, bad).unwrap_err();
    assert_eq!(e.scope, Scope::Transfer);
    assert_eq!(
        frames_r(&mut r),
        vec![Frame::Nack(Nack {
            transfer: t,
            code: ErrorCode::AUX_TOO_LARGE,
            buffer: NONE_INDEX,
            page: NONE_INDEX,
            detail: FailureReason::AuxTooLarge { len: 17, max: 16 }.to_string(),
        })]
    );
    assert_eq!(
        actions_r(&mut r),
        vec![ReceiverAction::Quarantine(t), ReceiverAction::Fence(t)]
    );
    r.handle_fenced(now, t);
    assert_eq!(actions_r(&mut r), vec![ReceiverAction::Release(t)]);
    assert_eq!(
        events_r(&mut r),
        vec![ReceiverEvent::Failed {
            transfer: t,
            reason: FailureReason::AuxTooLarge { len: 17, max: 16 },
        }]
    );
    assert!(frames_r(&mut r).is_empty(), "an ABORT after the NACK");

    // Exactly max_aux passes the check (the receiver fences to verify).
    let (mut r, t) = receiver_with_max_aux(now, 16);
    r.handle_frame(now, commit(t, vec![0xA5; 16])).unwrap();
    assert!(frames_r(&mut r).is_empty());
    assert_eq!(actions_r(&mut r), vec![ReceiverAction::Fence(t)]);

    // Above MAX_AUX the frame does not decode: the aux length is judged before the bytes
    // it announces are looked for.
    let mut bytes = commit(tref(9), vec![]).to_bytes().unwrap();
    let at = bytes.len() - TRAILER_LEN - 4; // the aux length of an empty aux record
    bytes[at..at + 4].copy_from_slice(&(MAX_AUX as u32 + 1).to_le_bytes());
    fix_crc(&mut bytes);
    assert_eq!(
        Frame::decode(&bytes),
        Err(DecodeError::TooMany {
            field: "aux",
            count: MAX_AUX as u64 + 1,
            max: MAX_AUX as u64,
        })
    );
}

/// SPEC §3.11 ("Precedence during the handshake"): on a node with authentication on, the
/// header and CRC (§3.3 steps 1–7) are judged first, then authentication, and only then the
/// inner type (step 8) and the handshake's own rules (§4.2). So an unsealed first frame other
/// than HELLO_REJECT — an unflagged HELLO, a frame §4.2 alone would call `Unexpected`, even a
/// type no version defines — is answered HELLO_REJECT(AUTH_MISMATCH); a sealed frame before
/// the keys exist, HELLO_REJECT(AUTH_FAILED); another version, HELLO_REJECT(VERSION_MISMATCH)
/// (a decode error, before authentication); an unflagged HELLO_REJECT passes authentication
/// and the handshake then judges it (a server: `Unexpected`, nothing sent).
#[test]
fn an_unsealed_first_frame_is_refused_by_authentication_before_the_handshake_judges_it() {
    let now = Instant::now();
    let timeout = Duration::from_secs(5);
    let server = || {
        (
            AuthChannel::server(psk(), nonce(0xa0)),
            Handshake::server(now, hello(Role::RECEIVER, 0), timeout).with_confirmation(),
        )
    };
    /// Opens `bytes` as the first frame and runs the handshake on the result, as a driver
    /// does (src/transport/stream.rs); returns the reply and the outcome.
    fn first_frame(
        (mut ch, mut hs): (AuthChannel, Handshake),
        bytes: &[u8],
    ) -> (Option<Frame>, Option<Result<Established, HandshakeError>>) {
        match ch.open(bytes) {
            Ok((f, _)) => hs.handle_frame(f),
            Err(OpenError::Auth(e)) => hs.handle_auth_error(&e),
            Err(OpenError::Decode(DecodeError::UnsupportedVersion(v))) => {
                hs.handle_unsupported_version(v)
            }
            Err(e) => panic!("{e}"),
        }
        let reply = hs.poll_transmit();
        (reply, hs.poll_outcome())
    }
    let refused_with = |(reply, outcome): (Option<Frame>, _), code: ErrorCode| {
        let Some(Frame::HelloReject(r)) = reply else {
            panic!("no HELLO_REJECT: {reply:?}");
        };
        assert_eq!(r.code, code, "{}", r.detail);
        assert_eq!(outcome, Some(Err(HandshakeError::Refused(r))));
    };

    let plain_hello = Frame::Hello(hello(Role::SENDER, 0)).to_bytes().unwrap();
    assert_eq!(
        server().0.open(&plain_hello),
        Err(OpenError::Auth(AuthError::Missing {
            frame_type: FrameType::HELLO
        }))
    );
    refused_with(
        first_frame(server(), &plain_hello),
        ErrorCode::AUTH_MISMATCH,
    );
    // A frame the unauthenticated handshake would call Unexpected (nothing sent).
    let plain_reserve = Frame::Reserve(reserve_for(ID, 9)).to_bytes().unwrap();
    refused_with(
        first_frame(server(), &plain_reserve),
        ErrorCode::AUTH_MISMATCH,
    );
    // A type no version defines: authentication (unflagged) comes before step 8.
    let mut unknown = Frame::Ping(1).to_bytes().unwrap();
    unknown[6..8].copy_from_slice(&0x0099u16.to_le_bytes());
    fix_crc(&mut unknown);
    assert!(matches!(
        AuthChannel::off().open(&unknown),
        Err(OpenError::Decode(DecodeError::UnknownFrameType(_)))
    ));
    refused_with(first_frame(server(), &unknown), ErrorCode::AUTH_MISMATCH);
    // A sealed frame before the keys exist (a HELLO_CONFIRM of another connection).
    let confirm = {
        let mut c = AuthChannel::client(psk(), nonce(0xc0));
        let mut s = AuthChannel::server(psk(), nonce(0xb0));
        let hello_bytes = c
            .seal_to_vec(&Frame::Hello(hello(Role::SENDER, 0)))
            .unwrap();
        s.open(&hello_bytes).unwrap();
        let ack = s
            .seal_to_vec(&Frame::HelloAck(hello(Role::RECEIVER, 0)))
            .unwrap();
        c.open(&ack).unwrap();
        c.seal_to_vec(&Frame::HelloConfirm).unwrap()
    };
    refused_with(first_frame(server(), &confirm), ErrorCode::AUTH_FAILED);
    // Another version: a decode error (§3.3 step 4), before authentication.
    let mut v1 = plain_hello.clone();
    v1[4..6].copy_from_slice(&1u16.to_le_bytes());
    refused_with(first_frame(server(), &v1), ErrorCode::VERSION_MISMATCH);
    // An unflagged HELLO_REJECT passes authentication; the server's handshake refuses it
    // as Unexpected and sends nothing.
    let reject = Frame::HelloReject(HelloReject {
        code: ErrorCode::SHUTDOWN,
        detail: String::new(),
    })
    .to_bytes()
    .unwrap();
    let (reply, outcome) = first_frame(server(), &reject);
    assert_eq!(reply, None);
    assert!(matches!(outcome, Some(Err(HandshakeError::Unexpected(_)))));
}

/// SPEC §4.2 ("When the handshake ends"): without authentication each side's first frame
/// received ends its handshake — the server is established once its HELLO_ACK is taken for
/// transmission, the client once it accepted HELLO_ACK. With authentication the client is
/// established once it accepted HELLO_ACK and its HELLO_CONFIRM is taken for transmission;
/// the server's accepted HELLO does not end its handshake (HELLO_ACK sent, AwaitingConfirm,
/// deadline still running, no outcome), its second frame does: HELLO_CONFIRM establishes it,
/// HELLO_REJECT is the client's refusal. Input after the end is ignored by the handshake.
#[test]
fn each_side_is_established_at_a_stated_frame_with_and_without_authentication() {
    let now = Instant::now();
    let timeout = Duration::from_secs(5);
    let pair = |auth: bool| {
        let mut c = Handshake::client(now, hello(Role::SENDER, 0), timeout);
        let mut s = Handshake::server(now, hello(Role::RECEIVER, 0), timeout);
        if auth {
            c = c.with_confirmation();
            s = s.with_confirmation();
        }
        (c, s)
    };

    // Unauthenticated: two frames.
    let (mut c, mut s) = pair(false);
    let hello_frame = c.poll_transmit().expect("HELLO");
    s.handle_frame(hello_frame.clone());
    assert!(
        s.poll_outcome().is_none(),
        "outcome before HELLO_ACK was taken"
    );
    let ack = s.poll_transmit().expect("HELLO_ACK");
    assert!(matches!(s.poll_outcome(), Some(Ok(_))));
    assert_eq!(s.poll_timeout(), None);
    c.handle_frame(ack);
    assert_eq!(
        c.poll_transmit(),
        None,
        "a HELLO_CONFIRM without authentication"
    );
    assert!(matches!(c.poll_outcome(), Some(Ok(_))));
    // Ended: a second HELLO reaches the handshake no more (the session judges such frames,
    // §7.3).
    s.handle_frame(hello_frame);
    assert_eq!((s.poll_transmit(), s.poll_outcome()), (None, None));

    // Authenticated: three frames.
    let (mut c, mut s) = pair(true);
    s.handle_frame(c.poll_transmit().expect("HELLO"));
    let ack = s.poll_transmit().expect("HELLO_ACK");
    assert!(
        s.poll_outcome().is_none(),
        "established before HELLO_CONFIRM"
    );
    assert_eq!(s.poll_timeout(), Some(now + timeout));
    c.handle_frame(ack.clone());
    assert!(
        c.poll_outcome().is_none(),
        "outcome before HELLO_CONFIRM was taken"
    );
    assert_eq!(c.poll_transmit(), Some(Frame::HelloConfirm));
    assert!(matches!(c.poll_outcome(), Some(Ok(_))));
    s.handle_frame(Frame::HelloConfirm);
    assert_eq!(s.poll_transmit(), None);
    assert!(matches!(s.poll_outcome(), Some(Ok(_))));
    assert_eq!(s.poll_timeout(), None);

    // Authenticated server, HELLO_REJECT as its second frame: refused by the client.
    let (mut c, mut s) = pair(true);
    s.handle_frame(c.poll_transmit().expect("HELLO"));
    s.poll_transmit().expect("HELLO_ACK");
    let no = HelloReject {
        code: ErrorCode::NO_COMMON_DIGEST,
        detail: "x".into(),
    };
    s.handle_frame(Frame::HelloReject(no.clone()));
    assert_eq!(s.poll_transmit(), None);
    assert_eq!(
        s.poll_outcome(),
        Some(Err(HandshakeError::RefusedByPeer(no)))
    );
}

/// SPEC §3.5.7: a NACK's code is not limited to the verification codes. A receiver repeats
/// the outcome of a finished reservation with the code it failed with (here TIMEOUT, after
/// its commit deadline and an ABORT nobody acknowledged); a sender treats every matching NACK
/// alike whatever its code — known, listed for other frames, or unknown (0xbeef): the receiver
/// did not deliver; source released, `Failed(Nacked)` keeping the code as it came (§3.10),
/// nothing sent, not retryable.
#[test]
fn a_nack_fails_the_committed_transfer_alike_whatever_its_code() {
    let now = Instant::now();
    // The receiver: NACK(TIMEOUT) for the COMMIT of a reservation that timed out.
    let (mut r, t) = receiver(now);
    r.handle_timeout(now + Duration::from_secs(1));
    r.handle_fenced(now, t);
    assert!(matches!(
        &frames_r(&mut r)[..],
        [Frame::Abort(a)] if a.code == ErrorCode::TIMEOUT
    ));
    r.handle_timeout(now + Duration::from_secs(7)); // the abort-ack deadline (5 s) passed
    assert_eq!(r.open_transfers(), 0);
    let _ = r.handle_frame(now, commit(t, vec![]));
    assert!(matches!(
        &frames_r(&mut r)[..],
        [Frame::Nack(n)] if n.code == ErrorCode::TIMEOUT && n.transfer == t
    ));

    // The sender: the same treatment for every code.
    for code in [
        ErrorCode::DIGEST_MISMATCH,
        ErrorCode::TIMEOUT,
        ErrorCode::CANCELLED,
        ErrorCode(0xbeef),
    ] {
        let mut s = sender(now, Some(9));
        s.handle_write_outcome(now, tref(9), WriteOutcome::Completed, 2);
        s.handle_digests(now, tref(9), TransferDigests::default());
        assert!(matches!(&frames_s(&mut s)[..], [Frame::Commit(_)]));
        actions_s(&mut s);
        s.handle_frame(
            now,
            Frame::Nack(Nack {
                transfer: tref(9),
                code,
                buffer: NONE_INDEX,
                page: 1,
                detail: String::new(),
            }),
        )
        .unwrap();
        assert!(frames_s(&mut s).is_empty(), "{code}: a frame in answer");
        assert_eq!(actions_s(&mut s), vec![SenderAction::ReleaseSource(ID)]);
        let reason = FailureReason::Nacked {
            code,
            buffer: None,
            page: Some(1),
        };
        assert!(!reason.is_retryable());
        assert_eq!(reason.code(), code);
        assert_eq!(
            events_s(&mut s),
            vec![SenderEvent::Failed {
                transfer: tref(9),
                reason
            }]
        );
        assert_eq!(s.open_transfers(), 0);
    }
    assert!(format!("{}", ErrorCode(0xbeef)).contains("Unknown(0xbeef)"));
}

/// SPEC §5.1 (PARKED_LIMIT): the refusal leaves nothing on the sender (no history entry, no
/// announcement), so a later RESERVE of the id, with a fresh nonce, is judged as if the first
/// had never come: refused again while the parked reservations are still `max_parked`, served
/// once the engine has submitted the request. On the receiver the refusal is an ordinary
/// REJECT (fence, release, `Failed(Rejected)`), retryable, and the id may be reserved again.
#[test]
fn after_parked_limit_the_receiver_may_reserve_again_and_the_sender_judges_it_afresh() {
    let now = Instant::now();
    let other = TransferId(2);
    let mut s = SenderSession::new(
        &established(Role::SENDER, 0),
        SenderConfig {
            max_parked: 1,
            ..SenderConfig::default()
        },
    );
    s.handle_frame(now, Frame::Reserve(reserve_for(other, 5)))
        .unwrap();
    assert!(frames_s(&mut s).is_empty(), "the first one is parked");
    events_s(&mut s);
    for n in [9, 10] {
        s.handle_frame(now, Frame::Reserve(reserve_for(ID, n)))
            .unwrap();
        assert!(matches!(
            &frames_s(&mut s)[..],
            [Frame::Reject(r)] if r.code == ErrorCode::PARKED_LIMIT && r.transfer == tref(n)
        ));
        assert!(events_s(&mut s).is_empty(), "the refused id was announced");
    }
    // The engine submits the request: the next reservation is served, not refused from a
    // history.
    s.submit(now, admitted(ID), vec![0, 1]).unwrap();
    s.handle_frame(now, Frame::Reserve(reserve_for(ID, 11)))
        .unwrap();
    assert!(frames_s(&mut s).is_empty());
    assert!(actions_s(&mut s)
        .iter()
        .any(|a| matches!(a, SenderAction::PostWrites { .. })));

    let (mut r, t) = receiver(now);
    r.handle_frame(
        now,
        Frame::Reject(kvwire_proto::wire::Reject {
            transfer: t,
            code: ErrorCode::PARKED_LIMIT,
            detail: String::new(),
        }),
    )
    .unwrap();
    assert_eq!(
        actions_r(&mut r),
        vec![ReceiverAction::Quarantine(t), ReceiverAction::Fence(t)]
    );
    r.handle_fenced(now, t);
    let [ReceiverEvent::Failed { reason, .. }] = &events_r(&mut r)[..] else {
        panic!("no failure");
    };
    assert_eq!(reason.code(), ErrorCode::PARKED_LIMIT);
    assert!(reason.is_retryable());
    let again = r.reserve(now, request(ID)).unwrap();
    assert_ne!(again.nonce, t.nonce);
    assert!(matches!(
        &frames_r(&mut r)[..],
        [Frame::Reserve(x)] if x.nonce == again.nonce
    ));
}

/// SPEC §9.1 ("Joining"): the frame decoder knows one magic. A join record where a frame is
/// expected — a stream joining a server that runs one stream, which does not look for
/// `KVJN` — is `BadMagic`, reported as soon as its third byte differs from `KVWR`, before and
/// whatever authentication: the handshake fails as on any decode error (nothing is sent, the
/// stream is closed, §4.2, §7.2).
#[test]
fn a_join_record_where_a_frame_is_expected_is_a_bad_magic() {
    let mut join = b"KVJN".to_vec();
    join.extend_from_slice(&1u16.to_le_bytes()); // lane 1
    join.extend_from_slice(&2u16.to_le_bytes()); // of 2 streams
    join.extend_from_slice(&[0x5a; 16]); // token
    assert_eq!(Frame::decode(&join), Err(DecodeError::BadMagic(*b"KVJN")));
    assert_eq!(
        Frame::decode(&join[..3]),
        Err(DecodeError::BadMagic(*b"KVJ\0"))
    );
    assert_eq!(
        Frame::decode(&join[..2]),
        Err(DecodeError::Incomplete { needed: 12 })
    );
    assert_eq!(
        AuthChannel::server(psk(), nonce(0xa0)).open(&join),
        Err(OpenError::Decode(DecodeError::BadMagic(*b"KVJN")))
    );
}

/// SPEC §3.5.9: an ABORT_ACK carries the ABORT's TransferRef, except where a receiver matched
/// a nonce-0 ABORT to its open reservation: then its current one. A sender in
/// AwaitingReservation (current nonce 0) matches exactly the nonce-0 ABORT, a receiver's
/// refusal: ABORT_ACK(id, 0), source released, `Failed(PeerAbort)`; an ABORT with another
/// nonce names a reservation it never accepted: ABORT_ACK echoing it, the transfer unchanged.
/// A receiver drops an ABORT_ACK with nonce 0, whatever is open for the id.
#[test]
fn abort_ack_nonces_and_what_a_sender_awaiting_its_reservation_matches() {
    let now = Instant::now();
    let mut refusing = ReceiverSession::new(
        &established(Role::RECEIVER, 0),
        ReceiverConfig::default(),
        7,
    );
    assert!(refusing.refuse(ID, ErrorCode::PROMPT_EXCEEDS_POOL, String::new()));
    let refusal = frames_r(&mut refusing);
    assert!(matches!(&refusal[..], [Frame::Abort(a)] if a.transfer == tref(0)));

    let mut s = sender(now, None);
    s.handle_frame(now, abort(tref(77), ErrorCode::TIMEOUT))
        .unwrap();
    assert_eq!(frames_s(&mut s), vec![Frame::AbortAck(tref(77))]);
    assert!(actions_s(&mut s).is_empty() && events_s(&mut s).is_empty());
    assert_eq!(s.open_transfers(), 1);
    s.handle_frame(now, refusal[0].clone()).unwrap();
    let ack = frames_s(&mut s);
    assert_eq!(ack, vec![Frame::AbortAck(tref(0))]);
    assert_eq!(actions_s(&mut s), vec![SenderAction::ReleaseSource(ID)]);
    assert_eq!(
        events_s(&mut s),
        vec![SenderEvent::Failed {
            transfer: tref(0),
            reason: FailureReason::PeerAbort {
                code: ErrorCode::PROMPT_EXCEEDS_POOL,
                completed_pages: 0,
            },
        }]
    );

    // The nonce-0 ABORT_ACK changes nothing on a receiver, also with the id reserved now.
    refusing.handle_frame(now, ack[0].clone()).unwrap();
    let t = refusing.reserve(now, request(ID)).unwrap();
    frames_r(&mut refusing);
    actions_r(&mut refusing);
    refusing.handle_frame(now, ack[0].clone()).unwrap();
    assert!(frames_r(&mut refusing).is_empty() && actions_r(&mut refusing).is_empty());
    assert_eq!(refusing.open_transfers(), 1);

    // A receiver matching a nonce-0 ABORT acknowledges with its current nonce.
    refusing
        .handle_frame(now, abort(tref(0), ErrorCode::CANCELLED))
        .unwrap();
    refusing.handle_fenced(now, t);
    assert_eq!(frames_r(&mut refusing), vec![Frame::AbortAck(t)]);
    let (mut r, t) = receiver(now);
    r.handle_frame(now, abort(t, ErrorCode::CANCELLED)).unwrap();
    r.handle_fenced(now, t);
    assert_eq!(frames_r(&mut r), vec![Frame::AbortAck(t)]);
}
