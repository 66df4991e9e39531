//! File store: one file per key in a directory every rank can see.
//!
//! A key `k` lives in the file `k.<k percent-encoded>`: bytes outside `[A-Za-z0-9._-]` become
//! `%XX`, so any key maps to one safe name and distinct keys to distinct names (the `k.` prefix
//! keeps `.` and `..` away). A value is written to a fresh temporary file and renamed over the
//! key's file, so readers see the old value or the new one, never a torn one. `get` and `wait`
//! poll with backoff from 1 ms to 50 ms. `add` is a read-modify-write under an exclusive
//! `flock(2)` on the file `.lock` (on NFS, Linux maps `flock` onto byte-range locks, which the
//! server arbitrates). `delete` unlinks. On a network file system a new file may take a moment
//! (the attribute cache) to show on other hosts; the polling covers that.

use std::fs::{self, File, OpenOptions, TryLockError};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use super::Store;
use crate::config::DEFAULT_TIMEOUT;
use crate::error::{Error, Result};

const POLL_START: Duration = Duration::from_millis(1);
const POLL_CAP: Duration = Duration::from_millis(50);
/// Longest file name Linux file systems accept.
const NAME_MAX: usize = 255;
const LOCK_FILE: &str = ".lock";

/// Refuses a store directory that another user could tamper with: one owned by another user, or
/// one that others may write (group- or world-writable, sticky or not: a stranger could plant
/// keys, or delete and replace ours). What remains: root, and the owner's other processes, can
/// always read and write the store; on a network file system the server's administrators too.
/// Keys and values are addresses and ids, not secrets, but a planted key could send ranks to a
/// stranger's address, which is why writing is what is checked.
fn check_owned(dir: &Path) -> Result<()> {
    let meta =
        fs::metadata(dir).map_err(|e| Error::system(format!("file store: stat {}", dir.display()), e))?;
    let me = crate::sys::user::euid();
    let (owner, mode) = (meta.uid(), meta.mode() & 0o7777);
    if !meta.is_dir() {
        return Err(Error::InvalidUsage(format!("file store: {} is not a directory", dir.display()).into()));
    }
    if owner != me || mode & 0o022 != 0 {
        return Err(Error::InvalidUsage(
            format!(
                "file store: {} is owned by uid {owner} with mode {mode:o}; the store needs a directory of \
                 this user (uid {me}) that no one else can write (chmod go-w, or choose another directory)",
                dir.display()
            )
            .into(),
        ));
    }
    Ok(())
}

/// A store kept in a directory of a shared file system.
#[derive(Debug)]
pub struct FileStore {
    dir: PathBuf,
    timeout: Duration,
}

impl FileStore {
    /// Opens (creating if needed) the store directory `path`.
    ///
    /// `add` waits for the lock up to [`DEFAULT_TIMEOUT`]; see [`FileStore::with_timeout`].
    ///
    /// # Errors
    /// [`Error::System`] when the directory cannot be created.
    pub fn new(path: impl AsRef<Path>) -> Result<FileStore> {
        let dir = path.as_ref().to_path_buf();
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(|e| Error::system(format!("file store: create {}", dir.display()), e))?;
        check_owned(&dir)?;
        tracing::info!(target: "toroid::store", "file store in {}", dir.display());
        Ok(FileStore { dir, timeout: DEFAULT_TIMEOUT })
    }

    /// Sets how long `add` waits for the lock that another process holds.
    pub fn with_timeout(mut self, timeout: Duration) -> FileStore {
        self.timeout = timeout;
        self
    }

    /// The store's directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    fn key_path(&self, key: &str) -> Result<PathBuf> {
        let name = file_name(key);
        if name.len() > NAME_MAX {
            return Err(Error::InvalidArgument(
                format!(
                    "file store: key of {} bytes is too long (encoded file name above {NAME_MAX} bytes)",
                    key.len()
                )
                .into(),
            ));
        }
        Ok(self.dir.join(name))
    }

    fn err(&self, what: impl std::fmt::Display, e: io::Error) -> Error {
        Error::system(format!("file store {}: {what}", self.dir.display()), e)
    }

    /// Writes `value` to a temporary file and renames it to `path`.
    fn write_atomic(&self, path: &Path, value: &[u8]) -> Result<()> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        loop {
            // Ranks on several hosts share the directory and may share a pid: the time and a
            // per-process counter make the name unique, and `create_new` catches the rest.
            let nanos = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
            let seq = SEQ.fetch_add(1, Ordering::Relaxed);
            let tmp = self.dir.join(format!(".tmp.{}.{seq}.{nanos}", std::process::id()));
            let mut file = match OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp) {
                Ok(f) => f,
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(self.err(format!("create {}", tmp.display()), e)),
            };
            let res = file.write_all(value).and_then(|()| fs::rename(&tmp, path));
            if let Err(e) = res {
                let _ = fs::remove_file(&tmp);
                return Err(self.err(format!("write {}", path.display()), e));
            }
            return Ok(());
        }
    }

    /// Calls `probe` with backoff until it returns a value or `timeout` passes; then `expired`
    /// gives the timeout's message.
    fn poll<T>(
        &self,
        timeout: Duration,
        mut probe: impl FnMut() -> Result<Option<T>>,
        expired: impl FnOnce() -> String,
    ) -> Result<T> {
        let deadline = Instant::now().checked_add(timeout);
        let mut backoff = POLL_START;
        loop {
            if let Some(v) = probe()? {
                return Ok(v);
            }
            let remaining = deadline.map_or(POLL_CAP, |d| d.saturating_duration_since(Instant::now()));
            if remaining.is_zero() {
                return Err(Error::Timeout(
                    format!("file store {}: {}", self.dir.display(), expired()).into(),
                ));
            }
            std::thread::sleep(backoff.min(remaining));
            backoff = (backoff * 2).min(POLL_CAP);
        }
    }

    fn exists(&self, path: &Path) -> Result<bool> {
        match fs::symlink_metadata(path) {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(self.err(format!("stat {}", path.display()), e)),
        }
    }
}

/// `k.` followed by `key` with every byte outside `[A-Za-z0-9._-]` written as `%XX`.
fn file_name(key: &str) -> String {
    let mut name = String::with_capacity(2 + key.len());
    name.push_str("k.");
    for b in key.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-') {
            name.push(char::from(b));
        } else {
            name.push_str(&format!("%{b:02X}"));
        }
    }
    name
}

/// Tries to take an exclusive lock on `file` without blocking (std's `File::try_lock`: an
/// exclusive, non-blocking `flock` on Linux).
fn try_lock(file: &File) -> io::Result<bool> {
    match file.try_lock() {
        Ok(()) => Ok(true),
        Err(TryLockError::WouldBlock) => Ok(false),
        Err(TryLockError::Error(e)) if e.kind() == io::ErrorKind::Interrupted => Ok(false),
        Err(TryLockError::Error(e)) => Err(e),
    }
}

impl Store for FileStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.write_atomic(&self.key_path(key)?, value)
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let path = self.key_path(key)?;
        self.poll(
            timeout,
            || match fs::read(&path) {
                Ok(v) => Ok(Some(v)),
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(self.err(format!("read {}", path.display()), e)),
            },
            || format!("waited {timeout:?} for key '{key}'"),
        )
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let path = self.key_path(key)?;
        let lock_path = self.dir.join(LOCK_FILE);
        let lock = OpenOptions::new()
            .read(true)
            .write(true)
            .mode(0o600)
            .create(true)
            .truncate(false)
            .open(&lock_path)
            .map_err(|e| self.err(format!("open {}", lock_path.display()), e))?;
        // Non-blocking attempts, so that a lock holder that hangs costs a timeout, not a hang.
        self.poll(
            self.timeout,
            || try_lock(&lock).map(|held| held.then_some(())).map_err(|e| self.err("flock", e)),
            || format!("waited {:?} for the lock {}", self.timeout, lock_path.display()),
        )?;
        let cur = match fs::read(&path) {
            Ok(v) => super::parse_counter(key, &v)?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => 0,
            Err(e) => return Err(self.err(format!("read {}", path.display()), e)),
        };
        let new = cur.wrapping_add(delta);
        self.write_atomic(&path, new.to_string().as_bytes())?;
        // Closing `lock` releases the flock.
        drop(lock);
        Ok(new)
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let paths = keys.iter().map(|k| self.key_path(k)).collect::<Result<Vec<_>>>()?;
        let missing = || -> Result<Vec<&str>> {
            let mut missing = Vec::new();
            for (k, p) in keys.iter().zip(&paths) {
                if !self.exists(p)? {
                    missing.push(*k);
                }
            }
            Ok(missing)
        };
        self.poll(
            timeout,
            || Ok(missing()?.is_empty().then_some(())),
            || format!("waited {timeout:?} for keys {:?}", missing().unwrap_or_default()),
        )
    }

    fn delete(&self, key: &str) -> Result<bool> {
        let path = self.key_path(key)?;
        match fs::remove_file(&path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(self.err(format!("remove {}", path.display()), e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rendezvous::check_store_contract;
    use std::sync::Arc;

    const T: Duration = Duration::from_secs(5);

    /// A fresh directory under the system temp dir, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> TempDir {
            let nanos = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap().as_nanos();
            let p = std::env::temp_dir().join(format!("toroid-fs-{name}-{}-{nanos}", std::process::id()));
            fs::create_dir_all(&p).unwrap();
            TempDir(p)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn keeps_the_store_contract_in_a_new_directory() {
        let dir = TempDir::new("roundtrip");
        // A directory that does not exist yet is created.
        let s = FileStore::new(dir.0.join("sub/store")).unwrap();
        check_store_contract(&s);
        // No temporary files are left behind.
        let names: Vec<String> =
            fs::read_dir(s.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        assert!(names.iter().all(|n| n.starts_with("k.") || n == LOCK_FILE), "{names:?}");
    }

    #[test]
    fn keys_map_to_distinct_safe_file_names() {
        let dir = TempDir::new("names");
        let s = FileStore::new(&dir.0).unwrap();
        let keys = ["", ".", "..", "a/b", "a%2Fb", "../escape", "ключ 🔑", "A-z_0.9"];
        for (i, k) in keys.iter().enumerate() {
            s.set(k, i.to_string().as_bytes()).unwrap();
        }
        for (i, k) in keys.iter().enumerate() {
            assert_eq!(s.get(k, T).unwrap(), i.to_string().as_bytes(), "{k}");
        }
        assert_eq!(fs::read_dir(&dir.0).unwrap().count(), keys.len());
        assert_eq!(file_name("a/b c"), "k.a%2Fb%20c");
        assert_eq!(file_name("A-z_0.9"), "k.A-z_0.9");
        let long = "x".repeat(300);
        assert!(matches!(s.set(&long, b"v"), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn concurrent_adds_from_many_stores_are_exact() {
        let dir = TempDir::new("adds");
        let path = Arc::new(dir.0.clone());
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let path = path.clone();
                std::thread::spawn(move || {
                    // One store per thread, as separate processes would have.
                    let s = FileStore::new(&*path).unwrap().with_timeout(T);
                    for _ in 0..100 {
                        s.add("count", 1).unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(FileStore::new(&dir.0).unwrap().add("count", 0).unwrap(), 800);
    }

    #[test]
    fn get_blocks_until_another_store_sets() {
        let dir = TempDir::new("get");
        let s = FileStore::new(&dir.0).unwrap();
        let path = dir.0.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(150));
            FileStore::new(path).unwrap().set("late", b"here").unwrap();
        });
        let start = Instant::now();
        assert_eq!(s.get("late", T).unwrap(), b"here");
        assert!(start.elapsed() >= Duration::from_millis(100));
        t.join().unwrap();
    }

    #[test]
    fn the_lock_excludes_a_second_open_until_the_first_closes() {
        let dir = TempDir::new("flock");
        let open = || OpenOptions::new().write(true).create(true).truncate(false).open(dir.0.join(LOCK_FILE));
        let (first, second) = (open().unwrap(), open().unwrap());
        assert!(try_lock(&first).unwrap());
        assert!(!try_lock(&second).unwrap());
        drop(first);
        assert!(try_lock(&second).unwrap());
    }

    #[test]
    fn add_times_out_while_another_process_holds_the_lock() {
        let dir = TempDir::new("lock");
        let s = FileStore::new(&dir.0).unwrap().with_timeout(Duration::from_millis(150));
        let held = File::create(dir.0.join(LOCK_FILE)).unwrap();
        assert!(try_lock(&held).unwrap());
        let start = Instant::now();
        assert!(matches!(s.add("n", 1), Err(Error::Timeout(_))));
        assert!(start.elapsed() < Duration::from_secs(2));
        drop(held);
        assert_eq!(s.add("n", 1).unwrap(), 1);
    }

    #[test]
    fn directories_are_private_and_files_owner_only() {
        let dir = TempDir::new("modes");
        let s = FileStore::new(dir.0.join("a/b")).unwrap();
        s.set("k", b"v").unwrap();
        s.add("n", 1).unwrap();
        let mode = |p: &Path| fs::metadata(p).unwrap().mode() & 0o777;
        assert_eq!(mode(&dir.0.join("a")), 0o700);
        assert_eq!(mode(s.path()), 0o700);
        assert_eq!(mode(&s.path().join(file_name("k"))), 0o600);
        assert_eq!(mode(&s.path().join(LOCK_FILE)), 0o600);
    }

    #[test]
    fn a_directory_others_can_write_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = TempDir::new("shared");
        for m in [0o777, 0o1777, 0o770] {
            fs::set_permissions(&dir.0, fs::Permissions::from_mode(m)).unwrap();
            let err = FileStore::new(&dir.0).unwrap_err();
            assert!(matches!(&err, Error::InvalidUsage(m) if m.contains("no one else can write")), "{err}");
        }
        fs::set_permissions(&dir.0, fs::Permissions::from_mode(0o755)).unwrap();
        FileStore::new(&dir.0).unwrap();
        // A directory of another user: as root, one given away to `nobody`; else the root one.
        let (other, uid) = if crate::sys::user::euid() == 0 {
            std::os::unix::fs::chown(&dir.0, Some(65534), None).unwrap();
            (dir.0.clone(), 65534)
        } else {
            (PathBuf::from("/"), 0)
        };
        let err = FileStore::new(&other).unwrap_err();
        assert!(matches!(&err, Error::InvalidUsage(m) if m.contains(&format!("uid {uid} "))), "{err}");
    }
}
