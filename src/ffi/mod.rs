//! The C ABI: every exported function, and nothing else (`include/toroid.h` is generated from
//! this module by cbindgen, and `python/toroid/_abi.json` from the same source; see `build.rs`).
//!
//! Conventions (`docs/reference/c-abi.md`): opaque handles;
//! `toroid_<noun>_<verb>` names; every function returns a `toroid_result` and writes its outputs
//! only on success; every pointer and handle is checked; every body runs inside a panic
//! boundary.
//!
//! One file per noun of the API:
//! - `comm.rs`: creating, splitting, querying, aborting and destroying a communicator
//!   (`init.rs` turns the C config and store into the Rust ones); `pending.rs`: its
//!   asynchronous creation; `shrink.rs`: a communicator without failed ranks; `grow.rs`: one
//!   with new ranks (the offer, its token, the grow, the newcomers' join); `stats.rs`,
//!   `dump.rs`: what it has done.
//! - `host.rs`: collectives and point-to-point on host memory, blocking and `_async`;
//!   `compressed.rs`: the all-reduce whose bytes travel as a 16-bit float.
//! - `stream.rs`: collectives on device memory ordered on a CUDA stream.
//! - `work.rs`: the work handles the `_async` calls return.
//! - `group.rs`: grouped calls (`toroid_group_start`/`_end`); `request.rs`: persistent requests.
//! - `store.rs`: the caller's key-value store, as toroid's `Store`.
//! - `errors.rs`: error text; `names.rs`: the version and the names of kinds and algorithms.
//!
//! The boundary helpers: [`types`] (the C types), `boundary.rs` (panics, errors, handles),
//! `ops.rs` (C arguments to operations, and running them).
//!
//! The functions are `unsafe` for Rust callers (they take raw pointers); their safety contract
//! is the C contract written in the header: pointers NULL or valid for the lengths a call
//! implies, buffers of async calls valid until the work completes, handles from toroid.
#![allow(clippy::missing_safety_doc)]

mod boundary;
mod comm;
mod compressed;
mod dump;
mod errors;
mod group;
mod grow;
mod host;
mod init;
mod names;
mod ops;
mod pending;
mod request;
mod shrink;
pub mod stats;
mod store;
mod stream;
pub mod types;
mod work;
