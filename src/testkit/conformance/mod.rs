//! The conformance kit (issue 37): a scripted prefill that connects to any implementation's
//! listening decode (`kvwire bench --listen`, or a third party's) and checks, one fresh
//! connection per check, the rules a listener must follow whatever its peer sends: what it
//! refuses in the handshake and with which code, what ends a connection, the heartbeat and
//! its bound under a PING flood (more than `PING_FLOOD_LIMIT` a second, which a target MAY
//! close), and that it still serves a correct peer afterwards. Run it
//! with `kvwire conform --connect ADDR` (the CLI's `conform` feature) or call [`run`]. Its
//! other half, [`run_prefill`] (`kvwire conform --listen ADDR`), plays a scripted decode for
//! an implementation's prefill.
//!
//! The kit's node configuration must describe the same layout, fingerprint and key as the
//! target's (the kit is a real prefill for its correct handshakes). Each check reports
//! [`Verdict::Pass`], [`Verdict::Fail`] or [`Verdict::Skip`] with the SPEC section it checks.
//! Checks that write raw frames after the handshake run only against a listener without
//! authentication (its frames would otherwise fail authentication first, and pass for the
//! wrong reason); data records and magics are not authenticated and run either way.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvwire_proto::auth::{AuthChannel, Sealer};
use kvwire_proto::handshake::HandshakeError;
use kvwire_proto::wire::{ErrorCode, Frame, Hello, Role, MAGIC};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::config::NodeConfig;
use crate::engine::{handshake_hello, EngineError};
use crate::transport::tcp::{DataHeader, TcpParams};

mod prefill;
pub use prefill::{reconnecting_prefill, run_prefill};

/// How a check ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The target did what the SPEC says; what was seen.
    Pass(String),
    /// It did not; what was seen instead.
    Fail(String),
    /// Not run, and why.
    Skip(String),
}

/// One check's outcome.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Checked {
    /// What the check asks of the target.
    pub name: &'static str,
    /// The SPEC sections it checks.
    pub spec: &'static str,
    /// What happened.
    pub verdict: Verdict,
}

/// How long the kit waits.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// For an answer, or for the target to close a connection it must close (the target's
    /// handshake timeout and liveness timeout must be shorter).
    pub wait: Duration,
    /// The target's heartbeat interval (SPEC §8.3: at most 16 PONGs per interval of its own).
    pub interval: Duration,
    /// How long the PING flood lasts.
    pub flood: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            wait: Duration::from_secs(15),
            interval: Duration::from_millis(250),
            flood: Duration::from_secs(2),
        }
    }
}

/// Runs every check against the decode listening at `addr`, as a prefill configured by
/// `config` (same layout, fingerprint and key as the target's), in order; the last check is a
/// correct connection after all the others.
pub async fn run(addr: SocketAddr, config: &NodeConfig, options: Options) -> Vec<Checked> {
    let kit = Kit {
        addr,
        config: config.clone(),
        options,
    };
    let mut out = Vec::new();
    out.push(
        checked(
            "bytes that are not kvwire are closed without a reply",
            "§4.2, §7.2",
            kit.not_kvwire(),
        )
        .await,
    );
    out.push(
        checked(
            "another protocol version is refused with VERSION_MISMATCH",
            "§4.5",
            kit.other_version(),
        )
        .await,
    );
    out.push(
        checked(
            "a peer of the same role is refused with ROLE_MISMATCH",
            "§4.3 #1",
            kit.refused(ErrorCode::ROLE_MISMATCH, |h| h.role = Role::RECEIVER),
        )
        .await,
    );
    out.push(
        checked(
            "another layout is refused with LAYOUT_MISMATCH",
            "§4.3 #2-4",
            kit.refused(ErrorCode::LAYOUT_MISMATCH, other_layout),
        )
        .await,
    );
    out.push(
        checked(
            "another fingerprint is refused with FINGERPRINT_MISMATCH",
            "§4.3 #5",
            kit.refused(ErrorCode::FINGERPRINT_MISMATCH, |h| {
                h.layout.fingerprint = b"kvwire-conformance/another-model".to_vec()
            }),
        )
        .await,
    );
    out.push(
        checked(
            "malformed TCP transport parameters are refused with TRANSPORT_MISMATCH",
            "§4.3 #7, §9.1",
            kit.refused(ErrorCode::TRANSPORT_MISMATCH, |h| {
                h.transport_params = vec![2, 0, 4, 0]
            }),
        )
        .await,
    );
    out.push(
        checked(
            "a peer that says nothing is closed at the handshake timeout",
            "§4.6",
            kit.silent(),
        )
        .await,
    );
    out.push(
        checked(
            "a correct HELLO is accepted and heartbeats follow",
            "§4.2, §8.3",
            kit.heartbeats(),
        )
        .await,
    );
    out.push(
        checked(
            "an unknown frame type ends the connection",
            "§3.10, §7.2",
            kit.after_handshake(Bad::FrameType),
        )
        .await,
    );
    out.push(
        checked(
            "a data record of the wrong length ends the connection",
            "§9.1",
            kit.after_handshake(Bad::DataLength),
        )
        .await,
    );
    out.push(
        checked(
            "an unknown record magic ends the connection",
            "§9.1",
            kit.after_handshake(Bad::Magic),
        )
        .await,
    );
    out.push(
        checked(
            "a PING flood gets at most 16 PONGs per interval (and may be closed)",
            "§8.3",
            kit.ping_flood(),
        )
        .await,
    );
    out.push(
        checked(
            "the listener still serves a correct peer",
            "§4, §7.5",
            kit.correct(),
        )
        .await,
    );
    out
}

/// What a post-handshake check sends.
#[derive(Clone, Copy, Debug)]
enum Bad {
    FrameType,
    DataLength,
    Magic,
}

struct Kit {
    addr: SocketAddr,
    config: NodeConfig,
    options: Options,
}

type Step = Result<Verdict, String>;

impl Kit {
    fn hello(&self) -> Hello {
        let mut h = self.config.hello(Role::SENDER);
        h.transport_params = TcpParams::one_stream(self.config.pool.pages).encode();
        h
    }

    async fn connect(&self) -> Result<TcpStream, String> {
        TcpStream::connect(self.addr)
            .await
            .map_err(|e| format!("connect to {}: {e}", self.addr))
    }

    /// A correct handshake with `hello` as the kit's.
    async fn handshake(
        &self,
        hello: Hello,
    ) -> Result<(TcpStream, kvwire_proto::auth::AuthChannel), EngineError> {
        let s = TcpStream::connect(self.addr).await?;
        let (s, _, channel) = handshake_hello(
            s,
            &self.config,
            true,
            hello,
            None,
            self.options.wait,
            &mut |_| {},
        )
        .await?;
        Ok((s, channel))
    }

    async fn not_kvwire(&self) -> Step {
        let mut s = self.connect().await?;
        s.write_all(b"GET / HTTP/1.0\r\n\r\n")
            .await
            .map_err(|e| e.to_string())?;
        Ok(match until_closed(&mut s, self.options.wait).await {
            (b, true) if b.is_empty() => Verdict::Pass("closed, nothing sent".into()),
            (b, true) => Verdict::Fail(format!("closed after sending {} bytes", b.len())),
            (_, false) => Verdict::Fail(format!(
                "still open after {} s",
                self.options.wait.as_secs()
            )),
        })
    }

    async fn other_version(&self) -> Step {
        let mut bytes = Frame::Hello(self.hello())
            .to_bytes()
            .map_err(|e| e.to_string())?;
        bytes[4..6].copy_from_slice(&1u16.to_le_bytes());
        let n = bytes.len() - 4;
        let crc = crc32fast::hash(&bytes[..n]);
        bytes[n..].copy_from_slice(&crc.to_le_bytes());
        let mut s = self.connect().await?;
        s.write_all(&bytes).await.map_err(|e| e.to_string())?;
        let (got, _) = until_closed(&mut s, self.options.wait).await;
        Ok(match first_frame(&got) {
            Some(Frame::HelloReject(r)) if r.code == ErrorCode::VERSION_MISMATCH => {
                Verdict::Pass(format!("HELLO_REJECT({}): {}", r.code, r.detail))
            }
            other => Verdict::Fail(format!("answered {other:?}")),
        })
    }

    async fn refused(&self, want: ErrorCode, change: impl FnOnce(&mut Hello)) -> Step {
        let mut hello = self.hello();
        change(&mut hello);
        Ok(match self.handshake(hello).await {
            Err(EngineError::Handshake(HandshakeError::RefusedByPeer(r))) if r.code == want => {
                Verdict::Pass(format!("HELLO_REJECT({}): {}", r.code, r.detail))
            }
            Err(e) => Verdict::Fail(format!("wanted HELLO_REJECT({want}), got: {e}")),
            Ok(_) => Verdict::Fail(format!("accepted; wanted HELLO_REJECT({want})")),
        })
    }

    async fn silent(&self) -> Step {
        let mut s = self.connect().await?;
        let start = Instant::now();
        Ok(match until_closed(&mut s, self.options.wait).await {
            (got, true) => {
                let said = match first_frame(&got) {
                    Some(Frame::HelloReject(r)) => format!(", HELLO_REJECT({})", r.code),
                    _ if got.is_empty() => String::new(),
                    _ => format!(", {} bytes", got.len()),
                };
                Verdict::Pass(format!(
                    "closed after {:.1} s{said}",
                    start.elapsed().as_secs_f64()
                ))
            }
            (_, false) => Verdict::Fail(format!(
                "still open after {} s",
                self.options.wait.as_secs()
            )),
        })
    }

    async fn heartbeats(&self) -> Step {
        let (mut s, channel) = self
            .handshake(self.hello())
            .await
            .map_err(|e| e.to_string())?;
        let (mut sealer, mut opener) = channel.split();
        let deadline = tokio::time::Instant::now() + self.options.interval * 8;
        let mut buf = Vec::new();
        let mut chunk = vec![0u8; 16 * 1024];
        loop {
            while let Ok((frame, used)) = opener.open(&buf) {
                buf.drain(..used);
                if let Frame::Ping(token) = frame {
                    let pong = sealer
                        .seal_to_vec(&Frame::Pong(token))
                        .map_err(|e| e.to_string())?;
                    s.write_all(&pong).await.map_err(|e| e.to_string())?;
                    return Ok(Verdict::Pass(format!("PING {token} answered")));
                }
            }
            match tokio::time::timeout_at(deadline, s.read(&mut chunk)).await {
                Err(_) => {
                    return Ok(Verdict::Fail(format!(
                        "no PING within 8 intervals ({} ms)",
                        (self.options.interval * 8).as_millis()
                    )))
                }
                Ok(Ok(0)) | Ok(Err(_)) => {
                    return Ok(Verdict::Fail("closed after the handshake".into()))
                }
                Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    }

    async fn after_handshake(&self, bad: Bad) -> Step {
        if matches!(bad, Bad::FrameType) && self.config.auth.is_on() {
            return Ok(Verdict::Skip(
                "the target authenticates: an unsealed frame would fail authentication first"
                    .into(),
            ));
        }
        let (mut s, _) = self
            .handshake(self.hello())
            .await
            .map_err(|e| e.to_string())?;
        let bytes = match bad {
            Bad::FrameType => unknown_frame_type(),
            Bad::DataLength => {
                let len = self.config.pool.bytes_per_page_index() as u32;
                let header = DataHeader {
                    transfer: kvwire_proto::wire::TransferRef {
                        transfer_id: kvwire_proto::wire::TransferId(1),
                        nonce: 1,
                    },
                    key: crate::memory::AccessKey(0),
                    ordinal: 0,
                    dst_page: 0,
                    len: len.wrapping_add(1),
                };
                header.encode().to_vec()
            }
            Bad::Magic => b"XKCD and then some bytes that mean nothing".to_vec(),
        };
        s.write_all(&bytes).await.map_err(|e| e.to_string())?;
        // The target may send PINGs first; what counts is that it closes.
        Ok(must_close(&mut s, self.options.wait).await)
    }

    async fn ping_flood(&self) -> Step {
        let (s, channel) = self
            .handshake(self.hello())
            .await
            .map_err(|e| e.to_string())?;
        ping_flood(s, channel, self.options).await
    }

    async fn correct(&self) -> Step {
        Ok(match self.handshake(self.hello()).await {
            Ok(_) => Verdict::Pass("HELLO_ACK".into()),
            Err(e) => Verdict::Fail(e.to_string()),
        })
    }
}

/// Floods PINGs on an established connection for `options.flood`, reading nothing, then
/// reads what the target answered: at most 16 PONGs per interval (SPEC §8.3), and whether it
/// closed the connection (a target MAY close a flood).
async fn ping_flood(s: TcpStream, channel: AuthChannel, options: Options) -> Step {
    let (sealer, mut opener) = channel.split();
    let (mut rd, mut wr) = s.into_split();
    let flood = options.flood;
    // Sends PINGs as fast as the socket takes them for `flood`, reading nothing.
    let sending = tokio::spawn(async move {
        let mut sealer: Sealer = sealer;
        let start = Instant::now();
        let mut sent = 0u64;
        let mut batch = Vec::with_capacity(64 * 1024);
        while start.elapsed() < flood {
            batch.clear();
            for _ in 0..1000 {
                sent += 1;
                match sealer.seal_to_vec(&Frame::Ping(sent)) {
                    Ok(b) => batch.extend_from_slice(&b),
                    Err(_) => return (sent, false, wr),
                }
            }
            match tokio::time::timeout(flood, wr.write_all(&batch)).await {
                Ok(Ok(())) => {}
                // Closed by the target, or it stopped reading: either is allowed.
                _ => return (sent, true, wr),
            }
        }
        (sent, false, wr)
    });
    // The write half is kept open while the answers are read: dropping it would end the
    // stream, and a target closing then would not show that it closed the flood.
    let (sent, cut, _wr) = sending.await.map_err(|e| e.to_string())?;
    let elapsed = flood + options.interval;
    // What the target answered, read only now.
    let mut got = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    let deadline = tokio::time::Instant::now() + options.interval * 4;
    let closed = loop {
        match tokio::time::timeout_at(deadline, rd.read(&mut chunk)).await {
            Err(_) => break false,
            Ok(Ok(0)) | Ok(Err(_)) => break true,
            Ok(Ok(n)) => got.extend_from_slice(&chunk[..n]),
        }
    };
    let mut pongs = 0u64;
    let mut at = 0;
    while let Ok((frame, used)) = opener.open(&got[at..]) {
        at += used;
        pongs += u64::from(matches!(frame, Frame::Pong(_)));
    }
    let intervals = (elapsed.as_secs_f64() / options.interval.as_secs_f64()).ceil() as u64 + 4;
    let bound = 16 * intervals;
    let seen = format!(
        "{sent} PINGs sent{}, {pongs} PONGs back{}",
        if cut {
            " (the target stopped taking them)"
        } else {
            ""
        },
        if closed {
            ", then closed"
        } else {
            ", still open"
        }
    );
    Ok(if pongs <= bound {
        Verdict::Pass(format!("{seen} (bound {bound})"))
    } else {
        Verdict::Fail(format!("{seen}: more than {bound}"))
    })
}

/// Reads until the target closes the connection or `wait` passes: the bytes, and whether
/// it closed (end of stream or a reset).
async fn until_closed(
    s: &mut (impl tokio::io::AsyncRead + Unpin),
    wait: Duration,
) -> (Vec<u8>, bool) {
    let deadline = tokio::time::Instant::now() + wait;
    let mut got = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Err(_) => return (got, false),
            Ok(Ok(0)) | Ok(Err(_)) => return (got, true),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

/// Whether the target closes the connection within `wait` (whatever it sends first).
async fn must_close(s: &mut (impl tokio::io::AsyncRead + Unpin), wait: Duration) -> Verdict {
    match until_closed(s, wait).await {
        (_, true) => Verdict::Pass("closed".into()),
        (_, false) => Verdict::Fail(format!("still open after {} s", wait.as_secs())),
    }
}

/// A frame of a type no version of the protocol defines (SPEC §3.6), unsealed.
fn unknown_frame_type() -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&MAGIC);
    b.extend_from_slice(&kvwire_proto::wire::VERSION.to_le_bytes());
    b.extend_from_slice(&0x7a7au16.to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes());
    let crc = crc32fast::hash(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    b
}

/// The kit's hello with another layout: buffer 0's page bytes doubled.
fn other_layout(h: &mut Hello) {
    if let Some(b) = h.layout.buffer_page_bytes.first_mut() {
        *b = b.wrapping_mul(2).max(1);
    }
}

/// One check: its outcome, a step that could not run counted as its failure.
async fn checked(
    name: &'static str,
    spec: &'static str,
    step: impl std::future::Future<Output = Step>,
) -> Checked {
    Checked {
        name,
        spec,
        verdict: step.await.unwrap_or_else(Verdict::Fail),
    }
}

/// The first frame (unauthenticated: HELLO_REJECT is never sealed) in `bytes`.
fn first_frame(bytes: &[u8]) -> Option<Frame> {
    Frame::decode(bytes).ok().map(|(f, _)| f)
}
