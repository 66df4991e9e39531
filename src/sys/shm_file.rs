//! Files of shared memory: created exclusively in a tmpfs directory, their pages reserved,
//! mapped shared into this process ([`Mapping`]), and the free space of their file system.
//!
//! Sizing (`ftruncate`), the size check (`fstat`) and removal (`unlink`) are std's
//! [`File::set_len`], [`File::metadata`] and [`std::fs::remove_file`].

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::ptr::NonNull;

/// Creates `path` for reading and writing, only if nothing is there, not even a dangling
/// symbolic link (`O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC`, mode `0600`).
pub fn create(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
}

/// Opens an existing `path` for reading and writing, refusing a symbolic link
/// (`O_NOFOLLOW | O_CLOEXEC`).
pub fn open(path: &Path) -> io::Result<File> {
    OpenOptions::new().read(true).write(true).custom_flags(libc::O_NOFOLLOW).open(path)
}

/// Reserves the first `len` bytes of `file` (`fallocate(2)`, or `posix_fallocate(3)` where the
/// file system does not support it): on a tmpfs that is too small this fails with `ENOSPC`
/// instead of a later `SIGBUS` on the first touch of a page beyond its limit.
pub fn allocate(file: &File, len: u64) -> io::Result<()> {
    let len = libc::off_t::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::FileTooLarge))?;
    // Plain integers on an open descriptor that `file` owns.
    match super::syscall!(fallocate(file.as_raw_fd(), 0, 0, len)) {
        Ok(_) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
            // SAFETY: plain integers on an open descriptor that `file` owns.
            let r = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) };
            // posix_fallocate returns the error number instead of setting errno.
            if r == 0 { Ok(()) } else { Err(io::Error::from_raw_os_error(r)) }
        }
        Err(e) => Err(e),
    }
}

/// Free bytes (for unprivileged users) and total bytes of the file system holding `dir`
/// (`statvfs(3)`).
pub fn free_space(dir: &Path) -> io::Result<(u64, u64)> {
    let c = CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in path"))?;
    // SAFETY: an all-zero statvfs is a valid value of this plain C struct.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // `c` is a NUL-terminated path and `st` a live, exclusively borrowed output struct.
    super::syscall!(statvfs(c.as_ptr(), &mut st))?;
    let unit = st.f_frsize as u64;
    Ok((st.f_bavail as u64 * unit, st.f_blocks as u64 * unit))
}

/// A shared, readable and writable mapping of a file (`mmap(2)` with `MAP_SHARED`), unmapped
/// on drop. The mapping stays valid after the file's descriptor is closed.
///
/// It hands out only a raw pointer: whoever reads or writes through it answers for the
/// accesses (other processes may map the same file).
#[derive(Debug)]
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a `Mapping` owns no Rust values, only the address range; every access through its
// pointer is an `unsafe` operation of the caller, who answers for synchronisation.
unsafe impl Send for Mapping {}
// SAFETY: as above; `&Mapping` gives nothing but the pointer and the length.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps the first `len` bytes of `fd` shared, for reading and writing. Touching pages beyond
    /// the end of the file raises `SIGBUS`: size the file first.
    pub fn shared(fd: BorrowedFd<'_>, len: usize) -> io::Result<Mapping> {
        // SAFETY: a fresh mapping at an address the kernel picks: no existing memory changes.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(p.cast()).ok_or_else(|| io::Error::other("mmap returned null"))?;
        Ok(Mapping { ptr, len })
    }

    /// Start of the mapping (page aligned).
    pub fn as_ptr(&self) -> NonNull<u8> {
        self.ptr
    }

    /// Length of the mapping in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` describe a mapping made by `Mapping::shared` and not unmapped
        // before; nothing borrows from it past `self`.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::os::unix::fs::PermissionsExt;
    use std::path::PathBuf;

    fn temp_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("toroid-shm-file-test-{:016x}", crate::sys::random::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn create_allocate_map_share_and_unlink() {
        let dir = temp_dir();
        let path = dir.join("seg");
        let f = create(&path).unwrap();
        assert_eq!(f.metadata().unwrap().permissions().mode() & 0o177, 0, "owner-only");
        assert_eq!(create(&path).unwrap_err().kind(), io::ErrorKind::AlreadyExists);
        f.set_len(8192).unwrap();
        allocate(&f, 8192).unwrap();
        let a = Mapping::shared(f.as_fd(), 8192).unwrap();
        drop(f); // the mapping outlives the descriptor
        let g = open(&path).unwrap();
        assert_eq!(g.metadata().unwrap().len(), 8192);
        let b = Mapping::shared(g.as_fd(), 8192).unwrap();
        assert_eq!(a.len(), 8192);
        assert_eq!(a.as_ptr().as_ptr() as usize % 4096, 0, "page aligned");
        // SAFETY: both mappings are 8192 bytes long and this thread is their only user.
        unsafe {
            a.as_ptr().as_ptr().add(8191).write(42);
            assert_eq!(b.as_ptr().as_ptr().add(8191).read(), 42, "one file, two mappings");
        }
        std::fs::remove_file(&path).unwrap();
        assert_eq!(open(&path).unwrap_err().kind(), io::ErrorKind::NotFound);
        // SAFETY: as above; the memory lives as long as a mapping does.
        assert_eq!(unsafe { b.as_ptr().as_ptr().add(8191).read() }, 42);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn symbolic_links_are_refused_and_empty_mappings_fail() {
        let dir = temp_dir();
        let target = dir.join("target");
        std::fs::write(&target, b"x").unwrap();
        std::os::unix::fs::symlink(&target, dir.join("link")).unwrap();
        assert!(open(&dir.join("link")).is_err(), "open follows no link");
        assert_eq!(create(&dir.join("link")).unwrap_err().kind(), io::ErrorKind::AlreadyExists);
        let f = open(&target).unwrap();
        assert!(Mapping::shared(f.as_fd(), 0).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn free_space_of_a_directory_and_of_none() {
        let (free, total) = free_space(&std::env::temp_dir()).unwrap();
        assert!(total > 0 && free <= total, "{free} of {total}");
        assert!(free_space(Path::new("/nonexistent-toroid-dir")).is_err());
    }
}
