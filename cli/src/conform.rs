//! `kvwire conform` (feature `conform`): the conformance kit
//! ([`kvwire::testkit::conformance`]) as a command: a scripted prefill against a listening
//! decode, one line per check, non-zero exit on any failure.

use std::net::SocketAddr;
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use kvwire::config::file::ConfigFile;
use kvwire::testkit::conformance::{self, Options, Verdict};
use kvwire::{Listener, ListenerConfig, Node};

/// Runs the kit against `connect`, or, with `self_test`, against a kvwire decode listening in
/// this process with the same configuration.
pub fn main(
    connect: Option<SocketAddr>,
    config: &Path,
    self_test: bool,
    options: Options,
) -> ExitCode {
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
        let (addr, held) = match (connect, self_test) {
            (Some(addr), false) => (addr, None),
            (None, true) => {
                let node = Node::new(node_config.clone()).map_err(|e| e.to_string())?;
                let mut listener =
                    Listener::receivers("127.0.0.1:0", &node, ListenerConfig::default())
                        .await
                        .map_err(|e| e.to_string())?;
                let addr = listener.local_addr();
                let held = tokio::spawn(async move {
                    let mut held = Vec::new();
                    while let Some(c) = listener.accept().await {
                        held.push(c);
                    }
                });
                (addr, Some(held))
            }
            _ => return Err("give --connect ADDR or --self-test".to_string()),
        };
        println!("kvwire conform: checking the decode listening at {addr}");
        let before = resident_kib("VmRSS");
        let checked = conformance::run(addr, &node_config, options).await;
        if let (true, Some(before), Some(peak)) = (held.is_some(), before, resident_kib("VmHWM")) {
            // The decode runs in this process: what the checks (the PING flood among them)
            // made it hold at most, the kit's own buffers included.
            println!(
                "kvwire conform: resident {:.1} MB before the checks, peak {:.1} MB (kit and decode together)",
                before as f64 / 1024.0,
                peak as f64 / 1024.0
            );
        }
        if let Some(h) = held {
            h.abort();
        }
        Ok(checked)
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
