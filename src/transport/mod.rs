//! Transports: how bytes move between two ranks.
//!
//! ## The contract every transport meets
//!
//! A [`Transport`] is one full-duplex, ordered, reliable byte stream to one peer, already
//! connected and authenticated by its constructor (magic, protocol version, communicator id and
//! both ranks checked). It is driven without blocking:
//!
//! - [`Transport::try_write`] / [`Transport::try_read`] move as many bytes as they can right now
//!   (vectored), with `std::io::Read` semantics: `Ok(0)` from a read means the peer closed, an
//!   error of kind `WouldBlock` means "nothing now";
//! - [`Transport::pollable`] gives a file descriptor that becomes readable/writable when the
//!   transport can make progress, so the progress engine can sleep in `poll(2)` after spinning;
//! - [`Transport::peek`] reads without consuming (mismatch detection on idle links);
//! - [`Transport::shutdown`] closes the sending direction (the peer sees end of stream).
//!
//! Transports know nothing of collectives. Framing, fingerprints, deadlines, spinning and
//! failure propagation live in [`exchange`], which every algorithm goes through.
//!
//! Transports are chosen per peer; today every peer uses [`tcp`].

pub mod exchange;
pub mod tcp;

use std::io;
use std::os::fd::RawFd;

pub use exchange::{CollKind, Fingerprint, Peers, Sink, Source};

/// One connected peer. See the module documentation for the contract.
pub trait Transport: Send + std::fmt::Debug {
    /// Short name for logs ("tcp").
    fn kind(&self) -> &'static str;
    /// Writes from `bufs` in order without blocking; returns the bytes written.
    fn try_write(&mut self, bufs: &[&[u8]]) -> io::Result<usize>;
    /// Reads into `bufs` in order without blocking; `Ok(0)` means the peer closed the stream.
    fn try_read(&mut self, bufs: &mut [&mut [u8]]) -> io::Result<usize>;
    /// Copies up to `buf.len()` available bytes without consuming them.
    fn peek(&mut self, buf: &mut [u8]) -> io::Result<usize>;
    /// A descriptor for `poll(2)`: readable/writable when `try_read`/`try_write` can progress.
    fn pollable(&self) -> RawFd;
    /// Ends the sending direction; the peer reads end of stream after the data already sent.
    fn shutdown(&mut self);
}
