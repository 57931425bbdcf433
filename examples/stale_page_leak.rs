//! Replays the stale-page incident from `DESIGN.md`, first against a naive decode node and
//! then through kvwire.
//!
//! Two tenants share a decode node whose KV pages are not zeroed between requests. Tenant
//! A's request leaves its bytes (the text `TENANT-A secret: account 4471-...`) in the pages.
//! Then tenant B sends a prompt longer than the prefill KV pool. The prefill "rejects" it by
//! swapping in a one-token placeholder, and that placeholder still reaches the transfer
//! stage. Its tiny transfer gets to the decode node, which receives "transfer complete" and
//! decodes over the pages it reserved for B. Those pages still hold tenant A's bytes.
//!
//! * Part 1, the naive receiver: a small page store defined in this file. It trusts
//!   "transfer complete" and hands tenant B the pages it reserved for B. The example prints
//!   what B's decode reads: tenant A's text.
//! * Part 2, kvwire: the same sequence through the library's public API
//!   ([`kvwire::testkit::Pair`]). The prefill rejects B's prompt at admission with a typed
//!   error. The decode side's reservation is answered with that original error
//!   (`PROMPT_EXCEEDS_POOL`), no byte moves, nothing is delivered to B's decode, and every
//!   page goes back to the pool. A legitimate short request then verifies end to end, which
//!   shows that the system still works.
//!
//! The example checks its own claims with `assert!`, so it cannot print a wrong story and
//! still exit 0.
//!
//! Run it with:
//!
//! ```text
//! cargo run --example stale_page_leak
//! ```

use kvwire::TransferId;
use std::error::Error;
use std::time::Duration;

use kvwire::config::EngineConfig;
use kvwire::proto::admission::Request;
use kvwire::proto::FailureReason;
use kvwire::receiver::ReserveParams;
use kvwire::testkit::{kv_pattern, Pair, PairConfig};

/// What tenant A's request left in every KV page it used, repeated to fill each page.
const TENANT_A_TEXT: &[u8] = b"TENANT-A secret: account 4471-0093-2231-8857 | ";

/// Tokens per KV page (the same as `PairConfig::small()`).
const TOKENS_PER_PAGE: usize = 16;

/// Bytes of one KV page across all buffers (512 + 256 + 512, the same as
/// `PairConfig::small()`).
const PAGE_BYTES: usize = 1280;

/// KV bytes per token.
const TOKEN_BYTES: usize = PAGE_BYTES / TOKENS_PER_PAGE;

/// Pages in the prefill KV pool: 64 pages hold 1024 tokens.
const PREFILL_POOL_PAGES: usize = 64;

/// Pages in the decode node's KV pool.
const DECODE_POOL_PAGES: usize = 256;

/// Tenant A's earlier request, in tokens (128 pages).
const TENANT_A_TOKENS: usize = 2048;

/// Tenant B's prompt, in tokens. It is longer than the prefill pool (1024 tokens), but it
/// fits the advertised context length.
const TENANT_B_TOKENS: usize = 2000;

/// Transfer id of tenant B's request.
const TENANT_B_ID: u64 = 42;

/// Transfer id of the legitimate short request in part 2.
const LEGIT_ID: u64 = 43;

/// Tokens of the legitimate short request in part 2.
const LEGIT_TOKENS: u32 = 100;

/// Fills `page` with tenant A's text, as tenant A's request left it.
fn fill_tenant_a(page: &mut [u8]) {
    for (byte, text) in page.iter_mut().zip(TENANT_A_TEXT.iter().cycle()) {
        *byte = *text;
    }
}

/// Renders bytes as text. Anything that is not printable ASCII is shown as `.`.
fn as_text(bytes: &[u8]) -> String {
    bytes
        .iter()
        .map(|&b| {
            if b.is_ascii_graphic() || b == b' ' {
                char::from(b)
            } else {
                '.'
            }
        })
        .collect()
}

/// A decode node's KV page store as the incident had it. Pages are not zeroed between
/// requests, and "transfer complete" is taken at its word.
struct NaiveDecodeNode {
    /// All pages, back to back.
    memory: Vec<u8>,
    /// Free pages. The most recently released page is handed out first, so warm pages are
    /// reused.
    free: Vec<usize>,
}

impl NaiveDecodeNode {
    /// A node with `pages` pages of [`PAGE_BYTES`] each.
    fn new(pages: usize) -> Self {
        Self {
            memory: vec![0; pages * PAGE_BYTES],
            free: (0..pages).rev().collect(),
        }
    }

    /// Reserves `n` pages for a request. They are not zeroed, so they still hold whatever
    /// the previous request wrote into them.
    fn reserve(&mut self, n: usize) -> Vec<usize> {
        assert!(n <= self.free.len(), "decode pool exhausted");
        let at = self.free.len() - n;
        let mut pages = self.free.split_off(at);
        pages.reverse();
        pages
    }

    /// Gives pages back without zeroing them, because that is faster.
    fn release(&mut self, pages: Vec<usize>) {
        self.free.extend(pages.into_iter().rev());
    }

    /// The bytes of one page.
    fn page_mut(&mut self, page: usize) -> &mut [u8] {
        &mut self.memory[page * PAGE_BYTES..(page + 1) * PAGE_BYTES]
    }

    /// An incoming write of `data` at `offset` within `page` (the RDMA WRITE landing).
    fn write(&mut self, page: usize, offset: usize, data: &[u8]) {
        self.page_mut(page)[offset..offset + data.len()].copy_from_slice(data);
    }

    /// "Transfer complete" arrived: the node assumes every reserved page was overwritten
    /// and hands the pages to the decode engine as the request's KV cache.
    fn on_transfer_complete(&self, pages: &[usize]) -> Vec<u8> {
        pages
            .iter()
            .flat_map(|&p| &self.memory[p * PAGE_BYTES..(p + 1) * PAGE_BYTES])
            .copied()
            .collect()
    }
}

/// Part 1: the incident, replayed on [`NaiveDecodeNode`]. Returns how many bytes of tenant
/// A's data tenant B's decode read.
fn naive() -> usize {
    println!("== naive receiver (trusts 'transfer complete') ==");
    let mut node = NaiveDecodeNode::new(DECODE_POOL_PAGES);

    // Tenant A's request: its KV lands, A decodes, and the pages go back unzeroed.
    let a_pages = node.reserve(TENANT_A_TOKENS.div_ceil(TOKENS_PER_PAGE));
    for &p in &a_pages {
        fill_tenant_a(node.page_mut(p));
    }
    println!(
        "tenant A: {TENANT_A_TOKENS} tokens decoded on {} pages; pages released without zeroing",
        a_pages.len()
    );
    node.release(a_pages);

    // Tenant B's prompt is longer than the prefill pool. The prefill "rejects" it by
    // swapping in a one-token placeholder, and that placeholder still flows to transfer.
    let prefill_pool_tokens = PREFILL_POOL_PAGES * TOKENS_PER_PAGE;
    assert!(TENANT_B_TOKENS > prefill_pool_tokens);
    println!(
        "tenant B: prompt of {TENANT_B_TOKENS} tokens > prefill KV pool of {prefill_pool_tokens} tokens; \
         prefill swaps in a 1-token placeholder"
    );

    // The decode node reserved pages for B's real prompt.
    let b_pages = node.reserve(TENANT_B_TOKENS.div_ceil(TOKENS_PER_PAGE));
    println!("decode node: reserved {} pages for tenant B", b_pages.len());

    // The placeholder's transfer: one token of KV into the first page, then "complete".
    let mut placeholder = vec![0; TOKEN_BYTES];
    kv_pattern(TransferId(TENANT_B_ID), 0, 0, &mut placeholder);
    node.write(b_pages[0], 0, &placeholder);
    let written_for_b = placeholder.len();
    println!(
        "transfer: placeholder wrote {written_for_b} bytes (1 token), then 'transfer complete'"
    );

    let b_kv = node.on_transfer_complete(&b_pages);
    println!(
        "tenant B's decode reads {} bytes of KV; page 1 starts with:",
        b_kv.len()
    );
    println!("  \"{}\"", as_text(&b_kv[PAGE_BYTES..PAGE_BYTES + 48]));

    // Every byte that no write for B produced must be compared with what tenant A left.
    let mut a_page = vec![0; PAGE_BYTES];
    fill_tenant_a(&mut a_page);
    let stale = b_kv
        .chunks(PAGE_BYTES)
        .flat_map(|page| page.iter().zip(&a_page))
        .skip(written_for_b)
        .filter(|(got, a)| got == a)
        .count();
    assert_eq!(
        stale,
        b_kv.len() - written_for_b,
        "every byte not written for B should be tenant A's"
    );
    assert!(stale > 0, "the naive path should have leaked");
    assert!(as_text(&b_kv[PAGE_BYTES..PAGE_BYTES + 48]).starts_with("TENANT-A secret"));
    println!("LEAK: tenant B decoded over {stale} bytes of tenant A's data");
    stale
}

/// Part 2: the same sequence through kvwire. Returns the bytes moved for tenant B.
fn kvwire_run() -> Result<u64, Box<dyn Error>> {
    println!("== kvwire ==");
    let mut cfg = PairConfig::small();
    // The prefill pool (64 pages, 1024 tokens) is smaller than its context length. The
    // operator overrode the start-up check, so admission is the last line of defence.
    cfg.sender_pool.pages = PREFILL_POOL_PAGES as u32;
    cfg.sender_engine = {
        let mut c = EngineConfig::new(4096);
        c.allow_undersized_pool = true;
        c
    };
    cfg.receiver_pool.pages = DECODE_POOL_PAGES as u32;
    cfg.receiver_engine = EngineConfig::new(4096);
    assert_eq!(cfg.receiver_pool.tokens_per_page as usize, TOKENS_PER_PAGE);
    assert_eq!(
        cfg.receiver_pool.buffer_page_bytes.iter().sum::<u32>() as usize,
        PAGE_BYTES
    );
    let mut pair = Pair::new(cfg)?;

    // Tenant A's earlier request left its bytes in every page of the decode pool.
    {
        let pool = pair.receiver.pool();
        for p in 0..pool.capacity_pages() {
            for b in 0..pool.buffers() {
                if let Some(mut page) = pool.raw_page_mut(p, b) {
                    fill_tenant_a(&mut page);
                }
            }
        }
    }
    let pool = pair.receiver.pool();
    let capacity = pool.capacity_pages();
    let sample = pool.raw_page(0, 0).map(|p| as_text(&p[..48]));
    println!(
        "decode pool: {capacity} pages, all still holding tenant A's bytes, e.g. \"{}\"",
        sample.unwrap_or_default()
    );

    // Tenant B's prompt: the prefill admits it or rejects it with a typed error.
    let tokens = TENANT_B_TOKENS as u64;
    let now = pair.now;
    let err = match pair.sender.admit(
        now,
        Request {
            transfer_id: TransferId(TENANT_B_ID),
            tokens,
        },
    ) {
        Ok(_) => panic!("a prompt longer than the prefill pool was admitted"),
        Err(e) => e,
    };
    println!("prefill admission: rejected: {err}");
    println!("  code {}", err.code());

    // The decode side reserves for B anyway, as in the incident.
    let now = pair.now;
    pair.receiver.reserve(
        now,
        ReserveParams::new(
            TransferId(TENANT_B_ID),
            TENANT_B_TOKENS as u32,
            Duration::from_secs(2),
        )
        .with_page_digests(),
    )?;
    println!(
        "decode node: reserved {} pages for tenant B",
        capacity - pair.receiver.pool().free_pages()
    );
    pair.drive();

    // What tenant B's decode engine got.
    let failure = pair.receiver_failure(TransferId(TENANT_B_ID)).cloned();
    let stats = pair.wire_stats();
    let pool = pair.receiver.pool();
    println!(
        "verified deliveries: {:?} (nothing handed to B's decode)",
        pair.verified
    );
    match &failure {
        Some(reason) => println!("decode outcome for B: {reason}"),
        None => println!("decode outcome for B: none"),
    }
    println!(
        "bytes moved: bytes_landed = {}, writes_posted = {}",
        stats.bytes_landed, stats.writes_posted
    );
    println!(
        "prefill: {} rejected at admission, {} source pages allocated",
        pair.sender.stats().rejected_at_admission,
        pair.sender.pool().stats().allocations
    );
    println!(
        "decode pool: {}/{} pages free after the failure",
        pool.free_pages(),
        pool.capacity_pages()
    );

    assert!(pair.verified.is_empty(), "something was delivered for B");
    match &failure {
        Some(FailureReason::Rejected { code, detail }) => {
            assert_eq!(*code, err.code());
            assert!(
                detail.contains(&err.to_string()),
                "original error lost: {detail}"
            );
        }
        other => panic!("expected the original admission error, got {other:?}"),
    }
    assert!(failure
        .as_ref()
        .is_some_and(|f| f.to_string().contains("PROMPT_EXCEEDS_POOL")));
    assert_eq!(stats.writes_posted, 0, "B reached the transfer stage");
    assert_eq!(stats.bytes_landed, 0, "bytes moved for B");
    assert_eq!(pair.sender.pool().stats().allocations, 0);
    assert_eq!(pool.free_pages(), pool.capacity_pages(), "pages leaked");
    let b_bytes = stats.bytes_landed;

    // A legitimate short request still verifies end to end, over pages that held tenant
    // A's bytes.
    println!("-- legitimate request: {LEGIT_TOKENS} tokens --");
    let now = pair.now;
    let admitted = pair.sender.admit(
        now,
        Request {
            transfer_id: TransferId(LEGIT_ID),
            tokens: u64::from(LEGIT_TOKENS),
        },
    )?;
    pair.sender.submit(now, admitted, |ord, b, page| {
        kv_pattern(TransferId(LEGIT_ID), ord, b, page)
    })?;
    pair.receiver.reserve(
        now,
        ReserveParams::new(TransferId(LEGIT_ID), LEGIT_TOKENS, Duration::from_secs(2))
            .with_page_digests(),
    )?;
    pair.drive();
    let stats = &pair.wire_stats();
    let pool = pair.receiver.pool();
    println!(
        "verified deliveries: {:?}; bytes_landed = {}, writes_posted = {}; content mismatches: {:?}",
        pair.verified, stats.bytes_landed, stats.writes_posted, pair.wrong_content
    );
    println!(
        "decode pool: {}/{} pages free",
        pool.free_pages(),
        pool.capacity_pages()
    );
    assert_eq!(pair.verified, vec![TransferId(LEGIT_ID)]);
    assert!(pair.wrong_content.is_empty());
    assert!(pair.illegal_landings().is_empty());
    assert!(pair.sender_verified(TransferId(LEGIT_ID)));
    let legit_pages = u64::from(LEGIT_TOKENS).div_ceil(TOKENS_PER_PAGE as u64);
    assert_eq!(stats.bytes_landed, legit_pages * PAGE_BYTES as u64);
    assert_eq!(pool.free_pages(), pool.capacity_pages());
    Ok(b_bytes)
}

fn main() -> Result<(), Box<dyn Error>> {
    let leaked = naive();
    println!();
    let moved = kvwire_run()?;
    println!();
    assert!(leaked > 0);
    assert_eq!(moved, 0);
    println!(
        "SUMMARY: naive receiver leaked {leaked} bytes of tenant A's data to tenant B; \
         kvwire rejected B at admission (PROMPT_EXCEEDS_POOL), moved {moved} bytes, delivered \
         nothing to B, and verified a legitimate request end to end"
    );
    Ok(())
}
