//! A transfer digested in chunks, inline and on the blocking pool, equals the one-shot
//! digests of the same pages; jobs of one transfer run in order; the state is dropped after
//! the final chunk or when the transfer is forgotten.

use std::task::{Context, Waker};

use kvwire_proto::wire::{DigestAlgorithm, TransferDigests, TransferId, TransferRef};

use super::{DigestExecution, Digests, JobOutcome};
use crate::checksum::{aux_digest, digest_transfer, DigestBinding, DigestMode};
use crate::memory::{PagePool, PoolGeometry, Scrub};

const T: TransferRef = TransferRef {
    transfer_id: TransferId(9),
    nonce: 77,
};

fn pool() -> PagePool {
    let pool = PagePool::new(
        PoolGeometry {
            tokens_per_page: 16,
            buffer_page_bytes: vec![512, 256, 128],
            pages: 16,
        },
        Scrub::None,
    )
    .unwrap();
    for p in 0..16 {
        for b in 0..3 {
            if let Some(mut page) = pool.raw_page_mut(p, b) {
                for (j, x) in page.iter_mut().enumerate() {
                    *x = (j * 7 + p as usize * 13 + b * 31) as u8;
                }
            }
        }
    }
    pool
}

/// The pages of the transfer, in ordinal order (not consecutive in the pool).
const PAGES: [u32; 7] = [3, 9, 0, 15, 4, 5, 11];

fn one_shot(pool: &PagePool, alg: DigestAlgorithm, aux: &[u8]) -> TransferDigests {
    let view = pool.share_pages(PAGES.to_vec()).unwrap();
    let binding = DigestBinding {
        transfer_id: T.transfer_id,
        nonce: T.nonce,
    };
    let mut d =
        digest_transfer(alg, binding, 3, PAGES.len(), true, |b, i| view.page(i, b)).unwrap();
    d.aux = aux_digest(alg, binding, aux).unwrap();
    d
}

/// Starts the chunks [0, 2), [2, 3), [3, 7) and returns every outcome, in order.
fn run_chunks(digests: &mut Digests, pool: &PagePool, alg: DigestAlgorithm, aux: &[u8]) {
    for (first, end) in [(0usize, 2usize), (2, 3), (3, 7)] {
        let aux = (end == PAGES.len()).then(|| aux.to_vec());
        let view = pool.share_pages(PAGES[first..end].to_vec());
        digests.start(T, alg, true, first as u32, view, aux);
    }
}

/// A runtime with a blocking pool of 4 threads, for offloaded jobs.
fn pool_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .max_blocking_threads(4)
        .build()
        .unwrap()
}

fn outcomes(digests: &mut Digests) -> Vec<JobOutcome> {
    std::iter::from_fn(|| {
        digests.take_ready().map(|(t, o)| {
            assert_eq!(t, T);
            o
        })
    })
    .collect()
}

fn assert_chunked(outcomes: &[JobOutcome], want: &TransferDigests) {
    assert!(
        matches!(
            outcomes,
            [JobOutcome::ChunkDigested, JobOutcome::ChunkDigested, JobOutcome::Digests(d)] if d == want
        ),
        "{outcomes:?}"
    );
}

#[test]
fn chunks_inline_equal_one_shot() {
    let pool = pool();
    for alg in [DigestAlgorithm::XXH3_64, DigestAlgorithm::CRC32] {
        let mut digests = Digests::new(DigestMode::Verify, DigestExecution::Inline);
        run_chunks(&mut digests, &pool, alg, b"first token");
        assert_chunked(
            &outcomes(&mut digests),
            &one_shot(&pool, alg, b"first token"),
        );
        assert_eq!(digests.streams(), 0, "state kept after the final chunk");
    }
}

#[test]
fn chunks_offloaded_run_in_order_and_equal_one_shot() {
    let pool = pool();
    let rt = pool_runtime();
    let _guard = rt.enter();
    let mut digests = Digests::new(
        DigestMode::Verify,
        DigestExecution::Offload {
            min_bytes: 0,
            threads: 1,
        },
    );
    run_chunks(&mut digests, &pool, DigestAlgorithm::XXH3_64, b"");
    // The first went to the pool and the others wait for it: nothing is ready yet.
    let mut got = outcomes(&mut digests);
    assert!(got.is_empty(), "{got:?}");
    let mut cx = Context::from_waker(Waker::noop());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while got.len() < 3 {
        assert!(
            std::time::Instant::now() < deadline,
            "jobs did not finish: {got:?}"
        );
        if digests.poll_done(&mut cx).is_ready() {
            got.extend(outcomes(&mut digests));
        } else {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
    assert_chunked(&got, &one_shot(&pool, DigestAlgorithm::XXH3_64, b""));
    assert_eq!(digests.streams(), 0);
}

#[test]
fn an_abandoned_transfer_is_forgotten_and_a_failed_view_is_reported() {
    let pool = pool();
    let mut digests = Digests::new(DigestMode::Verify, DigestExecution::Inline);
    let view = pool.share_pages(PAGES[..2].to_vec());
    digests.start(T, DigestAlgorithm::XXH3_64, false, 0, view, None);
    assert!(matches!(
        outcomes(&mut digests)[..],
        [JobOutcome::ChunkDigested]
    ));
    assert_eq!(digests.streams(), 1);
    digests.forget(T.transfer_id);
    assert_eq!(digests.streams(), 0);
    // A chunk that does not continue the digests so far fails (a driver bug, never silent).
    let view = pool.share_pages(PAGES[2..3].to_vec());
    digests.start(T, DigestAlgorithm::XXH3_64, false, 2, view, Some(vec![]));
    assert!(matches!(
        outcomes(&mut digests)[..],
        [JobOutcome::Failed { final_chunk: true }]
    ));
    // No view of the pages (out of range): reported as failed.
    let view = pool.share_pages(vec![99]);
    digests.start(T, DigestAlgorithm::XXH3_64, false, 0, view, None);
    assert!(matches!(
        outcomes(&mut digests)[..],
        [JobOutcome::Failed { final_chunk: false }]
    ));
}

#[test]
fn placeholder_mode_streams_too() {
    let pool = pool();
    let mut digests = Digests::new(DigestMode::UnverifiedBenchmarkOnly, DigestExecution::Inline);
    run_chunks(&mut digests, &pool, DigestAlgorithm::XXH3_64, b"x");
    let want = crate::checksum::placeholder_digests(3, PAGES.len(), true);
    assert_chunked(&outcomes(&mut digests), &want);
}

/// Digests while sending: stepped jobs report nothing until the pages before `through` cover
/// their chunk, then the same outcomes as jobs run at once, in order (a later chunk's job
/// waits for the stepped one); the pages stay pinned until their job is done; `u32::MAX`
/// (no write left to send: all posted, or cancelled) finishes a job at once.
#[test]
fn stepped_jobs_equal_one_shot_digests_and_pin_their_pages_until_done() {
    let pool = pool();
    let alg = DigestAlgorithm::XXH3_64;
    let mut digests = Digests::new(DigestMode::Verify, DigestExecution::Inline);
    digests.while_sending = true;
    run_chunks(&mut digests, &pool, alg, b"aux");
    assert!(outcomes(&mut digests).is_empty(), "nothing was sent yet");
    assert_eq!(digests.stepping().collect::<Vec<_>>(), vec![T]);
    // One page of the first chunk sent: still pinned, nothing reported.
    digests.advance(T, 1);
    assert!(outcomes(&mut digests).is_empty());
    assert!(
        pool.raw_page_mut(PAGES[1], 0).is_none(),
        "a page of a running job is pinned"
    );
    // Pages before ordinal 5 sent: chunks [0, 2) and [2, 3) done, [3, 7) stepped.
    digests.advance(T, 5);
    let got = outcomes(&mut digests);
    assert!(matches!(got[..], [JobOutcome::ChunkDigested]), "{got:?}");
    digests.advance(T, 5);
    let got = outcomes(&mut digests);
    assert!(matches!(got[..], [JobOutcome::ChunkDigested]), "{got:?}");
    assert!(
        pool.raw_page_mut(PAGES[1], 0).is_some(),
        "a finished chunk's pages are unpinned"
    );
    assert!(pool.raw_page_mut(PAGES[6], 0).is_none());
    // Nothing left to send (the rest posted or cancelled): the final chunk finishes.
    digests.advance(T, u32::MAX);
    let got = outcomes(&mut digests);
    assert!(
        matches!(&got[..], [JobOutcome::Digests(d)] if *d == one_shot(&pool, alg, b"aux")),
        "{got:?}"
    );
    assert!(pool.raw_page_mut(PAGES[6], 0).is_some());
    assert_eq!(digests.stepping().count(), 0);
    assert_eq!(digests.streams(), 0);
}

/// A stepped job of a transfer forgotten before it finished (its source released) is
/// dropped with its pin; nothing is reported for it.
#[test]
fn a_forgotten_transfers_stepped_job_is_dropped_with_its_pin() {
    let pool = pool();
    let mut digests = Digests::new(DigestMode::Verify, DigestExecution::Inline);
    digests.while_sending = true;
    let view = pool.share_pages(PAGES.to_vec());
    digests.start(T, DigestAlgorithm::XXH3_64, true, 0, view, Some(Vec::new()));
    digests.advance(T, 3);
    assert!(pool.raw_page_mut(PAGES[0], 0).is_none());
    digests.forget(T.transfer_id);
    assert!(pool.raw_page_mut(PAGES[0], 0).is_some());
    assert_eq!(digests.stepping().count(), 0);
    assert!(outcomes(&mut digests).is_empty());
}

/// Polls `digests` until `n` outcomes arrived; after each, `check(k)` runs with the number of
/// outcomes so far (the pool's threads run the jobs).
fn poll_outcomes(digests: &mut Digests, n: usize, mut check: impl FnMut(usize)) -> Vec<JobOutcome> {
    let mut cx = Context::from_waker(Waker::noop());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let mut got = outcomes(digests);
    while got.len() < n {
        assert!(
            std::time::Instant::now() < deadline,
            "jobs did not finish: {got:?}"
        );
        if digests.poll_done(&mut cx).is_ready() {
            for o in outcomes(digests) {
                got.push(o);
                check(got.len());
            }
        } else {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
    got
}

/// A job on the pool is split into parts of consecutive pages, digested on several threads
/// and folded in order: the digests equal the one-shot digests (both algorithms, chunks of
/// 2, 1 and 4 pages split into 2, 1 and 3 parts), and a chunk's pages are unpinned when its
/// outcome is reported (the job, and its pin, is dropped first).
#[test]
fn jobs_split_across_pool_threads_equal_one_shot_and_unpin_before_reporting() {
    let pool = pool();
    let rt = pool_runtime();
    let _guard = rt.enter();
    for alg in [DigestAlgorithm::XXH3_64, DigestAlgorithm::CRC32] {
        let mut digests = Digests::new(
            DigestMode::Verify,
            DigestExecution::Offload {
                min_bytes: 0,
                threads: 3,
            },
        );
        digests.min_part_bytes = 1;
        run_chunks(&mut digests, &pool, alg, b"aux");
        let chunks = [&PAGES[0..2], &PAGES[2..3], &PAGES[3..7]];
        let got = poll_outcomes(&mut digests, 3, |k| {
            for &p in chunks[k - 1] {
                assert!(
                    pool.raw_page_mut(p, 0).is_some(),
                    "page {p} of chunk {k} still pinned when its outcome came"
                );
            }
        });
        assert_chunked(&got, &one_shot(&pool, alg, b"aux"));
        assert_eq!(digests.split_jobs, 2, "the 1-page chunk is not split");
        assert_eq!(digests.streams(), 0);
    }
}

/// Parts that do not cover a chunk exactly once, in order, are refused, never folded.
#[test]
fn parts_that_do_not_cover_the_chunk_are_refused() {
    use crate::checksum::{DigestJob, DigestJobError};
    let pool = pool();
    let job = DigestJob::new(
        T,
        DigestAlgorithm::XXH3_64,
        true,
        DigestMode::Verify,
        0,
        pool.share_pages(PAGES.to_vec()).unwrap(),
        Some(Vec::new()),
    );
    let part = |from, to| job.page_digests_of(from, to).unwrap();
    let whole = job.run_from_parts(None, &[part(0, 3), part(3, 7)]).unwrap();
    assert!(
        matches!(&whole, super::DigestProgress::Done(d) if *d == one_shot(&pool, DigestAlgorithm::XXH3_64, b"")),
        "{whole:?}"
    );
    for bad in [
        vec![part(3, 7), part(0, 3)],
        vec![part(0, 3)],
        vec![part(0, 3), part(2, 7)],
        vec![part(0, 4), part(3, 7)],
    ] {
        assert!(
            matches!(
                job.run_from_parts(None, &bad),
                Err(DigestJobError::PartsMismatch { pages: 7, .. })
            ),
            "{bad:?}"
        );
    }
}

/// A digest job that panics (a bug) fails its transfer instead of leaving it waiting: inline,
/// stepped while sending, on the pool, and split across pool threads, the outcome is
/// `Failed`, the pages are unpinned, and no state is kept.
#[test]
fn a_panicking_job_fails_its_transfer_and_unpins_its_pages() {
    let panics = TransferRef {
        transfer_id: crate::checksum::PANICS_IN_TESTS,
        nonce: 5,
    };
    let pool = pool();
    let rt = pool_runtime();
    let _guard = rt.enter();
    let offload = |threads| DigestExecution::Offload {
        min_bytes: 0,
        threads,
    };
    for (name, execution, stepped) in [
        ("inline", DigestExecution::Inline, false),
        ("stepped", DigestExecution::Inline, true),
        ("pool", offload(1), false),
        ("split", offload(3), false),
    ] {
        let mut digests = Digests::new(DigestMode::Verify, execution);
        digests.while_sending = stepped;
        digests.min_part_bytes = 1;
        let view = pool.share_pages(PAGES.to_vec());
        digests.start(
            panics,
            DigestAlgorithm::XXH3_64,
            true,
            0,
            view,
            Some(Vec::new()),
        );
        if stepped {
            digests.advance(panics, 2);
        }
        let mut cx = Context::from_waker(Waker::noop());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let got = loop {
            if let Some(done) = digests.take_ready() {
                break done;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{name}: the panicking job never reported"
            );
            if digests.poll_done(&mut cx).is_pending() {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        };
        assert!(
            matches!(got, (t, JobOutcome::Failed { final_chunk: true }) if t == panics),
            "{name}: {got:?}"
        );
        for &p in &PAGES {
            assert!(
                pool.raw_page_mut(p, 0).is_some(),
                "{name}: page {p} still pinned"
            );
        }
        assert_eq!(digests.streams(), 0, "{name}: state kept");
        assert_eq!(digests.stepping().count(), 0, "{name}");
    }
}
