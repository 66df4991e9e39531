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
pub mod gpu;
mod memory;
mod reduce;
pub mod rendezvous;
mod sys;
mod topology;
mod trace;
mod transport;
mod tuning;

pub use collective::{Algorithm, CallOptions, OpKind};
pub use comm::{Communicator, Group, OwnedBuffer, PendingComm, Persistent, Work};
pub use config::{AuthToken, Config, RdmaMode};
pub use dtype::{DataType, Element, ReduceOp};
pub use error::{Error, Result};
pub use topology::Topology;

/// The layers behind the public API, for toroid's own benchmarks, binaries and tests. Not a
/// stable API: anything here may change in any release.
#[doc(hidden)]
pub mod internals {
    /// The C ABI's Rust side.
    pub mod ffi {
        pub use crate::ffi::*;
    }
    /// Collectives as schedules of exchanges over groups of ranks.
    pub mod algorithm {
        pub use crate::algorithm::*;
    }
    /// The vocabulary every rank agrees on.
    pub mod collective {
        pub use crate::collective::*;
    }
    /// The communicator's internals (raw operations, hooks).
    pub mod comm {
        pub use crate::comm::*;
    }
    /// Settings from the environment.
    pub mod config {
        pub use crate::config::*;
    }
    /// Buffer descriptors that outlive a borrow.
    pub mod memory {
        pub use crate::memory::*;
    }
    /// Reduction kernels.
    pub mod reduce {
        pub use crate::reduce::*;
    }
    /// The operating-system layer.
    pub mod sys {
        pub use crate::sys::*;
    }
    /// Hosts, grids and layouts.
    pub mod topology {
        pub use crate::topology::*;
    }
    /// The flight recorder, its snapshots and the stall report.
    pub mod trace {
        pub use crate::trace::*;
    }
    /// Transports and the progress engine.
    pub mod transport {
        pub use crate::transport::*;
    }
    /// The cost model.
    pub mod tuning {
        pub use crate::tuning::*;
    }
}
