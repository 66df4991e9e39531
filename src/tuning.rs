//! Algorithm choice: an alpha-beta-gamma cost model, a probe that measures it, and
//! `TOROID_ALGO`.
//!
//! Every link is either inside a host (`intra`) or between hosts (`inter`), each with a
//! latency `alpha` (seconds per message) and an inverse bandwidth `beta` (seconds per byte);
//! `gamma` is seconds per byte reduced. [`CostModel::predict`] turns an algorithm's schedule
//! into `time = steps * alpha + bytes * beta + reduced * gamma`, phase by phase, with the bytes
//! that cross each host's link counted where several ranks of a host share it (the formulas,
//! algorithm by algorithm, with their papers, are in `docs/reference/algorithms.md`). The cheapest allowed algorithm wins.
//!
//! The parameters come from a short probe when a communicator is created (ping-pong and a
//! bulk transfer between two ranks of one host, and between two hosts; a timed local
//! reduction), agreed across ranks by an all-reduce of the maxima, or from
//! `TOROID_COST_MODEL`. The same model drives the `toroid-sim` simulator.
//!
//! The choice depends only on the operation, its size, the shape and the model, which every
//! rank holds identically, so every rank makes the same one; a rank configured differently is
//! caught by the fingerprint (which carries the algorithm), never silently mixed.

use crate::collective::{Algorithm, CollKind};
use crate::error::{Error, Result};

mod cost_model;
mod probe;

pub use cost_model::{CostModel, LinkCost, Shape};
pub use probe::{PROBE_BYTES, PROBE_LEN, ProbeResult, probe};

/// The algorithms that can run `kind`.
pub fn candidates(kind: CollKind) -> &'static [Algorithm] {
    match kind {
        CollKind::AllReduce => &[
            Algorithm::Ring,
            Algorithm::Doubling,
            Algorithm::HalvingDoubling,
            Algorithm::HierarchicalRing,
            Algorithm::Torus2d,
        ],
        CollKind::ReduceScatter | CollKind::AllGather => &[Algorithm::Ring],
        CollKind::Broadcast | CollKind::Reduce => &[Algorithm::Chain, Algorithm::Tree],
        CollKind::AllToAll | CollKind::AllToAllV => &[Algorithm::Pairwise],
        CollKind::Barrier => &[Algorithm::Dissemination],
        CollKind::PointToPoint => &[Algorithm::Direct],
        CollKind::Split | CollKind::Probe => &[Algorithm::Ring],
    }
}

/// A parsed `TOROID_ALGO`: a default list and per-collective lists, each allowing or (`^`)
/// excluding algorithms. Example: `ring;allreduce:^rd;broadcast:chain`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AlgoFilter {
    default: Option<Rule>,
    per_kind: Vec<(CollKind, Rule)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Rule {
    exclude: bool,
    algos: Vec<Algorithm>,
}

impl Rule {
    fn allows(&self, a: Algorithm) -> bool {
        self.algos.contains(&a) != self.exclude
    }
}

fn kind_by_name(s: &str) -> Option<CollKind> {
    Some(match s.replace(['_', '-'], "").to_ascii_lowercase().as_str() {
        "allreduce" => CollKind::AllReduce,
        "reducescatter" => CollKind::ReduceScatter,
        "allgather" => CollKind::AllGather,
        "broadcast" | "bcast" => CollKind::Broadcast,
        "reduce" => CollKind::Reduce,
        "alltoall" => CollKind::AllToAll,
        "alltoallv" => CollKind::AllToAllV,
        "barrier" => CollKind::Barrier,
        _ => return None,
    })
}

impl AlgoFilter {
    /// Parses NCCL's list syntax: sections separated by `;`, each `[collective:]list`, a list
    /// being comma-separated names with an optional leading `^` to exclude them.
    pub fn parse(spec: &str) -> Result<AlgoFilter> {
        let mut f = AlgoFilter::default();
        for section in spec.split(';').map(str::trim).filter(|s| !s.is_empty()) {
            let (kind, list) = match section.split_once(':') {
                Some((k, l)) => {
                    let kind = kind_by_name(k).ok_or_else(|| {
                        Error::InvalidArgument(
                            format!("TOROID_ALGO: unknown collective '{k}' in '{spec}'").into(),
                        )
                    })?;
                    (Some(kind), l)
                }
                None => (None, section),
            };
            let (exclude, list) = match list.trim().strip_prefix('^') {
                Some(l) => (true, l),
                None => (false, list),
            };
            let mut algos = Vec::new();
            for name in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                algos.push(Algorithm::parse(name).ok_or_else(|| {
                    Error::InvalidArgument(
                        format!(
                            "TOROID_ALGO: unknown algorithm '{name}' (known: {})",
                            Algorithm::ALL.iter().map(|a| a.name()).collect::<Vec<_>>().join(", ")
                        )
                        .into(),
                    )
                })?);
            }
            let rule = Rule { exclude, algos };
            match kind {
                Some(k) => f.per_kind.push((k, rule)),
                None => f.default = Some(rule),
            }
        }
        Ok(f)
    }

    /// The candidates for `kind` this filter allows (all of them when a rule leaves none, so
    /// a list meant for other collectives never disables one).
    pub fn allowed(&self, kind: CollKind) -> impl Iterator<Item = Algorithm> + '_ {
        let rule = self.per_kind.iter().find(|(k, _)| *k == kind).map(|(_, r)| r).or(self.default.as_ref());
        let any = rule.is_none_or(|r| candidates(kind).iter().any(|a| r.allows(*a)));
        candidates(kind).iter().copied().filter(move |a| !any || rule.is_none_or(|r| r.allows(*a)))
    }

    /// The shared-window choice for `kind` when every rank is on one host and the window
    /// exists: [`intra_default`] when the filter allows it, else `None` (the other algorithms).
    pub fn choose_intra(&self, kind: CollKind, bytes: usize, n: usize) -> Option<Algorithm> {
        let a = intra_default(kind, bytes, n)?;
        let rule = self.per_kind.iter().find(|(k, _)| *k == kind).map(|(_, r)| r).or(self.default.as_ref());
        match rule {
            Some(rule) if !rule.allows(a) => None,
            _ => Some(a),
        }
    }
}

/// Picks the cheapest algorithm the filter allows for `kind` moving `bytes`.
pub fn choose(
    filter: &AlgoFilter,
    model: &CostModel,
    shape: &Shape,
    kind: CollKind,
    bytes: usize,
) -> Algorithm {
    let mut best: Option<(f64, Algorithm)> = None;
    for a in filter.allowed(kind) {
        let time = match kind {
            CollKind::AllReduce | CollKind::Broadcast | CollKind::Reduce => {
                model.predict(a, bytes, shape).time
            }
            _ => 0.0,
        };
        if best.is_none_or(|(t, _)| time < t) {
            best = Some((time, a));
        }
    }
    best.map_or(candidates(kind)[0], |(_, a)| a)
}

/// Checks that `algo` can run `kind` (a forced per-call choice).
pub fn check_forced(kind: CollKind, algo: Algorithm) -> Result<()> {
    if candidates(kind).contains(&algo) || intra_candidates(kind).contains(&algo) {
        Ok(())
    } else {
        Err(Error::InvalidArgument(
            format!(
                "algorithm {algo} cannot run {} (candidates: {})",
                kind.name(),
                candidates(kind).iter().map(|a| a.name()).collect::<Vec<_>>().join(", ")
            )
            .into(),
        ))
    }
}

/// The collectives the shared window can run when every rank is on one host.
pub fn intra_candidates(kind: CollKind) -> &'static [Algorithm] {
    match kind {
        CollKind::AllReduce
        | CollKind::ReduceScatter
        | CollKind::AllGather
        | CollKind::Broadcast
        | CollKind::Barrier
        | CollKind::Split => &[Algorithm::ShmDirect],
        _ => &[],
    }
}

/// Whether `shm_direct` (the shared window) should run `kind` moving `bytes` among `n` ranks
/// that all share one host.
///
/// Cost model per rank (bytes `B`, `n` ranks, `a` = one synchronisation through a shared cache
/// line, about 0.3 us with a core per rank and a context switch when oversubscribed):
/// `shm_direct` pays 2 to 3 syncs per chunk and about `(5 - 2/n) B` of memory traffic, where
/// the best point-to-point algorithm over shared-memory rings pays `log2 n` (rd) or `2 (n - 1)`
/// (ring) frame latencies of a few microseconds each, and for large `B` copies `2 (n - 1)/n B`
/// into and out of rings besides reducing. The window wins at every size measured (see the
/// README), so the rule is simply "always, when the filter allows it".
pub fn intra_default(kind: CollKind, bytes: usize, n: usize) -> Option<Algorithm> {
    let _ = bytes;
    (n >= 2).then(|| intra_candidates(kind).first().copied()).flatten()
}

#[cfg(test)]
mod tests;
