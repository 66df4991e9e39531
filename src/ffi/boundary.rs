//! The boundary between C and Rust: panics caught, errors recorded, pointers checked, handles
//! looked up.
//!
//! **Panics.** Every exported body runs inside [`ffi_boundary!`] (rustls-ffi's
//! `ffi_panic_boundary!`): a panic becomes `TOROID_INTERNAL_ERROR` (or a static string, or
//! nothing) and is recorded as the thread's last error; it never unwinds into C.
//!
//! **Errors.** A failing call records `"<function>: <error>"` as the last error of its
//! communicator (when it has a valid one) and of the calling thread, then returns the code.
//!
//! **Handles.** A `toroid_comm *` or `toroid_work *` that C holds is not the address of Rust
//! memory but a number that is looked up in a registry ([`Registry`]) before anything is touched.
//! A NULL handle is `TOROID_INVALID_ARGUMENT`; a handle that was destroyed (or never created,
//! or is a handle of the other kind) is not in the registry and is `TOROID_INVALID_USAGE`.
//! Numbers are never reused, so a destroyed handle is always detected, and no stale pointer is
//! ever dereferenced (a magic field inside freed memory could only be read by a use-after-free).
//! The registry holds the object in an `Arc`; a call holds its own clone while it runs, so a
//! toroid_comm_destroy racing with a call on another thread frees the communicator only once
//! that call has returned. The cost is one uncontended mutex per call, far below any collective.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ffi::{CStr, CString, c_char};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use super::types::{toroid_comm, toroid_result, toroid_work};
use crate::comm::{Communicator, Work};
use crate::error::{Error, Result};

/// Runs an exported function's body, turning a panic into the return type's error value.
///
/// ```text
/// ffi_boundary!("toroid_comm_rank", { ... body returning toroid_result ... })
/// ```
macro_rules! ffi_boundary {
    ($name:expr, $body:block) => {{
        match ::std::panic::catch_unwind(::std::panic::AssertUnwindSafe(|| $body)) {
            Ok(ret) => ret,
            Err(payload) => $crate::ffi::boundary::PanicDefault::on_panic($name, payload),
        }
    }};
}
pub(crate) use ffi_boundary;

/// What an exported function returns when its body panicked.
pub(crate) trait PanicDefault {
    /// Records the panic and returns the error value.
    fn on_panic(name: &'static str, payload: Box<dyn std::any::Any + Send>) -> Self;
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> &str {
    crate::error::panic_message(payload).unwrap_or("unknown panic")
}

impl PanicDefault for toroid_result {
    fn on_panic(name: &'static str, payload: Box<dyn std::any::Any + Send>) -> Self {
        let e = Error::Internal(format!("panic: {}", panic_message(&*payload)).into());
        fail(name, None, &e)
    }
}

impl PanicDefault for *const c_char {
    fn on_panic(name: &'static str, payload: Box<dyn std::any::Any + Send>) -> Self {
        let e = Error::Internal(format!("panic: {}", panic_message(&*payload)).into());
        let _ = fail(name, None, &e);
        c"internal error: toroid panicked (see toroid_get_last_error(NULL))".as_ptr()
    }
}

impl PanicDefault for () {
    fn on_panic(name: &'static str, payload: Box<dyn std::any::Any + Send>) -> Self {
        let e = Error::Internal(format!("panic: {}", panic_message(&*payload)).into());
        let _ = fail(name, None, &e);
    }
}

thread_local! {
    /// The last failure of a call made by this thread.
    static THREAD_ERROR: RefCell<Option<String>> = const { RefCell::new(None) };
    /// The text last returned by toroid_get_last_error(NULL) on this thread.
    static THREAD_RETURNED: RefCell<Option<CString>> = const { RefCell::new(None) };
}

/// Records `e` as the last error of the thread and of `comm`, and returns its code.
pub(crate) fn fail(name: &str, comm: Option<&CommHandle>, e: &Error) -> toroid_result {
    let msg = format!("{name}: {e}");
    tracing::debug!(target: "toroid::ffi", "{msg}");
    if let Some(h) = comm {
        h.comm.set_last_error(msg.clone());
    }
    // Ignore a thread that is being torn down (its locals are gone).
    let _ = THREAD_ERROR.try_with(|t| *t.borrow_mut() = Some(msg));
    toroid_result::of(e)
}

/// Turns `r` into a result code, recording the error.
pub(crate) fn code(name: &str, comm: Option<&CommHandle>, r: Result<()>) -> toroid_result {
    match r {
        Ok(()) => toroid_result::TOROID_SUCCESS,
        Err(e) => fail(name, comm, &e),
    }
}

/// The stable C copy of `text` kept in `slot`: replaced only when the text changed, so a pointer
/// returned earlier stays valid until the last error actually changes and is asked for again.
fn c_text(slot: &mut Option<CString>, text: &str) -> *const c_char {
    let same = slot.as_ref().is_some_and(|c| c.as_bytes() == text.as_bytes());
    if !same {
        // Interior NULs cannot occur in our messages, but never fail here.
        *slot = Some(CString::new(text.replace('\0', " ")).unwrap_or_default());
    }
    slot.as_ref().map_or(c"".as_ptr(), |c| c.as_ptr())
}

/// The thread's last error as C text (empty when none).
pub(crate) fn thread_error_text() -> *const c_char {
    let text = THREAD_ERROR.try_with(|t| t.borrow().clone()).ok().flatten().unwrap_or_default();
    THREAD_RETURNED.try_with(|slot| c_text(&mut slot.borrow_mut(), &text)).unwrap_or(c"".as_ptr())
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section here is a single map or slot update: a poisoned lock is still
    // consistent.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Handle numbers, shared by both kinds so that a work handle is never a valid comm handle.
/// Multiples of 16, starting high enough not to look like a small integer or error code.
static NEXT_HANDLE: AtomicUsize = AtomicUsize::new(0x1000);

/// Live objects of one handle kind, by handle number (see the module docs).
pub(crate) struct Registry<T> {
    map: Mutex<BTreeMap<usize, Arc<T>>>,
}

impl<T> Registry<T> {
    pub(crate) const fn new() -> Registry<T> {
        Registry { map: Mutex::new(BTreeMap::new()) }
    }
}

/// A Rust object that C holds through an opaque handle (rustls-ffi's `Castable`).
pub(crate) trait Handle: Sized + Send + Sync + 'static {
    /// The opaque C type.
    type C;
    /// The C type's name, for messages.
    const NAME: &'static str;
    /// Where the live objects are.
    fn registry() -> &'static Registry<Self>;

    /// Registers `obj` and returns its new handle.
    fn into_handle(obj: Arc<Self>) -> *mut Self::C {
        let id = NEXT_HANDLE.fetch_add(16, Ordering::Relaxed);
        lock(&Self::registry().map).insert(id, obj);
        std::ptr::without_provenance_mut(id)
    }

    /// The object behind `h`.
    fn get(h: *const Self::C) -> Result<Arc<Self>> {
        Self::check_null(h)?;
        lock(&Self::registry().map).get(&h.addr()).cloned().ok_or_else(|| Self::unknown(h))
    }

    /// Unregisters `h` and returns its object (dropped by the caller, outside the lock).
    fn remove(h: *const Self::C) -> Result<Arc<Self>> {
        Self::check_null(h)?;
        let obj = lock(&Self::registry().map).remove(&h.addr());
        obj.ok_or_else(|| Self::unknown(h))
    }

    /// Number of live handles of this kind (tests).
    #[cfg(test)]
    fn live() -> usize {
        lock(&Self::registry().map).len()
    }

    #[doc(hidden)]
    fn check_null(h: *const Self::C) -> Result<()> {
        if h.is_null() {
            return Err(Error::InvalidArgument(format!("{} handle is NULL", Self::NAME).into()));
        }
        Ok(())
    }

    #[doc(hidden)]
    fn unknown(h: *const Self::C) -> Error {
        Error::InvalidUsage(
            format!("{} handle {h:p} is not live: it was destroyed, or never created by toroid", Self::NAME)
                .into(),
        )
    }
}

/// What a `toroid_comm *` stands for.
pub(crate) struct CommHandle {
    pub(crate) comm: Communicator,
    /// The text last returned by toroid_get_last_error for this communicator.
    returned: Mutex<Option<CString>>,
    /// The group open on it (`toroid_group_start`), if any.
    pub(crate) group: Mutex<super::group::GroupState>,
}

impl CommHandle {
    pub(crate) fn new(comm: Communicator) -> Arc<CommHandle> {
        Arc::new(CommHandle { comm, returned: Mutex::new(None), group: Mutex::default() })
    }

    /// The communicator's last error as C text (empty when none).
    pub(crate) fn error_text(&self) -> *const c_char {
        let text = self.comm.last_error().unwrap_or_default();
        c_text(&mut lock(&self.returned), &text)
    }
}

static COMMS: Registry<CommHandle> = Registry::new();

impl Handle for CommHandle {
    type C = toroid_comm;
    const NAME: &'static str = "toroid_comm";
    fn registry() -> &'static Registry<Self> {
        &COMMS
    }
}

/// What a `toroid_work *` stands for.
pub(crate) struct WorkHandle {
    pub(crate) work: Work<()>,
    /// The works queued before `work` for the same call (a group's other runs); they complete
    /// before it, and the first of their failures is the call's result.
    pub(crate) earlier: Vec<Work<()>>,
    /// The communicator that issued it (not kept alive by the work).
    pub(crate) comm: Weak<CommHandle>,
    /// The communicator's timeout (for `timeout_ms < 0`).
    pub(crate) timeout: Duration,
    /// Where a receive from any source records its sender (see toroid_work_source).
    pub(crate) source: Option<Arc<AtomicUsize>>,
}

static WORKS: Registry<WorkHandle> = Registry::new();

impl Handle for WorkHandle {
    type C = toroid_work;
    const NAME: &'static str = "toroid_work";
    fn registry() -> &'static Registry<Self> {
        &WORKS
    }
}

/// Runs `f` on the communicator behind `comm` and turns the outcome into a result code.
pub(crate) fn with_comm(
    name: &'static str,
    comm: *const toroid_comm,
    f: impl FnOnce(&Arc<CommHandle>) -> Result<()>,
) -> toroid_result {
    match CommHandle::get(comm) {
        Ok(h) => code(name, Some(&h), f(&h)),
        Err(e) => fail(name, None, &e),
    }
}

/// Checks that an output pointer is not NULL (before any work, so that outputs can be written
/// only on success).
pub(crate) fn check_out<T>(p: *mut T, what: &str) -> Result<()> {
    if p.is_null() {
        return Err(Error::InvalidArgument(format!("output pointer {what} is NULL").into()));
    }
    Ok(())
}

/// Writes an output.
///
/// # Safety
/// `p` must be valid for a write of `T` (checked non-NULL by [`check_out`]).
pub(crate) unsafe fn write_out<T>(p: *mut T, v: T) {
    // SAFETY: forwarded from the caller.
    unsafe { p.write(v) }
}

/// Reads an optional NUL-terminated UTF-8 string (NULL gives `None`).
///
/// # Safety
/// A non-NULL `p` must point to a NUL-terminated string.
pub(crate) unsafe fn opt_str(p: *const c_char, what: &str) -> Result<Option<String>> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: forwarded from the caller.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str()
        .map(|s| Some(s.to_string()))
        .map_err(|_| Error::InvalidArgument(format!("{what} is not valid UTF-8").into()))
}

/// A C `int` that must be a rank-like number (`>= 0`).
pub(crate) fn non_negative(v: std::ffi::c_int, what: &str) -> Result<usize> {
    usize::try_from(v).map_err(|_| Error::InvalidArgument(format!("{what} {v} is negative").into()))
}

/// The library version as C text.
pub(crate) const VERSION: &std::ffi::CStr =
    match CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
        Ok(s) => s,
        Err(_) => c"unknown",
    };

/// The static description of a result code, with a hint (NCCL's ncclGetErrorString).
pub(crate) fn error_string(r: super::types::RawResult) -> &'static CStr {
    use super::types::toroid_result::*;
    match r.get() {
        Some(TOROID_SUCCESS) => c"no error",
        Some(TOROID_SYSTEM_ERROR) => {
            c"system error: a socket, file or thread operation failed (run with TOROID_DEBUG=INFO for details)"
        }
        Some(TOROID_INTERNAL_ERROR) => {
            c"internal error: a bug in toroid; please report it with the output of TOROID_DEBUG=INFO"
        }
        Some(TOROID_INVALID_ARGUMENT) => {
            c"invalid argument: toroid_get_last_error says which (run with TOROID_DEBUG=INFO for details)"
        }
        Some(TOROID_INVALID_USAGE) => c"invalid usage: a destroyed handle, or calls that differ across ranks \
              (run with TOROID_DEBUG=INFO for details)",
        Some(TOROID_REMOTE_ERROR) => c"remote error: a peer failed or closed its connection; the communicator \
              is aborted (run with TOROID_DEBUG=INFO on every rank for details)",
        Some(TOROID_TIMEOUT) => c"timeout: a deadline passed and the communicator is aborted; raise \
              TOROID_TIMEOUT if the job is only slow (run with TOROID_DEBUG=INFO for details)",
        Some(TOROID_ABORTED) => c"aborted: the communicator was aborted by toroid_comm_abort or an earlier \
              failure; destroy it and create a new one (run with TOROID_DEBUG=INFO for details)",
        Some(TOROID_UNSUPPORTED) => {
            c"unsupported operation or combination (run with TOROID_DEBUG=INFO for details)"
        }
        None => c"unknown toroid_result code",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ffi::types::RawResult;

    struct Dummy;
    static DUMMIES: Registry<Dummy> = Registry::new();
    impl Handle for Dummy {
        type C = toroid_work;
        const NAME: &'static str = "dummy";
        fn registry() -> &'static Registry<Self> {
            &DUMMIES
        }
    }

    #[test]
    fn handles_are_looked_up_and_destroyed_ones_detected() {
        let h = Dummy::into_handle(Arc::new(Dummy));
        let h2 = Dummy::into_handle(Arc::new(Dummy));
        assert_ne!(h, h2);
        assert_eq!(Dummy::live(), 2);
        assert!(Dummy::get(h).is_ok());
        assert!(Dummy::remove(h).is_ok());
        assert!(matches!(Dummy::get(h), Err(Error::InvalidUsage(_))));
        assert!(matches!(Dummy::remove(h), Err(Error::InvalidUsage(_))));
        assert!(matches!(Dummy::get(std::ptr::null()), Err(Error::InvalidArgument(_))));
        // A number that was never handed out, and a handle of another kind.
        assert!(Dummy::get(std::ptr::without_provenance(0x10)).is_err());
        assert!(Dummy::get(std::ptr::without_provenance(h2.addr() + 16)).is_err());
        assert!(Dummy::remove(h2).is_ok());
        assert_eq!(Dummy::live(), 0);
    }

    #[test]
    fn a_panic_becomes_an_internal_error_with_its_message() {
        let r: toroid_result = ffi_boundary!("test_fn", {
            if std::hint::black_box(true) {
                panic!("boom");
            }
            toroid_result::TOROID_SUCCESS
        });
        assert_eq!(r, toroid_result::TOROID_INTERNAL_ERROR);
        let text = THREAD_ERROR.with(|t| t.borrow().clone()).unwrap();
        assert!(text.contains("test_fn") && text.contains("boom"), "{text}");
    }

    #[test]
    fn error_strings_are_static_with_a_hint() {
        for code in 1..=8 {
            let s = error_string(RawResult(code)).to_str().unwrap();
            assert!(s.contains("TOROID_DEBUG") || s.contains("TOROID_TIMEOUT"), "{code}: {s}");
        }
        assert_eq!(error_string(RawResult(0)).to_str().unwrap(), "no error");
        assert!(error_string(RawResult(9)).to_str().unwrap().contains("unknown"));
        assert!(error_string(RawResult(-1)).to_str().unwrap().contains("unknown"));
        assert_eq!(VERSION.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
    }

    #[test]
    fn returned_text_is_stable_until_it_changes() {
        let mut slot = None;
        let a = c_text(&mut slot, "first");
        assert_eq!(c_text(&mut slot, "first"), a);
        let b = c_text(&mut slot, "second");
        // SAFETY: `b` points into `slot`, alive here.
        assert_eq!(unsafe { CStr::from_ptr(b) }.to_str().unwrap(), "second");
    }
}
