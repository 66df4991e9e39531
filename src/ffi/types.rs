//! The C types of the ABI: result codes, element types, reduction ops, the config and store
//! structs, and the opaque handles. cbindgen turns these into `include/toroid.h`.
//!
//! Enums arriving *from* C (`toroid_datatype`, `toroid_redop`, `toroid_result` as an argument)
//! are received as plain integers ([`RawDatatype`], [`RawRedop`], [`RawResult`], which the
//! header spells as the enum types) and validated before they become Rust enums: a Rust enum
//! holding a value outside its variants would be undefined behaviour before any check could run.

#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_void};

use crate::dtype::{DataType, ReduceOp};
use crate::error::Error;

/// The result of every call. `TOROID_SUCCESS` is 0; each error code matches one kind of failure
/// (the Rust `Error` variants, in order). `toroid_get_error_string` describes a code,
/// `toroid_get_last_error` gives the detail of the last failure.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum toroid_result {
    /// The call succeeded.
    TOROID_SUCCESS = 0,
    /// A system call failed (socket, file, thread).
    TOROID_SYSTEM_ERROR = 1,
    /// A bug in toroid (an invariant did not hold, or a panic was caught at the boundary).
    TOROID_INTERNAL_ERROR = 2,
    /// An argument is invalid on its face: NULL pointer, unknown type or op, count overflow,
    /// rank out of range, overlapping buffers.
    TOROID_INVALID_ARGUMENT = 3,
    /// The call is valid alone but not now: a destroyed handle, collectives that differ across
    /// ranks.
    TOROID_INVALID_USAGE = 4,
    /// A peer failed, closed its connection or sent something that failed validation.
    TOROID_REMOTE_ERROR = 5,
    /// A deadline passed (the communicator is aborted).
    TOROID_TIMEOUT = 6,
    /// The communicator was aborted, by toroid_comm_abort or an earlier failure.
    TOROID_ABORTED = 7,
    /// Not supported, for example TOROID_AVG on an integer type.
    TOROID_UNSUPPORTED = 8,
}

/// Every result code, in value order.
const RESULTS: [toroid_result; 9] = [
    toroid_result::TOROID_SUCCESS,
    toroid_result::TOROID_SYSTEM_ERROR,
    toroid_result::TOROID_INTERNAL_ERROR,
    toroid_result::TOROID_INVALID_ARGUMENT,
    toroid_result::TOROID_INVALID_USAGE,
    toroid_result::TOROID_REMOTE_ERROR,
    toroid_result::TOROID_TIMEOUT,
    toroid_result::TOROID_ABORTED,
    toroid_result::TOROID_UNSUPPORTED,
];

impl toroid_result {
    /// The code of `e`.
    pub fn of(e: &Error) -> toroid_result {
        match e {
            Error::System(_) => toroid_result::TOROID_SYSTEM_ERROR,
            Error::Internal(_) => toroid_result::TOROID_INTERNAL_ERROR,
            Error::InvalidArgument(_) => toroid_result::TOROID_INVALID_ARGUMENT,
            Error::InvalidUsage(_) => toroid_result::TOROID_INVALID_USAGE,
            Error::Remote(_) => toroid_result::TOROID_REMOTE_ERROR,
            Error::Timeout(_) => toroid_result::TOROID_TIMEOUT,
            Error::Aborted(_) => toroid_result::TOROID_ABORTED,
            Error::Unsupported(_) => toroid_result::TOROID_UNSUPPORTED,
        }
    }
}

/// The element type of a buffer.
// Declared for the C header (cbindgen) and the ABI description; Rust code uses its own types.
#[allow(dead_code)]
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum toroid_datatype {
    /// int8_t
    TOROID_INT8 = 0,
    /// uint8_t
    TOROID_UINT8 = 1,
    /// int32_t
    TOROID_INT32 = 2,
    /// uint32_t
    TOROID_UINT32 = 3,
    /// int64_t
    TOROID_INT64 = 4,
    /// uint64_t
    TOROID_UINT64 = 5,
    /// IEEE 754 half precision (16 bits)
    TOROID_FLOAT16 = 6,
    /// bfloat16 (the upper 16 bits of a float)
    TOROID_BFLOAT16 = 7,
    /// float
    TOROID_FLOAT32 = 8,
    /// double
    TOROID_FLOAT64 = 9,
}

/// A reduction operation. Integers wrap around on overflow (sum, prod); TOROID_AVG (sum divided
/// by the number of ranks) is defined on the floating types only.
// Declared for the C header (cbindgen) and the ABI description; Rust code uses its own types.
#[allow(dead_code)]
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum toroid_redop {
    /// Sum.
    TOROID_SUM = 0,
    /// Product.
    TOROID_PROD = 1,
    /// Minimum.
    TOROID_MIN = 2,
    /// Maximum.
    TOROID_MAX = 3,
    /// Arithmetic mean (floating types only).
    TOROID_AVG = 4,
}

/// A `toroid_datatype` as received from C: any integer, validated by [`RawDatatype::get`].
/// The header names this type `toroid_datatype` (cbindgen.toml renames it).
#[repr(transparent)]
#[derive(Debug, Clone, Copy)]
pub struct RawDatatype(pub c_int);

/// A `toroid_redop` as received from C (the header names it `toroid_redop`).
#[repr(transparent)]
#[derive(Debug, Clone, Copy)]
pub struct RawRedop(pub c_int);

/// A `toroid_result` as received from C (the header names it `toroid_result`).
#[repr(transparent)]
#[derive(Debug, Clone, Copy)]
pub struct RawResult(pub c_int);

impl RawDatatype {
    /// The data type, or `InvalidArgument` for a value that is not one.
    pub fn get(self) -> Result<DataType, Error> {
        u8::try_from(self.0).ok().and_then(DataType::from_u8).ok_or_else(|| {
            Error::InvalidArgument(
                format!("{} is not a toroid_datatype (TOROID_INT8 = 0 ... TOROID_FLOAT64 = 9)", self.0)
                    .into(),
            )
        })
    }
}

impl RawRedop {
    /// The reduction op, or `InvalidArgument` for a value that is not one.
    pub fn get(self) -> Result<ReduceOp, Error> {
        u8::try_from(self.0).ok().and_then(ReduceOp::from_u8).ok_or_else(|| {
            Error::InvalidArgument(
                format!("{} is not a toroid_redop (TOROID_SUM = 0 ... TOROID_AVG = 4)", self.0).into(),
            )
        })
    }
}

impl RawResult {
    /// The result code, if the value is one.
    pub fn get(self) -> Option<toroid_result> {
        usize::try_from(self.0).ok().and_then(|i| RESULTS.get(i).copied())
    }
}

/// Pass as `color` to toroid_comm_split to take part without joining any new communicator
/// (`*out` is set to NULL). Any negative color means the same.
// Declared for the C header (cbindgen) and the ABI description; Rust code uses its own types.
#[allow(dead_code)]
pub const TOROID_SPLIT_NOCOLOR: c_int = -1;

/// Room for a join token (toroid_grow_offer_token) and its NUL: always enough.
pub const TOROID_JOIN_TOKEN_MAX: usize = 256;

/// toroid_comm_health's format: one JSON document.
pub const TOROID_HEALTH_JSON: c_int = 0;
/// toroid_comm_health's format: Prometheus text exposition.
pub const TOROID_HEALTH_PROMETHEUS: c_int = 1;

/// Settings for toroid_comm_init. Set `struct_size = sizeof(toroid_config)`: later versions
/// append fields, and toroid reads only the fields that a caller's struct_size covers
/// (a smaller size than this first version is rejected).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct toroid_config {
    /// sizeof(toroid_config) as the caller compiled it.
    pub struct_size: usize,
    /// This process's rank, 0 <= rank < size.
    pub rank: c_int,
    /// Number of ranks, at least 1.
    pub size: c_int,
    /// Rendezvous store: "host:port" (rank 0 serves a TCP store there; the others connect) or
    /// "file:///shared/dir", or "torch://host:port" (a torch TCPStore where rank 0 publishes the
    /// port of the store it serves). NULL: from the environment (TOROID_STORE_ADDR, else
    /// torchrun's store or MASTER_ADDR and MASTER_PORT+1; see docs/ENV.md).
    pub store_addr: *const c_char,
    /// Deadline of set-up and of every call, in milliseconds. <= 0: TOROID_TIMEOUT or the
    /// default (300 s).
    pub timeout_ms: i64,
    /// Interface selection in NCCL syntax ("eth0", "^lo,docker"). NULL: TOROID_SOCKET_IFNAME or
    /// the default (the interface that routes to the store).
    pub socket_ifname: *const c_char,
    /// Encrypted links between ranks (second version of this struct): 1 on, -1 off, 0 as
    /// TOROID_ENCRYPT says. Encryption needs TOROID_AUTH_TOKEN; every rank must choose alike.
    pub encrypt: c_int,
}

/// The first version of [`toroid_config`]: the fields every caller's struct holds.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct toroid_config_v1 {
    pub struct_size: usize,
    pub rank: c_int,
    pub size: c_int,
    pub store_addr: *const c_char,
    pub timeout_ms: i64,
    pub socket_ifname: *const c_char,
}

/// Stores `len` bytes of `value` under the NUL-terminated `key`, replacing any value. Returns 0
/// on success, anything else on failure.
pub type toroid_store_set_fn = Option<
    unsafe extern "C" fn(ctx: *mut c_void, key: *const c_char, value: *const c_void, len: usize) -> c_int,
>;

/// Waits up to `timeout_ms` (0: do not wait) for `key` to exist, copies at most `cap` bytes of its
/// value to `value` and sets `*len` to the value's full length. Returns 0 on success and
/// non-zero when the key is still missing at the deadline or the store failed. toroid asks again
/// with a larger buffer when `*len > cap`.
pub type toroid_store_get_fn = Option<
    unsafe extern "C" fn(
        ctx: *mut c_void,
        key: *const c_char,
        value: *mut c_void,
        cap: usize,
        len: *mut usize,
        timeout_ms: i64,
    ) -> c_int,
>;

/// A caller-supplied key-value store (how a framework hands over its own store), used only
/// during toroid_comm_init_with_store and only from the thread that called it.
///
/// toroid needs set, get and wait-for-key, all built on these two callbacks. It also needs an
/// atomic counter per rank (a generation number, so that repeated inits on one store keep their
/// keys apart); it is emulated as get (without waiting) + set, which is not atomic but is only
/// ever used on keys that one rank alone writes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct toroid_store_ops {
    /// sizeof(toroid_store_ops) as the caller compiled it.
    pub struct_size: usize,
    /// Set a key (required).
    pub set: toroid_store_set_fn,
    /// Get a key, waiting for it (required).
    pub get: toroid_store_get_fn,
}

/// A communicator: a group of ranks that run collectives together. Opaque; created by the
/// toroid_comm_init* functions and toroid_comm_split, released by toroid_comm_destroy.
#[derive(Debug)]
pub struct toroid_comm {
    _private: [u8; 0],
}

/// A communicator being created, shrunk, grown or joined in the background
/// (toroid_comm_init_async, toroid_comm_init_env_async, toroid_comm_shrink_async,
/// toroid_comm_grow_async, toroid_comm_join_async). Opaque; released by
/// toroid_pending_free.
#[derive(Debug)]
pub struct toroid_pending {
    _private: [u8; 0],
}

/// One rank's offer to grow its communicator (toroid_comm_grow_offer): the join token for
/// the new processes, and what toroid_comm_grow needs. Opaque; released by
/// toroid_grow_offer_free.
#[derive(Debug)]
pub struct toroid_grow_offer {
    _private: [u8; 0],
}

/// A persistent all-reduce (toroid_all_reduce_init). Opaque; released by toroid_request_free.
#[derive(Debug)]
pub struct toroid_request {
    _private: [u8; 0],
}

/// An operation issued by an *_async call. Opaque; released by toroid_work_free.
#[derive(Debug)]
pub struct toroid_work {
    _private: [u8; 0],
}
