//! The flag protocol of the stream-ordered collectives ([`super::ordered`]): how the ranks of a
//! host, each running one kernel on its own stream, hand chunks to each other through their
//! device windows without the host. It is written here once as plain logic over any memory
//! that has acquire loads and release stores ([`Signals`]), unit-tested on the CPU with threads,
//! and emitted as CUDA C for the kernels ([`cuda_source`]) from the same constants.
//!
//! Each rank owns a window (two halves, used by chunks in turn: double buffering) and a signal
//! area of 64-bit words. A collective is cut into chunks (one per window half); each chunk is
//! one **step**, numbered per block from 1 by a counter that lives in the rank's own signal area
//! (so a CUDA graph replays correctly: no step number is baked into a launch). Block `b` of every
//! rank handles the same slice of each chunk, and block `b`'s words are its own, so blocks never
//! wait on each other inside a rank. For step `s`, half `h = s mod 2`, block `b` of rank `me`:
//!
//! 1. writes its slice of half `h`, then **posts**: `fp[h][b] <- fingerprint`, then
//!    `post[h][b] <- s` (release);
//! 2. **may read** once every rank's `post[h][b] >= s` (acquire), and each rank's `fp[h][b]`
//!    equals its own fingerprint: the ranks make the same call, else it is an error on every
//!    rank (each sees the other's fingerprint), never a read of something else;
//! 3. reads every rank's slice of half `h`.
//!
//! Why a rank never overwrites a half another still reads: rank `p` writes half `h` for step
//! `s + 2` only after its step `s + 1` saw every rank's post of `s + 1`, and each rank posts
//! `s + 1` only after it finished reading step `s`. Every rank posts every step (a broadcast's
//! non-roots post nothing written), which is what makes this hold without a second flag.
//!
//! Why `post[h][b]` is exactly `s`, never ahead, when rank `me` reads it: a peer posts step
//! `s + 2` only after seeing `me`'s post of `s + 1`, which `me` makes after its read of `s`. So
//! one word per half holds the fingerprint of the step being read, and a mismatch is caught
//! even between a call's last chunk and the next call's first.
//!
//! Every wait has a deadline and also stops when the rank's status says the communicator
//! failed or was aborted ([`Fault`]); the kernels then record the fault in host memory the
//! host reads before the next call.

// The Rust form is the protocol's model, run by the unit tests on the CPU; the kernels run its
// CUDA C form (`cuda_source`), emitted from the same layout.
#![cfg_attr(not(test), allow(dead_code))]

use std::time::{Duration, Instant};

/// Ranks a stream-ordered collective takes at most (one host).
pub const MAX_RANKS: usize = 16;
/// Blocks of a launch at most (each has its own words).
pub const MAX_BLOCKS: usize = 128;
/// Words per (half, block): post, fingerprint, then padding to 64 bytes (one cache line, so
/// blocks never share a line).
const STRIDE: usize = 8;
/// Words of one rank's signal area: the per-(half, block) words, then one step counter per
/// block.
pub const SIGNAL_WORDS: usize = 2 * MAX_BLOCKS * STRIDE + MAX_BLOCKS;
/// Bytes of one rank's signal area (a multiple of 4 KiB).
pub const SIGNAL_BYTES: usize = (SIGNAL_WORDS * 8).div_ceil(4096) * 4096;

/// The word of `post[h][b]`.
pub const fn post_slot(h: usize, b: usize) -> usize {
    (h * MAX_BLOCKS + b) * STRIDE
}
/// The word of `fp[h][b]`.
pub const fn fp_slot(h: usize, b: usize) -> usize {
    post_slot(h, b) + 1
}
/// The word of block `b`'s step counter.
pub const fn step_slot(b: usize) -> usize {
    2 * MAX_BLOCKS * STRIDE + b
}
/// The half step `s` uses.
pub const fn half(s: u64) -> usize {
    (s & 1) as usize
}

/// Why a wait ended without its condition (the kernels write the same codes, with the peer,
/// into the status word: [`Fault::word`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The deadline passed waiting for rank `peer`.
    Timeout { peer: usize },
    /// Rank `peer` posted another call's fingerprint.
    Mismatch { peer: usize },
    /// The status said stop (another block's fault, a failed or aborted communicator).
    Stopped,
}

/// Status word codes (bits 0..8; the peer is in bits 8..16).
pub const CODE_TIMEOUT: u64 = 1;
/// See [`CODE_TIMEOUT`].
pub const CODE_MISMATCH: u64 = 2;

impl Fault {
    /// The status word that records this fault (0 for [`Fault::Stopped`], which records
    /// nothing: whoever stopped it recorded why).
    pub fn word(self) -> u64 {
        match self {
            Fault::Timeout { peer } => CODE_TIMEOUT | (peer as u64) << 8,
            Fault::Mismatch { peer } => CODE_MISMATCH | (peer as u64) << 8,
            Fault::Stopped => 0,
        }
    }

    /// The fault a non-zero status word records, if it is one of these codes.
    pub fn from_word(w: u64) -> Option<Fault> {
        let peer = ((w >> 8) & 0xff) as usize;
        match w & 0xff {
            CODE_TIMEOUT => Some(Fault::Timeout { peer }),
            CODE_MISMATCH => Some(Fault::Mismatch { peer }),
            _ => None,
        }
    }
}

/// The signal areas of every rank, as one rank sees them.
pub trait Signals {
    /// Word `slot` of rank `rank`'s area, with acquire ordering.
    fn load(&self, rank: usize, slot: usize) -> u64;
    /// Sets word `slot` of rank `rank`'s area (a rank writes only its own), with release
    /// ordering: everything this rank wrote before is visible to whoever loads the value.
    fn store(&self, rank: usize, slot: usize, value: u64);
    /// Whether to stop waiting (the status word is set, or an abort).
    fn stopped(&self) -> bool;
}

/// Waits until `ok(load(rank, slot))` for every rank but `me`, checking the deadline.
fn wait_all(
    sig: &impl Signals,
    me: usize,
    n: usize,
    slot: usize,
    deadline: Instant,
    ok: impl Fn(u64) -> bool,
) -> Result<(), Fault> {
    for r in (0..n).filter(|&r| r != me) {
        let mut spins = 0u32;
        while !ok(sig.load(r, slot)) {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) {
                if sig.stopped() {
                    return Err(Fault::Stopped);
                }
                if Instant::now() > deadline {
                    return Err(Fault::Timeout { peer: r });
                }
                std::thread::yield_now();
            }
        }
    }
    Ok(())
}

/// Step 1 (after writing): publishes step `s` of the call `fp`.
pub fn publish(sig: &impl Signals, me: usize, b: usize, s: u64, fp: u64) {
    sig.store(me, fp_slot(half(s), b), fp);
    sig.store(me, post_slot(half(s), b), s);
}

/// Step 2: waits until every rank has posted step `s`, and checks each made the call `fp`.
pub fn before_read(
    sig: &impl Signals,
    me: usize,
    n: usize,
    b: usize,
    s: u64,
    fp: u64,
    timeout: Duration,
) -> Result<(), Fault> {
    let h = half(s);
    wait_all(sig, me, n, post_slot(h, b), Instant::now() + timeout, |v| v >= s)?;
    match (0..n).find(|&r| r != me && sig.load(r, fp_slot(h, b)) != fp) {
        Some(peer) => Err(Fault::Mismatch { peer }),
        None => Ok(()),
    }
}

/// The call's fingerprint every rank compares: its kind, operation or root, type and count,
/// mixed (FNV-1a over the four words), never 0 (0 is an unwritten word).
pub fn fingerprint(words: [u64; 4]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for w in words {
        for byte in w.to_le_bytes() {
            h ^= u64::from(byte);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h | 1
}

/// The protocol as CUDA C: the layout's constants, acquire/release accessors at system scope,
/// and `tr_publish` and `tr_before_read`, each run by thread 0 of a block (the caller
/// synchronises the block around them). A wait polls the status words
/// (`status[0]`: the fault, `status[1]`: abort) every 1024 spins and reads `%globaltimer` for its
/// deadline; a fault is returned as its status word (0: none). With `TR_EMULATION` defined
/// the accessors, the clock and the spin hint come from the includer (a host compiler running
/// the kernels on threads: tests/ordered_emulation.rs).
pub fn cuda_source() -> String {
    format!(
        r#"
#define TR_MAX_RANKS {MAX_RANKS}
#define TR_MAX_BLOCKS {MAX_BLOCKS}
#define TR_POST(h, b) ((((h) * TR_MAX_BLOCKS) + (b)) * {STRIDE})
#define TR_FP(h, b) (TR_POST(h, b) + 1)
#define TR_STEP(b) (2 * TR_MAX_BLOCKS * {STRIDE} + (b))
#define TR_CODE_TIMEOUT {CODE_TIMEOUT}ull
#define TR_CODE_MISMATCH {CODE_MISMATCH}ull
#define TR_STOPPED 0xffull
#ifndef TR_EMULATION
__device__ __forceinline__ u64_t tr_load(const u64_t* p) {{
  u64_t v; asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory"); return v;
}}
__device__ __forceinline__ void tr_store(u64_t* p, u64_t v) {{
  asm volatile("st.release.sys.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}}
__device__ __forceinline__ u64_t tr_now() {{
  u64_t t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t;
}}
#define TR_SPIN_HINT()
#endif
__device__ __forceinline__ bool tr_stopped(const u64_t* status) {{
  return tr_load(status) != 0 || tr_load(status + 1) != 0;
}}
/* Waits until every rank but me has word `slot` >= want. */
__device__ u64_t tr_wait_all(u64_t* const* sig, int me, int n, int slot, u64_t want,
                             const u64_t* status, u64_t timeout_ns) {{
  for (int r = 0; r < n; r++) {{
    if (r == me) continue;
    unsigned spins = 0; u64_t t0 = 0;
    while (tr_load(sig[r] + slot) < want) {{
      TR_SPIN_HINT();
      if ((++spins & 1023u) == 0) {{
        if (tr_stopped(status)) return TR_STOPPED;
        u64_t t = tr_now();
        if (t0 == 0) t0 = t; else if (t - t0 > timeout_ns) return TR_CODE_TIMEOUT | ((u64_t)r << 8);
      }}
    }}
  }}
  return 0;
}}
__device__ void tr_publish(u64_t* const* sig, int me, int b, u64_t s, u64_t fp) {{
  __threadfence_system();
  tr_store(sig[me] + TR_FP(s & 1, b), fp);
  tr_store(sig[me] + TR_POST(s & 1, b), s);
}}
__device__ u64_t tr_before_read(u64_t* const* sig, int me, int n, int b, u64_t s, u64_t fp,
                                const u64_t* status, u64_t timeout_ns) {{
  u64_t f = tr_wait_all(sig, me, n, TR_POST(s & 1, b), s, status, timeout_ns);
  if (f) return f;
  for (int r = 0; r < n; r++)
    if (r != me && tr_load(sig[r] + TR_FP(s & 1, b)) != fp) return TR_CODE_MISMATCH | ((u64_t)r << 8);
  return 0;
}}
"#
    )
}

#[cfg(test)]
#[path = "signal_tests.rs"]
mod tests;
