//! RDMA tests. They skip, saying why, on hosts without an RDMA device, and fail when the
//! SoftRoCE lane requires a device (`KVWIRE_REQUIRE_RDMA=1`, set by `.ci/run` for the run
//! inside `scripts/softroce-vm.sh`).
//!
//! Today they check the device the RDMA transport will run on, as kvwire sees it; the
//! transport's own tests (verified transfers, the incident scenarios, late writes, a killed
//! sender) join them with the transport.

use kvwire::doctor::{inspect, RdmaDevice};

/// The usable device, or `None` after printing why the test is skipped.
fn device(test: &str) -> Option<RdmaDevice> {
    let report = inspect();
    if let Some(d) = report.rdma.iter().find(|d| d.usable()) {
        return Some(d.clone());
    }
    let why = if report.rdma.is_empty() {
        "no RDMA device on this host".to_string()
    } else {
        format!(
            "no usable RDMA device (found {:?})",
            report.rdma.iter().map(|d| &d.name).collect::<Vec<_>>()
        )
    };
    if std::env::var_os("KVWIRE_REQUIRE_RDMA").is_some_and(|v| v == "1") {
        panic!("{test}: KVWIRE_REQUIRE_RDMA=1 but {why}");
    }
    println!(
        "SKIPPED {test}: {why} (run it under scripts/softroce-vm.sh with KVWIRE_REQUIRE_RDMA=1)"
    );
    None
}

#[test]
fn rdma_device_has_an_active_port_and_a_routable_roce_v2_gid() {
    let Some(d) = device("rdma_device_has_an_active_port_and_a_routable_roce_v2_gid") else {
        return;
    };
    // RoCE v2 over IPv4 needs an IPv4-mapped GID (::ffff:a.b.c.d) to address the peer.
    let mapped = d.gids.iter().any(|(_, _, gid, kind)| {
        kind == "RoCE v2" && gid.starts_with("0000:0000:0000:0000:0000:ffff:")
    });
    assert!(
        mapped,
        "{}: no IPv4-mapped RoCE v2 GID in {:?}",
        d.name, d.gids
    );
    let mtu_known = d
        .ports
        .iter()
        .any(|(_, state, mtu, _)| state.contains("ACTIVE") && mtu.parse::<u32>().is_ok());
    assert!(
        mtu_known,
        "{}: no active port with a known MTU: {:?}",
        d.name, d.ports
    );
}

#[test]
fn rdma_device_supports_type_2b_memory_windows() {
    let Some(d) = device("rdma_device_supports_type_2b_memory_windows") else {
        return;
    };
    match d.memory_windows {
        Some((type_2b, max_mw)) => assert!(
            type_2b && max_mw > 0,
            "{}: memory windows {:?}",
            d.name,
            d.memory_windows
        ),
        None => panic!(
            "{}: memory-window support unknown (ibv_devinfo missing?)",
            d.name
        ),
    }
}
