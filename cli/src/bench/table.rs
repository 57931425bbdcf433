//! The perftest-style table of a bench report.

use super::{Report, Verify, Workload};

/// `65536` -> `64 KiB`.
pub fn human_bytes(b: u64) -> String {
    if b >= 1 << 20 && b % (1 << 20) == 0 {
        format!("{} MiB", b >> 20)
    } else if b >= 1 << 10 && b % (1 << 10) == 0 {
        format!("{} KiB", b >> 10)
    } else {
        format!("{b} B")
    }
}

/// The perftest-style table.
pub fn table(report: &Report) -> String {
    let mut out = String::new();
    let verify = match report.spec.verify {
        Verify::Xxh3 => "verify: xxh3 digests over landed memory",
        Verify::Crc32 => "verify: crc32 digests over landed memory",
        Verify::None => {
            "verify: NONE -- UNVERIFIED, only to measure the integrity tax; never use for data"
        }
    };
    let workload = match report.spec.workload {
        Workload::Pool => "workload: pool".to_string(),
        Workload::Engine { memory, copy } => format!(
            "workload: engine memory {} per node, scattered pages, {}",
            human_bytes(memory),
            if copy {
                "copied through kvwire's pool"
            } else {
                "in place"
            }
        ),
    };
    out += &format!(
        "kvwire bench  transport: {}  {}  {}\n",
        report.transport, workload, verify
    );
    out += &format!(
        "{:>9} {:>6} {:>4} {:>9} {:>4} {:>8} {:>9} {:>8} {:>8} {:>9} {:>9} {:>8} {:>8} {:>6} {:>8} {:>6} {:>8} {:>7}  failures\n",
        "page",
        "pages",
        "bufs",
        "transfers",
        "conc",
        "GB/s",
        "xfer/s",
        "p50 ms",
        "p99 ms",
        "p99.9 ms",
        "verified",
        "checked",
        "raw GB/s",
        "ratio",
        "raw@conc",
        "ratio",
        "CPU s/GB",
        "raw CPU"
    );
    for c in &report.cases {
        let mut failures = if c.failures.is_empty() {
            "-".to_string()
        } else {
            c.failures
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(",")
        };
        if !c.unconfirmed.is_empty() {
            // Apart from the failures: these may have been delivered (SPEC §7.6).
            failures += &format!(
                " unconfirmed({})",
                c.unconfirmed
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(",")
            );
        }
        out += &format!(
            "{:>9} {:>6} {:>4} {:>9} {:>4} {:>8.3} {:>9.1} {:>8.2} {:>8.2} {:>9.2} {:>9} {:>8} {:>8} {:>6} {:>8} {:>6} {:>8} {:>7}  {}\n",
            human_bytes(u64::from(c.page_bytes)),
            c.pages,
            c.buffers,
            c.transfers,
            c.concurrency,
            c.gb_per_s,
            c.transfers_per_s,
            c.p50_ms,
            c.p99_ms,
            c.p999_ms,
            c.verified,
            c.bytes_checked,
            c.raw_gb_per_s.map_or("-".into(), |r| format!("{r:.3}")),
            c.ratio_to_raw.map_or("-".into(), |r| format!("{r:.2}")),
            c.raw_in_flight_gb_per_s
                .map_or("-".into(), |r| format!("{r:.3}")),
            c.ratio_to_raw_in_flight
                .map_or("-".into(), |r| format!("{r:.2}")),
            c.cpu_s_per_gb.map_or("-".into(), |r| format!("{r:.2}")),
            c.raw_cpu_s_per_gb.map_or("-".into(), |r| format!("{r:.2}")),
            failures
        );
        let path = match (c.same_host_pulls, c.tcp_stream_gb_per_s) {
            (Some(true), Some(t)) => format!(
                "pages pulled from the prefill's memory (same host); over the TCP stream {t:.3} GB/s, ratio {}",
                c.ratio_to_tcp_stream.map_or("-".into(), |r| format!("{r:.2}"))
            ),
            (Some(true), None) => "pages pulled from the prefill's memory (same host)".into(),
            (Some(false), _) => "page bytes on the TCP stream".into(),
            (None, _) => String::new(),
        };
        match c.memcpy_gb_per_s {
            Some(m) => {
                out += &format!(
                    "{:>9} memcpy of the same bytes {m:.3} GB/s, ratio {}{}{path}\n",
                    "",
                    c.ratio_to_memcpy.map_or("-".into(), |r| format!("{r:.2}")),
                    if path.is_empty() { "" } else { "; " }
                )
            }
            None if !path.is_empty() => out += &format!("{:>9} {path}\n", ""),
            None => {}
        }
    }
    if let Some(m) = &report.metrics {
        out += "counters:";
        for line in m.lines().filter(|l| !l.starts_with('#')) {
            out += "\n  ";
            out += line;
        }
        out += "\n";
    }
    out
}
