//! The kit's other half: a scripted decode that any implementation's prefill connects to
//! (`kvwire conform --listen ADDR`, then the prefill's `--connect ADDR`, run again each time
//! it is closed). Each check takes one connection: how the prefill's HELLO reads, what it
//! does with a refusal, a HELLO_ACK it must refuse and a server that never answers, and after
//! a correct handshake the rules a sender follows whatever its peer sends: heartbeats, an
//! ABORT for a transfer it does not know, reservations it has no request for (parked, then
//! refused; their number bounded), a frame only a sender sends, a PING flood; and last, that
//! it still connects. The prefill must keep connecting until the kit is done, and its
//! handshake timeout must be shorter than the kit's `wait`.

use std::time::{Duration, Instant};

use kvwire_proto::auth::{OpenError, Opener, Sealer};
use kvwire_proto::handshake::HandshakeError;
use kvwire_proto::wire::{
    Abort, DecodeError, DigestAlgorithm, ErrorCode, Frame, Hello, HelloReject, Reject, Reserve,
    Role, TransferId, TransferRef,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};

use super::{
    checked, first_frame, must_close, other_layout, ping_flood, unknown_frame_type, until_closed,
    Checked, Options, Step, Verdict,
};
use crate::config::NodeConfig;
use crate::engine::{handshake_hello, EngineError, Handshaken};
use crate::transport::tcp::TcpParams;

/// Transfer ids the kit names in its frames: far from any a workload picks, so that the
/// prefill has no request for them.
const KIT_IDS: u64 = 0x6b76_636f_6e66_0000;

/// Reservations the kit sends for requests the prefill does not have, to find its bound on
/// parked reservations (SPEC §5.1: a sender MUST bound them; kvwire's default is 256).
const RESERVATIONS_TO_PARK: u64 = 5_000;

/// Runs every check against the prefills that connect to `listener`, as a decode configured
/// by `config` (same layout, fingerprint and key as the prefill's), one accepted connection
/// per check, in order; the last is a correct handshake after all the others.
pub async fn run_prefill(
    listener: &TcpListener,
    config: &NodeConfig,
    options: Options,
) -> Vec<Checked> {
    let kit = Kit {
        listener,
        config: config.clone(),
        options,
    };
    let mut out = Vec::new();
    out.push(
        checked(
            "its HELLO is a sender's of the same layout and a handshake completes",
            "§3.5.1, §4.2, §4.3",
            kit.handshakes(),
        )
        .await,
    );
    out.push(
        checked(
            "a HELLO_REJECT ends its attempt: it closes",
            "§4.2",
            kit.takes_a_refusal(),
        )
        .await,
    );
    out.push(
        checked(
            "a HELLO_ACK of another layout is refused with LAYOUT_MISMATCH",
            "§4.2, §4.3 #2-4",
            kit.refuses_the_ack(ErrorCode::LAYOUT_MISMATCH, other_layout),
        )
        .await,
    );
    out.push(
        checked(
            "a HELLO_ACK of a sender is refused with ROLE_MISMATCH",
            "§4.2, §4.3 #1",
            kit.refuses_the_ack(ErrorCode::ROLE_MISMATCH, |h| h.role = Role::SENDER),
        )
        .await,
    );
    out.push(
        checked(
            "a server that never answers is given up at the handshake timeout",
            "§4.6",
            kit.silent_server(),
        )
        .await,
    );
    out.push(
        checked(
            "a PING is answered with a PONG of its token",
            "§8.3",
            kit.answers_a_ping(),
        )
        .await,
    );
    out.push(
        checked(
            "an ABORT for a transfer it does not know is answered with ABORT_ACK of that ref",
            "§7.3",
            kit.acks_an_unknown_abort(),
        )
        .await,
    );
    out.push(
        checked(
            "a RESERVE for a request it does not have is parked, then refused UNKNOWN_REQUEST",
            "§5.1",
            kit.refuses_an_unknown_reservation(),
        )
        .await,
    );
    out.push(
        checked(
            "its parked reservations are bounded: REJECT(PARKED_LIMIT) beyond them",
            "§5.1",
            kit.bounds_parked_reservations(),
        )
        .await,
    );
    out.push(
        checked(
            "a REJECT (a frame only a sender sends) ends the connection",
            "§7.3",
            kit.closes_on_a_senders_frame(),
        )
        .await,
    );
    out.push(
        checked(
            "an unknown frame type ends the connection",
            "§3.10, §7.2",
            kit.closes_on_an_unknown_frame_type(),
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
            "it still connects and completes a handshake",
            "§4, §7.5",
            kit.handshakes(),
        )
        .await,
    );
    out
}

/// kvwire's own prefill as [`run_prefill`]'s target: connects to `addr` as `node`, and again
/// each time a check ended its connection (or refused it), until `stop` is set; how each
/// connection it completed ended.
pub async fn reconnecting_prefill(
    addr: std::net::SocketAddr,
    node: crate::engine::Node,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> Vec<Option<crate::transport::Closed>> {
    use std::sync::atomic::Ordering;
    let mut reasons = Vec::new();
    while !stop.load(Ordering::SeqCst) {
        match crate::engine::SenderConn::connect(addr, &node).await {
            Ok(c) => {
                while !c.is_closed() && !stop.load(Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                reasons.push(c.closed_reason());
            }
            // Refused, or the kit said nothing: connect again.
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    reasons
}

struct Kit<'a> {
    listener: &'a TcpListener,
    config: NodeConfig,
    options: Options,
}

/// Frames as they arrive on a connection's read side, opened as the handshake set up.
struct FrameReader {
    rd: OwnedReadHalf,
    opener: Opener,
    buf: Vec<u8>,
}

/// What [`FrameReader::read_frame`] found.
enum Next {
    Frame(Frame),
    Closed,
    TimedOut,
}

impl FrameReader {
    /// The next frame (PING and PONG included), the connection's end, or `deadline`. A
    /// frame that fails to open ends the check.
    async fn read_frame(&mut self, deadline: tokio::time::Instant) -> Result<Next, String> {
        let mut chunk = vec![0u8; 64 * 1024];
        loop {
            match self.opener.open(&self.buf) {
                Ok((frame, used)) => {
                    self.buf.drain(..used);
                    return Ok(Next::Frame(frame));
                }
                Err(OpenError::Decode(DecodeError::Incomplete { .. })) => {}
                Err(e) => return Err(format!("a frame from the prefill did not open: {e}")),
            }
            match tokio::time::timeout_at(deadline, self.rd.read(&mut chunk)).await {
                Err(_) => return Ok(Next::TimedOut),
                Ok(Ok(0)) | Ok(Err(_)) => return Ok(Next::Closed),
                Ok(Ok(n)) => self.buf.extend_from_slice(&chunk[..n]),
            }
        }
    }
}

/// An established connection with the prefill: frames sealed and opened as the handshake
/// set up, its PINGs answered while the kit waits for something else.
struct Conn {
    reader: FrameReader,
    wr: OwnedWriteHalf,
    sealer: Sealer,
    digest: DigestAlgorithm,
}

impl Conn {
    async fn send(&mut self, frame: &Frame) -> Result<(), String> {
        let bytes = self.sealer.seal_to_vec(frame).map_err(|e| e.to_string())?;
        self.wr
            .write_all(&bytes)
            .await
            .map_err(|e| format!("write: {e}"))
    }

    /// The next frame other than PING (answered) and PONG, the connection's end, or
    /// `deadline`.
    async fn next(&mut self, deadline: tokio::time::Instant) -> Result<Next, String> {
        loop {
            match self.reader.read_frame(deadline).await? {
                Next::Frame(Frame::Ping(token)) => self.send(&Frame::Pong(token)).await?,
                Next::Frame(Frame::Pong(_)) => {}
                other => return Ok(other),
            }
        }
    }

    /// Waits for a frame `want` accepts, answering PINGs; what came instead otherwise.
    async fn expect(
        &mut self,
        wait: Duration,
        mut want: impl FnMut(&Frame) -> bool,
    ) -> Result<Result<Frame, String>, String> {
        let deadline = tokio::time::Instant::now() + wait;
        let mut other = Vec::new();
        loop {
            match self.next(deadline).await? {
                Next::Frame(f) if want(&f) => return Ok(Ok(f)),
                Next::Frame(f) => other.push(frame_name(&f)),
                Next::Closed => return Ok(Err(format!("closed (after {other:?})"))),
                Next::TimedOut => {
                    return Ok(Err(format!(
                        "nothing within {} ms (frames seen: {other:?})",
                        wait.as_millis()
                    )))
                }
            }
        }
    }
}

impl Kit<'_> {
    /// The kit's HELLO_ACK body: a receiver of the kit's layout, TCP over one stream.
    fn hello(&self) -> Hello {
        let mut h = self.config.hello(Role::RECEIVER);
        h.transport_params = TcpParams::one_stream(self.config.pool.pages).encode();
        h
    }

    /// The prefill's next connection.
    async fn accept(&self) -> Result<TcpStream, String> {
        match tokio::time::timeout(self.options.wait, self.listener.accept()).await {
            Ok(Ok((s, _))) => Ok(s),
            Ok(Err(e)) => Err(format!("accept: {e}")),
            Err(_) => Err(format!(
                "no connection from the prefill within {} s (it must connect again after each check)",
                self.options.wait.as_secs()
            )),
        }
    }

    /// A correct handshake, as a decode, with the prefill's next connection.
    async fn handshake(&self) -> Result<Handshaken, String> {
        let s = self.accept().await?;
        handshake_hello(
            s,
            &self.config,
            false,
            self.hello(),
            None,
            self.options.wait,
            &mut |_| {},
        )
        .await
        .map_err(|e| match e {
            EngineError::Handshake(HandshakeError::RefusedByPeer(r)) => {
                format!("refused: {}: {}", r.code, r.detail)
            }
            e => format!("handshake: {e}"),
        })
    }

    /// A correct handshake with the prefill's next connection, ready for frames.
    async fn established(&self) -> Result<Conn, String> {
        let (s, est, channel) = self.handshake().await?;
        let digest = *est
            .digests
            .first()
            .ok_or("the handshake settled on no digest algorithm")?;
        let (sealer, opener) = channel.split();
        let (rd, wr) = s.into_split();
        Ok(Conn {
            reader: FrameReader {
                rd,
                opener,
                buf: Vec::new(),
            },
            wr,
            sealer,
            digest,
        })
    }

    /// The prefill's next connection and its first bytes (its HELLO, sealed where the kit's
    /// configuration authenticates).
    async fn first_bytes(&self) -> Result<(TcpStream, Vec<u8>), String> {
        let mut s = self.accept().await?;
        let mut buf = vec![0u8; 64 * 1024];
        match tokio::time::timeout(self.options.wait, s.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => Ok((s, buf[..n].to_vec())),
            Ok(_) => Err("closed before its HELLO".into()),
            Err(_) => Err(format!("no HELLO within {} s", self.options.wait.as_secs())),
        }
    }

    async fn handshakes(&self) -> Step {
        let conn = self.established().await?;
        Ok(Verdict::Pass(format!(
            "HELLO accepted (digest {:?}{})",
            conn.digest,
            if self.config.auth.is_on() {
                ", authenticated"
            } else {
                ""
            }
        )))
    }

    async fn takes_a_refusal(&self) -> Step {
        let (mut s, _) = self.first_bytes().await?;
        let reject = Frame::HelloReject(HelloReject {
            code: ErrorCode::FINGERPRINT_MISMATCH,
            detail: "the conformance kit refuses this connection".into(),
        });
        s.write_all(&reject.to_bytes().map_err(|e| e.to_string())?)
            .await
            .map_err(|e| e.to_string())?;
        Ok(match until_closed(&mut s, self.options.wait).await {
            (b, true) if b.is_empty() => Verdict::Pass("closed, nothing more sent".into()),
            (b, true) => Verdict::Pass(format!("closed ({} more bytes sent first)", b.len())),
            (_, false) => Verdict::Fail(format!(
                "still open {} s after HELLO_REJECT",
                self.options.wait.as_secs()
            )),
        })
    }

    async fn refuses_the_ack(&self, want: ErrorCode, change: impl FnOnce(&mut Hello)) -> Step {
        if self.config.auth.is_on() {
            return Ok(Verdict::Skip(
                "the prefill authenticates: a HELLO_ACK the kit writes itself would fail authentication first"
                    .into(),
            ));
        }
        let (mut s, mut first) = self.first_bytes().await?;
        // The whole HELLO, however the network split it.
        let deadline = tokio::time::Instant::now() + self.options.wait;
        let mut chunk = vec![0u8; 64 * 1024];
        loop {
            match Frame::decode(&first) {
                Ok((Frame::Hello(_), _)) => break,
                Err(DecodeError::Incomplete { .. }) => {}
                other => return Ok(Verdict::Fail(format!("its first frame: {other:?}"))),
            }
            match tokio::time::timeout_at(deadline, s.read(&mut chunk)).await {
                Ok(Ok(n)) if n > 0 => first.extend_from_slice(&chunk[..n]),
                _ => return Ok(Verdict::Fail("no whole HELLO".into())),
            }
        }
        let mut ack = self.hello();
        change(&mut ack);
        s.write_all(&Frame::HelloAck(ack).to_bytes().map_err(|e| e.to_string())?)
            .await
            .map_err(|e| e.to_string())?;
        let (got, closed) = until_closed(&mut s, self.options.wait).await;
        Ok(match first_frame(&got) {
            Some(Frame::HelloReject(r)) if r.code == want => Verdict::Pass(format!(
                "HELLO_REJECT({}): {}{}",
                r.code,
                r.detail,
                if closed { ", closed" } else { "" }
            )),
            other => Verdict::Fail(format!(
                "wanted HELLO_REJECT({want}), got {other:?}{}",
                if closed { ", closed" } else { "" }
            )),
        })
    }

    async fn silent_server(&self) -> Step {
        let (mut s, _) = self.first_bytes().await?;
        let start = Instant::now();
        Ok(match until_closed(&mut s, self.options.wait).await {
            (got, true) => Verdict::Pass(format!(
                "closed after {:.1} s{}",
                start.elapsed().as_secs_f64(),
                match first_frame(&got) {
                    Some(Frame::HelloReject(r)) => format!(", HELLO_REJECT({})", r.code),
                    _ => String::new(),
                }
            )),
            (_, false) => Verdict::Fail(format!(
                "still waiting after {} s",
                self.options.wait.as_secs()
            )),
        })
    }

    async fn answers_a_ping(&self) -> Step {
        let mut conn = self.established().await?;
        let token = 0x6b76_7069_6e67_0001;
        conn.send(&Frame::Ping(token)).await?;
        let deadline = tokio::time::Instant::now() + self.options.wait;
        let mut its_pings = 0;
        // Read here, not by `next`, which drops PONGs.
        loop {
            match conn.reader.read_frame(deadline).await? {
                Next::Frame(Frame::Pong(t)) if t == token => {
                    return Ok(Verdict::Pass(format!(
                        "PONG {token:#x} ({its_pings} PINGs of its own meanwhile)"
                    )))
                }
                Next::Frame(Frame::Ping(t)) => {
                    its_pings += 1;
                    conn.send(&Frame::Pong(t)).await?;
                }
                Next::Frame(_) => {}
                Next::TimedOut => return Ok(Verdict::Fail("no PONG".into())),
                Next::Closed => return Ok(Verdict::Fail("closed".into())),
            }
        }
    }

    async fn acks_an_unknown_abort(&self) -> Step {
        let mut conn = self.established().await?;
        let named = TransferRef {
            transfer_id: TransferId(KIT_IDS + 1),
            nonce: 0x1234,
        };
        conn.send(&Frame::Abort(Abort {
            transfer: named,
            code: ErrorCode::CANCELLED,
            completed_pages: 0,
            detail: "the conformance kit".into(),
        }))
        .await?;
        Ok(
            match conn
                .expect(self.options.wait, |f| matches!(f, Frame::AbortAck(_)))
                .await?
            {
                Ok(Frame::AbortAck(r)) if r == named => Verdict::Pass("ABORT_ACK, same ref".into()),
                Ok(other) => Verdict::Fail(format!("ABORT_ACK of another ref: {other:?}")),
                Err(e) => Verdict::Fail(e),
            },
        )
    }

    fn reserve(&self, conn: &Conn, id: u64, deadline_ms: u32) -> Frame {
        Frame::Reserve(Reserve {
            transfer_id: TransferId(id),
            nonce: id ^ 0x5a5a,
            tokens: self.config.pool.tokens_per_page,
            digest: conn.digest,
            page_digests: false,
            deadline_ms,
            pages: vec![0],
            access: vec![0; 4],
        })
    }

    async fn refuses_an_unknown_reservation(&self) -> Step {
        let mut conn = self.established().await?;
        let deadline_ms = 500;
        let reserve = self.reserve(&conn, KIT_IDS + 2, deadline_ms);
        let Frame::Reserve(ref r) = reserve else {
            unreachable!()
        };
        let named = TransferRef {
            transfer_id: r.transfer_id,
            nonce: r.nonce,
        };
        let sent = Instant::now();
        conn.send(&reserve).await?;
        // Parked until 1 s after its deadline (SPEC §5.1), then refused.
        let wait = Duration::from_millis(u64::from(deadline_ms) + 1000) + self.options.wait;
        Ok(
            match conn.expect(wait, |f| matches!(f, Frame::Reject(_))).await? {
                Ok(Frame::Reject(j))
                    if j.transfer == named && j.code == ErrorCode::UNKNOWN_REQUEST =>
                {
                    Verdict::Pass(format!(
                        "REJECT(UNKNOWN_REQUEST) {:.1} s after the RESERVE",
                        sent.elapsed().as_secs_f64()
                    ))
                }
                Ok(other) => {
                    Verdict::Fail(format!("wanted REJECT(UNKNOWN_REQUEST), got {other:?}"))
                }
                Err(e) => Verdict::Fail(e),
            },
        )
    }

    async fn bounds_parked_reservations(&self) -> Step {
        let mut conn = self.established().await?;
        // Long deadlines: none expires while the kit counts.
        let mut frames = Vec::new();
        for i in 0..RESERVATIONS_TO_PARK {
            let f = self.reserve(&conn, KIT_IDS + 0x1_0000 + i, 60_000);
            frames.extend(conn.sealer.seal_to_vec(&f).map_err(|e| e.to_string())?);
        }
        // Written by a task while this one reads, so that the prefill's refusals cannot
        // back up against a kit that is still writing.
        let Conn {
            mut reader, mut wr, ..
        } = conn;
        let writing = tokio::spawn(async move {
            let r = wr.write_all(&frames).await;
            (r, wr)
        });
        let deadline = tokio::time::Instant::now() + self.options.wait;
        let mut other = 0u64;
        let verdict = loop {
            match reader.read_frame(deadline).await? {
                Next::Frame(Frame::Reject(j)) if j.code == ErrorCode::PARKED_LIMIT => {
                    break Verdict::Pass(format!(
                        "REJECT(PARKED_LIMIT) after {} RESERVEs it had no request for",
                        (j.transfer.transfer_id.0 - KIT_IDS - 0x1_0000) + 1
                    ));
                }
                // Its PINGs go unanswered here: the RESERVEs keep it hearing the kit.
                Next::Frame(Frame::Ping(_) | Frame::Pong(_)) => {}
                Next::Frame(_) => other += 1,
                Next::Closed | Next::TimedOut => {
                    break Verdict::Fail(format!(
                        "{RESERVATIONS_TO_PARK} RESERVEs it had no request for and no REJECT(PARKED_LIMIT) ({other} other frames)"
                    ))
                }
            }
        };
        drop(reader);
        let _ = tokio::time::timeout(self.options.wait, writing).await;
        Ok(verdict)
    }

    async fn closes_on_a_senders_frame(&self) -> Step {
        let mut conn = self.established().await?;
        conn.send(&Frame::Reject(Reject {
            transfer: TransferRef {
                transfer_id: TransferId(KIT_IDS + 3),
                nonce: 1,
            },
            code: ErrorCode::CANCELLED,
            detail: "a decode never sends this".into(),
        }))
        .await?;
        Ok(must_close(&mut conn.reader.rd, self.options.wait).await)
    }

    async fn closes_on_an_unknown_frame_type(&self) -> Step {
        if self.config.auth.is_on() {
            return Ok(Verdict::Skip(
                "the prefill authenticates: an unsealed frame would fail authentication first"
                    .into(),
            ));
        }
        let mut conn = self.established().await?;
        conn.wr
            .write_all(&unknown_frame_type())
            .await
            .map_err(|e| e.to_string())?;
        Ok(must_close(&mut conn.reader.rd, self.options.wait).await)
    }

    async fn ping_flood(&self) -> Step {
        let (s, _, channel) = self.handshake().await?;
        ping_flood(s, channel, self.options).await
    }
}

/// A frame's type, for what a check saw instead.
fn frame_name(f: &Frame) -> String {
    let s = format!("{f:?}");
    s.split(['(', ' ', '{'])
        .next()
        .unwrap_or_default()
        .to_string()
}
