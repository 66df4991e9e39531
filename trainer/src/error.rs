//! The trainer's error type: one message string with the context that produced it.
//!
//! Every failure a user can reach (missing or malformed data, a bad flag, a collective that
//! failed, a checkpoint that does not match the model) becomes an [`Error`] whose text says what
//! was wrong and where, and `main` prints it and exits non-zero instead of panicking.

use std::fmt;

/// A trainer error: a human-readable message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error(pub String);

/// Results of the trainer.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// An error with the message `msg`.
    pub fn msg(msg: impl Into<String>) -> Error {
        Error(msg.into())
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

impl From<candle_core::Error> for Error {
    fn from(e: candle_core::Error) -> Error {
        Error(format!("tensor error: {e}"))
    }
}

impl From<toroid::Error> for Error {
    fn from(e: toroid::Error) -> Error {
        Error(format!("communication error: {e}"))
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Error {
        Error(format!("I/O error: {e}"))
    }
}

/// Adds context to an error: `result.context(|| format!("reading {path}"))`.
pub trait Context<T> {
    /// Prefixes the error message with `what()`.
    fn context<S: Into<String>>(self, what: impl FnOnce() -> S) -> Result<T>;
}

impl<T, E: fmt::Display> Context<T> for std::result::Result<T, E> {
    fn context<S: Into<String>>(self, what: impl FnOnce() -> S) -> Result<T> {
        self.map_err(|e| Error(format!("{}: {e}", what().into())))
    }
}

/// Returns early with an [`Error`] built by `format!`.
#[macro_export]
macro_rules! bail {
    ($($arg:tt)*) => { return Err($crate::error::Error(format!($($arg)*))) };
}
