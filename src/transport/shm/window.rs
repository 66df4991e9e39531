//! A shared window: one segment mapped by every rank of a group on one host.
//!
//! It gives each member a control block and two data regions ("buffers" 0 and 1) that every
//! member can read, so a collective can move data with plain loads and stores: a member writes
//! its own region, publishes that with a counter, and the others read it after seeing the
//! counter (see `algorithm::intra` for the schedules).
//!
//! ```text
//! offset 0        header: magic, version, nonce, members, region size | aborted flag
//!        4096     member i control (512 bytes each):
//!                   +0    stage    u32, only member i stores it (release); futex word
//!                   +128  waiters  u32, members sleeping on `stage` (others add/subtract)
//!                   +256  fingerprints of the last 4 collectives, 64 bytes each
//!        data     member i, buffer b at data + (2 i + b) * region   (page aligned)
//! ```
//!
//! **Stages.** Each member counts the phases it has finished in `stage` (wrapping `u32`; every
//! member runs the same schedule, so equal values mean the same phase). Waiting for member `m`
//! to reach `t` spins (pure spinning for a few microseconds, only when every rank has its own
//! core), then yields the CPU until the spin budget is spent, then sleeps on a futex on `m`'s
//! `stage` word in short slices. `post` stores the new stage and wakes sleepers only when the
//! `waiters` count says there are some (a sequentially consistent fence on both sides: either
//! the waiter sees the new stage or the poster sees the waiter). Between slices a waiter checks
//! the deadline, the abort signal, the window's abort flag and, through a caller-supplied probe,
//! the member's connection: a member that died is an error within milliseconds, and a member
//! whose stage is already past the target is fine even if it has exited since.
//!
//! **Buffers.** Chunk `g` of a collective uses buffer `g mod 2`. Before a member writes its
//! region of buffer `b` it waits until every member's stage is past the value at which the chunk
//! that last used `b` ended ([`Window::begin_chunk`]): nobody still reads it. The wait is nearly
//! always already satisfied (and checked against cached stages, without touching shared lines).
//!
//! **Fingerprints.** At the start of its `k`-th collective on the window each member writes the
//! collective's fingerprint into slot `k mod 4`; a waiter compares the slot of each member it
//! waits for once per collective, so ranks that issued different collectives get a mismatch
//! error rather than wrong data. Four slots suffice: while a member is in window collective `k`,
//! no other member can start `k + 4` (by the buffer rule, starting to write chunk `g + 2` needs
//! everyone done with chunk `g`, and a member that writes nothing waits for one that does). The
//! count is of window collectives, not sequence numbers: other collectives in between (over the
//! point-to-point links) do not hold the window's members together.
//!
//! The data methods copy or reduce between private buffers and regions. They are safe to call;
//! their correctness (no member writes a region while another reads it) rests on the protocol,
//! which every schedule in `algorithm::intra` follows.

use std::io;
use std::sync::atomic::{AtomicU32, Ordering, fence};
use std::time::{Duration, Instant};

use super::Segment;
use crate::collective::{FINGERPRINT_LEN, Fingerprint};
use crate::dtype::{DataType, ReduceOp};
use crate::error::{Error, Result};
use crate::reduce;
use crate::transport::exchange::AbortSignal;

mod streaming;
mod wait;

pub use streaming::{copy_streaming, last_level_cache};

const WIN_MAGIC: u64 = u64::from_le_bytes(*b"TRSHMWIN");
const WIN_VERSION: u64 = 1;
const HDR_MAGIC: usize = 0;
const HDR_VERSION: usize = 8;
const HDR_NONCE: usize = 16;
const HDR_MEMBERS: usize = 24;
const HDR_REGION: usize = 32;
/// Members other than the creator that have mapped the window; the last one removes its name.
const HDR_ATTACHED: usize = 40;
const HDR_ABORTED: usize = 128;
const CTL_BASE: usize = 4096;
const MEMBER_CTL: usize = 512;
const STAGE: usize = 0;
const WAITERS: usize = 128;
const FP_SLOTS: usize = 256;
const FP_LEN: usize = 64;
const PAGE: usize = 4096;
/// Longest futex sleep between liveness checks.
const SLICE: Duration = Duration::from_millis(5);
/// Pure spinning before yielding (only when ranks do not outnumber cores).
const PURE_SPIN: Duration = Duration::from_micros(20);

/// Bytes of a window for `members` members with regions of `region` bytes.
pub fn window_len(members: usize, region: usize) -> usize {
    data_base(members) + 2 * members * region
}

fn data_base(members: usize) -> usize {
    (CTL_BASE + members * MEMBER_CTL).div_ceil(PAGE) * PAGE
}

/// How a waiting member spends its time.
#[derive(Debug, Clone, Copy)]
pub struct WaitPolicy {
    /// Time to poll before sleeping on the futex.
    pub spin: Duration,
    /// Ranks outnumber cores: yield from the start instead of spinning.
    pub oversubscribed: bool,
}

/// What a waiter checks between futex slices: `Ok(true)` when the awaited member's connection
/// has closed (it exited or crashed), `Err` to stop waiting (an abort frame, a mismatch).
pub type Probe<'a> = &'a mut dyn FnMut(usize) -> Result<bool>;

/// How one collective waits for the other members: which collective it is (checked against
/// their fingerprints, named in errors), how it spends its time, until when, what cancels it
/// and how it learns that a member's connection closed.
pub struct Waiter<'a> {
    /// The running collective.
    pub fp: &'a Fingerprint,
    /// Spin budget and oversubscription.
    pub policy: &'a WaitPolicy,
    /// When waiting becomes a timeout.
    pub deadline: Instant,
    /// The communicator's abort.
    pub abort: &'a AbortSignal,
    /// Liveness of the awaited member (see [`Probe`]).
    pub probe: Probe<'a>,
}

impl std::fmt::Debug for Waiter<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waiter")
            .field("fp", &self.fp)
            .field("policy", &self.policy)
            .field("deadline", &self.deadline)
            .finish_non_exhaustive()
    }
}

/// A place in the window: byte `off` of member `member`'s region of buffer `buf`.
#[derive(Debug, Clone, Copy)]
pub struct RegionAt {
    /// Whose region.
    pub member: usize,
    /// Buffer 0 or 1.
    pub buf: usize,
    /// Bytes into the region.
    pub off: usize,
}

/// One member's view of a shared window.
#[derive(Debug)]
pub struct Window {
    seg: Segment,
    members: usize,
    me: usize,
    region: usize,
    /// My stage (what I last posted).
    stage: u32,
    /// The last stage seen of every member (a lower bound of its real stage).
    seen: Vec<u32>,
    /// Chunks started (global across collectives).
    chunks: u64,
    /// Stage at which the last chunk using buffer `b` ended.
    done_at: [u32; 2],
    /// Fingerprint of the running collective was checked for these members.
    fp_checked: Vec<bool>,
    /// Collectives run on this window (every member counts the same); the running one's
    /// fingerprint lives in slot `colls mod 4`.
    colls: u64,
    /// More members than online CPUs: waiters yield from the start.
    oversubscribed: bool,
    /// How waits went (logged at DEBUG when the window is dropped).
    stats: WaitStats,
}

/// Counters of a window's waits.
#[derive(Debug, Default, Clone, Copy)]
pub struct WaitStats {
    /// Waits that found the member behind.
    pub waits: u64,
    /// CPU yields while spinning.
    pub yields: u64,
    /// Waits that went to sleep on the futex.
    pub sleeps: u64,
    /// Futex sleeps (a wait may take several).
    pub naps: u64,
    /// Time spent spinning and yielding.
    pub spin_time: Duration,
    /// Time spent asleep.
    pub sleep_time: Duration,
}

impl Drop for Window {
    fn drop(&mut self) {
        tracing::debug!(target: "toroid::net", "local rank {}: window waits {:?}", self.me, self.stats);
    }
}

fn reached(v: u32, target: u32) -> bool {
    (v.wrapping_sub(target) as i32) >= 0
}

impl Window {
    /// Initialises a freshly created (zeroed) segment as a window.
    pub fn init(seg: Segment, members: usize, me: usize, region: usize, nonce: u64) -> Result<Window> {
        if seg.len() < window_len(members, region) {
            return Err(Error::Internal("window segment too small".into()));
        }
        seg.u64_at(HDR_VERSION).store(WIN_VERSION, Ordering::Relaxed);
        seg.u64_at(HDR_NONCE).store(nonce, Ordering::Relaxed);
        seg.u64_at(HDR_MEMBERS).store(members as u64, Ordering::Relaxed);
        seg.u64_at(HDR_REGION).store(region as u64, Ordering::Relaxed);
        seg.u64_at(HDR_MAGIC).store(WIN_MAGIC, Ordering::Release);
        Ok(Window::wrap(seg, members, me, region))
    }

    /// Adopts a window another member created, after checking its header.
    pub fn attach(seg: Segment, members: usize, me: usize, region: usize, nonce: u64) -> io::Result<Window> {
        let bad =
            |what: &str| io::Error::new(io::ErrorKind::InvalidData, format!("window header: bad {what}"));
        if seg.len() < window_len(members, region) {
            return Err(bad("size"));
        }
        if seg.u64_at(HDR_MAGIC).load(Ordering::Acquire) != WIN_MAGIC {
            return Err(bad("magic"));
        }
        if seg.u64_at(HDR_VERSION).load(Ordering::Relaxed) != WIN_VERSION {
            return Err(bad("version"));
        }
        if seg.u64_at(HDR_NONCE).load(Ordering::Relaxed) != nonce {
            return Err(bad("nonce"));
        }
        if seg.u64_at(HDR_MEMBERS).load(Ordering::Relaxed) != members as u64
            || seg.u64_at(HDR_REGION).load(Ordering::Relaxed) != region as u64
        {
            return Err(bad("shape"));
        }
        let mut w = Window::wrap(seg, members, me, region);
        // The name is needed only until every member has mapped the segment: the last to map
        // it removes it at once, so a crash from here on cannot leave it behind (the creator
        // removes it too once everyone has answered, or when set-up fails).
        let attached = w.seg.u64_at(HDR_ATTACHED).fetch_add(1, Ordering::AcqRel) + 1;
        if attached + 1 >= members as u64 {
            w.unlink();
        }
        Ok(w)
    }

    fn wrap(seg: Segment, members: usize, me: usize, region: usize) -> Window {
        Window {
            seg,
            members,
            me,
            region,
            stage: 0,
            seen: vec![0; members],
            chunks: 0,
            done_at: [0; 2],
            fp_checked: vec![false; members],
            colls: 0,
            oversubscribed: members > crate::sys::cpu::online_cpus(),
            stats: WaitStats::default(),
        }
    }

    /// Removes the segment's name (once every member has mapped it).
    pub fn unlink(&mut self) {
        self.seg.unlink();
    }

    /// Number of members.
    pub fn members(&self) -> usize {
        self.members
    }

    /// My index.
    pub fn me(&self) -> usize {
        self.me
    }

    /// Bytes of each region.
    pub fn region(&self) -> usize {
        self.region
    }

    /// True when members outnumber the host's online CPUs (waiters yield instead of spinning).
    pub fn oversubscribed(&self) -> bool {
        self.oversubscribed
    }

    fn ctl(&self, m: usize) -> usize {
        CTL_BASE + m * MEMBER_CTL
    }

    fn stage_word(&self, m: usize) -> &AtomicU32 {
        self.seg.u32_at(self.ctl(m) + STAGE)
    }

    fn region_offset(&self, m: usize, buf: usize, off: usize, len: usize) -> usize {
        assert!(m < self.members && buf < 2 && off + len <= self.region, "window access out of bounds");
        data_base(self.members) + (2 * m + buf) * self.region + off
    }

    /// Bytes of member `m`'s region `buf` at `off`.
    ///
    /// Only for the duration of one kernel call, while the protocol guarantees that member `m`
    /// does not write them (it posted them and waits for us before touching the buffer again).
    fn theirs(&self, m: usize, buf: usize, off: usize, len: usize) -> &[u8] {
        let at = self.region_offset(m, buf, off, len);
        // SAFETY: in bounds of the live mapping (checked); the protocol keeps writers away
        // while readers hold this slice (see the module docs).
        unsafe { std::slice::from_raw_parts(self.seg.as_ptr().add(at), len) }
    }

    /// Bytes of my own region `buf` at `off`, for writing (nobody reads them before I post).
    fn mine(&mut self, buf: usize, off: usize, len: usize) -> &mut [u8] {
        let at = self.region_offset(self.me, buf, off, len);
        // SAFETY: in bounds of the live mapping (checked); only this member writes its region,
        // through `&mut self`, so one slice at a time, and readers wait for a later post (see
        // the module docs).
        unsafe { std::slice::from_raw_parts_mut(self.seg.as_ptr().add(at), len) }
    }

    // --- data -----------------------------------------------------------------------------

    /// Copies `src` into my region `buf` at `off`.
    pub fn put(&mut self, buf: usize, off: usize, src: &[u8]) {
        reduce::copy(self.mine(buf, off, src.len()), src);
    }

    /// Writes `src · factor` into my region `buf` at `off` (floating types).
    pub fn put_scaled(&mut self, buf: usize, off: usize, src: &[u8], dtype: DataType, factor: f64) {
        reduce::scale_into(dtype, self.mine(buf, off, src.len()), src, factor);
    }

    /// As [`Window::get`], with non-temporal stores when `stream` (see [`copy_streaming`]).
    pub fn get_to(&self, m: usize, buf: usize, off: usize, dst: &mut [u8], stream: bool) {
        let src = self.theirs(m, buf, off, dst.len());
        if stream { copy_streaming(dst, src) } else { reduce::copy(dst, src) }
    }

    /// `dst = dst ⊕ region(m, buf)[off..]`.
    pub fn reduce_from(
        &self,
        m: usize,
        buf: usize,
        off: usize,
        dst: &mut [u8],
        dtype: DataType,
        op: ReduceOp,
    ) {
        reduce::reduce_inplace(dtype, op, dst, self.theirs(m, buf, off, dst.len()));
    }

    /// `dst = a ⊕ region(at.member, at.buf)[at.off..]`.
    pub fn reduce_into_from(&self, at: RegionAt, dst: &mut [u8], a: &[u8], dtype: DataType, op: ReduceOp) {
        reduce::reduce_into(dtype, op, dst, a, self.theirs(at.member, at.buf, at.off, dst.len()));
    }

    /// `dst = region(x.member, x.buf)[x.off..] ⊕ region(y.member, y.buf)[y.off..]`.
    pub fn reduce_two(&self, x: RegionAt, y: RegionAt, dst: &mut [u8], dtype: DataType, op: ReduceOp) {
        let len = dst.len();
        let (x, y) = (self.theirs(x.member, x.buf, x.off, len), self.theirs(y.member, y.buf, y.off, len));
        reduce::reduce_into(dtype, op, dst, x, y);
    }

    // --- synchronisation -------------------------------------------------------------------

    /// Starts a collective: publishes my fingerprint (read by the others before they use my
    /// data) and forgets which members were checked.
    pub fn begin(&mut self, fp: &Fingerprint) {
        self.colls += 1;
        let slot = self.ctl(self.me) + FP_SLOTS + (self.colls % 4) as usize * FP_LEN;
        for (i, w) in fp_words(fp).iter().enumerate() {
            self.seg.u64_at(slot + 8 * i).store(*w, Ordering::Relaxed);
        }
        self.fp_checked.iter_mut().for_each(|c| *c = false);
        self.fp_checked[self.me] = true;
    }

    fn check_fp(&mut self, m: usize, fp: &Fingerprint) -> Result<()> {
        if self.fp_checked[m] {
            return Ok(());
        }
        let slot = self.ctl(m) + FP_SLOTS + (self.colls % 4) as usize * FP_LEN;
        let mut w = [0u64; 4];
        for (i, x) in w.iter_mut().enumerate() {
            *x = self.seg.u64_at(slot + 8 * i).load(Ordering::Relaxed);
        }
        if w != fp_words(fp) {
            return Err(Error::InvalidUsage(
                format!(
                    "collective mismatch: {fp} on local rank {} but local rank {m} called {} \
                 (every rank must issue the same collectives in the same order with the same \
                 type, count, op, root and algorithm)",
                    self.me,
                    describe_fp(&w)
                )
                .into(),
            )
            // Members are the communicator's ranks (the window exists when all are on this host).
            .with_peer(m));
        }
        self.fp_checked[m] = true;
        Ok(())
    }

    /// Finishes a phase: stage + 1, visible to the other members (release), waking sleepers.
    pub fn post(&mut self) -> u32 {
        self.stage = self.stage.wrapping_add(1);
        let word = self.stage_word(self.me);
        word.store(self.stage, Ordering::Release);
        fence(Ordering::SeqCst);
        let waiters = self.seg.u32_at(self.ctl(self.me) + WAITERS);
        if waiters.load(Ordering::Relaxed) != 0 {
            crate::sys::futex::wake(word);
        }
        self.stage
    }

    /// Starts a chunk: returns its buffer. When this member will write its region (`writes`),
    /// first waits until every member is done with the chunk that last used that buffer.
    pub fn begin_chunk(&mut self, writes: bool, w: &mut Waiter<'_>) -> Result<usize> {
        let buf = (self.chunks % 2) as usize;
        self.chunks += 1;
        if writes {
            let target = self.done_at[buf];
            let start = Instant::now();
            for m in 0..self.members {
                if m != self.me && !reached(self.seen[m], target) {
                    self.wait_at(m, target, w, start, false)?;
                }
            }
        }
        Ok(buf)
    }

    /// Ends the chunk that used `buf`: posts "done" (after this member's last read of the
    /// chunk) and records the stage for the buffer rule.
    pub fn end_chunk(&mut self, buf: usize) {
        self.post();
        self.done_at[buf] = self.stage;
    }

    /// Flags the window aborted and wakes every sleeping member (after a failure on this rank).
    pub fn abort(&self) {
        self.seg.u32_at(HDR_ABORTED).store(1, Ordering::SeqCst);
        for m in 0..self.members {
            crate::sys::futex::wake(self.stage_word(m));
        }
    }
}

/// A fingerprint as the four words of a window slot ([`Fingerprint::encode`], zero-padded).
fn fp_words(fp: &Fingerprint) -> [u64; 4] {
    let mut b = [0u8; 32];
    b[..FINGERPRINT_LEN].copy_from_slice(&fp.encode());
    let mut w = [0u64; 4];
    for (word, chunk) in w.iter_mut().zip(b.chunks_exact(8)) {
        *word = u64::from_le_bytes([
            chunk[0], chunk[1], chunk[2], chunk[3], chunk[4], chunk[5], chunk[6], chunk[7],
        ]);
    }
    w
}

/// What a slot's words say, for the mismatch message.
fn describe_fp(w: &[u64; 4]) -> String {
    let mut bytes = [0u8; 32];
    for (chunk, word) in bytes.chunks_exact_mut(8).zip(w) {
        chunk.copy_from_slice(&word.to_le_bytes());
    }
    let mut b = [0u8; FINGERPRINT_LEN];
    b.copy_from_slice(&bytes[..FINGERPRINT_LEN]);
    Fingerprint::decode(&b).map_or_else(|e| format!("an unknown collective ({e})"), |fp| fp.to_string())
}

#[cfg(test)]
mod tests;
