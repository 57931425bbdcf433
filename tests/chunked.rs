//! A transfer sent in chunks with an auxiliary record, end to end through the real sender and
//! receiver sessions and the real digests (SPEC.md §5.3.2, §6): the sender streams its
//! digests across the chunks; the COMMIT's digests equal a one-chunk computation over the
//! same pages; the receiver digests its landed memory and the aux record and delivers both.

use std::time::{Duration, Instant};

use kvwire::checksum::{aux_digest, digest_transfer, DigestBinding, TransferDigester};
use kvwire::proto::admission::{AdmissionPolicy, Request};
use kvwire::proto::handshake::in_memory;
use kvwire::proto::receiver::{
    ReceiverAction, ReceiverConfig, ReceiverEvent, ReceiverSession, ReservationRequest,
};
use kvwire::proto::sender::{SenderAction, SenderConfig, SenderEvent, SenderSession, WriteOutcome};
use kvwire::proto::wire::{DigestAlgorithm, Frame, Hello, KvLayout, Role};
use kvwire::TransferId;

const BUFFERS: [usize; 3] = [256, 64, 128];
const PAGES: u32 = 7;
const ID: TransferId = TransferId(42);

fn hello(role: Role) -> Hello {
    Hello {
        node_id: u64::from(role.0),
        role,
        layout: KvLayout {
            tokens_per_page: 16,
            buffer_page_bytes: BUFFERS.iter().map(|&b| b as u32).collect(),
            fingerprint: b"chunked".to_vec(),
        },
        digests: vec![DigestAlgorithm::XXH3_64, DigestAlgorithm::CRC32],
        transport_params: vec![],
        max_aux: 64,
    }
}

/// Memory of one side: `slots[buffer][page]`.
struct Memory {
    slots: Vec<Vec<Vec<u8>>>,
}

impl Memory {
    fn new(pages: usize, fill: impl Fn(usize, usize, usize) -> u8) -> Self {
        Self {
            slots: BUFFERS
                .iter()
                .enumerate()
                .map(|(b, &len)| {
                    (0..pages)
                        .map(|p| (0..len).map(|j| fill(b, p, j)).collect())
                        .collect()
                })
                .collect(),
        }
    }
}

fn move_frames(from: &mut dyn FnMut() -> Option<Frame>, to: &mut dyn FnMut(Frame)) {
    while let Some(f) = from() {
        let bytes = f.to_bytes().unwrap();
        to(Frame::decode(&bytes).unwrap().0);
    }
}

#[test]
fn a_chunked_transfer_with_aux_verifies_with_one_shot_digests() {
    for algorithm in [DigestAlgorithm::XXH3_64, DigestAlgorithm::CRC32] {
        for page_digests in [false, true] {
            run(algorithm, page_digests);
        }
    }
}

fn run(algorithm: DigestAlgorithm, page_digests: bool) {
    let now = Instant::now();
    let (r_est, s_est) = in_memory(now, hello(Role::RECEIVER), hello(Role::SENDER)).unwrap();
    let mut s = SenderSession::new(&s_est, SenderConfig::default());
    let mut r = ReceiverSession::new(&r_est, ReceiverConfig::default(), 0x6b76_7769_7265_0001);
    // Source pages 10.. of the sender's pool; destination pages chosen by the receiver,
    // which hold another tenant's bytes (pages are not zeroed).
    let source: Vec<u32> = (10..10 + PAGES).collect();
    let src = Memory::new(32, |b, p, j| (b * 31 + p * 7 + j * 3) as u8);
    let mut dst = Memory::new(32, |_, _, _| 0xA5);
    let aux = b"first token: 128000".to_vec();

    let admitted = AdmissionPolicy {
        tokens_per_page: 16,
        pool_pages: 32,
        max_context_tokens: 4096,
    }
    .admit(Request {
        transfer_id: ID,
        tokens: u64::from(PAGES) * 16 - 5,
    })
    .unwrap();
    s.open(now, admitted).unwrap();
    let t = r
        .reserve(
            now,
            ReservationRequest {
                transfer_id: ID,
                tokens: PAGES * 16 - 5,
                pages: vec![3, 17, 0, 25, 8, 9, 30],
                digest: Some(algorithm),
                page_digests,
                timeout: Duration::from_secs(5),
                access: vec![],
            },
        )
        .unwrap();
    move_frames(&mut || r.poll_transmit(), &mut |f| {
        s.handle_frame(now, f).unwrap()
    });

    // Chunked prefill: 3, 1 and 3 pages, the aux record with the last.
    let mut stream: Option<TransferDigester> = None;
    let mut commit_digests = None;
    for (first, end) in [(0usize, 3usize), (3, 4), (4, 7)] {
        let last = end == PAGES as usize;
        s.submit_chunk(
            now,
            ID,
            source[first..end].to_vec(),
            last.then(|| aux.clone()),
        )
        .unwrap();
        while let Some(action) = s.poll_action() {
            match action {
                SenderAction::ComputeDigests {
                    transfer,
                    algorithm: alg,
                    page_digests: per_page,
                    first: f,
                    pages,
                    aux: chunk_aux,
                } => {
                    assert_eq!((f as usize, pages as usize), (first, end - first));
                    let mut d = stream.take().unwrap_or_else(|| {
                        let binding = DigestBinding {
                            transfer_id: transfer.transfer_id,
                            nonce: transfer.nonce,
                        };
                        TransferDigester::new(alg, binding, BUFFERS.len(), per_page).unwrap()
                    });
                    d.update(pages as usize, |b, i| {
                        &src.slots[b][source[f as usize + i] as usize]
                    });
                    match chunk_aux {
                        Some(a) => {
                            let digests = d.finish(&a);
                            commit_digests = Some(digests.clone());
                            s.handle_digests(now, transfer, digests);
                        }
                        None => {
                            stream = Some(d);
                            s.handle_chunk_digested(now, transfer);
                        }
                    }
                }
                SenderAction::PostWrites {
                    transfer, writes, ..
                } => {
                    for w in &writes {
                        for (b, slots) in dst.slots.iter_mut().enumerate() {
                            slots[w.dst_page as usize]
                                .clone_from(&src.slots[b][w.src_page as usize]);
                        }
                    }
                    s.handle_write_outcome(
                        now,
                        transfer,
                        WriteOutcome::Completed,
                        writes.len() as u32,
                    );
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        if !last {
            assert!(s.poll_transmit().is_none(), "COMMIT before the final chunk");
        }
    }

    // The streamed digests equal a one-chunk computation over the same source pages.
    let binding = DigestBinding {
        transfer_id: t.transfer_id,
        nonce: t.nonce,
    };
    let mut one_shot = digest_transfer(
        algorithm,
        binding,
        BUFFERS.len(),
        PAGES as usize,
        page_digests,
        |b, i| &src.slots[b][source[i] as usize],
    )
    .unwrap();
    one_shot.aux = aux_digest(algorithm, binding, &aux).unwrap();
    assert_eq!(commit_digests.as_ref(), Some(&one_shot));

    // The receiver: fence, digest its landed memory and the aux record, deliver.
    let reserved = [3u32, 17, 0, 25, 8, 9, 30];
    let mut commit_seen = false;
    move_frames(&mut || s.poll_transmit(), &mut |f| {
        commit_seen |= matches!(&f, Frame::Commit(c) if c.aux == aux);
        r.handle_frame(now, f).unwrap()
    });
    assert!(commit_seen, "no COMMIT carrying the aux record");
    while let Some(action) = r.poll_action() {
        match action {
            ReceiverAction::Fence(t) => r.handle_fenced(now, t),
            ReceiverAction::ComputeDigests {
                transfer,
                algorithm: alg,
                page_digests: per_page,
                aux: a,
            } => {
                let mut landed = digest_transfer(
                    alg,
                    binding,
                    BUFFERS.len(),
                    PAGES as usize,
                    per_page,
                    |b, i| &dst.slots[b][reserved[i] as usize],
                )
                .unwrap();
                landed.aux = aux_digest(alg, binding, &a).unwrap();
                r.handle_digests(now, transfer, landed);
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    match r.poll_event() {
        Some(ReceiverEvent::Delivered(d)) => {
            assert_eq!(d.aux, aux);
            assert_eq!(d.pages, PAGES);
        }
        other => panic!("expected Delivered, got {other:?}"),
    }
    move_frames(&mut || r.poll_transmit(), &mut |f| {
        s.handle_frame(now, f).unwrap()
    });
    assert_eq!(s.poll_event(), Some(SenderEvent::Verified(t)));
}
