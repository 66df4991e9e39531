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

    /// How waits went so far.
    pub fn stats(&self) -> WaitStats {
        self.stats
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

    /// Copies member `m`'s region `buf` at `off` into `dst`.
    pub fn get(&self, m: usize, buf: usize, off: usize, dst: &mut [u8]) {
        reduce::copy(dst, self.theirs(m, buf, off, dst.len()));
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

    /// `dst = a ⊕ region(m, buf)[off..]`.
    #[allow(clippy::too_many_arguments)]
    pub fn reduce_into_from(
        &self,
        m: usize,
        buf: usize,
        off: usize,
        dst: &mut [u8],
        a: &[u8],
        dtype: DataType,
        op: ReduceOp,
    ) {
        reduce::reduce_into(dtype, op, dst, a, self.theirs(m, buf, off, dst.len()));
    }

    /// `dst = region(m1, buf)[off1..] ⊕ region(m2, buf)[off2..]`.
    #[allow(clippy::too_many_arguments)]
    pub fn reduce_two(
        &self,
        (m1, off1): (usize, usize),
        (m2, off2): (usize, usize),
        buf: usize,
        dst: &mut [u8],
        dtype: DataType,
        op: ReduceOp,
    ) {
        let len = dst.len();
        reduce::reduce_into(dtype, op, dst, self.theirs(m1, buf, off1, len), self.theirs(m2, buf, off2, len));
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

    /// My current stage.
    pub fn stage(&self) -> u32 {
        self.stage
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
    pub fn begin_chunk(
        &mut self,
        writes: bool,
        fp: &Fingerprint,
        policy: &WaitPolicy,
        deadline: Instant,
        abort: &AbortSignal,
        probe: Probe<'_>,
    ) -> Result<usize> {
        let buf = (self.chunks % 2) as usize;
        self.chunks += 1;
        if writes {
            let target = self.done_at[buf];
            let start = Instant::now();
            for m in 0..self.members {
                if m != self.me && !reached(self.seen[m], target) {
                    self.wait_at(m, target, fp, policy, deadline, abort, &mut *probe, start, false)?;
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

    /// Waits until member `m` reached stage `target`, checking its fingerprint for this
    /// collective on the way.
    #[allow(clippy::too_many_arguments)]
    pub fn wait(
        &mut self,
        m: usize,
        target: u32,
        fp: &Fingerprint,
        policy: &WaitPolicy,
        deadline: Instant,
        abort: &AbortSignal,
        probe: Probe<'_>,
    ) -> Result<()> {
        self.wait_at(m, target, fp, policy, deadline, abort, probe, Instant::now(), true)
    }

    /// Waits until every other member reached `target` (one spin budget for all).
    pub fn wait_all(
        &mut self,
        target: u32,
        fp: &Fingerprint,
        policy: &WaitPolicy,
        deadline: Instant,
        abort: &AbortSignal,
        probe: Probe<'_>,
    ) -> Result<()> {
        let start = Instant::now();
        // Check everyone once before waiting on anyone: members that are already there cost a
        // load each instead of a spin budget.
        for m in 0..self.members {
            if m != self.me && !reached(self.seen[m], target) {
                let v = self.stage_word(m).load(Ordering::Acquire);
                if reached(v, target) {
                    self.seen[m] = v;
                }
            }
        }
        for m in 0..self.members {
            if m != self.me {
                self.wait_at(m, target, fp, policy, deadline, abort, &mut *probe, start, true)?;
            }
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn wait_at(
        &mut self,
        m: usize,
        target: u32,
        fp: &Fingerprint,
        policy: &WaitPolicy,
        deadline: Instant,
        abort: &AbortSignal,
        probe: Probe<'_>,
        start: Instant,
        check_fp: bool,
    ) -> Result<()> {
        if !reached(self.seen[m], target) {
            self.spin_then_sleep(m, target, fp, policy, deadline, abort, probe, start)?;
        }
        if check_fp {
            self.check_fp(m, fp)?;
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn spin_then_sleep(
        &mut self,
        m: usize,
        target: u32,
        fp: &Fingerprint,
        policy: &WaitPolicy,
        deadline: Instant,
        abort: &AbortSignal,
        probe: Probe<'_>,
        start: Instant,
    ) -> Result<()> {
        let aborted = self.seg.u32_at(HDR_ABORTED);
        let pure = if policy.oversubscribed { Duration::ZERO } else { PURE_SPIN.min(policy.spin) };
        let mut i = 0u32;
        self.stats.waits += 1;
        let spun = Instant::now();
        // 1. Spin, then yield, until the spin budget is spent.
        loop {
            let v = self.stage_word(m).load(Ordering::Acquire);
            if reached(v, target) {
                self.seen[m] = v;
                self.stats.spin_time += spun.elapsed();
                return Ok(());
            }
            i = i.wrapping_add(1);
            if i.is_multiple_of(64) || policy.oversubscribed {
                abort.check()?;
                if aborted.load(Ordering::Relaxed) != 0 {
                    return Err(self.aborted_error(m, fp, probe));
                }
                let spent = start.elapsed();
                if spent >= policy.spin {
                    break;
                }
                if spent >= pure {
                    self.stats.yields += 1;
                    std::thread::yield_now();
                    continue;
                }
            }
            std::hint::spin_loop();
        }
        self.stats.spin_time += spun.elapsed();
        // 2. Sleep on the member's stage word in slices, checking liveness between them.
        let word = self.stage_word(m);
        let waiters = self.seg.u32_at(self.ctl(m) + WAITERS);
        waiters.fetch_add(1, Ordering::SeqCst);
        let slept = Instant::now();
        let mut last_probe = slept;
        let mut naps = 0u64;
        let r = (|| loop {
            let v = word.load(Ordering::SeqCst);
            if reached(v, target) {
                return Ok(v);
            }
            abort.check()?;
            if aborted.load(Ordering::Relaxed) != 0 {
                return Err(self.aborted_error(m, fp, &mut *probe));
            }
            let now = Instant::now();
            if now.duration_since(last_probe) < SLICE && now < deadline {
                naps += 1;
                crate::sys::futex::wait(word, v, SLICE.min(deadline - now));
                continue;
            }
            // A slice passed without the stage moving: is the member still there?
            last_probe = now;
            if probe(m)? {
                // Its connection closed: fine only if it got there before leaving.
                let v = word.load(Ordering::SeqCst);
                if reached(v, target) {
                    return Ok(v);
                }
                return Err(Error::Remote(
                    format!(
                        "local rank {m} closed its connection during {fp} (it exited, crashed or aborted)"
                    )
                    .into(),
                ));
            }
            if now >= deadline {
                return Err(Error::Timeout(
                    format!(
                        "local rank {} in {fp}: deadline passed waiting for local rank {m} \
                     (shared-memory stage {v}, waiting for {target})",
                        self.me
                    )
                    .into(),
                ));
            }
            naps += 1;
            crate::sys::futex::wait(word, v, SLICE.min(deadline - now));
        })();
        waiters.fetch_sub(1, Ordering::SeqCst);
        self.stats.sleeps += 1;
        self.stats.naps += naps;
        self.stats.sleep_time += slept.elapsed();
        let v = r?;
        self.seen[m] = v;
        Ok(())
    }

    /// Another member flagged the window aborted: find its reason on the links if it is there.
    fn aborted_error(&self, m: usize, fp: &Fingerprint, probe: Probe<'_>) -> Error {
        let deadline = Instant::now() + Duration::from_millis(200);
        while Instant::now() < deadline {
            match probe(m) {
                Err(e) => return e,
                Ok(true) => break,
                Ok(false) => std::thread::sleep(Duration::from_millis(1)),
            }
        }
        Error::Remote(format!("another rank aborted {fp} (its reason did not arrive)").into())
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

/// Bytes of the last-level cache (for choosing streaming stores): the largest cache sysfs lists
/// for CPU 0 (`sysconf` is not trusted: under KVM glibc reports the host's total), 32 MiB when
/// unknown. Read once.
pub fn last_level_cache() -> usize {
    static LLC: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *LLC.get_or_init(|| {
        let parse = |s: &str| {
            let s = s.trim();
            let (num, mult) = match s.chars().last() {
                Some('K') => (&s[..s.len() - 1], 1 << 10),
                Some('M') => (&s[..s.len() - 1], 1 << 20),
                _ => (s, 1),
            };
            num.parse::<usize>().ok().map(|v| v * mult)
        };
        (0..8)
            .filter_map(|i| {
                std::fs::read_to_string(format!("/sys/devices/system/cpu/cpu0/cache/index{i}/size")).ok()
            })
            .filter_map(|s| parse(&s))
            .max()
            .unwrap_or(32 << 20)
    })
}

/// Copies `src` to `dst` with non-temporal (streaming) stores: the destination is written to
/// memory without first being read into the cache (no read-for-ownership) and without evicting
/// useful lines. Worth it only for outputs that will not be read again soon and do not fit in
/// the cache anyway: a large collective's output. Falls back to a plain copy off x86-64.
pub fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_streaming: length mismatch");
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 is present (checked); the slices are valid and of equal length.
            unsafe { stream_avx2(dst, src) };
        } else {
            // SAFETY: SSE2 is part of x86-64; the slices are valid and of equal length.
            unsafe { stream_sse2(dst, src) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

/// Splits `dst` into a head that brings it to `align`, a body of whole `step`s and a tail.
#[cfg(target_arch = "x86_64")]
fn stream_split(dst: &[u8], align: usize, step: usize) -> (usize, usize) {
    let head = (align - dst.as_ptr() as usize % align) % align;
    let head = head.min(dst.len());
    let body = (dst.len() - head) / step * step;
    (head, body)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn stream_avx2(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m256i, _mm_sfence, _mm256_loadu_si256, _mm256_stream_si256};
    let (head, body) = stream_split(dst, 32, 128);
    dst[..head].copy_from_slice(&src[..head]);
    let mut i = head;
    while i < head + body {
        // SAFETY: `i + 128 <= head + body <= len`; `dst + i` is 32-byte aligned (head brings it
        // there and steps are multiples of 32); loads are unaligned.
        unsafe {
            let s = src.as_ptr().add(i) as *const __m256i;
            let d = dst.as_mut_ptr().add(i) as *mut __m256i;
            let (a, b, c, e) = (
                _mm256_loadu_si256(s),
                _mm256_loadu_si256(s.add(1)),
                _mm256_loadu_si256(s.add(2)),
                _mm256_loadu_si256(s.add(3)),
            );
            _mm256_stream_si256(d, a);
            _mm256_stream_si256(d.add(1), b);
            _mm256_stream_si256(d.add(2), c);
            _mm256_stream_si256(d.add(3), e);
        }
        i += 128;
    }
    dst[i..].copy_from_slice(&src[i..]);
    // Streaming stores are weakly ordered: make them visible before anything that follows
    // (the collective's completion, which another thread may observe).
    _mm_sfence();
}

#[cfg(target_arch = "x86_64")]
unsafe fn stream_sse2(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    let (head, body) = stream_split(dst, 16, 64);
    dst[..head].copy_from_slice(&src[..head]);
    let mut i = head;
    while i < head + body {
        // SAFETY: as in `stream_avx2`, with 16-byte alignment and 64-byte steps.
        unsafe {
            let s = src.as_ptr().add(i) as *const __m128i;
            let d = dst.as_mut_ptr().add(i) as *mut __m128i;
            for k in 0..4 {
                _mm_stream_si128(d.add(k), _mm_loadu_si128(s.add(k)));
            }
        }
        i += 64;
    }
    dst[i..].copy_from_slice(&src[i..]);
    // SAFETY: sfence has no preconditions.
    unsafe { _mm_sfence() };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_words_describe_the_fingerprint_they_hold() {
        use crate::collective::{Algorithm, CollKind};
        let fp = Fingerprint {
            seq: 812,
            kind: CollKind::AllReduce,
            dtype: DataType::F32,
            op: ReduceOp::Max,
            count: 4096,
            root: -1,
            algo: Algorithm::ShmDirect as u8,
        };
        assert_eq!(describe_fp(&fp_words(&fp)), fp.to_string());
        assert!(describe_fp(&[0; 4]).starts_with("an unknown collective"));
    }

    #[test]
    fn streaming_copy_is_a_copy_at_any_alignment_and_length() {
        let src: Vec<u8> = (0..5000u32).map(|i| (i * 31 % 251) as u8).collect();
        for off in [0usize, 1, 7, 16, 31, 33] {
            for len in [0usize, 1, 15, 31, 32, 127, 128, 129, 1000, 4000] {
                let mut dst = vec![0u8; len + 64];
                copy_streaming(&mut dst[off..off + len], &src[3..3 + len]);
                assert_eq!(&dst[off..off + len], &src[3..3 + len], "offset {off}, length {len}");
                assert!(dst[..off].iter().chain(&dst[off + len..]).all(|b| *b == 0), "wrote outside");
            }
        }
    }

    #[test]
    fn the_last_member_to_map_the_window_removes_its_name() {
        use super::super::segment::{Segment, segment_name};
        let dir = std::env::temp_dir().join(format!("toroid-window-test-{}", crate::sys::random::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (members, region) = (3, 4096);
        let len = window_len(members, region);
        let seg = Segment::create(&dir, &segment_name(7, "win"), len).unwrap_or_else(|e| panic!("{}", e.0));
        let path = seg.path().unwrap().to_path_buf();
        let _creator = Window::init(seg, members, 0, region, 7).unwrap();
        let _first = Window::attach(Segment::open(&path, len).unwrap(), members, 1, region, 7).unwrap();
        assert!(path.exists(), "a member has not mapped it yet");
        let _last = Window::attach(Segment::open(&path, len).unwrap(), members, 2, region, 7).unwrap();
        assert!(!path.exists(), "every member mapped it: the name must be gone");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn stages_compare_across_wrap_around() {
        assert!(reached(5, 5) && reached(6, 5) && !reached(4, 5));
        assert!(reached(2, u32::MAX - 1), "2 is three posts after 2^32 - 2");
        assert!(!reached(u32::MAX - 1, 2));
    }
}
