//! The engine-memory workload (`kvwire bench --workload engine`): what an inference engine
//! integrating kvwire does. Each node's KV memory (`--memory`, 1 GiB by default) is
//! registered once; the engine's own allocator chooses pages, a seeded random permutation
//! of all of them (so consecutive requests land scattered across the whole memory); every
//! request is a fixed number of pages.
//!
//! Two ways to move a request, to measure what zero copy buys (`--copy`):
//!
//! * **in place** (the default): the decode engine reserves exactly its chosen pages
//!   (`ReserveParams::into_pages`) and reads the verified KV where it landed; the prefill
//!   engine writes its KV into its own pages (`PagePool::engine_page_mut`) and sends them
//!   with `SenderConn::send_pages`, read by the transport straight from the registered
//!   memory.
//! * **copy** (`--copy`, how an engine had to integrate before): each node's KV lives in
//!   the engine's own memory outside kvwire; the prefill copies every page into kvwire's
//!   pool (`SenderConn::send` with a fill closure) and the decode engine copies every
//!   verified page out into its memory at the page its allocator chose.
//!
//! The raw TCP baseline of this workload does the same page writes: one record per page
//! index (its buffers' slices written vectored) read straight into the destination pages
//! of the same permutation, in memory of the same size.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvwire::engine::{Node, ReceiverConn, SenderConn};
use kvwire::proto::admission::Request;
use kvwire::{ReserveParams, TransferId};

use super::{page_is_expected, stamp, BenchSpec, Outcome};

/// A seeded random permutation of page indices, handed out in order, cyclically: the
/// engine's block allocator.
#[derive(Debug)]
pub(super) struct Allocator {
    order: Vec<u32>,
    next: usize,
}

impl Allocator {
    pub(super) fn new(pages: u32, seed: u64) -> Self {
        let mut order: Vec<u32> = (0..pages).collect();
        let mut x = seed | 1;
        for i in (1..order.len()).rev() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            order.swap(i, (x % (i as u64 + 1)) as usize);
        }
        Self { order, next: 0 }
    }

    /// The next `n` pages.
    pub(super) fn take(&mut self, n: u32) -> Vec<u32> {
        (0..n)
            .map(|_| {
                let p = self.order[self.next];
                self.next = (self.next + 1) % self.order.len();
                p
            })
            .collect()
    }
}

/// Memory the engine owns outside kvwire (the `--copy` way): one slot per page index,
/// holding that page of every buffer, back to back.
struct PlainKv {
    pages: Vec<Mutex<Box<[u8]>>>,
}

impl PlainKv {
    fn new(pages: u32, record: usize) -> Self {
        Self {
            pages: (0..pages)
                .map(|_| Mutex::new(vec![0u8; record].into_boxed_slice()))
                .collect(),
        }
    }

    fn page(&self, p: u32) -> std::sync::MutexGuard<'_, Box<[u8]>> {
        self.pages[p as usize]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }
}

/// One engine (prefill or decode) of the workload.
pub(super) struct EngineSide {
    /// The node the connection is opened over: the engine's memory (in place), or a small
    /// kvwire pool (copy).
    pub(super) node: Node,
    alloc: Mutex<Allocator>,
    plain: Option<PlainKv>,
    page: usize,
    buffers: usize,
}

/// Pages of `--memory` bytes of `page`-byte pages in `buffers` buffers.
pub(super) fn memory_pages(spec: &BenchSpec, page: u32) -> u32 {
    let per_index = u64::from(page) * u64::from(spec.buffers);
    ((spec.engine_memory() / per_index).min(u64::from(u32::MAX))) as u32
}

impl EngineSide {
    /// The engine of one side of case `page`; `seed` picks its allocator's permutation.
    pub(super) fn new(spec: &BenchSpec, page: u32, seed: u64) -> Result<Arc<Self>, String> {
        let pages = memory_pages(spec, page);
        if pages < spec.pages * (spec.concurrency + 1) {
            return Err(format!(
                "--memory holds {pages} pages of {page} B x {} buffers: too few for {} in flight of {} pages",
                spec.buffers, spec.concurrency, spec.pages
            ));
        }
        let copy = spec.engine_copy();
        let config = if copy {
            spec.node_config(page)
        } else {
            spec.node_config_with_pages(page, pages)
        };
        let node = spec.node(config)?;
        let record = page as usize * spec.buffers as usize;
        let plain = copy.then(|| PlainKv::new(pages, record));
        let side = Self {
            node,
            alloc: Mutex::new(Allocator::new(pages, seed)),
            plain,
            page: page as usize,
            buffers: spec.buffers as usize,
        };
        side.fill_bodies(pages)?;
        Ok(Arc::new(side))
    }

    /// The engine's KV before the run: every page holds the body pattern.
    fn fill_bodies(&self, pages: u32) -> Result<(), String> {
        for p in 0..pages {
            for b in 0..self.buffers {
                match &self.plain {
                    Some(plain) => {
                        let mut slot = plain.page(p);
                        let bytes = &mut slot[b * self.page..(b + 1) * self.page];
                        super::fill_body(b, bytes);
                    }
                    None => {
                        let mut bytes = self
                            .node
                            .pool()
                            .engine_page_mut(p, b)
                            .map_err(|e| e.to_string())?;
                        super::fill_body(b, &mut bytes);
                    }
                }
            }
        }
        Ok(())
    }

    fn take(&self, n: u32) -> Vec<u32> {
        self.alloc.lock().unwrap_or_else(|e| e.into_inner()).take(n)
    }

    /// The decode engine's side of one request.
    pub(super) fn receive_one(
        self: &Arc<Self>,
        r: &ReceiverConn,
        spec: &BenchSpec,
        id: u64,
    ) -> impl std::future::Future<Output = Outcome> + Send + 'static {
        let pages = self.take(spec.pages);
        let params = ReserveParams::new(TransferId(id), spec.tokens(), Duration::from_secs(30));
        let params = if self.plain.is_some() {
            params
        } else {
            params.into_pages(pages.clone())
        };
        let verified = r.reserve(params);
        let (me, check) = (self.clone(), spec.check_bytes);
        async move {
            let kv = match verified.await {
                Ok(kv) => kv,
                Err(e) => return Outcome::Failed(e),
            };
            let mut same = true;
            match &me.plain {
                // Copy the verified KV out into the engine's memory, at its pages.
                Some(plain) => {
                    for (o, &p) in pages.iter().enumerate() {
                        let mut slot = plain.page(p);
                        for b in 0..me.buffers {
                            let dst = &mut slot[b * me.page..(b + 1) * me.page];
                            match kv.page(o, b) {
                                Ok(src) => dst.copy_from_slice(&src),
                                Err(_) => same = false,
                            }
                            if check {
                                same &= page_is_expected(id, o as u32, b, dst);
                            }
                        }
                    }
                }
                // In place: the KV is in the engine's pages already.
                None if check => {
                    for (o, _) in pages.iter().enumerate() {
                        for b in 0..me.buffers {
                            same &= kv
                                .page(o, b)
                                .is_ok_and(|page| page_is_expected(id, o as u32, b, &page));
                        }
                    }
                }
                None => {}
            }
            if kv.release().is_err() {
                same = false;
            }
            Outcome::Verified(check.then_some(same))
        }
    }

    /// The prefill engine's side of one request: the engine writes its KV (here: stamps
    /// each page of its pattern) into its pages, then sends them.
    pub(super) fn send_one(
        self: &Arc<Self>,
        s: &SenderConn,
        spec: &BenchSpec,
        id: u64,
    ) -> impl std::future::Future<Output = Outcome> + Send + 'static {
        let pages = self.take(spec.pages);
        let (me, s, tokens) = (self.clone(), s.clone(), spec.tokens());
        async move {
            let admitted = match s.admit(Request {
                transfer_id: TransferId(id),
                tokens: u64::from(tokens),
            }) {
                Ok(a) => a,
                Err(e) => return Outcome::Failed(e),
            };
            let sent = match &me.plain {
                Some(plain) => {
                    for (o, &p) in pages.iter().enumerate() {
                        let mut slot = plain.page(p);
                        for b in 0..me.buffers {
                            let n = me.page.min(16);
                            slot[b * me.page..b * me.page + n]
                                .copy_from_slice(&stamp(id, o as u32, b)[..n]);
                        }
                    }
                    // Copied into kvwire's pages on the connection's task.
                    let me2 = me.clone();
                    s.send(admitted, move |o, b, page| {
                        let slot = me2.plain.as_ref().map(|k| k.page(pages[o as usize]));
                        if let Some(slot) = slot {
                            page.copy_from_slice(&slot[b * me2.page..(b + 1) * me2.page]);
                        }
                    })
                    .await
                }
                None => {
                    for (o, &p) in pages.iter().enumerate() {
                        for b in 0..me.buffers {
                            if let Ok(mut bytes) = me.node.pool().engine_page_mut(p, b) {
                                let n = bytes.len().min(16);
                                bytes[..n].copy_from_slice(&stamp(id, o as u32, b)[..n]);
                            }
                        }
                    }
                    s.send_pages(admitted, pages).await
                }
            };
            match sent {
                Ok(()) => Outcome::Verified(None),
                Err(e) => Outcome::Failed(e),
            }
        }
    }
}

/// The page writes of a run of the workload, for the raw baseline: `count` page indices
/// from each side's allocator.
pub(super) fn raw_pages(spec: &BenchSpec, page: u32, count: u64) -> (Vec<u32>, Vec<u32>) {
    let pages = memory_pages(spec, page);
    let (mut src, mut dst) = (
        Allocator::new(pages, SEND_SEED),
        Allocator::new(pages, RECEIVE_SEED),
    );
    let n = count.min(u64::from(u32::MAX)) as u32;
    (src.take(n), dst.take(n))
}

/// The prefill engine's allocator seed.
pub(super) const SEND_SEED: u64 = 0x5eed_0001;
/// The decode engine's allocator seed.
pub(super) const RECEIVE_SEED: u64 = 0x5eed_0002;
