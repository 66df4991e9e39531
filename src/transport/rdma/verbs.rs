//! The verbs the RDMA ring needs, as a trait: exactly those, so that an in-memory fake
//! (`super::fake`) can stand in for a NIC in the tests and `sideway` (`hca`, cargo
//! feature `rdma`) drives real hardware with the same ring.
//!
//! The operations are the InfiniBand Architecture Specification's (volume 1, chapter 11, as
//! rdma-core's libibverbs exposes them): register memory (`ibv_reg_mr`), post an RDMA WRITE
//! with immediate (`IBV_WR_RDMA_WRITE_WITH_IMM`) and receives (`ibv_post_recv`), poll the
//! completion queue (`ibv_poll_cq`), and bring a reliable-connected (RC) queue pair to
//! ready-to-send with the peer's address (`ibv_modify_qp`). What RC guarantees and the ring
//! relies on: writes arrive and complete in the order they were posted, each WRITE_WITH_IMM
//! consumes one posted receive at the target and completes there with its immediate after its
//! bytes are in place, and an error puts the queue pair in the error state, flushing every
//! outstanding request with an error completion.

use std::io;
use std::os::fd::RawFd;

/// One RDMA WRITE with immediate: `imm`, and `len` bytes at `offset` in `local` to
/// `remote_offset` in `remote`. `len` may be 0: then only the immediate travels.
#[derive(Debug, Clone, Copy)]
pub struct WriteImm<'a> {
    /// The registered memory the bytes come from.
    pub local: &'a Region,
    /// Where in `local` they start.
    pub offset: usize,
    /// How many (0: the immediate alone).
    pub len: usize,
    /// The peer's memory they go to.
    pub remote: &'a RemoteRegion,
    /// Where in `remote` they land.
    pub remote_offset: usize,
    /// The 32-bit immediate the receiver's completion carries.
    pub imm: u32,
}

/// A registered memory region: its address and keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// First byte (a virtual address for host memory).
    pub addr: u64,
    /// Length in bytes.
    pub len: usize,
    /// Key for local access (in work requests of this endpoint).
    pub lkey: u32,
    /// Key the peer names in RDMA writes into this region.
    pub rkey: u32,
}

impl Region {
    /// True when `addr..addr + len` lies inside this region.
    pub fn contains(&self, addr: u64, len: usize) -> bool {
        addr >= self.addr
            && addr.checked_add(len as u64).is_some_and(|end| end <= self.addr + self.len as u64)
    }
}

/// A peer's region as the peer described it: where RDMA writes go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteRegion {
    /// First byte.
    pub addr: u64,
    /// Length in bytes.
    pub len: usize,
    /// The peer's remote key.
    pub rkey: u32,
}

/// What a queue pair's peer needs to connect to it (exchanged before connecting).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QpInfo {
    /// Queue pair number.
    pub qpn: u32,
    /// First packet sequence number.
    pub psn: u32,
    /// Local identifier (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Global identifier of the port at `TOROID_IB_GID_INDEX` (RoCE, or routed InfiniBand).
    pub gid: [u8; 16],
    /// Path MTU as the verbs enum (1 = 256 bytes ... 5 = 4096 bytes).
    pub mtu: u8,
}

/// What a completion completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcOp {
    /// An RDMA WRITE this endpoint posted.
    Write,
    /// A posted receive, consumed by the peer's WRITE_WITH_IMM: its immediate and byte count.
    RecvImm {
        /// The immediate data.
        imm: u32,
        /// Bytes written into this endpoint's memory.
        len: u32,
    },
}

/// One work completion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// The work request's id, as posted.
    pub wr_id: u64,
    /// What completed (meaningless when `status` is an error: flushed receives say `Write`).
    pub op: WcOp,
    /// `Err` with the status's name (`ibv_wc_status_str`) when it failed.
    pub status: Result<(), String>,
}

/// One endpoint of one RC queue pair, with its protection domain and completion queue.
pub trait Verbs: Send + std::fmt::Debug {
    /// Registers `len` bytes at `ptr` for local access and remote writes.
    ///
    /// # Safety
    ///
    /// The memory must stay allocated until [`Verbs::deregister`] of the returned region, or
    /// until this endpoint is dropped: the device (or the peer, through the fake) may write it
    /// at any time until then.
    unsafe fn register(&mut self, ptr: *mut u8, len: usize) -> io::Result<Region>;

    /// Releases a registration: the device no longer touches the memory when this returns.
    fn deregister(&mut self, region: &Region);

    /// This endpoint's queue pair, for the peer's [`Verbs::connect`].
    fn local_qp(&self) -> QpInfo;

    /// Brings the queue pair to ready-to-send towards the peer described by `peer`.
    fn connect(&mut self, peer: &QpInfo) -> io::Result<()>;

    /// Posts `w` (signalled: it completes here as [`WcOp::Write`], with `wr_id`). Fails
    /// (without posting) when the send queue is full or the queue pair is not ready.
    fn post_write_imm(&mut self, wr_id: u64, w: WriteImm<'_>) -> io::Result<()>;

    /// Posts a receive (no buffer: it only takes a WRITE_WITH_IMM's immediate).
    fn post_recv(&mut self, wr_id: u64) -> io::Result<()>;

    /// Appends the completions there now (never waits).
    fn poll(&mut self, out: &mut Vec<Completion>) -> io::Result<()>;

    /// A descriptor that becomes readable when a completion arrives after
    /// [`Verbs::arm_notify`] (a completion channel: `ibv_create_comp_channel`), so that a
    /// waiting rank sleeps in `poll(2)` instead of polling the completion queue.
    fn notify_fd(&self) -> RawFd;

    /// Consumes the notifications delivered so far and asks for one at the next completion
    /// (`ibv_get_cq_event`, `ibv_ack_cq_events`, `ibv_req_notify_cq`). A completion queued
    /// before this call may not notify: poll once after arming, then sleep.
    fn arm_notify(&mut self) -> io::Result<()>;
}

/// Registrations made once and reused: a buffer inside a cached region needs no new
/// registration (pinning memory with `ibv_reg_mr` takes tens of microseconds per megabyte).
/// For buffers that outlive many operations: staging rings, and device memory (GPUDirect)
/// where the driver allows registering it.
// Not used by the ring yet (its stages are registered once each); GPUDirect will use it.
#[cfg_attr(not(test), allow(dead_code))]
#[derive(Debug, Default)]
pub struct MrCache {
    regions: Vec<Region>,
}

// Not used by the ring yet (its stages are registered once each); GPUDirect will use it.
#[cfg_attr(not(test), allow(dead_code))]
impl MrCache {
    /// An empty cache.
    pub fn new() -> MrCache {
        MrCache::default()
    }

    /// The cached region holding `ptr..ptr + len`, registered now when none does.
    ///
    /// # Safety
    ///
    /// As [`Verbs::register`]: the memory stays allocated until [`MrCache::evict`] of it or
    /// [`MrCache::clear`] (with the same endpoint).
    pub unsafe fn get<V: Verbs + ?Sized>(
        &mut self,
        verbs: &mut V,
        ptr: *mut u8,
        len: usize,
    ) -> io::Result<Region> {
        if let Some(r) = self.regions.iter().find(|r| r.contains(ptr as u64, len)) {
            return Ok(*r);
        }
        // SAFETY: the caller's contract is register's.
        let r = unsafe { verbs.register(ptr, len) }?;
        self.regions.push(r);
        Ok(r)
    }

    /// Deregisters every cached region overlapping `ptr..ptr + len` (before that memory is
    /// freed).
    pub fn evict<V: Verbs + ?Sized>(&mut self, verbs: &mut V, ptr: *mut u8, len: usize) {
        let (start, end) = (ptr as u64, ptr as u64 + len as u64);
        self.regions.retain(|r| {
            let overlaps = r.addr < end && start < r.addr + r.len as u64;
            if overlaps {
                verbs.deregister(r);
            }
            !overlaps
        });
    }

    /// Deregisters everything.
    pub fn clear<V: Verbs + ?Sized>(&mut self, verbs: &mut V) {
        for r in self.regions.drain(..) {
            verbs.deregister(&r);
        }
    }

    /// Cached regions.
    pub fn len(&self) -> usize {
        self.regions.len()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.regions.is_empty()
    }
}
