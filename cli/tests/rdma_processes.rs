//! Two `kvwire bench --transport rdma` processes with a sender killed mid-transfer: the
//! receiver fails its transfers, returns every page and serves the next sender. Skips, saying
//! why, on hosts without an RDMA device; fails when the SoftRoCE lane requires one
//! (`KVWIRE_REQUIRE_RDMA=1`, scripts/softroce-lane.sh runs it inside its VM).
#![cfg(feature = "rdma")]

mod common;
#[path = "../../tests/common/rdma_device.rs"]
mod rdma_device;

use rdma_device::device;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::process::{
    assert_all_verified, assert_receiver_account, finish, wait_for_line, Reaped, StderrLines,
};

fn kvwire(dev: &str, args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_kvwire"))
        .args(["bench", "--transport", "rdma", "--device", dev])
        .args([
            "--page-sizes",
            "64K",
            "--buffers",
            "4",
            "--pages",
            "8",
            "--bytes",
            "64M",
            // Content, not only status: the receiver compares the bytes it verified.
            "--check-bytes",
            "--json",
            // Under TCG emulation rxe moves tens of MB/s and a PING waits behind the
            // WRITEs posted before it on its queue pair (SPEC §8.3): a generous peer
            // timeout, so a slow link is not taken for a dead peer. The killed sender is
            // still found at once, by its bootstrap connection closing.
            "--peer-timeout-ms",
            "10000",
        ])
        .args(args)
        .env("KVWIRE_PSK", "72646d612d74776f2d70726f6365737365732d6b6579")
        .env_remove("KVWIRE_PSK_FILE")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kvwire")
}

#[test]
fn two_processes_over_rdma_survive_a_killed_sender() {
    let Some(d) = device("two_processes_over_rdma_survive_a_killed_sender") else {
        return;
    };
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    // Two queue pairs per connection, authenticated (KVWIRE_PSK): each lane has its own
    // channel.
    let mut receiver = Reaped(Some(kvwire(
        &d.name,
        &[
            "--listen",
            &addr,
            "--connections",
            "3",
            "--queue-pairs",
            "2",
        ],
    )));
    let mut said = StderrLines::of(receiver.0.as_mut().expect("receiver"));
    let sender = || kvwire(&d.name, &["--connect", &addr, "--queue-pairs", "2"]);

    let (code, json, err) = finish(sender(), Duration::from_secs(300));
    assert_eq!(code, Some(0), "first sender failed: {err} {json}");
    assert_eq!(json["transport"], "rdma");
    let case = &json["cases"][0];
    assert_all_verified(case);

    let mut victim = sender();
    wait_for_line(&mut victim, "connected over rdma");
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        victim.try_wait().expect("wait").is_none(),
        "the sender finished before it could be killed; the case is too small"
    );
    victim.kill().expect("SIGKILL");
    let _ = victim.wait();
    // One connection at a time: the next sender once the receiver served the killed one.
    said.wait_for("verified, failures", 2, Duration::from_secs(120));

    let (code, json, err) = finish(sender(), Duration::from_secs(300));
    assert_eq!(code, Some(0), "sender after the kill failed: {err} {json}");
    let case = &json["cases"][0];
    assert_all_verified(case);

    let (code, json, _) = finish(receiver.take(), Duration::from_secs(120));
    assert_receiver_account(code, &json, &said.text());
}
