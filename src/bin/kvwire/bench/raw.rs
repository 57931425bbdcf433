//! The raw TCP baseline: the same bytes as a case, over one TCP connection on the same
//! address pair, with no protocol at all.

use std::time::Instant;

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
