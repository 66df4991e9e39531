//! Fork safety: what a child made by `fork(2)` (Python's `os.fork`, a multiprocessing or
//! DataLoader worker, a C program) may keep of toroid.
//!
//! A forked child holds a copy of every descriptor of its parent. If it kept the sockets that
//! link a rank to its peers, a dead parent would not look dead: the connections stay open in
//! the child, so the peers learn of the death only at their deadline instead of at once. And
//! nothing in the child can use a communicator anyway: its worker thread did not survive the
//! fork, and its peers know only the parent.
//!
//! So toroid registers the descriptors it must not share ([`ForkGuarded`]), and a handler
//! installed with `pthread_atfork` closes them in the child right after the fork and advances
//! the fork [`generation`]. Objects created before the fork compare the generation to theirs:
//! a communicator then refuses every call with `InvalidUsage`, and [`ForkGuarded`] never closes
//! its descriptor again in the child (the number may by then name a file the child opened).
//!
//! The handler runs in the child of a multi-threaded process, where only async-signal-safe
//! work is allowed: it reads atomics and calls `close(2)`, nothing else. The registry is
//! therefore lock-free: chunks of atomic slots, allocated when full and never freed. A
//! descriptor is registered after it is opened and deregistered before it is closed, so the
//! handler can close only descriptors that belong to toroid. (`close` in the child drops only
//! the child's reference; the parent's connection is untouched, unlike `shutdown`.)

use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};
use std::os::fd::{AsRawFd, RawFd};
use std::ptr;
use std::sync::Once;
use std::sync::atomic::{AtomicI32, AtomicPtr, AtomicU64, Ordering};

/// Slots per chunk of the registry.
const CHUNK: usize = 256;
/// A free slot.
const FREE: RawFd = -1;

struct Chunk {
    slots: [AtomicI32; CHUNK],
    next: *mut Chunk,
}

/// The newest chunk; each links to the one before. Chunks are leaked, never freed, so a
/// pointer read from here stays valid for the life of the process.
static HEAD: AtomicPtr<Chunk> = AtomicPtr::new(ptr::null_mut());
/// Forks this process has been through (as a child); 0 in the original process.
static GENERATION: AtomicU64 = AtomicU64::new(0);
static INSTALL: Once = Once::new();

/// How many forks separate this process from the one that started the program: objects
/// remember it at creation and compare it to tell whether they now live in a forked child.
pub fn generation() -> u64 {
    GENERATION.load(Ordering::Acquire)
}

/// Installs the fork handler (once per process; later calls do nothing).
pub fn install() {
    INSTALL.call_once(|| {
        // SAFETY: registers a handler with no prepare or parent part; `in_child` is an
        // `extern "C"` function that stays valid for the life of the process.
        let rc = unsafe { libc::pthread_atfork(None, None, Some(in_child)) };
        if rc != 0 {
            tracing::warn!(target: "toroid::sys",
                "pthread_atfork failed ({rc}): a forked child will keep toroid's sockets open");
        }
    });
}

/// The chunks, newest first.
fn chunks() -> impl Iterator<Item = &'static Chunk> {
    let mut c = HEAD.load(Ordering::Acquire);
    std::iter::from_fn(move || {
        // SAFETY: every pointer in the list came from `Box::leak` and is never freed.
        let chunk = unsafe { c.as_ref() }?;
        c = chunk.next;
        Some(chunk)
    })
}

/// Runs in the child right after `fork`: closes every registered descriptor.
extern "C" fn in_child() {
    GENERATION.fetch_add(1, Ordering::AcqRel);
    for chunk in chunks() {
        for slot in &chunk.slots {
            let fd = slot.swap(FREE, Ordering::AcqRel);
            if fd >= 0 {
                // SAFETY: `fd` was registered by a live toroid object, which deregisters it
                // before closing it; close(2) is async-signal-safe.
                unsafe { libc::close(fd) };
            }
        }
    }
}

/// Records `fd` in a free slot (adding a chunk when all are taken) and returns the slot.
fn claim(fd: RawFd) -> &'static AtomicI32 {
    for chunk in chunks() {
        for slot in &chunk.slots {
            if slot.compare_exchange(FREE, fd, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
                return slot;
            }
        }
    }
    let chunk: &'static mut Chunk =
        Box::leak(Box::new(Chunk { slots: [const { AtomicI32::new(FREE) }; CHUNK], next: ptr::null_mut() }));
    chunk.slots[0].store(fd, Ordering::Relaxed);
    let mut head = HEAD.load(Ordering::Acquire);
    loop {
        chunk.next = head;
        match HEAD.compare_exchange(head, chunk, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return &chunk.slots[0],
            Err(now) => head = now,
        }
    }
}

/// A descriptor-owning value (a socket) that a forked child must not keep: registered while it
/// lives, closed in the child at fork, and never closed again by the child's copy of this value.
#[derive(Debug)]
pub struct ForkGuarded<T: AsRawFd> {
    inner: ManuallyDrop<T>,
    slot: &'static AtomicI32,
    fd: RawFd,
    generation: u64,
}

impl<T: AsRawFd> ForkGuarded<T> {
    /// Registers `inner`'s descriptor.
    pub fn new(inner: T) -> ForkGuarded<T> {
        install();
        let fd = inner.as_raw_fd();
        ForkGuarded { inner: ManuallyDrop::new(inner), slot: claim(fd), fd, generation: generation() }
    }

    /// True in a child forked after this value was made (its descriptor is closed there).
    pub fn forked(&self) -> bool {
        generation() != self.generation
    }
}

impl<T: AsRawFd> ForkGuarded<T> {
    /// Deregisters the descriptor and hands the value back (`None` in a forked child, where the
    /// descriptor is closed already).
    pub fn into_inner(self) -> Option<T> {
        if self.forked() {
            return None; // dropping `self` leaks it, as `Drop` does in a child
        }
        let mut me = ManuallyDrop::new(self);
        let _ = me.slot.compare_exchange(me.fd, FREE, Ordering::AcqRel, Ordering::Relaxed);
        // SAFETY: `me` is never dropped, so `inner` is taken exactly once and never used after.
        Some(unsafe { ManuallyDrop::take(&mut me.inner) })
    }
}

impl<T: AsRawFd> Deref for ForkGuarded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.inner
    }
}

impl<T: AsRawFd> DerefMut for ForkGuarded<T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.inner
    }
}

impl<T: AsRawFd> Drop for ForkGuarded<T> {
    fn drop(&mut self) {
        if self.forked() {
            // The fork handler closed the descriptor; its number may now name something of the
            // child's, so the value is leaked rather than closed a second time.
            return;
        }
        // Deregister first, so the handler of a fork racing with this never closes a number
        // that is about to be reused.
        let _ = self.slot.compare_exchange(self.fd, FREE, Ordering::AcqRel, Ordering::Relaxed);
        // SAFETY: `inner` is dropped exactly once, here, and never used after.
        unsafe { ManuallyDrop::drop(&mut self.inner) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    fn registered(fd: RawFd) -> bool {
        chunks().any(|c| c.slots.iter().any(|s| s.load(Ordering::Acquire) == fd))
    }

    /// Whether `fd` names an open descriptor.
    fn is_open(fd: RawFd) -> bool {
        // SAFETY: F_GETFD reads the flags of a descriptor number; no memory is involved.
        unsafe { libc::fcntl(fd, libc::F_GETFD) != -1 }
    }

    #[test]
    fn descriptors_are_registered_while_alive_and_released_on_drop() {
        let (a, b) = UnixStream::pair().unwrap();
        let fd = a.as_raw_fd();
        let g = ForkGuarded::new(a);
        assert!(registered(fd) && !g.forked());
        let slot = g.slot;
        drop(g);
        // Tests run in parallel: the number may already be reused and registered by another
        // value, but then it is open again.
        assert!(slot.load(Ordering::Acquire) != fd || is_open(fd));
        // Far more than a chunk: the registry grows and every slot is found again.
        let many: Vec<_> = (0..2 * CHUNK + 3).map(|_| ForkGuarded::new(b.try_clone().unwrap())).collect();
        assert!(many.iter().all(|g| registered(g.as_raw_fd())));
    }

    #[test]
    fn a_forked_child_has_the_descriptors_closed_and_a_new_generation() {
        let (a, _b) = UnixStream::pair().unwrap();
        let g = ForkGuarded::new(a);
        let fd = g.as_raw_fd();
        let before = generation();
        // SAFETY: the child only reads atomics, calls fcntl and _exit (async-signal-safe).
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let ok = !is_open(fd) && generation() == before + 1 && g.forked();
            // SAFETY: ends the child without running the parent's destructors or test harness.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: waits for our own child, writing its status into a live int.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "child saw {status:#x}");
        assert!(is_open(fd) && !g.forked(), "the parent keeps its descriptor");
    }
}
