//! A [`Store`] over the caller's `toroid_store_ops` callbacks (how a framework such as PyTorch
//! hands over its own store).
//!
//! The callbacks offer set and get-with-timeout; the rest of [`Store`] is built on them:
//!
//! - `wait(keys)`: a get of each key with the time left;
//! - `add(key, delta)`: get without waiting (a failure counts as a missing key, i.e. 0), then
//!   set. Not atomic, which is sound for the one key toroid's set-up adds to: each rank's own
//!   generation counter (`toroid/rank<r>/generation`), written by that rank alone;
//! - `delete`: not offered by the callbacks; returns [`Error::Unsupported`] (toroid never deletes
//!   during set-up).
//!
//! The callbacks are called only during `toroid_comm_init_with_store`, on the calling thread.
//! Afterwards the store is closed: the communicator keeps it (as it keeps every store), but any
//! later use fails instead of calling into a context the caller may have freed.

use std::ffi::{CString, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::types::{toroid_store_get_fn, toroid_store_ops, toroid_store_set_fn};
use crate::error::{Error, Result};
use crate::rendezvous::Store;

/// Values larger than this are refused (the store holds addresses and ids, a few bytes each).
const MAX_VALUE: usize = 64 << 20;

/// The caller's store.
pub(crate) struct CallbackStore {
    set: unsafe extern "C" fn(*mut c_void, *const std::ffi::c_char, *const c_void, usize) -> std::ffi::c_int,
    get: unsafe extern "C" fn(
        *mut c_void,
        *const std::ffi::c_char,
        *mut c_void,
        usize,
        *mut usize,
        i64,
    ) -> std::ffi::c_int,
    ctx: Ctx,
    open: AtomicBool,
}

/// The caller's context pointer, only ever handed back to its callbacks.
struct Ctx(*mut c_void);
// SAFETY: toroid never dereferences the pointer; it passes it to the caller's callbacks only
// during toroid_comm_init_with_store, on the calling thread (see the module docs), and never after
// the store is closed.
unsafe impl Send for Ctx {}
// SAFETY: as above.
unsafe impl Sync for Ctx {}

impl CallbackStore {
    /// Checks and copies the callbacks out of `ops` (the struct itself is not kept).
    ///
    /// # Safety
    /// `ops`'s callbacks must be safe to call with `ctx` and the arguments the header documents
    /// until the store is closed (the contract of `toroid_comm_init_with_store`).
    pub(crate) unsafe fn new(ops: &toroid_store_ops, ctx: *mut c_void) -> Result<CallbackStore> {
        let (set, get): (toroid_store_set_fn, toroid_store_get_fn) = (ops.set, ops.get);
        let set = set.ok_or_else(|| Error::InvalidArgument("toroid_store_ops.set is NULL".into()))?;
        let get = get.ok_or_else(|| Error::InvalidArgument("toroid_store_ops.get is NULL".into()))?;
        Ok(CallbackStore { set, get, ctx: Ctx(ctx), open: AtomicBool::new(true) })
    }

    /// No callback is called after this.
    pub(crate) fn close(&self) {
        self.open.store(false, Ordering::Release);
    }

    fn check_open(&self) -> Result<()> {
        if !self.open.load(Ordering::Acquire) {
            return Err(Error::InvalidUsage(
                "the caller-supplied store is used only during toroid_comm_init_with_store".into(),
            ));
        }
        Ok(())
    }

    fn key(key: &str) -> Result<CString> {
        CString::new(key)
            .map_err(|_| Error::InvalidArgument(format!("store key {key:?} contains NUL").into()))
    }

    fn ctx(&self) -> *mut c_void {
        self.ctx.0
    }

    /// One get; `None` when the callback failed (key missing at the deadline, or store error).
    fn try_get(&self, key: &str, timeout: Duration) -> Result<Option<Vec<u8>>> {
        self.check_open()?;
        let k = Self::key(key)?;
        let deadline = Instant::now() + timeout;
        let mut buf = vec![0u8; 256];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let ms = i64::try_from(left.as_millis()).unwrap_or(i64::MAX);
            let mut len = 0usize;
            // SAFETY: the caller of toroid_comm_init_with_store promised callbacks that may be
            // called with its context during that call; `k` is NUL-terminated, `buf` is writable
            // for `buf.len()` bytes and `len` for a usize.
            let rc = unsafe {
                (self.get)(self.ctx(), k.as_ptr(), buf.as_mut_ptr().cast(), buf.len(), &mut len, ms)
            };
            if rc != 0 {
                return Ok(None);
            }
            if len <= buf.len() {
                buf.truncate(len);
                return Ok(Some(buf));
            }
            if len > MAX_VALUE {
                return Err(Error::InvalidUsage(
                    format!("store value of '{key}' is {len} bytes: too large").into(),
                ));
            }
            buf.resize(len, 0);
        }
    }
}

impl Store for CallbackStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.check_open()?;
        let k = Self::key(key)?;
        // SAFETY: as in `try_get`; `value` is readable for its length.
        let rc = unsafe { (self.set)(self.ctx(), k.as_ptr(), value.as_ptr().cast(), value.len()) };
        if rc != 0 {
            return Err(Error::System(
                format!("store set of '{key}' failed (callback returned {rc})").into(),
            ));
        }
        Ok(())
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.try_get(key, timeout)?.ok_or_else(|| {
            Error::Timeout(
                format!("store get of '{key}' failed: missing after {timeout:?}, or the store failed").into(),
            )
        })
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        // Not atomic: see the module docs for why that is enough here.
        let cur = match self.try_get(key, Duration::ZERO)? {
            Some(v) => crate::rendezvous::parse_counter(key, &v)?,
            None => 0,
        };
        let new = cur.wrapping_add(delta);
        self.set(key, new.to_string().as_bytes())?;
        Ok(new)
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        for k in keys {
            self.get(k, deadline.saturating_duration_since(Instant::now()))?;
        }
        Ok(())
    }

    fn delete(&self, key: &str) -> Result<bool> {
        Err(Error::Unsupported(format!("the caller-supplied store cannot delete ('{key}')").into()))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::ffi::{CStr, c_char, c_int};
    use std::sync::Mutex;

    use super::*;

    /// The test's store behind `ctx`: a map and a count of callback calls.
    #[derive(Default)]
    struct Map {
        values: Mutex<HashMap<String, Vec<u8>>>,
        calls: Mutex<usize>,
    }

    fn map<'a>(ctx: *mut c_void) -> &'a Map {
        // SAFETY (test): `ctx` is the `Map` the test passed, alive for the whole test.
        unsafe { &*ctx.cast::<Map>() }
    }

    unsafe extern "C" fn set(
        ctx: *mut c_void,
        key: *const c_char,
        value: *const c_void,
        len: usize,
    ) -> c_int {
        let m = map(ctx);
        *m.calls.lock().unwrap() += 1;
        // SAFETY (test): toroid passes a NUL-terminated key and `len` readable bytes.
        let (k, v) = unsafe { (CStr::from_ptr(key), std::slice::from_raw_parts(value.cast::<u8>(), len)) };
        m.values.lock().unwrap().insert(k.to_str().unwrap().to_string(), v.to_vec());
        0
    }

    unsafe extern "C" fn get(
        ctx: *mut c_void,
        key: *const c_char,
        value: *mut c_void,
        cap: usize,
        len: *mut usize,
        _timeout_ms: i64,
    ) -> c_int {
        let m = map(ctx);
        *m.calls.lock().unwrap() += 1;
        // SAFETY (test): as above; `value` is writable for `cap` bytes and `len` for a usize.
        unsafe {
            let k = CStr::from_ptr(key).to_str().unwrap();
            let Some(v) = m.values.lock().unwrap().get(k).cloned() else { return 1 };
            std::ptr::copy_nonoverlapping(v.as_ptr(), value.cast::<u8>(), v.len().min(cap));
            *len = v.len();
        }
        0
    }

    #[test]
    fn callbacks_give_every_store_operation_until_closed() {
        let m = Map::default();
        let ctx = (&m as *const Map).cast_mut().cast::<c_void>();
        let ops = toroid_store_ops {
            struct_size: std::mem::size_of::<toroid_store_ops>(),
            set: Some(set),
            get: Some(get),
        };
        // SAFETY: the test's callbacks accept its context.
        let s = unsafe { CallbackStore::new(&ops, ctx) }.unwrap();
        s.set("a", b"xyz").unwrap();
        assert_eq!(s.get("a", Duration::ZERO).unwrap(), b"xyz");
        // A value longer than the first buffer is asked for again with the right size.
        let long = vec![7u8; 1000];
        s.set("long", &long).unwrap();
        assert_eq!(s.get("long", Duration::from_millis(10)).unwrap(), long);
        assert!(matches!(s.get("missing", Duration::ZERO), Err(Error::Timeout(_))));
        assert!(matches!(s.wait(&["a", "missing"], Duration::ZERO), Err(Error::Timeout(_))));
        s.wait(&["a", "long"], Duration::ZERO).unwrap();
        // add: a missing key counts as 0.
        assert_eq!(s.add("n", 1).unwrap(), 1);
        assert_eq!(s.add("n", 4).unwrap(), 5);
        assert!(matches!(s.add("a", 1), Err(Error::InvalidUsage(_))));
        assert!(matches!(s.delete("a"), Err(Error::Unsupported(_))));
        let calls = *m.calls.lock().unwrap();
        s.close();
        assert!(matches!(s.set("b", b"1"), Err(Error::InvalidUsage(_))));
        assert!(s.get("a", Duration::ZERO).is_err());
        assert_eq!(*m.calls.lock().unwrap(), calls, "a closed store calls nothing");
        let no_get = toroid_store_ops { get: None, ..ops };
        // SAFETY: rejected before any callback could be called.
        assert!(matches!(unsafe { CallbackStore::new(&no_get, ctx) }, Err(Error::InvalidArgument(_))));
    }
}
