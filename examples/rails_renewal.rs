//! A rail taken down and brought back under the poll-style manager (`kvwire::polled`, what the
//! Python and C fronts and the SGLang and vLLM backends use), over RDMA on two rails: the
//! decode dials the prefill, and runs `--transfers` requests one after another, every byte
//! compared, while `scripts/rails-test.sh` takes rail 1's link down in the prefill's VM and
//! brings it back. The manager renews the connection that lost a lane (drained, then dialled
//! again), and, once the rail is back, a renewed connection takes it again.
//!
//! ```text
//! rails_renewal prefill --addr 10.0.0.1:7600 --devices rxe0,rxe1 --transfers N
//! rails_renewal decode  --addr 10.0.0.1:7600 --devices rxe0,rxe1 --transfers N --pace-ms 30
//! ```
//!
//! `KVWIRE_PSK` (hex) is the shared key. Each side prints one JSON line at the end: requests
//! verified and failed (by kind), and the prefill the connections it accepted. Exits non-zero
//! if a verified transfer's bytes differ.

use std::time::{Duration, Instant};

use kvwire::config::TransportConfig;
use kvwire::polled::{KvBuffer, KvPoll, Manager, ManagerConfig, Role};
use kvwire::proto::auth::Psk;
use kvwire::{Auth, TransferId};

const PAGES: usize = 64;
const PAGE_BYTES: usize = 64 * 1024;
const TPP: u32 = 16;
/// Pages per request.
const REQUEST_PAGES: usize = 4;

struct Args {
    role: Role,
    addr: String,
    devices: String,
    transfers: u64,
    pace: Duration,
}

fn args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let role = match it.next().as_deref() {
        Some("prefill") => Role::Prefill,
        Some("decode") => Role::Decode,
        other => return Err(format!("prefill or decode, not {other:?}")),
    };
    let mut a = Args {
        role,
        addr: String::new(),
        devices: "rxe0,rxe1".into(),
        transfers: 200,
        pace: Duration::from_millis(30),
    };
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--addr" => a.addr = value,
            "--devices" => a.devices = value,
            "--transfers" => a.transfers = value.parse().map_err(|e| format!("{e}"))?,
            "--pace-ms" => {
                a.pace = Duration::from_millis(value.parse().map_err(|e| format!("{e}"))?)
            }
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if a.addr.is_empty() {
        return Err("--addr is required".into());
    }
    Ok(a)
}

/// The engine's KV cache: two buffers, leaked (they outlive the manager).
fn cache() -> Vec<KvBuffer> {
    (0..2)
        .map(|_| KvBuffer {
            ptr: Box::leak(vec![0u8; PAGES * PAGE_BYTES].into_boxed_slice()).as_mut_ptr(),
            len: PAGES * PAGE_BYTES,
            page_bytes: PAGE_BYTES,
        })
        .collect()
}

fn page(bufs: &[KvBuffer], b: usize, p: u32) -> &'static mut [u8] {
    // SAFETY: in bounds of a leaked buffer; only pages kvwire does not hold are written.
    unsafe { std::slice::from_raw_parts_mut(bufs[b].ptr.add(p as usize * PAGE_BYTES), PAGE_BYTES) }
}

fn pattern(room: u64, ordinal: usize, b: usize, out: &mut [u8]) {
    for (i, x) in out.iter_mut().enumerate() {
        *x = (room as usize * 131 + ordinal * 17 + b * 7 + i / 3) as u8;
    }
}

fn main() -> std::process::ExitCode {
    // kvwire's warnings (a lane that fails, a renewal) on stderr.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .try_init();
    let a = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("rails_renewal: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let psk = std::env::var("KVWIRE_PSK")
        .ok()
        .and_then(|k| Psk::from_hex(&k).ok());
    let Some(psk) = psk else {
        eprintln!("rails_renewal: KVWIRE_PSK (hex) is required");
        return std::process::ExitCode::from(2);
    };
    let devices: Vec<&str> = a.devices.split(',').collect();
    let config = ManagerConfig::new(a.role, TPP, (PAGES as u64) * u64::from(TPP), Auth::Psk(psk))
        .fingerprint("rails-renewal")
        .transport(TransportConfig::rdma_devices(
            &a.devices,
            devices.len() as u16,
        ))
        // SoftRoCE under TCG: a heartbeat can wait behind seconds of writes (SPEC §8.3).
        .liveness_timeout(Duration::from_secs(10));
    let bufs = cache();
    // SAFETY: the buffers are leaked (live for the process) and do not overlap.
    let mgr = match unsafe { Manager::new(config, &bufs) } {
        Ok(m) => m,
        Err(e) => {
            eprintln!("rails_renewal: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let wait = Duration::from_secs(60);
    let mut verified = 0u64;
    let mut failed: std::collections::BTreeMap<String, u64> = Default::default();
    let mut corrupt = 0u64;
    match a.role {
        Role::Prefill => {
            if let Err(e) = mgr.listen(&a.addr) {
                eprintln!("rails_renewal: {e}");
                return std::process::ExitCode::FAILURE;
            }
            eprintln!("rails_renewal: listening on {}", a.addr);
            for room in 1..=a.transfers {
                // The prefill's pages for this request: a slot of its own in turn.
                let src: Vec<u32> = (0..REQUEST_PAGES as u32)
                    .map(|o| ((room as usize * REQUEST_PAGES) % PAGES) as u32 + o)
                    .collect();
                for (o, &p) in src.iter().enumerate() {
                    for b in 0..2 {
                        pattern(room, o, b, page(&bufs, b, p));
                    }
                }
                let tx = match mgr.sender(TransferId(room), None) {
                    Ok(t) => t,
                    Err(e) => {
                        *failed.entry(format!("{:?}", e.kind())).or_default() += 1;
                        continue;
                    }
                };
                let tokens = REQUEST_PAGES as u32 * TPP;
                let outcome = tx
                    .init(REQUEST_PAGES as u32, tokens)
                    .and_then(|()| {
                        let start = Instant::now();
                        while tx.poll() == KvPoll::Bootstrapping && start.elapsed() < wait {
                            std::thread::sleep(Duration::from_millis(1));
                        }
                        if tx.poll() == KvPoll::WaitingForInput {
                            tx.send(&src, None)
                        } else {
                            Ok(())
                        }
                    })
                    .map(|()| tx.wait(wait));
                match outcome {
                    Ok(KvPoll::Success) => verified += 1,
                    Ok(_) => {
                        let kind = tx
                            .failure()
                            .map_or("None".into(), |e| format!("{:?}", e.kind()));
                        *failed.entry(kind).or_default() += 1;
                    }
                    Err(e) => *failed.entry(format!("{:?}", e.kind())).or_default() += 1,
                }
                let _ = tx.clear();
            }
            let stats = mgr.handshake_stats();
            println!(
                "{{\"role\":\"prefill\",\"transfers\":{},\"verified\":{verified},\"failed\":{},\"connections\":{}}}",
                a.transfers,
                serde_json_map(&failed),
                stats.established
            );
        }
        Role::Decode => {
            for room in 1..=a.transfers {
                let dst: Vec<u32> = (0..REQUEST_PAGES as u32)
                    .map(|o| ((room as usize * 7 * REQUEST_PAGES) % PAGES) as u32 / 4 * 4 + o)
                    .collect();
                let rx = match mgr.receiver_at(TransferId(room), &a.addr) {
                    Ok(r) => r,
                    Err(e) => {
                        *failed.entry(format!("{:?}", e.kind())).or_default() += 1;
                        continue;
                    }
                };
                let tokens = REQUEST_PAGES as u32 * TPP;
                match rx.init(dst.clone(), tokens, wait).map(|()| rx.wait(wait)) {
                    Ok(KvPoll::Success) => {
                        verified += 1;
                        let mut want = vec![0u8; PAGE_BYTES];
                        for (o, &p) in dst.iter().enumerate() {
                            for b in 0..2 {
                                pattern(room, o, b, &mut want);
                                if page(&bufs, b, p) != &want[..] {
                                    corrupt += 1;
                                }
                            }
                        }
                    }
                    Ok(_) => {
                        let kind = rx
                            .failure()
                            .map_or("None".into(), |e| format!("{:?}", e.kind()));
                        *failed.entry(kind).or_default() += 1;
                    }
                    Err(e) => *failed.entry(format!("{:?}", e.kind())).or_default() += 1,
                }
                let _ = rx.release();
                std::thread::sleep(a.pace);
            }
            println!(
                "{{\"role\":\"decode\",\"transfers\":{},\"verified\":{verified},\"failed\":{},\"corrupt\":{corrupt}}}",
                a.transfers,
                serde_json_map(&failed)
            );
        }
    }
    if corrupt > 0 {
        std::process::ExitCode::FAILURE
    } else {
        std::process::ExitCode::SUCCESS
    }
}

/// `{"kind":count,...}` without a JSON dependency.
fn serde_json_map(m: &std::collections::BTreeMap<String, u64>) -> String {
    let body: Vec<String> = m.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
    format!("{{{}}}", body.join(","))
}
