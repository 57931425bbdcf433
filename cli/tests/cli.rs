//! The `kvwire` binary as a user runs it: the bench checks content and exits non-zero on
//! any failure; check-config refuses an undersized pool naming both numbers.

mod common;

use std::process::Command;

use common::process::assert_all_verified;

fn kvwire(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvwire"))
        .args(args)
        .output()
        .expect("run kvwire");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn json(stdout: &str) -> serde_json::Value {
    serde_json::from_str(stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"))
}

#[test]
fn bench_verifies_and_byte_checks_every_transfer() {
    let (code, out, err) = kvwire(&[
        "bench",
        "--page-sizes",
        "16K",
        "--bytes",
        "4M",
        "--check-bytes",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let case = &json(&out)["cases"][0];
    let transfers = case["transfers"].as_u64().unwrap();
    assert!(transfers > 0);
    assert_eq!(case["verified"].as_u64(), Some(transfers), "{case}");
    assert_eq!(case["bytes_checked"].as_u64(), Some(transfers), "{case}");
    assert_eq!(
        case["pages_free_after"], case["pages_total"],
        "receiver pages leaked: {case}"
    );
    assert!(case["raw_gb_per_s"].as_f64().unwrap() > 0.0);
    // The pool workload has no requests of several pages: no in-flight raw baseline.
    assert!(case["raw_in_flight_gb_per_s"].is_null(), "{case}");
}

/// `--worker-threads` sizes the bench's runtime (the report says how many ran) and the run
/// verifies as with the default; 0 is refused before anything runs.
#[test]
fn bench_runs_on_the_worker_threads_it_is_given() {
    let args = [
        "bench",
        "--page-sizes",
        "16K",
        "--bytes",
        "2M",
        "--check-bytes",
        "--json",
    ];
    let (code, out, err) = kvwire(&[&args[..], &["--worker-threads", "1"]].concat());
    assert_eq!(code, 0, "{err}");
    let report = json(&out);
    assert_eq!(report["worker_threads"].as_u64(), Some(1), "{report}");
    let case = &report["cases"][0];
    assert_all_verified(case);
    assert_eq!(case["bytes_checked"], case["transfers"], "{case}");
    let (code, out, err) = kvwire(&[&args[..], &["--worker-threads", "3"]].concat());
    assert_eq!(code, 0, "{err}");
    assert_eq!(json(&out)["worker_threads"].as_u64(), Some(3));
    let (code, _, err) = kvwire(&[&args[..], &["--worker-threads", "0"]].concat());
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--worker-threads"), "{err}");
}

/// Regression: the sender connection ignored the digest mode, so `--verify none` failed
/// every transfer (fail closed: the receiver never accepted the mismatch).
#[test]
fn bench_verify_none_says_so_and_delivers() {
    let (code, out, err) = kvwire(&[
        "bench",
        "--page-sizes",
        "16K",
        "--bytes",
        "2M",
        "--verify",
        "none",
    ]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("UNVERIFIED"), "{out}");
    assert!(err.contains("NOT verified"), "{err}");
    assert!(!out.contains("DIGEST_MISMATCH"), "{out}");
}

/// The engine workload, in place and copied, and with KV memory placed off a 4 KiB boundary
/// (as an engine's allocator may place it), checks every byte that landed in the decode
/// engine's own pages, leaks no page, has its scattered raw baselines (in memory placed
/// alike), and reports where the buffers started. An offset of a whole page is refused.
#[test]
fn bench_engine_workload_in_place_and_copied_checks_every_byte() {
    for (copy, offset) in [(false, 0), (true, 0), (false, 16)] {
        let offset_arg = offset.to_string();
        let mut args = vec![
            "bench",
            "--workload",
            "engine",
            "--memory",
            "16M",
            "--page-sizes",
            "16K",
            "--bytes",
            "4M",
            "--check-bytes",
            "--json",
            "--buffer-offset",
            &offset_arg,
        ];
        if copy {
            args.push("--copy");
        }
        let (code, out, err) = kvwire(&args);
        assert_eq!(code, 0, "copy {copy}, offset {offset}: {err}");
        let report = json(&out);
        assert_eq!(report["spec"]["workload"]["kind"], "engine", "{report}");
        assert_eq!(report["spec"]["buffer_offset"], offset, "{report}");
        let case = &report["cases"][0];
        let transfers = case["transfers"].as_u64().unwrap();
        assert!(transfers > 0);
        assert_eq!(case["bytes_checked"].as_u64(), Some(transfers), "{case}");
        assert_eq!(case["pages_free_after"], case["pages_total"], "{case}");
        assert!(case["raw_gb_per_s"].as_f64().unwrap() > 0.0);
        // The same requests in flight over raw TCP, and kvwire's ratio to it.
        assert!(
            case["raw_in_flight_gb_per_s"].as_f64().unwrap() > 0.0,
            "{case}"
        );
        assert!(
            case["ratio_to_raw_in_flight"].as_f64().unwrap() > 0.0,
            "{case}"
        );
    }
    let (code, _, err) = kvwire(&["bench", "--buffer-offset", "4096", "--bytes", "1M"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("buffer-offset"), "{err}");
}

/// The engine workload across two processes: each engine registers its own memory.
#[test]
fn bench_engine_workload_across_two_processes() {
    use std::process::Stdio;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    drop(listener);
    let common = [
        "--workload",
        "engine",
        "--memory",
        "16M",
        "--page-sizes",
        "16K",
        "--bytes",
        "4M",
        "--insecure-no-auth",
        "--json",
    ];
    let decode = Command::new(env!("CARGO_BIN_EXE_kvwire"))
        .args(["bench", "--listen", &addr, "--check-bytes"])
        .args(common)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (code, prefill_out, err) =
        kvwire(&[&["bench", "--connect", &addr][..], &common[..]].concat());
    assert_eq!(code, 0, "prefill: {err}");
    let out = decode.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report = json(&String::from_utf8_lossy(&out.stdout));
    let case = &report["cases"][0];
    let transfers = case["transfers"].as_u64().unwrap();
    assert_eq!(case["bytes_checked"].as_u64(), Some(transfers), "{case}");
    assert!(case["raw_gb_per_s"].as_f64().unwrap() > 0.0, "{case}");
    assert!(
        case["raw_in_flight_gb_per_s"].as_f64().unwrap() > 0.0,
        "{case}"
    );
    for side in [&report, &json(&prefill_out)] {
        let c = &side["cases"][0];
        assert!(
            c["raw_in_flight_cpu_s_per_gb"].as_f64().unwrap() > 0.0,
            "{c}"
        );
    }
}

#[test]
fn bench_table_names_its_columns() {
    let (code, out, err) = kvwire(&["bench", "--page-sizes", "8K", "--bytes", "1M"]);
    assert_eq!(code, 0, "{err}");
    for col in [
        "GB/s", "xfer/s", "p50 ms", "p99 ms", "verified", "raw GB/s", "ratio", "raw@conc",
        "failures",
    ] {
        assert!(out.contains(col), "missing {col}: {out}");
    }
}

#[test]
fn check_config_refuses_an_undersized_pool_naming_both_numbers() {
    let file = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/config/decode-undersized.toml"
    );
    let (code, out, _) = kvwire(&["check-config", file]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("65536") && out.contains("131072") && out.contains("REFUSED"),
        "{out}"
    );
}

#[test]
fn check_config_accepts_a_pool_that_holds_the_context() {
    let file = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/config/decode.toml"
    );
    let (code, out, err) = kvwire(&["check-config", file]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("131072 tokens") && out.contains("ok:"),
        "{out}"
    );
}

#[test]
fn check_config_rejects_unknown_keys() {
    let dir = std::env::temp_dir().join(format!("kvwire-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("typo.toml");
    std::fs::write(&file, "[pool]\ntokens_per_page = 16\nbuffers = 2\npage_bytes = 4096\npages = 8\npagez = 9\n[engine]\nmax_context_tokens = 64\n").unwrap();
    let (code, _, err) = kvwire(&["check-config", file.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("pagez"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn doctor_reports_without_failing() {
    let (code, out, err) = kvwire(&["doctor"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("rdma:") && out.contains("memlock:") && out.contains("hugepages:"),
        "{out}"
    );
}

fn kvwire_env(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvwire"));
    c.args(args)
        .env_remove("KVWIRE_PSK")
        .env_remove("KVWIRE_PSK_FILE");
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().expect("run kvwire");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn doctor_reports_auth_without_printing_the_key() {
    let key = "00112233445566778899aabbccddeeff";
    let (code, out, err) = kvwire_env(&["doctor"], &[("KVWIRE_PSK", key)]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("auth:      on: psk (key id"), "{out}");
    assert!(out.contains("KVWIRE_PSK"), "{out}");
    assert!(!out.contains(key) && !err.contains(key), "{out}{err}");
    let (code, out, _) = kvwire_env(&["doctor"], &[]);
    assert_eq!(code, 0);
    assert!(out.contains("auth:      WARNING"), "{out}");
}

#[test]
fn two_process_bench_needs_a_key_or_an_explicit_off() {
    let (code, _, err) = kvwire_env(&["bench", "--connect", "127.0.0.1:9"], &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("no pre-shared key"), "{err}");
    assert!(err.contains("--insecure-no-auth"), "{err}");
}

#[test]
fn gen_psk_prints_a_usable_key() {
    let (code, out, err) = kvwire_env(&["gen-psk"], &[]);
    assert_eq!(code, 0, "{err}");
    let key = out.trim();
    assert_eq!(key.len(), 64, "{out}");
    assert!(kvwire::proto::auth::Psk::from_hex(key).is_ok());
    let (_, again, _) = kvwire_env(&["gen-psk"], &[]);
    assert_ne!(again.trim(), key, "two keys alike");
}

/// `kvwire bench --listen --connections 2` serves its two good prefill processes whatever
/// else connects before and between them: a port scan, an HTTP request, a peer with the
/// wrong key, a client that connects and stalls.
#[test]
fn bench_listen_serves_its_good_connections_whatever_else_connects() {
    // With the raw baseline, bad clients meet its announcement check; without, the
    // handshake listener.
    for raw in [true, false] {
        bench_listen_with_bad_clients(raw);
    }
}

fn bench_listen_with_bad_clients(raw: bool) {
    use std::io::{Read, Write};
    use std::net::TcpStream;
    use std::process::Stdio;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let addr_s = addr.to_string();
    let psk = "6b767769726520746573742070736b206f662033322062797465732e2e2e2e2e";
    let mut common = vec!["--page-sizes", "16K", "--bytes", "2M", "--json"];
    if !raw {
        common.push("--no-raw");
    }
    let decode = Command::new(env!("CARGO_BIN_EXE_kvwire"))
        .args(["bench", "--listen", &addr_s, "--connections", "2"])
        .args(&common)
        .env("KVWIRE_PSK", psk)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let connect = || loop {
        if let Ok(s) = TcpStream::connect(addr) {
            return s;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let bad_clients = || {
        drop(connect()); // a port scan
        let mut http = connect();
        let _ = http.write_all(b"GET / HTTP/1.0\r\n\r\n");
        let _ = http.set_read_timeout(Some(std::time::Duration::from_secs(5)));
        let _ = http.read_to_end(&mut Vec::new());
        // A peer with the wrong key.
        let rt = tokio::runtime::Runtime::new().unwrap();
        let wrong = kvwire::Node::new(kvwire::NodeConfig::example()).unwrap();
        assert!(rt
            .block_on(kvwire::SenderConn::connect(addr, &wrong))
            .is_err());
        connect() // stalls: connected, never says anything
    };
    let mut stalled = Vec::new();
    for _ in 0..2 {
        // Before each good prefill process (the decode exits after the second).
        stalled.push(bad_clients());
        let (code, _, err) = {
            let out = Command::new(env!("CARGO_BIN_EXE_kvwire"))
                .args(["bench", "--connect", &addr_s])
                .args(&common)
                .env("KVWIRE_PSK", psk)
                .output()
                .unwrap();
            (
                out.status.code().unwrap_or(-1),
                String::from_utf8_lossy(&out.stdout).into_owned(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        };
        assert_eq!(code, 0, "a good prefill process failed: {err}");
    }
    let out = decode.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let report = json(&String::from_utf8_lossy(&out.stdout));
    let cases = report["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 2, "{report}");
    for case in cases {
        assert_all_verified(case);
    }
    let dropped = if raw {
        "not a raw-baseline connection"
    } else {
        "handshake failed"
    };
    assert!(err.contains(dropped), "{err}");
    drop(stalled);
}

/// The sweep: every page size at every depth in one report, each case with its CPU cost
/// beside the raw baseline's and its latency percentiles, drawn into an SVG chart.
#[test]
fn bench_sweeps_depths_reports_cpu_cost_and_draws_a_chart() {
    let dir = std::env::temp_dir().join(format!("kvwire-sweep-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let chart = dir.join("sweep.svg");
    let (code, out, err) = kvwire(&[
        "bench",
        "--workload",
        "engine",
        "--memory",
        "16M",
        "--page-sizes",
        "16K,64K",
        "--pages",
        "2",
        "--bytes",
        "4M",
        "--concurrency",
        "1,3",
        "--chart",
        chart.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let report = json(&out);
    let cases = report["cases"].as_array().unwrap();
    let mut seen: Vec<(u64, u64)> = cases
        .iter()
        .map(|c| {
            (
                c["page_bytes"].as_u64().unwrap(),
                c["concurrency"].as_u64().unwrap(),
            )
        })
        .collect();
    seen.sort_unstable();
    assert_eq!(
        seen,
        [(16384, 1), (16384, 3), (65536, 1), (65536, 3)],
        "{report}"
    );
    for c in cases {
        assert_all_verified(c);
        assert!(c["cpu_seconds"].as_f64().unwrap() > 0.0, "{c}");
        assert!(c["cpu_s_per_gb"].as_f64().unwrap() > 0.0, "{c}");
        assert!(c["raw_cpu_s_per_gb"].as_f64().unwrap() > 0.0, "{c}");
        assert!(c["cpu_ratio_to_raw"].as_f64().unwrap() > 0.0, "{c}");
        let (p50, p99, p999) = (
            c["p50_ms"].as_f64().unwrap(),
            c["p99_ms"].as_f64().unwrap(),
            c["p999_ms"].as_f64().unwrap(),
        );
        assert!(0.0 < p50 && p50 <= p99 && p99 <= p999, "{c}");
    }
    let svg = std::fs::read_to_string(&chart).expect("the chart was written");
    assert!(
        svg.starts_with("<svg"),
        "not an SVG: {}",
        &svg[..svg.len().min(80)]
    );
    for text in [
        "kvwire, 1 in flight",
        "kvwire, 3 in flight",
        "raw TCP",
        "p99.9, 3 in flight",
        "64 KiB",
    ] {
        assert!(svg.contains(text), "the chart lacks {text:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);

    // A sweep runs in one process only.
    let (code, _, err) = kvwire(&[
        "bench",
        "--insecure-no-auth",
        "--connect",
        "127.0.0.1:1",
        "--concurrency",
        "1,2",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("one process"), "{err}");
}
