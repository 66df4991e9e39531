//! Rendezvous: how ranks find each other at set-up.
//!
//! A [`Store`] is a small key-value service used only while communicators are created (addresses,
//! host identities, the communicator id). Sources:
//!
//! - [`TcpStore`]: served by rank 0, the others connect with retry and backoff;
//! - [`FileStore`]: a directory on a file system every rank sees;
//! - a store supplied by the caller (through the C ABI's callbacks), which is how a framework such
//!   as PyTorch hands over its own store;
//! - [`MemStore`]: in-process, for ranks that are threads (tests).
//!
//! [`env`] reads rank, size and store address from the launcher's variables; under torchrun
//! the ranks find rank 0's [`TcpStore`] through torchrun's own store (`torch_store`).

pub mod env;
pub mod file_store;
pub mod tcp_store;
pub(crate) mod torch_store;

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

pub use file_store::FileStore;
pub use tcp_store::{
    HANDSHAKE_DEADLINE, MAX_CONNECTIONS, MAX_FRAME, MAX_KEY, MAX_PARK, MAX_STORED, MAX_VALUE, MAX_WAIT_KEYS,
    TcpStore,
};

use crate::error::{Error, Result};

/// A key-value store shared by all ranks of a job.
///
/// Every blocking method takes a timeout and returns [`Error::Timeout`] when it passes.
pub trait Store: Send + Sync {
    /// Sets `key` to `value`, replacing any previous value.
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;
    /// Waits up to `timeout` for `key` to exist and returns its value.
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;
    /// Adds `delta` to the integer stored at `key` (missing counts as 0) and returns the new value.
    fn add(&self, key: &str, delta: i64) -> Result<i64>;
    /// Waits up to `timeout` until every key in `keys` exists.
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()>;
    /// Deletes `key`; returns whether it existed.
    fn delete(&self, key: &str) -> Result<bool>;
}

impl<S: Store + ?Sized> Store for Arc<S> {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        (**self).set(key, value)
    }
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        (**self).get(key, timeout)
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        (**self).add(key, delta)
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        (**self).wait(keys, timeout)
    }
    fn delete(&self, key: &str) -> Result<bool> {
        (**self).delete(key)
    }
}

/// A view of a store in which every key is prefixed with `prefix/`, so that several
/// communicators (or jobs) can share one store without collisions.
///
/// ```
/// use std::sync::Arc;
/// use std::time::Duration;
/// use toroid::rendezvous::{MemStore, PrefixStore, Store};
/// let base = Arc::new(MemStore::new());
/// let a = PrefixStore::new("comm-a", base.clone());
/// a.set("x", b"1").unwrap();
/// assert_eq!(base.get("comm-a/x", Duration::from_secs(1)).unwrap(), b"1");
/// ```
#[derive(Clone)]
pub struct PrefixStore {
    prefix: String,
    inner: Arc<dyn Store>,
}

impl PrefixStore {
    /// Wraps `inner`; keys become `prefix/key`.
    pub fn new(prefix: impl Into<String>, inner: Arc<dyn Store>) -> PrefixStore {
        PrefixStore { prefix: prefix.into(), inner }
    }

    fn key(&self, key: &str) -> String {
        format!("{}/{}", self.prefix, key)
    }
}

impl std::fmt::Debug for PrefixStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixStore").field("prefix", &self.prefix).finish_non_exhaustive()
    }
}

impl Store for PrefixStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.set(&self.key(key), value)
    }
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.inner.get(&self.key(key), timeout)
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.inner.add(&self.key(key), delta)
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let full: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        let refs: Vec<&str> = full.iter().map(String::as_str).collect();
        self.inner.wait(&refs, timeout)
    }
    fn delete(&self, key: &str) -> Result<bool> {
        self.inner.delete(&self.key(key))
    }
}

/// An in-process store for ranks that are threads of one process.
#[derive(Debug, Default)]
pub struct MemStore {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

impl MemStore {
    /// An empty store.
    pub fn new() -> MemStore {
        MemStore::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<u8>>> {
        // A panic while holding the lock cannot leave the map half-updated (every update is
        // one insert or remove), so a poisoned lock is still usable.
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Store for MemStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.lock().insert(key.to_string(), value.to_vec());
        self.changed.notify_all();
        Ok(())
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.wait(&[key], timeout)?;
        self.lock()
            .get(key)
            .cloned()
            .ok_or_else(|| Error::Internal(format!("store key '{key}' vanished").into()))
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut map = self.lock();
        let cur = match map.get(key) {
            Some(v) => parse_counter(key, v)?,
            None => 0,
        };
        let new = cur.wrapping_add(delta);
        map.insert(key.to_string(), new.to_string().into_bytes());
        drop(map);
        self.changed.notify_all();
        Ok(new)
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut map = self.lock();
        loop {
            if keys.iter().all(|k| map.contains_key(*k)) {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<&str> = keys.iter().filter(|k| !map.contains_key(**k)).copied().collect();
                return Err(Error::Timeout(format!("store: waited {timeout:?} for keys {missing:?}").into()));
            }
            map = self.changed.wait_timeout(map, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    fn delete(&self, key: &str) -> Result<bool> {
        Ok(self.lock().remove(key).is_some())
    }
}

/// Parses a counter written by `add` (decimal text, as PyTorch's stores keep it).
pub(crate) fn parse_counter(key: &str, v: &[u8]) -> Result<i64> {
    std::str::from_utf8(v)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .ok_or_else(|| Error::InvalidUsage(format!("store key '{key}' does not hold an integer").into()))
}

/// Checks, on an empty `store`, what every [`Store`] promises: `set` replaces, `get` returns the
/// bytes set (any UTF-8 key, any value), `add` counts from 0 in decimal text and refuses a value
/// that is not a counter, `delete` says whether the key existed, and `get` and `wait` time out in
/// bounded time naming the missing keys; the store stays usable after each error.
#[cfg(test)]
pub(crate) fn check_store_contract(store: &dyn Store) {
    const T: Duration = Duration::from_secs(5);
    let s = store;
    s.set("a", b"xyz").unwrap();
    assert_eq!(s.get("a", T).unwrap(), b"xyz");
    s.set("a", b"").unwrap();
    assert_eq!(s.get("a", T).unwrap(), b"");
    // Arbitrary UTF-8 keys and binary values.
    s.set("ключ/🔑 with spaces", &[0, 255, 10]).unwrap();
    assert_eq!(s.get("ключ/🔑 with spaces", T).unwrap(), [0, 255, 10]);
    assert_eq!(s.add("n", 5).unwrap(), 5);
    assert_eq!(s.add("n", -7).unwrap(), -2);
    assert_eq!(s.get("n", T).unwrap(), b"-2");
    s.set("bad", b"x").unwrap();
    assert!(matches!(s.add("bad", 1), Err(Error::InvalidUsage(_))));
    assert!(s.delete("a").unwrap());
    assert!(!s.delete("a").unwrap());
    assert!(matches!(s.get("a", Duration::ZERO), Err(Error::Timeout(_))));
    s.wait(&[], Duration::ZERO).unwrap();
    s.wait(&["n", "bad"], Duration::ZERO).unwrap();
    let start = Instant::now();
    let err = s.wait(&["n", "absent"], Duration::from_millis(200)).unwrap_err();
    let took = start.elapsed();
    assert!(matches!(&err, Error::Timeout(m) if m.contains(r#"for keys ["absent"]"#)), "{err}");
    assert!(took >= Duration::from_millis(190) && took < Duration::from_secs(2), "{took:?}");
    // Still usable after the errors (a TCP client keeps its connection).
    assert_eq!(s.add("n", 2).unwrap(), 0);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_store_keeps_the_store_contract() {
        check_store_contract(&MemStore::new());
    }

    #[test]
    fn mem_store_wait_wakes_on_set_from_another_thread() {
        let s = Arc::new(MemStore::new());
        let s2 = s.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            s2.set("k", b"v").unwrap();
        });
        s.wait(&["k"], Duration::from_secs(5)).unwrap();
        t.join().unwrap();
    }

    #[test]
    fn prefix_store_isolates_keys() {
        let base: Arc<dyn Store> = Arc::new(MemStore::new());
        let a = PrefixStore::new("a", base.clone());
        let b = PrefixStore::new("b", base.clone());
        a.set("k", b"1").unwrap();
        b.set("k", b"2").unwrap();
        assert_eq!(a.get("k", Duration::from_millis(10)).unwrap(), b"1");
        assert_eq!(b.get("k", Duration::from_millis(10)).unwrap(), b"2");
        a.wait(&["k"], Duration::from_millis(10)).unwrap();
        assert_eq!(a.add("c", 2).unwrap(), 2);
        assert_eq!(base.get("a/c", Duration::from_millis(10)).unwrap(), b"2");
    }
}
