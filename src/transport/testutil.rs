//! What the transports' tests share: for the ring transports (shared memory, RDMA) a byte
//! pattern that says where in a stream each byte belongs and a seeded generator for random
//! schedules; for the TCP ones (striped, progress threads) loopback sockets, random streams and
//! the engine's way of moving them (arm, poll, retry), each with a deadline.

use std::io;
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::sys::poll::{PollFd, poll};
use crate::transport::Transport;

/// The byte at position `i` of a test stream.
pub(crate) fn pattern(i: u64) -> u8 {
    (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8
}

/// Bytes `from .. from + n` of a test stream.
pub(crate) fn bytes(from: u64, n: usize) -> Vec<u8> {
    (from..from + n as u64).map(pattern).collect()
}

/// The seeded generator of the kernel tests (splitmix64): the same steps on every run.
pub(crate) use crate::reduce::testutil::Rng;

/// `lanes` connected pairs of non-blocking loopback sockets (`TCP_NODELAY`), in lane order.
pub(crate) fn loopback_sockets(lanes: usize) -> (Vec<TcpStream>, Vec<TcpStream>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for _ in 0..lanes {
        a.push(TcpStream::connect(l.local_addr().unwrap()).unwrap());
        b.push(l.accept().unwrap().0);
    }
    for s in a.iter().chain(&b) {
        s.set_nonblocking(true).unwrap();
        s.set_nodelay(true).unwrap();
    }
    (a, b)
}

/// `len` random bytes from a seeded xorshift.
pub(crate) fn random_bytes(len: usize, mut seed: u64) -> Vec<u8> {
    (0..len)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed as u8
        })
        .collect()
}

/// Waits as the engine does: arm, then poll the transport's descriptor (at most 100 ms).
pub(crate) fn sleep_on(t: &mut dyn Transport, read: bool, write: bool) {
    if let Some(ev) = t.arm(read, write) {
        let _ = poll(&mut [PollFd::new(t.pollable(), ev)], 100).unwrap();
    }
}

/// Moves `a_out` from `a` to `b` and `b_out` back at once, in uneven pieces through two
/// buffers per call, sleeping as the engine does (20 s at most); returns what each received.
pub(crate) fn exchange(
    a: &mut dyn Transport,
    b: &mut dyn Transport,
    a_out: &[u8],
    b_out: &[u8],
) -> (Vec<u8>, Vec<u8>) {
    let (mut a_in, mut b_in) = (vec![0u8; b_out.len()], vec![0u8; a_out.len()]);
    let (mut sent, mut got) = ([0usize; 2], [0usize; 2]);
    let piece = [7919usize, 100_003];
    let deadline = Instant::now() + Duration::from_secs(20);
    while sent[0] < a_out.len() || sent[1] < b_out.len() || got[0] < b_out.len() || got[1] < a_out.len() {
        assert!(Instant::now() < deadline, "no progress: sent {sent:?} got {got:?}");
        for side in 0..2 {
            let t: &mut dyn Transport = if side == 0 { &mut *a } else { &mut *b };
            let (out, inp) = if side == 0 { (a_out, &mut a_in) } else { (b_out, &mut b_in) };
            let p = piece[side];
            if sent[side] < out.len() {
                let end = (sent[side] + p).min(out.len());
                let mid = (sent[side] + end) / 2;
                match t.try_write(&[&out[sent[side]..mid], &out[mid..end]]) {
                    Ok(n) => sent[side] += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => panic!("write: {e}"),
                }
            }
            if got[side] < inp.len() {
                let end = (got[side] + p).min(inp.len());
                let mid = (got[side] + end) / 2;
                let (x, y) = inp[got[side]..end].split_at_mut(mid - got[side]);
                match t.try_read(&mut [x, y]) {
                    Ok(0) => panic!("closed early"),
                    Ok(n) => got[side] += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => panic!("read: {e}"),
                }
            }
            let (r, w) = (got[side] < inp.len(), sent[side] < out.len());
            if r || w {
                sleep_on(t, r, w);
            }
        }
    }
    (a_in, b_in)
}

/// Reads `t` to the end of its stream (20 s at most).
pub(crate) fn read_to_end(t: &mut dyn Transport) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = vec![0u8; 100_000];
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        assert!(Instant::now() < deadline, "no end of stream after {} bytes", out.len());
        match t.try_read(&mut [&mut buf]) {
            Ok(0) => return out,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => sleep_on(t, true, false),
            Err(e) => panic!("read: {e}"),
        }
    }
}

/// Fills `buf` from `t` (20 s at most).
pub(crate) fn read_exact(t: &mut dyn Transport, buf: &mut [u8]) {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut got = 0;
    while got < buf.len() {
        assert!(Instant::now() < deadline, "read only {got} of {} bytes", buf.len());
        match t.try_read(&mut [&mut buf[got..]]) {
            Ok(0) => panic!("closed early"),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => sleep_on(t, true, false),
            Err(e) => panic!("read: {e}"),
        }
    }
}

/// Writes all of `msg` (20 s at most).
pub(crate) fn write_all(t: &mut dyn Transport, msg: &[u8]) {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut sent = 0;
    while sent < msg.len() {
        assert!(Instant::now() < deadline, "wrote only {sent} of {} bytes", msg.len());
        match t.try_write(&[&msg[sent..]]) {
            Ok(n) => sent += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => sleep_on(t, false, true),
            Err(e) => panic!("write: {e}"),
        }
    }
}
