//! Verbs: the device, registered memory and memory windows (through `sideway` and, for the
//! calls it does not wrap, `rdma-mummy-sys`). Queue pairs are in `link.rs`, the completion
//! channel in `events.rs`.

use std::ptr::NonNull;
use std::sync::Arc;

use sideway::ibverbs::address::Gid;
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::DeviceContext;
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::AccessFlags;

use sideway::ibverbs::device_context::Mtu;

use crate::memory::KvMemory;

/// Bytes of each send and receive slot for control frames.
pub const SLOT: usize = 64 * 1024;

/// Control frames in flight at once per link (each in its own registered slot).
pub const SEND_SLOTS: usize = 32;

/// An IB MTU in bytes.
pub(super) fn mtu_bytes(m: Mtu) -> u32 {
    match m {
        Mtu::Mtu256 => 256,
        Mtu::Mtu512 => 512,
        Mtu::Mtu1024 => 1024,
        Mtu::Mtu2048 => 2048,
        Mtu::Mtu4096 => 4096,
    }
}

/// Why the RDMA transport could not do something.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RdmaError {
    /// No RDMA device (or none with that name).
    #[error("no RDMA device{0}")]
    NoDevice(String),
    /// Port 1 is not active (cable, link, or for SoftRoCE: the netdev it sits on is down).
    #[error("device {device}: port 1 is {state}, not ACTIVE (check the link / `ip link`; for rxe, the underlying netdev)")]
    PortDown {
        /// The device.
        device: String,
        /// The port's state.
        state: String,
    },
    /// Registering memory failed; most often the locked-memory limit is too low.
    #[error("registering {bytes} bytes failed: {detail}; locked-memory limit: {limit} (raise `ulimit -l` / LimitMEMLOCK; see `kvwire doctor`)")]
    Register {
        /// Bytes of the region that failed.
        bytes: usize,
        /// The verbs error.
        detail: String,
        /// RLIMIT_MEMLOCK as `/proc/self/limits` shows it.
        limit: String,
    },
    /// No RoCE v2 GID usable for IPv4 on the port.
    #[error("device {0}: no usable RoCE v2 GID on port 1")]
    NoUsableGid(String),
    /// Buffer `buffer` is device (GPU) memory: registering it needs dma-buf or
    /// nvidia-peermem (docs/GPU.md, "RDMA into GPU memory"), not built yet.
    #[error("buffer {buffer} is device memory: RDMA registration of GPU memory is not built yet (docs/GPU.md)")]
    DeviceMemory {
        /// The buffer.
        buffer: usize,
    },
    /// A verbs call failed.
    #[error("{call}: {detail}")]
    Verbs {
        /// The call.
        call: &'static str,
        /// The error.
        detail: String,
    },
    /// A work request completed in error (e.g. a remote access error after a fence).
    #[error("work request {wr_id:#x} completed with status {status}")]
    Completion {
        /// The work request.
        wr_id: u64,
        /// The verbs status.
        status: u32,
    },
    /// A frame does not fit a send or receive slot.
    #[error("frame of {0} bytes exceeds the {SLOT} byte slot")]
    FrameTooLarge(usize),
    /// The peer's MTU is not a valid IB MTU (256, 512, 1024, 2048 or 4096 bytes).
    #[error("no common path MTU: local {local} bytes, peer {peer} bytes")]
    Mtu {
        /// Local active MTU.
        local: u32,
        /// The peer's.
        peer: u32,
    },
    /// The two sides of a connection have different numbers of queue pairs.
    #[error("queue pair count differs: {local} here, {peer} at the peer")]
    Lanes {
        /// Queue pairs here.
        local: usize,
        /// Queue pairs the peer listed.
        peer: usize,
    },
    /// Every lane of the connection was left out: each one's rail is down at one end or the
    /// other (SPEC §9.2, "A rail down when the connection opens").
    #[error("none of the connection's {lanes} lanes has its rail up at both ends")]
    NoLiveLane {
        /// The connection's lanes.
        lanes: usize,
    },
    /// Every send slot holds a frame whose SEND has not completed yet; retry after polling.
    #[error("all {SEND_SLOTS} send slots are in flight")]
    SendSlotsBusy,
}

pub(super) fn verbs<E: std::fmt::Display>(call: &'static str) -> impl Fn(E) -> RdmaError {
    move |e| RdmaError::Verbs {
        call,
        detail: e.to_string(),
    }
}

/// An opened RDMA device: context and protection domain. Which GID and MTU port 1 offers,
/// and whether it is up, is asked per connection ([`RdmaDevice::port_path`]): a rail whose
/// link is down when a node starts, or goes down and comes back, keeps its device and its
/// memory registration.
pub struct RdmaDevice {
    pub(super) ctx: Arc<DeviceContext>,
    pub(super) pd: Arc<ProtectionDomain>,
    /// Device name.
    pub name: String,
}

impl std::fmt::Debug for RdmaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaDevice")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// What a queue pair on a device's port 1 is addressed by now: the RoCE v2 GID and the
/// port's active MTU ([`RdmaDevice::port_path`]).
#[derive(Clone, Copy, Debug)]
pub struct PortPath {
    /// The GID index used (an IPv4-mapped RoCE v2 GID).
    pub gid_index: u8,
    /// Port 1's active MTU in bytes.
    pub mtu: u32,
    pub(super) gid: Gid,
}

impl PortPath {
    /// The placeholder of a lane whose rail is down: it is never connected, and its queue
    /// pair record says so (SPEC §9.2, "A rail down when the connection opens").
    pub(super) fn down() -> Self {
        Self {
            gid_index: 0,
            mtu: 0,
            gid: Gid { raw: [0; 16] },
        }
    }
}

impl RdmaDevice {
    /// Opens `name`, or the first device: its context and a protection domain. Its port
    /// need not be up ([`RdmaDevice::port_path`] says, per connection).
    pub fn open(name: Option<&str>) -> Result<Self, RdmaError> {
        let list = DeviceList::new().map_err(|e| RdmaError::NoDevice(format!(" ({e})")))?;
        let dev = list
            .iter()
            .find(|d| name.is_none_or(|n| d.name() == n))
            .ok_or_else(|| {
                RdmaError::NoDevice(name.map(|n| format!(" named {n}")).unwrap_or_default())
            })?;
        let name = dev.name().to_string();
        let ctx = dev.open().map_err(verbs("ibv_open_device"))?;
        let pd = ctx.alloc_pd().map_err(verbs("ibv_alloc_pd"))?;
        Ok(Self { ctx, pd, name })
    }

    /// Port 1 as a connection opened now would use it: the first IPv4-mapped RoCE v2 GID
    /// (what RoCE v2 over IPv4 addresses a peer with) and the active MTU; `PortDown` when
    /// the port is not active, `NoUsableGid` when it has no such GID.
    pub fn port_path(&self) -> Result<PortPath, RdmaError> {
        let port = self.ctx.query_port(1).map_err(verbs("ibv_query_port"))?;
        if port.port_state() != sideway::ibverbs::device_context::PortState::Active {
            return Err(RdmaError::PortDown {
                device: self.name.clone(),
                state: format!("{:?}", port.port_state()),
            });
        }
        // Index 1 is where rdma_rxe and most RoCE NICs put the IPv4-mapped RoCE v2 GID; check it.
        let doctor = crate::host::inspect();
        let gid_index = doctor
            .rdma
            .iter()
            .find(|d| d.name == self.name)
            .and_then(|d| {
                d.gids
                    .iter()
                    .find(|(p, _, g, t)| {
                        p == "1"
                            && t == "RoCE v2"
                            && g.starts_with("0000:0000:0000:0000:0000:ffff:")
                    })
                    .map(|(_, i, _, _)| *i as u8)
            })
            .ok_or_else(|| RdmaError::NoUsableGid(self.name.clone()))?;
        let gid = self
            .ctx
            .query_gid(1, gid_index.into())
            .map_err(verbs("ibv_query_gid"))?;
        Ok(PortPath {
            gid_index,
            mtu: mtu_bytes(port.active_mtu()),
            gid,
        })
    }

    /// Registers every buffer of `memory` for local and remote write (one region each).
    pub fn register(&self, memory: &Arc<KvMemory>) -> Result<RegisteredMemory, RdmaError> {
        let mut mrs = Vec::with_capacity(memory.buffers());
        for b in 0..memory.buffers() {
            let Some((ptr, len)) = memory.region(b) else {
                return Err(RdmaError::DeviceMemory { buffer: b });
            };
            // SAFETY: the region is valid for `len` bytes and lives as long as `memory`, which
            // the returned RegisteredMemory keeps alive (dropping the MRs first).
            let mr = unsafe {
                self.pd
                    .reg_mr(
                        ptr.as_ptr() as usize,
                        len,
                        AccessFlags::LocalWrite
                            | AccessFlags::RemoteWrite
                            | AccessFlags::MemoryWindowBind,
                    )
                    .map_err(|e| RdmaError::Register {
                        bytes: len,
                        detail: e.to_string(),
                        limit: match crate::host::inspect().memlock {
                            Some(Some(b)) => format!("{} KiB", b / 1024),
                            Some(None) => "unlimited".into(),
                            None => "unknown".into(),
                        },
                    })?
            };
            mrs.push((mr, ptr.as_ptr() as u64));
        }
        Ok(RegisteredMemory {
            mrs,
            _memory: memory.clone(),
        })
    }
}

impl RdmaDevice {
    /// Allocates a type-2 memory window (unbound: grants nothing until bound).
    pub fn alloc_window(&self) -> Result<MemoryWindow, RdmaError> {
        // SAFETY: the PD pointer is valid while `self.pd` lives; the window keeps that Arc.
        let raw = unsafe {
            rdma_mummy_sys::ibv_alloc_mw(
                self.pd.pd().as_ptr(),
                rdma_mummy_sys::ibv_mw_type::IBV_MW_TYPE_2,
            )
        };
        let mw = NonNull::new(raw).ok_or(RdmaError::Verbs {
            call: "ibv_alloc_mw",
            detail: "type-2 memory windows unavailable".into(),
        })?;
        Ok(MemoryWindow {
            mw,
            rkey: 0,
            binds: 0,
            _pd: Arc::clone(&self.pd),
        })
    }
}

/// A type-2 memory window: remote write access to exactly the range it is bound over, until
/// it is invalidated. Holds its protection domain, so it is freed before it.
///
/// An invalidated window may be bound again: each bind takes the next key (the low 8 bits of
/// the rkey), so the rkeys of its earlier bindings stay dead. The key repeats after 256 binds,
/// so a window is bound at most [`MemoryWindow::MAX_BINDS`] times and then deallocated.
pub struct MemoryWindow {
    pub(super) mw: NonNull<rdma_mummy_sys::ibv_mw>,
    /// The rkey of the current binding (0 before the first bind).
    pub rkey: u32,
    /// Binds posted over this window's life.
    pub(super) binds: u32,
    _pd: Arc<ProtectionDomain>,
}

impl MemoryWindow {
    /// Binds of one window over its life: fewer than the 256 keys of an rkey's low byte, so
    /// no rkey of an earlier binding of the window ever becomes valid again.
    pub const MAX_BINDS: u32 = 255;

    /// Whether the window may be bound again once invalidated (it has keys left).
    pub fn reusable(&self) -> bool {
        self.binds < Self::MAX_BINDS
    }

    /// The rkey the device holds for this window now: the last one bound, or the one it was
    /// allocated with.
    pub(super) fn current_rkey(&self) -> u32 {
        if self.rkey != 0 {
            self.rkey
        } else {
            // SAFETY: `mw` is a live window from ibv_alloc_mw; its rkey field is plain data.
            unsafe { self.mw.as_ref().rkey }
        }
    }
}

// SAFETY: an `ibv_mw` is a handle libibverbs lets any thread use (its verbs are thread-safe);
// the window is owned by one value, which may move to another thread (the connection's task
// can be moved between tokio workers); it is never shared.
unsafe impl Send for MemoryWindow {}

impl Drop for MemoryWindow {
    fn drop(&mut self) {
        // SAFETY: allocated by ibv_alloc_mw and freed once, before its PD (held by `_pd`).
        unsafe { rdma_mummy_sys::ibv_dealloc_mw(self.mw.as_ptr()) };
    }
}

/// The buffers of a [`KvMemory`] registered with a device.
pub struct RegisteredMemory {
    // Declared first so the regions are deregistered before the memory can be freed.
    mrs: Vec<(Arc<MemoryRegion>, u64)>,
    _memory: Arc<KvMemory>,
}

impl RegisteredMemory {
    /// Local key of buffer `b`.
    pub fn lkey(&self, b: usize) -> u32 {
        self.mrs[b].0.lkey()
    }

    /// Remote key of buffer `b` (the whole region's: see the module docs on memory windows).
    pub fn rkey(&self, b: usize) -> u32 {
        self.mrs[b].0.rkey()
    }

    /// Virtual address of byte `offset` of buffer `b`.
    pub fn addr(&self, b: usize, offset: u64) -> u64 {
        self.mrs[b].1 + offset
    }

    /// The NUMA node holding the first page of every buffer, where the kernel says so and
    /// they agree (`get_mempolicy(MPOL_F_NODE | MPOL_F_ADDR)`; registered pages are
    /// resident). `None` for memory the kernel cannot place (device memory) or buffers on
    /// different nodes.
    pub fn numa_node(&self) -> Option<u32> {
        const MPOL_F_NODE: libc::c_ulong = 1;
        const MPOL_F_ADDR: libc::c_ulong = 2;
        let mut nodes = self.mrs.iter().map(|(_, addr)| {
            let mut node: libc::c_int = -1;
            // SAFETY: get_mempolicy with MPOL_F_ADDR only reads the policy of the page at
            // `addr` (registered, so mapped and resident, for as long as `self`) and writes
            // one int to `node`; no nodemask is passed (null, maxnode 0).
            let rc = unsafe {
                libc::syscall(
                    libc::SYS_get_mempolicy,
                    &mut node as *mut libc::c_int,
                    std::ptr::null_mut::<libc::c_ulong>(),
                    0 as libc::c_ulong,
                    *addr as *const libc::c_void,
                    MPOL_F_NODE | MPOL_F_ADDR,
                )
            };
            (rc == 0)
                .then_some(node)
                .and_then(|n| u32::try_from(n).ok())
        });
        let first = nodes.next()??;
        nodes.all(|n| n == Some(first)).then_some(first)
    }

    pub(super) fn mr_ptr(&self, b: usize) -> *mut rdma_mummy_sys::ibv_mr {
        // SAFETY: the MR lives as long as `self`; the pointer is only passed to a bind.
        unsafe { self.mrs[b].0.mr().as_ptr() }
    }
}
