//! `toroid_comm_stats`: the communicator's statistics (`trace::Stats`, item 4 of the
//! observability work) as a snapshot of fixed-size C structs, one per (collective, algorithm,
//! size class). The caller owns the array; a first call with `out == NULL, capacity == 0` tells
//! it how many cells exist, as `snprintf` tells the length it needs.

use std::ffi::c_int;

use super::boundary::{check_out, ffi_boundary, with_comm, write_out};
use super::types::{toroid_comm, toroid_result};
use crate::error::Error;
use crate::trace::stats::{Cell, HIST_BUCKETS};

/// One row of a communicator's statistics: every completed operation of one collective, one
/// algorithm and one size class.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct toroid_stat {
    /// The collective: 1 all_reduce, 2 reduce_scatter, 3 all_gather, 4 broadcast, 5 reduce,
    /// 6 all_to_all, 7 barrier, 8 send/recv, 9 split, 10 probe (toroid's own set-up check).
    pub kind: c_int,
    /// The algorithm's id (as in toroid-bench's output and TOROID_ALGO's names).
    pub algorithm: c_int,
    /// Messages of at most 2^size_class bytes (and more than half that).
    pub size_class: c_int,
    /// Operations completed.
    pub count: u64,
    /// Their message bytes (count x element size, as passed by the caller), summed.
    pub bytes: u64,
    /// Bytes this rank sent and received for them.
    pub moved: u64,
    /// Total time of these operations, in nanoseconds.
    pub total_ns: u64,
    /// Shortest time, in nanoseconds.
    pub min_ns: u64,
    /// Longest time, in nanoseconds.
    pub max_ns: u64,
    /// Time histogram: hist[i] counts operations that took less than 2^i microseconds (and at
    /// least 2^(i-1)); the last bucket also counts everything longer.
    pub hist: [u64; 32],
}

const _: () = assert!(HIST_BUCKETS == 32, "toroid_stat.hist is spelled with 32 buckets in the header");

impl From<&Cell> for toroid_stat {
    fn from(c: &Cell) -> toroid_stat {
        toroid_stat {
            kind: c_int::from(c.kind as u8),
            algorithm: c_int::from(c.algo),
            size_class: c_int::from(c.size_class),
            count: c.count,
            bytes: c.bytes,
            moved: c.moved,
            total_ns: c.total_ns,
            min_ns: if c.count == 0 { 0 } else { c.min_ns },
            max_ns: c.max_ns,
            hist: c.hist,
        }
    }
}

/// A snapshot of `comm`'s statistics: writes up to `capacity` rows to `out` (in the order the
/// rows were first seen) and sets *count to the number of rows that exist, which may be more
/// than `capacity` (call first with out = NULL and capacity = 0 to size the array). Never
/// blocks on the network; the snapshot is consistent (taken under the recorder's lock).
/// TOROID_INVALID_ARGUMENT when count is NULL, or out is NULL with capacity > 0.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_comm_stats(
    comm: *mut toroid_comm,
    out: *mut toroid_stat,
    capacity: usize,
    count: *mut usize,
) -> toroid_result {
    const NAME: &str = "toroid_comm_stats";
    ffi_boundary!(NAME, {
        with_comm(NAME, comm, |h| {
            check_out(count, "count")?;
            if out.is_null() && capacity > 0 {
                return Err(Error::InvalidArgument(
                    format!("out is NULL but capacity is {capacity} (pass 0 to ask for the count)").into(),
                ));
            }
            let stats = h.comm.stats();
            let cells = stats.cells();
            for (i, c) in cells.iter().take(capacity).enumerate() {
                // SAFETY: `out` is non-NULL (capacity > 0 here) and valid for `capacity` rows
                // (the caller's promise); i < capacity.
                unsafe { out.add(i).write(toroid_stat::from(c)) };
            }
            // SAFETY: non-NULL (checked) and valid (the caller's promise).
            unsafe { write_out(count, cells.len()) };
            Ok(())
        })
    })
}
