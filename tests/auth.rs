//! Authenticated peers over the real TCP engine (SPEC.md §3.11, §4.8): the happy path, a
//! wrong key, no key, a tampered HELLO, a tampered COMMIT and a replayed COMMIT, each refused
//! with its typed error, and the receiver's pool back to full afterwards. A man-in-the-middle
//! proxy between the two engines edits the sender's control frames.

use kvwire::TransferId;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvwire::proto::admission::Request;
use kvwire::proto::auth::{AuthError, Psk, AUTH_FLAG};
use kvwire::proto::wire::{ErrorCode, FrameType, HEADER_LEN, TRAILER_LEN};
use kvwire::receiver::ReserveParams;
use kvwire::testkit::{first_pattern_mismatch, kv_pattern};
use kvwire::transport::tcp::DATA_HEADER_LEN;
use kvwire::{Auth, NodeConfig, ReceiverConn, SenderConn, TransferError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Edits one control frame travelling from the sender (client) to the receiver: returns the
/// records to forward in its place.
type Hook = Box<dyn FnMut(Vec<u8>) -> Vec<Vec<u8>> + Send>;

fn frame_type(frame: &[u8]) -> u16 {
    u16::from_le_bytes([frame[6], frame[7]])
}

fn fix_crc(frame: &mut [u8]) {
    let n = frame.len() - TRAILER_LEN;
    let crc = crc32fast::hash(&frame[..n]);
    frame[n..].copy_from_slice(&crc.to_le_bytes());
}

/// Reads the next record of the sender's stream (a control frame or a data record).
async fn read_record(r: &mut tokio::net::tcp::OwnedReadHalf) -> Option<(bool, Vec<u8>)> {
    let mut magic = [0u8; 4];
    r.read_exact(&mut magic).await.ok()?;
    if &magic == b"KVDT" {
        let mut head = vec![0u8; DATA_HEADER_LEN];
        head[..4].copy_from_slice(&magic);
        r.read_exact(&mut head[4..]).await.ok()?;
        let len = u32::from_le_bytes(head[32..36].try_into().unwrap()) as usize;
        let mut rec = head;
        rec.resize(DATA_HEADER_LEN + len, 0);
        r.read_exact(&mut rec[DATA_HEADER_LEN..]).await.ok()?;
        Some((false, rec))
    } else {
        let mut head = vec![0u8; HEADER_LEN];
        head[..4].copy_from_slice(&magic);
        r.read_exact(&mut head[4..]).await.ok()?;
        let len = u32::from_le_bytes(head[8..12].try_into().unwrap()) as usize;
        let mut rec = head;
        rec.resize(HEADER_LEN + len + TRAILER_LEN, 0);
        r.read_exact(&mut rec[HEADER_LEN..]).await.ok()?;
        Some((true, rec))
    }
}

/// A proxy on a fresh port forwarding one connection to `target`; control frames from the
/// client pass through `hook`.
async fn proxy(target: std::net::SocketAddr, mut hook: Hook) -> std::net::SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        let (client, _) = l.accept().await.unwrap();
        let server = TcpStream::connect(target).await.unwrap();
        let (mut crd, mut cwr) = client.into_split();
        let (mut srd, mut swr) = server.into_split();
        tokio::spawn(async move {
            let _ = tokio::io::copy(&mut srd, &mut cwr).await;
            let _ = cwr.shutdown().await;
        });
        while let Some((control, rec)) = read_record(&mut crd).await {
            let out = if control { hook(rec) } else { vec![rec] };
            for r in out {
                if swr.write_all(&r).await.is_err() {
                    return;
                }
            }
        }
        let _ = swr.shutdown().await;
    });
    addr
}

/// Receiver listening with `rx`, sender connecting through a proxy with `tx`.
async fn connect(
    tx: &NodeConfig,
    rx: &NodeConfig,
    hook: Hook,
) -> (
    Result<SenderConn, kvwire::engine::EngineError>,
    Result<ReceiverConn, kvwire::engine::EngineError>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let target = listener.local_addr().unwrap();
    let decode = kvwire::Node::new(rx.clone()).unwrap();
    let prefill = kvwire::Node::new(tx.clone()).unwrap();
    let accept = tokio::spawn(async move { ReceiverConn::accept(&listener, &decode).await });
    let via = proxy(target, hook).await;
    let s = SenderConn::connect(via, &prefill).await;
    (s, accept.await.unwrap())
}

fn pass() -> Hook {
    Box::new(|f| vec![f])
}

fn config(auth: Auth) -> NodeConfig {
    let mut c = NodeConfig::example();
    c.auth = auth;
    // The proxy parses the stream's frames and data records: page bytes travel on it (no
    // same-host pulls, SPEC §9.3, whose pull records it does not parse).
    c.same_host = kvwire::SameHost::Off;
    c.handshake_timeout = Duration::from_secs(5);
    c
}

fn key(b: u8) -> Auth {
    Auth::Psk(Psk::new(vec![b; 32]).unwrap())
}

fn params(id: u64) -> ReserveParams {
    ReserveParams::new(TransferId(id), 100, Duration::from_secs(5)).with_page_digests()
}

async fn send(s: &SenderConn, id: u64) -> Result<(), TransferError> {
    let a = s.admit(Request {
        transfer_id: TransferId(id),
        tokens: 100,
    })?;
    s.send(a, move |o, b, p| kv_pattern(TransferId(id), o, b, p))
        .await
}

async fn assert_pool_full(r: &ReceiverConn) {
    let s = r.stats().await.unwrap();
    assert_eq!(s.pages_free, s.pages_total, "{s:?}");
    assert_eq!(s.pages_quarantined, 0, "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authenticated_transfer_verifies_with_the_senders_bytes() {
    let c = config(key(1));
    let (s, r) = connect(&c, &c, pass()).await;
    let (s, r) = (s.unwrap(), r.unwrap());
    let v = r.reserve(params(7));
    send(&s, 7).await.unwrap();
    let kv = v.await.unwrap();
    let ok = kv
        .page(0, 1)
        .map(|page| {
            let mut want = vec![0u8; page.len()];
            kv_pattern(TransferId(7), 0, 1, &mut want);
            *page == want[..]
        })
        .unwrap();
    assert!(ok, "landed bytes differ from the sender's pattern");
    // The release is done when it returns: the pages are back at once.
    kv.release().unwrap();
    assert_pool_full(&r).await;
}

fn refusal(e: &kvwire::engine::EngineError) -> ErrorCode {
    e.refusal_code()
        .unwrap_or_else(|| panic!("expected a handshake refusal, got {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_key_cannot_complete_the_handshake() {
    let (s, r) = connect(&config(key(1)), &config(key(2)), pass()).await;
    assert_eq!(refusal(&s.unwrap_err()), ErrorCode::AUTH_FAILED);
    assert_eq!(refusal(&r.unwrap_err()), ErrorCode::AUTH_FAILED);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_key_on_one_side_is_refused_as_a_mismatch() {
    let (s, r) = connect(&config(Auth::Off), &config(key(1)), pass()).await;
    assert_eq!(refusal(&s.unwrap_err()), ErrorCode::AUTH_MISMATCH);
    assert_eq!(refusal(&r.unwrap_err()), ErrorCode::AUTH_MISMATCH);
    let (s, r) = connect(&config(key(1)), &config(Auth::Off), pass()).await;
    assert_eq!(refusal(&s.unwrap_err()), ErrorCode::AUTH_MISMATCH);
    assert_eq!(refusal(&r.unwrap_err()), ErrorCode::AUTH_MISMATCH);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_sides_off_still_connect() {
    let c = config(Auth::Off);
    let (s, r) = connect(&c, &c, pass()).await;
    let (s, r) = (s.unwrap(), r.unwrap());
    let v = r.reserve(params(3));
    send(&s, 3).await.unwrap();
    let kv = v.await.unwrap();
    assert_eq!(
        first_pattern_mismatch(&kv, TransferId(3)),
        None,
        "delivered bytes differ from the sender's"
    );
    kv.release().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tampered_hello_is_refused() {
    let hook: Hook = Box::new(|mut f| {
        if frame_type(&f) == FrameType::HELLO.0 | AUTH_FLAG {
            f[HEADER_LEN] ^= 0x01; // node id
            fix_crc(&mut f);
        }
        vec![f]
    });
    let c = config(key(1));
    let (s, r) = connect(&c, &c, hook).await;
    assert_eq!(refusal(&r.unwrap_err()), ErrorCode::AUTH_FAILED);
    assert_eq!(refusal(&s.unwrap_err()), ErrorCode::AUTH_FAILED);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tampered_commit_closes_the_connection_and_fails_the_transfer_safely() {
    let hook: Hook = Box::new(|mut f| {
        if frame_type(&f) == FrameType::COMMIT.0 | AUTH_FLAG {
            f[HEADER_LEN + 40] ^= 0xff; // first byte of the first buffer digest
            fix_crc(&mut f);
        }
        vec![f]
    });
    let c = config(key(1));
    let (s, r) = connect(&c, &c, hook).await;
    let (s, r) = (s.unwrap(), r.unwrap());
    let v = r.reserve(params(9));
    let sent = tokio::spawn(async move { send(&s, 9).await });
    match v.await {
        Err(TransferError::Unauthenticated(AuthError::BadTag { frame_type })) => {
            assert_eq!(frame_type, FrameType::COMMIT)
        }
        other => panic!("expected Unauthenticated(BadTag), got {other:?}"),
    }
    assert_pool_full(&r).await;
    assert!(r.stats().await.unwrap().peer_lost);
    // The receiver closed the connection: the sender learns it (no verdict is forged). Its
    // COMMIT had gone, so the outcome is Unconfirmed around the loss (SPEC §7.6).
    let got = sent.await.unwrap();
    assert!(
        matches!(
            &got,
            Err(TransferError::Failed(kvwire::proto::FailureReason::Unconfirmed { cause }))
                if **cause == kvwire::proto::FailureReason::PeerLost
        ),
        "{got:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_commit_is_refused() {
    // The proxy keeps the first transfer's COMMIT and sends it again in place of the
    // second's: a valid tag, an old sequence number.
    let first: Arc<Mutex<Option<Vec<u8>>>> = Arc::default();
    let seen = first.clone();
    let hook: Hook = Box::new(move |f| {
        if frame_type(&f) != FrameType::COMMIT.0 | AUTH_FLAG {
            return vec![f];
        }
        let mut g = seen.lock().unwrap();
        match g.as_ref() {
            None => {
                *g = Some(f.clone());
                vec![f]
            }
            Some(old) => vec![old.clone()],
        }
    });
    let c = config(key(1));
    let (s, r) = connect(&c, &c, hook).await;
    let (s, r) = (s.unwrap(), r.unwrap());
    let v = r.reserve(params(1));
    send(&s, 1).await.unwrap();
    let kv = v.await.unwrap();
    assert_eq!(first_pattern_mismatch(&kv, TransferId(1)), None);
    kv.release().unwrap();
    let v = r.reserve(params(2));
    let sent = tokio::spawn(async move { send(&s, 2).await });
    match v.await {
        Err(TransferError::Unauthenticated(AuthError::Sequence {
            frame_type,
            expected,
            got,
        })) => {
            assert_eq!(frame_type, FrameType::COMMIT);
            assert!(got < expected, "got {got}, expected {expected}");
        }
        other => panic!("expected Unauthenticated(Sequence), got {other:?}"),
    }
    assert!(first.lock().unwrap().is_some());
    assert_pool_full(&r).await;
    assert!(sent.await.unwrap().is_err());
}
