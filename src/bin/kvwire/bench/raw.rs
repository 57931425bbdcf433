//! The raw TCP baseline: the same bytes as a case, over one TCP connection on the same
//! address pair, with no protocol at all.

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Raw TCP loopback: the same bytes, in records of one page index, copied into a page-sized
/// buffer on arrival (what landing does), with no protocol at all.
pub async fn raw_tcp_baseline(total: u64, record: usize) -> std::io::Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let reader = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await?;
        raw_read(&mut s, total, record).await
    });
    let mut s = TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    let start = Instant::now();
    raw_write(&mut s, total, record).await?;
    reader.await.map_err(std::io::Error::other)??;
    Ok(total as f64 / start.elapsed().as_secs_f64() / 1e9)
}

pub(super) async fn raw_write(s: &mut TcpStream, total: u64, record: usize) -> std::io::Result<()> {
    let buf = vec![0x5au8; record];
    let mut left = total;
    while left > 0 {
        let n = (left as usize).min(record);
        s.write_all(&buf[..n]).await?;
        left -= n as u64;
    }
    s.flush().await
}

pub(super) async fn raw_read(s: &mut TcpStream, total: u64, record: usize) -> std::io::Result<()> {
    let mut buf = vec![0u8; record];
    let mut left = total;
    while left > 0 {
        let n = (left as usize).min(record);
        s.read_exact(&mut buf[..n]).await?;
        left -= n as u64;
    }
    Ok(())
}

/// The engine workload's raw baseline: the same page writes as a case of it, over raw TCP
/// loopback, with no protocol: page index `src[i]` of every buffer of the source memory
/// written (vectored) as one record, read straight into page `dst[i]` of every buffer of
/// the destination memory. Both memories are `pages` page indices of `buffers` buffers of
/// `page` bytes, written through before the clock starts (no zero-page reads).
pub async fn raw_engine_baseline(
    page: usize,
    buffers: usize,
    pages: u32,
    src: Vec<u32>,
    dst: Vec<u32>,
) -> std::io::Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let mut dest = RawMemory::new(page, buffers, pages, 0);
    let reader = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await?;
        engine_raw_read(&mut s, &mut dest, &dst).await
    });
    let source = RawMemory::new(page, buffers, pages, 0x5a);
    let mut s = TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    let start = Instant::now();
    let total = engine_raw_write(&mut s, &source, &src).await?;
    reader.await.map_err(std::io::Error::other)??;
    Ok(total as f64 / start.elapsed().as_secs_f64() / 1e9)
}

/// An engine's KV memory for the raw baseline: one region per buffer, written through.
pub(super) struct RawMemory {
    buffers: Vec<Vec<u8>>,
    page: usize,
}

impl RawMemory {
    pub(super) fn new(page: usize, buffers: usize, pages: u32, fill: u8) -> Self {
        Self {
            buffers: (0..buffers)
                .map(|_| vec![fill; page * pages as usize])
                .collect(),
            page,
        }
    }
}

/// Writes page index `p` of every buffer as one record, for each `p` of `pages`; returns the
/// bytes written.
pub(super) async fn engine_raw_write(
    s: &mut TcpStream,
    memory: &RawMemory,
    pages: &[u32],
) -> std::io::Result<u64> {
    let n = memory.page;
    for &p in pages {
        let at = p as usize * n;
        let mut slices: Vec<&[u8]> = memory.buffers.iter().map(|b| &b[at..at + n]).collect();
        write_all_vectored(s, &mut slices).await?;
    }
    s.flush().await?;
    Ok(pages.len() as u64 * (n * memory.buffers.len()) as u64)
}

/// Reads one record per page of `pages` straight into that page of every buffer.
pub(super) async fn engine_raw_read(
    s: &mut TcpStream,
    memory: &mut RawMemory,
    pages: &[u32],
) -> std::io::Result<()> {
    let n = memory.page;
    for &p in pages {
        let at = p as usize * n;
        for buf in memory.buffers.iter_mut() {
            s.read_exact(&mut buf[at..at + n]).await?;
        }
    }
    Ok(())
}

/// Writes every slice, in order, with vectored writes (what kvwire's TCP transport does
/// with a record's buffers).
async fn write_all_vectored(s: &mut TcpStream, slices: &mut [&[u8]]) -> std::io::Result<()> {
    let mut first = 0;
    while first < slices.len() {
        let io: Vec<std::io::IoSlice<'_>> = slices[first..]
            .iter()
            .map(|b| std::io::IoSlice::new(b))
            .collect();
        let mut n = s.write_vectored(&io).await?;
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
