//! The host probe: what this host offers a transfer engine (RDMA devices, their ports, GIDs
//! and memory-window support, the locked-memory limit, huge pages). The RDMA transport uses
//! it to choose a GID; `kvwire doctor` prints it.
//!
//! Reads only files under `/sys` and `/proc` (and runs `ibv_devinfo` when installed), so it
//! works, and says so plainly, on hosts without RDMA support or packages.

use std::path::Path;

/// One RDMA device found under `/sys/class/infiniband`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RdmaDevice {
    /// Device name (e.g. `rxe0`, `mlx5_0`).
    pub name: String,
    /// Ports: (number, state, active MTU, link layer).
    pub ports: Vec<(String, String, String, String)>,
    /// Set GIDs: (port, index, GID, type such as "RoCE v2").
    pub gids: Vec<(String, u32, String, String)>,
    /// Memory-window support as `ibv_devinfo -v` reports it, if that tool is installed:
    /// (type 2B windows supported, max_mw).
    pub memory_windows: Option<(bool, u64)>,
    /// The NUMA node of the device's PCI function (`device/numa_node`), where the kernel
    /// knows it (not for a software device such as rxe, nor on a host without NUMA).
    pub numa_node: Option<u32>,
}

impl RdmaDevice {
    /// Whether a port is ACTIVE and has a RoCE v2 GID (what the RDMA transport needs).
    pub fn usable(&self) -> bool {
        self.ports.iter().any(|(n, state, _, _)| {
            state.contains("ACTIVE")
                && self
                    .gids
                    .iter()
                    .any(|(p, _, _, t)| p == n && t == "RoCE v2")
        })
    }
}

/// Set GIDs of one port directory (`.../ports/N`), in index order.
fn gids_of(port: &Path, port_num: &str) -> Vec<(String, u32, String, String)> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(port.join("gids")) else {
        return out;
    };
    let mut idx: Vec<u32> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse().ok())
        .collect();
    idx.sort_unstable();
    for i in idx {
        let Some(gid) = read(&port.join("gids").join(i.to_string())) else {
            continue;
        };
        if gid.chars().all(|c| c == '0' || c == ':') {
            continue;
        }
        let kind =
            read(&port.join("gid_attrs/types").join(i.to_string())).unwrap_or_else(|| "?".into());
        out.push((port_num.to_string(), i, gid, kind));
    }
    out
}

/// What `ibv_devinfo -v -d DEV` says (None if the tool is missing or fails).
fn devinfo(dev: &str) -> Option<String> {
    let out = std::process::Command::new("ibv_devinfo")
        .args(["-v", "-d", dev])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Active MTU of each port in `ibv_devinfo` output: (port, "4096").
fn devinfo_mtus(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut port = None;
    for line in text.lines() {
        let l = line.trim();
        if let Some(rest) = l.strip_prefix("port:") {
            port = Some(rest.trim().to_string());
        } else if let (Some(rest), Some(p)) = (l.strip_prefix("active_mtu:"), &port) {
            let mtu = rest.split_whitespace().next().unwrap_or("?").to_string();
            out.push((p.clone(), mtu));
        }
    }
    out
}

/// Memory-window support in `ibv_devinfo -v` output: (type 2B supported, max_mw).
fn memory_windows(text: &str) -> Option<(bool, u64)> {
    let type_2b = text.contains("MEM_WINDOW_TYPE_2B");
    let max_mw = text
        .lines()
        .find(|l| l.trim_start().starts_with("max_mw:"))
        .and_then(|l| l.split(':').nth(1))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    Some((type_2b, max_mw))
}

/// What the host offers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    /// RDMA devices; empty when none (or no RDMA support in the kernel).
    pub rdma: Vec<RdmaDevice>,
    /// Whether `/sys/class/infiniband` exists at all.
    pub rdma_sysfs: bool,
    /// Locked-memory limit in bytes (`None` = unlimited), from `/proc/self/limits`.
    pub memlock: Option<Option<u64>>,
    /// Huge pages: (total, free, size in KiB), from `/proc/meminfo`.
    pub hugepages: Option<(u64, u64, u64)>,
    /// Transparent huge pages: the mode in `/sys/kernel/mm/transparent_hugepage/enabled`
    /// (`always`, `madvise`, `never`). Same-host pulls copy about twice as fast out of memory
    /// on them (docs/SAME_HOST.md).
    pub thp: Option<String>,
    /// Yama's `ptrace_scope` (`/proc/sys/kernel/yama/ptrace_scope`), `None` without Yama: which
    /// processes may read another's memory, as same-host pulls do (docs/SAME_HOST.md).
    pub ptrace_scope: Option<u8>,
}

/// The NUMA node of RDMA device `name` on the host whose root is `root`, where the kernel
/// knows it: `sys/class/infiniband/NAME/device/numa_node`, absent for software devices (rxe)
/// and -1 where the host has no NUMA information.
pub fn device_numa_node(root: &Path, name: &str) -> Option<u32> {
    read(
        &root
            .join("sys/class/infiniband")
            .join(name)
            .join("device/numa_node"),
    )
    .and_then(|v| v.parse::<i64>().ok())
    .and_then(|n| u32::try_from(n).ok())
}

fn read(p: &Path) -> Option<String> {
    std::fs::read_to_string(p)
        .ok()
        .map(|s| s.trim().to_string())
}

/// Inspects the host.
pub fn inspect() -> Report {
    inspect_at(Path::new("/"))
}

/// Inspects a host whose root is `root` (for tests).
pub fn inspect_at(root: &Path) -> Report {
    let ib = root.join("sys/class/infiniband");
    let mut rdma = Vec::new();
    if let Ok(entries) = std::fs::read_dir(&ib) {
        let mut names: Vec<_> = entries
            .flatten()
            .map(|e| e.file_name().to_string_lossy().to_string())
            .collect();
        names.sort();
        for name in names {
            let mut ports = Vec::new();
            let mut gids = Vec::new();
            if let Ok(ps) = std::fs::read_dir(ib.join(&name).join("ports")) {
                let mut ps: Vec<_> = ps.flatten().map(|e| e.path()).collect();
                ps.sort();
                for p in ps {
                    let get = |f: &str| read(&p.join(f)).unwrap_or_else(|| "?".into());
                    let num = p
                        .file_name()
                        .map(|n| n.to_string_lossy().to_string())
                        .unwrap_or_default();
                    gids.extend(gids_of(&p, &num));
                    ports.push((num, get("state"), get("active_mtu"), get("link_layer")));
                }
            }
            // Only the live host has an ibv_devinfo to ask; sysfs lacks MTU on some drivers.
            let info = if root == Path::new("/") {
                devinfo(&name)
            } else {
                None
            };
            if let Some(text) = &info {
                for (p, mtu) in devinfo_mtus(text) {
                    if let Some(port) = ports.iter_mut().find(|x| x.0 == p && x.2 == "?") {
                        port.2 = mtu;
                    }
                }
            }
            let memory_windows = info.as_deref().and_then(memory_windows);
            let numa_node = device_numa_node(root, &name);
            rdma.push(RdmaDevice {
                name,
                ports,
                gids,
                memory_windows,
                numa_node,
            });
        }
    }
    let memlock = read(&root.join("proc/self/limits")).and_then(|l| {
        l.lines()
            .find(|x| x.starts_with("Max locked memory"))
            .map(|x| {
                let soft = x.split_whitespace().nth(3).unwrap_or("");
                soft.parse::<u64>().ok()
            })
    });
    let hugepages = read(&root.join("proc/meminfo")).map(|m| {
        let field = |k: &str| {
            m.lines()
                .find(|l| l.starts_with(k))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        (
            field("HugePages_Total:"),
            field("HugePages_Free:"),
            field("Hugepagesize:"),
        )
    });
    let thp = read(&root.join("sys/kernel/mm/transparent_hugepage/enabled")).and_then(|m| {
        let start = m.find('[')?;
        let end = m[start..].find(']')?;
        Some(m[start + 1..start + end].to_string())
    });
    let ptrace_scope =
        read(&root.join("proc/sys/kernel/yama/ptrace_scope")).and_then(|v| v.parse().ok());
    Report {
        rdma,
        rdma_sysfs: ib.exists(),
        memlock,
        hugepages,
        thp,
        ptrace_scope,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_fake_host() {
        let dir = std::env::temp_dir().join(format!("kvwire-doctor-{}", std::process::id()));
        let port = dir.join("sys/class/infiniband/rxe0/ports/1");
        std::fs::create_dir_all(&port).unwrap();
        std::fs::write(port.join("state"), "4: ACTIVE\n").unwrap();
        std::fs::write(port.join("active_mtu"), "1024\n").unwrap();
        std::fs::write(port.join("link_layer"), "Ethernet\n").unwrap();
        std::fs::create_dir_all(port.join("gids")).unwrap();
        std::fs::create_dir_all(port.join("gid_attrs/types")).unwrap();
        std::fs::write(
            port.join("gids/0"),
            "fe80:0000:0000:0000:0200:00ff:fe00:0000\n",
        )
        .unwrap();
        std::fs::write(port.join("gid_attrs/types/0"), "RoCE v2\n").unwrap();
        std::fs::write(
            port.join("gids/1"),
            "0000:0000:0000:0000:0000:0000:0000:0000\n",
        )
        .unwrap();
        std::fs::create_dir_all(dir.join("proc/self")).unwrap();
        std::fs::write(
            dir.join("proc/self/limits"),
            "Limit Soft Hard Units\nMax locked memory         8388608              8388608              bytes\n",
        )
        .unwrap();
        std::fs::write(
            dir.join("proc/meminfo"),
            "HugePages_Total:      16\nHugePages_Free:        8\nHugepagesize:       2048 kB\n",
        )
        .unwrap();
        let r = inspect_at(&dir);
        assert_eq!(r.rdma.len(), 1);
        assert_eq!(
            r.rdma[0].ports[0],
            (
                "1".into(),
                "4: ACTIVE".into(),
                "1024".into(),
                "Ethernet".into()
            )
        );
        assert_eq!(r.memlock, Some(Some(8 << 20)));
        assert_eq!(r.hugepages, Some((16, 8, 2048)));
        let gid = "fe80:0000:0000:0000:0200:00ff:fe00:0000".to_string();
        assert_eq!(r.rdma[0].gids, vec![("1".into(), 0, gid, "RoCE v2".into())]);
        assert!(r.rdma[0].usable());
        // A software device: no PCI function, no NUMA node.
        assert_eq!(r.rdma[0].numa_node, None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A NIC's NUMA node is its PCI function's; -1 (no NUMA information) and a missing file
    /// (a software device) are unknown.
    #[test]
    fn a_devices_numa_node_comes_from_its_pci_function() {
        let dir = std::env::temp_dir().join(format!("kvwire-numa-{}", std::process::id()));
        for (name, node) in [("mlx5_0", "0\n"), ("mlx5_1", "1\n"), ("mlx5_2", "-1\n")] {
            let d = dir.join("sys/class/infiniband").join(name).join("device");
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("numa_node"), node).unwrap();
        }
        std::fs::create_dir_all(dir.join("sys/class/infiniband/rxe0")).unwrap();
        assert_eq!(device_numa_node(&dir, "mlx5_0"), Some(0));
        assert_eq!(device_numa_node(&dir, "mlx5_1"), Some(1));
        assert_eq!(device_numa_node(&dir, "mlx5_2"), None);
        assert_eq!(device_numa_node(&dir, "rxe0"), None);
        assert_eq!(device_numa_node(&dir, "absent"), None);
        let r = inspect_at(&dir);
        let nodes: Vec<_> = r
            .rdma
            .iter()
            .map(|d| (d.name.as_str(), d.numa_node))
            .collect();
        assert_eq!(
            nodes,
            [
                ("mlx5_0", Some(0)),
                ("mlx5_1", Some(1)),
                ("mlx5_2", None),
                ("rxe0", None)
            ]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn devinfo_output_gives_mtu_and_memory_windows() {
        // The shape of `ibv_devinfo -v -d rxe0` on SoftRoCE.
        let text = "hca_id:\trxe0\n\tdevice_cap_flags:\t0x00221c76\n\t\t\t\t\tMEM_WINDOW\n\t\t\t\t\tMEM_WINDOW_TYPE_2B\n\tmax_mw:\t\t\t\t524287\n\t\tport:\t1\n\t\t\tstate:\t\t\tPORT_ACTIVE (4)\n\t\t\tactive_mtu:\t\t4096 (5)\n";
        assert_eq!(
            devinfo_mtus(text),
            vec![("1".to_string(), "4096".to_string())]
        );
        assert_eq!(memory_windows(text), Some((true, 524287)));
        assert_eq!(memory_windows("max_mw: 0\n"), Some((false, 0)));
    }
}
