//! `toroid_group_start` / `toroid_group_end`: NCCL's `ncclGroupStart` / `ncclGroupEnd`, per
//! communicator. Between them, the blocking collective calls on the communicator are checked and
//! recorded, not run, and return at once; the end runs them as one group
//! ([`crate::Communicator::group`]: consecutive small all-reduces packed into one). Their
//! buffers must stay valid, and untouched, until the end returns.

use std::sync::{Arc, Mutex};

use super::boundary::{CommHandle, ffi_boundary, with_comm};
use super::types::{toroid_comm, toroid_result};
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
                 a group holds blocking collectives"
            )
            .into(),
        ));
    }
    Ok(())
}

/// Opens a group on `comm` (or nests one in an open group): until the matching
/// `toroid_group_end`, blocking collectives on `comm` (all_reduce, reduce_scatter, all_gather,
/// broadcast, reduce, all_to_all, barrier) are checked and recorded, and return TOROID_SUCCESS
/// at once without touching their buffers. Async calls, send and receive are refused inside a
/// group (TOROID_INVALID_USAGE). Every rank must record the same calls in the same order.
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

fn end(h: &Arc<CommHandle>) -> Result<()> {
    let ops = {
        let mut g = lock(&h.group);
        match g.depth {
            0 => return Err(Error::InvalidUsage("toroid_group_end without toroid_group_start".into())),
            1 => {
                g.depth = 0;
                std::mem::take(&mut g.ops)
            }
            _ => {
                g.depth -= 1;
                return Ok(());
            }
        }
    };
    // SAFETY: the C contract: every recorded call's buffers stay valid and untouched until
    // this returns.
    unsafe { h.comm.run_group(ops) }
}
