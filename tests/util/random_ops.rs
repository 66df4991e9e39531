//! Random collectives for the fault matrix and the soak: every rank draws the same sequence of
//! cases from a shared seed, runs each one and verifies every element against the reference of
//! `data` (computed locally from the seeds of all ranks, so nothing verified travels over the
//! communicator under test).
//!
//! Included with `#[path]` by `tests/faults.rs` and `tests/soak.rs`; it uses `crate::util`.

#![allow(dead_code)]

use toroid::{Algorithm, CallOptions, Communicator, DataType, OpKind, ReduceOp};

use crate::util::cases::{Case, Coll, check};
use crate::util::data::{fill, mix};

/// A small deterministic generator (splitmix64 over a counter): the same seed gives every
/// rank the same cases.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(mix(seed))
    }
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(1);
        mix(self.0)
    }
    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    pub fn pick<T: Copy>(&mut self, v: &[T]) -> T {
        v[self.below(v.len() as u64) as usize]
    }
}

/// The integer types: their reductions are exact (wrapping for sum and prod), so every element
/// can be compared bit for bit.
pub const INT_TYPES: [DataType; 6] =
    [DataType::I8, DataType::U8, DataType::I32, DataType::U32, DataType::I64, DataType::U64];
const INT_OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max];

/// One drawn operation: a collective of `cases`, or a send/recv exchange between pairs.
#[derive(Debug, Clone, Copy)]
pub enum Op {
    Coll(Case),
    /// Ranks 2k and 2k+1 exchange `count` elements (an odd last rank sits out).
    SendRecv {
        dtype: DataType,
        count: usize,
    },
}

impl Op {
    /// A short name for the tally (`all_reduce/ring`).
    pub fn label(&self) -> String {
        match self {
            Op::SendRecv { .. } => "send_recv".into(),
            Op::Coll(c) => {
                let kind = match c.coll {
                    Coll::AllReduce => "all_reduce",
                    Coll::ReduceScatter => "reduce_scatter",
                    Coll::AllGather => "all_gather",
                    Coll::Broadcast(_) => "broadcast",
                    Coll::Reduce(_) => "reduce",
                    Coll::AllToAll => "all_to_all",
                    Coll::AllToAllV => "all_to_all_v",
                };
                match c.algo {
                    Some(a) => format!("{kind}/{a}"),
                    None => format!("{kind}/auto"),
                }
            }
        }
    }
}

/// Draws one operation for `n` ranks. Element counts are log-uniform up to `max_bytes` per
/// rank's piece (odd counts included); `window` (every rank on one host with the shared window)
/// adds `shm_direct` where it applies.
pub fn draw(rng: &mut Rng, n: usize, max_bytes: usize, window: bool) -> Op {
    let dtype = rng.pick(&INT_TYPES);
    let op = rng.pick(&INT_OPS);
    let max_count = (max_bytes / dtype.size()).max(1);
    let count = match rng.below(8) {
        0 => 0,
        1 => 1 + rng.below(7) as usize,
        _ => {
            // log-uniform: a random number of bits, then a random value below that.
            let bits = 64 - (max_count as u64).leading_zeros() as u64;
            let b = 1 + rng.below(bits);
            (rng.below(1 << b) as usize).min(max_count)
        }
    };
    let in_place = rng.below(2) == 0;
    let root = rng.below(n as u64) as usize;
    let shm = |v: &mut Vec<Option<Algorithm>>| {
        if window {
            v.push(Some(Algorithm::ShmDirect));
        }
    };
    let (coll, algos) = match rng.below(7) {
        0 | 1 => {
            let mut a = vec![
                None,
                Some(Algorithm::Ring),
                Some(Algorithm::Doubling),
                Some(Algorithm::HalvingDoubling),
                Some(Algorithm::HierarchicalRing),
            ];
            shm(&mut a);
            (Coll::AllReduce, a)
        }
        2 => {
            let mut a = vec![None, Some(Algorithm::Ring)];
            shm(&mut a);
            (Coll::ReduceScatter, a)
        }
        3 => {
            let mut a = vec![None, Some(Algorithm::Ring)];
            shm(&mut a);
            (Coll::AllGather, a)
        }
        4 => {
            let mut a = vec![None, Some(Algorithm::Chain), Some(Algorithm::Tree)];
            shm(&mut a);
            (Coll::Broadcast(root), a)
        }
        5 => (Coll::Reduce(root), vec![None, Some(Algorithm::Chain), Some(Algorithm::Tree)]),
        _ => {
            match rng.below(3) {
                0 => return Op::SendRecv { dtype, count },
                // (blocks of 0..=count elements, out of place)
                1 => {
                    let case = Case { coll: Coll::AllToAllV, dtype, op, count, in_place: false, algo: None };
                    return Op::Coll(case);
                }
                _ => (Coll::AllToAll, vec![None, Some(Algorithm::Pairwise)]),
            }
        }
    };
    // Pieces of reduce_scatter, all_gather and all_to_all are per rank: keep the whole buffer
    // within n x max_bytes like the others.
    let algo = rng.pick(&algos);
    Op::Coll(Case { coll, dtype, op, count, in_place, algo })
}

/// Runs `op` as case `id` and verifies this rank's output; `Err` carries the call's error or the
/// first wrong elements.
pub fn run(comm: &Communicator, id: u64, op: &Op) -> Result<(), String> {
    match op {
        Op::Coll(c) => check(comm, id, c),
        Op::SendRecv { dtype, count } => send_recv(comm, id, *dtype, *count),
    }
}

/// Ranks 2k and 2k+1 swap `count` elements of their inputs: the lower sends first, so the
/// exchange cannot deadlock even when a send waits for its receiver.
fn send_recv(comm: &Communicator, id: u64, d: DataType, count: usize) -> Result<(), String> {
    let (r, n) = (comm.rank(), comm.size());
    let peer = r ^ 1;
    if peer >= n {
        return Ok(());
    }
    let s = d.size();
    let mut mine = vec![0u8; count * s];
    fill(&mut mine, id, r, 0, d, ReduceOp::Sum);
    let mut got = vec![0xA5u8; count * s];
    let opts = CallOptions::default();
    let send = |buf: &[u8]| {
        comm.run_bytes(OpKind::Send(peer), d, Some(buf), None, opts)
            .map_err(|e| format!("rank {r}: send to {peer}: {e}"))
    };
    let recv = |buf: &mut [u8]| {
        comm.run_bytes(OpKind::Recv(peer), d, None, Some(buf), opts)
            .map_err(|e| format!("rank {r}: recv from {peer}: {e}"))
    };
    if r < peer {
        send(&mine)?;
        recv(&mut got)?;
    } else {
        recv(&mut got)?;
        send(&mine)?;
    }
    let mut want = vec![0u8; count * s];
    fill(&mut want, id, peer, 0, d, ReduceOp::Sum);
    if got != want {
        let k = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0) / s;
        return Err(format!("rank {r}: send_recv {count} x {d:?} from {peer}: element {k} differs"));
    }
    Ok(())
}
