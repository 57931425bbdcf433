//! How much memory an open transfer costs: N transfers held open at once on one TCP
//! connection (both nodes in this process), each with its first chunk written and its final
//! chunk not yet sent (a chunked prefill in progress), then all finished and verified. The
//! heap is measured by a counting allocator before, while all N are open, and after; the KV
//! pages themselves are registered memory, allocated before the first measurement.
//!
//! ```sh
//! cargo run --release --example open_transfers -- 10000      # N (default 10000)
//! ```
//!
//! Prints the heap bytes per open transfer (both nodes together, and the connection tasks'
//! share), for N and for N/10, so a reader sees whether the cost per transfer stays flat.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::Duration;

use kvwire::proto::admission::Request;
use kvwire::receiver::ReserveParams;
use kvwire::{Auth, PoolGeometry, TransferId};
use kvwire::{Node, NodeConfig, ReceiverConn, SenderConn};

/// The system allocator, counting the bytes live.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call is forwarded unchanged to the system allocator; only a counter is kept.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract for `alloc`, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn live() -> isize {
    LIVE.load(Ordering::Relaxed)
}

/// Pages per transfer (two chunks of one page).
const PAGES: u32 = 2;
const TOKENS_PER_PAGE: u32 = 16;

async fn run(n: u32) -> Result<Vec<(isize, isize)>, Box<dyn std::error::Error + Send + Sync>> {
    let geometry = PoolGeometry {
        tokens_per_page: TOKENS_PER_PAGE,
        // Four buffers (e.g. 2 layers x K/V) of 1 KiB pages: the state that grows with
        // buffers (digests) is counted, the pages stay small.
        buffer_page_bytes: vec![1024; 4],
        pages: n * PAGES,
    };
    let config = NodeConfig::builder(geometry, u64::from(PAGES * TOKENS_PER_PAGE))
        .auth(Auth::ephemeral())
        .build()?;
    let (decode_node, prefill_node) = (Node::new(config.clone())?, Node::new(config)?);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let accept = tokio::spawn(async move { ReceiverConn::accept(&listener, &decode_node).await });
    let prefill = SenderConn::connect(addr, &prefill_node).await?;
    let decode = accept.await??;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut rounds = Vec::new();
    // Twice over the same connection: what the first round leaves (maps keep their
    // capacity, the bounded history of ended transfers) must not grow in the second.
    for round in 0..2u64 {
        let before = live();
        let first_id = round * u64::from(n) + 1;

        // The prefill opens every transfer and sends its first chunk (one page of its own
        // memory); then the decode reserves them all. Each first page is written at once.
        let mut outgoing = Vec::with_capacity(n as usize);
        let mut outcomes = Vec::with_capacity(n as usize);
        for i in 0..n {
            let admitted = prefill.admit(Request {
                transfer_id: TransferId(first_id + u64::from(i)),
                tokens: u64::from(PAGES * TOKENS_PER_PAGE),
            })?;
            let mut t = prefill.open(admitted);
            outcomes.push(tokio::spawn(t.take_outcome()));
            t.send_chunk(vec![i * PAGES], None).await?;
            outgoing.push(t);
        }
        let verified: Vec<_> = (0..n)
            .map(|i| {
                tokio::spawn(decode.reserve(ReserveParams::new(
                    TransferId(first_id + u64::from(i)),
                    PAGES * TOKENS_PER_PAGE,
                    Duration::from_secs(120),
                )))
            })
            .collect();
        // Every transfer's first page written: wait until both sides' counters say so.
        loop {
            if prefill.stats().await?.writes >= (2 * round + 1) * u64::from(n) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let open = live();

        // The final chunks: all verify, their pages are released.
        for (i, t) in outgoing.iter().enumerate() {
            t.send_chunk(vec![i as u32 * PAGES + 1], Some(Vec::new()))
                .await?;
        }
        for v in verified {
            v.await??.release()?;
        }
        for o in outcomes {
            o.await??;
        }
        drop(outgoing);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let after = live();
        println!(
        "n = {n}, round {round}: heap {} KiB before, {} KiB with all open, {} KiB after they verified",
        before / 1024,
        open / 1024,
        after / 1024
    );
        rounds.push((open - before, after - before));
    }
    Ok(rounds)
}

fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let n: u32 = std::env::args()
        .nth(1)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(10_000);
    let rt = tokio::runtime::Runtime::new()?;
    for n in [n / 10, n] {
        for (round, (open, left)) in rt.block_on(run(n.max(1)))?.into_iter().enumerate() {
            println!(
                "n = {n}, round {round}: {} bytes of heap per open transfer (both nodes, all tasks), {} bytes per transfer left after",
                open / isize::try_from(n.max(1))?,
                left / isize::try_from(n.max(1))?
            );
        }
    }
    Ok(())
}
