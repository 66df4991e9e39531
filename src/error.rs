//! The one error type of the library.
//!
//! Variants mirror NCCL's result categories and map 1:1 onto the C ABI's `toroid_result`
//! (`TOROID_SUCCESS = 0`, then one code per variant in this order).

use std::io;

/// Result alias used throughout toroid.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in toroid.
///
/// After `Remote`, `Timeout` or `Aborted` the communicator is aborted: every later call fails
/// fast with [`Error::Aborted`] and the caller rebuilds it.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    /// A system call failed (socket, file, shared memory).
    #[error("system error: {0}")]
    System(String),
    /// A bug in toroid: an invariant did not hold.
    #[error("internal error: {0}")]
    Internal(String),
    /// An argument is invalid on its face (length, type, rank out of range).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The call is valid alone but not in this state or across ranks (mismatched collectives).
    #[error("invalid usage: {0}")]
    InvalidUsage(String),
    /// A peer failed, closed its connection or sent something that failed validation.
    #[error("remote error: {0}")]
    Remote(String),
    /// A wait passed its deadline.
    #[error("timeout: {0}")]
    Timeout(String),
    /// The communicator was aborted (by the user or by an earlier failure).
    #[error("aborted: {0}")]
    Aborted(String),
    /// The operation or combination is not supported (for example `avg` on integers).
    #[error("unsupported: {0}")]
    Unsupported(String),
}

impl Error {
    /// Wraps an I/O error with what was being done.
    pub fn system(context: impl std::fmt::Display, err: io::Error) -> Error {
        Error::System(format!("{context}: {err}"))
    }

    /// True for the errors after which the communicator cannot be used any more.
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            Error::Remote(_) | Error::Timeout(_) | Error::Aborted(_) | Error::System(_) | Error::Internal(_)
        )
    }

    /// The detail text without the category prefix.
    pub fn detail(&self) -> &str {
        match self {
            Error::System(s)
            | Error::Internal(s)
            | Error::InvalidArgument(s)
            | Error::InvalidUsage(s)
            | Error::Remote(s)
            | Error::Timeout(s)
            | Error::Aborted(s)
            | Error::Unsupported(s) => s,
        }
    }
}
