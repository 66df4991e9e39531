//! Data: data sets (IDX files, class-per-directory image folders), per-rank sharding of each
//! epoch's permutation, and the threaded input pipeline.

pub mod echo;
pub mod folder;
pub mod idx;
pub mod pipeline;
pub mod slow;

use crate::error::Result;

/// A decoded image: 8-bit pixels, row-major, channels interleaved (HWC).
#[derive(Debug, Clone, PartialEq)]
pub struct Image {
    /// Rows.
    pub height: usize,
    /// Columns.
    pub width: usize,
    /// Channels per pixel (1 or 3).
    pub channels: usize,
    /// `height * width * channels` bytes.
    pub pixels: Vec<u8>,
}

/// One decoded, labelled example.
#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    /// The image.
    pub image: Image,
    /// Its class, `0..num_classes`.
    pub label: u32,
}

/// A random-access labelled image data set.
pub trait Dataset: Send + Sync {
    /// Number of examples.
    fn len(&self) -> usize;
    /// True when there are no examples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Number of classes.
    fn num_classes(&self) -> usize;
    /// Channels of every decoded image.
    fn channels(&self) -> usize;
    /// Reads and decodes example `i` (this is the expensive part for files on disk).
    fn get(&self, i: usize) -> Result<Example>;
    /// A one-line description for the log.
    fn describe(&self) -> String;
}

/// The examples rank `rank` of `world` reads in epoch `epoch`: a disjoint share of one random
/// permutation of `0..len` that every rank computes identically from `seed` (Goyal et al.: one
/// shuffle per epoch, partitioned across workers).
///
/// Rank r takes positions r, r + world, r + 2*world, ... of the permutation, so the first k
/// examples of every rank together are exactly the first k*world of the permutation: N ranks
/// with batch b see, step by step, the same examples as 1 rank with batch N*b. With `equal`
/// (training), every rank gets `len / world` examples so all ranks take the same number of
/// steps (the remainder is left out this epoch, a different remainder each epoch); otherwise
/// (evaluation) the shards cover every example and differ in length by at most one.
pub fn shard(
    len: usize,
    epoch: u64,
    seed: u64,
    rank: usize,
    world: usize,
    shuffle: bool,
    equal: bool,
) -> Vec<usize> {
    let mut perm: Vec<usize> = (0..len).collect();
    if shuffle {
        crate::rng::Rng::derive(seed, &[0x5045_524d, epoch]).shuffle(&mut perm);
    }
    let usable = if equal { len / world * world } else { len };
    perm[..usable].iter().skip(rank).step_by(world.max(1)).copied().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_are_disjoint_and_cover_the_permutation() {
        for world in 1..=5 {
            for len in [0, 1, 7, 60, 101] {
                let mut all = vec![];
                let mut lens = vec![];
                for r in 0..world {
                    let s = shard(len, 3, 42, r, world, true, true);
                    lens.push(s.len());
                    all.extend(s);
                }
                // Equal shards, disjoint, and together all but fewer than `world` examples.
                assert!(lens.iter().all(|&l| l == len / world));
                let mut sorted = all.clone();
                sorted.sort_unstable();
                sorted.dedup();
                assert_eq!(sorted.len(), all.len(), "overlap: world {world} len {len}");
                assert_eq!(all.len(), len / world * world);

                // Evaluation shards cover everything exactly once.
                let mut all: Vec<usize> =
                    (0..world).flat_map(|r| shard(len, 0, 0, r, world, false, false)).collect();
                all.sort_unstable();
                assert_eq!(all, (0..len).collect::<Vec<_>>());
            }
        }
    }

    #[test]
    fn shards_reproduce_the_single_rank_order_batch_by_batch() {
        let (len, world, b) = (1000, 3, 8);
        let one = shard(len, 5, 9, 0, 1, true, true);
        let shards: Vec<Vec<usize>> = (0..world).map(|r| shard(len, 5, 9, r, world, true, true)).collect();
        for step in 0..len / (world * b) {
            let mut global: Vec<usize> = one[step * world * b..(step + 1) * world * b].to_vec();
            let mut union: Vec<usize> =
                shards.iter().flat_map(|s| s[step * b..(step + 1) * b].to_vec()).collect();
            global.sort_unstable();
            union.sort_unstable();
            assert_eq!(global, union, "step {step}");
        }
        // A new epoch is a new permutation.
        assert_ne!(shard(len, 5, 9, 0, 1, true, true), shard(len, 6, 9, 0, 1, true, true));
    }
}
