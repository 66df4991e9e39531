//! All-to-all by pairwise exchange, barrier by dissemination, and point-to-point.
//!
//! **Pairwise all-to-all**: in step `s = 1 .. n-1` rank `r` sends its block for `r + s` and
//! receives the block from `r - s` (mod `n`); every link carries one block each way, and up to
//! [`WINDOW`](crate::transport::exchange::WINDOW) steps are in flight at once
//! (`Peers::all_to_all`), so a slow pair does not hold the others' next steps back.
//!
//! **Pairwise all-to-all-v**: the same steps, each block of the size the caller gives for that
//! pair (an empty block is still a frame, so every step completes the same way).
//!
//! **Dissemination barrier**: in round `k` rank `r` sends an empty frame to `r + 2^k` and waits
//! for one from `r - 2^k`; after `ceil(log2 n)` rounds every rank has (transitively) heard from
//! every other, whatever `n`.

use super::{Bufs, Group, OpContext, Scratch};
use crate::error::{Error, Result};
use crate::transport::exchange::Splits;
use crate::transport::{Sink, Source};

/// All-to-all: block `j` of this rank's input goes to rank `j`, whose output block `r` it
/// becomes. Blocks are `len / n` bytes.
pub fn all_to_all(ctx: &mut OpContext<'_>, scratch: &mut Scratch, bufs: Bufs<'_>) -> Result<()> {
    let n = ctx.size();
    let r = ctx.rank();
    let (src, dst): (&[u8], &mut [u8]) = match bufs {
        Bufs::InPlace(b) => {
            // Blocks are overwritten before they are sent: work from a copy.
            let copy = scratch.one(b.len());
            copy.copy_from_slice(b);
            (copy, b)
        }
        Bufs::OutOfPlace { send, recv } => (send, recv),
    };
    let block = dst.len() / n;
    let at = |j: usize| j * block..(j + 1) * block;
    dst[at(r)].copy_from_slice(&src[at(r)]);
    ctx.all_to_all(Group::World(n), r, 1, block, src, dst)
}

/// All-to-all-v: block `j` of this rank's input (`splits.send[j]..splits.send[j + 1]`) goes to
/// rank `j`, whose output block `r` it becomes; blocks differ in size, and each pair of ranks
/// agrees on the size of theirs (a frame of another length is an error). Out of place only.
pub fn all_to_all_v(ctx: &mut OpContext<'_>, splits: Splits<'_>, bufs: Bufs<'_>) -> Result<()> {
    let r = ctx.rank();
    let Bufs::OutOfPlace { send, recv } = bufs else {
        return Err(Error::Internal("all_to_all_v in place".into()));
    };
    let (mine, into) = (splits.send[r]..splits.send[r + 1], splits.recv[r]..splits.recv[r + 1]);
    if mine.len() != into.len() {
        return Err(Error::Internal("all_to_all_v: this rank's own block changes size".into()));
    }
    recv[into].copy_from_slice(&send[mine]);
    ctx.all_to_all_v(splits, send, recv)
}

/// Dissemination barrier.
pub fn barrier(ctx: &mut OpContext<'_>) -> Result<()> {
    let n = ctx.size();
    let r = ctx.rank();
    let mut k = 0;
    while (1usize << k) < n {
        let d = 1usize << k;
        ctx.exchange(
            k,
            Some(((r + d) % n, Source::Bytes(&[]))),
            Some(((r + n - d % n) % n, Sink::Copy(&mut []))),
        )?;
        k += 1;
    }
    Ok(())
}

/// Sends `buf` to `peer`.
pub fn send(ctx: &mut OpContext<'_>, buf: &[u8], peer: usize) -> Result<()> {
    ctx.exchange(0, Some((peer, Source::Bytes(buf))), None)
}

/// Receives into `buf` from `peer`.
pub fn recv(ctx: &mut OpContext<'_>, buf: &mut [u8], peer: usize) -> Result<()> {
    ctx.exchange(0, None, Some((peer, Sink::Copy(buf))))
}

#[cfg(test)]
mod tests {
    #[test]
    fn dissemination_rounds_cover_every_rank() {
        for n in 1..=17usize {
            // reach[r] = set of ranks r has heard from (transitively).
            let mut reach: Vec<Vec<bool>> = (0..n).map(|r| (0..n).map(|j| j == r).collect()).collect();
            let mut k = 0;
            while (1usize << k) < n {
                let d = 1 << k;
                let prev = reach.clone();
                for (r, row) in reach.iter_mut().enumerate() {
                    let from = (r + n - d % n) % n;
                    for (j, b) in row.iter_mut().enumerate() {
                        *b |= prev[from][j];
                    }
                }
                k += 1;
            }
            assert!(reach.iter().all(|row| row.iter().all(|b| *b)), "n={n}");
        }
    }
}
