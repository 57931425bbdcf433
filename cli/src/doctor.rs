//! `kvwire doctor`: the host probe ([`kvwire::host`]) and the authentication settings, as
//! one finding per line.

use std::fmt::Write as _;
use std::path::Path;

use kvwire::host::Report;

/// A human summary of the host, one finding per line.
pub fn render(report: &Report) -> String {
    let mut o = String::new();
    if report.rdma.is_empty() {
        let why = if report.rdma_sysfs {
            "no RDMA devices"
        } else {
            "no RDMA support in this kernel (/sys/class/infiniband absent)"
        };
        let _ = writeln!(
            o,
            "rdma:      none: {why}; the RDMA transport is unavailable, TCP and loopback work"
        );
    }
    for d in &report.rdma {
        let note = if d.usable() {
            ""
        } else {
            " (not usable: no ACTIVE port with a RoCE v2 GID)"
        };
        let numa = d
            .numa_node
            .map_or_else(String::new, |n| format!(" (NUMA node {n})"));
        let _ = writeln!(o, "rdma:      {}{numa}{note}", d.name);
        match d.memory_windows {
            Some((true, max)) => {
                let _ = writeln!(
                    o,
                    "           memory windows: type 2B supported, max_mw {max} (ibv_devinfo)"
                );
            }
            Some((false, max)) => {
                let _ = writeln!(
                    o,
                    "           memory windows: type 2B NOT supported (max_mw {max})"
                );
            }
            None => {
                let _ = writeln!(
                    o,
                    "           memory windows: unknown (install ibverbs-utils for ibv_devinfo)"
                );
            }
        }
        for (n, state, mtu, ll) in &d.ports {
            let _ = writeln!(
                o,
                "           port {n}: {state}, active MTU {mtu}, link layer {ll}"
            );
        }
        for (port, i, gid, kind) in &d.gids {
            let _ = writeln!(o, "           gid {port}/{i}: {gid} ({kind})");
        }
    }
    // The rails a node naming every usable device would run (SPEC §9.2, several rails).
    let usable_devices: Vec<&kvwire::host::RdmaDevice> =
        report.rdma.iter().filter(|d| d.usable()).collect();
    let usable: Vec<&str> = usable_devices.iter().map(|d| d.name.as_str()).collect();
    match usable.len() {
        0 => {}
        1 => {
            let _ = writeln!(
                o,
                "rails:     one ({}): one device with an ACTIVE port",
                usable[0]
            );
        }
        n => {
            let _ = writeln!(
                o,
                "rails:     {n} ({}): --device {} (Python ib_device=\"{}\") stripes transfers over them; rail i of each node must reach rail i of its peers",
                usable.join(", "),
                usable.join(","),
                usable.join(",")
            );
            // Rail affinity (SPEC §9.2, striping): a decode whose KV memory is on a node with
            // rails stripes and reserves over those first.
            let mut nodes: Vec<u32> = usable_devices.iter().filter_map(|d| d.numa_node).collect();
            nodes.sort_unstable();
            nodes.dedup();
            if nodes.len() > 1 {
                let groups: Vec<String> = nodes
                    .iter()
                    .map(|n| {
                        let on: Vec<&str> = usable_devices
                            .iter()
                            .filter(|d| d.numa_node == Some(*n))
                            .map(|d| d.name.as_str())
                            .collect();
                        format!("node {n}: {}", on.join(", "))
                    })
                    .collect();
                let _ = writeln!(
                    o,
                    "           by NUMA node ({}): a decode uses the rails of its KV memory's node while one of them is up",
                    groups.join("; ")
                );
            }
        }
    }
    match report.memlock {
        Some(None) => {
            let _ = writeln!(o, "memlock:   unlimited");
        }
        Some(Some(b)) => {
            let hint = if b < 64 << 20 {
                " -- too low to register KV memory for RDMA; raise `ulimit -l` (e.g. unlimited)"
            } else {
                ""
            };
            let _ = writeln!(o, "memlock:   {} KiB{hint}", b / 1024);
        }
        None => {
            let _ = writeln!(o, "memlock:   unknown (/proc/self/limits unreadable)");
        }
    }
    match report.hugepages {
        Some((total, free, size)) => {
            let _ = writeln!(o, "hugepages: {total} total, {free} free, {size} KiB each");
        }
        None => {
            let _ = writeln!(o, "hugepages: unknown (/proc/meminfo unreadable)");
        }
    }
    let _ = writeln!(o, "{}", same_host_line(report));
    o
}

/// The `same-host:` line: whether a decode on this host may pull pages out of a prefill's
/// memory (SPEC §9.3; docs/SAME_HOST.md), and how fast its memory can be.
fn same_host_line(report: &Report) -> String {
    let who = match report.ptrace_scope {
        None | Some(0) => "a decode may pull from a prefill of the same user",
        Some(1) => "Yama ptrace_scope 1: a decode may pull only from a prefill it started, or one that named it with prctl(PR_SET_PTRACER); otherwise page bytes travel on the stream",
        Some(2) => "Yama ptrace_scope 2: only a decode with CAP_SYS_PTRACE may pull; otherwise page bytes travel on the stream",
        Some(_) => "Yama ptrace_scope 3: no process may pull; page bytes travel on the stream",
    };
    let thp = match report.thp.as_deref() {
        Some("never") => "; transparent huge pages off: pulls copy at about half speed",
        Some(_) => "",
        None => "; transparent huge pages unknown",
    };
    format!("same-host: {who}{thp}")
}

/// The `auth:` lines of `kvwire doctor`: whether peers will be authenticated and where the
/// key comes from (its id, never the key), with a warning when authentication is off or no
/// key is found. `config` is the configuration file, if one was given.
pub fn auth_line(config: Option<&Path>) -> String {
    use kvwire::config::auth;
    let resolved = match config {
        Some(f) => match kvwire::config::file::ConfigFile::load(f) {
            Ok(c) => c.auth().map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        },
        None => auth::resolve(false, None).map_err(|e| e.to_string()),
    };
    match resolved {
        Ok((a, from)) if a.is_on() => {
            let from = from.map(|f| format!(" from {f}")).unwrap_or_default();
            format!("auth:      on: {}{from}\n", a.describe())
        }
        Ok(_) => "auth:      WARNING: off: peers are not authenticated; anyone who reaches the port can connect and forge frames\n".to_string(),
        Err(e) => format!("auth:      WARNING: {e}\n"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_devices_gids_and_limits() {
        let report = Report {
            rdma: vec![kvwire::host::RdmaDevice {
                name: "rxe0".into(),
                ports: vec![(
                    "1".into(),
                    "4: ACTIVE".into(),
                    "1024".into(),
                    "Ethernet".into(),
                )],
                gids: vec![(
                    "1".into(),
                    0,
                    "fe80:0000:0000:0000:0200:00ff:fe00:0000".into(),
                    "RoCE v2".into(),
                )],
                memory_windows: None,
                numa_node: None,
            }],
            rdma_sysfs: true,
            memlock: Some(Some(8 << 20)),
            hugepages: Some((16, 8, 2048)),
            thp: Some("never".into()),
            ptrace_scope: Some(1),
        };
        let text = render(&report);
        assert!(text.contains("rxe0") && text.contains("too low"), "{text}");
        assert!(
            text.contains("gid 1/0: fe80") && text.contains("(RoCE v2)"),
            "{text}"
        );
        assert!(
            text.contains("ptrace_scope 1") && text.contains("half speed"),
            "{text}"
        );
    }

    /// Every usable device is a rail; one without an ACTIVE port is left out.
    #[test]
    fn lists_the_rails_of_the_usable_devices() {
        let device = |name: &str, state: &str| kvwire::host::RdmaDevice {
            name: name.into(),
            ports: vec![("1".into(), state.into(), "1024".into(), "Ethernet".into())],
            gids: vec![("1".into(), 1, "::ffff:10.0.0.1".into(), "RoCE v2".into())],
            memory_windows: None,
            numa_node: None,
        };
        let mut report = Report {
            rdma: vec![
                device("rxe0", "4: ACTIVE"),
                device("rxe1", "4: ACTIVE"),
                device("rxe2", "1: DOWN"),
            ],
            rdma_sysfs: true,
            memlock: None,
            hugepages: None,
            thp: None,
            ptrace_scope: None,
        };
        let text = render(&report);
        assert!(
            text.contains("rails:     2 (rxe0, rxe1): --device rxe0,rxe1"),
            "{text}"
        );
        assert!(!text.contains("NUMA"), "{text}");
        // NICs on two NUMA nodes: each says its node, and the rails line groups them.
        report.rdma[0].numa_node = Some(0);
        report.rdma[1].numa_node = Some(1);
        let text = render(&report);
        assert!(text.contains("rdma:      rxe0 (NUMA node 0)"), "{text}");
        assert!(
            text.contains("by NUMA node (node 0: rxe0; node 1: rxe1)"),
            "{text}"
        );
        report.rdma.truncate(1);
        assert!(render(&report).contains("rails:     one (rxe0)"));
    }

    #[test]
    fn no_rdma_is_a_clear_message() {
        let dir = std::env::temp_dir().join(format!("kvwire-doctor-none-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let text = render(&kvwire::host::inspect_at(&dir));
        assert!(text.contains("no RDMA support in this kernel"), "{text}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
