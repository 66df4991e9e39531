//! Shared-memory segments: files in a tmpfs directory mapped into this process, and the sweep
//! of names left behind (see the [module documentation](super)).

use std::ffi::CString;
use std::io;
use std::os::fd::RawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::time::{Duration, SystemTime};

use crate::sys::syscall;

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
    ptr: NonNull<u8>,
    len: usize,
    /// The path while this process is responsible for removing it.
    pub(super) path: Option<PathBuf>,
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

#[cfg(test)]
mod tests {
    use super::*;

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
