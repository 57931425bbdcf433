//! The `kvwire` command-line tool: `bench` (the main job), `check-config`, `doctor`,
//! `gen-psk`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

mod bench;
#[cfg(feature = "conform")]
mod conform;
mod doctor;

use bench::{BenchSpec, BenchTransport, Verify};
use clap::{Parser, Subcommand, ValueEnum};
use kvwire::config::file::ConfigFile;

#[derive(Parser)]
#[command(
    name = "kvwire",
    version,
    about = "KV-cache transfer engine with an integrity protocol"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Verified transfer benchmark. With no address: both roles in this process over TCP
    /// loopback, against a raw TCP baseline measured in the same run.
    Bench(Box<BenchArgs>),
    /// Checks a configuration file: pool capacity in tokens against the context length.
    /// Exits non-zero on a mismatch, naming both numbers.
    CheckConfig {
        /// The TOML configuration file.
        file: PathBuf,
    },
    /// What this host offers: RDMA devices, locked-memory limit, huge pages, and the
    /// configuration check when given a file.
    Doctor {
        /// A TOML configuration file to check as well.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Exit non-zero unless an RDMA device has an ACTIVE port with a RoCE v2 GID.
        #[arg(long)]
        require_rdma: bool,
    },
    /// Prints a fresh random pre-shared key (hex) for `--psk-file`, `[auth] psk_file`,
    /// KVWIRE_PSK_FILE or KVWIRE_PSK.
    GenPsk,
    /// The conformance kit: a scripted prefill against a listening decode (`--connect`) or a
    /// scripted decode for a connecting prefill (`--listen`), any implementation's, one
    /// connection per check; exits non-zero if one fails.
    #[cfg(feature = "conform")]
    Conform {
        /// The decode's listening address.
        #[arg(long, conflicts_with_all = ["listen", "self_test"])]
        connect: Option<std::net::SocketAddr>,
        /// Listen here for the prefill's connections (run it with its connect address set
        /// here, again each time a check closes it, until the kit is done).
        #[arg(long, conflicts_with = "self_test")]
        listen: Option<std::net::SocketAddr>,
        /// The kit's node configuration (TOML, as `check-config` reads): the target's layout,
        /// fingerprint and key.
        #[arg(long)]
        config: PathBuf,
        /// Check kvwire's decode and prefill in this process, with the same configuration.
        #[arg(long)]
        self_test: bool,
        /// Seconds to wait for an answer or a close (longer than the target's handshake and
        /// liveness timeouts).
        #[arg(long, default_value_t = 15)]
        wait_s: u64,
        /// The target's heartbeat interval, in ms (the PING flood's bound counts in them).
        #[arg(long, default_value_t = 250)]
        interval_ms: u64,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum VerifyArg {
    Xxh3,
    Crc32,
    None,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum WorkloadArg {
    /// kvwire's page pool chooses the pages on both sides.
    Pool,
    /// Each engine's own registered memory (--memory), scattered pages its allocator chose,
    /// sent and received in place (zero copy), or copied through kvwire's pool with --copy.
    Engine,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum TransportArg {
    Tcp,
    Rdma,
    Loopback,
}

#[derive(clap::Args)]
struct BenchArgs {
    /// Workload: pool (kvwire's page pool chooses the pages) or engine (each engine's own
    /// registered KV memory, pages chosen by its allocator as a random permutation of all
    /// of them, sent and received in place; docs/BENCHMARKS.md).
    #[arg(long, value_enum, default_value = "pool")]
    workload: WorkloadArg,
    /// With --workload engine: KV memory per engine (suffixes K, M, G).
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    memory: u64,
    /// With --workload engine: copy every page into kvwire's pool on the prefill side and
    /// out of it on the decode side (how an engine integrated before zero copy), to measure
    /// what in place saves.
    #[arg(long)]
    copy: bool,
    /// Transport: tcp (the embedded default), rdma (RC queue pairs on --device; needs a
    /// build with `--features rdma` and an RDMA device, e.g. SoftRoCE's rxe0), or loopback
    /// (both roles in this process over the in-process wire). tcp and rdma run both roles in
    /// this process, or one role with --listen/--connect (for rdma, TCP only carries the
    /// handshake and then watches the peer's liveness). One loop runs all three.
    #[arg(long, value_enum, default_value = "tcp")]
    transport: TransportArg,
    /// With --transport rdma: the RDMA device (default: the first one), or several
    /// comma-separated (`rxe0,rxe1`): one rail each, `--queue-pairs` raised to one per rail.
    #[arg(long)]
    device: Option<String>,
    /// With --transport rdma: RC queue pairs per connection (both processes must agree);
    /// transfers take them in turn.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    queue_pairs: u16,
    /// With --transport rdma: poll completion queues in a loop instead of sleeping on the
    /// completion channel.
    #[arg(long)]
    busy_poll: bool,
    /// With --transport rdma: the queue pairs' local ACK timeout, 4.096 µs x 2^N (1 to 31;
    /// 14, about 67 ms, as ib_write_bw's default -u). Higher where acknowledgements can queue
    /// longer than that (docs/BENCHMARKS.md, "Retransmissions on SoftRoCE").
    #[arg(long, default_value_t = kvwire::config::DEFAULT_ACK_TIMEOUT,
          value_parser = ack_timeout_arg)]
    ack_timeout: u8,
    /// With --transport rdma, decode side: pages per stripe below which a transfer is not
    /// written over one more queue pair at once (a transfer of P pages takes
    /// min(P / N, queue pairs), each rail once before any twice; 0: one queue pair per
    /// transfer).
    #[arg(long, default_value_t = kvwire::config::DEFAULT_STRIPE_PAGES)]
    stripe_pages: u32,
    /// With --transport rdma, decode side: use every rail alike instead of keeping to those
    /// on the KV memory's NUMA node while one is up (`kvwire doctor` shows each device's
    /// node).
    #[arg(long)]
    no_rail_affinity: bool,
    /// Worker threads of the bench's tokio runtime (default: one per core). Engines choose
    /// their own runtime; with both ends of a two-process run on one small host, fewer
    /// workers mean fewer wake-ups across threads per transfer (docs/BENCHMARKS.md).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=1024))]
    worker_threads: Option<u16>,
    /// Two-process mode, decode side: listen here and receive.
    #[arg(long, conflicts_with = "connect")]
    listen: Option<SocketAddr>,
    /// Two-process mode, prefill side: connect here and send.
    #[arg(long)]
    connect: Option<SocketAddr>,
    /// With --listen: serve this many sender connections in turn.
    #[arg(long, default_value_t = 1)]
    connections: u32,
    /// In two-process mode, skip the raw TCP baselines (streaming, and for the engine workload
    /// with the same requests in flight).
    #[arg(long)]
    no_raw: bool,
    /// Bytes per page per buffer, one case each (suffixes K, M).
    #[arg(long, value_delimiter = ',', default_value = "64K,1M", value_parser = parse_size_u32)]
    page_sizes: Vec<u32>,
    /// Buffers (e.g. layers x K/V).
    #[arg(long, default_value_t = 4)]
    buffers: u32,
    /// Pages per transfer.
    #[arg(long, default_value_t = 8)]
    pages: u32,
    /// Payload bytes per case (suffixes K, M, G).
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    bytes: u64,
    /// Transfers in flight. A list (e.g. 1,4,16) sweeps the depths, every page size at each
    /// (in one process only).
    #[arg(long, value_delimiter = ',', default_value = "4")]
    concurrency: Vec<u32>,
    /// Also draw the run as an SVG chart here: GB/s beside the raw baseline and p50 / p99 /
    /// p99.9 latency, against the page size, one line per depth.
    #[arg(long)]
    chart: Option<PathBuf>,
    /// Verification: xxh3 (default), crc32, or none (UNVERIFIED: only to measure the
    /// integrity tax).
    #[arg(long, value_enum, default_value = "xxh3")]
    verify: VerifyArg,
    /// Also compare every delivered byte with what the sender wrote.
    #[arg(long)]
    check_bytes: bool,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
    /// Digest transfers of at least this many bytes on the blocking pool instead of the
    /// connection's task (suffixes K, M, G). Default: the transport's: none over TCP, which
    /// digests each page right after the connection's thread copied it (measured on 2 cores:
    /// the pool cost more CPU and GB/s at 8 MiB and 32 MiB), every transfer over RDMA
    /// (docs/BENCHMARKS.md).
    #[arg(long, value_parser = parse_size)]
    digest_offload: Option<u64>,
    /// Threads one offloaded transfer's digests may use at once (its pages split into that
    /// many runs of at least 1 MiB); 1: one thread (the default); 0: the process's cores, at
    /// most 8.
    #[arg(long, default_value_t = 1)]
    digest_threads: usize,
    /// TCP streams per connection (`NodeConfig::tcp_streams`, 1 to 64; both ends): every
    /// transfer's records and frames travel on one, chosen by the receiver round robin.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    tcp_streams: u16,
    /// Same-host pulls over TCP (`NodeConfig::same_host`; SPEC §9.3): `auto` (the decode copies
    /// pages out of the prefill's memory when both run on this host), `off` (page bytes on the
    /// stream) or `require`.
    #[arg(long, default_value = "auto", value_parser = parse_same_host)]
    same_host: kvwire::SameHost,
    /// Threads that copy the node's same-host pulls (`NodeConfig::pull_threads`): 1 on
    /// the connection's task, 0 half the process's cores (at most 8).
    #[arg(long, default_value_t = 0)]
    pull_threads: usize,
    /// Start every KV buffer the run allocates (kvwire's and the raw baselines') this many
    /// bytes past a 4 KiB boundary (0 to 4095; 0, on one, is how kvwire allocates): to
    /// measure memory placed as an engine's allocator places it (glibc's large blocks start
    /// 16 bytes into a page). Over TCP the kernel's copies slow down for some offsets on some
    /// CPUs (docs/BENCHMARKS.md, "Which offsets are slow").
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u16).range(0..4096))]
    buffer_offset: u16,
    /// Receivers digest every transfer's memory after its fence instead of each page as it
    /// lands (TCP, loopback; RDMA always digests after the fence), to measure the difference.
    #[arg(long)]
    digest_after_fence: bool,
    /// Senders digest every transfer's source pages before its first write instead of each
    /// page as it is handed to the transport (host memory), to measure the difference.
    #[arg(long)]
    digest_before_send: bool,
    /// Heartbeats (SPEC §8.3): milliseconds between PINGs on every connection.
    #[arg(long, default_value_t = 250, value_parser = clap::value_parser!(u64).range(1..))]
    heartbeat_ms: u64,
    /// A peer from which nothing arrived for this many milliseconds is declared unresponsive
    /// and its transfers fail (SPEC §8.3). Over RDMA a PING queues behind the WRITEs posted
    /// before it on the same queue pair, so on a slow or emulated device (SoftRoCE under
    /// TCG) allow for the time those take to drain.
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(1..))]
    peer_timeout_ms: u64,
    /// Serve Prometheus metrics on this address while the bench runs.
    #[arg(long)]
    metrics_addr: Option<SocketAddr>,
    /// Pre-shared key file (hex) authenticating the two processes; else KVWIRE_PSK_FILE or
    /// KVWIRE_PSK. Without --listen/--connect an ephemeral key serves both ends.
    #[arg(long)]
    psk_file: Option<PathBuf>,
    /// Turn peer authentication off (any peer that reaches the port can connect).
    #[arg(long, conflicts_with = "psk_file")]
    insecure_no_auth: bool,
}

fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("not a size: {s:?} (e.g. 65536, 64K, 1M)"))
}

fn parse_size_u32(s: &str) -> Result<u32, String> {
    parse_size(s).and_then(|n| u32::try_from(n).map_err(|_| format!("{s} is too large")))
}

fn main() -> ExitCode {
    // Logs go to stderr, filtered by RUST_LOG (default: warnings and errors).
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Bench(args) => bench_main(*args),
        Command::CheckConfig { file } => check_config(&file),
        #[cfg(feature = "conform")]
        Command::Conform {
            connect,
            listen,
            config,
            self_test,
            wait_s,
            interval_ms,
        } => {
            let target = match (connect, listen, self_test) {
                (Some(a), None, false) => conform::Target::Decode(a),
                (None, Some(a), false) => conform::Target::Prefill(a),
                (None, None, true) => conform::Target::SelfTest,
                _ => {
                    eprintln!(
                        "kvwire conform: give one of --connect ADDR, --listen ADDR, --self-test"
                    );
                    return ExitCode::from(2);
                }
            };
            conform::main(target, &config, conform::options(wait_s, interval_ms))
        }
        Command::GenPsk => match kvwire::config::auth::generate_hex() {
            Ok(k) => {
                println!("{k}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("kvwire gen-psk: {e}");
                ExitCode::FAILURE
            }
        },
        Command::Doctor {
            config,
            require_rdma,
        } => {
            let report = kvwire::host::inspect();
            print!("{}", doctor::render(&report));
            print!("{}", doctor::auth_line(config.as_deref()));
            if require_rdma && !report.rdma.iter().any(|d| d.usable()) {
                eprintln!("kvwire doctor: no usable RDMA device (--require-rdma)");
                return ExitCode::FAILURE;
            }
            match config {
                Some(f) => check_config(&f),
                None => ExitCode::SUCCESS,
            }
        }
    }
}

fn check_config(file: &std::path::Path) -> ExitCode {
    let cfg = match ConfigFile::load(file) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvwire check-config: {e}");
            return ExitCode::from(2);
        }
    };
    let geometry = match cfg.geometry() {
        Ok(g) => g,
        Err(e) => {
            eprintln!("kvwire check-config: {e}");
            return ExitCode::from(2);
        }
    };
    let engine = cfg.engine();
    println!(
        "pool:    {} pages x {} tokens/page = {} tokens ({} buffers, {} bytes per page index)",
        geometry.pages,
        geometry.tokens_per_page,
        geometry.capacity_tokens(),
        geometry.buffers(),
        geometry.bytes_per_page_index()
    );
    println!(
        "context: {} tokens (max_context_tokens)",
        engine.max_context_tokens
    );
    // The rest of the file is checked without the key; whether a key is found is reported
    // (the key may be provided only on the serving host).
    if let Err(e) = cfg.node_config_with(kvwire::Auth::Off) {
        eprintln!("kvwire check-config: {e}");
        return ExitCode::from(2);
    }
    match cfg.auth() {
        Ok((a, from)) => {
            let from = from.map(|f| format!(" from {f}")).unwrap_or_default();
            println!("auth:    {}{from}", a.describe());
            if !a.is_on() {
                println!("WARNING: peer authentication is off ([auth] mode = \"off\")");
            }
        }
        Err(e) => println!("WARNING: {e}"),
    }
    match engine.validate_geometry(&geometry) {
        Ok(warnings) if warnings.is_empty() => {
            println!("ok:      the pool holds the longest context");
            ExitCode::SUCCESS
        }
        Ok(warnings) => {
            for w in warnings {
                println!("WARNING: {w} (allowed by allow_undersized_pool)");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("REFUSED: {e}");
            ExitCode::FAILURE
        }
    }
}

fn parse_same_host(s: &str) -> Result<kvwire::SameHost, String> {
    s.parse()
}

fn bench_main(a: BenchArgs) -> ExitCode {
    let two_process = a.listen.is_some() || a.connect.is_some();
    let auth = if !two_process && !a.insecure_no_auth && a.psk_file.is_none() {
        // Both ends in this process: an ephemeral key, unless one was given.
        match kvwire::config::auth::find_psk(None) {
            Ok(Some((k, _))) => kvwire::Auth::Psk(k),
            Ok(None) => kvwire::Auth::ephemeral(),
            Err(e) => {
                eprintln!("kvwire bench: {e}");
                return ExitCode::from(2);
            }
        }
    } else {
        match kvwire::config::auth::resolve(a.insecure_no_auth, a.psk_file.as_deref()) {
            Ok((auth, _)) => auth,
            Err(e) => {
                eprintln!("kvwire bench: {e}");
                return ExitCode::from(2);
            }
        }
    };
    if !auth.is_on() {
        eprintln!("kvwire bench: --insecure-no-auth: peers are NOT authenticated");
    }
    if a.copy && a.workload != WorkloadArg::Engine {
        eprintln!("kvwire bench: --copy applies to --workload engine");
        return ExitCode::from(2);
    }
    let spec = BenchSpec {
        workload: match a.workload {
            WorkloadArg::Pool => bench::Workload::Pool,
            WorkloadArg::Engine => bench::Workload::Engine {
                memory: a.memory,
                copy: a.copy,
            },
        },
        page_sizes: a.page_sizes,
        buffers: a.buffers,
        pages: a.pages,
        tokens_per_page: 16,
        bytes_per_case: a.bytes,
        concurrency: a.concurrency.first().copied().unwrap_or(1).max(1),
        verify: match a.verify {
            VerifyArg::Xxh3 => Verify::Xxh3,
            VerifyArg::Crc32 => Verify::Crc32,
            VerifyArg::None => Verify::None,
        },
        check_bytes: a.check_bytes,
        digest_offload_bytes: a.digest_offload,
        digest_threads: a.digest_threads,
        tcp_streams: a.tcp_streams,
        same_host: a.same_host,
        pull_threads: a.pull_threads,
        digest_at_landing: !a.digest_after_fence,
        digest_while_sending: !a.digest_before_send,
        buffer_offset: usize::from(a.buffer_offset),
        liveness: kvwire::proto::liveness::LivenessConfig {
            interval: std::time::Duration::from_millis(a.heartbeat_ms),
            timeout: std::time::Duration::from_millis(a.peer_timeout_ms),
        },
        metrics: Some(kvwire::metrics::Metrics::new()),
        on_transfer: None,
        auth,
        transport: match a.transport {
            TransportArg::Tcp => BenchTransport::Tcp,
            TransportArg::Loopback => BenchTransport::Loopback,
            TransportArg::Rdma => BenchTransport::Rdma {
                device: a.device.clone(),
                queue_pairs: a.queue_pairs,
                busy_poll: a.busy_poll,
                ack_timeout: a.ack_timeout,
                stripe_pages: a.stripe_pages,
                rail_affinity: !a.no_rail_affinity,
            },
        },
    };
    if a.concurrency.len() > 1 && two_process {
        eprintln!("kvwire bench: a list of --concurrency depths (a sweep) runs in one process; it takes no --listen/--connect");
        return ExitCode::from(2);
    }
    if a.transport == TransportArg::Loopback && two_process {
        eprintln!("kvwire bench: --transport loopback runs both roles in this process; it takes no --listen/--connect");
        return ExitCode::from(2);
    }
    // A progress bar only when a person watches (stderr is a terminal), never in pipes or CI.
    let mut spec = spec;
    let bar = std::io::IsTerminal::is_terminal(&std::io::stderr()).then(|| {
        let total = spec.total_transfers()
            * u64::from(a.connections.max(1))
            * a.concurrency.len().max(1) as u64;
        let bar = indicatif::ProgressBar::new(total);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} {pos}/{len} transfers {wide_bar} {per_sec} {eta}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar
    });
    if let Some(bar) = &bar {
        let b = bar.clone();
        spec.on_transfer = Some(bench::OnTransfer(std::sync::Arc::new(move || b.inc(1))));
    }
    if spec.verify == Verify::None {
        eprintln!("kvwire bench: --verify none: transfers are NOT verified; this mode only measures the integrity tax");
    }
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = a.worker_threads {
        builder.worker_threads(usize::from(n));
    }
    let runtime = match builder.enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kvwire bench: {e}");
            return ExitCode::FAILURE;
        }
    };
    let progress = |msg: &str| match &bar {
        Some(b) => b.println(format!("kvwire bench: {msg}")),
        None => eprintln!("kvwire bench: {msg}"),
    };
    let result = {
        runtime.block_on(async {
            if let (Some(addr), Some(m)) = (a.metrics_addr, spec.metrics.clone()) {
                match tokio::net::TcpListener::bind(addr).await {
                    Ok(l) => {
                        eprintln!("kvwire bench: metrics on http://{addr}/metrics");
                        tokio::spawn(kvwire::metrics::serve(l, m));
                    }
                    Err(e) => return Err(format!("metrics address {addr}: {e}")),
                }
            }
            match (a.listen, a.connect) {
                (Some(addr), _) => {
                    bench::run_listen(&spec, addr, a.connections, !a.no_raw, progress).await
                }
                (_, Some(addr)) => bench::run_connect(&spec, addr, !a.no_raw, progress).await,
                _ => {
                    // One run per depth, their cases in one report.
                    let mut report: Option<bench::Report> = None;
                    for &depth in &a.concurrency {
                        let mut s = spec.clone();
                        s.concurrency = depth.max(1);
                        let r = bench::run_in_process(&s, &progress).await?;
                        match &mut report {
                            None => report = Some(r),
                            Some(all) => all.cases.extend(r.cases),
                        }
                    }
                    report.ok_or_else(|| "no --concurrency depth given".to_string())
                }
            }
        })
    };
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    let report = match result {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kvwire bench: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(path) = &a.chart {
        match bench::chart::write_svg(&report, path) {
            Ok(()) => eprintln!("kvwire bench: chart written to {}", path.display()),
            Err(e) => {
                eprintln!("kvwire bench: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    if a.json {
        match serde_json::to_string_pretty(&report) {
            Ok(j) => println!("{j}"),
            Err(e) => {
                eprintln!("kvwire bench: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        print!("{}", bench::table(&report));
    }
    // Content, not status: a run with any failed or unchecked-but-asked transfer fails.
    let failed = report
        .cases
        .iter()
        .any(|c| !c.failures.is_empty() || !c.unconfirmed.is_empty() || c.verified < c.transfers);
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// `--ack-timeout`: an exponent in `kvwire::config::ACK_TIMEOUTS`.
fn ack_timeout_arg(s: &str) -> Result<u8, String> {
    let range = kvwire::config::ACK_TIMEOUTS;
    s.parse::<u8>()
        .ok()
        .filter(|n| range.contains(n))
        .ok_or_else(|| format!("{s}: an exponent from {} to {}", range.start(), range.end()))
}
