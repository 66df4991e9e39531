//! The one error type of the library.
//!
//! Variants mirror NCCL's result categories and map 1:1 onto the C ABI's `toroid_result`
//! (`TOROID_SUCCESS = 0`, then one code per variant in this order). Each carries a [`Detail`]:
//! the message (what `Display` prints and `toroid_get_last_error` returns) and the facts a
//! program can act on without parsing it: the peer rank at fault, the sequence number of the
//! operation that failed, and the `io::ErrorKind` of a failed system call.

use std::fmt;
use std::io;
use std::ops::Deref;

/// Result alias used throughout toroid.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The message a panic carried (`panic!` with a literal or a formatted string), if any.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> Option<&str> {
    payload.downcast_ref::<&str>().copied().or_else(|| payload.downcast_ref::<String>().map(String::as_str))
}

/// The message of an [`Error`] and the structured facts known about it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Detail {
    message: String,
    peer: Option<usize>,
    seq: Option<u64>,
    io_kind: Option<io::ErrorKind>,
}

impl Detail {
    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for Detail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// The message, so `detail.contains(..)` and friends read as on a string.
impl Deref for Detail {
    type Target = str;
    fn deref(&self) -> &str {
        &self.message
    }
}

impl From<String> for Detail {
    fn from(message: String) -> Detail {
        Detail { message, ..Detail::default() }
    }
}

impl From<&str> for Detail {
    fn from(message: &str) -> Detail {
        Detail::from(message.to_string())
    }
}

/// Everything that can go wrong in toroid.
///
/// After `Remote`, `Timeout` or `Aborted` the communicator is aborted: every later call fails
/// fast with [`Error::Aborted`] and the caller rebuilds it.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    /// A system call failed (socket, file, shared memory).
    #[error("system error: {0}")]
    System(Detail),
    /// A bug in toroid: an invariant did not hold.
    #[error("internal error: {0}")]
    Internal(Detail),
    /// An argument is invalid on its face (length, type, rank out of range).
    #[error("invalid argument: {0}")]
    InvalidArgument(Detail),
    /// The call is valid alone but not in this state or across ranks (mismatched collectives).
    #[error("invalid usage: {0}")]
    InvalidUsage(Detail),
    /// A peer failed, closed its connection or sent something that failed validation.
    #[error("remote error: {0}")]
    Remote(Detail),
    /// A wait passed its deadline.
    #[error("timeout: {0}")]
    Timeout(Detail),
    /// The communicator was aborted (by the user or by an earlier failure).
    #[error("aborted: {0}")]
    Aborted(Detail),
    /// The operation or combination is not supported (for example `avg` on integers).
    #[error("unsupported: {0}")]
    Unsupported(Detail),
}

impl Error {
    /// Wraps an I/O error with what was being done (its `io::ErrorKind` is kept).
    pub fn system(context: impl fmt::Display, err: io::Error) -> Error {
        let mut d = Detail::from(format!("{context}: {err}"));
        d.io_kind = Some(err.kind());
        Error::System(d)
    }

    /// True for the errors after which the communicator cannot be used any more.
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            Error::Remote(_) | Error::Timeout(_) | Error::Aborted(_) | Error::System(_) | Error::Internal(_)
        )
    }

    fn parts(&self) -> &Detail {
        match self {
            Error::System(d)
            | Error::Internal(d)
            | Error::InvalidArgument(d)
            | Error::InvalidUsage(d)
            | Error::Remote(d)
            | Error::Timeout(d)
            | Error::Aborted(d)
            | Error::Unsupported(d) => d,
        }
    }

    fn parts_mut(&mut self) -> &mut Detail {
        match self {
            Error::System(d)
            | Error::Internal(d)
            | Error::InvalidArgument(d)
            | Error::InvalidUsage(d)
            | Error::Remote(d)
            | Error::Timeout(d)
            | Error::Aborted(d)
            | Error::Unsupported(d) => d,
        }
    }

    /// The category as a short lowercase name (`"remote"`, `"timeout"`, ...), for logs and
    /// line-oriented reports.
    pub fn category(&self) -> &'static str {
        match self {
            Error::System(_) => "system",
            Error::Internal(_) => "internal",
            Error::InvalidArgument(_) => "invalid_argument",
            Error::InvalidUsage(_) => "invalid_usage",
            Error::Remote(_) => "remote",
            Error::Timeout(_) => "timeout",
            Error::Aborted(_) => "aborted",
            Error::Unsupported(_) => "unsupported",
        }
    }

    /// The detail text without the category prefix.
    pub fn detail(&self) -> &str {
        &self.parts().message
    }

    /// The rank (of the communicator that failed) whose failure, silence or mismatch this
    /// error reports, where one peer is to blame.
    pub fn peer(&self) -> Option<usize> {
        self.parts().peer
    }

    /// The sequence number of the operation that failed (collectives count per communicator,
    /// send/recv per pair of ranks; the number in messages such as `all_reduce #812`).
    pub fn seq(&self) -> Option<u64> {
        self.parts().seq
    }

    /// The kind of the failed system call's error, for `System` errors.
    pub fn io_kind(&self) -> Option<io::ErrorKind> {
        self.parts().io_kind
    }

    /// Names `peer` as the rank at fault, unless a more specific place already named one.
    pub fn with_peer(mut self, peer: usize) -> Error {
        self.parts_mut().peer.get_or_insert(peer);
        self
    }

    /// Records the failed operation's sequence number, unless already recorded.
    pub fn with_seq(mut self, seq: u64) -> Error {
        self.parts_mut().seq.get_or_insert(seq);
        self
    }

    /// The same error with `context` put before its message (`context: message`); the
    /// category and the facts stay.
    pub fn context(mut self, context: &str) -> Error {
        let d = self.parts_mut();
        d.message = format!("{context}: {}", d.message);
        self
    }

    /// This error's facts (peer, sequence number, I/O kind) carried over to `other`, for an
    /// error reported in place of this one (an abort after it).
    pub fn facts_into(&self, mut other: Error) -> Error {
        let (from, to) = (self.parts(), other.parts_mut());
        to.peer = to.peer.or(from.peer);
        to.seq = to.seq.or(from.seq);
        to.io_kind = to.io_kind.or(from.io_kind);
        other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_unchanged_and_facts_are_kept() {
        let e = Error::Remote("rank 3 closed its connection".into()).with_peer(3).with_seq(812);
        assert_eq!(e.to_string(), "remote error: rank 3 closed its connection");
        assert_eq!((e.peer(), e.seq(), e.io_kind()), (Some(3), Some(812), None));
        // The first, most specific, peer and sequence number win.
        let e = e.with_peer(5).with_seq(1);
        assert_eq!((e.peer(), e.seq()), (Some(3), Some(812)));
        let io = Error::system("connecting to rank 1", io::Error::from(io::ErrorKind::ConnectionRefused));
        assert_eq!(io.io_kind(), Some(io::ErrorKind::ConnectionRefused));
        assert!(io.detail().starts_with("connecting to rank 1: "));
        let aborted = e.facts_into(Error::Aborted("communicator aborted after an earlier error".into()));
        assert_eq!((aborted.peer(), aborted.seq()), (Some(3), Some(812)));
        assert!(matches!(&aborted, Error::Aborted(d) if d.contains("earlier error")));
        let c = aborted.context("2 operations failed");
        assert_eq!(
            c.to_string(),
            "aborted: 2 operations failed: communicator aborted after an earlier error"
        );
        assert_eq!((c.peer(), c.seq()), (Some(3), Some(812)));
        assert_eq!((c.category(), io.category()), ("aborted", "system"));
    }
}
