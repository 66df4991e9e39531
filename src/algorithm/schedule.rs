//! Offset maths of the schedules, as pure functions.
//!
//! Everything here works in elements; callers multiply by the element size. Pieces are balanced:
//! when `count` does not divide evenly, the first `count % parts` pieces get one element more,
//! and pieces may be empty when `count < parts`.

use std::ops::Range;

/// The element range of piece `i` when `count` elements are cut into `parts` balanced pieces.
///
/// ```
/// use toroid::internals::algorithm::schedule::piece;
/// assert_eq!(piece(10, 3, 0), 0..4);
/// assert_eq!(piece(10, 3, 1), 4..7);
/// assert_eq!(piece(10, 3, 2), 7..10);
/// assert_eq!(piece(2, 4, 3), 2..2);
/// ```
pub fn piece(count: usize, parts: usize, i: usize) -> Range<usize> {
    assert!(parts > 0 && i < parts, "piece {i} of {parts}");
    let base = count / parts;
    let extra = count % parts;
    let start = i * base + i.min(extra);
    let len = base + usize::from(i < extra);
    start..start + len
}

/// `r` scaled to bytes for elements of `size` bytes.
pub fn bytes(r: Range<usize>, size: usize) -> Range<usize> {
    r.start * size..r.end * size
}

/// Ring reduce-scatter over `n` positions: the pieces position `i` sends and receives at step
/// `s` (`0 <= s < n - 1`). After the last step position `i` holds the reduction of piece `i`.
///
/// At step `s` position `i` sends piece `i - s - 1` and receives piece `i - s - 2` (mod `n`),
/// which is the piece its left neighbour sends at that step.
pub fn ring_reduce_scatter(n: usize, i: usize, s: usize) -> (usize, usize) {
    assert!(n >= 2 && i < n && s + 1 < n);
    ((i + 2 * n - s - 1) % n, (i + 2 * n - s - 2) % n)
}

/// Ring all-gather over `n` positions where position `i` starts with piece `i`: the pieces sent
/// and received at step `s` (`0 <= s < n - 1`): send `i - s`, receive `i - s - 1` (mod `n`).
pub fn ring_all_gather(n: usize, i: usize, s: usize) -> (usize, usize) {
    assert!(n >= 2 && i < n && s + 1 < n);
    ((i + n - s) % n, (i + 2 * n - s - 1) % n)
}

/// Recursive doubling on any `n` (MPICH's fold): the largest power of two `p <= n` ranks run
/// `log2 p` pairwise exchanges; the first `2 (n - p)` ranks pair up first, the even one handing
/// its data to the odd one and waiting for the result at the end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Doubling {
    /// Largest power of two not above `n`.
    pub pof2: usize,
    /// `n - pof2`: ranks that fold into a partner.
    pub rem: usize,
}

impl Doubling {
    /// The layout for `n` ranks.
    pub fn new(n: usize) -> Doubling {
        assert!(n >= 1);
        let pof2 = 1usize << (usize::BITS - 1 - n.leading_zeros());
        Doubling { pof2, rem: n - pof2 }
    }

    /// The rank among the `pof2` that `rank` plays, or `None` when it folds away.
    pub fn virtual_rank(&self, rank: usize) -> Option<usize> {
        if rank < 2 * self.rem { (rank % 2 == 1).then_some(rank / 2) } else { Some(rank - self.rem) }
    }

    /// The real rank that plays virtual rank `v`.
    pub fn real_rank(&self, v: usize) -> usize {
        if v < self.rem { 2 * v + 1 } else { v + self.rem }
    }

    /// Number of pairwise rounds among the `pof2`.
    pub fn rounds(&self) -> usize {
        self.pof2.trailing_zeros() as usize
    }
}

/// Recursive halving on `2^rounds` ranks, Rabenseifner's reduce-scatter: in round `k` virtual
/// rank `v` pairs with `v ^ 2^k`, keeps the half of its current block range selected by bit `k`
/// of `v` and sends the other half. Returns `(send, keep)` block ranges of round `k`; after all
/// rounds `v` keeps exactly one block (its bit-reversed index). The all-gather runs the same
/// rounds backwards, receiving what it sent.
pub fn halving_round(v: usize, rounds: usize, k: usize) -> (Range<usize>, Range<usize>) {
    let (mut lo, mut hi) = (0usize, 1usize << rounds);
    for j in 0..=k {
        let mid = (lo + hi) / 2;
        let (send, keep) = if v >> j & 1 == 0 { (mid..hi, lo..mid) } else { (lo..mid, mid..hi) };
        if j == k {
            return (send, keep);
        }
        (lo, hi) = (keep.start, keep.end);
    }
    unreachable!()
}

/// Binomial tree rooted at virtual rank 0 over `n` ranks: the parent of `v` (none for 0) and
/// its children in the order they are served (largest subtree first).
pub fn binomial_parent(v: usize) -> Option<usize> {
    (v != 0).then(|| v & (v - 1))
}

/// Children of virtual rank `v` in a binomial tree over `n` ranks, largest subtree first.
pub fn binomial_children(n: usize, v: usize) -> impl Iterator<Item = usize> {
    // v's children are v + 2^k for every k below v's lowest set bit (all k when v == 0).
    let limit = if v == 0 { usize::BITS } else { v.trailing_zeros() };
    (0..limit).rev().map(move |k| v + (1usize << k)).filter(move |&c| c < n && c > v)
}

/// Relative ("virtual") rank of `rank` when `root` is moved to 0.
pub fn relative(rank: usize, root: usize, n: usize) -> usize {
    (rank + n - root) % n
}

/// Real rank of relative rank `v`.
pub fn absolute(v: usize, root: usize, n: usize) -> usize {
    (v + root) % n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_the_range_in_order_and_balance() {
        for count in [0usize, 1, 2, 7, 10, 4099, 1 << 20] {
            for parts in 1..=9 {
                let mut next = 0;
                for i in 0..parts {
                    let r = piece(count, parts, i);
                    assert_eq!(r.start, next);
                    let len = r.len();
                    assert!(len == count / parts || len == count / parts + 1);
                    next = r.end;
                }
                assert_eq!(next, count);
            }
        }
        assert_eq!(bytes(3..5, 4), 12..20);
    }

    #[test]
    fn ring_reduce_scatter_reaches_every_piece_once() {
        for n in 2..=9 {
            for i in 0..n {
                let left = (i + n - 1) % n;
                let mut received = vec![false; n];
                for s in 0..n - 1 {
                    let (send, recv) = ring_reduce_scatter(n, i, s);
                    // What I receive is what my left neighbour sends at the same step.
                    assert_eq!(recv, ring_reduce_scatter(n, left, s).0);
                    // What I send from step 1 on is what I finished receiving the step before.
                    if s > 0 {
                        assert_eq!(send, ring_reduce_scatter(n, i, s - 1).1);
                    } else {
                        assert_ne!(send, i);
                    }
                    assert!(!received[recv]);
                    received[recv] = true;
                }
                // The last piece received (fully reduced) is my own; I never receive piece i - 1.
                assert_eq!(ring_reduce_scatter(n, i, n - 2).1, i);
                assert!(!received[(i + n - 1) % n]);
            }
        }
    }

    #[test]
    fn ring_all_gather_fills_every_piece_once() {
        for n in 2..=9 {
            for i in 0..n {
                let left = (i + n - 1) % n;
                let mut have = vec![false; n];
                have[i] = true;
                for s in 0..n - 1 {
                    let (send, recv) = ring_all_gather(n, i, s);
                    assert!(have[send], "n={n} i={i} s={s}: sends a piece it lacks");
                    assert_eq!(recv, ring_all_gather(n, left, s).0);
                    assert!(!have[recv]);
                    have[recv] = true;
                }
                assert!(have.iter().all(|h| *h));
            }
        }
    }

    #[test]
    fn doubling_fold_pairs_everyone() {
        for n in 1..=40 {
            let d = Doubling::new(n);
            assert!(d.pof2.is_power_of_two() && d.pof2 <= n && 2 * d.pof2 > n);
            let mut seen = vec![false; d.pof2];
            for r in 0..n {
                match d.virtual_rank(r) {
                    Some(v) => {
                        assert!(!seen[v]);
                        seen[v] = true;
                        assert_eq!(d.real_rank(v), r);
                    }
                    None => assert!(r < 2 * d.rem && r % 2 == 0),
                }
            }
            assert!(seen.iter().all(|s| *s));
            assert_eq!(1 << d.rounds(), d.pof2);
        }
    }

    #[test]
    fn halving_rounds_partition_the_blocks() {
        for rounds in 0..=5usize {
            let p = 1usize << rounds;
            let mut owner = vec![usize::MAX; p];
            for v in 0..p {
                let mut range = 0..p;
                for k in 0..rounds {
                    let (send, keep) = halving_round(v, rounds, k);
                    // Both halves split the current range; the partner keeps what we send.
                    assert_eq!(send.len(), keep.len());
                    assert!(range.start <= keep.start.min(send.start) && keep.end.max(send.end) <= range.end);
                    let (psend, pkeep) = halving_round(v ^ (1 << k), rounds, k);
                    assert_eq!((psend, pkeep), (keep.clone(), send.clone()));
                    range = keep;
                }
                assert_eq!(range.len(), 1);
                assert_eq!(owner[range.start], usize::MAX, "block owned twice");
                owner[range.start] = v;
            }
        }
    }

    #[test]
    fn binomial_tree_is_a_spanning_tree() {
        for n in 1..=33 {
            let mut reached = vec![false; n];
            reached[0] = true;
            for v in 0..n {
                for c in binomial_children(n, v) {
                    assert_eq!(binomial_parent(c), Some(v));
                    assert!(!reached[c]);
                    reached[c] = true;
                }
            }
            assert!(reached.iter().all(|r| *r), "n={n}");
            for v in 1..n {
                assert!(binomial_parent(v).unwrap() < v);
            }
        }
        assert_eq!(binomial_children(8, 0).collect::<Vec<_>>(), [4, 2, 1]);
        assert_eq!(binomial_children(6, 4).collect::<Vec<_>>(), [5]);
    }

    #[test]
    fn relative_and_absolute_invert() {
        for n in 1..=9 {
            for root in 0..n {
                for r in 0..n {
                    assert_eq!(absolute(relative(r, root, n), root, n), r);
                }
                assert_eq!(relative(root, root, n), 0);
            }
        }
    }
}
