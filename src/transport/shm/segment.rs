//! Shared-memory segments: files in a tmpfs directory mapped into this process, and the sweep
//! of names left behind (see the [module documentation](super)).

use std::io;
use std::marker::PhantomData;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::time::{Duration, SystemTime};

use crate::sys::shm_file::{self, Mapping};

/// Prefix of every segment name toroid creates.
pub const NAME_PREFIX: &str = "toroid-";
/// A name older than this whose creator is gone is stale (see [`sweep_stale`]).
const STALE_AGE: Duration = Duration::from_secs(30);

/// A shared-memory segment mapped into this process.
///
/// Created with [`Segment::create`] (which leaves the name in place until [`Segment::unlink`]) or
/// opened by name with [`Segment::open`]. Dropping it unmaps the memory and, if this process
/// still holds the name, removes it.
#[derive(Debug)]
pub struct Segment {
    map: Mapping,
    /// The path while this process is responsible for removing it.
    path: Option<PathBuf>,
}

/// Why a segment could not be created.
#[derive(Debug, Clone)]
pub struct SegmentError(pub String);

impl std::fmt::Display for SegmentError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
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
            // ENOSPC, EFBIG, ENOMEM: the file system (or its memory) is too small.
            use io::ErrorKind::{FileTooLarge, OutOfMemory, StorageFull};
            if matches!(e.kind(), StorageFull | FileTooLarge | OutOfMemory) {
                if let Ok((free, total)) = shm_file::free_space(dir) {
                    msg.push_str(&format!(" ({} has {} free of {})", dir.display(), mib(free), mib(total)));
                }
                msg.push_str(
                    "; containers often get a 64 MB /dev/shm: run with --shm-size=1g or --ipc=host, \
                     point TOROID_SHM_DIR at a larger tmpfs, or set TOROID_SHM_DISABLE=1",
                );
            }
            SegmentError(msg)
        };
        let file = shm_file::create(&path).map_err(|e| fail("open", e))?;
        let mapped = file
            .set_len(len as u64)
            .map_err(|e| fail("ftruncate", e))
            // Reserve every page now: on tmpfs a later first touch beyond the size limit is
            // SIGBUS.
            .and_then(|()| shm_file::allocate(&file, len as u64).map_err(|e| fail("fallocate", e)))
            .and_then(|()| Mapping::shared(file.as_fd(), len).map_err(|e| fail("mmap", e)));
        match mapped {
            Ok(map) => Ok(Segment { map, path: Some(path) }),
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                Err(e)
            }
        }
    }

    /// Opens and maps an existing segment of exactly `len` bytes. The caller unlinks it.
    pub fn open(path: &Path, len: usize) -> io::Result<Segment> {
        let file = shm_file::open(path)?;
        let size = file.metadata()?.len();
        if size != len as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("segment is {size} bytes, expected {len}"),
            ));
        }
        let map = Mapping::shared(file.as_fd(), len)?;
        Ok(Segment { map, path: Some(path.to_path_buf()) })
    }

    /// Removes the name (idempotent; a name already removed by the peer is fine).
    pub fn unlink(&mut self) {
        if let Some(p) = self.path.take() {
            let _ = std::fs::remove_file(p);
        }
    }

    /// The name while this process is responsible for removing it (until [`Segment::unlink`]).
    pub(super) fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Start of the mapping (page aligned).
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_ptr().as_ptr()
    }

    /// Length of the mapping.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// The mapping as shared memory, for as long as `self` is borrowed.
    pub(crate) fn mem(&self) -> SharedMem<'_> {
        // SAFETY: the mapping is page aligned and stays mapped while `self` lives; processes
        // that map it access its words only atomically and its other bytes under the protocols
        // of the rings and the window (see their modules).
        unsafe { SharedMem::new(self.map.as_ptr(), self.map.len()) }
    }

    /// The 64-bit word at byte `offset` (8-aligned, inside the mapping) as an atomic.
    pub(crate) fn u64_at(&self, offset: usize) -> &AtomicU64 {
        self.mem().u64_at(offset)
    }

    /// The 32-bit word at byte `offset` (4-aligned, inside the mapping) as an atomic.
    pub(crate) fn u32_at(&self, offset: usize) -> &AtomicU32 {
        self.mem().u32_at(offset)
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // The name goes first; the mapping is unmapped when `map` drops after this.
        self.unlink();
    }
}

/// A borrowed view of memory shared with other threads or processes: `len` bytes at an 8-byte
/// aligned address, valid for `'a`. Words are accessed as atomics ([`SharedMem::u64_at`],
/// [`SharedMem::u32_at`]); other bytes through the raw pointers of [`SharedMem::ptr_at`], under
/// a protocol that keeps a writer of some bytes apart from every other access to them (the
/// rings', the window's). A [`Segment`] gives one ([`Segment::mem`]), and so does a heap buffer
/// of atomic words (the rings' tests).
#[derive(Debug, Clone, Copy)]
pub(crate) struct SharedMem<'a> {
    ptr: NonNull<u8>,
    len: usize,
    _borrow: PhantomData<&'a [AtomicU64]>,
}

impl<'a> SharedMem<'a> {
    /// A view of `len` bytes at `ptr`.
    ///
    /// # Safety
    ///
    /// `ptr` is 8-byte aligned, the `len` bytes from it stay allocated and writable for `'a`,
    /// and whoever accesses them during `'a` (in any process) does so atomically or under a
    /// protocol that excludes data races.
    pub(crate) unsafe fn new(ptr: NonNull<u8>, len: usize) -> SharedMem<'a> {
        SharedMem { ptr, len, _borrow: PhantomData }
    }

    /// A view of heap words.
    #[cfg(test)]
    pub(crate) fn from_words(words: &'a [AtomicU64]) -> SharedMem<'a> {
        // SAFETY: atomics are 8-byte aligned, live for `'a`, and allow writes through shared
        // references (they are `UnsafeCell`s); their other users access them atomically.
        unsafe { SharedMem::new(NonNull::from(words).cast(), std::mem::size_of_val(words)) }
    }

    /// The 64-bit word at byte `offset` (8-aligned, inside the memory) as an atomic.
    pub(crate) fn u64_at(self, offset: usize) -> &'a AtomicU64 {
        assert!(offset.is_multiple_of(8) && offset + 8 <= self.len, "word at {offset} of {}", self.len);
        // SAFETY: in bounds and aligned (checked, the base is 8-aligned); the memory lives for
        // `'a`, and everyone accesses this word only atomically.
        unsafe { AtomicU64::from_ptr(self.ptr.as_ptr().add(offset).cast()) }
    }

    /// The 32-bit word at byte `offset` (4-aligned, inside the memory) as an atomic.
    pub(crate) fn u32_at(self, offset: usize) -> &'a AtomicU32 {
        assert!(offset.is_multiple_of(4) && offset + 4 <= self.len, "word at {offset} of {}", self.len);
        // SAFETY: as in `u64_at`.
        unsafe { AtomicU32::from_ptr(self.ptr.as_ptr().add(offset).cast()) }
    }

    /// A pointer to the `len` bytes at `offset`, checked to lie inside the memory. Reading or
    /// writing through it is the caller's `unsafe`, under the protocol of those bytes.
    pub(crate) fn ptr_at(self, offset: usize, len: usize) -> *mut u8 {
        assert!(offset <= self.len && len <= self.len - offset, "bytes {offset}+{len} of {}", self.len);
        // SAFETY: `offset <= len` (checked): the result is inside the allocation or one past it.
        unsafe { self.ptr.as_ptr().add(offset) }
    }
}

/// A segment name for this process: `toroid-<pid>-<nonce>-<what>`.
pub fn segment_name(nonce: u64, what: &str) -> String {
    format!("{NAME_PREFIX}{}-{nonce:016x}-{what}", std::process::id())
}

/// Removes names in `dir` that toroid left behind: created by a process that no longer exists
/// (killed inside a set-up exchange, when only the name keeps the memory), at least
/// 30 seconds old (`STALE_AGE`). Returns the names removed.
pub fn sweep_stale(dir: &Path) -> Vec<String> {
    let mut removed = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else { return removed };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(NAME_PREFIX) else { continue };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<i32>().ok()) else { continue };
        if pid <= 0 {
            continue;
        }
        let gone = !crate::sys::pid::exists(pid as u32);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn creating_in_a_missing_directory_is_a_clear_error() {
        let e = Segment::create(Path::new("/nonexistent-toroid-dir"), "toroid-x", 8192).unwrap_err();
        assert!(e.0.contains("/nonexistent-toroid-dir/toroid-x") && e.0.contains("open"), "{e}");
    }

    #[test]
    fn create_open_share_and_unlink() {
        let dir = std::env::temp_dir().join(format!("toroid-segment-test-{}", crate::sys::random::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut a = Segment::create(&dir, "toroid-t", 8192).unwrap();
        let path = a.path().unwrap().to_path_buf();
        assert_eq!(path, dir.join("toroid-t"));
        let e = Segment::create(&dir, "toroid-t", 8192).unwrap_err();
        assert!(e.0.contains("open") && !e.0.contains("--shm-size"), "{e}");
        let wrong = Segment::open(&path, 4096).unwrap_err();
        assert_eq!(wrong.kind(), io::ErrorKind::InvalidData, "{wrong}");
        let mut b = Segment::open(&path, 8192).unwrap();
        assert_eq!((b.len(), b.as_ptr() as usize % 4096), (8192, 0));
        a.u64_at(8184).store(7, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(b.u64_at(8184).load(std::sync::atomic::Ordering::Relaxed), 7);
        b.unlink();
        assert!(!path.exists() && b.path().is_none());
        a.unlink(); // already gone: fine
        drop(a);
        assert_eq!(b.u32_at(8188).load(std::sync::atomic::Ordering::Relaxed), 0);
        let c = Segment::create(&dir, "toroid-u", 4096).unwrap();
        drop(c);
        assert!(!dir.join("toroid-u").exists(), "drop removes a name still held");
        std::fs::remove_dir_all(&dir).unwrap();
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
