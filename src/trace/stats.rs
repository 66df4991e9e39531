//! Statistics per communicator: for every (collective, algorithm, size class) seen, how many
//! operations completed, how many bytes they carried and moved, and a histogram of their times
//! (what `toroid-bench` prints and the C ABI's `toroid_comm_stats` returns).
//!
//! A table of cells searched linearly: the distinct keys of a job are a few dozen, so a new key
//! allocates once and every later operation only adds to its cell.

use std::fmt;

use super::snapshot::OpRecord;
use crate::collective::{Algorithm, CollKind};

/// Time histogram buckets: bucket `i` counts operations that took less than 2^i microseconds
/// (the last one everything longer).
pub const HIST_BUCKETS: usize = 32;

/// One (collective, algorithm, size class) and what was seen of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cell {
    /// The collective.
    pub kind: CollKind,
    /// The algorithm's wire id.
    pub algo: u8,
    /// Size class: messages of at most 2^`size_class` bytes (and more than half that).
    pub size_class: u8,
    /// Operations completed.
    pub count: u64,
    /// Their message bytes (count x element size, as the caller passed them).
    pub bytes: u64,
    /// Bytes this rank sent and received for them.
    pub moved: u64,
    /// Total, shortest and longest time (ns).
    pub total_ns: u64,
    /// See `total_ns`.
    pub min_ns: u64,
    /// See `total_ns`.
    pub max_ns: u64,
    /// Time histogram (see [`HIST_BUCKETS`]).
    pub hist: [u64; HIST_BUCKETS],
}

/// The statistics of one communicator.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    cells: Vec<Cell>,
}

/// The size class of a message of `bytes` bytes: the smallest `c` with `bytes <= 2^c`.
pub fn size_class(bytes: u64) -> u8 {
    if bytes <= 1 { 0 } else { (64 - (bytes - 1).leading_zeros()) as u8 }
}

fn time_bucket(ns: u64) -> usize {
    let us = ns / 1000;
    ((64 - us.leading_zeros()) as usize).min(HIST_BUCKETS - 1)
}

impl Stats {
    /// Adds one completed operation.
    pub fn add(&mut self, r: &OpRecord) {
        let bytes = r.fp.count.saturating_mul(r.fp.dtype.size() as u64);
        let (kind, algo, size_class) = (r.fp.kind, r.fp.algo, size_class(bytes));
        let ns = r.ended_ns.saturating_sub(r.started_ns);
        let i = match self
            .cells
            .iter()
            .position(|c| (c.kind, c.algo, c.size_class) == (kind, algo, size_class))
        {
            Some(i) => i,
            None => {
                self.cells.push(Cell {
                    kind,
                    algo,
                    size_class,
                    count: 0,
                    bytes: 0,
                    moved: 0,
                    total_ns: 0,
                    min_ns: u64::MAX,
                    max_ns: 0,
                    hist: [0; HIST_BUCKETS],
                });
                self.cells.len() - 1
            }
        };
        let c = &mut self.cells[i];
        c.count += 1;
        c.bytes = c.bytes.saturating_add(bytes);
        c.moved = c.moved.saturating_add(r.bytes);
        c.total_ns = c.total_ns.saturating_add(ns);
        c.min_ns = c.min_ns.min(ns);
        c.max_ns = c.max_ns.max(ns);
        c.hist[time_bucket(ns)] += 1;
    }

    /// Every cell, in the order first seen.
    pub fn cells(&self) -> &[Cell] {
        &self.cells
    }

    /// Operations counted in all.
    pub fn total_count(&self) -> u64 {
        self.cells.iter().map(|c| c.count).sum()
    }
}

fn human(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 30 => format!("{}G", b >> 30),
        b if b >= 1 << 20 => format!("{}M", b >> 20),
        b if b >= 1 << 10 => format!("{}K", b >> 10),
        b => format!("{b}"),
    }
}

impl fmt::Display for Stats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{:<15} {:<18} {:>9} {:>9} {:>12} {:>11} {:>11} {:>11}",
            "collective", "algorithm", "size<=", "count", "bytes", "avg(us)", "min(us)", "max(us)"
        )?;
        let mut cells: Vec<&Cell> = self.cells.iter().collect();
        cells.sort_by_key(|c| (c.kind as u8, c.size_class, c.algo));
        for c in cells {
            let avg = c.total_ns as f64 / c.count.max(1) as f64 / 1e3;
            writeln!(
                f,
                "{:<15} {:<18} {:>9} {:>9} {:>12} {:>11.1} {:>11.1} {:>11.1}",
                c.kind.name(),
                Algorithm::name_of(c.algo),
                human(1u64 << c.size_class.min(63)),
                c.count,
                c.bytes,
                avg,
                c.min_ns as f64 / 1e3,
                c.max_ns as f64 / 1e3
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::Fingerprint;
    use crate::dtype::{DataType, ReduceOp};
    use crate::trace::{OpState, Phase};

    fn op(kind: CollKind, count: u64, ns: u64) -> OpRecord {
        OpRecord {
            fp: Fingerprint {
                seq: 1,
                kind,
                dtype: DataType::F32,
                op: ReduceOp::Sum,
                count,
                root: -1,
                algo: 1,
            },
            state: OpState::Done,
            phase: Phase::None,
            peer: -1,
            waiting_on: -1,
            step: 0,
            issued_ns: 100,
            started_ns: 1000,
            ended_ns: 1000 + ns,
            bytes: 2 * count * 4,
        }
    }

    #[test]
    fn cells_count_bytes_and_times_exactly() {
        let mut s = Stats::default();
        s.add(&op(CollKind::AllReduce, 1024, 5_000)); // 4 KiB, 5 us
        s.add(&op(CollKind::AllReduce, 1000, 7_000)); // 4000 B: same class
        s.add(&op(CollKind::AllReduce, 1025, 900)); // 4100 B: the next class
        s.add(&op(CollKind::Broadcast, 1024, 3_000_000_000));
        assert_eq!(s.total_count(), 4);
        let c = &s.cells()[0];
        assert_eq!((c.count, c.bytes, c.moved, c.size_class), (2, 8096, 16192, 12));
        assert_eq!((c.min_ns, c.max_ns, c.total_ns), (5_000, 7_000, 12_000));
        assert_eq!(c.hist[3], 2, "5 and 7 us are in [4, 8)");
        assert_eq!(s.cells()[1].size_class, 13);
        assert_eq!(s.cells()[1].hist[0], 1, "0.9 us is below 1 us");
        assert_eq!(s.cells()[2].hist[22], 1, "3 s is in [2^21, 2^22) us");
        let table = s.to_string();
        assert!(
            table.contains("all_reduce") && table.contains("broadcast") && table.contains("4K"),
            "{table}"
        );
    }

    #[test]
    fn size_classes_are_ceilings_of_powers_of_two() {
        assert_eq!([0, 1, 2, 3, 4, 5, 1024, 1025].map(size_class), [0, 0, 1, 2, 2, 3, 10, 11]);
    }
}
