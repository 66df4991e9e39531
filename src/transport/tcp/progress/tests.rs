//! Unit tests of the progress threads ([`super`]).

use super::*;
use crate::transport::Transport;
use crate::transport::tcp::SocketOptions;
use crate::transport::tcp::striped::StripedTransport;
use crate::transport::testutil::{
    exchange, loopback_sockets as sockets, random_bytes, read_to_end, sleep_on, write_all,
};

#[test]
fn random_bytes_cross_both_ways_between_threaded_ends_on_one_and_three_lanes() {
    for (lanes, threads) in [(1, 1), (3, 2), (3, 4)] {
        let pool = ProgressThreads::new(threads);
        let (a, b) = sockets(lanes);
        let (mut a, mut b) = (pool.attach(a).unwrap(), pool.attach(b).unwrap());
        assert_eq!(a.kind(), if lanes == 1 { "tcp" } else { "tcp-striped" });
        let a_out = random_bytes(9 * CHUNK + 12_345, lanes as u64);
        let b_out = random_bytes(17 * CHUNK + 1, 7 + lanes as u64);
        let (a_in, b_in) = exchange(&mut a, &mut b, &a_out, &b_out);
        assert!(a_in == b_out && b_in == a_out, "{lanes} lanes, {threads} threads: bytes differ");
    }
}

#[test]
fn a_threaded_end_and_a_plain_striped_end_deal_the_stream_the_same_way() {
    let pool = ProgressThreads::new(2);
    let (a, b) = sockets(3);
    let mut a = pool.attach(a).unwrap();
    let opts = SocketOptions::default();
    let mut b = StripedTransport::new(b, &opts).unwrap();
    let a_out = random_bytes(11 * CHUNK + 77, 3);
    let b_out = random_bytes(5 * CHUNK + 3, 4);
    let (a_in, b_in) = exchange(&mut a, &mut b, &a_out, &b_out);
    assert!(a_in == b_out && b_in == a_out, "bytes differ");
}

#[test]
fn what_was_written_before_a_drop_or_a_shutdown_arrives_then_the_stream_ends() {
    let pool = ProgressThreads::new(2);
    // Shut down, still alive: the peer reads everything, then the end.
    let (a, b) = sockets(2);
    let (mut a, mut b) = (pool.attach(a).unwrap(), pool.attach(b).unwrap());
    let msg = random_bytes(2 * RING + 5, 5);
    let reader = std::thread::spawn(move || read_to_end(&mut b));
    write_all(&mut a, &msg);
    a.shutdown();
    assert!(reader.join().unwrap() == msg, "shut down: bytes differ");
    // Dropped at once after the last write: the helper still sends what the rings held.
    let (a, b) = sockets(2);
    let (mut a, mut b) = (pool.attach(a).unwrap(), pool.attach(b).unwrap());
    let msg = random_bytes(3 * RING + 9, 6);
    let reader = std::thread::spawn(move || read_to_end(&mut b));
    write_all(&mut a, &msg);
    drop(a);
    assert!(reader.join().unwrap() == msg, "dropped: bytes differ");
}

#[test]
fn peek_sees_across_the_lane_boundary_without_consuming() {
    // One lane too: the chunk boundary then leads back to the same ring, whose head the peek
    // has already seen (a 40-byte frame header peeked across it once read its own magic again).
    for lanes in [1, 2, 3] {
        peek_across_the_boundary(lanes);
    }
}

fn peek_across_the_boundary(lanes: usize) {
    let pool = ProgressThreads::new(1);
    let (a, b) = sockets(lanes);
    let (mut a, mut b) = (pool.attach(a).unwrap(), pool.attach(b).unwrap());
    let msg = random_bytes(CHUNK + 40, 3);
    write_all(&mut a, &msg);
    let mut head = vec![0u8; CHUNK - 20];
    let mut got = 0;
    while got < head.len() {
        match b.try_read(&mut [&mut head[got..]]) {
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => sleep_on(&mut b, true, false),
            Err(e) => panic!("{e}"),
        }
    }
    let mut p = [0u8; 50];
    let deadline = Instant::now() + Duration::from_secs(5);
    while b.peek(&mut p).unwrap_or(0) < 50 {
        assert!(Instant::now() < deadline, "peek never saw 50 bytes");
        sleep_on(&mut b, true, false);
    }
    assert_eq!(&p[..], &msg[CHUNK - 20..CHUNK + 30], "{lanes} lanes");
    let mut rest = [0u8; 60];
    let mut got = 0;
    while got < 60 {
        match b.try_read(&mut [&mut rest[got..]]) {
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => sleep_on(&mut b, true, false),
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(&rest[..], &msg[CHUNK - 20..], "{lanes} lanes");
}

#[test]
fn a_sleeping_reader_wakes_when_bytes_arrive_and_a_closed_peer_shows() {
    let pool = ProgressThreads::new(1);
    let (a, b) = sockets(1);
    let (mut a, mut b) = (pool.attach(a).unwrap(), pool.attach(b).unwrap());
    // Nothing there: the reader sleeps, and its descriptor is not readable.
    let ev = b.arm(true, false).expect("nothing to read: sleep");
    assert_eq!(poll(&mut [PollFd::new(b.pollable(), ev)], 50).unwrap(), 0);
    write_all(&mut a, b"hello");
    assert_eq!(poll(&mut [PollFd::new(b.pollable(), ev)], 5000).unwrap(), 1, "no wake-up");
    let mut buf = [0u8; 5];
    assert_eq!(b.try_read(&mut [&mut buf]).unwrap(), 5);
    assert_eq!(&buf, b"hello");
    // The peer's sockets close (its process died, say): the reader sees the end.
    drop(a);
    assert!(read_to_end(&mut b).is_empty());
}

#[test]
fn a_reset_connection_fails_the_writer() {
    let pool = ProgressThreads::new(1);
    let (a, b) = sockets(2);
    let mut a = pool.attach(a).unwrap();
    // The peer closes with unread bytes in its buffer: the kernel answers with a reset.
    write_all(&mut a, &random_bytes(1000, 1));
    std::thread::sleep(Duration::from_millis(50));
    drop(b);
    let deadline = Instant::now() + Duration::from_secs(10);
    let chunk = vec![0u8; CHUNK];
    let err = loop {
        assert!(Instant::now() < deadline, "the writer never saw the reset");
        match a.try_write(&[&chunk]) {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => sleep_on(&mut a, false, true),
            Err(e) => break e,
        }
    };
    assert!(matches!(err.kind(), io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe), "{err}");
}

#[test]
fn the_threads_end_when_the_last_link_is_gone() {
    let pool = ProgressThreads::new(3);
    let (a, b) = sockets(2);
    let (a, b) = (pool.attach(a).unwrap(), pool.attach(b).unwrap());
    let helpers: Vec<Arc<Helper>> =
        pool.pool.helpers.lock().unwrap().iter().map(|(h, _)| Arc::clone(h)).collect();
    assert_eq!(helpers.len(), 3);
    let t = Instant::now();
    drop((a, b, pool));
    // Each thread held one reference; the links held theirs: only ours are left.
    assert!(helpers.iter().all(|h| Arc::strong_count(h) == 1), "a thread is still running");
    assert!(t.elapsed() < FLUSH, "the threads took {:?} to end", t.elapsed());
}
