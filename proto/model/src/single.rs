//! One session driven by arbitrary input: the fuzz targets (`fuzz/fuzz_targets/`) and the
//! regression tests feed [`run_sender`] / [`run_receiver`] raw bytes, which are read as a
//! program of operations: peer frames (built from the bytes with small ids and nonces so
//! they collide with the session's own, or decoded from raw bytes), write outcomes, fence
//! and digest completions, local aborts, time passing and connection loss. After every
//! operation the driver models check the safety invariants ([`crate::driver`]); at the
//! end every pending effect is completed, time is driven far forward, and every transfer
//! must have ended with its pages and source returned.

use kvwire_proto::wire::TransferId;
use std::time::{Duration, Instant};

use kvwire_proto::admission::{AdmissionPolicy, Request};
use kvwire_proto::receiver::{ReceiverAction, ReceiverConfig, ReceiverSession, ReservationRequest};
use kvwire_proto::sender::{SenderConfig, SenderSession, WriteOutcome};
use kvwire_proto::wire::{
    Abort, Commit, Digest128, DigestAlgorithm, ErrorCode, Frame, HelloReject, Nack, Reject,
    Reserve, Role, TransferRef,
};
use kvwire_proto::{FrameError, Scope};

use crate::digest;
use crate::driver::{RxDriver, TxDriver};
use crate::{ensure, established, layout, Violation, TOKENS_PER_PAGE};

/// Reads the fuzz input; yields zeros once it is exhausted.
struct Bytes<'a> {
    data: &'a [u8],
}

impl Bytes<'_> {
    fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
    fn u8(&mut self) -> u8 {
        match self.data.split_first() {
            Some((&b, rest)) => {
                self.data = rest;
                b
            }
            None => 0,
        }
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }
    fn u64(&mut self) -> u64 {
        u64::from(self.u32()) | (u64::from(self.u32()) << 32)
    }
    fn take(&mut self, n: usize) -> Vec<u8> {
        let n = n.min(self.data.len());
        let (a, b) = self.data.split_at(n);
        self.data = b;
        a.to_vec()
    }
    fn bool(&mut self) -> bool {
        self.u8() & 1 == 1
    }
    /// A transfer id in 1..=4.
    fn id(&mut self) -> TransferId {
        TransferId(u64::from(self.u8() % 4) + 1)
    }
    fn code(&mut self) -> ErrorCode {
        const CODES: [ErrorCode; 6] = [
            ErrorCode::CANCELLED,
            ErrorCode::TIMEOUT,
            ErrorCode::STALE_NONCE,
            ErrorCode::WRITE_FAILED,
            ErrorCode::DIGEST_MISMATCH,
            ErrorCode::SHUTDOWN,
        ];
        let b = self.u8();
        CODES
            .get(usize::from(b % 8))
            .copied()
            .unwrap_or(ErrorCode(u16::from(b)))
    }
    fn digest(&mut self) -> DigestAlgorithm {
        DigestAlgorithm(self.u8() % 4)
    }
}

fn frame_error(result: Result<(), FrameError>) -> bool {
    matches!(result, Err(e) if e.scope == Scope::Connection)
}

/// Every frame a session emits must be encodable.
fn check_encodes(frame: &Frame) -> Result<(), Violation> {
    match frame.to_bytes() {
        Ok(bytes) => {
            let back = Frame::decode(&bytes);
            ensure!(
                matches!(back, Ok((_, n)) if n == bytes.len()),
                "emitted frame does not decode: {frame:?}: {back:?}"
            );
            Ok(())
        }
        Err(e) => Err(Violation(format!(
            "emitted frame cannot be encoded: {e}: {frame:?}"
        ))),
    }
}

// ---- sender ------------------------------------------------------------------------------

struct SenderRig {
    now: Instant,
    s: SenderSession,
    tx: TxDriver,
    buffers: usize,
}

impl SenderRig {
    fn pump(&mut self) -> Result<(), Violation> {
        while let Some(a) = self.s.poll_action() {
            self.tx.apply(a)?;
        }
        while let Some(e) = self.s.poll_event() {
            self.tx.event(&e)?;
        }
        while let Some(f) = self.s.poll_transmit() {
            check_encodes(&f)?;
        }
        Ok(())
    }

    fn frame(&mut self, f: Frame) {
        if frame_error(self.s.handle_frame(self.now, f)) {
            // The driver closes the connection and reports the loss (SPEC §7.1).
            self.s.handle_peer_lost(self.now);
        }
    }

    fn nonce(&mut self, b: &mut Bytes<'_>) -> u64 {
        match b.u8() % 8 {
            7 => b.u64(),
            n => u64::from(n % 4),
        }
    }

    fn tref(&mut self, b: &mut Bytes<'_>) -> TransferRef {
        TransferRef {
            transfer_id: b.id(),
            nonce: self.nonce(b),
        }
    }

    fn step(&mut self, b: &mut Bytes<'_>) -> Result<(), Violation> {
        match b.u8() % 13 {
            0 => {
                let policy = AdmissionPolicy {
                    tokens_per_page: TOKENS_PER_PAGE,
                    pool_pages: 4,
                    max_context_tokens: 64,
                };
                let transfer_id = b.id();
                let tokens = u64::from(b.u8() % 80);
                match policy.admit(Request {
                    transfer_id,
                    tokens,
                }) {
                    Ok(a) => {
                        let pages = a.pages();
                        // Whole, or opened for chunks that later operations submit.
                        let ok = if b.u8() % 3 == 0 {
                            self.s.open(self.now, a).is_ok()
                        } else {
                            self.s.submit(self.now, a, (0..pages).collect()).is_ok()
                        };
                        if ok {
                            self.tx.submit(transfer_id, pages);
                        }
                    }
                    Err(rejected) => {
                        let _ = self.s.retire(rejected);
                    }
                }
            }
            1 => {
                let t = self.tref(b);
                let n = usize::from(b.u8() % 6);
                let r = Reserve {
                    transfer_id: t.transfer_id,
                    nonce: t.nonce,
                    tokens: u32::from(b.u8() % 80),
                    digest: b.digest(),
                    page_digests: b.bool(),
                    deadline_ms: u32::from(b.u8()) * 4,
                    pages: (0..n).map(|_| u32::from(b.u8() % 8)).collect(),
                    access: {
                        let n = usize::from(b.u8() % 5);
                        b.take(n)
                    },
                };
                self.frame(Frame::Reserve(r));
            }
            2 => {
                let t = self.tref(b);
                self.frame(Frame::Verified(t));
            }
            3 => {
                let t = self.tref(b);
                let n = Nack {
                    transfer: t,
                    code: b.code(),
                    buffer: b.u32(),
                    page: b.u32(),
                    detail: "fuzz".into(),
                };
                self.frame(Frame::Nack(n));
            }
            4 => {
                let t = self.tref(b);
                let a = Abort {
                    transfer: t,
                    code: b.code(),
                    completed_pages: b.u32(),
                    detail: String::new(),
                };
                self.frame(Frame::Abort(a));
            }
            5 => {
                let t = self.tref(b);
                self.frame(Frame::AbortAck(t));
            }
            6 => {
                let t = self.tref(b);
                let f = match b.u8() % 3 {
                    0 => Frame::Reject(Reject {
                        transfer: t,
                        code: b.code(),
                        detail: String::new(),
                    }),
                    1 => Frame::HelloReject(HelloReject {
                        code: b.code(),
                        detail: String::new(),
                    }),
                    _ => Frame::Commit(Commit {
                        transfer: t,
                        tokens: 16,
                        pages: 1,
                        bytes: 96,
                        digest: DigestAlgorithm::XXH3_64,
                        buffer_digests: vec![Digest128::from_u128(1); 2],
                        page_digests: vec![],
                        aux_digest: Digest128::from_u128(1),
                        aux: vec![],
                    }),
                };
                self.frame(f);
            }
            7 => {
                let n = usize::from(b.u8());
                let raw = b.take(n);
                if let Ok((f, _)) = Frame::decode(&raw) {
                    self.frame(f);
                }
            }
            8 => {
                if !self.tx.writes.is_empty() {
                    let i = usize::from(b.u8()) % self.tx.writes.len();
                    let w = self.tx.take_write(i);
                    let outcome = match b.u8() % 4 {
                        0 | 1 => WriteOutcome::Completed,
                        2 => WriteOutcome::Failed,
                        _ => WriteOutcome::Cancelled,
                    };
                    self.s
                        .handle_write_outcome(self.now, w.transfer, outcome, 1);
                }
            }
            9 => {
                if !self.tx.digest_jobs.is_empty() {
                    let i = usize::from(b.u8()) % self.tx.digest_jobs.len();
                    self.complete_digests(i);
                }
            }
            10 => {
                let id = b.id();
                let code = b.code();
                self.s.abort(self.now, id, code);
            }
            11 => {
                self.now += Duration::from_millis(u64::from(b.u16()));
                self.s.handle_timeout(self.now);
            }
            _ => match b.u8() % 4 {
                0 => self.s.handle_peer_lost(self.now),
                1 | 2 => {
                    // The next chunk of an opened transfer (or a bad one: the session
                    // refuses it with a typed error and nothing changes).
                    let id = b.id();
                    let n = u32::from(b.u8() % 4);
                    let aux = match b.u8() % 4 {
                        0 => None,
                        k => Some(vec![k; usize::from(b.u8() % 12)]),
                    };
                    let _ = self.s.submit_chunk(self.now, id, (0..n).collect(), aux);
                }
                _ => {}
            },
        }
        self.pump()
    }

    fn complete_digests(&mut self, i: usize) {
        match self.tx.complete_digests(i, self.buffers) {
            (t, Some(d)) => self.s.handle_digests(self.now, t, d),
            (t, None) => self.s.handle_chunk_digested(self.now, t),
        }
    }

    /// Completes every pending effect and drives time far forward.
    fn settle(&mut self) -> Result<(), Violation> {
        for _ in 0..64 {
            while !self.tx.writes.is_empty() {
                let w = self.tx.take_write(0);
                self.s
                    .handle_write_outcome(self.now, w.transfer, WriteOutcome::Completed, 1);
                self.pump()?;
            }
            while !self.tx.digest_jobs.is_empty() {
                self.complete_digests(0);
                self.pump()?;
            }
            match self.s.poll_timeout() {
                Some(at) => {
                    self.now = self.now.max(at);
                    self.s.handle_timeout(self.now);
                    self.pump()?;
                }
                None if self.tx.writes.is_empty() && self.tx.digest_jobs.is_empty() => break,
                None => {}
            }
        }
        ensure!(
            self.s.open_transfers() == 0,
            "{} sender transfers still open after every effect completed and every deadline passed",
            self.s.open_transfers()
        );
        self.tx.check_quiescent()
    }
}

/// Runs the sender session on the operations in `data`; `Err` is a broken invariant.
/// Panics inside the session propagate (the fuzzer reports them as crashes).
pub fn run_sender(data: &[u8]) -> Result<(), Violation> {
    let mut rig = SenderRig {
        now: Instant::now(),
        s: SenderSession::new(
            &established(Role::SENDER),
            SenderConfig {
                reservation_timeout: Duration::from_millis(500),
                parked_reservation_timeout: Duration::from_millis(100),
                verdict_timeout: Duration::from_millis(300),
                abort_ack_timeout: Duration::from_millis(100),
                history: 3,
                max_parked: 2,
            },
        ),
        tx: TxDriver::default(),
        buffers: layout().buffers(),
    };
    let mut b = Bytes { data };
    while !b.is_empty() {
        rig.step(&mut b)?;
    }
    rig.settle()
}

// ---- receiver ----------------------------------------------------------------------------

struct ReceiverRig {
    now: Instant,
    r: ReceiverSession,
    rx: RxDriver,
    /// Every reservation made, in order (for nonces to reuse).
    refs: Vec<TransferRef>,
}

impl ReceiverRig {
    fn pump(&mut self, commit: Option<Commit>) -> Result<(), Violation> {
        let actions: Vec<ReceiverAction> = std::iter::from_fn(|| self.r.poll_action()).collect();
        if let Some(c) = commit {
            let t = c.transfer;
            if actions.contains(&ReceiverAction::Fence(t))
                && !actions.contains(&ReceiverAction::Quarantine(t))
            {
                self.rx.accept(c);
            }
        }
        for a in actions {
            self.rx.apply(a)?;
        }
        while let Some(e) = self.r.poll_event() {
            self.rx.event(&e, None)?;
        }
        while let Some(f) = self.r.poll_transmit() {
            check_encodes(&f)?;
        }
        Ok(())
    }

    fn frame(&mut self, f: Frame) -> Result<(), Violation> {
        let commit = match &f {
            Frame::Commit(c) => Some(c.clone()),
            _ => None,
        };
        let lost = frame_error(self.r.handle_frame(self.now, f));
        self.pump(commit)?;
        if lost {
            self.r.handle_peer_lost(self.now);
        }
        Ok(())
    }

    fn tref(&mut self, b: &mut Bytes<'_>) -> TransferRef {
        let transfer_id = b.id();
        let mine: Vec<TransferRef> = self
            .refs
            .iter()
            .filter(|t| t.transfer_id == transfer_id)
            .copied()
            .collect();
        let nonce = match b.u8() % 6 {
            0..=2 => mine.last().map_or(1, |t| t.nonce),
            3 => mine.first().map_or(2, |t| t.nonce),
            4 => 0,
            _ => b.u64(),
        };
        TransferRef { transfer_id, nonce }
    }

    fn step(&mut self, b: &mut Bytes<'_>) -> Result<(), Violation> {
        match b.u8() % 13 {
            0 => {
                let transfer_id = b.id();
                let tokens = u32::from(b.u8() % 64);
                let n = tokens.div_ceil(TOKENS_PER_PAGE) as usize;
                let page_digests = b.bool();
                let timeout = Duration::from_millis(u64::from(b.u8()) * 4);
                if let Some(pages) = self.rx.free_pages(n) {
                    let req = ReservationRequest {
                        transfer_id,
                        tokens,
                        pages: pages.clone(),
                        digest: None,
                        page_digests,
                        timeout,
                        access: vec![],
                    };
                    if let Ok(t) = self.r.reserve(self.now, req) {
                        self.rx.lease(t, &pages)?;
                        self.refs.push(t);
                    }
                }
            }
            1 => {
                let t = self.tref(b);
                let flags = b.u8();
                let reserved = self.rx.reserved.get(&t).cloned().unwrap_or_default();
                let pages = reserved.len() as u32;
                let bpi = layout().bytes_per_page_index();
                let algorithm = if flags & 8 != 0 {
                    DigestAlgorithm::CRC32
                } else {
                    DigestAlgorithm::XXH3_64
                };
                let contents = match flags >> 6 {
                    0 | 1 => self.rx.contents(t),
                    2 => digest::source_contents(t.transfer_id, pages),
                    _ => vec![None; pages as usize],
                };
                let with_pages = flags & 16 != 0;
                let aux = vec![flags; usize::from(b.u8() % 12)];
                let mut d =
                    digest::digests(t, algorithm, self.rx.buffers, &contents, with_pages, &aux);
                if flags & 32 != 0 {
                    match b.u8() % 5 {
                        0 => d.buffers.truncate(1),
                        1 => d.buffers[0] = Digest128::default(),
                        2 => d.aux = Digest128::default(),
                        3 => d.aux = Digest128::from_u128(d.aux.to_u128() ^ 1),
                        _ => d.pages.push(7),
                    }
                }
                let c = Commit {
                    transfer: t,
                    tokens: u32::from(b.u8() % 64) * u32::from(flags & 1) + {
                        // Usually the tokens the reservation implies (its pages, full).
                        if flags & 1 == 0 {
                            pages * TOKENS_PER_PAGE
                        } else {
                            0
                        }
                    },
                    pages: pages + u32::from(flags & 2 != 0),
                    bytes: u64::from(pages) * bpi + u64::from(flags & 4 != 0),
                    digest: algorithm,
                    buffer_digests: d.buffers,
                    page_digests: d.pages,
                    aux_digest: d.aux,
                    aux,
                };
                self.frame(Frame::Commit(c))?;
            }
            2 => {
                let t = self.tref(b);
                let code = b.code();
                self.frame(Frame::Reject(Reject {
                    transfer: t,
                    code,
                    detail: "fuzz".into(),
                }))?;
            }
            3 => {
                let t = self.tref(b);
                let code = b.code();
                let completed_pages = b.u32();
                self.frame(Frame::Abort(Abort {
                    transfer: t,
                    code,
                    completed_pages,
                    detail: String::new(),
                }))?;
            }
            4 => {
                let t = self.tref(b);
                self.frame(Frame::AbortAck(t))?;
            }
            5 => {
                let t = self.tref(b);
                let f = match b.u8() % 3 {
                    0 => Frame::Verified(t),
                    1 => Frame::Nack(Nack {
                        transfer: t,
                        code: b.code(),
                        buffer: 0,
                        page: 0,
                        detail: String::new(),
                    }),
                    _ => Frame::Reserve(Reserve {
                        transfer_id: t.transfer_id,
                        nonce: t.nonce,
                        tokens: 16,
                        digest: DigestAlgorithm::XXH3_64,
                        page_digests: false,
                        deadline_ms: 10,
                        pages: vec![0],
                        access: vec![],
                    }),
                };
                self.frame(f)?;
            }
            6 => {
                let n = usize::from(b.u8());
                let raw = b.take(n);
                if let Ok((f, _)) = Frame::decode(&raw) {
                    self.frame(f)?;
                }
            }
            7 => {
                // The peer writes a page: the right bytes, or garbage.
                let t = self.tref(b);
                let ordinal = u32::from(b.u8() % 4);
                let reserved = self.rx.reserved.get(&t).cloned().unwrap_or_default();
                let dst = match reserved.get(ordinal as usize) {
                    Some(&p) if b.u8() % 4 != 0 => p,
                    _ => u32::from(b.u8()) % self.rx.pages.len() as u32,
                };
                let content = if b.bool() {
                    Some((t.transfer_id, ordinal))
                } else {
                    Some((TransferId(99), u32::from(b.u8())))
                };
                self.rx.land(t, ordinal, dst, content)?;
            }
            8 => {
                if !self.rx.fences.is_empty() {
                    let i = usize::from(b.u8()) % self.rx.fences.len();
                    let t = self.rx.complete_fence(i);
                    self.r.handle_fenced(self.now, t);
                }
            }
            9 => {
                if !self.rx.digest_jobs.is_empty() {
                    let i = usize::from(b.u8()) % self.rx.digest_jobs.len();
                    if b.u8() % 4 == 0 {
                        // The driver's coverage check found a page short of bytes: it
                        // reports that instead of digests (SPEC §6), and no longer reads.
                        let t = self.rx.digest_jobs.remove(i).0;
                        self.r
                            .handle_missing_pages(self.now, t, u32::from(b.u8() % 4));
                    } else {
                        let (t, d) = self.rx.complete_digests(i);
                        self.r.handle_digests(self.now, t, d);
                    }
                }
            }
            10 => {
                let id = b.id();
                let code = b.code();
                self.r.abort(self.now, id, code);
            }
            11 => {
                self.now += Duration::from_millis(u64::from(b.u16()));
                self.r.handle_timeout(self.now);
            }
            _ => {
                if b.u8() % 4 == 0 {
                    self.r.handle_peer_lost(self.now);
                }
            }
        }
        self.pump(None)
    }

    fn settle(&mut self) -> Result<(), Violation> {
        for _ in 0..64 {
            while !self.rx.fences.is_empty() {
                let t = self.rx.complete_fence(0);
                self.r.handle_fenced(self.now, t);
                self.pump(None)?;
            }
            while !self.rx.digest_jobs.is_empty() {
                let (t, d) = self.rx.complete_digests(0);
                self.r.handle_digests(self.now, t, d);
                self.pump(None)?;
            }
            match self.r.poll_timeout() {
                Some(at) => {
                    self.now = self.now.max(at);
                    self.r.handle_timeout(self.now);
                    self.pump(None)?;
                }
                None if self.rx.fences.is_empty() && self.rx.digest_jobs.is_empty() => break,
                None => {}
            }
        }
        ensure!(
            self.r.open_transfers() == 0,
            "{} receiver transfers still open after every effect completed and every deadline passed",
            self.r.open_transfers()
        );
        self.rx.check_quiescent()
    }
}

/// Runs the receiver session on the operations in `data`; `Err` is a broken invariant.
pub fn run_receiver(data: &[u8]) -> Result<(), Violation> {
    let mut rig = ReceiverRig {
        now: Instant::now(),
        r: ReceiverSession::new(
            &established(Role::RECEIVER),
            ReceiverConfig {
                history: 3,
                abort_ack_timeout: Duration::from_millis(100),
            },
            crate::world::MODEL_NONCE_SEED,
        ),
        rx: RxDriver::new(8, layout().buffers()),
        refs: Vec::new(),
    };
    let mut b = Bytes { data };
    while !b.is_empty() {
        rig.step(&mut b)?;
    }
    rig.settle()
}

/// The frame decoder's round trip: whatever decodes re-encodes to the same bytes, and
/// whatever does not decode is refused without a panic.
pub fn run_decode(data: &[u8]) -> Result<(), Violation> {
    match Frame::decode(data) {
        Ok((frame, used)) => {
            ensure!(
                used <= data.len(),
                "decode used {used} of {} bytes",
                data.len()
            );
            let bytes = frame
                .to_bytes()
                .map_err(|e| Violation(format!("a decoded frame does not encode: {e}")))?;
            ensure!(
                bytes == data[..used],
                "decode -> encode changed the bytes of {frame:?}"
            );
            let (again, n) = Frame::decode(&bytes)
                .map_err(|e| Violation(format!("re-encoded frame does not decode: {e}")))?;
            ensure!(again == frame && n == used, "decode of encode differs");
        }
        Err(kvwire_proto::wire::DecodeError::Incomplete { needed }) => {
            ensure!(
                needed > data.len(),
                "Incomplete needs {needed} with {} bytes",
                data.len()
            );
        }
        Err(_) => {}
    }
    Ok(())
}
