//! Algorithm choice.
//!
//! Each collective has a default rule by message size and rank count, measured on loopback TCP
//! (see the README's results): latency-bound sizes take the algorithm with the fewest steps,
//! bandwidth-bound sizes the one that moves the fewest bytes. `TOROID_ALGO` narrows the choice
//! with NCCL's syntax, and a per-call option forces it.
//!
//! The choice depends only on the operation, its size, the rank count and the configuration,
//! so every rank makes the same one; a rank configured differently is caught by the fingerprint
//! (which carries the algorithm), never silently mixed.

use crate::algorithm::Algorithm;
use crate::error::{Error, Result};
use crate::transport::CollKind;

/// Largest all-reduce (bytes) that recursive doubling handles by default.
pub const DOUBLING_MAX_BYTES: usize = 64 * 1024;
/// Largest broadcast/reduce (bytes) that the binomial tree handles by default.
pub const TREE_MAX_BYTES: usize = 64 * 1024;

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
        CollKind::AllToAll => &[Algorithm::Pairwise],
        CollKind::Barrier => &[Algorithm::Dissemination],
        CollKind::PointToPoint => &[Algorithm::Direct],
        CollKind::Split => &[Algorithm::Ring],
    }
}

/// The default choice for `kind` moving `bytes` (the full message size) among `n` ranks.
pub fn default_choice(kind: CollKind, bytes: usize, n: usize) -> Algorithm {
    match kind {
        CollKind::AllReduce if bytes <= DOUBLING_MAX_BYTES || n == 1 => Algorithm::Doubling,
        CollKind::Broadcast | CollKind::Reduce if bytes <= TREE_MAX_BYTES || n <= 2 => Algorithm::Tree,
        _ => candidates(kind)[0],
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
                        Error::InvalidArgument(format!("TOROID_ALGO: unknown collective '{k}' in '{spec}'"))
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
                    Error::InvalidArgument(format!(
                        "TOROID_ALGO: unknown algorithm '{name}' (known: {})",
                        Algorithm::ALL.iter().map(|a| a.name()).collect::<Vec<_>>().join(", ")
                    ))
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

    /// Picks the algorithm for `kind`: the default choice when the filter allows it, else the
    /// first allowed candidate, else (nothing allowed fits this collective) the default choice.
    pub fn choose(&self, kind: CollKind, bytes: usize, n: usize) -> Algorithm {
        let def = default_choice(kind, bytes, n);
        let rule = self.per_kind.iter().find(|(k, _)| *k == kind).map(|(_, r)| r).or(self.default.as_ref());
        let Some(rule) = rule else { return def };
        if rule.allows(def) {
            return def;
        }
        candidates(kind).iter().copied().find(|a| rule.allows(*a)).unwrap_or(def)
    }
}

/// Checks that `algo` can run `kind` (a forced per-call choice).
pub fn check_forced(kind: CollKind, algo: Algorithm) -> Result<()> {
    if candidates(kind).contains(&algo) {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "algorithm {algo} cannot run {} (candidates: {})",
            kind.name(),
            candidates(kind).iter().map(|a| a.name()).collect::<Vec<_>>().join(", ")
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_by_size() {
        assert_eq!(default_choice(CollKind::AllReduce, 4096, 4), Algorithm::Doubling);
        assert_eq!(default_choice(CollKind::AllReduce, 16 << 20, 4), Algorithm::Ring);
        assert_eq!(default_choice(CollKind::Broadcast, 16 << 20, 4), Algorithm::Chain);
        assert_eq!(default_choice(CollKind::Broadcast, 100, 4), Algorithm::Tree);
    }

    #[test]
    fn filter_syntax() {
        let f = AlgoFilter::parse("ring;broadcast:^chain").unwrap();
        assert_eq!(f.choose(CollKind::AllReduce, 16, 4), Algorithm::Ring);
        assert_eq!(f.choose(CollKind::Broadcast, 1 << 30, 4), Algorithm::Tree);
        // A global list that names nothing a collective can run leaves its default.
        assert_eq!(f.choose(CollKind::AllToAll, 1, 4), Algorithm::Pairwise);
        let f = AlgoFilter::parse("allreduce:rd").unwrap();
        assert_eq!(f.choose(CollKind::AllReduce, 1 << 30, 4), Algorithm::Doubling);
        assert_eq!(f.choose(CollKind::Reduce, 1 << 30, 4), Algorithm::Chain);
        assert!(AlgoFilter::parse("warp").is_err());
        assert!(AlgoFilter::parse("gossip:ring").is_err());
        assert_eq!(AlgoFilter::parse("").unwrap(), AlgoFilter::default());
    }

    #[test]
    fn forced_choice_must_fit() {
        assert!(check_forced(CollKind::AllReduce, Algorithm::Ring).is_ok());
        assert!(check_forced(CollKind::AllGather, Algorithm::Doubling).is_err());
    }
}
