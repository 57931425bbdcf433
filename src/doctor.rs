//! `kvwire doctor`: what this host offers a transfer engine.
//!
//! Reads only files under `/sys` and `/proc`, so it works (and says so plainly) on hosts
//! without RDMA support or packages.

use std::fmt::Write as _;
use std::path::Path;

/// One RDMA device found under `/sys/class/infiniband`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RdmaDevice {
    /// Device name (e.g. `rxe0`, `mlx5_0`).
    pub name: String,
    /// Ports: (number, state, active MTU, link layer).
    pub ports: Vec<(String, String, String, String)>,
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
            if let Ok(ps) = std::fs::read_dir(ib.join(&name).join("ports")) {
                let mut ps: Vec<_> = ps.flatten().map(|e| e.path()).collect();
                ps.sort();
                for p in ps {
                    let get = |f: &str| read(&p.join(f)).unwrap_or_else(|| "?".into());
                    let num = p
                        .file_name()
                        .map(|n| n.to_string_lossy().to_string())
                        .unwrap_or_default();
                    ports.push((num, get("state"), get("active_mtu"), get("link_layer")));
                }
            }
            rdma.push(RdmaDevice { name, ports });
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
    Report {
        rdma,
        rdma_sysfs: ib.exists(),
        memlock,
        hugepages,
    }
}

impl Report {
    /// A human summary, one finding per line.
    pub fn render(&self) -> String {
        let mut o = String::new();
        if self.rdma.is_empty() {
            let why = if self.rdma_sysfs {
                "no RDMA devices"
            } else {
                "no RDMA support in this kernel (/sys/class/infiniband absent)"
            };
            let _ = writeln!(
                o,
                "rdma:      none: {why}; the RDMA transport is unavailable, TCP and loopback work"
            );
        }
        for d in &self.rdma {
            let _ = writeln!(o, "rdma:      {}", d.name);
            for (n, state, mtu, ll) in &d.ports {
                let _ = writeln!(
                    o,
                    "           port {n}: {state}, active MTU {mtu}, link layer {ll}"
                );
            }
        }
        match self.memlock {
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
        match self.hugepages {
            Some((total, free, size)) => {
                let _ = writeln!(o, "hugepages: {total} total, {free} free, {size} KiB each");
            }
            None => {
                let _ = writeln!(o, "hugepages: unknown (/proc/meminfo unreadable)");
            }
        }
        o
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
        let text = r.render();
        assert!(text.contains("rxe0") && text.contains("too low"), "{text}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn no_rdma_is_a_clear_message() {
        let dir = std::env::temp_dir().join(format!("kvwire-doctor-none-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let text = inspect_at(&dir).render();
        assert!(text.contains("no RDMA support in this kernel"), "{text}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
