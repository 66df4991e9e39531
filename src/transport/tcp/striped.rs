//! A striped connection: one byte stream to a peer carried by several TCP connections
//! ("lanes"), so that a path that caps each flow (a cloud network's per-flow limit, one flow's
//! share of a fast NIC) still carries the whole link rate. NCCL does the same with
//! `NCCL_NSOCKS_PERTHREAD` x `NCCL_SOCKET_NTHREADS`; Gloo cannot.
//!
//! The stream is cut into chunks of [`CHUNK`] bytes dealt round-robin: chunk `i` goes on lane
//! `i mod lanes`, so both ends know where every byte travels without any header, and the
//! receiver reads the lanes in the same order. A lane whose next chunk has not arrived holds
//! the reader, but not the others' transfers: their bytes wait in their own kernel buffers
//! (the reordering window is the socket buffers, megabytes under autotuning), so every flow
//! keeps sending at its own rate. The writer likewise stops only on the lane whose chunk it is
//! writing, whose buffer is full because that flow is the slowest.
//!
//! Sleeping: reading waits on the lane the next chunk comes from, writing on the lane the next
//! chunk goes to; when both directions wait on different lanes, the two lanes go in an
//! `epoll(7)` set, one descriptor for the engine's `poll(2)` ([`crate::sys::epoll`]).

use std::cell::Cell;
use std::io::{self, IoSlice, IoSliceMut};
use std::net::TcpStream;
use std::os::fd::{AsFd, AsRawFd, RawFd};

use super::handshake::MAX_LANES;
use super::{MAX_BUFS, SocketOptions, configure};
use crate::error::{Error, Result};
use crate::sys::epoll::{self, EpollSet, Interest};
use crate::sys::fork::ForkGuarded;
use crate::sys::poll::{Events, PollFd};
use crate::sys::socket;
use crate::transport::Transport;

/// Bytes of the stream per lane before the next lane takes over. Large enough that one
/// `sendmsg` moves a useful amount; small enough that a 1 MiB message spreads over 16 chunks.
pub const CHUNK: usize = 64 << 10;

/// What one rank asks of its connections, published beside its host identity so that the two
/// ends of every pair derive the same number of lanes ([`lanes_for`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkPrefs {
    /// `TOROID_NSOCKS`; 0: choose.
    pub nsocks: usize,
    /// Shared memory allowed with ranks of this host (`TOROID_SHM_DISABLE` unset).
    pub shm: bool,
    /// Lanes this rank would choose towards another host: from its interface's speed.
    pub auto: usize,
    /// This rank can reach other hosts through RDMA (`transport::rdma::setup::wanted`).
    pub rdma: bool,
}

impl LinkPrefs {
    /// This rank's preferences: `cfg`, and the speed of the interface `ifname` it listens on
    /// (`/sys/class/net/*/speed`): 4 lanes from 25 Gbit/s, 2 from 10 Gbit/s, else 1 (one flow
    /// fills a slower link); 1 when `size` ranks with that many lanes each would come near the
    /// descriptor limit.
    pub fn local(cfg: &crate::config::Config, ifname: &str, size: usize) -> LinkPrefs {
        let mbit = std::fs::read_to_string(format!("/sys/class/net/{ifname}/speed"))
            .ok()
            .and_then(|s| s.trim().parse::<i64>().ok())
            .unwrap_or(0);
        let mut auto = match mbit {
            25_000.. => 4,
            10_000.. => 2,
            _ => 1,
        };
        let need = size.saturating_sub(1).saturating_mul(auto).saturating_add(256) as u64;
        if crate::sys::process::open_files_limit().is_some_and(|limit| need > limit) {
            auto = 1;
        }
        LinkPrefs { nsocks: cfg.nsocks, shm: !cfg.shm_disable, auto, rdma: false }
    }

    /// The published form.
    pub fn encode(&self) -> String {
        format!(
            "nsocks={} shm={} auto={} rdma={}",
            self.nsocks,
            u8::from(self.shm),
            self.auto,
            u8::from(self.rdma)
        )
    }

    /// Parses [`LinkPrefs::encode`]'s form; `None` when malformed or out of range.
    pub fn decode(s: &str) -> Option<LinkPrefs> {
        let mut p = LinkPrefs { nsocks: usize::MAX, shm: false, auto: usize::MAX, rdma: false };
        let mut shm = None;
        for kv in s.split_ascii_whitespace() {
            match kv.split_once('=')? {
                ("nsocks", v) => p.nsocks = v.parse().ok()?,
                ("shm", v) => shm = Some(v == "1"),
                ("rdma", v) => p.rdma = v == "1",
                ("auto", v) => p.auto = v.parse().ok()?,
                _ => return None,
            }
        }
        p.shm = shm?;
        (p.nsocks <= MAX_LANES && (1..=MAX_LANES).contains(&p.auto)).then_some(p)
    }
}

/// Connections between two ranks with preferences `a` and `b` (symmetric, so both ends agree):
/// one where shared memory will carry the pair (same host, both allow it) or RDMA will (other
/// hosts, both can: the connection only watches the peer, and if RDMA then fails to connect the
/// pair runs on that one connection, with a WARN); else the larger of
/// what the two ask, where a rank that did not set `TOROID_NSOCKS` asks 1 inside a host and on
/// loopback and its [`LinkPrefs::auto`] between hosts.
pub fn lanes_for(a: &LinkPrefs, b: &LinkPrefs, same_host: bool, loopback: bool) -> usize {
    if (same_host && a.shm && b.shm) || (!same_host && a.rdma && b.rdma) {
        return 1;
    }
    let want = |p: &LinkPrefs| match p.nsocks {
        0 if same_host || loopback => 1,
        0 => p.auto,
        n => n,
    };
    want(a).max(want(b)).clamp(1, MAX_LANES)
}

/// Where one direction of the stream is: the lane of the current chunk and the bytes of that
/// chunk still to move.
#[derive(Debug, Clone, Copy)]
pub(super) struct Stripe {
    pub(super) lane: usize,
    pub(super) left: usize,
}

impl Stripe {
    pub(super) fn start() -> Stripe {
        Stripe { lane: 0, left: CHUNK }
    }

    /// `n` bytes of the current chunk moved (`n <= left`).
    pub(super) fn advance(&mut self, n: usize, lanes: usize) {
        self.left -= n;
        if self.left == 0 {
            self.lane = (self.lane + 1) % lanes;
            self.left = CHUNK;
        }
    }
}

/// What [`Transport::pollable`] hands out after the last [`Transport::arm`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Armed {
    /// The reading lane (also what an unarmed caller gets: it watches for a hang-up).
    Rx,
    /// The writing lane.
    Tx,
    /// The epoll set holding both.
    Set,
}

/// A byte stream striped over several connected TCP lanes.
#[derive(Debug)]
pub struct StripedTransport {
    lanes: Vec<ForkGuarded<TcpStream>>,
    tx: Stripe,
    rx: Stripe,
    /// Made the first time both directions sleep on different lanes.
    set: Option<EpollSet>,
    /// What each lane is registered for in `set`.
    interest: Vec<Interest>,
    armed: Cell<Armed>,
}

impl StripedTransport {
    /// Joins `lanes` (in lane order, as both ends numbered them in the handshake).
    pub fn new(lanes: Vec<TcpStream>, opts: &SocketOptions) -> Result<StripedTransport> {
        if lanes.len() < 2 {
            return Err(Error::Internal("a striped connection needs two lanes or more".into()));
        }
        let n = lanes.len();
        let lanes = lanes
            .into_iter()
            .map(|s| configure(s, opts).map(ForkGuarded::new))
            .collect::<Result<Vec<_>>>()?;
        Ok(StripedTransport {
            lanes,
            tx: Stripe::start(),
            rx: Stripe::start(),
            set: None,
            interest: vec![0; n],
            armed: Cell::new(Armed::Rx),
        })
    }

    fn fd(&self, lane: usize) -> RawFd {
        self.lanes[lane].as_raw_fd()
    }

    /// Registers the reading lane for input and hang-up and the writing lane for room, every
    /// other lane for nothing.
    fn arm_set(&mut self) -> io::Result<()> {
        if self.set.is_none() {
            let set = EpollSet::new()?;
            for l in &self.lanes {
                set.add(l.as_raw_fd(), 0)?;
            }
            self.set = Some(set);
        }
        for lane in 0..self.lanes.len() {
            let want = if lane == self.rx.lane {
                epoll::IN | epoll::RDHUP
            } else if lane == self.tx.lane {
                epoll::OUT
            } else {
                0
            };
            if self.interest[lane] != want {
                if let Some(set) = &self.set {
                    set.modify(self.fd(lane), want)?;
                }
                self.interest[lane] = want;
            }
        }
        Ok(())
    }
}

/// The slices of `bufs` from byte `skip` on, at most `max` bytes and [`MAX_BUFS`] slices.
fn window<'a>(
    bufs: &[&'a [u8]],
    mut skip: usize,
    mut max: usize,
    out: &mut [IoSlice<'a>; MAX_BUFS],
) -> usize {
    let mut n = 0;
    for b in bufs {
        if max == 0 || n == MAX_BUFS {
            break;
        }
        if skip >= b.len() {
            skip -= b.len();
            continue;
        }
        let take = (b.len() - skip).min(max);
        out[n] = IoSlice::new(&b[skip..skip + take]);
        n += 1;
        max -= take;
        skip = 0;
    }
    n
}

/// [`window`] for reading.
fn window_mut<'a>(
    bufs: &'a mut [&mut [u8]],
    mut skip: usize,
    mut max: usize,
    out: &mut [IoSliceMut<'a>; MAX_BUFS],
) -> usize {
    let mut n = 0;
    for b in bufs.iter_mut() {
        if max == 0 || n == MAX_BUFS {
            break;
        }
        if skip >= b.len() {
            skip -= b.len();
            continue;
        }
        let take = (b.len() - skip).min(max);
        out[n] = IoSliceMut::new(&mut b[skip..skip + take]);
        n += 1;
        max -= take;
        skip = 0;
    }
    n
}

impl Transport for StripedTransport {
    fn kind(&self) -> &'static str {
        "tcp-striped"
    }

    fn try_write(&mut self, bufs: &[&[u8]]) -> io::Result<usize> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let lanes = self.lanes.len();
        let mut done = 0;
        while done < total {
            let mut iov = [IoSlice::new(&[]); MAX_BUFS];
            let n = window(bufs, done, self.tx.left, &mut iov);
            let want: usize = iov[..n].iter().map(|b| b.len()).sum();
            match socket::send_vectored(self.lanes[self.tx.lane].as_fd(), &iov[..n]) {
                Ok(k) => {
                    done += k;
                    self.tx.advance(k, lanes);
                    if k < want {
                        break;
                    }
                }
                // What moved so far counts; the error (or the full lane) shows on the next call.
                Err(_) if done > 0 => break,
                Err(e) => return Err(e),
            }
        }
        Ok(done)
    }

    fn try_read(&mut self, bufs: &mut [&mut [u8]]) -> io::Result<usize> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if total == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty read"));
        }
        let lanes = self.lanes.len();
        let mut done = 0;
        while done < total {
            let mut iov: [IoSliceMut<'_>; MAX_BUFS] = std::array::from_fn(|_| IoSliceMut::new(&mut []));
            let n = window_mut(bufs, done, self.rx.left, &mut iov);
            let want: usize = iov[..n].iter().map(|b| b.len()).sum();
            match socket::recv_vectored(self.lanes[self.rx.lane].as_fd(), &mut iov[..n]) {
                // The end of the stream (the peer shut down every lane after its last byte).
                Ok(0) => break,
                Ok(k) => {
                    done += k;
                    self.rx.advance(k, lanes);
                    if k < want {
                        break;
                    }
                }
                Err(_) if done > 0 => break,
                Err(e) => return Err(e),
            }
        }
        Ok(done)
    }

    fn peek(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        // The next bytes of the stream are the rest of the current chunk on its lane, then the
        // head of the next lane, and so on.
        let (mut lane, mut left) = (self.rx.lane, self.rx.left);
        let mut got = 0;
        while got < buf.len() {
            let want = left.min(buf.len() - got);
            let n = match socket::peek(self.lanes[lane].as_fd(), &mut buf[got..got + want]) {
                Ok(n) => n,
                Err(_) if got > 0 => break,
                Err(e) => return Err(e),
            };
            got += n;
            if n < want {
                break;
            }
            lane = (lane + 1) % self.lanes.len();
            left = CHUNK;
        }
        Ok(got)
    }

    fn pollable(&self) -> RawFd {
        // One use per arm: a caller that did not arm watches the reading lane for a hang-up.
        match self.armed.replace(Armed::Rx) {
            Armed::Rx => self.fd(self.rx.lane),
            Armed::Tx => self.fd(self.tx.lane),
            Armed::Set => self.set.as_ref().map_or(self.fd(self.rx.lane), |s| s.as_raw_fd()),
        }
    }

    fn arm(&mut self, read: bool, write: bool) -> Option<Events> {
        if read && write && self.rx.lane != self.tx.lane {
            if self.arm_set().is_err() {
                // Without the set, do not sleep: the next read or write reports what is wrong.
                return None;
            }
            self.armed.set(Armed::Set);
            return Some(PollFd::IN);
        }
        let mut events = 0;
        if read {
            events |= PollFd::IN;
        }
        if write {
            events |= PollFd::OUT;
        }
        self.armed.set(if read || !write { Armed::Rx } else { Armed::Tx });
        Some(events)
    }

    fn shutdown(&mut self) {
        for l in &self.lanes {
            let _ = l.shutdown(std::net::Shutdown::Write);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::poll::poll;
    use crate::transport::testutil::{
        exchange, loopback_sockets, random_bytes, read_exact, read_to_end, write_all,
    };

    /// Two ends of a striped connection of `lanes` lanes over loopback.
    fn pair(lanes: usize) -> (StripedTransport, StripedTransport) {
        let (a, b) = loopback_sockets(lanes);
        let opts = SocketOptions { buffer: 256 << 10, ..SocketOptions::default() };
        (StripedTransport::new(a, &opts).unwrap(), StripedTransport::new(b, &opts).unwrap())
    }

    #[test]
    fn both_ends_of_a_pair_choose_the_same_lanes() {
        let p = |nsocks, shm, auto| LinkPrefs { nsocks, shm, auto, rdma: false };
        let (auto2, set4, noshm) = (p(0, true, 2), p(4, true, 1), p(0, false, 1));
        let rdma = LinkPrefs { rdma: true, ..auto2 };
        for (a, b, same, lo, want) in [
            (auto2, auto2, true, false, 1),  // shared memory carries it
            (set4, set4, true, false, 1),    // even when striping is asked for
            (auto2, auto2, false, false, 2), // between hosts: the interface's choice
            (auto2, auto2, false, true, 1),  // loopback
            (auto2, set4, false, true, 4),   // asked for: honoured on loopback too
            (noshm, set4, true, false, 4),   // one side keeps TCP inside the host
            (noshm, noshm, true, false, 1),
            (rdma, rdma, false, false, 1),  // RDMA carries it
            (rdma, auto2, false, false, 2), // one side cannot: TCP, striped
            (rdma, set4, true, false, 1),   // inside a host: shared memory
        ] {
            assert_eq!(lanes_for(&a, &b, same, lo), want, "{a:?} {b:?} same host {same} loopback {lo}");
            assert_eq!(lanes_for(&b, &a, same, lo), want, "symmetric");
        }
        for q in [auto2, set4, noshm, rdma] {
            assert_eq!(LinkPrefs::decode(&q.encode()), Some(q));
        }
        for bad in ["", "nsocks=1", "nsocks=17 shm=1 auto=1", "nsocks=1 shm=1 auto=0", "x=1 shm=1 auto=1"] {
            assert_eq!(LinkPrefs::decode(bad), None, "{bad}");
        }
    }

    #[test]
    fn random_bytes_cross_both_ways_intact_over_three_lanes() {
        let (mut a, mut b) = pair(3);
        let a_out = random_bytes(5 * CHUNK + 12_345, 1);
        let b_out = random_bytes(11 * CHUNK + 1, 2);
        let (a_in, b_in) = exchange(&mut a, &mut b, &a_out, &b_out);
        assert!(a_in == b_out && b_in == a_out, "bytes differ");
        // Every lane carried its share: the writer dealt 6 chunks of a's stream over 3 lanes.
        assert_eq!((a.tx.lane, a.tx.left), (5 % 3, CHUNK - 12_345));
        assert_eq!((b.rx.lane, b.rx.left), (a.tx.lane, a.tx.left));
    }

    #[test]
    fn peek_sees_across_the_lane_boundary_without_consuming() {
        let (mut a, mut b) = pair(2);
        let msg = random_bytes(CHUNK + 40, 3);
        write_all(&mut a, &msg);
        // Read up to 20 bytes before the boundary, then peek 50 across it.
        let mut head = vec![0u8; CHUNK - 20];
        read_exact(&mut b, &mut head);
        let mut p = [0u8; 50];
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while b.peek(&mut p).unwrap_or(0) < 50 {
            assert!(std::time::Instant::now() < deadline, "peek never saw 50 bytes");
        }
        assert_eq!(&p[..], &msg[CHUNK - 20..CHUNK + 30]);
        let mut rest = [0u8; 60];
        read_exact(&mut b, &mut rest);
        assert_eq!(&rest[..], &msg[CHUNK - 20..]);
    }

    #[test]
    fn the_end_of_the_stream_shows_after_the_last_byte() {
        let (mut a, mut b) = pair(4);
        let msg = random_bytes(2 * CHUNK + 3, 4);
        write_all(&mut a, &msg);
        a.shutdown();
        assert!(read_to_end(&mut b) == msg, "bytes differ");
    }

    #[test]
    fn a_reader_and_writer_on_different_lanes_sleep_on_one_descriptor() {
        let (mut a, mut b) = pair(2);
        // Move a's writing lane on by one chunk; b reads it so that a's buffers are empty.
        write_all(&mut a, &vec![9u8; CHUNK]);
        read_exact(&mut b, &mut vec![0u8; CHUNK]);
        assert_eq!((a.tx.lane, a.rx.lane), (1, 0));
        let ev = a.arm(true, true).expect("sleep");
        let fd = a.pollable();
        assert_ne!(fd, a.fd(0));
        assert_ne!(fd, a.fd(1));
        // Lane 1 has room: the set is ready at once.
        assert_eq!(poll(&mut [PollFd::new(fd, ev)], 1000).unwrap(), 1);
        // A second pollable without arming is the reading lane (a hang-up watch).
        assert_eq!(a.pollable(), a.fd(0));
    }
}
