//! Peer discovery through the embedded bootstrap server and (feature `etcd`) a real etcd
//! server, driven through the same scenarios: register and resolve, a dropped registration
//! disappears, a dead node (no more refreshes) expires after its TTL while a live one stays,
//! a watch sees additions and removals. The embedded server also gets bad clients.
//!
//! The etcd tests start `etcd` (Debian: etcd-server) on loopback with random ports and a
//! temporary data directory. Without the binary they print `SKIPPED` and pass, unless
//! `KVWIRE_REQUIRE_ETCD=1` (CI), where they fail.

use std::time::Duration;

use kvwire::discovery::{
    sort_newest_first, BootstrapConfig, BootstrapServer, Discovery, DiscoveryError,
    EmbeddedDiscovery, PeerEvent, PeerQuery, PeerRecord, PeerWatch, RegistrationStatus, Role,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

/// How long any expected change may take to be seen (a bound for correctness, not speed).
const WITHIN: Duration = Duration::from_secs(10);

fn record(cluster: &str, role: Role, rank: u32, node: u64) -> PeerRecord {
    let mut r = PeerRecord::new(
        cluster,
        role,
        rank,
        node,
        format!("10.1.{rank}.{node}:7400"),
    );
    r.layout_fingerprint = "ab12".into();
    r.extra.insert("zone".into(), format!("z{rank}"));
    r
}

/// `r` without the backend's registration stamp, to compare with what was registered.
fn unstamped(r: &PeerRecord) -> PeerRecord {
    let mut r = r.clone();
    r.registered = 0;
    r
}

/// `e` with its record unstamped.
fn plain(e: PeerEvent) -> PeerEvent {
    match e {
        PeerEvent::Added(r) => PeerEvent::Added(unstamped(&r)),
        removed => removed,
    }
}

fn keys(records: &[PeerRecord]) -> Vec<(Role, u32, u64)> {
    records
        .iter()
        .map(|r| (r.role, r.engine_rank, r.node_id))
        .collect()
}

/// Polls `resolve(query)` until `done` holds for the result, for at most `within`.
async fn resolve_until(
    d: &dyn Discovery,
    query: PeerQuery,
    within: Duration,
    what: &str,
    done: impl Fn(&[PeerRecord]) -> bool,
) -> Vec<PeerRecord> {
    let deadline = Instant::now() + within;
    loop {
        let records = d.resolve(query.clone()).await.expect("resolve");
        if done(&records) {
            return records;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not within {within:?}; last resolve: {:?}",
            keys(&records)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn next_event(w: &mut PeerWatch, what: &str) -> PeerEvent {
    tokio::time::timeout(WITHIN, w.next())
        .await
        .unwrap_or_else(|_| panic!("{what}: no watch event within {WITHIN:?}"))
        .expect("the watch ended")
}

// ---------------------------------------------------------------------------------------
// The scenarios, for any backend. `peer` resolves and watches; `node` registers, with a TTL
// far beyond `WITHIN` where what it registers must disappear by being removed, never by
// expiring during the test; `short` registers with a 1 s TTL.

async fn scenario_register_resolve(node: &dyn Discovery, peer: &dyn Discovery, cluster: &str) {
    let p0 = node
        .register(record(cluster, Role::Prefill, 0, 100))
        .await
        .expect("register prefill rank 0");
    let p1 = node
        .register(record(cluster, Role::Prefill, 1, 101))
        .await
        .expect("register prefill rank 1");
    let d0 = node
        .register(record(cluster, Role::Decode, 0, 200))
        .await
        .expect("register decode rank 0");
    assert_eq!(p0.status(), RegistrationStatus::Live);

    let prefill = PeerQuery::cluster(cluster).role(Role::Prefill);
    let found = peer.resolve(prefill.clone()).await.unwrap();
    assert_eq!(
        keys(&found),
        vec![(Role::Prefill, 0, 100), (Role::Prefill, 1, 101)]
    );
    // The whole record comes back, not just the address, stamped by the backend.
    assert_eq!(unstamped(&found[0]), record(cluster, Role::Prefill, 0, 100));
    assert!(found.iter().all(|r| r.registered != 0), "{found:?}");
    assert_eq!(found[0].registered, p0.record().registered);
    assert_eq!(found[1].address, "10.1.1.101:7400");
    found[1].check_layout("ab12").unwrap();
    assert!(matches!(
        found[1].check_layout("cd34"),
        Err(DiscoveryError::LayoutMismatch { .. })
    ));

    let rank1 = peer.resolve(prefill.clone().rank(1)).await.unwrap();
    assert_eq!(keys(&rank1), vec![(Role::Prefill, 1, 101)]);
    let all = peer.resolve(PeerQuery::cluster(cluster)).await.unwrap();
    assert_eq!(all.len(), 3, "{:?}", keys(&all));
    let rank0 = peer
        .resolve(PeerQuery::cluster(cluster).rank(0))
        .await
        .unwrap();
    assert_eq!(
        keys(&rank0),
        vec![(Role::Prefill, 0, 100), (Role::Decode, 0, 200)]
    );
    let other = peer
        .resolve(PeerQuery::cluster(format!("{cluster}-other")))
        .await
        .unwrap();
    assert!(other.is_empty());

    // Registering the same key again replaces the record.
    let mut moved = record(cluster, Role::Prefill, 1, 101);
    moved.address = "10.9.9.9:7401".into();
    let p1b = node.register(moved).await.unwrap();
    let found = peer.resolve(prefill.clone().rank(1)).await.unwrap();
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].address, "10.9.9.9:7401");

    // Deregistering the replaced registration leaves its replacement alone.
    p1.deregister()
        .await
        .expect("deregister the replaced registration");
    let found = peer.resolve(prefill.clone().rank(1)).await.unwrap();
    assert_eq!(found.len(), 1, "the replacement survives");
    assert_eq!(found[0].address, "10.9.9.9:7401");

    for r in [p0, p1b, d0] {
        r.deregister().await.expect("deregister");
    }
    assert!(peer
        .resolve(PeerQuery::cluster(cluster))
        .await
        .unwrap()
        .is_empty());

    // Invalid records and queries are refused before reaching the backend.
    let mut bad = record(cluster, Role::Prefill, 0, 1);
    bad.cluster = "a/b".into();
    assert!(matches!(
        node.register(bad).await,
        Err(DiscoveryError::InvalidRecord(_))
    ));
    assert!(matches!(
        peer.resolve(PeerQuery::cluster("")).await,
        Err(DiscoveryError::InvalidQuery(_))
    ));
}

async fn scenario_dropped_registration_disappears(
    node: &dyn Discovery,
    peer: &dyn Discovery,
    cluster: &str,
) {
    let query = PeerQuery::cluster(cluster);
    let reg = node
        .register(record(cluster, Role::Prefill, 0, 300))
        .await
        .unwrap();
    assert_eq!(peer.resolve(query.clone()).await.unwrap().len(), 1);
    assert!(reg.ttl() > WITHIN * 2, "a long TTL: {:?}", reg.ttl());
    // Abandoning (a process that dies without deregistering) leaves the record until its
    // TTL runs out: still there, however slow this machine is (in a cluster of its own,
    // where it stays for the long TTL).
    let elsewhere = format!("{cluster}-abandoned");
    let abandoned = node
        .register(record(&elsewhere, Role::Prefill, 1, 301))
        .await
        .unwrap();
    abandoned.abandon();
    // Given the time a removal would take (a slow machine makes this check no weaker).
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        keys(&peer.resolve(PeerQuery::cluster(&elsewhere)).await.unwrap()),
        vec![(Role::Prefill, 1, 301)],
        "abandon must not deregister"
    );
    drop(reg);
    resolve_until(
        peer,
        query,
        WITHIN,
        "a dropped registration disappears",
        |r| r.is_empty(),
    )
    .await;
}

/// `ttl` is the TTL the backend applies. The dead node stops refreshing without removing its
/// record; it must disappear within `WITHIN`, while the live one, refreshed, stays.
async fn scenario_dead_node_expires(short: &dyn Discovery, peer: &dyn Discovery, cluster: &str) {
    let query = PeerQuery::cluster(cluster).role(Role::Prefill);
    let live = short
        .register(record(cluster, Role::Prefill, 0, 400))
        .await
        .unwrap();
    let dead = short
        .register(record(cluster, Role::Prefill, 1, 401))
        .await
        .unwrap();
    let ttl = dead.ttl();
    assert!(ttl <= Duration::from_secs(2), "test TTL is short: {ttl:?}");

    let abandoned = Instant::now();
    // Abandoning does not remove the record (checked under a long TTL in
    // `scenario_dropped_registration_disappears`); it goes when the TTL runs out.
    dead.abandon();
    resolve_until(
        peer,
        query.clone(),
        WITHIN,
        "the dead node expires and the live one stays",
        |r| keys(r) == vec![(Role::Prefill, 0, 400)],
    )
    .await;
    assert!(
        abandoned.elapsed() >= ttl / 2,
        "the dead node vanished before its TTL could have run out ({:?} < {ttl:?})",
        abandoned.elapsed()
    );

    // The live node outlives several TTLs because it refreshes.
    tokio::time::sleep(ttl * 3).await;
    let now = peer.resolve(query).await.unwrap();
    assert_eq!(
        keys(&now),
        vec![(Role::Prefill, 0, 400)],
        "the live node expired"
    );
    assert_eq!(live.status(), RegistrationStatus::Live);
    live.deregister().await.unwrap();
}

async fn scenario_watch(
    short: &dyn Discovery,
    node: &dyn Discovery,
    peer: &dyn Discovery,
    cluster: &str,
) {
    let before = node
        .register(record(cluster, Role::Prefill, 0, 500))
        .await
        .unwrap();
    let mut watch = peer
        .watch(PeerQuery::cluster(cluster).role(Role::Prefill))
        .await
        .expect("watch");
    // First what is there already.
    assert_eq!(
        plain(next_event(&mut watch, "initial record").await),
        PeerEvent::Added(record(cluster, Role::Prefill, 0, 500))
    );

    let added = node
        .register(record(cluster, Role::Prefill, 1, 501))
        .await
        .unwrap();
    assert_eq!(
        plain(next_event(&mut watch, "registration").await),
        PeerEvent::Added(record(cluster, Role::Prefill, 1, 501))
    );

    // A decode record does not match the query: the next event is the removal below.
    let decode = node
        .register(record(cluster, Role::Decode, 0, 502))
        .await
        .unwrap();
    drop(added);
    assert_eq!(
        next_event(&mut watch, "dropped registration").await,
        PeerEvent::Removed(record(cluster, Role::Prefill, 1, 501).key())
    );

    // A dead node's expiry is a removal too.
    let dead = short
        .register(record(cluster, Role::Prefill, 2, 503))
        .await
        .unwrap();
    assert_eq!(
        plain(next_event(&mut watch, "registration").await),
        PeerEvent::Added(record(cluster, Role::Prefill, 2, 503))
    );
    dead.abandon();
    assert_eq!(
        next_event(&mut watch, "expiry").await,
        PeerEvent::Removed(record(cluster, Role::Prefill, 2, 503).key())
    );

    before.deregister().await.unwrap();
    assert_eq!(
        next_event(&mut watch, "deregistration").await,
        PeerEvent::Removed(record(cluster, Role::Prefill, 0, 500).key())
    );
    decode.deregister().await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        watch.try_next(),
        None,
        "nothing else happened to prefill records"
    );
}

/// Issue 31: a prefill killed with SIGKILL leaves its record until its TTL runs out (here
/// 10 min, so it cannot expire during the test); the prefill restarted under a new node id
/// registers, and the very next resolve lists it first of its rank (decodes take the first
/// record of a rank, and used to dial the dead one for a whole TTL). The dead node's id is
/// the smaller on rank 0 and the larger on rank 1, so neither key order nor its reverse
/// passes. Then a rolling restart (a third node while the second still runs) and a node
/// registering again under an old id: the newest registration is first each time.
async fn scenario_restarted_node_first(node: &dyn Discovery, peer: &dyn Discovery, cluster: &str) {
    let query = PeerQuery::cluster(cluster).role(Role::Prefill);
    let mut watch = peer.watch(query.clone()).await.expect("watch");
    let mut live = Vec::new();
    for (rank, dead, restarted) in [(0u32, 1u64, 2u64), (1, 20, 10)] {
        let killed = node
            .register(record(cluster, Role::Prefill, rank, dead))
            .await
            .unwrap();
        // SIGKILL: nothing deregisters the record; it stays until its TTL.
        killed.abandon();
        let started = Instant::now();
        let reg = node
            .register(record(cluster, Role::Prefill, rank, restarted))
            .await
            .unwrap();
        let found = peer.resolve(query.clone().rank(rank)).await.unwrap();
        assert_eq!(
            keys(&found),
            vec![
                (Role::Prefill, rank, restarted),
                (Role::Prefill, rank, dead)
            ],
            "rank {rank}: the restarted node first, its dead predecessor after it"
        );
        assert_eq!(
            found[0].address,
            record(cluster, Role::Prefill, rank, restarted).address
        );
        assert!(found[0].registered > found[1].registered, "{found:?}");
        assert_eq!(found[0].registered, reg.record().registered);
        println!(
            "rank {rank}: the restarted node resolved first {:?} after it began registering",
            started.elapsed()
        );
        live.push(reg);
    }

    // A rolling restart: node 3 joins rank 0 while node 2 still runs.
    let rolling = node
        .register(record(cluster, Role::Prefill, 0, 3))
        .await
        .unwrap();
    let all = peer.resolve(query.clone()).await.unwrap();
    assert_eq!(
        keys(&all),
        vec![
            (Role::Prefill, 0, 3),
            (Role::Prefill, 0, 2),
            (Role::Prefill, 0, 1),
            (Role::Prefill, 1, 10),
            (Role::Prefill, 1, 20),
        ]
    );

    // The watch's records carry the same stamps: sorted, they come in the same order.
    let mut seen = std::collections::BTreeMap::new();
    while seen.len() < all.len() {
        match next_event(&mut watch, "the registrations").await {
            PeerEvent::Added(r) => {
                seen.insert(r.key(), r);
            }
            PeerEvent::Removed(k) => panic!("nothing was removed, yet {k} was"),
        }
    }
    let mut watched: Vec<PeerRecord> = seen.into_values().collect();
    sort_newest_first(&mut watched);
    assert_eq!(watched, all, "the watch and resolve agree");

    // Node 1 registering again (under its old id) is the newest registration of rank 0.
    let again = node
        .register(record(cluster, Role::Prefill, 0, 1))
        .await
        .unwrap();
    let rank0 = peer.resolve(query.clone().rank(0)).await.unwrap();
    assert_eq!(
        keys(&rank0),
        vec![
            (Role::Prefill, 0, 1),
            (Role::Prefill, 0, 3),
            (Role::Prefill, 0, 2)
        ]
    );
    // Deregistering the newest leaves the next newest first.
    again.deregister().await.unwrap();
    rolling.deregister().await.unwrap();
    let rank0 = peer.resolve(query.rank(0)).await.unwrap();
    assert_eq!(keys(&rank0), vec![(Role::Prefill, 0, 2)]);
    for r in live {
        r.deregister().await.unwrap();
    }
}

// ---------------------------------------------------------------------------------------
// Embedded bootstrap server.

struct Embedded {
    server: BootstrapServer,
    /// Registers with a 1 s TTL.
    short: EmbeddedDiscovery,
    /// Registers with a 10 min TTL.
    long: EmbeddedDiscovery,
    peer: EmbeddedDiscovery,
}

async fn embedded() -> Embedded {
    let (server, addr) = BootstrapServer::bind("127.0.0.1:0").await.unwrap();
    Embedded {
        server,
        short: EmbeddedDiscovery::new(addr).with_ttl(Duration::from_secs(1)),
        long: EmbeddedDiscovery::new(addr).with_ttl(Duration::from_secs(600)),
        peer: EmbeddedDiscovery::new(addr),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_register_resolve() {
    let e = embedded().await;
    scenario_register_resolve(&e.long, &e.peer, "c-resolve").await;
    assert_eq!(e.server.record_count(), 0);
    e.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_dropped_registration_disappears() {
    let e = embedded().await;
    scenario_dropped_registration_disappears(&e.long, &e.peer, "c-drop").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_dead_node_expires() {
    let e = embedded().await;
    scenario_dead_node_expires(&e.short, &e.peer, "c-expire").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_watch() {
    let e = embedded().await;
    scenario_watch(&e.short, &e.long, &e.peer, "c-watch").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_restarted_node_is_resolved_first() {
    let e = embedded().await;
    scenario_restarted_node_first(&e.long, &e.peer, "c-restarted").await;
}

/// The server, not the client, stamps registrations: a stamp in the body is ignored, the
/// answers carry the server's, and a client that knows nothing of stamps (no `age_ms`, no
/// `registered`) still registers and reads records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_registration_stamps_are_the_servers() {
    let (server, addr) = BootstrapServer::bind("127.0.0.1:0").await.unwrap();
    let client = EmbeddedDiscovery::new(addr).with_ttl(Duration::from_secs(600));
    let put = |body: &serde_json::Value| {
        let body = body.to_string();
        format!(
            "PUT /v1/peers HTTP/1.1\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    // An old client's registration, and one claiming a stamp far in the future.
    let old =
        serde_json::json!({"record": record("c-stamp", Role::Prefill, 0, 1), "ttl_ms": 600_000});
    assert!(raw(addr, put(&old).as_bytes())
        .await
        .starts_with("HTTP/1.1 200 "));
    let mut cheat =
        serde_json::json!({"record": record("c-stamp", Role::Prefill, 0, 2), "ttl_ms": 600_000});
    cheat["record"]["registered"] = u64::MAX.into();
    assert!(raw(addr, put(&cheat).as_bytes())
        .await
        .starts_with("HTTP/1.1 200 "));
    let reg = client
        .register(record("c-stamp", Role::Prefill, 0, 3))
        .await
        .unwrap();
    let found = client.resolve(PeerQuery::cluster("c-stamp")).await.unwrap();
    assert_eq!(
        keys(&found),
        vec![
            (Role::Prefill, 0, 3),
            (Role::Prefill, 0, 2),
            (Role::Prefill, 0, 1)
        ]
    );
    let unix_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    for r in &found {
        assert!(
            r.registered.abs_diff(unix_ms) < 60_000,
            "the server's clock in Unix ms: {r:?}"
        );
    }
    // An old client reads the answer: the record is there, the extra field ignored.
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /v1/peers?cluster=c-stamp&rank=0 HTTP/1.1\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    s.read_to_end(&mut answer).await.unwrap();
    let answer = String::from_utf8(answer).unwrap();
    let body: serde_json::Value =
        serde_json::from_str(&answer[answer.find("\r\n\r\n").unwrap() + 4..]).unwrap();
    assert_eq!(body["records"][0]["node_id"], 3);
    assert_eq!(body["records"][0]["registered"], found[0].registered);

    // A re-creation (a lease this server never gave, as after its restart) is as old as its
    // age says; the record's own stamp is kept only where it agrees with that age.
    let unix_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let aged = unix_ms - 5000;
    for (node, claimed) in [(11u64, 0u64), (12, aged + 300), (13, aged - 3_600_000)] {
        let mut r = record("c-stamp", Role::Prefill, 1, node);
        r.registered = claimed;
        let body = serde_json::json!({"record": r, "ttl_ms": 600_000, "lease": 1000 + node, "age_ms": 5000});
        assert!(raw(addr, put(&body).as_bytes())
            .await
            .starts_with("HTTP/1.1 200 "));
    }
    let rank1 = client
        .resolve(PeerQuery::cluster("c-stamp").rank(1))
        .await
        .unwrap();
    let stamp = |node: u64| rank1.iter().find(|r| r.node_id == node).unwrap().registered;
    assert!(stamp(11).abs_diff(aged) < 1000, "{rank1:?}");
    assert_eq!(stamp(12), aged + 300, "an agreeing stamp is kept");
    assert!(
        stamp(13).abs_diff(aged) < 1000,
        "a disagreeing stamp is not: {rank1:?}"
    );
    reg.deregister().await.unwrap();
    server.shutdown().await;
}

/// The server restarts empty: live registrations put their records back as old as they
/// were, so the order of registrations survives (the one that refreshes more often, here the
/// newer, re-creates its record first, which must not make it look older).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_restart_keeps_registration_order() {
    let (server, addr) = BootstrapServer::bind("127.0.0.1:0").await.unwrap();
    let query = PeerQuery::cluster("c-order").role(Role::Prefill).rank(0);
    let started = Instant::now();
    let older = EmbeddedDiscovery::new(addr)
        .with_ttl(Duration::from_secs(3))
        .register(record("c-order", Role::Prefill, 0, 1))
        .await
        .unwrap();
    let mut slowest = started.elapsed();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let started = Instant::now();
    let newer = EmbeddedDiscovery::new(addr)
        .with_ttl(Duration::from_secs(1))
        .register(record("c-order", Role::Prefill, 0, 2))
        .await
        .unwrap();
    slowest = slowest.max(started.elapsed());
    let peer = EmbeddedDiscovery::new(addr);
    let before = peer.resolve(query.clone()).await.unwrap();
    assert_eq!(
        keys(&before),
        vec![(Role::Prefill, 0, 2), (Role::Prefill, 0, 1)]
    );

    server.shutdown().await;
    let (server, _) = BootstrapServer::bind(addr).await.unwrap();
    let after = resolve_until(&peer, query, WITHIN, "both records back", |r| r.len() == 2).await;
    assert_eq!(
        keys(&after),
        vec![(Role::Prefill, 0, 2), (Role::Prefill, 0, 1)],
        "the restart reordered the registrations: {after:?}"
    );
    // Each record comes back as it was, not stamped as new by the restart: every field
    // equal, and the stamp the record's own (the server keeps it when it is within 1 s of
    // the one its age gives) or the one its age gives, which is off by at most the time a
    // registration took here.
    let tolerance = 1000 + slowest.as_millis() as u64;
    for (a, b) in after.iter().zip(&before) {
        let mut same_stamp = a.clone();
        same_stamp.registered = b.registered;
        assert_eq!(&same_stamp, b, "the restart changed a record");
        assert!(
            a.registered.abs_diff(b.registered) <= tolerance,
            "stamped anew by the restart: {} against {} (tolerance {tolerance} ms)",
            a.registered,
            b.registered
        );
    }
    older.deregister().await.unwrap();
    newer.deregister().await.unwrap();
    server.shutdown().await;
}

/// Sends raw bytes, half-closes, returns the answer's status line.
async fn raw(addr: std::net::SocketAddr, bytes: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    let _ = s.shutdown().await;
    let mut answer = Vec::new();
    tokio::time::timeout(WITHIN, s.read_to_end(&mut answer))
        .await
        .expect("the server answers")
        .ok();
    let text = String::from_utf8_lossy(&answer).into_owned();
    text.lines().next().unwrap_or_default().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_server_survives_bad_clients() {
    let mut config = BootstrapConfig::default();
    config.request_timeout = Duration::from_millis(500);
    let (server, addr) = BootstrapServer::bind_with("127.0.0.1:0", config)
        .await
        .unwrap();
    let client = EmbeddedDiscovery::new(addr).with_ttl(Duration::from_secs(5));
    let reg = client
        .register(record("c-bad", Role::Prefill, 0, 1))
        .await
        .unwrap();
    let still_serving = || async {
        let r = client.resolve(PeerQuery::cluster("c-bad")).await.unwrap();
        assert_eq!(keys(&r), vec![(Role::Prefill, 0, 1)]);
    };

    let valid = serde_json::json!({"record": record("c-bad", Role::Prefill, 1, 2), "ttl_ms": 1000});
    let put = |body: &str| {
        format!(
            "PUT /v1/peers HTTP/1.1\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    let mut invalid_record = valid.clone();
    invalid_record["record"]["address"] = "no port".into();
    let mut short_ttl = valid.clone();
    short_ttl["ttl_ms"] = 1.into();
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("garbage", b"\x00\xff\x13garbage\r\n\r\n".to_vec(), "400"),
        ("not http", b"hello there\n".to_vec(), "400"),
        (
            "unknown path",
            b"GET /admin HTTP/1.1\r\n\r\n".to_vec(),
            "404",
        ),
        (
            "unknown method",
            b"BREW /v1/peers HTTP/1.1\r\n\r\n".to_vec(),
            "405",
        ),
        ("post", b"POST /v1/peers HTTP/1.1\r\n\r\n".to_vec(), "405"),
        (
            "no cluster",
            b"GET /v1/peers HTTP/1.1\r\n\r\n".to_vec(),
            "400",
        ),
        (
            "bad cluster",
            b"GET /v1/peers?cluster=../x HTTP/1.1\r\n\r\n".to_vec(),
            "400",
        ),
        (
            "bad role",
            b"GET /v1/peers?cluster=c&role=x HTTP/1.1\r\n\r\n".to_vec(),
            "400",
        ),
        (
            "bad since",
            b"GET /v1/peers?cluster=c&since=-1 HTTP/1.1\r\n\r\n".to_vec(),
            "400",
        ),
        (
            "bad delete",
            b"DELETE /v1/peers/c/x/1/2?lease=1 HTTP/1.1\r\n\r\n".to_vec(),
            "400",
        ),
        (
            "delete without lease",
            b"DELETE /v1/peers/c-bad/prefill/0/1 HTTP/1.1\r\n\r\n".to_vec(),
            "400",
        ),
        (
            "delete with the wrong lease",
            b"DELETE /v1/peers/c-bad/prefill/0/1?lease=7 HTTP/1.1\r\n\r\n".to_vec(),
            "409",
        ),
        ("bad json", put("{not json").into_bytes(), "400"),
        (
            "json of the wrong shape",
            put("[1,2,3]").into_bytes(),
            "400",
        ),
        (
            "invalid record",
            put(&invalid_record.to_string()).into_bytes(),
            "400",
        ),
        (
            "ttl below the minimum",
            put(&short_ttl.to_string()).into_bytes(),
            "400",
        ),
        (
            "body too large",
            b"PUT /v1/peers HTTP/1.1\r\nContent-Length: 100000000\r\n\r\n".to_vec(),
            "413",
        ),
        (
            "head too large",
            format!("GET /{} HTTP/1.1\r\n\r\n", "a".repeat(20_000)).into_bytes(),
            "431",
        ),
        (
            "chunked",
            b"PUT /v1/peers HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n".to_vec(),
            "501",
        ),
        (
            "truncated body",
            b"PUT /v1/peers HTTP/1.1\r\nContent-Length: 50\r\n\r\n{".to_vec(),
            "400",
        ),
        ("empty", Vec::new(), "400"),
    ];
    for (what, bytes, status) in &cases {
        let line = raw(addr, bytes).await;
        assert!(
            line.starts_with(&format!("HTTP/1.1 {status} ")),
            "{what}: expected {status}, got {line:?}"
        );
        still_serving().await;
    }

    // A slow client (never finishes its head) gets 408 after the request timeout, and does
    // not hold up anyone else meanwhile.
    let mut slow = TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"GET /v1/peers?clu").await.unwrap();
    still_serving().await;
    let mut answer = Vec::new();
    tokio::time::timeout(WITHIN, slow.read_to_end(&mut answer))
        .await
        .expect("the server ends a slow client")
        .ok();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408 "), "{answer:?}");

    // Many bad clients at once.
    let mut tasks = Vec::new();
    for i in 0..64u32 {
        tasks.push(tokio::spawn(async move {
            let mut s = TcpStream::connect(addr).await.unwrap();
            let junk: Vec<u8> = (0..512).map(|j| (i * 31 + j * 7) as u8).collect();
            let _ = s.write_all(&junk).await;
            drop(s); // hang up without reading
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    still_serving().await;

    // A real registration through raw HTTP works, and so does the health check.
    assert!(raw(addr, put(&valid.to_string()).as_bytes())
        .await
        .starts_with("HTTP/1.1 200 "));
    assert!(raw(addr, b"GET /v1/health HTTP/1.1\r\n\r\n")
        .await
        .starts_with("HTTP/1.1 200 "));
    reg.deregister().await.unwrap();
    server.shutdown().await;
}

/// The server goes away and comes back empty on the same address: live registrations put
/// their records back, and a watch reconciles.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_server_restart_is_healed() {
    let (server, addr) = BootstrapServer::bind("127.0.0.1:0").await.unwrap();
    let node = EmbeddedDiscovery::new(addr).with_ttl(Duration::from_secs(1));
    let peer = EmbeddedDiscovery::new(addr);
    let reg = node
        .register(record("c-restart", Role::Prefill, 0, 1))
        .await
        .unwrap();
    let mut watch = peer.watch(PeerQuery::cluster("c-restart")).await.unwrap();
    assert!(matches!(
        next_event(&mut watch, "initial").await,
        PeerEvent::Added(_)
    ));

    server.shutdown().await;
    let deadline = Instant::now() + WITHIN;
    while reg.status() == RegistrationStatus::Live {
        assert!(
            Instant::now() < deadline,
            "refreshes against a stopped server fail"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(peer.resolve(PeerQuery::cluster("c-restart")).await.is_err());

    let (server, _) = BootstrapServer::bind(addr).await.unwrap();
    resolve_until(
        &peer,
        PeerQuery::cluster("c-restart"),
        WITHIN,
        "re-registered",
        |r| keys(r) == vec![(Role::Prefill, 0, 1)],
    )
    .await;
    let deadline = Instant::now() + WITHIN;
    while reg.status() != RegistrationStatus::Live {
        assert!(Instant::now() < deadline, "the registration is live again");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The watch saw either nothing (it caught the record back) or a removal and an addition.
    while let Some(e) = watch.try_next() {
        if let PeerEvent::Removed(_) = e {
            assert!(matches!(
                next_event(&mut watch, "back").await,
                PeerEvent::Added(_)
            ));
        }
    }
    drop(reg);
    assert_eq!(
        next_event(&mut watch, "dropped").await,
        PeerEvent::Removed(record("c-restart", Role::Prefill, 0, 1).key())
    );
    server.shutdown().await;
}

/// Two registrations of one key (a restarted node while its old process lingers): the newer
/// wins, the older one notices and stops refreshing, and dropping it leaves the newer alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_newer_registration_supersedes() {
    let e = embedded().await;
    let (node, peer) = (&e.short, &e.peer);
    let old = node
        .register(record("c-dup", Role::Prefill, 0, 9))
        .await
        .unwrap();
    let mut newer = record("c-dup", Role::Prefill, 0, 9);
    newer.address = "10.2.2.2:7400".into();
    let new = node.register(newer.clone()).await.unwrap();
    let deadline = Instant::now() + WITHIN;
    while old.status() != RegistrationStatus::Superseded {
        assert!(Instant::now() < deadline, "the older registration notices");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    old.deregister().await.unwrap();
    let found = peer.resolve(PeerQuery::cluster("c-dup")).await.unwrap();
    assert_eq!(found.iter().map(unstamped).collect::<Vec<_>>(), vec![newer]);
    assert_eq!(new.status(), RegistrationStatus::Live);
}

// ---------------------------------------------------------------------------------------
// etcd.

#[cfg(feature = "etcd")]
mod etcd {
    use super::*;
    use kvwire::discovery::{EtcdDiscovery, EtcdOptions};
    use std::path::PathBuf;
    use std::process::{Child, Command, Stdio};

    /// A throwaway single-node etcd on loopback; killed and its data removed on drop.
    pub struct Etcd {
        child: Child,
        dir: PathBuf,
        pub endpoint: String,
    }

    impl Drop for Etcd {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    fn etcd_binary() -> Option<PathBuf> {
        if let Some(p) = std::env::var_os("KVWIRE_ETCD_BIN") {
            return Some(PathBuf::from(p));
        }
        let path = std::env::var_os("PATH")?;
        std::env::split_paths(&path)
            .map(|d| d.join("etcd"))
            .find(|p| p.is_file())
    }

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    /// Starts etcd, or returns `None` (after printing SKIPPED) when it is not installed and
    /// not required.
    pub async fn start(test: &str) -> Option<Etcd> {
        let Some(bin) = etcd_binary() else {
            if std::env::var("KVWIRE_REQUIRE_ETCD").as_deref() == Ok("1") {
                panic!("{test}: etcd is not installed (apt-get install etcd-server) and KVWIRE_REQUIRE_ETCD=1");
            }
            println!("SKIPPED {test}: etcd is not installed (apt-get install etcd-server)");
            return None;
        };
        let mut last_log = String::new();
        // Free ports are picked then released, so another process may take one first:
        // a few attempts.
        for attempt in 0..3 {
            let dir = std::env::temp_dir().join(format!(
                "kvwire-etcd-{}-{test}-{attempt}",
                std::process::id()
            ));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            let (client, peer) = (free_port(), free_port());
            let endpoint = format!("http://127.0.0.1:{client}");
            let peer_url = format!("http://127.0.0.1:{peer}");
            let log = std::fs::File::create(dir.join("etcd.log")).unwrap();
            let child = Command::new(&bin)
                .arg("--name=kvwire-test")
                .arg(format!("--data-dir={}", dir.join("data").display()))
                .arg(format!("--listen-client-urls={endpoint}"))
                .arg(format!("--advertise-client-urls={endpoint}"))
                .arg(format!("--listen-peer-urls={peer_url}"))
                .arg(format!("--initial-advertise-peer-urls={peer_url}"))
                .arg(format!("--initial-cluster=kvwire-test={peer_url}"))
                // Shorter election timing lowers etcd's minimum lease TTL to 1 s.
                .arg("--heartbeat-interval=50")
                .arg("--election-timeout=500")
                .arg("--logger=zap")
                .arg("--log-outputs=stderr")
                .stdin(Stdio::null())
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .expect("spawn etcd");
            let mut etcd = Etcd {
                child,
                dir,
                endpoint,
            };
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                if let Ok(Some(status)) = etcd.child.try_wait() {
                    last_log =
                        std::fs::read_to_string(etcd.dir.join("etcd.log")).unwrap_or_default();
                    eprintln!("{test}: etcd exited with {status} (attempt {attempt})");
                    break;
                }
                if let Ok(d) = connect(&etcd, Duration::from_secs(1)).await {
                    if d.resolve(PeerQuery::cluster("probe")).await.is_ok() {
                        return Some(etcd);
                    }
                }
                if Instant::now() > deadline {
                    last_log =
                        std::fs::read_to_string(etcd.dir.join("etcd.log")).unwrap_or_default();
                    eprintln!("{test}: etcd not ready within 30 s (attempt {attempt})");
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        let tail: String = last_log
            .lines()
            .rev()
            .take(30)
            .collect::<Vec<_>>()
            .join("\n");
        panic!("{test}: etcd did not start; its last log lines (newest first):\n{tail}");
    }

    pub async fn connect(etcd: &Etcd, ttl: Duration) -> Result<EtcdDiscovery, DiscoveryError> {
        let options = EtcdOptions::default()
            .with_prefix("kvwire-test")
            .with_ttl(ttl);
        EtcdDiscovery::connect([etcd.endpoint.as_str()], options).await
    }

    struct Clients {
        etcd: Etcd,
        /// Registers with a 1 s TTL.
        short: EtcdDiscovery,
        /// Registers with a 10 min TTL.
        long: EtcdDiscovery,
        peer: EtcdDiscovery,
    }

    async fn clients(test: &str) -> Option<Clients> {
        let etcd = start(test).await?;
        let short = connect(&etcd, Duration::from_secs(1))
            .await
            .expect("connect");
        let long = connect(&etcd, Duration::from_secs(600))
            .await
            .expect("connect");
        let peer = connect(&etcd, Duration::from_secs(600))
            .await
            .expect("connect");
        Some(Clients {
            etcd,
            short,
            long,
            peer,
        })
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn etcd_register_resolve() {
        let Some(c) = clients("etcd_register_resolve").await else {
            return;
        };
        scenario_register_resolve(&c.long, &c.peer, "c-resolve").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn etcd_dropped_registration_disappears() {
        let Some(c) = clients("etcd_dropped").await else {
            return;
        };
        scenario_dropped_registration_disappears(&c.long, &c.peer, "c-drop").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn etcd_dead_node_lease_expires() {
        let Some(c) = clients("etcd_dead_node").await else {
            return;
        };
        scenario_dead_node_expires(&c.short, &c.peer, "c-expire").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn etcd_watch() {
        let Some(c) = clients("etcd_watch").await else {
            return;
        };
        scenario_watch(&c.short, &c.long, &c.peer, "c-watch").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn etcd_restarted_node_is_resolved_first() {
        let Some(c) = clients("etcd_restarted").await else {
            return;
        };
        scenario_restarted_node_first(&c.long, &c.peer, "c-restarted").await;
    }

    /// Keys have the documented layout, and a foreign or malformed value under the prefix is
    /// ignored rather than failing the resolve.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn etcd_key_layout() {
        let Some(c) = clients("etcd_key_layout").await else {
            return;
        };
        let (etcd, node, peer) = (&c.etcd, &c.long, &c.peer);
        let reg = node
            .register(record("c-keys", Role::Decode, 3, 77))
            .await
            .unwrap();
        assert_eq!(node.key_of(&reg.key()), "/kvwire-test/c-keys/decode/3/77");
        let mut raw =
            kvwire::discovery::etcd_client::Client::connect([etcd.endpoint.as_str()], None)
                .await
                .unwrap();
        let got = raw
            .get("/kvwire-test/c-keys/decode/3/77", None)
            .await
            .unwrap();
        let kv = &got.kvs()[0];
        assert_ne!(kv.lease(), 0, "the key is under a lease");
        let stored: PeerRecord = serde_json::from_slice(kv.value()).unwrap();
        assert_eq!(stored, record("c-keys", Role::Decode, 3, 77));
        raw.put("/kvwire-test/c-keys/decode/3/78", "not json", None)
            .await
            .unwrap();
        raw.put(
            "/kvwire-test/c-keys/decode/4/77",
            serde_json::to_vec(&stored).unwrap(),
            None,
        )
        .await
        .unwrap();
        let found = peer.resolve(PeerQuery::cluster("c-keys")).await.unwrap();
        assert_eq!(keys(&found), vec![(Role::Decode, 3, 77)]);
        reg.deregister().await.unwrap();
        let got = raw
            .get("/kvwire-test/c-keys/decode/3/77", None)
            .await
            .unwrap();
        assert!(
            got.kvs().is_empty(),
            "deregister revokes the lease and its key"
        );
    }
}
