//! The operating-system layer: every call into libc made by toroid lives below this module
//! (as mio keeps its `sys/`). Each function here is a thin, safe wrapper that checks its
//! arguments and turns `-1` into an [`std::io::Error`]; the layers above speak in these types
//! and never name libc.
//!
//! | module | what |
//! |---|---|
//! | [`cpu`] | CPUs online |
//! | [`dl`] | loading a shared library at run time (CUDA's, which may be absent) |
//! | [`errno`] | what an `errno` means for the caller (descriptors or buffers ran out) |
//! | [`epoll`] | a set of descriptors that is one descriptor (a striped connection's lanes) |
//! | [`eventfd`] | an event descriptor that wakes a thread sleeping in `poll(2)` |
//! | [`fork`] | descriptors closed in a forked child, and the fork generation |
//! | [`futex`] | wait on and wake a shared 32-bit word |
//! | [`net_if`] | the addresses of the network interfaces that are up |
//! | [`pid`] | whether a process exists |
//! | [`poll`] | `poll(2)` over a set of descriptors |
//! | [`process`] | CPU affinity, children that die with their launcher, signals |
//! | [`random`] | random bytes and ids from the kernel |
//! | [`socket`] | TCP socket options and non-blocking vectored I/O without `SIGPIPE` |
//! | [`shm_file`] | shared-memory files: exclusive creation, reserved pages, shared mappings |
//! | [`socketpair`] | a connected pair of Unix stream sockets, non-blocking sends and receives |
//! | [`user`] | the user this process runs as |

pub mod cpu;
pub mod dl;
pub mod epoll;
pub mod errno;
pub mod eventfd;
pub mod fork;
pub mod futex;
pub mod net_if;
pub mod pid;
pub mod poll;
pub mod process;
pub mod random;
pub mod shm_file;
pub mod signal;
pub mod socket;
pub mod socketpair;
pub mod user;

/// Calls a libc function and turns `-1` into the `io::Error` of `errno` (mio's `syscall!`).
/// Each call site states why its arguments are valid.
macro_rules! syscall {
    ($fn:ident ( $($arg:expr),* $(,)? )) => {{
        // SAFETY: each call site passes pointers to live, correctly sized objects; see there.
        let res = unsafe { libc::$fn($($arg),*) };
        if res == -1 { Err(std::io::Error::last_os_error()) } else { Ok(res) }
    }};
}
pub(crate) use syscall;
