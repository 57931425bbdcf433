//! The integrator's side of kvwire, as the README shows it: a decode engine that reserves
//! pages and reads verified KV in place, and a prefill engine that admits requests and sends
//! their pages. Only names from the crate root; the same code runs over every transport
//! (`examples/quickstart/main.rs` over TCP or RDMA across two processes, `tests/quickstart.rs`
//! over TCP in `cargo test`).

use std::time::Duration;

use kvwire::{ReceiverConn, Request, ReserveParams, SenderConn, TransferError, TransferId};

/// The KV bytes the prefill engine "computed" for page `ordinal` of `buffer` of request `id`.
pub fn kv_bytes(id: TransferId, ordinal: u32, buffer: usize, page: &mut [u8]) {
    for (i, b) in page.iter_mut().enumerate() {
        *b = (id.get() as usize * 31 + ordinal as usize * 7 + buffer * 3 + i) as u8;
    }
}

/// Decode side: reserves `requests` transfers of `tokens` tokens each, one after another,
/// checks every verified byte in place, and gives the pages back. Returns the bytes checked.
pub async fn decode(
    conn: &ReceiverConn,
    requests: u64,
    tokens: u32,
) -> Result<u64, Box<dyn std::error::Error + Send + Sync>> {
    let mut checked = 0;
    for id in (1..=requests).map(TransferId) {
        let kv = conn
            .reserve(ReserveParams::new(id, tokens, Duration::from_secs(60)))
            .await?;
        let mut want = Vec::new();
        for ordinal in 0..kv.pages() {
            for buffer in 0..kv.buffers() {
                let page = kv.page(ordinal, buffer)?;
                want.resize(page.len(), 0);
                kv_bytes(id, ordinal as u32, buffer, &mut want);
                if *page != want[..] {
                    return Err(
                        format!("request {id}: page {ordinal} buffer {buffer} differs").into(),
                    );
                }
                checked += page.len() as u64;
            }
        }
        kv.release()?;
    }
    Ok(checked)
}

/// Prefill side: admits and sends the same `requests` transfers.
pub async fn prefill(conn: &SenderConn, requests: u64, tokens: u32) -> Result<(), TransferError> {
    for id in (1..=requests).map(TransferId) {
        let admitted = conn.admit(Request {
            transfer_id: id,
            tokens: u64::from(tokens),
        })?;
        conn.send(admitted, move |ordinal, buffer, page| {
            kv_bytes(id, ordinal, buffer, page)
        })
        .await?;
    }
    Ok(())
}
