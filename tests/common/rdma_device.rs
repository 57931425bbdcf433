//! The RDMA device a test runs on (included with `#[path]` by tests/rdma.rs and
//! cli/tests/rdma_processes.rs; not a test target of its own).

use kvwire::host::{inspect, RdmaDevice};

/// The usable device, or `None` after printing why the test is skipped.
pub fn device(test: &str) -> Option<RdmaDevice> {
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
    if std::env::var("KVWIRE_REQUIRE_RDMA").is_ok_and(|v| v == "1") {
        panic!("{test}: KVWIRE_REQUIRE_RDMA=1 but {why}");
    }
    println!(
        "SKIPPED {test}: {why} (run it under scripts/softroce-vm.sh with KVWIRE_REQUIRE_RDMA=1)"
    );
    None
}
