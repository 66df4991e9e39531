//! The verbs on a real RDMA device, through `sideway` (cargo feature `rdma`).
//!
//! `sideway` calls libibverbs through rdma-core-mummy, a small static shim whose functions look
//! the real ones up with `dlopen("libibverbs.so.1")` when libtoroid loads, and answer
//! `EOPNOTSUPP` when it is missing: libibverbs is never a load-time dependency (a test loads
//! libtoroid with it hidden). Some calls are inline functions of the headers that jump through
//! the device context's function table, so nothing of sideway runs before [`probe`] has seen
//! libibverbs load and a device open; and sideway panics in places (failed asserts in drops,
//! `expect`s), so every call into it runs behind [`guard`], as `gpu::guard` does for cudarc.
//!
//! Device and port: `TOROID_IB_HCA` (`name` or `name:port`), else the first device, port 1;
//! the GID at `TOROID_IB_GID_INDEX` addresses RoCE ports (and InfiniBand ones across subnets).
//! One [`HcaVerbs`] is one RC queue pair with its own completion queue, which reports to its
//! own completion channel (whose descriptor a waiting rank sleeps on), and memory regions
//! registered once per buffer and kept until deregistered. The device context and protection
//! domain are shared by every queue pair of the process: a rank linked to hundreds of peers
//! opens its device once (the last queue pair to go closes it).
//!
//! GPUDirect RDMA: [`HcaVerbs::register`] accepts any address `ibv_reg_mr` accepts, device
//! memory included where the driver allows it (NVIDIA's `nvidia-peermem` module loaded); where
//! it does not, registration fails with the driver's error and the caller stages through host
//! memory. Never run: there was no RDMA hardware to run any of this on.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, OnceLock};

use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{
    CompletionChannel, CompletionQueue, ExtendedCompletionQueue, GenericCompletionQueue, WorkCompletionStatus,
};
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, Mtu, PortState};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    ExtendedQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState, SetInlineData,
    SetScatterGatherEntry, WorkRequestFlags,
};

use super::verbs::{Completion, QpInfo, Region, Verbs, WcOp, WriteImm};
use crate::config::Config;
use crate::error::{Error, Result};

/// The library rdma-core-mummy opens.
pub const LIBIBVERBS: &str = "libibverbs.so.1";

/// Runs `f`, a call into sideway, turning a panic into [`Error::Unsupported`] naming `what`.
pub fn guard<T>(what: &str, f: impl FnOnce() -> T) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| {
        let msg = crate::error::panic_message(&*p).unwrap_or("a panic");
        Error::Unsupported(format!("{what}: RDMA verbs failed: {msg}").into())
    })
}

/// The device and port to use, from `TOROID_IB_HCA` (`name` or `name:port`).
fn parse_hca(hca: Option<&str>) -> Result<(Option<String>, u8)> {
    let Some(s) = hca else { return Ok((None, 1)) };
    match s.split_once(':') {
        None => Ok((Some(s.to_string()), 1)),
        Some((name, port)) => match port.parse::<u8>() {
            Ok(p @ 1..) => Ok((Some(name.to_string()), p)),
            _ => Err(Error::InvalidArgument(format!("TOROID_IB_HCA={s}: the port must be 1 to 255").into())),
        },
    }
}

/// An opened device: its context, protection domain and port.
struct Device {
    ctx: Arc<DeviceContext>,
    pd: Arc<ProtectionDomain>,
    name: String,
    port: u8,
}

/// Opens the device `TOROID_IB_HCA` names (else the first) after checking that libibverbs
/// loads; `Err(Unsupported)` says why RDMA cannot be used here.
fn open_device(hca: Option<&str>) -> Result<Device> {
    let (want, port) = parse_hca(hca)?;
    crate::sys::dl::load(LIBIBVERBS).map_err(|e| {
        Error::Unsupported(format!("RDMA is not available: {LIBIBVERBS} cannot be loaded ({e})").into())
    })?;
    guard("opening the RDMA device", || {
        let list = DeviceList::new()
            .map_err(|e| Error::Unsupported(format!("RDMA is not available: no device list ({e})").into()))?;
        let names: Vec<String> = list.iter().map(|d| d.name()).collect();
        let dev = match &want {
            Some(w) => list.iter().find(|d| &d.name() == w),
            None => list.iter().next(),
        };
        let Some(dev) = dev else {
            let what =
                want.as_deref().map_or("no RDMA device".to_string(), |w| format!("no RDMA device {w}"));
            return Err(Error::Unsupported(
                format!("RDMA is not available: {what} (found: {names:?})").into(),
            ));
        };
        let name = dev.name();
        let ctx = dev
            .open()
            .map_err(|e| Error::Unsupported(format!("RDMA is not available: opening {name}: {e}").into()))?;
        let attr = ctx.query_port(port).map_err(|e| {
            Error::Unsupported(format!("RDMA is not available: {name} port {port}: {e}").into())
        })?;
        if attr.port_state() != PortState::Active {
            return Err(Error::Unsupported(
                format!("RDMA is not available: {name} port {port} is {:?}, not active", attr.port_state())
                    .into(),
            ));
        }
        let pd = ctx
            .alloc_pd()
            .map_err(|e| Error::Unsupported(format!("RDMA: {name}: no protection domain: {e}").into()))?;
        Ok(Device { ctx, pd, name, port })
    })?
}

/// The device `hca` names, opened once per process while any queue pair uses it.
fn shared_device(hca: Option<&str>) -> Result<Arc<Device>> {
    type Open = Option<(Option<String>, std::sync::Weak<Device>)>;
    static OPEN: std::sync::Mutex<Open> = std::sync::Mutex::new(None);
    let mut open = OPEN.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((name, weak)) = open.as_ref()
        && name.as_deref() == hca
        && let Some(dev) = weak.upgrade()
    {
        return Ok(dev);
    }
    let dev = Arc::new(open_device(hca)?);
    *open = Some((hca.map(str::to_string), Arc::downgrade(&dev)));
    Ok(dev)
}

/// Whether this process can use RDMA: libibverbs loads and the device (`TOROID_IB_HCA`, else
/// the first) has an active port. Checked once per process; `Err(Unsupported)` says why not.
pub fn probe(cfg: &Config) -> Result<String> {
    static PROBE: OnceLock<std::result::Result<String, String>> = OnceLock::new();
    PROBE
        .get_or_init(|| match open_device(cfg.ib_hca.as_deref()) {
            Ok(d) => {
                let what = format!("{} port {}", d.name, d.port);
                // sideway asserts in its drops: closing runs behind the guard too.
                let _ = guard("closing the RDMA device", move || drop(d));
                Ok(what)
            }
            Err(e) => Err(e.to_string()),
        })
        .clone()
        .map_err(|e| Error::Unsupported(e.into()))
}

/// False when no RDMA device can be used here (the communicator then keeps TCP between hosts
/// and says why, once, at INFO).
pub fn can_connect(cfg: &Config) -> bool {
    match probe(cfg) {
        Ok(dev) => {
            tracing::info!(target: "toroid::net", "RDMA device {dev} available: RDMA between hosts");
            true
        }
        Err(e) => {
            tracing::info!(target: "toroid::net", "{e}; TCP between hosts");
            false
        }
    }
}

/// One RC queue pair on a device, with its completion queue and registrations. The sideway
/// objects are released in [`Drop`] behind the panic guard (sideway asserts in its drops), the
/// queue pair before the registrations and the completion queue it uses.
pub struct HcaVerbs {
    qp: std::mem::ManuallyDrop<ExtendedQueuePair>,
    mrs: std::mem::ManuallyDrop<HashMap<u32, Arc<MemoryRegion>>>,
    cq: std::mem::ManuallyDrop<Arc<ExtendedCompletionQueue>>,
    channel: std::mem::ManuallyDrop<Arc<CompletionChannel>>,
    dev: std::mem::ManuallyDrop<Arc<Device>>,
    gid_index: u32,
    local: QpInfo,
}

impl std::fmt::Debug for HcaVerbs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HcaVerbs").field("device", &self.dev.name).field("qp", &self.local).finish()
    }
}

fn mtu_code(m: Mtu) -> u8 {
    match m {
        Mtu::Mtu256 => 1,
        Mtu::Mtu512 => 2,
        Mtu::Mtu1024 => 3,
        Mtu::Mtu2048 => 4,
        Mtu::Mtu4096 => 5,
    }
}

fn mtu_of(code: u8) -> Mtu {
    match code {
        1 => Mtu::Mtu256,
        2 => Mtu::Mtu512,
        3 => Mtu::Mtu1024,
        4 => Mtu::Mtu2048,
        _ => Mtu::Mtu4096,
    }
}

fn io_err(what: &str, e: impl std::fmt::Display) -> io::Error {
    io::Error::other(format!("{what}: {e}"))
}

fn guard_io<T>(what: &str, f: impl FnOnce() -> io::Result<T>) -> io::Result<T> {
    guard(what, f).map_err(|e| io_err(what, e))?
}

impl HcaVerbs {
    /// A queue pair in the INIT state on the configured device, with room for `send_depth`
    /// and `recv_depth` outstanding requests.
    pub fn open(cfg: &Config, send_depth: usize, recv_depth: usize) -> Result<HcaVerbs> {
        let dev = shared_device(cfg.ib_hca.as_deref())?;
        let gid_index = cfg.ib_gid_index;
        let made = guard("creating an RDMA queue pair", || {
            let sys = |what: &str, e: &dyn std::fmt::Display| {
                Error::System(format!("RDMA: {}: {what}: {e}", dev.name).into())
            };
            let depth = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
            let channel = CompletionChannel::new(&dev.ctx).map_err(|e| sys("completion channel", &e))?;
            channel.set_nonblocking(true).map_err(|e| sys("completion channel", &e))?;
            let cq = dev
                .ctx
                .create_cq_builder()
                .setup_cqe(depth(send_depth + recv_depth))
                .setup_comp_channel(&channel, 0)
                .build_ex()
                .map_err(|e| sys("completion queue", &e))?;
            let handle = GenericCompletionQueue::from(Arc::clone(&cq));
            let mut qp = dev
                .pd
                .create_qp_builder()
                .setup_max_inline_data(64)
                .setup_send_cq(handle.clone())
                .setup_recv_cq(handle)
                .setup_max_send_wr(depth(send_depth))
                .setup_max_recv_wr(depth(recv_depth))
                .build_ex()
                .map_err(|e| sys("queue pair", &e))?;
            let mut attr = QueuePairAttribute::new();
            attr.setup_state(QueuePairState::Init)
                .setup_pkey_index(0)
                .setup_port(dev.port)
                .setup_access_flags(AccessFlags::LocalWrite | AccessFlags::RemoteWrite);
            qp.modify(&attr).map_err(|e| sys("queue pair to INIT", &e))?;
            let port = dev.ctx.query_port(dev.port).map_err(|e| sys("port", &e))?;
            let gid =
                dev.ctx.query_gid(dev.port, gid_index).map_err(|e| sys(&format!("GID {gid_index}"), &e))?;
            let local = QpInfo {
                qpn: qp.qp_number(),
                psn: (crate::sys::random::id() & 0xFF_FFFF) as u32,
                lid: port.lid(),
                gid: gid.raw,
                mtu: mtu_code(port.active_mtu()),
            };
            Ok((qp, cq, channel, local))
        });
        match made {
            Ok(Ok((qp, cq, channel, local))) => Ok(HcaVerbs {
                qp: std::mem::ManuallyDrop::new(qp),
                mrs: std::mem::ManuallyDrop::new(HashMap::new()),
                cq: std::mem::ManuallyDrop::new(cq),
                channel: std::mem::ManuallyDrop::new(channel),
                dev: std::mem::ManuallyDrop::new(dev),
                gid_index,
                local,
            }),
            Ok(Err(e)) | Err(e) => {
                let _ = guard("closing the RDMA device", || drop(dev));
                Err(e)
            }
        }
    }
}

impl Drop for HcaVerbs {
    fn drop(&mut self) {
        // SAFETY: each field is taken exactly once, here, and never used again.
        let (qp, mrs, cq, channel, dev) = unsafe {
            (
                std::mem::ManuallyDrop::take(&mut self.qp),
                std::mem::ManuallyDrop::take(&mut self.mrs),
                std::mem::ManuallyDrop::take(&mut self.cq),
                std::mem::ManuallyDrop::take(&mut self.channel),
                std::mem::ManuallyDrop::take(&mut self.dev),
            )
        };
        let _ = guard("closing the RDMA queue pair", move || {
            drop(qp);
            drop(mrs);
            drop(cq);
            drop(channel);
            drop(dev);
        });
    }
}

impl Verbs for HcaVerbs {
    unsafe fn register(&mut self, ptr: *mut u8, len: usize) -> io::Result<Region> {
        let pd = Arc::clone(&self.dev.pd);
        let mr = guard_io("registering memory", || {
            // SAFETY: the caller keeps `ptr..ptr + len` allocated until it deregisters it
            // (this trait's contract).
            unsafe { pd.reg_mr(ptr as usize, len, AccessFlags::LocalWrite | AccessFlags::RemoteWrite) }
                .map_err(|e| io_err("ibv_reg_mr", e))
        })?;
        let r = Region { addr: ptr as u64, len, lkey: mr.lkey(), rkey: mr.rkey() };
        self.mrs.insert(r.lkey, mr);
        Ok(r)
    }

    fn deregister(&mut self, region: &Region) {
        if let Some(mr) = self.mrs.remove(&region.lkey) {
            // Dropping the last reference deregisters (`ibv_dereg_mr`).
            let _ = guard("deregistering memory", || drop(mr));
        }
    }

    fn local_qp(&self) -> QpInfo {
        self.local
    }

    fn connect(&mut self, peer: &QpInfo) -> io::Result<()> {
        let (port, gid_index, local) = (self.dev.port, self.gid_index, self.local);
        let qp = &mut self.qp;
        guard_io("connecting the queue pair", || {
            let mut attr = QueuePairAttribute::new();
            attr.setup_state(QueuePairState::ReadyToReceive)
                .setup_path_mtu(mtu_of(peer.mtu.min(local.mtu)))
                .setup_dest_qp_num(peer.qpn)
                .setup_rq_psn(peer.psn)
                .setup_max_dest_read_atomic(0)
                .setup_min_rnr_timer(12);
            let mut ah = AddressHandleAttribute::new();
            ah.setup_dest_lid(peer.lid).setup_port(port).setup_service_level(0);
            if peer.gid != [0; 16] {
                let gid_index = u8::try_from(gid_index).unwrap_or(0);
                ah.setup_grh_src_gid_index(gid_index)
                    .setup_grh_dest_gid(&Gid { raw: peer.gid })
                    .setup_grh_hop_limit(64);
            }
            attr.setup_address_vector(&ah);
            qp.modify(&attr).map_err(|e| io_err("queue pair to RTR", e))?;
            let mut attr = QueuePairAttribute::new();
            attr.setup_state(QueuePairState::ReadyToSend)
                .setup_sq_psn(local.psn)
                .setup_timeout(14)
                .setup_retry_cnt(7)
                .setup_rnr_retry(7)
                .setup_max_read_atomic(0);
            qp.modify(&attr).map_err(|e| io_err("queue pair to RTS", e))
        })
    }

    fn post_write_imm(&mut self, wr_id: u64, w: WriteImm<'_>) -> io::Result<()> {
        let WriteImm { local, offset, len, remote, remote_offset, imm } = w;
        if offset.checked_add(len).is_none_or(|end| end > local.len)
            || remote_offset.checked_add(len).is_none_or(|end| end > remote.len)
        {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "RDMA write outside its regions"));
        }
        let length = u32::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        let qp = &mut self.qp;
        guard_io("posting an RDMA write", || {
            let mut post = qp.start_post_send();
            // The immediate is big-endian on the wire (`__be32` in the verbs API).
            let wr = post.construct_wr(wr_id, WorkRequestFlags::Signaled).setup_write_imm(
                remote.rkey,
                remote.addr + remote_offset as u64,
                imm.to_be(),
            );
            if len == 0 {
                // No scatter entry at all: a zero-length one means 2 GiB to some devices.
                wr.setup_inline_data(&[]);
            } else {
                // SAFETY: `offset..offset + len` is inside `local` (checked above), a region
                // registered here whose memory the ring keeps until the write completes.
                unsafe { wr.setup_sge(local.lkey, local.addr + offset as u64, length) };
            }
            post.post().map_err(|e| io_err("ibv_wr_complete", e))
        })
    }

    fn post_recv(&mut self, wr_id: u64) -> io::Result<()> {
        let qp = &mut self.qp;
        guard_io("posting a receive", || {
            let mut post = qp.start_post_recv();
            let _ = post.construct_wr(wr_id);
            post.post().map_err(|e| io_err("ibv_post_recv", e))
        })
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> io::Result<()> {
        let cq = Arc::clone(&self.cq);
        guard_io("polling the completion queue", || {
            // An empty queue is an `Err` from `start_poll` (ENOENT): nothing to add.
            let Ok(mut poller) = cq.start_poll() else { return Ok(()) };
            for wc in &mut poller {
                let status = match WorkCompletionStatus::from(wc.status()) {
                    WorkCompletionStatus::Success => Ok(()),
                    s => Err(format!("{s:?} (vendor error 0x{:x})", wc.vendor_err())),
                };
                // A receive completes as RECV_RDMA_WITH_IMM; anything else is our write.
                let op = if wc.opcode()
                    == sideway::ibverbs::completion::WorkCompletionOperationType::ReceiveWithImmediate as u32
                {
                    WcOp::RecvImm { imm: u32::from_be(wc.imm_data()), len: wc.byte_len() }
                } else {
                    WcOp::Write
                };
                out.push(Completion { wr_id: wc.wr_id(), op, status });
            }
            Ok(())
        })
    }

    fn notify_fd(&self) -> RawFd {
        self.channel.as_raw_fd()
    }

    fn arm_notify(&mut self) -> io::Result<()> {
        let (cq, channel) = (Arc::clone(&self.cq), Arc::clone(&self.channel));
        guard_io("arming the completion channel", || {
            use rdma_mummy_sys::{ibv_ack_cq_events, ibv_get_cq_event, ibv_req_notify_cq};
            // SAFETY: `cq` and `channel` are live (held by the Arcs above for the whole block);
            // an extended completion queue begins with the basic one (rdma-core's
            // `ibv_cq_ex_to_cq` is this cast, as sideway's `cq()` does).
            let (cq, ch) = unsafe { (cq.cq().as_ptr(), channel.comp_channel().as_ptr()) };
            let mut events = 0u32;
            loop {
                let (mut from, mut ctx) = (std::ptr::null_mut(), std::ptr::null_mut());
                // SAFETY: `ch` is a live channel; the out-pointers are valid locals. The
                // channel's descriptor is non-blocking: with no event it fails with EAGAIN.
                if unsafe { ibv_get_cq_event(ch, &mut from, &mut ctx) } != 0 {
                    break;
                }
                events += 1;
            }
            if events > 0 {
                // SAFETY: acknowledges the events just taken from this queue's channel.
                unsafe { ibv_ack_cq_events(cq, events) };
            }
            // SAFETY: `cq` is a live completion queue of an open device context.
            match unsafe { ibv_req_notify_cq(cq, 0) } {
                0 => Ok(()),
                e => Err(io_err("ibv_req_notify_cq", io::Error::from_raw_os_error(e))),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_device_setting_names_a_device_and_a_port() {
        assert_eq!(parse_hca(None).expect("unset"), (None, 1));
        assert_eq!(parse_hca(Some("mlx5_0")).expect("name"), (Some("mlx5_0".into()), 1));
        assert_eq!(parse_hca(Some("mlx5_1:2")).expect("port"), (Some("mlx5_1".into()), 2));
        assert!(parse_hca(Some("mlx5_1:0")).is_err() && parse_hca(Some("mlx5_1:x")).is_err());
        for m in [Mtu::Mtu256, Mtu::Mtu512, Mtu::Mtu1024, Mtu::Mtu2048, Mtu::Mtu4096] {
            assert_eq!(mtu_of(mtu_code(m)), m);
        }
    }

    #[test]
    fn without_a_device_rdma_is_unsupported_and_can_connect_is_false() {
        // This machine has no RDMA device (CI's neither); where one exists, it must open.
        let cfg = Config::default();
        match probe(&cfg) {
            Ok(dev) => assert!(can_connect(&cfg), "{dev}"),
            Err(e) => {
                assert!(
                    matches!(e, Error::Unsupported(_)) && e.to_string().contains("RDMA is not available"),
                    "{e}"
                );
                assert!(!can_connect(&cfg));
                let e = HcaVerbs::open(&cfg, 4, 4).expect_err("no device");
                assert!(matches!(e, Error::Unsupported(_)), "{e}");
            }
        }
    }
}
