//! Two `kvwire` processes: verified transfers across a network, then a sender killed with
//! SIGKILL mid-transfer, after which the receiver has failed those transfers, returned
//! every page, and still serves a new sender.
//!
//! The scenario runs over loopback everywhere, and across two network namespaces joined by
//! a veth pair when run as root with `ip netns` (`.ci/run` requires the latter with
//! `KVWIRE_REQUIRE_NETNS=1`).

mod common;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::process::{
    assert_all_verified, assert_receiver_account, finish, wait_for_line, Reaped, StderrLines,
};

const CASE: &[&str] = &[
    "--page-sizes",
    "64K",
    "--buffers",
    "4",
    "--pages",
    "8",
    "--bytes",
    "1G",
    "--no-raw",
    // Content, not only status: the receiver compares every byte it verified.
    "--check-bytes",
    "--json",
];

fn kvwire(prefix: &[String], args: &[&str]) -> Command {
    let bin = env!("CARGO_BIN_EXE_kvwire");
    let mut c = match prefix.split_first() {
        Some((first, rest)) => {
            let mut c = Command::new(first);
            c.args(rest).arg(bin);
            c
        }
        None => Command::new(bin),
    };
    c.args(args);
    // Both processes hold the same pre-shared key (authentication is on by default).
    c.env(
        "KVWIRE_PSK",
        "6d756c7469686f73742d746573742d6b65792d30303031",
    );
    c.env_remove("KVWIRE_PSK_FILE");
    c
}

fn spawn(mut c: Command) -> Child {
    c.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kvwire")
}

/// The scenario: one complete sender, one killed mid-transfer, one complete again.
fn scenario(receiver_prefix: &[String], sender_prefix: &[String], addr: &str) {
    let mut rx_args = vec!["bench", "--listen", addr, "--connections", "3"];
    rx_args.extend_from_slice(CASE);
    let mut receiver = Reaped(Some(spawn(kvwire(receiver_prefix, &rx_args))));
    let mut said = StderrLines::of(receiver.0.as_mut().expect("receiver"));
    let mut tx_args = vec!["bench", "--connect", addr];
    tx_args.extend_from_slice(CASE);

    // 1. A whole run verifies.
    let (code, json, err) = finish(
        spawn(kvwire(sender_prefix, &tx_args)),
        Duration::from_secs(120),
    );
    assert_eq!(code, Some(0), "first sender failed: {err}");
    let case = &json["cases"][0];
    assert_all_verified(case);

    // 2. A sender killed with SIGKILL while transfers are in flight.
    let mut victim = spawn(kvwire(sender_prefix, &tx_args));
    wait_for_line(&mut victim, "connected");
    // Killed as soon as it connected: its 1 GiB of transfers start at once and cannot have
    // ended by now.
    assert!(
        victim.try_wait().expect("wait").is_none(),
        "the sender finished before it could be killed; the case is too small"
    );
    victim.kill().expect("SIGKILL");
    let _ = victim.wait();
    // The receiver takes one connection at a time (a connection still in its handshake when
    // another is handed out is dropped): the next sender starts once the receiver has
    // served the killed one.
    said.wait_for("verified, failures", 2, Duration::from_secs(60));

    // 3. A new sender is served.
    let (code, json, err) = finish(
        spawn(kvwire(sender_prefix, &tx_args)),
        Duration::from_secs(120),
    );
    assert_eq!(
        code,
        Some(0),
        "sender after the kill failed: {err}; the receiver said:\n{}",
        said.text()
    );
    let case = &json["cases"][0];
    assert_all_verified(case);

    // The receiver's own account of the three connections.
    let (code, json, _) = finish(receiver.take(), Duration::from_secs(60));
    assert_receiver_account(code, &json, &said.text());
}

#[test]
fn two_processes_on_loopback_survive_a_killed_sender() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    scenario(&[], &[], &format!("127.0.0.1:{port}"));
}

/// Two network namespaces joined by a veth pair, deleted again on drop.
struct Hosts {
    a: String,
    b: String,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Hosts {
    fn new() -> Result<Self, String> {
        let id = std::process::id() % 100_000;
        let h = Hosts {
            a: format!("kvw-a-{id}"),
            b: format!("kvw-b-{id}"),
        };
        let (va, vb) = (format!("kva{id}"), format!("kvb{id}"));
        ip(&["netns", "add", &h.a])?;
        ip(&["netns", "add", &h.b])?;
        ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb])?;
        ip(&["link", "set", &va, "netns", &h.a])?;
        ip(&["link", "set", &vb, "netns", &h.b])?;
        ip(&["-n", &h.a, "addr", "add", "10.77.0.1/24", "dev", &va])?;
        ip(&["-n", &h.b, "addr", "add", "10.77.0.2/24", "dev", &vb])?;
        for (ns, dev) in [(&h.a, &va), (&h.b, &vb)] {
            ip(&["-n", ns, "link", "set", dev, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(h)
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.a]);
        let _ = ip(&["netns", "del", &self.b]);
    }
}

#[test]
fn two_hosts_in_network_namespaces_survive_a_killed_sender() {
    let required = std::env::var("KVWIRE_REQUIRE_NETNS").is_ok_and(|v| v == "1");
    let is_root = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .map(|l| l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false);
    let hosts = if is_root {
        Hosts::new()
    } else {
        Err("not running as root".into())
    };
    let hosts = match hosts {
        Ok(h) => h,
        Err(why) if !required => {
            println!("SKIPPED two_hosts_in_network_namespaces_survive_a_killed_sender: {why} (set KVWIRE_REQUIRE_NETNS=1 to make this a failure)");
            return;
        }
        Err(why) => {
            panic!("network namespaces required (KVWIRE_REQUIRE_NETNS=1) but unavailable: {why}")
        }
    };
    let exec = |ns: &str| {
        vec![
            "ip".to_string(),
            "netns".into(),
            "exec".into(),
            ns.to_string(),
        ]
    };
    scenario(&exec(&hosts.a), &exec(&hosts.b), "10.77.0.1:7400");
}
