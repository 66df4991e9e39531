//! Shared-memory transport between ranks of one host.
//!
//! ## Segments
//!
//! Every pair of ranks with the same host identity shares one segment holding two
//! single-producer/single-consumer rings, one per direction. The lower rank creates it in the
//! shared-memory directory (`TOROID_SHM_DIR`, default `/dev/shm`) under an unguessable name
//! `toroid-<pid>-<nonce>-p<lo>-<hi>`, reserves its pages with `fallocate(2)` (a tmpfs that is too
//! small fails here with a clear message instead of a `SIGBUS` on first touch), maps it and
//! offers it to the peer over their TCP connection. The peer maps it, checks the nonce written in
//! the header, unlinks the name and accepts; the creator unlinks too (whoever is first wins). The
//! name therefore exists only for the milliseconds of set-up: after a normal exit, an error or a
//! `kill -9` at any later moment nothing is left in `/dev/shm`, because the memory lives only as
//! long as some process maps it. Names left behind by a process killed inside that set-up window
//! are swept by the next set-up on the host ([`sweep_stale`]).
//!
//! ```text
//! offset 0      header: magic, version, nonce, ring capacity        (one page)
//!        512    ring lo->hi control    head | tail | reader waiting | writer waiting
//!        1024   ring hi->lo control    (each field on its own 128-byte line)
//!        4096   ring lo->hi data       capacity bytes (a power of two)
//!        4096+C ring hi->lo data
//! ```
//!
//! ## Rings
//!
//! A ring is a byte stream: `head` counts bytes ever written (only the producer stores it),
//! `tail` bytes ever consumed (only the consumer stores it); both are 64-bit and never wrap.
//! The producer copies into the free space and publishes `head` with a release store every
//! [`PUBLISH`] bytes, so the consumer starts on the first bytes of a large write while the rest
//! is still being copied; the consumer reads after an acquire load of `head` and frees space
//! with a release store of `tail`. Each side caches the other's counter and reloads it only when
//! the cached value says "empty" or "full", so the hot loop touches the other side's cache line
//! only when it must.
//!
//! ## Waking and liveness
//!
//! The TCP connection of the pair stays open as the wake-up and liveness channel: the progress
//! engine keeps sleeping in `poll(2)` on it (see [`Transport::arm`]). Before sleeping, a reader
//! sets `reader_waiting` and re-checks the ring (a sequentially consistent fence on both sides:
//! either the reader sees the data or the writer sees the flag); a writer that publishes and
//! finds the flag set clears it and sends one byte on the socket. Writers waiting for space do
//! the same with `writer_waiting`. A peer that exits or is killed closes its socket, so a
//! sleeping rank wakes at once and sees end of stream; a peer that shuts down cleanly also marks
//! its ring closed (after its last data) so the reader sees end of stream in order.
//!
//! ## Zero copy
//!
//! [`Transport::read_with`] hands the reader's reduction the bytes straight out of the ring:
//! `dst = dst ⊕ ring` without first copying into a scratch buffer.

use std::ffi::CString;
use std::io;
use std::os::fd::RawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};
use std::time::{Duration, Instant, SystemTime};

use super::Transport;
use crate::error::{Error, Result};

/// Calls a libc function and turns `-1` into the `io::Error` of `errno` (mio's `syscall!`).
macro_rules! syscall {
    ($fn:ident ( $($arg:expr),* $(,)? )) => {{
        // SAFETY: each call site passes pointers to live, correctly sized objects; see there.
        let res = unsafe { libc::$fn($($arg),*) };
        if res == -1 { Err(io::Error::last_os_error()) } else { Ok(res) }
    }};
}

/// Prefix of every segment name toroid creates.
pub const NAME_PREFIX: &str = "toroid-";
/// Segment header magic ("TRSHMSEG").
const SEG_MAGIC: u64 = u64::from_le_bytes(*b"TRSHMSEG");
/// Layout version of segments.
const SEG_VERSION: u64 = 1;
/// Bytes before the ring data.
const RING_DATA_OFFSET: usize = 4096;
/// Cache line distance used to keep fields of different writers apart (two 64-byte lines:
/// the adjacent-line prefetcher pulls pairs).
pub(crate) const LINE: usize = 128;
/// The producer publishes at least this often inside one large write.
pub const PUBLISH: usize = 64 * 1024;
/// Smallest ring capacity accepted.
pub const MIN_RING: usize = 4096;
/// A name older than this whose creator is gone is stale (see [`sweep_stale`]).
const STALE_AGE: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------------------------
// Segments
// ---------------------------------------------------------------------------------------------

/// A shared-memory segment mapped into this process.
///
/// Created with [`Segment::create`] (which leaves the name in place until [`Segment::unlink`]) or
/// opened by name with [`Segment::open`]. Dropping it unmaps the memory and, if this process
/// still holds the name, removes it.
#[derive(Debug)]
pub struct Segment {
    ptr: NonNull<u8>,
    len: usize,
    /// The path while this process is responsible for removing it.
    path: Option<PathBuf>,
}

// SAFETY: the mapping is plain shared memory; every access goes through atomics or through the
// protocols documented where the memory is used (rings, window), never through `&mut` aliases
// that outlive a call.
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

/// Why a segment could not be created.
#[derive(Debug, Clone)]
pub struct SegmentError(pub String);

impl std::fmt::Display for SegmentError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn cpath(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in path"))
}

/// Free and total bytes of the file system holding `dir`.
fn space(dir: &Path) -> Option<(u64, u64)> {
    let c = cpath(dir).ok()?;
    // SAFETY: zeroed statvfs is a valid output buffer.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path, `st` a live output struct.
    syscall!(statvfs(c.as_ptr(), &mut st)).ok()?;
    let f = st.f_frsize as u64;
    Some((st.f_bavail as u64 * f, st.f_blocks as u64 * f))
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1 << 20) as f64)
}

impl Segment {
    /// Creates `dir/name` of `len` bytes (exclusively), reserves its pages and maps it. The name
    /// stays until [`Segment::unlink`] or drop.
    pub fn create(dir: &Path, name: &str, len: usize) -> std::result::Result<Segment, SegmentError> {
        let path = dir.join(name);
        let fail = |what: &str, e: io::Error| {
            let mut msg = format!(
                "creating a {} shared-memory segment {} failed: {what}: {e}",
                mib(len as u64),
                path.display()
            );
            if matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EFBIG) | Some(libc::ENOMEM)) {
                if let Some((free, total)) = space(dir) {
                    msg.push_str(&format!(" ({} has {} free of {})", dir.display(), mib(free), mib(total)));
                }
                msg.push_str(
                    "; containers often get a 64 MB /dev/shm: run with --shm-size=1g or --ipc=host, \
                     point TOROID_SHM_DIR at a larger tmpfs, or set TOROID_SHM_DISABLE=1",
                );
            }
            SegmentError(msg)
        };
        let c = cpath(&path).map_err(|e| fail("path", e))?;
        // SAFETY: NUL-terminated path; flags and mode are plain integers.
        let fd = syscall!(open(
            c.as_ptr(),
            libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC | libc::O_NOFOLLOW,
            0o600 as libc::c_uint
        ))
        .map_err(|e| fail("open", e))?;
        let fd = Fd(fd);
        let unlink = || {
            // SAFETY: NUL-terminated path.
            unsafe { libc::unlink(c.as_ptr()) };
        };
        // SAFETY: `fd` is open; `len` fits off_t on 64-bit Linux.
        if let Err(e) = syscall!(ftruncate(fd.0, len as libc::off_t)) {
            unlink();
            return Err(fail("ftruncate", e));
        }
        // Reserve every page now: on tmpfs a later first touch beyond the size limit is SIGBUS.
        // SAFETY: `fd` is open; plain integers.
        let r = unsafe { libc::fallocate(fd.0, 0, 0, len as libc::off_t) };
        if r != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
                // SAFETY: as above; posix_fallocate returns the error number instead of -1.
                let r = unsafe { libc::posix_fallocate(fd.0, 0, len as libc::off_t) };
                if r != 0 {
                    unlink();
                    return Err(fail("posix_fallocate", io::Error::from_raw_os_error(r)));
                }
            } else {
                unlink();
                return Err(fail("fallocate", e));
            }
        }
        match map(fd.0, len) {
            Ok(ptr) => Ok(Segment { ptr, len, path: Some(path) }),
            Err(e) => {
                unlink();
                Err(fail("mmap", e))
            }
        }
    }

    /// Opens and maps an existing segment of exactly `len` bytes. The caller unlinks it.
    pub fn open(path: &Path, len: usize) -> io::Result<Segment> {
        let c = cpath(path)?;
        // SAFETY: NUL-terminated path.
        let fd = Fd(syscall!(open(c.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC | libc::O_NOFOLLOW))?);
        // SAFETY: zeroed stat is a valid output buffer.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `fd` is open, `st` a live output struct.
        syscall!(fstat(fd.0, &mut st))?;
        if st.st_size as u64 != len as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("segment is {} bytes, expected {len}", st.st_size),
            ));
        }
        let ptr = map(fd.0, len)?;
        Ok(Segment { ptr, len, path: Some(path.to_path_buf()) })
    }

    /// Removes the name (idempotent; a name already removed by the peer is fine).
    pub fn unlink(&mut self) {
        if let Some(p) = self.path.take()
            && let Ok(c) = cpath(&p)
        {
            // SAFETY: NUL-terminated path.
            unsafe { libc::unlink(c.as_ptr()) };
        }
    }

    /// Start of the mapping (page aligned).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length of the mapping.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty mapping (never: segments have a header).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The 64-bit word at byte `offset` (8-aligned, inside the mapping) as an atomic.
    pub(crate) fn u64_at(&self, offset: usize) -> &AtomicU64 {
        assert!(offset.is_multiple_of(8) && offset + 8 <= self.len);
        // SAFETY: in bounds and aligned (checked); the mapping lives as long as `self`, and all
        // processes access this word only atomically.
        unsafe { AtomicU64::from_ptr(self.as_ptr().add(offset).cast()) }
    }

    /// The 32-bit word at byte `offset` (4-aligned, inside the mapping) as an atomic.
    pub(crate) fn u32_at(&self, offset: usize) -> &AtomicU32 {
        assert!(offset.is_multiple_of(4) && offset + 4 <= self.len);
        // SAFETY: as in `u64_at`.
        unsafe { AtomicU32::from_ptr(self.as_ptr().add(offset).cast()) }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        self.unlink();
        // SAFETY: `ptr`/`len` describe a mapping made by `map` and not unmapped before.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

struct Fd(RawFd);

impl Drop for Fd {
    fn drop(&mut self) {
        // SAFETY: we own the descriptor. A mapping survives the close.
        unsafe { libc::close(self.0) };
    }
}

fn map(fd: RawFd, len: usize) -> io::Result<NonNull<u8>> {
    // SAFETY: a fresh shared mapping of an open descriptor; no existing memory is affected.
    let p = unsafe {
        libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0)
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    NonNull::new(p.cast()).ok_or_else(|| io::Error::other("mmap returned null"))
}

/// A segment name for this process: `toroid-<pid>-<nonce>-<what>`.
pub fn segment_name(nonce: u64, what: &str) -> String {
    format!("{NAME_PREFIX}{}-{nonce:016x}-{what}", std::process::id())
}

/// Removes names in `dir` that toroid left behind: created by a process that no longer exists
/// (killed inside the set-up window, when only the name keeps the memory), at least
/// [`STALE_AGE`] old. Returns the names removed.
pub fn sweep_stale(dir: &Path) -> Vec<String> {
    let mut removed = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else { return removed };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(NAME_PREFIX) else { continue };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<libc::pid_t>().ok()) else { continue };
        if pid <= 0 {
            continue;
        }
        // SAFETY: kill with signal 0 only checks for existence.
        let gone = unsafe { libc::kill(pid, 0) } == -1
            && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        let old = e
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| SystemTime::now().duration_since(t).ok())
            .is_some_and(|age| age >= STALE_AGE);
        if gone && old && std::fs::remove_file(e.path()).is_ok() {
            removed.push(name);
        }
    }
    removed
}

// ---------------------------------------------------------------------------------------------
// Rings
// ---------------------------------------------------------------------------------------------

/// Offsets of one ring's control fields inside its control block (each on its own line).
const HEAD: usize = 0;
const CLOSED: usize = 8;
const TAIL: usize = LINE;
const GONE: usize = LINE + 8;
const READER_WAITING: usize = 2 * LINE;
const WRITER_WAITING: usize = 3 * LINE;
/// Size of a control block.
const CTL_LEN: usize = 4 * LINE;

/// Where one ring lives in a segment.
#[derive(Debug, Clone, Copy)]
struct RingAt {
    ctl: usize,
    data: usize,
    cap: usize,
}

/// Total bytes of a pair segment with rings of `cap` bytes.
pub fn pair_segment_len(cap: usize) -> usize {
    RING_DATA_OFFSET + 2 * cap
}

fn rings(cap: usize) -> [RingAt; 2] {
    [
        RingAt { ctl: 512, data: RING_DATA_OFFSET, cap },
        RingAt { ctl: 512 + CTL_LEN, data: RING_DATA_OFFSET + cap, cap },
    ]
}

/// The writing end of a ring.
#[derive(Debug)]
struct Producer {
    at: RingAt,
    /// Bytes written (local copy of `head`, ahead of it between publishes).
    head: u64,
    published: u64,
    tail_cache: u64,
}

/// The reading end of a ring.
#[derive(Debug)]
struct Consumer {
    at: RingAt,
    tail: u64,
    released: u64,
    head_cache: u64,
}

impl Producer {
    fn free(&mut self, seg: &Segment) -> usize {
        let cap = self.at.cap as u64;
        if self.head - self.tail_cache == cap {
            self.tail_cache = seg.u64_at(self.at.ctl + TAIL).load(Ordering::Acquire);
        }
        (cap - (self.head - self.tail_cache)) as usize
    }

    /// Copies as much of `bufs` as fits; returns (bytes, reader needs a wake-up).
    fn write(&mut self, seg: &Segment, bufs: &[&[u8]]) -> (usize, bool) {
        let mut written = 0;
        let mut wake = false;
        let mask = self.at.cap as u64 - 1;
        'outer: for b in bufs {
            let mut off = 0;
            while off < b.len() {
                let mut free = self.free(seg);
                if free == 0 {
                    // Let the reader drain what we have before giving up.
                    wake |= self.publish(seg);
                    free = self.free(seg);
                    if free == 0 {
                        break 'outer;
                    }
                }
                let pos = (self.head & mask) as usize;
                let unpublished = (self.head - self.published) as usize;
                let n = free
                    .min(b.len() - off)
                    .min(self.at.cap - pos)
                    .min(PUBLISH - unpublished.min(PUBLISH - 1));
                // SAFETY: `pos + n <= cap`, inside this ring's data area of the live mapping;
                // the consumer does not read these bytes before `head` is published past them,
                // and `free` says it has consumed what was there.
                unsafe {
                    crate::reduce::copy_nonoverlapping(
                        b.as_ptr().add(off),
                        seg.as_ptr().add(self.at.data + pos),
                        n,
                    );
                }
                self.head += n as u64;
                off += n;
                written += n;
                if self.head - self.published >= PUBLISH as u64 {
                    wake |= self.publish(seg);
                }
            }
        }
        if self.head != self.published {
            wake |= self.publish(seg);
        }
        (written, wake)
    }

    /// Makes the written bytes visible; true when the reader sleeps and must be woken.
    fn publish(&mut self, seg: &Segment) -> bool {
        if self.head == self.published {
            return false;
        }
        seg.u64_at(self.at.ctl + HEAD).store(self.head, Ordering::Release);
        self.published = self.head;
        fence(Ordering::SeqCst);
        let w = seg.u32_at(self.at.ctl + READER_WAITING);
        w.load(Ordering::Relaxed) != 0 && w.swap(0, Ordering::AcqRel) != 0
    }

    fn close(&mut self, seg: &Segment) -> bool {
        let wake = self.publish(seg);
        seg.u32_at(self.at.ctl + CLOSED).store(1, Ordering::Release);
        fence(Ordering::SeqCst);
        wake || seg.u32_at(self.at.ctl + READER_WAITING).swap(0, Ordering::AcqRel) != 0
    }

    fn reader_gone(&self, seg: &Segment) -> bool {
        seg.u32_at(self.at.ctl + GONE).load(Ordering::Acquire) != 0
    }
}

impl Consumer {
    fn available(&mut self, seg: &Segment) -> usize {
        if self.head_cache == self.tail {
            self.head_cache = seg.u64_at(self.at.ctl + HEAD).load(Ordering::Acquire);
        }
        (self.head_cache - self.tail) as usize
    }

    /// True when the writer closed its end (it may have left data to read).
    fn writer_done(&self, seg: &Segment) -> bool {
        seg.u32_at(self.at.ctl + CLOSED).load(Ordering::Acquire) != 0
    }

    /// True when the writer closed and everything it wrote has been consumed.
    fn at_end(&mut self, seg: &Segment) -> bool {
        if seg.u32_at(self.at.ctl + CLOSED).load(Ordering::Acquire) == 0 {
            return false;
        }
        // `head` was published before `closed`: reload it.
        self.head_cache = seg.u64_at(self.at.ctl + HEAD).load(Ordering::Acquire);
        self.head_cache == self.tail
    }

    /// The readable bytes at the tail that are contiguous in the ring (at most `max`).
    fn contiguous(&mut self, seg: &Segment, max: usize) -> (usize, usize) {
        let avail = self.available(seg).min(max);
        let pos = (self.tail & (self.at.cap as u64 - 1)) as usize;
        (pos, avail.min(self.at.cap - pos))
    }

    /// Copies up to `dst.len()` bytes out; returns the count.
    fn read_into(&mut self, seg: &Segment, dst: &mut [u8]) -> usize {
        let mut got = 0;
        while got < dst.len() {
            let (pos, n) = self.contiguous(seg, dst.len() - got);
            if n == 0 {
                break;
            }
            // SAFETY: `pos + n <= cap` inside the live mapping; the producer published these
            // bytes (acquire load of head) and does not overwrite them before `tail` passes.
            unsafe {
                crate::reduce::copy_nonoverlapping(
                    seg.as_ptr().add(self.at.data + pos),
                    dst[got..].as_mut_ptr(),
                    n,
                )
            };
            got += n;
            self.tail += n as u64;
        }
        got
    }

    fn read(&mut self, seg: &Segment, bufs: &mut [&mut [u8]]) -> (usize, bool) {
        let mut total = 0;
        let mut wake = false;
        for b in bufs.iter_mut() {
            let mut off = 0;
            while off < b.len() {
                let chunk = (b.len() - off).min(PUBLISH);
                let n = self.read_into(seg, &mut b[off..off + chunk]);
                off += n;
                total += n;
                if self.tail - self.released >= PUBLISH as u64 {
                    wake |= self.release(seg);
                }
                if n < chunk {
                    wake |= self.release(seg);
                    return (total, wake);
                }
            }
        }
        wake |= self.release(seg);
        (total, wake)
    }

    /// Offers up to `max` bytes in place to `f` (contiguous; across the ring's end a stitched
    /// copy of at most 64 bytes) and consumes what it takes.
    fn read_with(&mut self, seg: &Segment, max: usize, f: &mut dyn FnMut(&[u8]) -> usize) -> (usize, bool) {
        let mut total = 0;
        let mut wake = false;
        while total < max {
            let (pos, n) = self.contiguous(seg, max - total);
            if n == 0 {
                break;
            }
            let avail = self.available(seg).min(max - total);
            let took = if n < 64 && avail > n {
                // The contiguous part ends at the ring's end inside the first few elements:
                // stitch it with the start so that at least one whole element is offered.
                let mut bounce = [0u8; 64];
                let k = avail.min(64);
                let mut peekc = Consumer {
                    at: self.at,
                    tail: self.tail,
                    released: self.released,
                    head_cache: self.head_cache,
                };
                let got = peekc.read_into(seg, &mut bounce[..k]);
                f(&bounce[..got]).min(got)
            } else {
                // SAFETY: `pos + n <= cap` inside the live mapping; published bytes that the
                // producer does not touch until `tail` passes them (after `f` returns).
                let s = unsafe { std::slice::from_raw_parts(seg.as_ptr().add(self.at.data + pos), n) };
                f(s).min(n)
            };
            if took == 0 {
                break;
            }
            self.tail += took as u64;
            total += took;
            if self.tail - self.released >= PUBLISH as u64 {
                wake |= self.release(seg);
            }
        }
        wake |= self.release(seg);
        (total, wake)
    }

    /// Copies available bytes without consuming them.
    fn peek(&mut self, seg: &Segment, buf: &mut [u8]) -> usize {
        let mut c =
            Consumer { at: self.at, tail: self.tail, released: self.released, head_cache: self.head_cache };
        let n = c.read_into(seg, buf);
        self.head_cache = c.head_cache;
        n
    }

    /// Frees consumed space; true when the writer sleeps and must be woken.
    fn release(&mut self, seg: &Segment) -> bool {
        if self.tail == self.released {
            return false;
        }
        seg.u64_at(self.at.ctl + TAIL).store(self.tail, Ordering::Release);
        self.released = self.tail;
        fence(Ordering::SeqCst);
        let w = seg.u32_at(self.at.ctl + WRITER_WAITING);
        w.load(Ordering::Relaxed) != 0 && w.swap(0, Ordering::AcqRel) != 0
    }
}

// ---------------------------------------------------------------------------------------------
// The transport
// ---------------------------------------------------------------------------------------------

/// A peer on the same host: two rings in a shared segment, and the peer's TCP connection as the
/// wake-up and liveness channel.
#[derive(Debug)]
pub struct ShmTransport {
    seg: Segment,
    tx: Producer,
    rx: Consumer,
    wake: Box<dyn Transport>,
    /// The wake-up connection reached end of stream or failed: the peer is gone.
    peer_gone: bool,
}

impl ShmTransport {
    /// Wraps a mapped pair segment. `lower` says whether this side is the pair's lower rank
    /// (it writes ring 0 and reads ring 1).
    fn new(seg: Segment, cap: usize, lower: bool, wake: Box<dyn Transport>) -> ShmTransport {
        let [a, b] = rings(cap);
        let (txa, rxa) = if lower { (a, b) } else { (b, a) };
        ShmTransport {
            seg,
            tx: Producer { at: txa, head: 0, published: 0, tail_cache: 0 },
            rx: Consumer { at: rxa, tail: 0, released: 0, head_cache: 0 },
            wake,
            peer_gone: false,
        }
    }

    /// A connected pair in this process (tests and benchmarks): two transports over one segment
    /// in `dir`, woken through a socket pair.
    pub fn pair(dir: &Path, cap: usize) -> Result<(ShmTransport, ShmTransport)> {
        let cap = ring_capacity(cap);
        let len = pair_segment_len(cap);
        let nonce = crate::sys::random::id();
        let mut seg =
            Segment::create(dir, &segment_name(nonce, "test"), len).map_err(|e| Error::System(e.0.into()))?;
        let path = dir.join(segment_name(nonce, "test"));
        let other = Segment::open(&path, len).map_err(|e| Error::system("opening the segment", e))?;
        seg.unlink();
        let (a, b) = socket_pair()?;
        Ok((
            ShmTransport::new(seg, cap, true, Box::new(a)),
            ShmTransport::new(other, cap, false, Box::new(b)),
        ))
    }

    /// Sends one wake-up byte on the connection (a failure means the peer is gone).
    fn ring_doorbell(&mut self) {
        match self.wake.try_write(&[&[1u8]]) {
            Ok(_) => {}
            // A full socket buffer holds plenty of wake-ups already.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(_) => self.peer_gone = true,
        }
    }

    /// Reads pending wake-up bytes; notices end of stream.
    fn drain_doorbell(&mut self) {
        let mut buf = [0u8; 64];
        loop {
            match self.wake.try_read(&mut [&mut buf]) {
                Ok(0) => {
                    self.peer_gone = true;
                    return;
                }
                Ok(n) if n < buf.len() => return,
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    self.peer_gone = true;
                    return;
                }
            }
        }
    }

    fn broken_pipe(&self) -> io::Error {
        io::Error::new(io::ErrorKind::BrokenPipe, "peer closed its shared-memory ring")
    }
}

impl Transport for ShmTransport {
    fn kind(&self) -> &'static str {
        "shm"
    }

    fn try_write(&mut self, bufs: &[&[u8]]) -> io::Result<usize> {
        if self.peer_gone || self.tx.reader_gone(&self.seg) {
            return Err(self.broken_pipe());
        }
        let (n, wake) = self.tx.write(&self.seg, bufs);
        if wake {
            self.ring_doorbell();
        }
        if n == 0 && bufs.iter().any(|b| !b.is_empty()) {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        Ok(n)
    }

    fn try_read(&mut self, bufs: &mut [&mut [u8]]) -> io::Result<usize> {
        if bufs.iter().all(|b| b.is_empty()) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty read"));
        }
        let (n, wake) = self.rx.read(&self.seg, bufs);
        if wake {
            self.ring_doorbell();
        }
        if n > 0 {
            return Ok(n);
        }
        if self.rx.at_end(&self.seg) || (self.peer_gone && self.rx.available(&self.seg) == 0) {
            return Ok(0);
        }
        Err(io::ErrorKind::WouldBlock.into())
    }

    fn peek(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.drain_doorbell();
        let n = self.rx.peek(&self.seg, buf);
        if n == 0 && !self.rx.at_end(&self.seg) && !self.peer_gone {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        Ok(n)
    }

    fn pollable(&self) -> RawFd {
        self.wake.pollable()
    }

    fn shutdown(&mut self) {
        if self.tx.close(&self.seg) {
            self.ring_doorbell();
        }
        self.wake.shutdown();
    }

    fn arm(&mut self, read: bool, write: bool) -> Option<libc::c_short> {
        self.drain_doorbell();

        if self.peer_gone {
            return None;
        }
        if read {
            let flag = self.seg.u32_at(self.rx.at.ctl + READER_WAITING);
            flag.store(1, Ordering::SeqCst);
            fence(Ordering::SeqCst);
            if self.rx.available(&self.seg) > 0 || self.rx.at_end(&self.seg) {
                flag.store(0, Ordering::Relaxed);
                return None;
            }
        }
        if write {
            let flag = self.seg.u32_at(self.tx.at.ctl + WRITER_WAITING);
            flag.store(1, Ordering::SeqCst);
            fence(Ordering::SeqCst);
            if self.tx.free(&self.seg) > 0 || self.tx.reader_gone(&self.seg) {
                flag.store(0, Ordering::Relaxed);
                return None;
            }
        }
        Some(libc::POLLIN)
    }

    fn zero_copy(&self) -> bool {
        true
    }

    fn read_with(&mut self, max: usize, f: &mut dyn FnMut(&[u8]) -> usize) -> io::Result<usize> {
        let (n, wake) = self.rx.read_with(&self.seg, max, f);
        if wake {
            self.ring_doorbell();
        }
        if n > 0 {
            return Ok(n);
        }
        // Nothing taken: either nothing is there, or only part of an element. Once the writer
        // has closed or died, look once more (it may have published just before) and then it is
        // the end of the stream: a partial element will never be completed.
        if self.rx.writer_done(&self.seg) || self.peer_gone {
            let (n, wake) = self.rx.read_with(&self.seg, max, f);
            if wake {
                self.ring_doorbell();
            }
            return Ok(n);
        }
        Err(io::ErrorKind::WouldBlock.into())
    }
}

impl Drop for ShmTransport {
    fn drop(&mut self) {
        // Writes to us fail from now on, and the peer reads end of stream after our data.
        self.seg.u32_at(self.rx.at.ctl + GONE).store(1, Ordering::Release);
        let _ = self.tx.close(&self.seg);
        // The wake-up connection closes with `wake`, which wakes a sleeping peer.
    }
}

/// Rounds a requested ring size to the power of two used (at least [`MIN_RING`]).
pub fn ring_capacity(requested: usize) -> usize {
    requested.max(MIN_RING).checked_next_power_of_two().unwrap_or(1 << 40)
}

/// A connected pair of non-blocking Unix stream sockets as transports (wake-up channels for
/// in-process pairs).
fn socket_pair() -> Result<(UnixWake, UnixWake)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: `fds` is a live array of two ints.
    syscall!(socketpair(
        libc::AF_UNIX,
        libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
        0,
        fds.as_mut_ptr()
    ))
    .map_err(|e| Error::system("socketpair", e))?;
    Ok((UnixWake(fds[0]), UnixWake(fds[1])))
}

/// One end of a socket pair used only to wake the other end.
#[derive(Debug)]
struct UnixWake(RawFd);

impl Drop for UnixWake {
    fn drop(&mut self) {
        // SAFETY: we own the descriptor.
        unsafe { libc::close(self.0) };
    }
}

impl Transport for UnixWake {
    fn kind(&self) -> &'static str {
        "unix"
    }

    fn try_write(&mut self, bufs: &[&[u8]]) -> io::Result<usize> {
        let b = bufs.iter().find(|b| !b.is_empty()).map_or(&[][..], |b| *b);
        // SAFETY: `b` is a live buffer of `b.len()` bytes.
        let r = syscall!(send(self.0, b.as_ptr().cast(), b.len(), libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL))?;
        Ok(r as usize)
    }

    fn try_read(&mut self, bufs: &mut [&mut [u8]]) -> io::Result<usize> {
        let Some(b) = bufs.iter_mut().find(|b| !b.is_empty()) else {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty read"));
        };
        // SAFETY: `b` is a live exclusive buffer of `b.len()` bytes.
        let r = syscall!(recv(self.0, b.as_mut_ptr().cast(), b.len(), libc::MSG_DONTWAIT))?;
        Ok(r as usize)
    }

    fn peek(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: `buf` is a live exclusive buffer.
        let r =
            syscall!(recv(self.0, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT | libc::MSG_PEEK))?;
        Ok(r as usize)
    }

    fn pollable(&self) -> RawFd {
        self.0
    }

    fn shutdown(&mut self) {
        // SAFETY: plain call on our descriptor.
        unsafe { libc::shutdown(self.0, libc::SHUT_WR) };
    }
}

/// Waits until `t` can progress in the asked directions or `deadline` passes (blocking helper
/// for set-up, outside the engine).
pub(crate) fn wait_ready(
    t: &mut dyn Transport,
    read: bool,
    write: bool,
    deadline: Instant,
) -> io::Result<()> {
    let Some(events) = t.arm(read, write) else { return Ok(()) };
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::ErrorKind::TimedOut.into());
    }
    let mut pfd = libc::pollfd { fd: t.pollable(), events, revents: 0 };
    let ms = left.as_millis().clamp(1, 100) as libc::c_int;
    // SAFETY: one live pollfd.
    match syscall!(poll(&mut pfd, 1, ms)) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(()),
        Err(e) => Err(e),
    }
}

// ---------------------------------------------------------------------------------------------
// Set-up: upgrading same-host links, and the window
// ---------------------------------------------------------------------------------------------

/// Settings of the shared-memory transport (from `TOROID_SHM_*`).
#[derive(Debug, Clone)]
pub struct ShmOptions {
    /// Use shared memory at all (`TOROID_SHM_DISABLE=1` turns it off).
    pub enabled: bool,
    /// Directory of the segments (a tmpfs; `TOROID_SHM_DIR`, default `/dev/shm`).
    pub dir: PathBuf,
    /// Bytes of each point-to-point ring (per direction).
    pub ring: usize,
    /// Bytes of each member region of the window (0: no window).
    pub window_region: usize,
}

/// What set-up produced.
#[derive(Debug)]
pub struct ShmSetup {
    /// One transport per rank: shared memory where the upgrade succeeded, else the original.
    pub links: Vec<Option<Box<dyn Transport>>>,
    /// The window of all ranks, when every rank is on this host and it could be set up.
    pub window: Option<super::window::Window>,
    /// Ranks reached through shared memory.
    pub shm_peers: usize,
}

const MSG_MAGIC: u32 = u32::from_le_bytes(*b"TRSM");
const MSG_LEN: usize = 256;
const MSG_TEXT: usize = MSG_LEN - 32;
const OFFER: u8 = 1;
const DECLINE: u8 = 2;
const ACCEPT: u8 = 3;
const REFUSE: u8 = 4;
const WIN_OFFER: u8 = 5;
const WIN_NONE: u8 = 6;
const WIN_OK: u8 = 7;
const WIN_FAIL: u8 = 8;
const WIN_GO: u8 = 9;
const WIN_NOGO: u8 = 10;

#[derive(Debug)]
struct Msg {
    kind: u8,
    nonce: u64,
    size: u64,
    text: String,
}

fn encode_msg(kind: u8, nonce: u64, size: u64, text: &str) -> [u8; MSG_LEN] {
    let mut m = [0u8; MSG_LEN];
    m[0..4].copy_from_slice(&MSG_MAGIC.to_le_bytes());
    m[4] = kind;
    m[8..16].copy_from_slice(&nonce.to_le_bytes());
    m[16..24].copy_from_slice(&size.to_le_bytes());
    let t = text.as_bytes();
    let mut n = t.len().min(MSG_TEXT);
    while !text.is_char_boundary(n) {
        n -= 1;
    }
    m[24..26].copy_from_slice(&(n as u16).to_le_bytes());
    m[32..32 + n].copy_from_slice(&t[..n]);
    m
}

fn decode_msg(m: &[u8; MSG_LEN]) -> Result<Msg> {
    if m[0..4] != MSG_MAGIC.to_le_bytes() {
        return Err(Error::Remote("shared-memory set-up: peer sent a bad message".into()));
    }
    let u64_at = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&m[i..i + 8]);
        u64::from_le_bytes(b)
    };
    let n = (u16::from_le_bytes([m[24], m[25]]) as usize).min(MSG_TEXT);
    Ok(Msg {
        kind: m[4],
        nonce: u64_at(8),
        size: u64_at(16),
        text: String::from_utf8_lossy(&m[32..32 + n]).into_owned(),
    })
}

fn send_msg(t: &mut dyn Transport, peer: usize, msg: &[u8; MSG_LEN], deadline: Instant) -> Result<()> {
    let mut done = 0;
    while done < MSG_LEN {
        match t.try_write(&[&msg[done..]]) {
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                wait_ready(t, false, true, deadline).map_err(|e| setup_error(peer, e))?;
            }
            Err(e) => return Err(setup_error(peer, e)),
        }
    }
    Ok(())
}

fn recv_msg(t: &mut dyn Transport, peer: usize, deadline: Instant) -> Result<Msg> {
    let mut m = [0u8; MSG_LEN];
    let mut got = 0;
    while got < MSG_LEN {
        match t.try_read(&mut [&mut m[got..]]) {
            Ok(0) => {
                return Err(Error::Remote(
                    format!("rank {peer} closed its connection during shared-memory set-up").into(),
                ));
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                wait_ready(t, true, false, deadline).map_err(|e| setup_error(peer, e))?;
            }
            Err(e) => return Err(setup_error(peer, e)),
        }
    }
    decode_msg(&m)
}

fn setup_error(peer: usize, e: io::Error) -> Error {
    if e.kind() == io::ErrorKind::TimedOut {
        Error::Timeout(format!("shared-memory set-up with rank {peer}: deadline passed").into())
    } else {
        Error::Remote(format!("shared-memory set-up with rank {peer} failed: {e}").into())
    }
}

/// Header of a pair segment.
const PAIR_MAGIC: usize = 0;
const PAIR_NONCE: usize = 8;
const PAIR_CAP: usize = 16;

fn link_mut(links: &mut [Option<Box<dyn Transport>>], peer: usize) -> Result<&mut dyn Transport> {
    match links.get_mut(peer).and_then(Option::as_mut) {
        Some(t) => Ok(t.as_mut()),
        None => Err(Error::Internal(format!("no connection to rank {peer} for shared-memory set-up").into())),
    }
}

/// Upgrades the links to every rank on this host (`host_of[r] == host_of[rank]`) to shared
/// memory, and, when every rank is on this host and `window` is asked for, sets up the window.
///
/// Runs over the freshly connected links before any frame moves, the same way on every rank:
/// the lower rank of each pair creates the segment and offers it, the higher one maps it and
/// accepts; either can decline (shared memory disabled, `/dev/shm` full, the segment not found
/// because the "same host" is not), and then the pair keeps TCP, with one WARN per rank.
pub fn connect(
    rank: usize,
    host_of: &[usize],
    mut links: Vec<Option<Box<dyn Transport>>>,
    opts: &ShmOptions,
    comm_id: u64,
    deadline: Instant,
) -> Result<ShmSetup> {
    let size = host_of.len();
    let local: Vec<usize> = (0..size).filter(|&r| r != rank && host_of[r] == host_of[rank]).collect();
    if local.is_empty() {
        return Ok(ShmSetup { links, window: None, shm_peers: 0 });
    }
    if opts.enabled {
        let removed = sweep_stale(&opts.dir);
        if !removed.is_empty() {
            tracing::info!(target: "toroid::net", "rank {rank}: removed stale shared-memory names {removed:?}");
        }
    }
    let cap = ring_capacity(opts.ring);
    let len = pair_segment_len(cap);
    let mut failures: Vec<String> = Vec::new();
    // 1. Offer a segment to every higher local rank (the messages fit in socket buffers, so
    //    offering to everyone before reading anything cannot deadlock).
    let mut offered: Vec<(usize, Segment)> = Vec::new();
    for &p in local.iter().filter(|&&p| p > rank) {
        let nonce = crate::sys::random::id() ^ comm_id;
        let made = if opts.enabled {
            Segment::create(&opts.dir, &segment_name(nonce, &format!("p{rank}-{p}")), len).map_err(|e| e.0)
        } else {
            Err("shared memory disabled on this rank (TOROID_SHM_DISABLE)".to_string())
        };
        let msg = match made {
            Ok(seg) => {
                seg.u64_at(PAIR_NONCE).store(nonce, Ordering::Relaxed);
                seg.u64_at(PAIR_CAP).store(cap as u64, Ordering::Relaxed);
                seg.u64_at(PAIR_MAGIC).store(SEG_MAGIC ^ SEG_VERSION, Ordering::Release);
                let path = seg.path.as_ref().map(|p| p.to_string_lossy().into_owned()).unwrap_or_default();
                let msg = if path.len() <= MSG_TEXT {
                    encode_msg(OFFER, nonce, len as u64, &path)
                } else {
                    encode_msg(DECLINE, 0, 0, "segment path too long")
                };
                if msg[4] == OFFER {
                    offered.push((p, seg));
                }
                msg
            }
            Err(reason) => {
                failures.push(reason.clone());
                encode_msg(DECLINE, 0, 0, &reason)
            }
        };
        send_msg(link_mut(&mut links, p)?, p, &msg, deadline)?;
    }
    // 2. Answer the offers of the lower local ranks.
    let mut accepted: Vec<(usize, Segment, usize)> = Vec::new();
    for &p in local.iter().filter(|&&p| p < rank) {
        let t = link_mut(&mut links, p)?;
        let m = recv_msg(t, p, deadline)?;
        match m.kind {
            OFFER => {
                let opened = if opts.enabled {
                    open_pair(Path::new(&m.text), m.size as usize, m.nonce)
                } else {
                    Err("shared memory disabled on this rank (TOROID_SHM_DISABLE)".to_string())
                };
                match opened {
                    Ok((mut seg, cap)) => {
                        seg.unlink();
                        send_msg(t, p, &encode_msg(ACCEPT, m.nonce, 0, ""), deadline)?;
                        accepted.push((p, seg, cap));
                    }
                    Err(reason) => {
                        failures.push(format!("rank {p}'s segment: {reason}"));
                        send_msg(t, p, &encode_msg(REFUSE, m.nonce, 0, &reason), deadline)?;
                    }
                }
            }
            DECLINE => failures.push(format!("rank {p}: {}", m.text)),
            k => {
                return Err(Error::Remote(
                    format!("shared-memory set-up: rank {p} sent message kind {k}").into(),
                ));
            }
        }
    }
    // 3. Collect the answers to our offers.
    for (p, mut seg) in offered {
        let m = recv_msg(link_mut(&mut links, p)?, p, deadline)?;
        seg.unlink();
        match m.kind {
            ACCEPT => accepted.push((p, seg, cap)),
            REFUSE => failures.push(format!("rank {p}: {}", m.text)),
            k => {
                return Err(Error::Remote(
                    format!("shared-memory set-up: rank {p} sent message kind {k}").into(),
                ));
            }
        }
    }
    let shm_peers = accepted.len();
    for (p, seg, cap) in accepted {
        let Some(wake) = links[p].take() else { continue };
        links[p] = Some(Box::new(ShmTransport::new(seg, cap, rank < p, wake)));
    }
    if !failures.is_empty() {
        tracing::warn!(target: "toroid::net",
            "rank {rank}: shared memory unavailable for {} of {} peers on this host, using TCP for them: {}",
            local.len() - shm_peers, local.len(), failures[0]);
    }
    // 4. The window of all ranks, when they all share this host.
    let window = if local.len() + 1 == size && opts.window_region > 0 {
        window_setup(rank, size, &mut links, opts, comm_id, deadline)?
    } else {
        None
    };
    Ok(ShmSetup { links, window, shm_peers })
}

fn open_pair(path: &Path, len: usize, nonce: u64) -> std::result::Result<(Segment, usize), String> {
    let name_ok = path.file_name().is_some_and(|n| n.to_string_lossy().starts_with(NAME_PREFIX));
    if !name_ok {
        return Err(format!("refusing to map {}: not a toroid segment name", path.display()));
    }
    let seg = Segment::open(path, len).map_err(|e| format!("opening {}: {e}", path.display()))?;
    let magic = seg.u64_at(PAIR_MAGIC).load(Ordering::Acquire);
    let cap = seg.u64_at(PAIR_CAP).load(Ordering::Relaxed) as usize;
    if magic != SEG_MAGIC ^ SEG_VERSION || seg.u64_at(PAIR_NONCE).load(Ordering::Relaxed) != nonce {
        return Err(format!("{} is not the segment offered (a different host or job?)", path.display()));
    }
    if !cap.is_power_of_two() || cap < MIN_RING || pair_segment_len(cap) != len {
        return Err(format!("{}: bad ring size {cap}", path.display()));
    }
    Ok((seg, cap))
}

fn window_setup(
    rank: usize,
    size: usize,
    links: &mut [Option<Box<dyn Transport>>],
    opts: &ShmOptions,
    comm_id: u64,
    deadline: Instant,
) -> Result<Option<super::window::Window>> {
    use super::window::{Window, window_len};
    let region = opts.window_region.div_ceil(4096) * 4096;
    let len = window_len(size, region);
    if rank == 0 {
        let nonce = crate::sys::random::id() ^ comm_id;
        let made = if opts.enabled {
            Segment::create(&opts.dir, &segment_name(nonce, "win"), len).map_err(|e| e.0)
        } else {
            Err("shared memory disabled (TOROID_SHM_DISABLE)".to_string())
        };
        let (mut win, offer) = match made {
            Ok(seg) => {
                let path = seg.path.as_ref().map(|p| p.to_string_lossy().into_owned()).unwrap_or_default();
                let w = Window::init(seg, size, 0, region, nonce)?;
                (Some(w), encode_msg(WIN_OFFER, nonce, len as u64, &path))
            }
            Err(reason) => {
                tracing::warn!(target: "toroid::net",
                    "rank 0: no shared-memory window, collectives use point-to-point links: {reason}");
                (None, encode_msg(WIN_NONE, 0, 0, &reason))
            }
        };
        for p in 1..size {
            send_msg(link_mut(links, p)?, p, &offer, deadline)?;
        }
        let Some(w) = win.as_mut() else { return Ok(None) };
        let mut refusal: Option<String> = None;
        for p in 1..size {
            let m = recv_msg(link_mut(links, p)?, p, deadline)?;
            match m.kind {
                WIN_OK => {}
                WIN_FAIL => {
                    refusal.get_or_insert(format!("rank {p}: {}", m.text));
                }
                k => {
                    return Err(Error::Remote(
                        format!("window set-up: rank {p} sent message kind {k}").into(),
                    ));
                }
            }
        }
        w.unlink();
        let verdict = match &refusal {
            None => encode_msg(WIN_GO, 0, 0, ""),
            Some(r) => encode_msg(WIN_NOGO, 0, 0, r),
        };
        for p in 1..size {
            send_msg(link_mut(links, p)?, p, &verdict, deadline)?;
        }
        if let Some(r) = refusal {
            tracing::warn!(target: "toroid::net", "rank 0: no shared-memory window: {r}");
            return Ok(None);
        }
        Ok(win)
    } else {
        let t = link_mut(links, 0)?;
        let m = recv_msg(t, 0, deadline)?;
        match m.kind {
            WIN_NONE => {
                tracing::info!(target: "toroid::net", "rank {rank}: no shared-memory window: {}", m.text);
                return Ok(None);
            }
            WIN_OFFER => {}
            k => return Err(Error::Remote(format!("window set-up: rank 0 sent message kind {k}").into())),
        }
        let path = PathBuf::from(&m.text);
        let attached = if !opts.enabled {
            Err(format!("shared memory disabled on rank {rank} (TOROID_SHM_DISABLE)"))
        } else if !path.file_name().is_some_and(|n| n.to_string_lossy().starts_with(NAME_PREFIX)) {
            Err(format!("refusing to map {}: not a toroid segment name", path.display()))
        } else {
            Segment::open(&path, m.size as usize)
                .and_then(|seg| Window::attach(seg, size, rank, region, m.nonce))
                .map_err(|e| format!("rank {rank} could not map {}: {e}", path.display()))
        };
        let mut win = match attached {
            // The name stays until rank 0 has heard from every rank (it unlinks it then).
            Ok(w) => {
                send_msg(t, 0, &encode_msg(WIN_OK, 0, 0, ""), deadline)?;
                w
            }
            Err(reason) => {
                send_msg(t, 0, &encode_msg(WIN_FAIL, 0, 0, &reason), deadline)?;
                // Rank 0 still sends its verdict; read it so the stream stays in step.
                let _ = recv_msg(t, 0, deadline)?;
                return Ok(None);
            }
        };
        let v = recv_msg(t, 0, deadline)?;
        match v.kind {
            WIN_GO => {
                win.unlink();
                Ok(Some(win))
            }
            WIN_NOGO => {
                tracing::info!(target: "toroid::net", "rank {rank}: no shared-memory window: {}", v.text);
                Ok(None)
            }
            k => Err(Error::Remote(format!("window set-up: rank 0 sent message kind {k}").into())),
        }
    }
}

impl ShmOptions {
    /// The settings in `cfg`.
    pub fn from_config(cfg: &crate::config::Config) -> ShmOptions {
        ShmOptions {
            enabled: !cfg.shm_disable,
            dir: cfg.shm_dir.clone(),
            ring: cfg.shm_ring_size,
            window_region: cfg.shm_chunk_size,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread;

    fn dir() -> PathBuf {
        PathBuf::from(crate::config::DEFAULT_SHM_DIR)
    }

    fn poll_one(t: &mut dyn Transport, read: bool, write: bool) {
        wait_ready(t, read, write, Instant::now() + Duration::from_secs(10)).unwrap();
    }

    fn pattern(i: u64) -> u8 {
        (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8
    }

    #[test]
    fn stream_survives_wrap_around_with_copies_and_lending() {
        let (mut a, mut b) = ShmTransport::pair(&dir(), MIN_RING).unwrap();
        const TOTAL: u64 = 3 << 20;
        let writer = thread::spawn(move || {
            let mut sent = 0u64;
            let mut len = 1usize;
            let mut buf = vec![0u8; 20000];
            while sent < TOTAL {
                len = (len * 7 + 13) % 20000 + 1;
                let n = len.min((TOTAL - sent) as usize);
                for (k, x) in buf[..n].iter_mut().enumerate() {
                    *x = pattern(sent + k as u64);
                }
                let mut off = 0;
                while off < n {
                    // Split into two parts to exercise vectored writes.
                    let mid = off + (n - off) / 2;
                    match a.try_write(&[&buf[off..mid], &buf[mid..n]]) {
                        Ok(k) => off += k,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => poll_one(&mut a, false, true),
                        Err(e) => panic!("{e}"),
                    }
                }
                sent += n as u64;
            }
            a.shutdown();
            a
        });
        let mut got = 0u64;
        let mut buf = vec![0u8; 7000];
        let mut turn = 0u32;
        loop {
            turn += 1;
            let r = if turn.is_multiple_of(2) {
                b.try_read(&mut [&mut buf[..(turn as usize * 31) % 7000 + 1]]).inspect(|&n| {
                    for (k, x) in buf[..n].iter().enumerate() {
                        assert_eq!(*x, pattern(got + k as u64), "byte {}", got + k as u64);
                    }
                })
            } else {
                let mut at = got;
                // Take whole 4-byte "elements" only, as a reducing sink does.
                b.read_with(usize::MAX, &mut |s: &[u8]| {
                    let take = s.len() - s.len() % 4;
                    for (k, x) in s[..take].iter().enumerate() {
                        assert_eq!(*x, pattern(at + k as u64), "lent byte {}", at + k as u64);
                    }
                    at += take as u64;
                    take
                })
            };
            match r {
                Ok(0) => break,
                Ok(n) => got += n as u64,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    // The last bytes may be a partial element only plain reads take.
                    if !turn.is_multiple_of(2) {
                        continue;
                    }
                    poll_one(&mut b, true, false)
                }
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(got, TOTAL);
        drop(writer.join().unwrap());
    }

    #[test]
    fn lending_stitches_elements_across_the_ring_end() {
        let (mut a, mut b) = ShmTransport::pair(&dir(), MIN_RING).unwrap();
        // Move the stream position to 6 bytes before the end of the ring.
        let pad = vec![0u8; MIN_RING - 6];
        assert_eq!(a.try_write(&[&pad]).unwrap(), pad.len());
        let mut sink = vec![0u8; pad.len()];
        assert_eq!(b.try_read(&mut [&mut sink]).unwrap(), pad.len());
        let data: Vec<u8> = (0..16u8).collect();
        assert_eq!(a.try_write(&[&data]).unwrap(), 16);
        let mut seen = Vec::new();
        while seen.len() < 16 {
            b.read_with(16 - seen.len(), &mut |s: &[u8]| {
                let take = s.len() - s.len() % 8;
                seen.extend_from_slice(&s[..take]);
                take
            })
            .unwrap();
        }
        assert_eq!(seen, data);
    }

    #[test]
    fn end_of_stream_after_shutdown_and_after_drop() {
        let (mut a, mut b) = ShmTransport::pair(&dir(), MIN_RING).unwrap();
        a.try_write(&[b"last words"]).unwrap();
        a.shutdown();
        let mut buf = [0u8; 64];
        assert_eq!(b.try_read(&mut [&mut buf]).unwrap(), 10);
        assert_eq!(b.try_read(&mut [&mut buf]).unwrap(), 0);
        let (mut a, mut b) = ShmTransport::pair(&dir(), MIN_RING).unwrap();
        a.try_write(&[b"x"]).unwrap();
        drop(a);
        assert_eq!(b.try_read(&mut [&mut buf]).unwrap(), 1);
        assert_eq!(b.try_read(&mut [&mut buf]).unwrap(), 0);
        assert_eq!(b.try_write(&[b"y"]).unwrap_err().kind(), io::ErrorKind::BrokenPipe);
    }

    #[test]
    fn a_killed_peer_is_seen_through_the_wake_up_connection() {
        // The peer's process dies without marking its ring: only its socket closes.
        let (mut a, mut b) = ShmTransport::pair(&dir(), MIN_RING).unwrap();
        let (spare, _other) = socket_pair().unwrap();
        drop(std::mem::replace(&mut a.wake, Box::new(spare)));
        std::mem::forget(a); // no Drop: the ring is never marked closed
        let mut buf = [0u8; 8];
        assert_eq!(b.try_read(&mut [&mut buf]).unwrap_err().kind(), io::ErrorKind::WouldBlock);
        assert!(b.arm(true, false).is_none(), "arm notices the closed connection");
        assert_eq!(b.try_read(&mut [&mut buf]).unwrap(), 0);
    }

    #[test]
    fn arm_sleeps_only_when_nothing_can_move_and_a_write_wakes_the_sleeper() {
        let (mut a, mut b) = ShmTransport::pair(&dir(), MIN_RING).unwrap();
        assert_eq!(b.arm(true, false), Some(libc::POLLIN));
        assert!(a.arm(false, true).is_none(), "an empty ring has room");
        let t = thread::spawn(move || {
            thread::sleep(Duration::from_millis(50));
            a.try_write(&[b"wake"]).unwrap();
            a
        });
        let mut pfd = libc::pollfd { fd: b.pollable(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one live pollfd.
        let n = unsafe { libc::poll(&mut pfd, 1, 5000) };
        assert_eq!(n, 1, "the writer's doorbell wakes poll");
        let mut buf = [0u8; 8];
        assert_eq!(b.try_read(&mut [&mut buf]).unwrap(), 4);
        let mut a = t.join().unwrap();
        // A full ring: the writer arms, the reader's release wakes it.
        let fill = vec![7u8; MIN_RING];
        assert_eq!(a.try_write(&[&fill]).unwrap(), MIN_RING);
        assert_eq!(a.arm(false, true), Some(libc::POLLIN));
        let mut big = vec![0u8; 100];
        b.try_read(&mut [&mut big]).unwrap();
        let mut pfd = libc::pollfd { fd: a.pollable(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one live pollfd.
        assert_eq!(unsafe { libc::poll(&mut pfd, 1, 5000) }, 1);
        assert!(a.arm(false, true).is_none());
    }

    #[test]
    fn creating_in_a_missing_directory_is_a_clear_error() {
        let e = Segment::create(Path::new("/nonexistent-toroid-dir"), "toroid-x", 8192).unwrap_err();
        assert!(e.0.contains("/nonexistent-toroid-dir/toroid-x") && e.0.contains("open"), "{e}");
    }

    #[test]
    fn sweep_removes_only_old_names_of_dead_processes() {
        let dir = std::env::temp_dir().join(format!("toroid-sweep-test-{}", crate::sys::random::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let make = |name: &str, old: bool| {
            let p = dir.join(name);
            std::fs::write(&p, b"").unwrap();
            if old {
                let t = SystemTime::now() - Duration::from_secs(3600);
                std::fs::File::options().write(true).open(&p).unwrap().set_modified(t).unwrap();
            }
        };
        make(&format!("toroid-{dead}-00-p0-1"), true);
        make(&format!("toroid-{dead}-01-win"), false);
        make(&format!("toroid-{}-02-win", std::process::id()), true);
        make("unrelated-1-2", true);
        let removed = sweep_stale(&dir);
        assert_eq!(removed, vec![format!("toroid-{dead}-00-p0-1")]);
        let mut left: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left.len(), 3);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
