//! The raw TCP baseline: the same bytes as a case, over one TCP connection on the same
//! address pair, with no protocol at all.

use std::time::{Duration, Instant};

use std::io::{Read, Write};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::cost::{per_gb, CpuClock};

/// Bytes that start `offset` bytes past a 4 KiB boundary, as the KV memory kvwire allocates
/// for the same run does (`BenchSpec::buffer_offset`): over TCP the kernel's copies are
/// slower for some pairings of source and destination offsets within 4 KiB on some CPUs
/// (docs/BENCHMARKS.md, "Which offsets are slow"), so a baseline in memory placed otherwise
/// (a plain `Vec` of a megabyte or more starts 16 bytes into a page under glibc) would
/// measure the placement, not the protocol.
#[derive(Clone)]
pub(super) struct PlacedBytes {
    storage: Vec<u8>,
    start: usize,
    len: usize,
}

impl PlacedBytes {
    /// `len` bytes of `fill` at `offset` (below 4096) past a 4 KiB boundary, on transparent
    /// huge pages where the kernel gives them (asked for before the first touch, as kvwire
    /// asks over the memory it allocates).
    pub(super) fn new(len: usize, offset: usize, fill: u8) -> Self {
        const PAGE: usize = 4096;
        // `vec![0; n]` maps nothing yet: the advice comes before the first write.
        let mut storage = vec![0u8; len + PAGE];
        let start = (offset % PAGE + PAGE - storage.as_ptr() as usize % PAGE) % PAGE;
        kvwire::memory::advise_huge_pages(&mut storage[start..start + len]);
        storage[start..start + len].fill(fill);
        Self {
            storage,
            start,
            len,
        }
    }
}

impl std::ops::Deref for PlacedBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.storage[self.start..self.start + self.len]
    }
}

impl std::ops::DerefMut for PlacedBytes {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.storage[self.start..self.start + self.len]
    }
}

/// One raw baseline's figures.
#[derive(Clone, Copy, Debug)]
pub struct RawRun {
    /// Payload throughput, 10^9 bytes/s.
    pub gb_per_s: f64,
    /// CPU-seconds of this process per 10^9 bytes (both ends when both run here).
    pub cpu_s_per_gb: Option<f64>,
}

impl RawRun {
    /// The figures of `bytes` moved since `start` / `cpu`.
    pub(super) fn since(start: Instant, cpu: CpuClock, bytes: u64) -> Self {
        Self {
            gb_per_s: bytes as f64 / start.elapsed().as_secs_f64() / 1e9,
            cpu_s_per_gb: per_gb(cpu.seconds(), bytes),
        }
    }
}

/// Raw TCP loopback: the same bytes, in records of one page index, copied into a page-sized
/// buffer on arrival (what landing does), with no protocol at all; both buffers start
/// `offset` bytes past a 4 KiB boundary ([`PlacedBytes`]).
pub async fn raw_tcp_baseline(total: u64, record: usize, offset: usize) -> std::io::Result<RawRun> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let reader = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await?;
        raw_read(&mut s, total, record, offset).await
    });
    let mut s = TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    let (start, cpu) = (Instant::now(), CpuClock::start());
    raw_write(&mut s, total, record, offset).await?;
    reader.await.map_err(std::io::Error::other)??;
    Ok(RawRun::since(start, cpu, total))
}

pub(super) async fn raw_write(
    s: &mut TcpStream,
    total: u64,
    record: usize,
    offset: usize,
) -> std::io::Result<()> {
    let buf = PlacedBytes::new(record, offset, 0x5a);
    let mut left = total;
    while left > 0 {
        let n = (left as usize).min(record);
        s.write_all(&buf[..n]).await?;
        left -= n as u64;
    }
    s.flush().await
}

pub(super) async fn raw_read(
    s: &mut TcpStream,
    total: u64,
    record: usize,
    offset: usize,
) -> std::io::Result<()> {
    let mut buf = PlacedBytes::new(record, offset, 0xa5);
    let mut left = total;
    while left > 0 {
        let n = (left as usize).min(record);
        s.read_exact(&mut buf[..n]).await?;
        left -= n as u64;
    }
    Ok(())
}

/// The engine workload's raw baseline: the same page writes as a case of it, over raw TCP
/// loopback, with no protocol, written the way a careful C program would: page index
/// `src[i]` of every buffer of the source memory written with `writev`, read with `readv`
/// straight into page `dst[i]` of every buffer of the destination memory, up to
/// [`RAW_BATCH_PAGES`] pages and [`RAW_BATCH_BYTES`] per system call (one page index at
/// least), on blocking sockets in two threads; streaming, or with the case's requests in
/// flight ([`InFlight`]). Both memories are `pages` page indices of `buffers` buffers of
/// `page` bytes, written through before the clock starts (no zero-page reads), every buffer
/// starting `offset` bytes past a 4 KiB boundary.
pub async fn raw_engine_baseline(
    page: usize,
    buffers: usize,
    pages: u32,
    offset: usize,
    src: Vec<u32>,
    dst: Vec<u32>,
    in_flight: Option<InFlight>,
) -> std::io::Result<RawRun> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let dest = RawMemory::new(page, buffers, pages, 0xa5, offset);
    let reader = tokio::spawn(async move {
        let (s, _) = listener.accept().await?;
        engine_raw_read(s, dest, dst, in_flight).await
    });
    let source = RawMemory::new(page, buffers, pages, 0x5a, offset);
    let s = TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    let (start, cpu) = (Instant::now(), CpuClock::start());
    let (total, source) = engine_raw_write(s, source, src, in_flight).await?;
    let dest = reader.await.map_err(std::io::Error::other)??;
    let run = RawRun::since(start, cpu, total);
    // Both memories are freed after the clock stopped, as kvwire's engines outlive theirs.
    drop((source, dest));
    Ok(run)
}

/// Pages per `writev` / `readv` in the engine raw baseline (times the buffers, at most 1024
/// slices: Linux's `IOV_MAX`).
pub(super) const RAW_BATCH_PAGES: usize = 64;

/// Bytes per `writev` / `readv` in the engine raw baseline, unless one page index (all its
/// buffers) is more. A blocking `writev` of 16 MiB or more ran at 0.7-0.8x the GB/s of 1-4
/// MiB calls on the 2-vCPU host (`bench/raw-tcp-poll.c`, docs/BENCHMARKS.md), and the
/// baseline is meant to be the fastest plain TCP does.
pub(super) const RAW_BATCH_BYTES: usize = 1 << 20;

/// An engine's KV memory for the raw baseline: one region per buffer, written through.
pub(super) struct RawMemory {
    buffers: Vec<PlacedBytes>,
    page: usize,
}

impl RawMemory {
    /// `fill` must not be 0: every byte is written before the clock starts, as kvwire's own
    /// memory is, so no page fault lands inside the clock. Every buffer starts `offset` bytes
    /// past a 4 KiB boundary, backed as kvwire backs the memory it allocates ([`PlacedBytes`]).
    pub(super) fn new(page: usize, buffers: usize, pages: u32, fill: u8, offset: usize) -> Self {
        assert_ne!(fill, 0, "a raw baseline memory must be written through");
        Self {
            buffers: (0..buffers)
                .map(|_| PlacedBytes::new(page * pages as usize, offset, fill))
                .collect(),
            page,
        }
    }

    fn batch(&self) -> usize {
        let index_bytes = (self.page * self.buffers.len()).max(1);
        (1024 / self.buffers.len().max(1))
            .min(RAW_BATCH_BYTES / index_bytes)
            .clamp(1, RAW_BATCH_PAGES)
    }
}

/// The stream as a blocking socket, for a baseline thread.
fn blocking(s: TcpStream) -> std::io::Result<std::net::TcpStream> {
    let s = s.into_std()?;
    s.set_nonblocking(false)?;
    Ok(s)
}

/// Requests in flight in a raw baseline: the case's requests (`pages` page indices each),
/// at most `depth` of them written and not yet acknowledged. The reader acknowledges each
/// request with one byte once every byte of it was read into its pages; the writer's clock
/// stops at the last acknowledgement. What kvwire's requests cost with the protocol taken
/// away: the same page writes, the same requests in flight, one round trip per request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InFlight {
    /// Page indices per request.
    pub pages: usize,
    /// Requests written and not yet acknowledged, at most (at least 1).
    pub depth: usize,
}

/// Writes page index `p` of every buffer, for each `p` of `pages`, in order, batched
/// `writev`s on a blocking thread, streaming (`in_flight` `None`) or request by request;
/// returns the bytes written and the memory (to be freed by the caller once its clock
/// stopped).
pub(super) async fn engine_raw_write(
    s: TcpStream,
    memory: RawMemory,
    pages: Vec<u32>,
    in_flight: Option<InFlight>,
) -> std::io::Result<(u64, RawMemory)> {
    let mut s = blocking(s)?;
    tokio::task::spawn_blocking(move || {
        let n = memory.page;
        let per_request = in_flight.map_or(pages.len(), |f| f.pages).max(1);
        let (mut written, mut acked) = (0usize, 0usize);
        let mut ack = [0u8; 1];
        for request in pages.chunks(per_request) {
            if let Some(f) = in_flight {
                if written - acked >= f.depth.max(1) {
                    s.read_exact(&mut ack)?;
                    acked += 1;
                }
            }
            for batch in request.chunks(memory.batch()) {
                let mut slices: Vec<&[u8]> = Vec::with_capacity(batch.len() * memory.buffers.len());
                for &p in batch {
                    let at = p as usize * n;
                    slices.extend(memory.buffers.iter().map(|b| &b[at..at + n]));
                }
                write_all_vectored(&mut s, &mut slices)?;
            }
            written += 1;
        }
        s.flush()?;
        if in_flight.is_some() {
            while acked < written {
                s.read_exact(&mut ack)?;
                acked += 1;
            }
        }
        Ok((
            pages.len() as u64 * (n * memory.buffers.len()) as u64,
            memory,
        ))
    })
    .await
    .map_err(std::io::Error::other)?
}

/// Reads each page of `pages` straight into that page of every buffer, in order, batched
/// `readv`s on a blocking thread, acknowledging each request with one byte when `in_flight`
/// says the writer waits for that; gives the memory back.
pub(super) async fn engine_raw_read(
    s: TcpStream,
    mut memory: RawMemory,
    pages: Vec<u32>,
    in_flight: Option<InFlight>,
) -> std::io::Result<RawMemory> {
    let mut s = blocking(s)?;
    tokio::task::spawn_blocking(move || {
        let batch_pages = memory.batch();
        let per_request = in_flight.map_or(pages.len(), |f| f.pages).max(1);
        for request in pages.chunks(per_request) {
            read_request(&mut s, &mut memory, request, batch_pages)?;
            if in_flight.is_some() {
                s.write_all(&[1])?;
            }
        }
        Ok(memory)
    })
    .await
    .map_err(std::io::Error::other)?
}

/// Reads one request's pages into their slots, `batch_pages` page indices per `readv`.
fn read_request(
    s: &mut std::net::TcpStream,
    memory: &mut RawMemory,
    pages: &[u32],
    batch_pages: usize,
) -> std::io::Result<()> {
    let n = memory.page;
    for batch in pages.chunks(batch_pages) {
        // The slots of this batch, in stream order. A page index may repeat within a
        // batch only if the workload repeats it; slots are taken disjointly by reading
        // one batch of distinct pages at a time.
        let mut slots: Vec<&mut [u8]> = Vec::with_capacity(batch.len() * memory.buffers.len());
        let mut order: Vec<(usize, usize)> = batch
            .iter()
            .enumerate()
            .map(|(i, &p)| (p as usize, i))
            .collect();
        order.sort_unstable();
        if order.windows(2).any(|w| w[0].0 == w[1].0) {
            // Repeated page in one batch: fall back to one page at a time.
            for &p in batch {
                let at = p as usize * n;
                let mut one: Vec<&mut [u8]> = memory
                    .buffers
                    .iter_mut()
                    .map(|b| &mut b[at..at + n])
                    .collect();
                read_exact_vectored(s, &mut one)?;
            }
            continue;
        }
        // Split every buffer into this batch's page slots (disjoint, sorted by page),
        // then put them back into stream order.
        let mut per_buffer: Vec<Vec<Option<&mut [u8]>>> = memory
            .buffers
            .iter_mut()
            .map(|b| {
                let mut out: Vec<Option<&mut [u8]>> = (0..batch.len()).map(|_| None).collect();
                let mut rest: &mut [u8] = b;
                let mut base = 0;
                for &(p, i) in &order {
                    let tail = std::mem::take(&mut rest);
                    let (_, from) = tail.split_at_mut(p * n - base);
                    let (slot, after) = from.split_at_mut(n);
                    out[i] = Some(slot);
                    rest = after;
                    base = p * n + n;
                }
                out
            })
            .collect();
        for i in 0..batch.len() {
            for b in per_buffer.iter_mut() {
                slots.push(b[i].take().expect("each slot taken once"));
            }
        }
        read_exact_vectored(s, &mut slots)?;
    }
    Ok(())
}

/// Writes every slice, in order, with vectored writes (what kvwire's TCP transport does
/// with a record's buffers).
fn write_all_vectored(s: &mut std::net::TcpStream, slices: &mut [&[u8]]) -> std::io::Result<()> {
    let mut first = 0;
    while first < slices.len() {
        let io: Vec<std::io::IoSlice<'_>> = slices[first..]
            .iter()
            .map(|b| std::io::IoSlice::new(b))
            .collect();
        let mut n = s.write_vectored(&io)?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        while first < slices.len() && n >= slices[first].len() {
            n -= slices[first].len();
            first += 1;
        }
        if n > 0 {
            slices[first] = &slices[first][n..];
        }
    }
    Ok(())
}

/// Fills every slot, in order, with vectored reads.
fn read_exact_vectored(
    s: &mut std::net::TcpStream,
    slots: &mut [&mut [u8]],
) -> std::io::Result<()> {
    let mut first = 0;
    while first < slots.len() {
        let mut io: Vec<std::io::IoSliceMut<'_>> = slots[first..]
            .iter_mut()
            .map(|b| std::io::IoSliceMut::new(b))
            .collect();
        let mut n = s.read_vectored(&mut io)?;
        drop(io);
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        while first < slots.len() && n >= slots[first].len() {
            n -= slots[first].len();
            first += 1;
        }
        if n > 0 {
            let slot = std::mem::take(&mut slots[first]);
            slots[first] = &mut slot[n..];
        }
    }
    Ok(())
}

/// What a raw baseline connection says first, so the listening side can tell it from
/// anything else that connects (and drop the rest).
const RAW_MAGIC: &[u8; 16] = b"kvwire-raw-base\n";

/// The prefill side of a two-process raw baseline announces itself.
pub(super) async fn announce_raw(s: &mut TcpStream) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    s.write_all(RAW_MAGIC).await
}

/// The decode side of a two-process raw baseline: the next connection that announces itself
/// within 2 s; every other one (a port scan, HTTP, a stalled client) is dropped.
pub(super) async fn accept_raw(listener: &TcpListener) -> TcpStream {
    loop {
        let Ok((mut s, peer)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let mut magic = [0u8; 16];
        match tokio::time::timeout(Duration::from_secs(2), s.read_exact(&mut magic)).await {
            Ok(Ok(_)) if &magic == RAW_MAGIC => return s,
            _ => tracing::warn!(%peer, "not a raw-baseline connection; dropped"),
        }
    }
}

/// A single-threaded memcpy of `total` bytes in records of `record` bytes (one page index),
/// from one buffer into another, both `offset` bytes past a 4 KiB boundary ([`PlacedBytes`]),
/// each 256 MiB or the bytes moved if fewer (beyond the caches, as KV memory is): what one
/// copy per byte costs on this host, the bound of same-host pulls (SPEC §9.3).
pub fn memcpy_baseline(total: u64, record: usize, offset: usize) -> RawRun {
    let record = record.max(1);
    let span = (total.min(256 << 20) as usize).max(record) / record * record;
    let src = PlacedBytes::new(span, offset, 0x5A);
    let mut dst = PlacedBytes::new(span, offset, 0);
    let (start, cpu) = (Instant::now(), CpuClock::start());
    let (mut moved, mut at) = (0u64, 0usize);
    while moved < total {
        if at + record > span {
            at = 0;
        }
        dst[at..at + record].copy_from_slice(&src[at..at + record]);
        at += record;
        moved += record as u64;
    }
    std::hint::black_box(&dst[..]);
    RawRun::since(start, cpu, moved)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The baseline must move the same bytes kvwire does: every source page lands in its
    /// destination slot (batched readv over scattered, unsorted slots), streaming and with
    /// requests in flight (the last request shorter than the others).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_engine_baseline_lands_every_page_in_its_slot() {
        for in_flight in [
            None,
            Some(InFlight { pages: 7, depth: 1 }),
            Some(InFlight {
                pages: 32,
                depth: 4,
            }),
        ] {
            let (page, buffers, pages) = (256usize, 3usize, 200u32);
            let mut source = RawMemory::new(page, buffers, pages, 1, 0);
            for (b, buf) in source.buffers.iter_mut().enumerate() {
                for (i, x) in buf.iter_mut().enumerate() {
                    *x = (i / page * 7 + b * 31 + i % 251) as u8;
                }
            }
            let src: Vec<u32> = (0..pages).map(|i| (i * 37) % pages).collect();
            let dst: Vec<u32> = (0..pages).map(|i| (i * 91 + 5) % pages).collect();
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let dest = RawMemory::new(page, buffers, pages, 0xa5, 0);
            let dst2 = dst.clone();
            let reader = tokio::spawn(async move {
                let (s, _) = listener.accept().await.unwrap();
                engine_raw_read(s, dest, dst2, in_flight).await.unwrap()
            });
            let expected = source.buffers.clone();
            let s = TcpStream::connect(addr).await.unwrap();
            engine_raw_write(s, source, src.clone(), in_flight)
                .await
                .unwrap();
            let dest = reader.await.unwrap();
            for (i, (&from, &to)) in src.iter().zip(&dst).enumerate() {
                for (b, (landed, sent)) in dest.buffers.iter().zip(&expected).enumerate() {
                    let (f, t) = (from as usize * page, to as usize * page);
                    assert_eq!(
                        landed[t..t + page],
                        sent[f..f + page],
                        "{in_flight:?}: record {i} buffer {b}"
                    );
                }
            }
        }
    }

    /// With requests in flight the writer keeps at most `depth` requests unacknowledged: a
    /// reader that takes every byte but acknowledges nothing gets exactly `depth` requests
    /// (the writer blocks in its read of the next acknowledgement), and the rest once it
    /// acknowledges them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_in_flight_baseline_waits_for_each_acknowledgement() {
        let (page, buffers, pages) = (1024usize, 2usize, 12u32);
        let f = InFlight { pages: 3, depth: 2 };
        let request_bytes = f.pages * page * buffers;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let source = RawMemory::new(page, buffers, pages, 1, 0);
        let writer = tokio::spawn(async move {
            let s = TcpStream::connect(addr).await.unwrap();
            engine_raw_write(s, source, (0..pages).collect(), Some(f))
                .await
                .unwrap()
                .0
        });
        let got = tokio::task::spawn_blocking(move || {
            let (mut s, _) = listener.accept().unwrap();
            // The first `depth` requests, however long the writer takes to send them...
            let mut got = vec![0u8; f.depth * request_bytes];
            s.read_exact(&mut got).unwrap();
            // ...and then nothing more while none is acknowledged.
            s.set_read_timeout(Some(Duration::from_millis(300)))
                .unwrap();
            let mut buf = vec![0u8; 1 << 16];
            match s.read(&mut buf) {
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(e) => panic!("{e}"),
            }
            let before_acks = got.len();
            // Acknowledge every request; the writer finishes and closes.
            s.set_read_timeout(None).unwrap();
            s.write_all(&[1; 4]).unwrap();
            s.read_to_end(&mut got).unwrap();
            (before_acks, got.len())
        })
        .await
        .unwrap();
        assert_eq!(got.0, f.depth * request_bytes, "unacknowledged bytes");
        assert_eq!(
            got.1,
            pages as usize * page * buffers,
            "all bytes in the end"
        );
        assert_eq!(writer.await.unwrap(), got.1 as u64);
    }

    /// Raw baseline memory starts where it is told within a 4 KiB page, filled to its last
    /// byte, whatever the allocator gave (a plain `Vec` of a megabyte starts 16 bytes into a
    /// page under glibc, which slowed the kernel's copies into it).
    #[test]
    fn placed_bytes_start_at_their_offset() {
        for offset in [0, 16, 64, 2048, 4095] {
            for len in [1, 4096, 1 << 20] {
                let b = PlacedBytes::new(len, offset, 0x5a);
                assert_eq!(b.as_ptr() as usize % 4096, offset, "{offset} {len}");
                assert_eq!(b.len(), len);
                assert!(b.iter().all(|&x| x == 0x5a), "{offset} {len}");
            }
        }
        let m = RawMemory::new(1024, 3, 4, 1, 64);
        assert!(m.buffers.iter().all(|b| b.as_ptr() as usize % 4096 == 64));
    }

    /// A system call moves at most `RAW_BATCH_BYTES` (or one page index, where that alone is
    /// more) and at most `RAW_BATCH_PAGES` page indices: 64 page indices of 4 MiB per call
    /// (256 MiB) had held the baseline at 0.6x of what TCP moves here.
    #[test]
    fn a_baseline_call_moves_about_a_mebibyte() {
        let batch = |page, buffers| RawMemory::new(page, buffers, 1, 1, 0).batch();
        assert_eq!(batch(1 << 20, 4), 1, "one 4 MiB page index");
        assert_eq!(batch(4 << 20, 1), 1, "one 4 MiB page");
        assert_eq!(batch(64 << 10, 4), 4, "4 x 256 KiB = 1 MiB");
        assert_eq!(batch(64 << 10, 1), 16);
        assert_eq!(batch(4 << 10, 4), 64, "capped at RAW_BATCH_PAGES");
        assert_eq!(batch(4 << 10, 64), 4, "64 x 4 KiB x 4 = 1 MiB");
        assert_eq!(batch(512, 64), 16, "1024 slices: IOV_MAX");
    }
}
