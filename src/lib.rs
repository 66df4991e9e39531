//! # toroid
//!
//! A collective-communication runtime: N processes on one or many hosts all-reduce,
//! reduce-scatter, all-gather, broadcast, reduce, all-to-all and barrier, fast, with every wait
//! bounded by a deadline and every failure turned into an error on every rank.
//!
//! The public API is what this page lists: [`Communicator`] and its [`Work`] handles, the
//! element types and reductions, [`Config`], [`Error`], and the stores of [`rendezvous`].
//! The layers behind it (algorithms, transports, the OS layer) and the contracts between them
//! are described in `docs/ARCHITECTURE.md`; environment variables in `docs/ENV.md`.

#![deny(missing_docs, rust_2018_idioms)]
#![warn(missing_debug_implementations)]

mod algorithm;
mod cancel;
mod collective;
mod comm;
mod config;
mod dtype;
mod error;
mod ffi;
#[doc(hidden)]
pub mod fuzzing;
#[cfg(feature = "cuda")]
mod gpu;
mod memory;
mod reduce;
pub mod rendezvous;
mod sys;
mod tls;
mod topology;
mod trace;
mod transport;
mod tuning;

pub use collective::{Algorithm, CallOptions, OpKind};
pub use comm::{Communicator, Group, GrowOffer, JoinToken, OwnedBuffer, PendingComm, Persistent, Work};
pub use config::{AuthToken, Config, RdmaMode, TlsFiles};
pub use dtype::{DataType, Element, ReduceOp};
pub use error::{Error, Result};
pub use topology::Topology;
pub use trace::Health;

/// The items behind the public API that toroid's own binaries (`toroid-bench`, `toroid-run`,
/// `toroid-sim`), benches, examples, tests and the trainer use, each named (no module is
/// re-exported whole except the safe CUDA layer, `gpu::cuda`). Not a stable API: anything here
/// may change in any release.
#[doc(hidden)]
pub mod internals {
    /// The offset maths of the schedules (its doc example).
    pub mod algorithm {
        /// Balanced pieces.
        pub mod schedule {
            pub use crate::algorithm::schedule::piece;
        }
    }
    /// The vocabulary every rank agrees on.
    pub mod collective {
        pub use crate::collective::{CollKind, Fingerprint};
    }
    /// Raw operations and their hooks, persistent plans; the health query from outside a job.
    pub mod comm {
        pub use crate::comm::{AllReducePlan, HEALTH_GRACE, Hooks, RawOp, query_dir};
    }
    /// Settings: sizes as the variables write them, defaults, the variables the binaries read.
    pub mod config {
        pub use crate::config::{
            DEFAULT_SHM_DIR, DEFAULT_SHM_RING_SIZE, auth_token_from_env, parse_size, status_dir_from_env,
            timeline_path_from_env,
        };
    }
    /// Buffer descriptors that outlive a borrow.
    pub mod memory {
        pub use crate::memory::{RawBufMut, RawBufs};
    }
    /// Reduction kernels (the CPU references of the benches and tests).
    pub mod reduce {
        pub use crate::reduce::{reduce_inplace, reduce_into, scale_into};
    }
    /// The operating-system calls the launcher and the tests make.
    pub mod sys {
        /// CPU time.
        pub mod cpu {
            pub use crate::sys::cpu::process_cpu_time;
        }
        /// Child processes, CPU sets and the signals the launcher handles.
        pub mod process {
            pub use crate::sys::process::{
                CpuSet, SIGHUP, SIGINT, SIGKILL, SIGTERM, SIGUSR1, Signal, bind_child, catch_signals,
                caught_signal, clear_caught_signal, kill_child_with_parent, kill_group, open_files_limit,
            };
        }
        /// Sending a signal.
        pub mod signal {
            pub use crate::sys::signal::send;
        }
        /// The effective user.
        pub mod user {
            pub use crate::sys::user::euid;
        }
    }
    /// Grid shapes as `TOROID_TORUS_SHAPE` writes them.
    pub mod topology {
        pub use crate::topology::parse_shape;
    }
    /// The flight recorder's records and the timeline.
    pub mod trace {
        pub use crate::trace::health::prometheus_header;
        pub use crate::trace::{OpState, Phase, timeline};
    }
    /// The shared-memory transport and encrypted links' records (benches), the handshake's
    /// protocol version (tests).
    pub mod transport {
        pub use crate::transport::Transport;
        /// Shared-memory links.
        pub mod shm {
            pub use crate::transport::shm::{ShmTransport, pair_segment_len};
        }
        /// TCP links; the record keys of encrypted links (`benches/record.rs`).
        pub mod tcp {
            pub use crate::transport::tcp::PROTOCOL_VERSION;
            pub use crate::transport::tcp::secure::record::{Direction, MAX_PLAIN, MAX_RECORD, SECRET_LEN};
        }
    }
    /// The cost model (`toroid-sim`).
    pub mod tuning {
        pub use crate::tuning::{CostModel, LinkCost, Shape};
    }
    /// Collectives on device memory (`toroid-bench --device`, the GPU tests and examples).
    #[cfg(feature = "cuda")]
    pub mod gpu {
        pub use crate::gpu::cuda;
        pub use crate::gpu::{PTX_ARCH, compile, driver_available, guard, load_nvrtc, ptx};
        /// The kernels as CUDA C and their names.
        pub mod kernels {
            pub use crate::gpu::kernels::{OPS, TYPES, names, source};
        }
        /// The stream-ordered kernels as CUDA C (a module of their own) and their names.
        pub mod ordered_kernels {
            pub use crate::gpu::ordered_kernels::{names, source};
        }
        /// The kernels loaded on a device.
        pub mod device {
            pub use crate::gpu::device::DeviceKernels;
        }
        /// The IPC path's window sizes.
        pub mod ipc {
            pub use crate::gpu::ipc::{HALF, WINDOW};
        }
        /// The staged path.
        pub mod staged {
            pub use crate::gpu::staged::{CHUNK, DeviceCollectives, device_of, is_device_pointer};
        }
        /// The stream entry points.
        pub mod stream {
            pub use crate::gpu::stream::{DevicePath, on_stream, on_stream_async, path, route_of};
        }
    }
}
