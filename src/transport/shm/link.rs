//! The shared-memory transport: two rings in a pair segment, woken through the pair's
//! connection (see the [module documentation](super)).

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::time::Instant;

use super::byte_ring::{Consumer, Producer, pair_segment_len, ring_capacity, rings};
use super::{Segment, segment_name};
use crate::error::{Error, Result};
use crate::sys::poll::{Events, PollFd, poll};
use crate::sys::socketpair;
use crate::transport::Transport;

/// A peer on the same host: two rings in a shared segment, and the peer's TCP connection as the
/// wake-up and liveness channel.
#[derive(Debug)]
pub struct ShmTransport {
    seg: Segment,
    tx: Producer,
    rx: Consumer,
    wake: Box<dyn Transport>,
    /// The wake-up connection reached end of stream or failed: the peer is gone.
    peer_gone: bool,
}

impl ShmTransport {
    /// Wraps a mapped pair segment. `lower` says whether this side is the pair's lower rank
    /// (it writes ring 0 and reads ring 1).
    pub(super) fn new(seg: Segment, cap: usize, lower: bool, wake: Box<dyn Transport>) -> ShmTransport {
        let [a, b] = rings(cap);
        let (txa, rxa) = if lower { (a, b) } else { (b, a) };
        ShmTransport { seg, tx: Producer::new(txa), rx: Consumer::new(rxa), wake, peer_gone: false }
    }

    /// A connected pair in this process (tests and benchmarks): two transports over one segment
    /// in `dir`, woken through a socket pair.
    pub fn pair(dir: &Path, cap: usize) -> Result<(ShmTransport, ShmTransport)> {
        let cap = ring_capacity(cap);
        let len = pair_segment_len(cap);
        let nonce = crate::sys::random::id();
        let mut seg =
            Segment::create(dir, &segment_name(nonce, "test"), len).map_err(|e| Error::System(e.0.into()))?;
        let path = dir.join(segment_name(nonce, "test"));
        let other = Segment::open(&path, len).map_err(|e| Error::system("opening the segment", e))?;
        seg.unlink();
        let (a, b) = socket_pair()?;
        Ok((
            ShmTransport::new(seg, cap, true, Box::new(a)),
            ShmTransport::new(other, cap, false, Box::new(b)),
        ))
    }

    /// Sends one wake-up byte on the connection (a failure means the peer is gone).
    fn ring_doorbell(&mut self) {
        match self.wake.try_write(&[&[1u8]]) {
            Ok(_) => {}
            // A full socket buffer holds plenty of wake-ups already.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(_) => self.peer_gone = true,
        }
    }

    /// Reads pending wake-up bytes; notices end of stream.
    fn drain_doorbell(&mut self) {
        let mut buf = [0u8; 64];
        loop {
            match self.wake.try_read(&mut [&mut buf]) {
                Ok(0) => {
                    self.peer_gone = true;
                    return;
                }
                Ok(n) if n < buf.len() => return,
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    self.peer_gone = true;
                    return;
                }
            }
        }
    }

    fn broken_pipe(&self) -> io::Error {
        io::Error::new(io::ErrorKind::BrokenPipe, "peer closed its shared-memory ring")
    }
}

impl Transport for ShmTransport {
    fn kind(&self) -> &'static str {
        "shm"
    }

    fn try_write(&mut self, bufs: &[&[u8]]) -> io::Result<usize> {
        if self.peer_gone || self.tx.reader_gone(self.seg.mem()) {
            return Err(self.broken_pipe());
        }
        let (n, wake) = self.tx.write(self.seg.mem(), bufs);
        if wake {
            self.ring_doorbell();
        }
        if n == 0 && bufs.iter().any(|b| !b.is_empty()) {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        Ok(n)
    }

    fn try_read(&mut self, bufs: &mut [&mut [u8]]) -> io::Result<usize> {
        if bufs.iter().all(|b| b.is_empty()) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty read"));
        }
        let (n, wake) = self.rx.read(self.seg.mem(), bufs);
        if wake {
            self.ring_doorbell();
        }
        if n > 0 {
            return Ok(n);
        }
        if self.rx.at_end(self.seg.mem()) || (self.peer_gone && self.rx.available(self.seg.mem()) == 0) {
            return Ok(0);
        }
        Err(io::ErrorKind::WouldBlock.into())
    }

    fn peek(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.drain_doorbell();
        let n = self.rx.peek(self.seg.mem(), buf);
        if n == 0 && !self.rx.at_end(self.seg.mem()) && !self.peer_gone {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        Ok(n)
    }

    fn pollable(&self) -> RawFd {
        self.wake.pollable()
    }

    fn shutdown(&mut self) {
        if self.tx.close(self.seg.mem()) {
            self.ring_doorbell();
        }
        self.wake.shutdown();
    }

    fn arm(&mut self, read: bool, write: bool) -> Option<Events> {
        self.drain_doorbell();

        if self.peer_gone {
            return None;
        }
        if read && !self.rx.arm(self.seg.mem()) {
            return None;
        }
        if write && !self.tx.arm(self.seg.mem()) {
            return None;
        }
        Some(PollFd::IN)
    }

    fn zero_copy(&self) -> bool {
        true
    }

    fn read_with(&mut self, max: usize, f: &mut dyn FnMut(&[u8]) -> usize) -> io::Result<usize> {
        let (n, wake) = self.rx.read_with(self.seg.mem(), max, f);
        if wake {
            self.ring_doorbell();
        }
        if n > 0 {
            return Ok(n);
        }
        // Nothing taken: either nothing is there, or only part of an element. Once the writer
        // has closed or died, look once more (it may have published just before) and then it is
        // the end of the stream: a partial element will never be completed.
        if self.rx.writer_done(self.seg.mem()) || self.peer_gone {
            let (n, wake) = self.rx.read_with(self.seg.mem(), max, f);
            if wake {
                self.ring_doorbell();
            }
            return Ok(n);
        }
        Err(io::ErrorKind::WouldBlock.into())
    }
}

impl Drop for ShmTransport {
    fn drop(&mut self) {
        // Writes to us fail from now on, and the peer reads end of stream after our data.
        self.rx.leave(self.seg.mem());
        let _ = self.tx.close(self.seg.mem());
        // The wake-up connection closes with `wake`, which wakes a sleeping peer.
    }
}

/// A connected pair of non-blocking Unix stream sockets as transports (wake-up channels for
/// in-process pairs).
/// A connected pair of wake-up sockets (tests of other modules).
#[cfg(test)]
pub(super) fn socket_pair_for_tests() -> (UnixWake, UnixWake) {
    socket_pair().expect("socketpair")
}

fn socket_pair() -> Result<(UnixWake, UnixWake)> {
    let (a, b) = socketpair::stream_pair().map_err(|e| Error::system("socketpair", e))?;
    Ok((UnixWake(a), UnixWake(b)))
}

/// One end of a socket pair used only to wake the other end.
#[derive(Debug)]
pub(super) struct UnixWake(OwnedFd);

impl Transport for UnixWake {
    fn kind(&self) -> &'static str {
        "unix"
    }

    fn try_write(&mut self, bufs: &[&[u8]]) -> io::Result<usize> {
        let b = bufs.iter().find(|b| !b.is_empty()).map_or(&[][..], |b| *b);
        socketpair::send(self.0.as_fd(), b)
    }

    fn try_read(&mut self, bufs: &mut [&mut [u8]]) -> io::Result<usize> {
        let Some(b) = bufs.iter_mut().find(|b| !b.is_empty()) else {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty read"));
        };
        socketpair::recv(self.0.as_fd(), b)
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

/// Waits until `t` can progress in the asked directions or `deadline` passes (blocking helper
/// for set-up, outside the engine).
pub(crate) fn wait_ready(
    t: &mut dyn Transport,
    read: bool,
    write: bool,
    deadline: Instant,
) -> io::Result<()> {
    let Some(events) = t.arm(read, write) else { return Ok(()) };
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::ErrorKind::TimedOut.into());
    }
    let ms = left.as_millis().clamp(1, 100) as i32;
    // An interrupted sleep is `Ok(0)`: the caller re-checks, as after a timeout.
    poll(&mut [PollFd::new(t.pollable(), events)], ms).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::shm::byte_ring::MIN_RING;
    use std::path::PathBuf;
    use std::thread;
    use std::time::Duration;

    fn dir() -> PathBuf {
        PathBuf::from(crate::config::DEFAULT_SHM_DIR)
    }

    fn poll_one(t: &mut dyn Transport, read: bool, write: bool) {
        wait_ready(t, read, write, Instant::now() + Duration::from_secs(10)).unwrap();
    }

    fn pattern(i: u64) -> u8 {
        (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8
    }

    #[test]
    fn stream_survives_wrap_around_with_copies_and_lending() {
        let (mut a, mut b) = ShmTransport::pair(&dir(), MIN_RING).unwrap();
        const TOTAL: u64 = 3 << 20;
        let writer = thread::spawn(move || {
            let mut sent = 0u64;
            let mut len = 1usize;
            let mut buf = vec![0u8; 20000];
            while sent < TOTAL {
                len = (len * 7 + 13) % 20000 + 1;
                let n = len.min((TOTAL - sent) as usize);
                for (k, x) in buf[..n].iter_mut().enumerate() {
                    *x = pattern(sent + k as u64);
                }
                let mut off = 0;
                while off < n {
                    // Split into two parts to exercise vectored writes.
                    let mid = off + (n - off) / 2;
                    match a.try_write(&[&buf[off..mid], &buf[mid..n]]) {
                        Ok(k) => off += k,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => poll_one(&mut a, false, true),
                        Err(e) => panic!("{e}"),
                    }
                }
                sent += n as u64;
            }
            a.shutdown();
            a
        });
        let mut got = 0u64;
        let mut buf = vec![0u8; 7000];
        let mut turn = 0u32;
        loop {
            turn += 1;
            let r = if turn.is_multiple_of(2) {
                b.try_read(&mut [&mut buf[..(turn as usize * 31) % 7000 + 1]]).inspect(|&n| {
                    for (k, x) in buf[..n].iter().enumerate() {
                        assert_eq!(*x, pattern(got + k as u64), "byte {}", got + k as u64);
                    }
                })
            } else {
                let mut at = got;
                // Take whole 4-byte "elements" only, as a reducing sink does.
                b.read_with(usize::MAX, &mut |s: &[u8]| {
                    let take = s.len() - s.len() % 4;
                    for (k, x) in s[..take].iter().enumerate() {
                        assert_eq!(*x, pattern(at + k as u64), "lent byte {}", at + k as u64);
                    }
                    at += take as u64;
                    take
                })
            };
            match r {
                Ok(0) => break,
                Ok(n) => got += n as u64,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    // The last bytes may be a partial element only plain reads take.
                    if !turn.is_multiple_of(2) {
                        continue;
                    }
                    poll_one(&mut b, true, false)
                }
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(got, TOTAL);
        drop(writer.join().unwrap());
    }

    #[test]
    fn lending_stitches_elements_across_the_ring_end() {
        let (mut a, mut b) = ShmTransport::pair(&dir(), MIN_RING).unwrap();
        // Move the stream position to 6 bytes before the end of the ring.
        let pad = vec![0u8; MIN_RING - 6];
        assert_eq!(a.try_write(&[&pad]).unwrap(), pad.len());
        let mut sink = vec![0u8; pad.len()];
        assert_eq!(b.try_read(&mut [&mut sink]).unwrap(), pad.len());
        let data: Vec<u8> = (0..16u8).collect();
        assert_eq!(a.try_write(&[&data]).unwrap(), 16);
        let mut seen = Vec::new();
        while seen.len() < 16 {
            b.read_with(16 - seen.len(), &mut |s: &[u8]| {
                let take = s.len() - s.len() % 8;
                seen.extend_from_slice(&s[..take]);
                take
            })
            .unwrap();
        }
        assert_eq!(seen, data);
    }

    #[test]
    fn end_of_stream_after_shutdown_and_after_drop() {
        let (mut a, mut b) = ShmTransport::pair(&dir(), MIN_RING).unwrap();
        a.try_write(&[b"last words"]).unwrap();
        a.shutdown();
        let mut buf = [0u8; 64];
        assert_eq!(b.try_read(&mut [&mut buf]).unwrap(), 10);
        assert_eq!(b.try_read(&mut [&mut buf]).unwrap(), 0);
        let (mut a, mut b) = ShmTransport::pair(&dir(), MIN_RING).unwrap();
        a.try_write(&[b"x"]).unwrap();
        drop(a);
        assert_eq!(b.try_read(&mut [&mut buf]).unwrap(), 1);
        assert_eq!(b.try_read(&mut [&mut buf]).unwrap(), 0);
        assert_eq!(b.try_write(&[b"y"]).unwrap_err().kind(), io::ErrorKind::BrokenPipe);
    }

    #[test]
    fn a_killed_peer_is_seen_through_the_wake_up_connection() {
        // The peer's process dies without marking its ring: only its socket closes.
        let (mut a, mut b) = ShmTransport::pair(&dir(), MIN_RING).unwrap();
        let (spare, _other) = socket_pair().unwrap();
        drop(std::mem::replace(&mut a.wake, Box::new(spare)));
        std::mem::forget(a); // no Drop: the ring is never marked closed
        let mut buf = [0u8; 8];
        assert_eq!(b.try_read(&mut [&mut buf]).unwrap_err().kind(), io::ErrorKind::WouldBlock);
        assert!(b.arm(true, false).is_none(), "arm notices the closed connection");
        assert_eq!(b.try_read(&mut [&mut buf]).unwrap(), 0);
    }

    #[test]
    fn arm_sleeps_only_when_nothing_can_move_and_a_write_wakes_the_sleeper() {
        let (mut a, mut b) = ShmTransport::pair(&dir(), MIN_RING).unwrap();
        assert_eq!(b.arm(true, false), Some(PollFd::IN));
        assert!(a.arm(false, true).is_none(), "an empty ring has room");
        let t = thread::spawn(move || {
            thread::sleep(Duration::from_millis(50));
            a.try_write(&[b"wake"]).unwrap();
            a
        });
        let n = poll(&mut [PollFd::new(b.pollable(), PollFd::IN)], 5000).unwrap();
        assert_eq!(n, 1, "the writer's doorbell wakes poll");
        let mut buf = [0u8; 8];
        assert_eq!(b.try_read(&mut [&mut buf]).unwrap(), 4);
        let mut a = t.join().unwrap();
        // A full ring: the writer arms, the reader's release wakes it.
        let fill = vec![7u8; MIN_RING];
        assert_eq!(a.try_write(&[&fill]).unwrap(), MIN_RING);
        assert_eq!(a.arm(false, true), Some(PollFd::IN));
        let mut big = vec![0u8; 100];
        b.try_read(&mut [&mut big]).unwrap();
        assert_eq!(poll(&mut [PollFd::new(a.pollable(), PollFd::IN)], 5000).unwrap(), 1);
        assert!(a.arm(false, true).is_none());
    }
}
