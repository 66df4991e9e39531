//! `toroid_group_start` / `toroid_group_end`: NCCL's `ncclGroupStart` / `ncclGroupEnd`, per
//! communicator. Between them, the blocking collective calls, sends and receives on the
//! communicator are checked and recorded, not run, and return at once; the end runs them as one
//! group ([`crate::Communicator::group`]: consecutive small all-reduces packed into one, the
//! sends and receives side by side after the collectives). Their buffers must stay valid, and
//! untouched, until the end returns.

use std::sync::{Arc, Mutex};

use super::boundary::{CommHandle, Handle, WorkHandle, check_out, ffi_boundary, with_comm, write_out};
use super::types::{toroid_comm, toroid_result, toroid_work};
use crate::comm::{Hooks, RawOp};
use crate::error::{Error, Result};

/// A communicator's open group.
#[derive(Default)]
pub(crate) struct GroupState {
    /// Starts not yet ended (groups nest, as NCCL's do; the outermost end runs them).
    depth: usize,
    ops: Vec<(RawOp, Hooks)>,
}

fn lock(m: &Mutex<GroupState>) -> std::sync::MutexGuard<'_, GroupState> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Records `op` when a group is open on `h` (returns `None`); otherwise hands it back.
pub(crate) fn record(h: &CommHandle, op: RawOp, hooks: Hooks) -> Option<(RawOp, Hooks)> {
    let mut g = lock(&h.group);
    if g.depth == 0 {
        return Some((op, hooks));
    }
    g.ops.push((op, hooks));
    None
}

/// An error when a group is open on `h` (for the calls that cannot be in one).
pub(crate) fn refuse_in_group(h: &CommHandle, what: &str) -> Result<()> {
    if lock(&h.group).depth > 0 {
        return Err(Error::InvalidUsage(
            format!(
                "{what} cannot be issued inside a group (toroid_group_start .. toroid_group_end): \
                 a group holds blocking collectives, sends and receives"
            )
            .into(),
        ));
    }
    Ok(())
}

/// Opens a group on `comm` (or nests one in an open group): until the matching
/// `toroid_group_end`, blocking collectives on `comm` (all_reduce, reduce_scatter, all_gather,
/// broadcast, reduce, all_to_all, all_to_all_v, barrier) and toroid_send / toroid_recv are
/// checked and recorded, and return TOROID_SUCCESS at once without touching their buffers.
/// The group's sends and receives run side by side after its collectives (NCCL's grouped
/// ncclSend / ncclRecv: a group where each rank sends to one peer and receives from another
/// completes whatever the sizes; as in NCCL, a group orders none of its operations), each
/// pairing with its peer's send or receive, grouped or not, in the pair's order; no receive's
/// buffer may overlap another of the group's send or receive buffers (TOROID_INVALID_ARGUMENT
/// at the end, before anything runs). Async calls and toroid_recv_any are refused inside a
/// group (TOROID_INVALID_USAGE). Every rank must record the same collectives in the same order.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_group_start(comm: *mut toroid_comm) -> toroid_result {
    const NAME: &str = "toroid_group_start";
    ffi_boundary!(NAME, {
        with_comm(NAME, comm, |h| {
            lock(&h.group).depth += 1;
            Ok(())
        })
    })
}

/// Closes the group opened by the matching `toroid_group_start`; the outermost end runs the
/// recorded calls, consecutive small all-reduces of one type and op packed into one, and
/// returns when all have run (the first failure stops the group and is returned). The buffers
/// of the recorded calls must stay valid, and untouched, until it returns.
/// TOROID_INVALID_USAGE without an open group.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_group_end(comm: *mut toroid_comm) -> toroid_result {
    const NAME: &str = "toroid_group_end";
    ffi_boundary!(NAME, { with_comm(NAME, comm, end) })
}

/// Closes the group like `toroid_group_end`, but the outermost end queues the recorded calls
/// behind the async work already issued on `comm` and returns at once (NCCL's group end, which
/// only enqueues): *work completes when every call has run, and toroid_work_wait returns the
/// first failure among them. The buffers of the recorded calls must stay valid, and untouched,
/// until the work completes. *work is set to NULL when nothing was queued: a nested end, or a
/// group that recorded nothing. TOROID_INVALID_USAGE without an open group.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_group_end_async(
    comm: *mut toroid_comm,
    work: *mut *mut toroid_work,
) -> toroid_result {
    const NAME: &str = "toroid_group_end_async";
    ffi_boundary!(NAME, {
        with_comm(NAME, comm, |h| {
            check_out(work, "work")?;
            // SAFETY: non-NULL (checked) and valid (the caller's promise).
            unsafe { write_out(work, std::ptr::null_mut()) };
            let Some(ops) = close(h)? else { return Ok(()) };
            if ops.is_empty() {
                return Ok(());
            }
            // SAFETY: the C contract: every recorded call's buffers stay valid and untouched
            // until the work completes.
            let mut works = unsafe { h.comm.submit_group(ops)? };
            let Some(last) = works.pop() else { return Ok(()) };
            let handle = WorkHandle {
                work: last,
                earlier: works,
                comm: Arc::downgrade(h),
                timeout: h.comm.timeout(),
                source: None,
            };
            // SAFETY: as above.
            unsafe { write_out(work, WorkHandle::into_handle(Arc::new(handle))) };
            Ok(())
        })
    })
}

fn end(h: &Arc<CommHandle>) -> Result<()> {
    let Some(ops) = close(h)? else { return Ok(()) };
    // SAFETY: the C contract: every recorded call's buffers stay valid and untouched until
    // this returns.
    unsafe { h.comm.run_group(ops) }
}

/// Closes the innermost open group on `h`: the recorded calls when it was the outermost, None
/// for a nested one.
fn close(h: &CommHandle) -> Result<Option<Vec<(RawOp, Hooks)>>> {
    let mut g = lock(&h.group);
    match g.depth {
        0 => Err(Error::InvalidUsage("toroid_group_end without toroid_group_start".into())),
        1 => {
            g.depth = 0;
            Ok(Some(std::mem::take(&mut g.ops)))
        }
        _ => {
            g.depth -= 1;
            Ok(None)
        }
    }
}
