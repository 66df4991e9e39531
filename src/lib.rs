//! # toroid
//!
//! A collective-communication runtime: N processes on one or many hosts all-reduce,
//! reduce-scatter, all-gather, broadcast, reduce, all-to-all and barrier, fast, with every wait
//! bounded by a deadline and every failure turned into an error on every rank.
//!
//! ## Layers, bottom to top
//!
//! ```text
//!  include/toroid.h + src/ffi/  C ABI (cbindgen), panics caught, handles opaque
//!  src/comm.rs                  Communicator: rank, size, split, work queue, abort
//!  src/algorithm/               collectives as schedules of steps over groups of ranks
//!  src/transport/               Transport trait (tcp, shm), framed exchanges with fingerprints,
//!                               the shared window of one host
//!  src/rendezvous/              Store trait: tcp store, file store; launcher detection
//!  src/reduce.rs, src/dtype.rs  element types, reduction ops, vectorised kernels
//! ```
//!
//! Each layer talks only to the one below. Environment variables are read in [`config`] only
//! (documented in `docs/ENV.md`).

#![deny(missing_docs, rust_2018_idioms)]
#![warn(missing_debug_implementations)]

pub mod algorithm;
pub mod collective;
pub mod comm;
pub mod config;
pub mod dtype;
pub mod error;
pub mod ffi;
pub mod memory;
pub mod reduce;
pub mod rendezvous;
pub mod sys;
pub mod topology;
pub mod transport;
pub mod tuning;

pub use collective::{Algorithm, CallOptions, OpKind};
pub use comm::{Communicator, OwnedBuffer, Work};
pub use config::{AuthToken, Config};
pub use dtype::{DataType, Element, ReduceOp};
pub use error::{Error, Result};
pub use topology::Topology;
