//! Intra-host collectives over the shared window (`shm_direct`).
//!
//! When every rank lives on one host they all map one window (see [`crate::transport::window`]):
//! each rank owns two regions that everybody can read. A collective runs in chunks of at most a
//! region; chunk `g` uses region buffer `g mod 2`, so one chunk's copy-in overlaps the slowest
//! rank's reads of the previous one. Every phase ends with a `post` (a release store of the
//! rank's stage counter) and the next phase waits for the stages it needs.
//!
//! **all_reduce, large (two-shot, direct reduce-scatter then all-gather by reading).** The chunk
//! is cut into one slice per rank.
//!
//! ```text
//!   1. copy in    rank r copies its input slices j != r into its region        post
//!   2. reduce     rank r: out[r] = in[r] ⊕ region_j[r] for every j != r,
//!                 written to out and to its own region                           post
//!   3. gather     rank r copies region_j[j] (rank j's result) to out[j]          post (done)
//! ```
//!
//! Chunk `g + 1`'s copy-in runs between steps 2 and 3 of chunk `g` (it waits for nobody), so
//! it overlaps the slowest rank's reduction instead of waiting for it.
//!
//! Per rank and byte of message that is about `3 - 2/n` reads and 2 writes, where a ring over
//! point-to-point links moves `2 (n - 1) / n` of the message through a transport twice (copy in,
//! copy out) and synchronises `2 (n - 1)` times instead of twice.
//!
//! **all_reduce, small (one-shot).** Every rank copies its whole input into its region, posts,
//! and reduces all regions into its output itself, in member order (so every rank computes
//! bit-identical results): one synchronisation instead of two, at the price of `n` times the
//! reduction work, which is nothing for small messages.
//!
//! **reduce_scatter** is phases 1 and 2 (each rank reduces its own piece from every region);
//! **all_gather** copies each rank's piece into its region and every rank reads all regions;
//! **broadcast** has the root copy in and everyone else copy out; a **barrier** only posts and
//! waits for every member. Each rank posts the same number of stages per chunk in every
//! collective, so stage values keep meaning the same phase everywhere. `avg` pre-scales inputs
//! by `1/n` where they are copied in (as the ring does).
//!
//! Reductions run in blocks of [`BLOCK`] bytes, so a block of the output stays in L1 while
//! every source streams through it.

use std::sync::Arc;
use std::time::Instant;

use super::schedule;
use super::{Bufs, OpContext};
use crate::collective::Fingerprint;
use crate::dtype::{DataType, ReduceOp};
use crate::error::{Error, Result};
use crate::reduce;
use crate::transport::exchange::{AbortSignal, Peers};
use crate::transport::window::{RegionAt, WaitPolicy, Waiter, Window, copy_streaming, last_level_cache};

/// Bytes reduced at a time (a block of output stays in L1).
pub const BLOCK: usize = 16 * 1024;

/// Largest all-reduce (bytes) done one-shot with `n` ranks: every rank reduces the whole message,
/// so the limit shrinks as `n` grows. (2 ranks, AMD EPYC VM, 2026-11-30, toroid-bench 500
/// iterations alternating three times: 64 KiB one-shot 11.3 us, two-shot 10.0-10.1 us; 32 KiB
/// alike both ways.)
pub fn one_shot_max(n: usize) -> usize {
    match n {
        0..=2 => 32 * 1024,
        3..=4 => 16 * 1024,
        _ => 8 * 1024,
    }
}

/// The synchronisation context of one collective on the window.
struct Sync<'a> {
    peers: &'a mut Peers,
    fp: Fingerprint,
    deadline: Instant,
    policy: WaitPolicy,
    abort: Arc<AbortSignal>,
}

impl Sync<'_> {
    fn wait_all(&mut self, win: &mut Window, target: u32) -> Result<()> {
        let (fp, peers) = (self.fp, &mut *self.peers);
        let probe = &mut |m| {
            peers.progress().waiting(Some(m), 0);
            peers.poll_idle_links(&fp, m)
        };
        win.wait_all(
            target,
            &mut Waiter { fp: &fp, policy: &self.policy, deadline: self.deadline, abort: &self.abort, probe },
        )
    }

    fn wait(&mut self, win: &mut Window, m: usize, target: u32) -> Result<()> {
        let (fp, peers) = (self.fp, &mut *self.peers);
        let probe = &mut |m| {
            peers.progress().waiting(Some(m), 0);
            peers.poll_idle_links(&fp, m)
        };
        win.wait(
            m,
            target,
            &mut Waiter { fp: &fp, policy: &self.policy, deadline: self.deadline, abort: &self.abort, probe },
        )
    }

    fn begin_chunk(&mut self, win: &mut Window, writes: bool) -> Result<usize> {
        let (fp, peers) = (self.fp, &mut *self.peers);
        let probe = &mut |m| {
            peers.progress().waiting(Some(m), 0);
            peers.poll_idle_links(&fp, m)
        };
        win.begin_chunk(
            writes,
            &mut Waiter { fp: &fp, policy: &self.policy, deadline: self.deadline, abort: &self.abort, probe },
        )
    }
}

/// Runs `f` on the window the engine lent this operation, while its waits probe the links.
fn with_window(
    ctx: &mut OpContext<'_>,
    f: impl FnOnce(&mut Window, &mut Sync<'_>) -> Result<()>,
) -> Result<()> {
    let Some(win) = ctx.window.as_deref_mut() else {
        return Err(Error::InvalidArgument(
            "algorithm shm_direct needs every rank on one host with a shared-memory window \
             (see TOROID_SHM_DISABLE, TOROID_SHM_CHUNK_SIZE and the WARN lines at set-up)"
                .into(),
        ));
    };
    let spin = ctx.peers.spin_policy();
    let policy = WaitPolicy { spin: spin.spin, oversubscribed: win.oversubscribed() };
    let abort = ctx.peers.abort_signal().clone();
    win.begin(&ctx.fp);
    let mut sync = Sync { peers: &mut *ctx.peers, fp: ctx.fp, deadline: ctx.deadline, policy, abort };
    f(win, &mut sync)
}

/// Element ranges of chunk `c` of `count` elements in chunks of `per` elements.
fn chunks(count: usize, per: usize) -> impl Iterator<Item = (usize, usize)> {
    let per = per.max(1);
    let n = count.div_ceil(per).max(1);
    (0..n).map(move |c| (c * per, ((c + 1) * per).min(count)))
}

/// `dst = src · 1/n` for avg, else a copy into the window.
fn put_input(win: &mut Window, buf: usize, off: usize, src: &[u8], dtype: DataType, avg: Option<f64>) {
    match avg {
        Some(f) => win.put_scaled(buf, off, src, dtype, f),
        None => win.put(buf, off, src),
    }
}

/// The reduction a window collective applies: element type, operator (`Sum` for avg) and avg's
/// `1/n` pre-scale of the inputs (see [`avg_factor`]).
#[derive(Debug, Clone, Copy)]
struct Reduction {
    dtype: DataType,
    op: ReduceOp,
    avg: Option<f64>,
}

/// Where [`reduce_slice`] puts my reduced slice: `dst`, also my region at `publish` when given,
/// through an L1 block and streaming stores when `stream`.
struct Output<'a> {
    dst: &'a mut [u8],
    publish: Option<usize>,
    stream: bool,
}

/// Reduces my slice: `dst = first ⊕ region_j[off..]` over every member `j != me`, where `first`
/// is `src` (scaled for avg) or, when `src` is `None`, `dst` itself; also writes the result to
/// my region at `publish` when given. Block by block; with `stream`, each block is reduced in a
/// small buffer that stays in L1 and streamed to `dst` (see [`copy_streaming`]).
fn reduce_slice(
    win: &mut Window,
    buf: usize,
    off: usize,
    src: Option<&[u8]>,
    red: Reduction,
    out: Output<'_>,
) {
    let Reduction { dtype, op, avg } = red;
    let Output { dst, publish, stream } = out;
    let me = win.me();
    let n = win.members();
    let block = BLOCK - BLOCK % dtype.size();
    let mut tmp = [0u64; BLOCK / 8];
    let mut at = 0;
    while at < dst.len() {
        let len = block.min(dst.len() - at);
        let out = &mut dst[at..at + len];
        // In place the first operand is the output itself: copy it into the block first.
        if stream && src.is_none() {
            bytemuck::cast_slice_mut::<u64, u8>(&mut tmp)[..len].copy_from_slice(out);
        }
        let d: &mut [u8] =
            if stream { &mut bytemuck::cast_slice_mut::<u64, u8>(&mut tmp)[..len] } else { out };
        let mut peers = (0..n).filter(|&j| j != me);
        match (src, avg) {
            (Some(s), Some(f)) => reduce::scale_into(dtype, d, &s[at..at + len], f),
            (None, Some(f)) => reduce::scale_inplace(dtype, d, f),
            (Some(s), None) => {
                if let Some(j) = peers.next() {
                    win.reduce_into_from(
                        RegionAt { member: j, buf, off: off + at },
                        d,
                        &s[at..at + len],
                        dtype,
                        op,
                    );
                } else {
                    reduce::copy(d, &s[at..at + len]);
                }
            }
            (None, None) => {}
        }
        for j in peers {
            win.reduce_from(j, buf, off + at, d, dtype, op);
        }
        if let Some(p) = publish {
            win.put(buf, p + at, d);
        }
        if stream {
            copy_streaming(&mut dst[at..at + len], &bytemuck::cast_slice::<u64, u8>(&tmp)[..len]);
        }
        at += len;
    }
}

/// Whether outputs of `bytes` per rank should be written with streaming stores: when every
/// rank's input and output together overflow the last-level cache, the output would be evicted
/// before anyone reads it again, and streaming saves reading each line before writing it.
fn streaming(bytes: usize, members: usize) -> bool {
    2 * bytes * members > last_level_cache()
}

fn avg_factor(op: ReduceOp, n: usize) -> (ReduceOp, Option<f64>) {
    if op == ReduceOp::Avg { (ReduceOp::Sum, Some(1.0 / n as f64)) } else { (op, None) }
}

/// All-reduce on the window (one-shot for small messages, two-shot otherwise).
pub fn all_reduce(ctx: &mut OpContext<'_>, bufs: Bufs<'_>, dtype: DataType, op: ReduceOp) -> Result<()> {
    with_window(ctx, |win, sync| {
        let n = win.members();
        let es = dtype.size();
        let (op, avg) = avg_factor(op, n);
        let (src, out): (Option<&[u8]>, &mut [u8]) = match bufs {
            Bufs::InPlace(b) => (None, b),
            Bufs::OutOfPlace { send, recv } => (Some(send), recv),
        };
        let count = out.len() / es;
        if out.len() <= one_shot_max(n).min(win.region()) {
            one_shot(win, sync, src, out, Reduction { dtype, op, avg })
        } else {
            two_shot(win, sync, src, out, count, Reduction { dtype, op, avg })
        }
    })
}

fn one_shot(
    win: &mut Window,
    sync: &mut Sync<'_>,
    src: Option<&[u8]>,
    out: &mut [u8],
    red: Reduction,
) -> Result<()> {
    let Reduction { dtype, op, avg } = red;
    let n = win.members();
    let b = sync.begin_chunk(win, true)?;
    put_input(win, b, 0, src.unwrap_or(&*out), dtype, avg);
    let s = win.post();
    sync.wait_all(win, s)?;
    // Every rank reduces all regions in member order: identical results everywhere.
    let block = BLOCK - BLOCK % dtype.size();
    let mut at = 0;
    while at < out.len() {
        let len = block.min(out.len() - at);
        let d = &mut out[at..at + len];
        win.reduce_two(
            RegionAt { member: 0, buf: b, off: at },
            RegionAt { member: 1, buf: b, off: at },
            d,
            dtype,
            op,
        );
        for j in 2..n {
            win.reduce_from(j, b, at, d, dtype, op);
        }
        at += len;
    }
    win.end_chunk(b);
    Ok(())
}

fn two_shot(
    win: &mut Window,
    sync: &mut Sync<'_>,
    src: Option<&[u8]>,
    out: &mut [u8],
    count: usize,
    red: Reduction,
) -> Result<()> {
    let Reduction { dtype, avg, .. } = red;
    let n = win.members();
    let me = win.me();
    let es = dtype.size();
    let stream = streaming(out.len(), n);
    let per = win.region() / es;
    let total = count.div_ceil(per).max(1);
    let range = |g: usize| (g * per, ((g + 1) * per).min(count));
    let slice = |g: usize, j: usize| {
        let (c0, c1) = range(g);
        schedule::bytes(schedule::piece(c1 - c0, n, j), es)
    };
    // 1. Copy in every slice of chunk `g` that the others reduce; returns (buffer, stage).
    let copy_in = |win: &mut Window, sync: &mut Sync<'_>, out: &[u8], g: usize| -> Result<(usize, u32)> {
        let b = sync.begin_chunk(win, true)?;
        let base = range(g).0 * es;
        for j in (0..n).filter(|&j| j != me) {
            let r = slice(g, j);
            let input = match src {
                Some(s) => &s[base + r.start..base + r.end],
                None => &out[base + r.start..base + r.end],
            };
            put_input(win, b, r.start, input, dtype, avg);
        }
        Ok((b, win.post()))
    };
    // The next chunk's copy-in runs while the others still reduce this one, so a rank that is
    // late (or descheduled) delays the others by less.
    let mut next = Some(copy_in(win, sync, out, 0)?);
    for g in 0..total {
        let Some((b, data)) = next.take() else { break };
        let base = range(g).0 * es;
        sync.wait_all(win, data)?;
        // 2. Reduce my slice from everyone's region, into the output and my region.
        let r = slice(g, me);
        let own = src.map(|s| &s[base + r.start..base + r.end]);
        let dst = &mut out[base + r.start..base + r.end];
        reduce_slice(win, b, r.start, own, red, Output { dst, publish: Some(r.start), stream });
        let reduced = win.post();
        if g + 1 < total {
            next = Some(copy_in(win, sync, out, g + 1)?);
        }
        sync.wait_all(win, reduced)?;
        // 3. Gather the others' results.
        for j in (0..n).filter(|&j| j != me) {
            let r = slice(g, j);
            win.get_to(j, b, r.start, &mut out[base + r.start..base + r.end], stream);
        }
        win.end_chunk(b);
    }
    Ok(())
}

/// Reduce-scatter on the window: in place the result lands in this rank's piece of the buffer,
/// out of place in `recv`.
pub fn reduce_scatter(ctx: &mut OpContext<'_>, bufs: Bufs<'_>, dtype: DataType, op: ReduceOp) -> Result<()> {
    with_window(ctx, |win, sync| {
        let n = win.members();
        let me = win.me();
        let es = dtype.size();
        let (op, avg) = avg_factor(op, n);
        let (src, buf, in_place) = match bufs {
            Bufs::InPlace(b) => (None, b, true),
            Bufs::OutOfPlace { send, recv } => (Some(send), recv, false),
        };
        let total = src.map_or(buf.len(), <[u8]>::len);
        let count = total / es / n;
        let piece = count * es;
        let stream = streaming(total, n);
        // A chunk holds one sub-slice per member in a region.
        for (c0, c1) in chunks(count, win.region() / n / es) {
            let sub = (c1 - c0) * es;
            let (a, z) = (c0 * es, c1 * es);
            let b = sync.begin_chunk(win, true)?;
            for j in (0..n).filter(|&j| j != me) {
                let input = match src {
                    Some(s) => &s[j * piece + a..j * piece + z],
                    None => &buf[j * piece + a..j * piece + z],
                };
                put_input(win, b, j * sub, input, dtype, avg);
            }
            let s = win.post();
            sync.wait_all(win, s)?;
            let (dst, own) = if in_place {
                (&mut buf[me * piece + a..me * piece + z], None)
            } else {
                let own = src.map(|s| &s[me * piece + a..me * piece + z]);
                (&mut buf[a..z], own)
            };
            reduce_slice(
                win,
                b,
                me * sub,
                own,
                Reduction { dtype, op, avg },
                Output { dst, publish: None, stream },
            );
            win.end_chunk(b);
        }
        Ok(())
    })
}

/// All-gather on the window: every rank's piece lands at its position of the output.
pub fn all_gather(ctx: &mut OpContext<'_>, bufs: Bufs<'_>) -> Result<()> {
    with_window(ctx, |win, sync| {
        let n = win.members();
        let me = win.me();
        let out = match bufs {
            Bufs::InPlace(b) => b,
            Bufs::OutOfPlace { send, recv } => {
                let p = send.len();
                reduce::copy(&mut recv[me * p..(me + 1) * p], send);
                recv
            }
        };
        let piece = out.len() / n;
        let stream = streaming(out.len(), n);
        for (a, z) in chunks(piece, win.region()) {
            let b = sync.begin_chunk(win, true)?;
            win.put(b, 0, &out[me * piece + a..me * piece + z]);
            let s = win.post();
            sync.wait_all(win, s)?;
            for j in (0..n).filter(|&j| j != me) {
                win.get_to(j, b, 0, &mut out[j * piece + a..j * piece + z], stream);
            }
            win.end_chunk(b);
        }
        Ok(())
    })
}

/// Barrier on the window: every member posts one stage and waits for everyone's (one
/// synchronisation, where dissemination over point-to-point links takes `log2 n` rounds of
/// messages and links `log2 n` peers).
pub fn barrier(ctx: &mut OpContext<'_>) -> Result<()> {
    with_window(ctx, |win, sync| {
        let b = sync.begin_chunk(win, false)?;
        let s = win.post();
        sync.wait_all(win, s)?;
        win.end_chunk(b);
        Ok(())
    })
}

/// Broadcast from `root` on the window.
pub fn broadcast(ctx: &mut OpContext<'_>, bufs: Bufs<'_>, root: usize) -> Result<()> {
    with_window(ctx, |win, sync| {
        let me = win.me();
        let out = match bufs {
            Bufs::InPlace(b) => b,
            Bufs::OutOfPlace { send, recv } => {
                if me == root {
                    reduce::copy(recv, send);
                }
                recv
            }
        };
        let stream = streaming(out.len(), win.members());
        for (a, z) in chunks(out.len(), win.region()) {
            let b = sync.begin_chunk(win, me == root)?;
            if me == root {
                win.put(b, 0, &out[a..z]);
            }
            let s = win.post();
            if me != root {
                sync.wait(win, root, s)?;
                win.get_to(root, b, 0, &mut out[a..z], stream);
            }
            win.end_chunk(b);
        }
        Ok(())
    })
}
