//! Authenticated peers (SPEC.md §3.11, §4.8): golden vectors for the authenticated forms
//! (checked both ways), and every class of attack the channel must refuse with its typed
//! error: wrong key, no key, tampered HELLO, tampered / replayed / cross-connection /
//! reflected frames, and a replayed handshake.

use kvwire_proto::wire::TransferId;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvwire_proto::auth::{
    AuthChannel, AuthError, Nonce, OpenError, Psk, PskError, AUTH_FLAG, SEALED_OVERHEAD,
};
use kvwire_proto::handshake::{Handshake, HandshakeError};
use kvwire_proto::wire::{
    Commit, DecodeError, Digest128, DigestAlgorithm, ErrorCode, Frame, FrameType, Hello,
    HelloReject, KvLayout, Reserve, Role, TransferRef, HEADER_LEN, TRAILER_LEN,
};

// ---------------------------------------------------------------------------------------------
// The fixed key, nonces and frames of the vectors (proto/vectors/auth/gen.py).

fn psk() -> Psk {
    Psk::new((0x40u8..0x60).collect()).unwrap()
}

fn nonce(start: u8) -> Nonce {
    let mut n = [0u8; 32];
    for (i, b) in n.iter_mut().enumerate() {
        *b = start + i as u8;
    }
    n
}

const NC: u8 = 0xc0;
const NS: u8 = 0xa0;

const REF: TransferRef = TransferRef {
    transfer_id: TransferId(0x0102_0304_0506_0708),
    nonce: 0x1112_1314_1516_1718,
};

fn layout() -> KvLayout {
    KvLayout {
        tokens_per_page: 16,
        buffer_page_bytes: vec![65_536, 32_768],
        fingerprint: b"llama-3-8b/tp2of8".to_vec(),
    }
}

fn hello() -> Hello {
    Hello {
        node_id: 0x2122_2324_2526_2728,
        role: Role::SENDER,
        layout: layout(),
        digests: vec![DigestAlgorithm::XXH3_64, DigestAlgorithm::CRC32],
        transport_params: vec![1, 2, 3, 4],
        max_aux: 0,
    }
}

fn hello_ack() -> Hello {
    Hello {
        node_id: 0x3132_3334_3536_3738,
        role: Role::RECEIVER,
        layout: layout(),
        digests: vec![DigestAlgorithm::CRC32, DigestAlgorithm::XXH3_64],
        transport_params: vec![],
        max_aux: 4096,
    }
}

fn reserve() -> Frame {
    Frame::Reserve(Reserve {
        transfer_id: REF.transfer_id,
        nonce: REF.nonce,
        tokens: 40,
        digest: DigestAlgorithm::XXH3_64,
        page_digests: true,
        deadline_ms: 5000,
        pages: vec![7, 3, 0x12345],
        access: vec![0xde, 0xad, 0xbe, 0xef, 0x00, 0x01],
    })
}

fn commit() -> Frame {
    let mut d0 = [0u8; 16];
    let mut d1 = [0u8; 16];
    for i in 0..16 {
        d0[i] = i as u8;
        d1[i] = 0x10 + i as u8;
    }
    Frame::Commit(Commit {
        transfer: REF,
        tokens: 40,
        pages: 3,
        bytes: 294_912,
        digest: DigestAlgorithm::XXH3_64,
        buffer_digests: vec![Digest128(d0), Digest128(d1)],
        page_digests: (0..6).map(|i| 0xa0a1_a2a3_a4a5_a6a0 + i).collect(),
        aux_digest: Digest128(core::array::from_fn(|i| 0x20 + i as u8)),
        aux: vec![],
    })
}

/// Who sends each vector, in exchange order.
#[derive(Clone, Copy, PartialEq)]
enum From {
    Client,
    Server,
}

fn exchange() -> Vec<(&'static str, From, Frame)> {
    vec![
        ("hello", From::Client, Frame::Hello(hello())),
        ("hello_ack", From::Server, Frame::HelloAck(hello_ack())),
        ("hello_confirm", From::Client, Frame::HelloConfirm),
        ("reserve", From::Server, reserve()),
        ("commit", From::Client, commit()),
        ("verified", From::Server, Frame::Verified(REF)),
        ("ping", From::Server, Frame::Ping(0x0102_0304_0506_0708)),
        ("pong", From::Client, Frame::Pong(0x0102_0304_0506_0708)),
    ]
}

fn vectors_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("vectors/auth")
}

fn read_vector(name: &str) -> Vec<u8> {
    let path = vectors_dir().join(format!("{name}.hex"));
    let text = std::fs::read_to_string(&path).unwrap();
    let digits: String = text
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .flat_map(|l| l.chars())
        .filter(|c| !c.is_whitespace())
        .collect();
    assert!(digits.len() % 2 == 0, "{name}: odd digit count");
    (0..digits.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&digits[i..i + 2], 16).unwrap())
        .collect()
}

fn pair() -> (AuthChannel, AuthChannel) {
    (
        AuthChannel::client(psk(), nonce(NC)),
        AuthChannel::server(psk(), nonce(NS)),
    )
}

/// Replaces the CRC of a whole frame after an edit, so the edit reaches authentication.
fn fix_crc(frame: &mut [u8]) {
    let n = frame.len() - TRAILER_LEN;
    let crc = crc32fast::hash(&frame[..n]);
    frame[n..].copy_from_slice(&crc.to_le_bytes());
}

fn auth_err(r: Result<(Frame, usize), OpenError>) -> AuthError {
    match r {
        Err(OpenError::Auth(e)) => e,
        other => panic!("expected an authentication error, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Golden vectors.

#[test]
fn auth_vectors_encode_and_decode() {
    let (mut client, mut server) = pair();
    let on_disk: Vec<String> = {
        let mut v: Vec<String> = std::fs::read_dir(vectors_dir())
            .unwrap()
            .filter_map(|e| {
                let n = e.unwrap().file_name().into_string().unwrap();
                n.strip_suffix(".hex").map(str::to_owned)
            })
            .collect();
        v.sort();
        v
    };
    let mut names: Vec<String> = exchange().iter().map(|(n, _, _)| n.to_string()).collect();
    names.sort();
    assert_eq!(on_disk, names, "every auth vector needs an expected frame");
    for (name, from, frame) in exchange() {
        let want = read_vector(name);
        let (tx, rx) = match from {
            From::Client => (&mut client, &mut server),
            From::Server => (&mut server, &mut client),
        };
        let sealed = tx.seal_to_vec(&frame).unwrap();
        assert_eq!(sealed, want, "vector {name} (encode)");
        assert_eq!(
            rx.open(&want),
            Ok((frame.clone(), want.len())),
            "vector {name} (decode)"
        );
        let raw = u16::from_le_bytes([want[6], want[7]]);
        assert_eq!(
            raw,
            frame.frame_type().0 | AUTH_FLAG,
            "{name}: flagged type"
        );
        let crc = u32::from_le_bytes(want[want.len() - 4..].try_into().unwrap());
        assert_eq!(crc, crc32fast::hash(&want[..want.len() - 4]), "{name}: crc");
    }
}

#[test]
fn the_plain_decoder_refuses_authenticated_frames_as_unknown_types() {
    let bytes = read_vector("commit");
    assert_eq!(
        Frame::decode(&bytes),
        Err(DecodeError::UnknownFrameType(FrameType(0x8012)))
    );
}

/// Brings a fresh pair to the state right before vector `upto`: every earlier vector opened
/// by its receiver (and sealed by its sender).
fn state_before(upto: &str) -> (AuthChannel, AuthChannel) {
    let (mut client, mut server) = pair();
    for (name, from, frame) in exchange() {
        if name == upto {
            break;
        }
        let (tx, rx) = match from {
            From::Client => (&mut client, &mut server),
            From::Server => (&mut server, &mut client),
        };
        let bytes = tx.seal_to_vec(&frame).unwrap();
        rx.open(&bytes).unwrap();
    }
    (client, server)
}

#[test]
fn every_altered_payload_byte_of_every_auth_vector_is_refused() {
    for (name, from, _) in exchange() {
        let good = read_vector(name);
        for i in HEADER_LEN..good.len() - TRAILER_LEN {
            let (mut client, mut server) = state_before(name);
            let rx = if from == From::Client {
                &mut server
            } else {
                &mut client
            };
            let mut bad = good.clone();
            bad[i] ^= 0x01;
            fix_crc(&mut bad);
            assert_eq!(
                auth_err(rx.open(&bad)),
                AuthError::BadTag {
                    frame_type: FrameType(u16::from_le_bytes([good[6], good[7]]) & !AUTH_FLAG)
                },
                "{name}: byte {i} altered"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Attacks on the transfer frames.

/// Client and server after the vectors' handshake.
fn established() -> (AuthChannel, AuthChannel) {
    state_before("reserve")
}

#[test]
fn a_replayed_manifest_is_refused() {
    let (mut client, mut server) = established();
    let r = server.seal_to_vec(&reserve()).unwrap();
    assert!(client.open(&r).is_ok());
    assert_eq!(
        auth_err(client.open(&r)),
        AuthError::Sequence {
            frame_type: FrameType::RESERVE,
            expected: 1,
            got: 0
        }
    );
    let c = client.seal_to_vec(&commit()).unwrap();
    assert!(server.open(&c).is_ok());
    let e = auth_err(server.open(&c));
    assert_eq!(
        e,
        AuthError::Sequence {
            frame_type: FrameType::COMMIT,
            expected: 2,
            got: 1
        }
    );
    assert_eq!(e.code(), ErrorCode::AUTH_FAILED);
}

#[test]
fn a_dropped_frame_is_detected_by_the_next_one() {
    let (mut client, mut server) = established();
    let _lost = server.seal_to_vec(&reserve()).unwrap();
    let next = server.seal_to_vec(&Frame::Verified(REF)).unwrap();
    assert_eq!(
        auth_err(client.open(&next)),
        AuthError::Sequence {
            frame_type: FrameType::VERIFIED,
            expected: 0,
            got: 1
        }
    );
}

#[test]
fn a_manifest_from_another_connection_is_refused() {
    // Same key, same transfer, same sequence position: only the nonces differ.
    let (mut client1, _server1) = established();
    let mut client2 = AuthChannel::client(psk(), nonce(0x10));
    let mut server2 = AuthChannel::server(psk(), nonce(0x30));
    let h = client2.seal_to_vec(&Frame::Hello(hello())).unwrap();
    server2.open(&h).unwrap();
    let a = server2.seal_to_vec(&Frame::HelloAck(hello_ack())).unwrap();
    client2.open(&a).unwrap();
    let c = client2.seal_to_vec(&Frame::HelloConfirm).unwrap();
    server2.open(&c).unwrap();

    let from_conn1 = client1.seal_to_vec(&commit()).unwrap(); // seq 1 on connection 1
                                                              // Opened where connection 2 expects seq 1: the sequence matches, the key does not.
    assert_eq!(
        auth_err(server2.open(&from_conn1)),
        AuthError::BadTag {
            frame_type: FrameType::COMMIT
        }
    );
}

#[test]
fn a_tampered_manifest_is_refused() {
    let (mut client, mut server) = established();
    let mut c = client.seal_to_vec(&commit()).unwrap();
    // Raise the COMMIT's token count (payload offset 16) and fix the CRC.
    c[HEADER_LEN + 16] ^= 0x04;
    fix_crc(&mut c);
    assert_eq!(
        auth_err(server.open(&c)),
        AuthError::BadTag {
            frame_type: FrameType::COMMIT
        }
    );
}

#[test]
fn a_reflected_frame_is_refused() {
    let (_client, mut server) = established();
    // The server's own RESERVE fed back to the server: the direction keys differ.
    let r = server.seal_to_vec(&reserve()).unwrap();
    assert_eq!(
        auth_err(server.open(&r)),
        AuthError::BadTag {
            frame_type: FrameType::RESERVE
        }
    );
}

#[test]
fn an_unauthenticated_frame_is_refused_after_the_handshake() {
    let (mut client, mut server) = established();
    let plain = commit().to_bytes().unwrap();
    let e = auth_err(server.open(&plain));
    assert_eq!(
        e,
        AuthError::Missing {
            frame_type: FrameType::COMMIT
        }
    );
    assert_eq!(e.code(), ErrorCode::AUTH_MISMATCH);
    // A plain HELLO_REJECT is a handshake frame: refused once the peer proved its keys.
    let reject = Frame::HelloReject(HelloReject {
        code: ErrorCode::SHUTDOWN,
        detail: String::new(),
    })
    .to_bytes()
    .unwrap();
    assert!(matches!(
        client.open(&reject),
        Err(OpenError::Auth(AuthError::Missing { .. }))
    ));
}

#[test]
fn sealed_frames_carry_the_documented_overhead() {
    let (mut client, _) = established();
    let plain = commit().to_bytes().unwrap();
    let sealed = client.seal_to_vec(&commit()).unwrap();
    assert_eq!(sealed.len(), plain.len() + SEALED_OVERHEAD);
}

// ---------------------------------------------------------------------------------------------
// The handshake: wrong key, no key, tampered and replayed HELLO, and the happy path.

struct Node {
    hs: Handshake,
    ch: AuthChannel,
}

fn client_node(ch: AuthChannel) -> Node {
    let mut hs = Handshake::client(Instant::now(), hello(), Duration::from_secs(5));
    if ch.is_authenticated() {
        hs = hs.with_confirmation();
    }
    Node { hs, ch }
}

fn server_node(ch: AuthChannel) -> Node {
    let mut hs = Handshake::server(Instant::now(), hello_ack(), Duration::from_secs(5));
    if ch.is_authenticated() {
        hs = hs.with_confirmation();
    }
    Node { hs, ch }
}

/// Delivers `bytes` to `node` as a driver does: open, then the frame or the error.
fn deliver(node: &mut Node, bytes: &[u8]) {
    match node.ch.open(bytes) {
        Ok((f, _)) => node.hs.handle_frame(f),
        Err(OpenError::Auth(e)) => node.hs.handle_auth_error(&e),
        Err(e) => panic!("decode error {e}"),
    }
}

fn outgoing(node: &mut Node) -> Vec<Vec<u8>> {
    let mut v = Vec::new();
    while let Some(f) = node.hs.poll_transmit() {
        v.push(node.ch.seal_to_vec(&f).unwrap());
    }
    v
}

type Outcome = Option<Result<kvwire_proto::handshake::Established, HandshakeError>>;

/// Runs a handshake, letting `tamper` edit every record on the wire (client to server:
/// `true`). Returns both outcomes.
fn run(mut c: Node, mut s: Node, tamper: impl Fn(bool, &mut Vec<u8>)) -> (Outcome, Outcome) {
    let (mut oc, mut os) = (None, None);
    for _ in 0..4 {
        for mut b in outgoing(&mut c) {
            tamper(true, &mut b);
            deliver(&mut s, &b);
        }
        os = os.or(s.hs.poll_outcome());
        for mut b in outgoing(&mut s) {
            tamper(false, &mut b);
            deliver(&mut c, &b);
        }
        oc = oc.or(c.hs.poll_outcome());
        os = os.or(s.hs.poll_outcome());
    }
    (oc, os)
}

fn refused_code(o: &Outcome) -> (ErrorCode, bool) {
    match o {
        Some(Err(HandshakeError::Refused(r))) => (r.code, true),
        Some(Err(HandshakeError::RefusedByPeer(r))) => (r.code, false),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn authenticated_handshake_happy_path() {
    let (c, s) = pair();
    let (oc, os) = run(client_node(c), server_node(s), |_, _| {});
    assert_eq!(oc.unwrap().unwrap().peer, hello_ack());
    assert_eq!(os.unwrap().unwrap().peer, hello());
}

#[test]
fn the_server_is_established_only_after_the_confirmation() {
    let (c, s) = pair();
    let mut c = client_node(c);
    let mut s = server_node(s);
    for b in outgoing(&mut c) {
        deliver(&mut s, &b);
    }
    let ack = outgoing(&mut s);
    assert_eq!(ack.len(), 1);
    assert!(
        s.hs.poll_outcome().is_none(),
        "established before HELLO_CONFIRM"
    );
    deliver(&mut c, &ack[0]);
    let confirm = outgoing(&mut c);
    assert!(c.hs.poll_outcome().unwrap().is_ok());
    assert!(s.hs.poll_outcome().is_none());
    deliver(&mut s, &confirm[0]);
    assert!(s.hs.poll_outcome().unwrap().is_ok());
}

#[test]
fn wrong_key_is_refused_at_the_hello() {
    let c = AuthChannel::client(Psk::new(vec![7; 32]).unwrap(), nonce(NC));
    let s = AuthChannel::server(psk(), nonce(NS));
    let (oc, os) = run(client_node(c), server_node(s), |_, _| {});
    assert_eq!(refused_code(&os), (ErrorCode::AUTH_FAILED, true));
    assert_eq!(refused_code(&oc), (ErrorCode::AUTH_FAILED, false));
}

#[test]
fn no_key_on_either_side_is_refused_as_a_mismatch() {
    let (oc, os) = run(
        client_node(AuthChannel::off()),
        server_node(AuthChannel::server(psk(), nonce(NS))),
        |_, _| {},
    );
    assert_eq!(refused_code(&os), (ErrorCode::AUTH_MISMATCH, true));
    assert_eq!(refused_code(&oc), (ErrorCode::AUTH_MISMATCH, false));

    let (oc, os) = run(
        client_node(AuthChannel::client(psk(), nonce(NC))),
        server_node(AuthChannel::off()),
        |_, _| {},
    );
    assert_eq!(refused_code(&os), (ErrorCode::AUTH_MISMATCH, true));
    assert_eq!(refused_code(&oc), (ErrorCode::AUTH_MISMATCH, false));
}

#[test]
fn a_tampered_hello_is_refused() {
    let (c, s) = pair();
    // Change the fingerprint's first byte in the client's HELLO (payload offset 24).
    let (oc, os) = run(client_node(c), server_node(s), |to_server, b| {
        if to_server && u16::from_le_bytes([b[6], b[7]]) == FrameType::HELLO.0 | AUTH_FLAG {
            b[HEADER_LEN + 24] ^= 0x20;
            fix_crc(b);
        }
    });
    assert_eq!(refused_code(&os), (ErrorCode::AUTH_FAILED, true));
    assert_eq!(refused_code(&oc), (ErrorCode::AUTH_FAILED, false));
}

#[test]
fn a_tampered_hello_ack_is_refused_by_the_client() {
    let (c, s) = pair();
    let (oc, os) = run(client_node(c), server_node(s), |to_server, b| {
        if !to_server && u16::from_le_bytes([b[6], b[7]]) == FrameType::HELLO_ACK.0 | AUTH_FLAG {
            b[HEADER_LEN] ^= 0x01; // node id
            fix_crc(b);
        }
    });
    assert_eq!(refused_code(&oc), (ErrorCode::AUTH_FAILED, true));
    assert_eq!(refused_code(&os), (ErrorCode::AUTH_FAILED, false));
}

#[test]
fn a_replayed_handshake_cannot_complete() {
    // Record a whole client side of a good handshake...
    let (c, s) = pair();
    let mut c = client_node(c);
    let mut s = server_node(s);
    let hello_bytes = outgoing(&mut c);
    deliver(&mut s, &hello_bytes[0]);
    let ack = outgoing(&mut s);
    deliver(&mut c, &ack[0]);
    let confirm_bytes = outgoing(&mut c);
    deliver(&mut s, &confirm_bytes[0]);
    assert!(s.hs.poll_outcome().unwrap().is_ok());

    // ...and replay it to a server with a fresh nonce: the HELLO passes (it is the key
    // holder's), but the recorded HELLO_CONFIRM is sealed under the old connection's keys.
    let mut s2 = server_node(AuthChannel::server(psk(), nonce(0x55)));
    deliver(&mut s2, &hello_bytes[0]);
    assert_eq!(outgoing(&mut s2).len(), 1, "HELLO_ACK");
    assert!(s2.hs.poll_outcome().is_none());
    deliver(&mut s2, &confirm_bytes[0]);
    let o = s2.hs.poll_outcome();
    assert!(
        o.is_none(),
        "the refusal is reported after its HELLO_REJECT is taken"
    );
    let reject = outgoing(&mut s2);
    assert_eq!(reject.len(), 1);
    assert_eq!(
        refused_code(&s2.hs.poll_outcome()),
        (ErrorCode::AUTH_FAILED, true)
    );
}

#[test]
fn a_confirmation_is_required_and_nothing_else_stands_in_for_it() {
    let (c, s) = pair();
    let mut c = client_node(c);
    let mut s = server_node(s);
    deliver(&mut s, &outgoing(&mut c)[0]);
    let ack = outgoing(&mut s);
    deliver(&mut c, &ack[0]);
    assert_eq!(c.hs.poll_transmit(), Some(Frame::HelloConfirm));
    // The client seals another frame (sequence 0) instead of its confirmation.
    let other = c.ch.seal_to_vec(&reserve()).unwrap();
    deliver(&mut s, &other);
    assert!(matches!(
        s.hs.poll_outcome(),
        Some(Err(HandshakeError::Unexpected(_)))
    ));
}

#[test]
fn psk_parsing_and_redaction() {
    assert_eq!(
        Psk::from_hex("00112233445566778899aabbccddeeff\n")
            .unwrap()
            .len(),
        16
    );
    assert_eq!(Psk::from_hex("0011"), Err(PskError::TooShort { len: 2 }));
    assert_eq!(Psk::from_hex("zz"), Err(PskError::NotHex));
    assert_eq!(Psk::from_hex("001"), Err(PskError::NotHex));
    let k = psk();
    let dbg = format!("{k:?}");
    assert!(!dbg.contains("404142"), "{dbg}");
    assert!(dbg.contains(&k.id()));
    assert_ne!(k.id(), Psk::new(vec![7; 32]).unwrap().id());
}

/// Lanes (one channel per queue pair, SPEC.md §3.11.1): each lane of one side opens only what
/// the same lane of the other side sealed, with its own sequence numbers, in any interleaving
/// across lanes; lane 0 is the connection's channel itself.
#[test]
fn lanes_open_only_their_own_frames_in_any_order_across_lanes() {
    let (client, server) = established();
    let mut c = client.clone().lanes(3);
    let mut s = server.clone().lanes(3);
    assert_eq!((c.len(), s.len()), (3, 3));
    // Server seals one RESERVE on each lane; the client opens them in reverse lane order.
    let sealed: Vec<Vec<u8>> = s
        .iter_mut()
        .map(|l| l.seal_to_vec(&reserve()).unwrap())
        .collect();
    for i in (0..3).rev() {
        assert!(c[i].open(&sealed[i]).is_ok(), "lane {i}");
    }
    // A frame sealed on lane 1 does not open on lane 2 (nor on lane 0).
    let f = c[1].seal_to_vec(&commit()).unwrap();
    for wrong in [0usize, 2] {
        assert!(
            matches!(s[wrong].clone().open(&f), Err(OpenError::Auth(_))),
            "lane {wrong} opened a lane-1 frame"
        );
    }
    assert!(s[1].open(&f).is_ok());
    // Lane 0 is the channel itself: it continues the connection's sequence.
    let mut plain_client = client;
    let a = server
        .clone()
        .lanes(1)
        .remove(0)
        .seal_to_vec(&reserve())
        .unwrap();
    assert!(plain_client.open(&a).is_ok());
    // Unauthenticated channels give unauthenticated lanes.
    let off = AuthChannel::off().lanes(2);
    assert!(off.iter().all(|l| !l.is_authenticated()));
}
