//! Connection handshake tests: HELLO / HELLO_ACK / HELLO_REJECT between a client and a
//! server machine, every mismatch class, timeouts, versions, unexpected frames, peer loss.
//!
//! Frames travel between the two machines through the real codec (encode, then decode), as
//! a driver would move them.

use kvwire_proto::wire::TransferId;
use std::time::{Duration, Instant};

use kvwire_proto::handshake::{check_peer, version_reject, Established, Handshake, HandshakeError};
use kvwire_proto::wire::{
    DecodeError, DigestAlgorithm, ErrorCode, Frame, FrameType, Hello, HelloReject, KvLayout,
    Reserve, Role, TransferRef, VERSION,
};

const TIMEOUT: Duration = Duration::from_secs(5);

fn layout() -> KvLayout {
    KvLayout {
        tokens_per_page: 16,
        buffer_page_bytes: vec![65_536, 32_768, 16_384],
        fingerprint: vec![0xAA, 0xBB, 0x01],
    }
}

fn sender() -> Hello {
    Hello {
        node_id: 0x5E,
        role: Role::SENDER,
        layout: layout(),
        digests: vec![DigestAlgorithm::XXH3_64, DigestAlgorithm::CRC32],
        transport_params: vec![1, 2, 3],
        max_aux: 0,
    }
}

fn receiver() -> Hello {
    Hello {
        node_id: 0x8E,
        role: Role::RECEIVER,
        layout: layout(),
        digests: vec![DigestAlgorithm::CRC32, DigestAlgorithm::XXH3_64],
        transport_params: vec![],
        max_aux: 4096,
    }
}

/// Moves a frame through the codec, as the wire would.
fn wire(frame: Frame) -> Frame {
    let bytes = frame.to_bytes().expect("encodes");
    let (decoded, n) = Frame::decode(&bytes).expect("decodes");
    assert_eq!(n, bytes.len());
    assert_eq!(decoded, frame);
    decoded
}

/// The client's HELLO, taken from a fresh client machine.
fn client_hello(client: &mut Handshake) -> Frame {
    let hello = client.poll_transmit().expect("client sends HELLO first");
    assert!(matches!(hello, Frame::Hello(_)), "{hello:?}");
    assert!(client.poll_transmit().is_none());
    assert!(client.poll_outcome().is_none());
    wire(hello)
}

/// Runs a server against `client_local`, returning the server's reply and outcome.
fn server_answers(
    server_local: Hello,
    client_local: Hello,
) -> (Option<Frame>, Result<Established, HandshakeError>) {
    let now = Instant::now();
    let mut client = Handshake::client(now, client_local, TIMEOUT);
    let mut server = Handshake::server(now, server_local, TIMEOUT);
    assert!(server.poll_transmit().is_none(), "the server speaks second");
    server.handle_frame(client_hello(&mut client));
    // The outcome waits until the reply has been taken.
    assert!(server.poll_outcome().is_none());
    let reply = server.poll_transmit().map(wire);
    let outcome = server.poll_outcome().expect("server outcome");
    assert!(
        server.poll_outcome().is_none(),
        "the outcome is reported once"
    );
    (reply, outcome)
}

/// Asserts the server refused with `code` and sent the same HELLO_REJECT; returns the detail.
fn assert_server_refuses(server_local: Hello, client_local: Hello, code: ErrorCode) -> String {
    // `check_peer` agrees with the machine.
    let direct = check_peer(&server_local, &client_local).expect_err("check_peer refuses");
    assert_eq!(direct.code, code, "{}", direct.detail);

    let (reply, outcome) = server_answers(server_local, client_local);
    let Some(Frame::HelloReject(sent)) = reply else {
        panic!("expected a HELLO_REJECT, got {reply:?}");
    };
    assert_eq!(sent.code, code, "{}", sent.detail);
    assert_eq!(outcome, Err(HandshakeError::Refused(sent.clone())));
    assert_eq!(sent, direct);
    sent.detail
}

fn assert_names(detail: &str, values: &[&str]) {
    for v in values {
        assert!(detail.contains(v), "detail {detail:?} does not name {v:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// Success.

#[test]
fn handshake_succeeds_with_common_digests_in_local_order() {
    let now = Instant::now();
    let mut client = Handshake::client(now, sender(), TIMEOUT);
    let mut server = Handshake::server(now, receiver(), TIMEOUT);
    assert_eq!(client.poll_timeout(), Some(now + TIMEOUT));
    assert_eq!(server.poll_timeout(), Some(now + TIMEOUT));

    server.handle_frame(client_hello(&mut client));
    let ack = server.poll_transmit().expect("HELLO_ACK");
    assert_eq!(ack, Frame::HelloAck(receiver()));
    let server_done = server
        .poll_outcome()
        .expect("server outcome")
        .expect("server accepts");
    assert_eq!(server_done.local, receiver());
    assert_eq!(server_done.peer, sender());
    assert_eq!(
        server_done.digests,
        vec![DigestAlgorithm::CRC32, DigestAlgorithm::XXH3_64]
    );
    assert_eq!(server_done.layout(), &layout());
    assert_eq!(server.poll_timeout(), None, "no timer once done");

    client.handle_frame(wire(ack));
    assert!(
        client.poll_transmit().is_none(),
        "nothing to send on success"
    );
    let client_done = client
        .poll_outcome()
        .expect("client outcome")
        .expect("client accepts");
    assert_eq!(client_done.local, sender());
    assert_eq!(client_done.peer, receiver());
    assert_eq!(
        client_done.digests,
        vec![DigestAlgorithm::XXH3_64, DigestAlgorithm::CRC32]
    );
    assert_eq!(client.poll_timeout(), None);
    assert!(
        client.poll_outcome().is_none(),
        "the outcome is reported once"
    );
}

#[test]
fn receiver_may_be_the_client() {
    let now = Instant::now();
    let mut client = Handshake::client(now, receiver(), TIMEOUT);
    let mut server = Handshake::server(now, sender(), TIMEOUT);
    server.handle_frame(client_hello(&mut client));
    let ack = server.poll_transmit().expect("HELLO_ACK");
    assert!(server.poll_outcome().unwrap().is_ok());
    client.handle_frame(wire(ack));
    let done = client.poll_outcome().unwrap().unwrap();
    assert_eq!(done.peer.role, Role::SENDER);
    assert_eq!(
        done.digests,
        vec![DigestAlgorithm::CRC32, DigestAlgorithm::XXH3_64]
    );
}

#[test]
fn common_digests_exclude_what_either_side_lacks() {
    let mut local = sender();
    local.digests = vec![
        DigestAlgorithm(0x42),
        DigestAlgorithm::CRC32,
        DigestAlgorithm::XXH3_64,
    ];
    let mut peer = receiver();
    peer.digests = vec![DigestAlgorithm::CRC32, DigestAlgorithm(0x42)];
    assert_eq!(check_peer(&local, &peer), Ok(vec![DigestAlgorithm::CRC32]));
}

// ---------------------------------------------------------------------------------------------
// Mismatches: each refused with the right code and a detail naming both values.

#[test]
fn both_senders_is_a_role_mismatch() {
    let detail = assert_server_refuses(sender(), sender(), ErrorCode::ROLE_MISMATCH);
    assert!(
        detail.matches("SENDER").count() >= 2,
        "detail {detail:?} names both roles"
    );
}

#[test]
fn both_receivers_is_a_role_mismatch() {
    let detail = assert_server_refuses(receiver(), receiver(), ErrorCode::ROLE_MISMATCH);
    assert!(detail.matches("RECEIVER").count() >= 2, "{detail:?}");
}

#[test]
fn unknown_peer_role_is_a_role_mismatch() {
    let mut peer = sender();
    peer.role = Role(9);
    let detail = assert_server_refuses(receiver(), peer, ErrorCode::ROLE_MISMATCH);
    assert_names(&detail, &["RECEIVER", "Unknown(0x9)"]);
}

/// ErrorCode::ROLE_MISMATCH is documented as "both peers claim the same role, or a role is
/// unknown", the local role included. Regression: `check_peer` once treated any local role
/// other than SENDER as RECEIVER and accepted a SENDER peer.
#[test]
fn unknown_local_role_is_a_role_mismatch() {
    let mut local = receiver();
    local.role = Role(9);
    let detail = assert_server_refuses(local, sender(), ErrorCode::ROLE_MISMATCH);
    assert_names(&detail, &["Unknown(0x9)", "SENDER"]);
}

#[test]
fn tokens_per_page_mismatch() {
    let mut peer = sender();
    peer.layout.tokens_per_page = 48;
    let detail = assert_server_refuses(receiver(), peer, ErrorCode::LAYOUT_MISMATCH);
    assert_names(&detail, &["16", "48"]);
}

#[test]
fn buffer_count_mismatch() {
    let mut peer = sender();
    peer.layout.buffer_page_bytes.push(8192);
    let detail = assert_server_refuses(receiver(), peer, ErrorCode::LAYOUT_MISMATCH);
    assert_names(&detail, &["3", "4"]);

    let mut peer = sender();
    peer.layout.buffer_page_bytes.clear();
    // A peer with no buffers is refused as degenerate before counts are compared.
    let detail = assert_server_refuses(receiver(), peer, ErrorCode::LAYOUT_MISMATCH);
    assert_names(&detail, &["peer", "degenerate"]);
}

#[test]
fn buffer_bytes_per_page_mismatch_names_the_buffer() {
    let mut peer = sender();
    peer.layout.buffer_page_bytes[1] = 12_345;
    let detail = assert_server_refuses(receiver(), peer, ErrorCode::LAYOUT_MISMATCH);
    assert_names(&detail, &["buffer 1", "32768", "12345"]);

    // Several differ: the first is named.
    let mut peer = sender();
    peer.layout.buffer_page_bytes[2] = 1;
    peer.layout.buffer_page_bytes[0] = 2;
    let detail = assert_server_refuses(receiver(), peer, ErrorCode::LAYOUT_MISMATCH);
    assert_names(&detail, &["buffer 0", "65536", "2"]);
}

#[test]
fn fingerprint_mismatch() {
    let mut peer = sender();
    peer.layout.fingerprint = vec![0xCC, 0xDD];
    let detail = assert_server_refuses(receiver(), peer, ErrorCode::FINGERPRINT_MISMATCH);
    assert_names(&detail, &["aabb01", "ccdd"]);

    // An empty fingerprint is still named.
    let mut peer = sender();
    peer.layout.fingerprint.clear();
    let detail = assert_server_refuses(receiver(), peer, ErrorCode::FINGERPRINT_MISMATCH);
    assert_names(&detail, &["aabb01"]);
}

#[test]
fn no_common_digest() {
    let mut local = receiver();
    local.digests = vec![DigestAlgorithm::XXH3_64];
    let mut peer = sender();
    peer.digests = vec![DigestAlgorithm::CRC32];
    let detail = assert_server_refuses(local, peer, ErrorCode::NO_COMMON_DIGEST);
    assert_names(&detail, &["XXH3_64", "CRC32"]);

    // An empty list on either side.
    let mut peer = sender();
    peer.digests.clear();
    assert_server_refuses(receiver(), peer, ErrorCode::NO_COMMON_DIGEST);

    // An algorithm neither side knows is never agreed on, even when both list it.
    let mut local = receiver();
    local.digests = vec![DigestAlgorithm(0x99)];
    let mut peer = sender();
    peer.digests = vec![DigestAlgorithm(0x99)];
    let detail = assert_server_refuses(local, peer, ErrorCode::NO_COMMON_DIGEST);
    assert_names(&detail, &["Unknown(0x99)"]);
}

// ---------------------------------------------------------------------------------------------
// The client side.

#[test]
fn client_refuses_a_bad_hello_ack_and_sends_hello_reject() {
    let now = Instant::now();
    let mut client = Handshake::client(now, sender(), TIMEOUT);
    client_hello(&mut client);

    let mut server_hello = receiver();
    server_hello.layout.fingerprint = vec![0x01];
    client.handle_frame(wire(Frame::HelloAck(server_hello)));
    assert!(
        client.poll_outcome().is_none(),
        "the outcome waits for the HELLO_REJECT to be taken"
    );
    let Some(Frame::HelloReject(sent)) = client.poll_transmit().map(wire) else {
        panic!("the client must transmit HELLO_REJECT");
    };
    assert_eq!(sent.code, ErrorCode::FINGERPRINT_MISMATCH);
    assert_names(&sent.detail, &["aabb01", "01"]);
    assert_eq!(
        client.poll_outcome(),
        Some(Err(HandshakeError::Refused(sent)))
    );
    assert_eq!(client.poll_timeout(), None);
}

#[test]
fn client_refuses_a_hello_ack_with_the_same_role() {
    let now = Instant::now();
    let mut client = Handshake::client(now, sender(), TIMEOUT);
    client_hello(&mut client);
    client.handle_frame(wire(Frame::HelloAck(sender())));
    let Some(Frame::HelloReject(sent)) = client.poll_transmit() else {
        panic!("the client must transmit HELLO_REJECT");
    };
    assert_eq!(sent.code, ErrorCode::ROLE_MISMATCH);
    assert!(matches!(
        client.poll_outcome(),
        Some(Err(HandshakeError::Refused(_)))
    ));
}

#[test]
fn client_refused_by_the_server() {
    let now = Instant::now();
    let mut client = Handshake::client(now, sender(), TIMEOUT);
    let mut server_hello = receiver();
    server_hello.layout.tokens_per_page = 32;
    let mut server = Handshake::server(now, server_hello, TIMEOUT);
    server.handle_frame(client_hello(&mut client));
    let reject = server.poll_transmit().expect("HELLO_REJECT");
    let Frame::HelloReject(r) = &reject else {
        panic!("{reject:?}");
    };
    let r = r.clone();
    assert_eq!(r.code, ErrorCode::LAYOUT_MISMATCH);

    client.handle_frame(wire(reject));
    assert!(
        client.poll_transmit().is_none(),
        "no reply to a HELLO_REJECT"
    );
    assert_eq!(
        client.poll_outcome(),
        Some(Err(HandshakeError::RefusedByPeer(r)))
    );
}

// ---------------------------------------------------------------------------------------------
// Time, versions, unexpected frames, loss.

#[test]
fn client_times_out() {
    let now = Instant::now();
    let mut client = Handshake::client(now, sender(), TIMEOUT);
    client_hello(&mut client);
    client.handle_timeout(now + TIMEOUT - Duration::from_millis(1));
    assert!(client.poll_outcome().is_none(), "not yet");
    assert_eq!(client.poll_timeout(), Some(now + TIMEOUT));
    client.handle_timeout(now + TIMEOUT);
    // SPEC §4.6: HELLO_REJECT(HANDSHAKE_TIMEOUT) first, then the outcome.
    assert!(
        matches!(client.poll_transmit(), Some(Frame::HelloReject(r)) if r.code == ErrorCode::HANDSHAKE_TIMEOUT)
    );
    assert_eq!(client.poll_outcome(), Some(Err(HandshakeError::Timeout)));
    assert_eq!(client.poll_timeout(), None);

    // A late HELLO_ACK changes nothing.
    client.handle_frame(Frame::HelloAck(receiver()));
    assert!(client.poll_outcome().is_none());
    assert!(client.poll_transmit().is_none());
}

#[test]
fn server_times_out() {
    let now = Instant::now();
    let mut server = Handshake::server(now, receiver(), TIMEOUT);
    server.handle_timeout(now + Duration::from_secs(60));
    assert!(
        matches!(server.poll_transmit(), Some(Frame::HelloReject(r)) if r.code == ErrorCode::HANDSHAKE_TIMEOUT)
    );
    assert_eq!(server.poll_outcome(), Some(Err(HandshakeError::Timeout)));
    server.handle_frame(Frame::Hello(sender()));
    assert!(server.poll_transmit().is_none());
    assert!(server.poll_outcome().is_none());
}

#[test]
fn unsupported_version_is_refused_with_version_mismatch() {
    // A HELLO from a version-1 peer (the previous protocol), as it arrives off the wire.
    let mut bytes = Frame::Hello(sender()).to_bytes().unwrap();
    bytes[4..6].copy_from_slice(&1u16.to_le_bytes());
    let Err(DecodeError::UnsupportedVersion(v)) = Frame::decode(&bytes) else {
        panic!("version 1 must be refused by the codec");
    };
    assert_eq!(v, 1);

    let now = Instant::now();
    let mut server = Handshake::server(now, receiver(), TIMEOUT);
    server.handle_unsupported_version(v);
    assert!(server.poll_outcome().is_none(), "reply first");
    let reply = server.poll_transmit().map(wire);
    let Some(Frame::HelloReject(sent)) = reply else {
        panic!("expected HELLO_REJECT, got {reply:?}");
    };
    assert_eq!(sent.code, ErrorCode::VERSION_MISMATCH);
    assert_names(&sent.detail, &["version 1", &VERSION.to_string()]);
    assert_eq!(sent, version_reject(1));
    assert_eq!(
        server.poll_outcome(),
        Some(Err(HandshakeError::Refused(sent)))
    );

    // The client side does the same for a version-0 answer.
    let mut client = Handshake::client(now, sender(), TIMEOUT);
    client_hello(&mut client);
    client.handle_unsupported_version(0);
    let Some(Frame::HelloReject(HelloReject { code, detail })) = client.poll_transmit() else {
        panic!("expected HELLO_REJECT");
    };
    assert_eq!(code, ErrorCode::VERSION_MISMATCH);
    assert_names(&detail, &["0"]);
    assert!(matches!(
        client.poll_outcome(),
        Some(Err(HandshakeError::Refused(_)))
    ));
}

#[test]
fn unexpected_frame_on_the_server() {
    let now = Instant::now();
    let mut server = Handshake::server(now, receiver(), TIMEOUT);
    server.handle_frame(wire(Frame::Reserve(Reserve {
        transfer_id: TransferId(1),
        nonce: 2,
        tokens: 16,
        digest: DigestAlgorithm::XXH3_64,
        page_digests: false,
        deadline_ms: 100,
        pages: vec![0],
        access: vec![],
    })));
    assert!(server.poll_transmit().is_none());
    let Some(Err(HandshakeError::Unexpected(u))) = server.poll_outcome() else {
        panic!("expected Unexpected");
    };
    assert_eq!(u.got, FrameType::RESERVE);
    assert_eq!(u.expected, &[FrameType::HELLO]);
    assert!(u.to_string().contains("RESERVE"), "{u}");
}

#[test]
fn unexpected_frame_on_the_client() {
    for frame in [
        Frame::Hello(receiver()),
        Frame::Verified(TransferRef {
            transfer_id: TransferId(1),
            nonce: 2,
        }),
    ] {
        let now = Instant::now();
        let mut client = Handshake::client(now, sender(), TIMEOUT);
        client_hello(&mut client);
        let got = frame.frame_type();
        client.handle_frame(wire(frame));
        assert!(client.poll_transmit().is_none());
        let Some(Err(HandshakeError::Unexpected(u))) = client.poll_outcome() else {
            panic!("expected Unexpected for {got}");
        };
        assert_eq!(u.got, got);
        assert!(u.expected.contains(&FrameType::HELLO_ACK));
        assert!(u.expected.contains(&FrameType::HELLO_REJECT));
    }
}

#[test]
fn peer_lost() {
    let now = Instant::now();
    let mut client = Handshake::client(now, sender(), TIMEOUT);
    client_hello(&mut client);
    client.handle_peer_lost();
    assert_eq!(client.poll_outcome(), Some(Err(HandshakeError::PeerLost)));
    assert_eq!(client.poll_timeout(), None);

    let mut server = Handshake::server(now, receiver(), TIMEOUT);
    server.handle_peer_lost();
    assert_eq!(server.poll_outcome(), Some(Err(HandshakeError::PeerLost)));

    // Loss after completion does not replace the outcome.
    let mut server = Handshake::server(now, receiver(), TIMEOUT);
    server.handle_frame(Frame::Hello(sender()));
    server.handle_peer_lost();
    assert!(server.poll_transmit().is_some());
    assert!(matches!(server.poll_outcome(), Some(Ok(_))));
    assert!(server.poll_outcome().is_none());
}

#[test]
fn handshake_errors_display_their_codes() {
    let r = HelloReject {
        code: ErrorCode::LAYOUT_MISMATCH,
        detail: "tokens per page: local 16, peer 32".into(),
    };
    let shown = HandshakeError::Refused(r.clone()).to_string();
    assert_names(&shown, &["LAYOUT_MISMATCH", "local 16, peer 32"]);
    let shown = HandshakeError::RefusedByPeer(r).to_string();
    assert_names(&shown, &["LAYOUT_MISMATCH", "peer"]);
    assert!(!HandshakeError::Timeout.to_string().is_empty());
    assert!(!HandshakeError::PeerLost.to_string().is_empty());
}

// ---------------------------------------------------------------------------------------------
// Transport parameters (SPEC §4.3 #7).

/// A check that accepts only parameters equal to this node's.
fn same_params(local: &[u8], peer: &[u8]) -> Result<(), String> {
    if local == peer {
        Ok(())
    } else {
        Err(format!("this node {local:?}, the peer {peer:?}"))
    }
}

/// SPEC §4.3 #7 (Q23): a transport that refuses the peer's parameters says so in the
/// handshake, HELLO_REJECT(TRANSPORT_MISMATCH) naming both, instead of a bare close after
/// it: a server at the client's HELLO, and a client at a HELLO_ACK from a server that did not
/// check (an older peer), which then hears why.
#[test]
fn transport_parameters_a_transport_refuses_are_refused_in_the_handshake() {
    let now = Instant::now();
    // The server checks: it refuses the client's HELLO.
    let mut client = Handshake::client(now, sender(), TIMEOUT);
    let mut server = Handshake::server(now, receiver(), TIMEOUT).checking_transport(same_params);
    server.handle_frame(client_hello(&mut client));
    let Some(Frame::HelloReject(r)) = server.poll_transmit().map(wire) else {
        panic!("the server did not refuse");
    };
    assert_eq!(r.code, ErrorCode::TRANSPORT_MISMATCH);
    assert_names(&r.detail, &["[]", "[1, 2, 3]"]);
    assert_eq!(
        server.poll_outcome(),
        Some(Err(HandshakeError::Refused(r.clone())))
    );
    client.handle_frame(Frame::HelloReject(r.clone()));
    assert_eq!(
        client.poll_outcome(),
        Some(Err(HandshakeError::RefusedByPeer(r)))
    );

    // Only the client checks: it refuses the server's HELLO_ACK, and tells it.
    let mut client = Handshake::client(now, sender(), TIMEOUT).checking_transport(same_params);
    let mut server = Handshake::server(now, receiver(), TIMEOUT);
    server.handle_frame(client_hello(&mut client));
    client.handle_frame(server.poll_transmit().map(wire).expect("HELLO_ACK"));
    let Some(Frame::HelloReject(r)) = client.poll_transmit().map(wire) else {
        panic!("the client did not refuse");
    };
    assert_eq!(r.code, ErrorCode::TRANSPORT_MISMATCH);
    assert_eq!(client.poll_outcome(), Some(Err(HandshakeError::Refused(r))));

    // Equal parameters pass.
    let mut same = receiver();
    same.transport_params = sender().transport_params;
    let (reply, outcome) = {
        let mut client = Handshake::client(now, sender(), TIMEOUT).checking_transport(same_params);
        let mut server = Handshake::server(now, same, TIMEOUT).checking_transport(same_params);
        server.handle_frame(client_hello(&mut client));
        let ack = server.poll_transmit().map(wire).expect("HELLO_ACK");
        client.handle_frame(ack.clone());
        (ack, client.poll_outcome())
    };
    assert!(matches!(reply, Frame::HelloAck(_)));
    assert!(matches!(outcome, Some(Ok(_))), "{outcome:?}");
}
