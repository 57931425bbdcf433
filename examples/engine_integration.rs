//! Engine integration, the way an inference engine uses kvwire: three processes, each an
//! engine that owns its KV memory and its block allocator, registered once with kvwire.
//!
//! * one **decode** engine listens; for every request of each prefill peer it takes pages
//!   from its own allocator, reserves exactly those pages, reads the verified KV (and the
//!   request's auxiliary record) in place, and gives the pages back to its allocator only
//!   once kvwire holds none of them;
//! * two **prefill** engines compute each request's KV chunk by chunk (chunked prefill) into
//!   pages their own allocators chose, and send each chunk as it is ready, in place; the
//!   final chunk carries an aux record (the "first output token").
//!
//! One request is rejected at the prefill's admission (longer than its context: the decode
//! engine receives the original error), and one is aborted by the decode engine before the
//! prefill sends it (the late submit fails at once). Every landed byte is compared with what
//! the prefill wrote. Exits non-zero on any difference.
//!
//! ```sh
//! cargo run --example engine_integration                 # spawns the three processes
//! cargo run --example engine_integration -- --rdma rxe0  # the same over RDMA
//! ```

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::process::{Child, Command};
use std::time::Duration;

use kvwire::proto::admission::Request;
use kvwire::{
    Auth, ErrorCode, KvMemory, Listener, ListenerConfig, Node, NodeConfig, PoolGeometry,
    ReceiveError, ReserveParams, SenderConn, TransferError, TransferId, TransportConfig,
};

type Error = Box<dyn std::error::Error + Send + Sync>;

const PAGE_BYTES: usize = 4096;
const BUFFERS: usize = 2;
const TOKENS_PER_PAGE: u32 = 16;
const CONTEXT: u64 = 2048;
const PREFILLS: u64 = 2;

/// What a request is for, the same plan in every process.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    /// Sent in chunks, with an aux record, verified.
    Normal,
    /// Longer than the prefill's context: rejected at its admission.
    Rejected,
    /// Aborted by the decode engine before the prefill sends it.
    Aborted,
}

/// Prefill engine `engine`'s requests: (id, tokens, kind).
fn plan(engine: u64) -> Vec<(TransferId, u32, Kind)> {
    let mut v: Vec<_> = (0..5)
        .map(|i| {
            (
                TransferId(engine * 100 + i),
                60 + 37 * i as u32,
                Kind::Normal,
            )
        })
        .collect();
    if engine == 1 {
        v[2] = (TransferId(102), CONTEXT as u32 + 1, Kind::Rejected);
    } else {
        v[3].2 = Kind::Aborted;
    }
    v
}

fn pages_for(tokens: u32) -> usize {
    tokens.div_ceil(TOKENS_PER_PAGE) as usize
}

/// The KV a prefill engine computes for ordinal `o` of request `id`, buffer `b`.
fn kv(id: TransferId, o: usize, b: usize, page: &mut [u8]) {
    for (i, x) in page.iter_mut().enumerate() {
        *x = (id.get() as usize * 7 + o * 13 + b * 29 + i / 64) as u8;
    }
}

/// The aux record of request `id`: its "first output token".
fn aux(id: TransferId) -> Vec<u8> {
    format!("first-token:{}", id.get() * 3 + 1).into_bytes()
}

/// An engine's block allocator: its own free list of page indices.
struct BlockAllocator {
    free: VecDeque<u32>,
}

impl BlockAllocator {
    fn new(pages: u32) -> Self {
        // Handed out in a scattered order, as a long-running engine's free list would be.
        let mut free: Vec<u32> = (0..pages).collect();
        free.sort_by_key(|&p| p.wrapping_mul(2_654_435_761) % 97);
        Self { free: free.into() }
    }

    fn alloc(&mut self, n: usize) -> Result<Vec<u32>, Error> {
        if self.free.len() < n {
            return Err("the engine is out of KV pages".into());
        }
        Ok(self.free.drain(..n).collect())
    }

    /// Frees pages, after asking kvwire whether it still holds any of them.
    fn free(&mut self, node: &Node, pages: Vec<u32>) -> Result<(), Error> {
        node.pool().check_engine_free(&pages)?;
        self.free.extend(pages);
        Ok(())
    }
}

fn config(auth: Auth, rdma: Option<&str>, pages: u32) -> Result<NodeConfig, Error> {
    let pool = PoolGeometry {
        tokens_per_page: TOKENS_PER_PAGE,
        buffer_page_bytes: vec![PAGE_BYTES as u32; BUFFERS],
        pages,
    };
    let transport = match rdma {
        Some(dev) => TransportConfig::rdma(Some(dev)),
        None => TransportConfig::Tcp,
    };
    Ok(NodeConfig::builder(pool, CONTEXT)
        .fingerprint("engine-integration-model/tp0")
        .auth(auth)
        .transport(transport)
        .build()?)
}

/// The engine's own KV memory, registered once with kvwire.
fn register(config: &NodeConfig) -> Result<Node, Error> {
    let buffers = (0..BUFFERS)
        .map(|b| vec![0u8; config.pool.buffer_len(b).unwrap_or(0)].into_boxed_slice())
        .collect();
    let memory = KvMemory::from_buffers(&config.pool, buffers)?;
    Ok(Node::with_memory(config.clone(), memory)?)
}

async fn decode(addr: SocketAddr, config: NodeConfig) -> Result<(), Error> {
    let node = register(&config)?;
    let mut alloc = BlockAllocator::new(config.pool.pages);
    let mut listener = Listener::receivers(addr, &node, ListenerConfig::default()).await?;
    eprintln!("decode: listening on {}", listener.local_addr());
    let mut peers = Vec::new();
    for _ in 0..PREFILLS {
        let conn = listener.accept().await.ok_or("the listener stopped")?;
        peers.push(conn);
    }
    // Which prefill engine is which: by its node id.
    let (mut verified, mut bytes) = (0, 0u64);
    for conn in &peers {
        let engine = conn.peer().node_id;
        for (id, tokens, kind) in plan(engine) {
            let pages = alloc.alloc(pages_for(tokens))?;
            let params = ReserveParams::new(id, tokens, Duration::from_secs(30))
                .into_pages(pages.clone())
                .with_page_digests();
            let waiting = conn.reserve(params);
            if kind == Kind::Aborted {
                conn.abort(id, ErrorCode::CANCELLED);
            }
            match (kind, waiting.await) {
                (Kind::Normal, Ok(landed)) => {
                    if landed.page_indices() != pages {
                        return Err(format!(
                            "{id}: landed at {:?}, not {pages:?}",
                            landed.page_indices()
                        )
                        .into());
                    }
                    if landed.aux() != aux(id) {
                        return Err(format!("{id}: wrong aux record").into());
                    }
                    let mut want = vec![0u8; PAGE_BYTES];
                    for o in 0..landed.pages() {
                        for b in 0..BUFFERS {
                            kv(id, o, b, &mut want);
                            let page = landed.page(o, b)?;
                            if *page != want[..] {
                                return Err(format!("{id}: ordinal {o} buffer {b} differs").into());
                            }
                            bytes += page.len() as u64;
                        }
                    }
                    landed.release()?;
                    verified += 1;
                }
                // Over this decode's context too: it refuses the request itself before
                // reserving (and tells the prefill), or, if the prefill's REJECT came first,
                // fails with the prefill's rejection. Either way nothing was transferred.
                (
                    Kind::Rejected,
                    Err(TransferError::Reserve(ReceiveError::ExceedsContext { .. })),
                ) => {
                    eprintln!("decode: {id} refused before reserving, as planned");
                }
                (Kind::Rejected, Err(TransferError::Failed(reason)))
                    if reason.code() == ErrorCode::PROMPT_EXCEEDS_CONTEXT =>
                {
                    eprintln!("decode: {id} rejected by the prefill, as planned: {reason}");
                }
                (Kind::Aborted, Err(TransferError::Failed(reason)))
                    if reason.code() == ErrorCode::CANCELLED =>
                {
                    eprintln!("decode: {id} aborted, as planned");
                }
                (kind, other) => return Err(format!("{id} ({kind:?}): {other:?}").into()),
            }
            // Every outcome returned the pages: the engine's allocator takes them back.
            alloc.free(&node, pages)?;
        }
    }
    if !node.pool().held_pages().is_empty() {
        return Err("kvwire still holds pages".into());
    }
    println!("decode: {verified} transfers verified from {PREFILLS} prefill engines, {bytes} bytes compared, one rejection and one abort as planned");
    Ok(())
}

async fn prefill(addr: SocketAddr, config: NodeConfig, engine: u64) -> Result<(), Error> {
    let node = register(&config)?;
    let mut alloc = BlockAllocator::new(config.pool.pages);
    let conn = loop {
        match SenderConn::connect(addr, &node).await {
            Ok(c) => break c,
            Err(kvwire::EngineError::Io(_)) => tokio::time::sleep(Duration::from_millis(100)).await,
            Err(e) => return Err(e.into()),
        }
    };
    for (id, tokens, kind) in plan(engine) {
        let admitted = match conn.admit(Request {
            transfer_id: id,
            tokens: u64::from(tokens),
        }) {
            Ok(a) => a,
            Err(TransferError::Rejected(e)) if kind == Kind::Rejected => {
                eprintln!("prefill {engine}: {id} rejected at admission, as planned: {e}");
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        let pages = alloc.alloc(pages_for(tokens))?;
        if kind == Kind::Aborted {
            // The decode engine aborts this one; give its abort time to arrive.
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // Chunked prefill: compute a chunk into the engine's pages, send it, go on.
        let tx = conn.open(admitted);
        let chunks: Vec<&[u32]> = pages.chunks(3).collect();
        let mut chunk_refused = None;
        for (c, chunk) in chunks.iter().enumerate() {
            for (k, &p) in chunk.iter().enumerate() {
                for b in 0..BUFFERS {
                    let mut page = node.pool().engine_page_mut(p, b)?;
                    kv(id, c * 3 + k, b, &mut page);
                }
            }
            let record = (c + 1 == chunks.len()).then(|| aux(id));
            if let Err(e) = tx.send_chunk(chunk.to_vec(), record).await {
                chunk_refused = Some(e);
                break;
            }
        }
        let outcome = tx.outcome().await;
        match (kind, outcome, chunk_refused) {
            (Kind::Normal, Ok(()), None) => {}
            (Kind::Aborted, Err(e), _) => {
                eprintln!("prefill {engine}: {id} aborted by the decode engine, as planned: {e}")
            }
            (kind, outcome, refused) => {
                return Err(format!("{id} ({kind:?}): {outcome:?}, chunk {refused:?}").into())
            }
        }
        alloc.free(&node, pages)?;
    }
    println!("prefill {engine}: done");
    Ok(())
}

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn spawn(extra: &[String], psk: &str) -> Result<Child, Error> {
    Ok(Command::new(std::env::current_exe()?)
        .args(extra)
        .env("KVWIRE_PSK", psk)
        .spawn()?)
}

fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rdma = arg(&args, "--rdma");
    if let Some(role) = arg(&args, "--role") {
        let addr: SocketAddr = arg(&args, "--addr").ok_or("--addr")?.parse()?;
        let (key, _) = kvwire::config::auth::find_psk(None)?.ok_or("KVWIRE_PSK")?;
        let rt = tokio::runtime::Runtime::new()?;
        return match role.as_str() {
            "decode" => rt.block_on(decode(addr, config(Auth::Psk(key), rdma.as_deref(), 512)?)),
            "prefill" => {
                let engine: u64 = arg(&args, "--engine").ok_or("--engine")?.parse()?;
                let mut cfg = config(Auth::Psk(key), rdma.as_deref(), 256)?;
                cfg.node_id = engine;
                rt.block_on(prefill(addr, cfg, engine))
            }
            other => Err(format!("unknown role {other}").into()),
        };
    }
    // The orchestrator: one decode engine and two prefill engines, each its own process,
    // sharing a fresh key.
    let psk: String = kvwire::config::random_bytes::<32>()?
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let addr = format!("127.0.0.1:{port}");
    let with_rdma = |mut v: Vec<String>| {
        if let Some(d) = &rdma {
            v.extend(["--rdma".into(), d.clone()]);
        }
        v
    };
    let mut decode = spawn(
        &with_rdma(vec![
            "--role".into(),
            "decode".into(),
            "--addr".into(),
            addr.clone(),
        ]),
        &psk,
    )?;
    let mut prefills = (1..=PREFILLS)
        .map(|e| {
            spawn(
                &with_rdma(vec![
                    "--role".into(),
                    "prefill".into(),
                    "--addr".into(),
                    addr.clone(),
                    "--engine".into(),
                    e.to_string(),
                ]),
                &psk,
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut ok = decode.wait()?.success();
    for p in &mut prefills {
        ok &= p.wait()?.success();
    }
    if ok {
        println!("engine integration: every process succeeded");
        Ok(())
    } else {
        Err("an engine process failed".into())
    }
}
