//! Argument checks, for every caller: pure functions of the call, the rank and the size (so
//! they are tested here without sockets). One call description, [`Call`], whose buffers are
//! host memory ([`Buffers::Host`]: the Rust API, the queue, the C ABI) or device memory
//! ([`Buffers::Device`]: the stream entry points, through `gpu::host_comm::HostComm::check`), and
//! one check, [`check`]: what both memories share is checked once (the reduce op for the type,
//! the root or peer, the wire type), then what is particular to each. [`validate`] and
//! [`check_device`] are its two entries, so every caller reports the same errors for the same
//! condition and the GPU path checks nothing itself.

use std::sync::Arc;

use super::RawOp;
use crate::collective::{Algorithm, CallOptions, OpKind};
use crate::dtype::DataType;
use crate::error::{Error, Result};
#[cfg(feature = "cuda")]
use crate::gpu::host_comm::DeviceCall;
use crate::memory::RawBufs;
use crate::tuning;

/// The buffers of a [`Call`]: host memory (as the operation will run on it) or device memory
/// (addresses, as the C entry points take them).
#[derive(Clone, Copy)]
pub(crate) enum Buffers<'a> {
    /// Host memory: the operation's byte buffers.
    Host(&'a RawBufs),
    /// Device memory: `count` elements (per rank, as [`DeviceCall`] says) from `send` into
    /// `recv`.
    #[cfg(feature = "cuda")]
    Device {
        /// Elements (per rank).
        count: usize,
        /// The input's device address.
        send: u64,
        /// The output's device address.
        recv: u64,
    },
}

/// One call to check, whatever memory its buffers are in (borrowed: nothing is allocated).
#[derive(Clone, Copy)]
pub(crate) struct Call<'a> {
    /// What to do.
    pub kind: OpKind,
    /// Element type.
    pub dtype: DataType,
    /// Its buffers.
    pub buffers: Buffers<'a>,
    /// Its options.
    pub opts: CallOptions,
    /// An all-to-all-v's block offsets (`RawOp::splits`).
    pub splits: Option<&'a [usize]>,
}

impl<'a> Call<'a> {
    /// The call `op` describes (host memory).
    pub(crate) fn host(op: &'a RawOp) -> Call<'a> {
        let splits = op.splits.as_deref();
        Call { kind: op.kind, dtype: op.dtype, buffers: Buffers::Host(&op.bufs), opts: op.opts, splits }
    }

    /// The call `call` describes (device memory, default options).
    #[cfg(feature = "cuda")]
    pub(crate) fn device(call: &DeviceCall) -> Call<'static> {
        let DeviceCall { kind, dtype, count, send, recv } = *call;
        let (buffers, opts) = (Buffers::Device { count, send, recv }, CallOptions::default());
        Call { kind, dtype, buffers, opts, splits: None }
    }
}

/// What a call that passed [`check`] needs to run.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Checked {
    /// On host memory.
    Host,
    /// On device memory, of the device with this ordinal.
    Device(usize),
    /// On device memory, with nothing to do (no elements): no device needed.
    Nothing,
}

/// A send or receive names another rank as its peer.
fn not_self(peer: usize, rank: usize) -> Result<()> {
    if peer == rank {
        return Err(Error::InvalidArgument(
            format!("rank {peer} cannot send to or receive from itself").into(),
        ));
    }
    Ok(())
}

/// `r`, a root or peer (`what`), is a rank of a communicator of `n` ranks.
fn rank_ok(what: &str, r: usize, n: usize) -> Result<()> {
    if r >= n {
        return Err(Error::InvalidArgument(
            format!("{what} {r} is not a rank of this communicator (size {n})").into(),
        ));
    }
    Ok(())
}

/// Checks everything about `call` that can be checked locally, before any byte moves or any
/// device is set up, for `rank` of a communicator of `size` ranks (`has_window`: `shm_direct`
/// can run): first what host and device memory share, then what is particular to the memory
/// its buffers are in.
pub(crate) fn check(call: &Call<'_>, rank: usize, size: usize, has_window: bool) -> Result<Checked> {
    common(call, rank, size)?;
    match call.buffers {
        Buffers::Host(bufs) => {
            host(call, bufs, rank, size, has_window)?;
            Ok(Checked::Host)
        }
        #[cfg(feature = "cuda")]
        Buffers::Device { count, send, recv } => device(call, count, send, recv, rank, size),
    }
}

/// The checks of every call, whatever its memory: the wire type, the reduce op for the type
/// (avg on floats only), the root or peer a rank of the communicator, and not this one.
fn common(call: &Call<'_>, rank: usize, n: usize) -> Result<()> {
    if let Some(w) = call.opts.wire
        && w != call.dtype
        && !matches!(w, DataType::BF16 | DataType::F16)
    {
        return Err(Error::InvalidArgument(
            format!("wire type {w}: a float all-reduce travels in bf16 or f16 (or its own type)").into(),
        ));
    }
    match call.kind {
        OpKind::AllReduce(rop) | OpKind::ReduceScatter(rop) => rop.check(call.dtype),
        OpKind::Reduce(rop, root) => {
            rop.check(call.dtype)?;
            rank_ok("root", root, n)
        }
        OpKind::Broadcast(root) => rank_ok("root", root, n),
        OpKind::Send(peer) | OpKind::Recv(peer) => {
            rank_ok("peer", peer, n)?;
            not_self(peer, rank)
        }
        OpKind::AllGather
        | OpKind::SplitExchange
        | OpKind::AllToAll
        | OpKind::AllToAllV
        | OpKind::Barrier
        | OpKind::Probe
        | OpKind::RecvAny => Ok(()),
        // (checked item by item: `validate`)
        OpKind::SendRecv => Err(Error::Internal("a batch of sends and receives checked as one call".into())),
    }
}

/// The checks of a call on host memory: the buffers' byte lengths (whole elements, split into
/// `n` pieces where the collective needs it, input and output agreeing, the in-place forms),
/// and a forced algorithm (able to run the collective; `shm_direct` only with a window).
fn host(call: &Call<'_>, bufs: &RawBufs, rank: usize, n: usize, has_window: bool) -> Result<()> {
    let dtype = call.dtype;
    let es = dtype.size();
    let (inp, out) = (bufs.input_len(), bufs.output_len());
    let whole = |what: &str, len: usize| -> Result<usize> {
        if !len.is_multiple_of(es) {
            return Err(Error::InvalidArgument(
                format!("{what} of {len} bytes is not a whole number of {dtype} elements").into(),
            ));
        }
        Ok(len / es)
    };
    let in_place = matches!(bufs, RawBufs::InPlace(_));
    match call.kind {
        OpKind::AllReduce(_) | OpKind::Reduce(..) => {
            whole("buffer", out.max(inp))?;
            if inp != out && !(matches!(call.kind, OpKind::Reduce(..)) && out == 0) {
                return Err(Error::InvalidArgument(
                    format!("input is {inp} bytes but output is {out}").into(),
                ));
            }
        }
        OpKind::ReduceScatter(_) => {
            let c = whole("input", inp)?;
            if c % n != 0 {
                return Err(Error::InvalidArgument(
                    format!("reduce_scatter input of {c} elements does not split into {n} equal pieces")
                        .into(),
                ));
            }
            if !in_place && out * n != inp {
                return Err(Error::InvalidArgument(
                    format!("reduce_scatter output is {out} bytes; expected input/size = {}", inp / n).into(),
                ));
            }
        }
        OpKind::AllGather | OpKind::SplitExchange => {
            let c = whole("output", out)?;
            if c % n != 0 {
                return Err(Error::InvalidArgument(
                    format!("all_gather output of {c} elements does not split into {n} equal pieces").into(),
                ));
            }
            if !in_place && inp * n != out {
                return Err(Error::InvalidArgument(
                    format!("all_gather output is {out} bytes; expected size x input = {}", inp * n).into(),
                ));
            }
        }
        OpKind::Broadcast(root) => {
            whole("buffer", out)?;
            if !in_place && inp != out && (rank == root || inp != 0) {
                return Err(Error::InvalidArgument(
                    format!("input is {inp} bytes but output is {out}").into(),
                ));
            }
        }
        OpKind::AllToAll => {
            let c = whole("buffer", out)?;
            if c % n != 0 || inp != out {
                return Err(Error::InvalidArgument(format!(
                    "all_to_all buffers must be equal and split into {n} blocks (input {inp}, output {out} bytes)"
                ).into()));
            }
        }
        OpKind::AllToAllV => all_to_all_v(call.splits, inp, out, in_place, es, rank, n)?,
        OpKind::Barrier => {}
        OpKind::Probe => {
            if out != crate::tuning::PROBE_LEN * 8 {
                return Err(Error::Internal("probe output has the wrong length".into()));
            }
        }
        OpKind::Send(_) | OpKind::Recv(_) => {
            whole("buffer", inp.max(out))?;
        }
        OpKind::SendRecv => {}
        OpKind::RecvAny => {
            if n < 2 {
                return Err(Error::InvalidUsage(
                    "receive from any source on a communicator of one rank: no rank can send".into(),
                ));
            }
            whole("buffer", out)?;
        }
    }
    if let Some(a) = call.opts.algorithm {
        tuning::check_forced(call.kind.coll(), a)?;
        if a == Algorithm::ShmDirect && !has_window {
            return Err(Error::InvalidArgument(
                "algorithm shm_direct needs every rank on one host with a shared-memory window \
                 (not available on this communicator: see TOROID_SHM_DISABLE and the WARN lines at set-up)"
                    .into(),
            ));
        }
    }
    Ok(())
}

/// An all-to-all-v's counts (elements of `es` bytes: one per rank to send, one per rank to
/// receive, `n` each) as its block offsets in bytes (`RawOp::splits`): the one conversion for
/// the Rust API and the C ABI, refused when a list has the wrong length or a total overflows.
pub(crate) fn split_offsets(send: &[usize], recv: &[usize], n: usize, es: usize) -> Result<Arc<[usize]>> {
    let mut offsets = Vec::with_capacity(2 * (n + 1));
    for (what, counts) in [("send_counts", send), ("recv_counts", recv)] {
        if counts.len() != n {
            return Err(Error::InvalidArgument(
                format!("all_to_all_v: {what} has {} entries for {n} ranks", counts.len()).into(),
            ));
        }
        let mut at = 0usize;
        offsets.push(0);
        for &c in counts {
            at = c
                .checked_mul(es)
                .and_then(|b| b.checked_add(at))
                .filter(|b| isize::try_from(*b).is_ok())
                .ok_or_else(|| {
                    Error::InvalidArgument(
                        format!("all_to_all_v: the {what} overflow the address space").into(),
                    )
                })?;
            offsets.push(at);
        }
    }
    Ok(offsets.into())
}

/// An all-to-all-v's blocks: `n + 1` byte offsets for the input's blocks, then as many for the
/// output's, each list from 0 to the buffer's length, never decreasing, on whole elements; this
/// rank's own block the same size in both; out of place.
fn all_to_all_v(
    splits: Option<&[usize]>,
    inp: usize,
    out: usize,
    in_place: bool,
    es: usize,
    rank: usize,
    n: usize,
) -> Result<()> {
    let bad = |why: String| Err(Error::InvalidArgument(format!("all_to_all_v: {why}").into()));
    if in_place {
        return bad("has no in-place form (give an input and an output)".into());
    }
    let Some(splits) = splits.filter(|s| s.len() == 2 * (n + 1)) else {
        return Err(Error::InvalidUsage(
            "all_to_all_v without its counts (Communicator::all_to_all_v, toroid_all_to_all_v)".into(),
        ));
    };
    let (send, recv) = splits.split_at(n + 1);
    for (what, offsets, len) in [("input", send, inp), ("output", recv, out)] {
        if offsets[0] != 0 || offsets[n] != len || offsets.windows(2).any(|w| w[0] > w[1]) {
            return bad(format!("the {what}'s counts add up to {} bytes, not its {len}", offsets[n]));
        }
        if let Some(o) = offsets.iter().find(|o| !o.is_multiple_of(es)) {
            return bad(format!("the {what}'s block at byte {o} is not on a whole element"));
        }
    }
    let (mine, into) = (send[rank + 1] - send[rank], recv[rank + 1] - recv[rank]);
    if mine != into {
        return bad(format!("this rank sends itself {mine} bytes but expects {into}"));
    }
    Ok(())
}

/// The checks of a call on device memory: the sizes (no overflow), the overlaps (only NCCL's
/// in-place forms may overlap) and that the buffers this rank uses are device memory of one
/// device, whose ordinal it returns.
#[cfg(feature = "cuda")]
fn device(call: &Call<'_>, count: usize, send: u64, recv: u64, me: usize, n: usize) -> Result<Checked> {
    let (kind, dtype) = (call.kind, call.dtype);
    let overflow = || Error::InvalidArgument(format!("{n} x {count} elements of {dtype} overflow").into());
    let bytes = count.checked_mul(dtype.size()).ok_or_else(overflow)?;
    let all = bytes.checked_mul(n).ok_or_else(overflow)?;
    if count == 0 {
        return Ok(Checked::Nothing);
    }
    // The buffers' sizes (0: not used on this rank: a send's recvbuf, a receive's sendbuf, a
    // non-root's recvbuf of a reduce), and which overlaps are the in-place forms (NCCL's, and
    // for a reduce-scatter the result at the front of sendbuf).
    let mine = (me * bytes) as u64;
    let (send_len, recv_len, in_place) = match kind {
        OpKind::AllGather => (bytes, all, send == recv.wrapping_add(mine)),
        OpKind::ReduceScatter(_) => (all, bytes, recv == send || recv == send.wrapping_add(mine)),
        OpKind::AllReduce(_) | OpKind::Broadcast(_) => (bytes, bytes, send == recv),
        OpKind::Reduce(_, root) => (bytes, if me == root { bytes } else { 0 }, send == recv),
        OpKind::AllToAll => (all, all, send == recv),
        OpKind::Send(_) => (bytes, 0, false),
        OpKind::Recv(_) => (0, bytes, false),
        other => return Err(Error::Unsupported(format!("{other:?} on device memory").into())),
    };
    let overlap = send_len > 0
        && recv_len > 0
        && send < recv.saturating_add(recv_len as u64)
        && recv < send.saturating_add(send_len as u64);
    if overlap && !in_place {
        return Err(Error::InvalidArgument(
            format!("{kind:?} on device memory: sendbuf and recvbuf overlap, and not in an in-place form")
                .into(),
        ));
    }
    // Only the buffers this rank uses must be device memory (of one device).
    let device = |len: usize, ptr: u64| (len > 0).then(|| crate::gpu::cuda::device_of(ptr));
    match (device(send_len, send), device(recv_len, recv)) {
        (Some(Some(a)), Some(Some(b))) if a == b => Ok(Checked::Device(a)),
        (Some(Some(a)), None) | (None, Some(Some(a))) => Ok(Checked::Device(a)),
        (a, b) => {
            let say = |d: Option<Option<usize>>| match d {
                Some(Some(d)) => format!("on device {d}"),
                Some(None) => "host memory".into(),
                None => "not used".into(),
            };
            Err(Error::InvalidArgument(
                format!(
                    "the stream collectives take device memory of one device: sendbuf is {}, recvbuf is {}",
                    say(a),
                    say(b)
                )
                .into(),
            ))
        }
    }
}

/// [`check`] of `op` on host memory (the Rust API, the queue and the C ABI).
pub(crate) fn validate(op: &RawOp, rank: usize, size: usize, has_window: bool) -> Result<()> {
    if op.kind == OpKind::SendRecv {
        return batch(op, rank, size, has_window);
    }
    check(&Call::host(op), rank, size, has_window).map(drop)
}

/// A batch of sends and receives ([`OpKind::SendRecv`]): each is a valid send or receive of its
/// own, and no receive's buffer overlaps another buffer of the batch (they are written side by
/// side; several sends may read one buffer).
fn batch(op: &RawOp, rank: usize, size: usize, has_window: bool) -> Result<()> {
    let items = op.batch.as_deref().unwrap_or_default();
    if items.is_empty() {
        return Err(Error::Internal("a batch of sends and receives without any".into()));
    }
    // (start, end, written) of every non-empty buffer
    let mut spans = Vec::with_capacity(items.len());
    for item in items {
        let span = match (item.kind, item.bufs) {
            (OpKind::Send(_), RawBufs::Read(b)) => (b.addr(), b.len(), false),
            (OpKind::Recv(_), RawBufs::InPlace(b)) => (b.addr(), b.len(), true),
            _ => {
                return Err(Error::Internal(
                    format!("a batch of sends and receives holds {:?}", item.kind).into(),
                ));
            }
        };
        if item.batch.is_some() {
            return Err(Error::Internal("a batch inside a batch".into()));
        }
        check(&Call::host(item), rank, size, has_window)?;
        if span.1 > 0 {
            spans.push((span.0, span.0 + span.1, span.2));
        }
    }
    // In address order, a buffer overlaps an earlier one when it starts before the furthest
    // end so far; it clashes when it or an earlier written buffer reaching past its start is
    // written.
    spans.sort_unstable();
    let (mut end, mut written_end) = (0, 0);
    for (start, stop, written) in spans {
        if start < written_end || (written && start < end) {
            return Err(Error::InvalidArgument(
                "a receive's buffer overlaps another buffer of its group's sends and receives".into(),
            ));
        }
        end = end.max(stop);
        if written {
            written_end = written_end.max(stop);
        }
    }
    Ok(())
}

/// [`check`] of a call on device memory: the ordinal of the device its buffers are on, or
/// `None` when there is nothing to do (no elements).
#[cfg(feature = "cuda")]
pub(crate) fn check_device(call: &DeviceCall, rank: usize, size: usize) -> Result<Option<usize>> {
    match check(&Call::device(call), rank, size, false)? {
        Checked::Device(d) => Ok(Some(d)),
        Checked::Nothing => Ok(None),
        Checked::Host => Err(Error::Internal("a call on device memory checked as host memory".into())),
    }
}

#[cfg(test)]
#[path = "argcheck_tests.rs"]
mod tests;
