//! `kvwire conform` (feature `conform`): the conformance kit
//! ([`kvwire::testkit::conformance`]) as a command: a scripted prefill against a listening
//! decode (`--connect`), a scripted decode for connecting prefills (`--listen`), or both
//! against kvwire in this process (`--self-test`); one line per check, non-zero exit on any
//! failure.

use std::net::SocketAddr;
use std::path::Path;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvwire::config::file::ConfigFile;
use kvwire::testkit::conformance::{self, Checked, Options, Verdict};
use kvwire::{Listener, ListenerConfig, Node, NodeConfig};

/// What the command checks.
pub enum Target {
    /// The decode listening there.
    Decode(SocketAddr),
    /// The prefills that connect here.
    Prefill(SocketAddr),
    /// kvwire's own decode and prefill, in this process.
    SelfTest,
}

/// Runs the kit as `target` says.
pub fn main(target: Target, config: &Path, options: Options) -> ExitCode {
    let node_config = match ConfigFile::load(config).and_then(|c| c.node_config()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvwire conform: {e}");
            return ExitCode::from(2);
        }
    };
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvwire conform: {e}");
            return ExitCode::FAILURE;
        }
    };
    let checked = rt.block_on(async {
        let mut checked = Vec::new();
        match target {
            Target::Decode(addr) => {
                println!("kvwire conform: checking the decode listening at {addr}");
                checked.extend(conformance::run(addr, &node_config, options).await);
            }
            Target::Prefill(addr) => {
                let listener = tokio::net::TcpListener::bind(addr)
                    .await
                    .map_err(|e| format!("listen on {addr}: {e}"))?;
                println!(
                    "kvwire conform: checking the prefill that connects to {} (it must connect again after each check)",
                    listener.local_addr().map_err(|e| e.to_string())?
                );
                checked.extend(conformance::run_prefill(&listener, &node_config, options).await);
            }
            Target::SelfTest => {
                let before = resident_kib("VmRSS");
                checked.extend(self_test_decode(&node_config, options).await?);
                checked.extend(self_test_prefill(&node_config, options).await?);
                if let (Some(before), Some(peak)) = (before, resident_kib("VmHWM")) {
                    // kvwire's decode and prefill run in this process: what the checks (the
                    // PING floods among them) made it hold at most, the kit's buffers included.
                    println!(
                        "kvwire conform: resident {:.1} MB before the checks, peak {:.1} MB (kit, decode and prefill together)",
                        before as f64 / 1024.0,
                        peak as f64 / 1024.0
                    );
                }
            }
        }
        Ok::<_, String>(checked)
    });
    let checked = match checked {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvwire conform: {e}");
            return ExitCode::from(2);
        }
    };
    let mut failed = 0;
    for c in &checked {
        let (tag, detail) = match &c.verdict {
            Verdict::Pass(d) => ("PASS", d),
            Verdict::Fail(d) => {
                failed += 1;
                ("FAIL", d)
            }
            Verdict::Skip(d) => ("SKIP", d),
        };
        println!("{tag}  {} ({}): {detail}", c.name, c.spec);
    }
    println!("kvwire conform: {} checks, {failed} failed", checked.len());
    if failed > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// The decode checks against a kvwire decode listening in this process.
async fn self_test_decode(config: &NodeConfig, options: Options) -> Result<Vec<Checked>, String> {
    let node = Node::new(config.clone()).map_err(|e| e.to_string())?;
    let mut listener = Listener::receivers("127.0.0.1:0", &node, ListenerConfig::default())
        .await
        .map_err(|e| e.to_string())?;
    let addr = listener.local_addr();
    let held = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Some(c) = listener.accept().await {
            held.push(c);
        }
    });
    println!("kvwire conform: checking kvwire's decode listening at {addr}");
    let checked = conformance::run(addr, config, options).await;
    held.abort();
    Ok(checked)
}

/// The prefill checks against a kvwire prefill in this process that connects again whenever
/// a check ended its connection.
async fn self_test_prefill(config: &NodeConfig, options: Options) -> Result<Vec<Checked>, String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let node = Node::new(config.clone()).map_err(|e| e.to_string())?;
    let done = Arc::new(AtomicBool::new(false));
    let connecting = tokio::spawn(conformance::reconnecting_prefill(addr, node, done.clone()));
    println!("kvwire conform: checking kvwire's prefill connecting to {addr}");
    let checked = conformance::run_prefill(&listener, config, options).await;
    done.store(true, Ordering::SeqCst);
    let _ = connecting.await;
    Ok(checked)
}

/// A `/proc/self/status` size in KiB (`VmRSS`, `VmHWM`), where there is one.
fn resident_kib(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// The kit's waits from the command's flags.
pub fn options(wait_s: u64, interval_ms: u64) -> Options {
    Options {
        wait: Duration::from_secs(wait_s),
        interval: Duration::from_millis(interval_ms),
        ..Options::default()
    }
}
