//! The RDMA transport: an [`RdmaRing`] as a [`Transport`], with the pair's TCP connection kept
//! as the liveness channel (docs/reference/rdma.md).
//!
//! What the engine needs beyond the ring:
//! - **sleeping**: [`Transport::pollable`] is an epoll set holding the verbs' completion
//!   channel and the TCP connection, so one descriptor wakes the engine for either. Arming
//!   consumes the channel's notifications, asks for the next one, and looks at the completion
//!   queue once more: a completion that arrived before the request would not notify, and the
//!   look sees it instead (the completion-channel pattern of `ibv_get_cq_event(3)`);
//! - **a peer that is gone**: RDMA says nothing to a rank that only waits for writes from a
//!   dead peer, but the kernel closes the dead peer's TCP connection, which makes the epoll set
//!   readable. From then on reads return the end of the stream once the ring is empty, as the
//!   shared-memory transport does, and the engine reports the peer; writes fail. A failed
//!   completion (the peer is unreachable) ends the stream the same way, after the bytes that
//!   arrived before it;
//! - **nothing lost at the end**: an RDMA write is only posted when `try_write` returns, and a
//!   queue pair destroyed before its writes complete drops them. Dropping the transport first
//!   waits (bounded) for every posted write to complete.
//!
//! The TCP connection carries no bytes after set-up; it is never shut down before the drop,
//! so its end of stream always means the peer's process closed it.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use super::verbs::Verbs;
use super::write_ring::RdmaRing;
use crate::error::Error;
use crate::sys::epoll::{self, EpollSet};
use crate::sys::poll::{Events, PollFd};
use crate::transport::Transport;

/// How long a drop waits for posted writes to complete.
const FLUSH_ON_DROP: Duration = Duration::from_secs(5);

/// A peer on another host reached through RDMA.
#[derive(Debug)]
pub struct RdmaTransport<V: Verbs> {
    ring: RdmaRing<V>,
    /// The pair's TCP connection: silent, watched for its end.
    tcp: Box<dyn Transport>,
    /// Holds the completion channel and `tcp`.
    poll_set: EpollSet,
    /// The TCP connection ended or failed: the peer's process is gone.
    peer_gone: bool,
}

fn io_error(e: Error) -> io::Error {
    io::Error::other(e.to_string())
}

impl<V: Verbs> RdmaTransport<V> {
    /// Wraps a connected ring and the pair's TCP connection.
    pub fn new(ring: RdmaRing<V>, tcp: Box<dyn Transport>) -> io::Result<RdmaTransport<V>> {
        let poll_set = EpollSet::new()?;
        poll_set.add(ring.verbs().notify_fd(), epoll::IN)?;
        poll_set.add(tcp.pollable(), epoll::IN | epoll::RDHUP)?;
        Ok(RdmaTransport { ring, tcp, poll_set, peer_gone: false })
    }

    /// Looks at the TCP connection: any end of it (or a byte, which a peer never sends after
    /// set-up) means the peer is gone.
    fn watch_tcp(&mut self) {
        if self.peer_gone {
            return;
        }
        let mut b = [0u8; 1];
        match self.tcp.peek(&mut b) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted => {}
            _ => self.peer_gone = true,
        }
    }

    /// What a read, peek or lend `f` got from the ring. When nothing: the end of the stream
    /// once the connection is lost or the peer's process is known to be gone (as a closed
    /// socket reads; what arrived before is read first), else "nothing now". The TCP
    /// connection is looked at when the engine arms or peeks, not on every empty read.
    fn look(&mut self, f: impl FnOnce(&mut RdmaRing<V>) -> Result<usize, Error>) -> io::Result<usize> {
        // Known before the look, so this look is the last one after the peer went.
        let gone = self.peer_gone;
        match f(&mut self.ring) {
            Err(_) if self.ring.lost() => Ok(0),
            Err(e) => Err(io_error(e)),
            Ok(n) if n > 0 || gone || self.ring.at_end() => Ok(n),
            Ok(_) => Err(io::ErrorKind::WouldBlock.into()),
        }
    }

    fn gone(&self) -> io::Error {
        io::Error::new(io::ErrorKind::BrokenPipe, format!("rank {}'s connection is gone", self.ring.peer()))
    }
}

impl<V: Verbs> Transport for RdmaTransport<V> {
    fn kind(&self) -> &'static str {
        "rdma"
    }

    fn try_write(&mut self, bufs: &[&[u8]]) -> io::Result<usize> {
        if self.peer_gone || self.ring.lost() {
            return Err(self.gone());
        }
        let n =
            self.ring.write(bufs).map_err(|e| if self.ring.lost() { self.gone() } else { io_error(e) })?;
        if n == 0 && bufs.iter().any(|b| !b.is_empty()) {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        Ok(n)
    }

    fn try_read(&mut self, bufs: &mut [&mut [u8]]) -> io::Result<usize> {
        if bufs.iter().all(|b| b.is_empty()) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty read"));
        }
        self.look(|ring| ring.read(bufs))
    }

    fn peek(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self.look(|ring| ring.peek(buf)) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                self.watch_tcp();
                self.look(|ring| ring.peek(buf))
            }
            r => r,
        }
    }

    fn zero_copy(&self) -> bool {
        true
    }

    fn read_with(&mut self, max: usize, f: &mut dyn FnMut(&[u8]) -> usize) -> io::Result<usize> {
        self.look(|ring| ring.read_with(max, f))
    }

    fn pollable(&self) -> RawFd {
        self.poll_set.as_raw_fd()
    }

    fn shutdown(&mut self) {
        // The TCP connection stays open: its end would tell the peer this process is gone.
        let _ = self.ring.shutdown();
    }

    fn arm(&mut self, read: bool, write: bool) -> Option<Events> {
        self.watch_tcp();
        if self.peer_gone || self.ring.verbs_mut().arm_notify().is_err() {
            return None;
        }
        if (read && self.ring.readable()) || (write && self.ring.writable()) {
            return None;
        }
        Some(PollFd::IN)
    }
}

impl<V: Verbs> Drop for RdmaTransport<V> {
    fn drop(&mut self) {
        if !self.peer_gone {
            let _ = self.ring.flush(Instant::now() + FLUSH_ON_DROP);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::poll::poll;
    use crate::sys::socketpair;
    use crate::transport::rdma::fake::FakeVerbs;
    use crate::transport::rdma::write_ring::Geometry;
    use crate::transport::testutil::bytes;
    use std::os::fd::{AsFd, OwnedFd};

    /// One end of a socket pair, standing in for the pair's TCP connection.
    #[derive(Debug)]
    struct Sock(OwnedFd);

    impl Transport for Sock {
        fn kind(&self) -> &'static str {
            "unix"
        }
        fn try_write(&mut self, bufs: &[&[u8]]) -> io::Result<usize> {
            socketpair::send(self.0.as_fd(), bufs.first().copied().unwrap_or(&[]))
        }
        fn try_read(&mut self, bufs: &mut [&mut [u8]]) -> io::Result<usize> {
            match bufs.first_mut() {
                Some(b) => socketpair::recv(self.0.as_fd(), b),
                None => Ok(0),
            }
        }
        fn peek(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            socketpair::peek(self.0.as_fd(), buf)
        }
        fn pollable(&self) -> RawFd {
            self.0.as_raw_fd()
        }
        fn shutdown(&mut self) {
            let _ = socketpair::shutdown_write(self.0.as_fd());
        }
    }

    fn pair(geo: Geometry) -> (RdmaTransport<FakeVerbs>, RdmaTransport<FakeVerbs>) {
        let (a, b, _) = crate::transport::rdma::tests::pair(geo);
        let (sa, sb) = socketpair::stream_pair().expect("socket pair");
        (
            RdmaTransport::new(a, Box::new(Sock(sa))).expect("transport a"),
            RdmaTransport::new(b, Box::new(Sock(sb))).expect("transport b"),
        )
    }

    /// Sleeps as the engine does: arm, then poll the descriptor (bounded).
    fn sleep_until_ready(t: &mut dyn Transport, read: bool, write: bool) {
        if let Some(ev) = t.arm(read, write) {
            let _ = poll(&mut [PollFd::new(t.pollable(), ev)], 5_000);
        }
    }

    #[test]
    fn a_stream_larger_than_the_ring_arrives_whole_with_both_sides_sleeping() {
        let geo = Geometry { slots: 4, slot_bytes: 1000 };
        let (mut a, mut b) = pair(geo);
        let want = bytes(7, 1 << 20);
        let sent = want.clone();
        let writer = std::thread::spawn(move || {
            let mut at = 0;
            while at < sent.len() {
                // Vectored, cut at an odd place.
                let end = (at + 3333).min(sent.len());
                let mid = at + (end - at) / 3;
                match a.try_write(&[&sent[at..mid], &sent[mid..end]]) {
                    Ok(n) => at += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => sleep_until_ready(&mut a, false, true),
                    Err(e) => panic!("write: {e}"),
                }
            }
            a.shutdown();
            a
        });
        let mut got = Vec::new();
        let mut buf = vec![0u8; 1500];
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            assert!(Instant::now() < deadline, "stuck after {} bytes", got.len());
            let mut head = [0u8; 16];
            match b.peek(&mut head) {
                Ok(n) => {
                    // Peeking shows the next bytes of the stream without taking them.
                    let k = n.min(want.len() - got.len());
                    assert_eq!(&head[..k], &want[got.len()..got.len() + k]);
                }
                Err(e) => assert_eq!(e.kind(), io::ErrorKind::WouldBlock),
            }
            match b.try_read(&mut [&mut buf]) {
                Ok(0) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => sleep_until_ready(&mut b, true, false),
                Err(e) => panic!("read: {e}"),
            }
        }
        let a = writer.join().expect("writer");
        assert!(got == want, "{} bytes arrived, {} sent", got.len(), want.len());
        drop((a, b));
    }

    #[test]
    fn lent_bytes_stitch_elements_across_slots() {
        // Slots of 10 bytes: 8-byte elements straddle every slot boundary.
        let geo = Geometry { slots: 4, slot_bytes: 10 };
        let (mut a, mut b) = pair(geo);
        let want: Vec<u8> = bytes(3, 8 * 1000);
        let mut got: Vec<u8> = Vec::new();
        let (mut sent, mut offers) = (0usize, 0usize);
        let deadline = Instant::now() + Duration::from_secs(30);
        while got.len() < want.len() {
            assert!(Instant::now() < deadline, "stuck after {} bytes", got.len());
            if sent < want.len() {
                match a.try_write(&[&want[sent..(sent + 17).min(want.len())]]) {
                    Ok(n) => sent += n,
                    Err(e) => assert_eq!(e.kind(), io::ErrorKind::WouldBlock),
                }
            }
            // Takes whole 8-byte elements only, as the engine's reductions do.
            let left = want.len() - got.len();
            let mut take = |s: &[u8]| {
                offers += 1;
                let k = s.len() - s.len() % 8;
                got.extend_from_slice(&s[..k]);
                k
            };
            match b.read_with(left, &mut take) {
                Ok(n) => assert!(n > 0 && n % 8 == 0, "took {n}"),
                Err(e) => assert_eq!(e.kind(), io::ErrorKind::WouldBlock),
            }
        }
        assert!(got == want, "the lent stream differs");
        assert!(b.zero_copy() && offers > 0);
    }

    #[test]
    fn a_peek_spans_slots() {
        let geo = Geometry { slots: 8, slot_bytes: 4 };
        let (mut a, mut b) = pair(geo);
        // Three writes: slots of 3, 4 and 4 + 1 bytes.
        assert_eq!(a.try_write(&[b"abc"]).expect("w1"), 3);
        assert_eq!(a.try_write(&[b"defghijk", b"l"]).expect("w2"), 9);
        let mut p = [0u8; 10];
        assert_eq!(b.peek(&mut p).expect("peek"), 10);
        assert_eq!(&p, b"abcdefghij");
        let mut one = [0u8; 2];
        assert_eq!(b.try_read(&mut [&mut one]).expect("read"), 2);
        let mut p = [0u8; 64];
        assert_eq!(b.peek(&mut p).expect("peek"), 10);
        assert_eq!(&p[..10], b"cdefghijkl");
    }

    #[test]
    fn a_peer_whose_process_is_gone_wakes_the_sleeper_and_ends_the_stream() {
        let geo = Geometry { slots: 4, slot_bytes: 64 };
        let (mut a, mut b) = pair(geo);
        assert_eq!(a.try_write(&[b"last words"]).expect("write"), 10);
        // Nothing to wait for on b's write side: it may write, so it does not sleep.
        assert!(b.arm(false, true).is_none());
        let sleeper = std::thread::spawn(move || {
            let mut got = Vec::new();
            let mut buf = [0u8; 64];
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                assert!(Instant::now() < deadline, "the sleeper never learned the peer was gone");
                match b.try_read(&mut [&mut buf]) {
                    Ok(0) => return (got, b),
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => sleep_until_ready(&mut b, true, false),
                    Err(e) => panic!("read: {e}"),
                }
            }
        });
        std::thread::sleep(Duration::from_millis(50));
        // The peer vanishes without closing its ring (a killed process): only TCP ends.
        let RdmaTransport { tcp, .. } = &mut a;
        drop(std::mem::replace(tcp, Box::new(Sock(socketpair::stream_pair().expect("pair").0))));
        let (got, mut b) = sleeper.join().expect("sleeper");
        assert_eq!(got, b"last words");
        assert_eq!(b.try_write(&[b"x"]).expect_err("peer gone").kind(), io::ErrorKind::BrokenPipe);
        assert!(b.arm(true, false).is_none(), "a gone peer never puts the engine to sleep");
    }
}
