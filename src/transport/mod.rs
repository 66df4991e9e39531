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
//! Transports are chosen per peer: [`shm`] between ranks with the same host identity (unless
//! `TOROID_SHM_DISABLE=1` or shared memory cannot be set up), [`rdma`] between hosts where both
//! ranks can use it (`TOROID_RDMA`), [`tcp`] otherwise.
//!
//! Optional parts of the contract (defaults suit sockets):
//! - [`Transport::arm`] says what to `poll(2)` for before the engine sleeps (a shared-memory
//!   ring is not a descriptor: it arms a wake-up and polls its wake-up connection);
//! - [`Transport::read_with`] lends received bytes in place (zero copy) when
//!   [`Transport::zero_copy`] is true.

pub mod exchange;
pub mod ledger;
// Without the verbs (feature `rdma`) nothing builds a real RDMA ring: set-up reports RDMA
// unavailable (or, with the test feature `rdma-fake`, runs the fake), and the rest of the ring
// protocol and its test tools are compiled for the tests.
#[cfg_attr(not(feature = "rdma"), allow(dead_code, unused_imports))]
pub mod rdma;
pub mod shm;
pub mod tcp;
#[cfg(test)]
mod testutil;

/// The shared window lives beside the shared-memory transport; this is its path for callers.
pub use shm::window;

use std::io;
use std::os::fd::RawFd;
use std::time::Instant;

use crate::sys::poll::{Events, PollFd};

pub use exchange::{AbortSignal, Peers, REVOKED, Sink, Source};

/// Opens links on demand (`TOROID_CONNECT=lazy`): the progress engine asks for a link to a
/// peer the first time an operation needs it. Of each pair the higher rank opens the
/// connection ([`Connector::dial`]) and the lower one takes it from a background acceptor
/// ([`Connector::arrived`]), so two ranks never connect to each other twice and neither waits
/// for the other's engine to accept. The handshake, its checks and its errors are those of
/// set-up.
pub trait Connector: Send + std::fmt::Debug {
    /// True when this rank opens the connection to `peer`; otherwise `peer` opens it.
    fn dials(&self, peer: usize) -> bool;
    /// Opens, checks and returns the link to `peer` by `deadline`, giving up when `abort` fires.
    fn dial(
        &mut self,
        peer: usize,
        deadline: Instant,
        abort: &AbortSignal,
    ) -> crate::error::Result<Box<dyn Transport>>;
    /// The links peers opened to this rank since the last call (every lane checked).
    fn arrived(&mut self) -> crate::error::Result<Vec<(usize, Box<dyn Transport>)>>;
    /// Readable once [`Connector::arrived`] has something.
    fn arrival_fd(&self) -> RawFd;
    /// `Some(why)` when `peer`'s process is gone (its listener refuses connections).
    fn peer_gone(&self, peer: usize) -> Option<String>;
    /// This rank failed: every link that arrives from now on is answered with `abort_frame`
    /// and closed, so a peer that connects later learns why at once.
    fn close(&mut self, abort_frame: &[u8]);
    /// Connections (lanes included) this rank opened or accepted so far (the tests count them).
    #[cfg(test)]
    fn sockets(&self) -> usize;
    /// The [`Transport::kind`] the link to `peer` will have once opened.
    fn kind_of(&self, peer: usize) -> &'static str;
}

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

    /// Prepares to sleep until `try_read` (`read`) or `try_write` (`write`) can progress:
    /// returns the `poll(2)` events to wait for on [`Transport::pollable`], or `None` when
    /// progress is possible now (do not sleep). Sockets wait for their own readiness.
    fn arm(&mut self, read: bool, write: bool) -> Option<Events> {
        let mut events = 0;
        if read {
            events |= PollFd::IN;
        }
        if write {
            events |= PollFd::OUT;
        }
        Some(events)
    }

    /// True when [`Transport::read_with`] lends bytes in place.
    fn zero_copy(&self) -> bool {
        false
    }

    /// Zero-copy receive: offers up to `max` received bytes to `f` where they lie (no copy);
    /// `f` returns how many it consumed (it may take fewer, e.g. whole elements only) and
    /// those are consumed. Returns the bytes consumed; `Ok(0)` means the peer closed the
    /// stream; `WouldBlock` means nothing (or nothing `f` took) has arrived. Only called when
    /// [`Transport::zero_copy`] is true.
    fn read_with(&mut self, max: usize, f: &mut dyn FnMut(&[u8]) -> usize) -> io::Result<usize> {
        let _ = (max, f);
        Err(io::Error::new(io::ErrorKind::Unsupported, "this transport cannot lend received bytes"))
    }
}
