//! The record layer over loopback sockets: streams of random lengths both ways, key epochs,
//! and every way of tampering with records in transit, each of which must end in an error
//! after a correct prefix, never in other data.

use super::*;
use crate::transport::tcp::secure::tcp_pair;
use crate::transport::testutil::{Rng, random_bytes, read_to_end, write_all};

const S1: [u8; SECRET_LEN] = [1; SECRET_LEN];
const S2: [u8; SECRET_LEN] = [2; SECRET_LEN];

/// Two ends of a sealed link: `a` sends with S1 and receives with S2, `b` the other way.
fn sealed_pair(epoch_records: u64) -> (Sealed, Sealed) {
    let (a, b) = tcp_pair();
    let d = |s: &[u8; SECRET_LEN]| Direction::with_epoch_records(s, epoch_records);
    (Sealed::new(a, 1, d(&S1), d(&S2)), Sealed::new(b, 0, d(&S2), d(&S1)))
}

/// Sends `out` and receives `n` bytes on `t` at once, in uneven pieces of two slices, as the
/// engine does (20 s at most); the other end runs on another thread.
fn duplex(t: &mut Sealed, out: &[u8], n: usize) -> Vec<u8> {
    let mut inp = vec![0u8; n];
    let (mut sent, mut got) = (0, 0);
    let mut rng = Rng(out.len() as u64);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while sent < out.len() || got < n {
        assert!(std::time::Instant::now() < deadline, "no progress: sent {sent} got {got}");
        if sent < out.len() {
            let end = (sent + 1 + rng.upto(200_000)).min(out.len());
            let mid = (sent + end) / 2;
            match t.try_write(&[&out[sent..mid], &out[mid..end]]) {
                Ok(k) => sent += k,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => panic!("write: {e}"),
            }
        }
        if got < n {
            let end = (got + 1 + rng.upto(150_000)).min(n);
            let mid = (got + end) / 2;
            let (x, y) = inp[got..end].split_at_mut(mid - got);
            match t.try_read(&mut [x, y]) {
                Ok(0) => panic!("closed early"),
                Ok(k) => got += k,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => panic!("read: {e}"),
            }
        }
        let (r, w) = (got < n, sent < out.len());
        if r || w {
            crate::transport::testutil::sleep_on(t, r, w);
        }
    }
    inp
}

#[test]
fn streams_of_any_length_cross_both_ways() {
    let mut rng = Rng(41);
    for case in 0..12 {
        let (mut a, mut b) = sealed_pair(if case % 3 == 0 { 3 } else { EPOCH_RECORDS });
        let n1 = (rng.next() % (3 << 20)) as usize;
        let n2 = (rng.next() % (1 << 20)) as usize;
        let (x, y) = (random_bytes(n1, case + 1), random_bytes(n2, case + 100));
        let (x2, y2) = (x.clone(), y.clone());
        let b_side = std::thread::spawn(move || duplex(&mut b, &y2, x2.len()));
        let at_a = duplex(&mut a, &x, y.len());
        assert!(b_side.join().unwrap() == x && at_a == y, "case {case}: {n1} / {n2} bytes differ");
        assert_eq!(a.kind(), "tcp+tls");
    }
}

#[test]
fn a_record_is_never_the_plaintext() {
    let (mut a, b) = sealed_pair(EPOCH_RECORDS);
    let (_, mut raw) = (0, b.inner);
    let msg = vec![0x5au8; 100_000];
    write_all(&mut a, &msg);
    a.shutdown();
    let wire = read_to_end(&mut *raw);
    assert_eq!(wire.len(), msg.len() + 4 * (HEADER + TAG));
    assert!(!wire.windows(32).any(|w| w.iter().all(|&c| c == 0x5a)), "plaintext on the wire");
}

/// The records `a` puts on the wire for `msg`, split by their headers.
fn records_of(msg: &[u8]) -> Vec<Vec<u8>> {
    let (mut a, b) = sealed_pair(EPOCH_RECORDS);
    let mut raw = b.inner;
    write_all(&mut a, msg);
    a.shutdown();
    let wire = read_to_end(&mut *raw);
    let mut out = Vec::new();
    let mut at = 0;
    while at < wire.len() {
        let body = body_len(&wire[at..at + HEADER]).unwrap();
        out.push(wire[at..at + HEADER + body].to_vec());
        at += HEADER + body;
    }
    out
}

/// Delivers `wire` to a fresh receiver with `a`'s keys; returns what it read before the
/// error, and the error (`None` if the stream ended cleanly).
fn deliver(wire: &[u8]) -> (Vec<u8>, Option<io::Error>) {
    let (mut raw, b) = tcp_pair();
    let mut rx = Sealed::new(b, 0, Direction::new(&S2).unwrap(), Direction::new(&S1).unwrap());
    let wire = wire.to_vec();
    let writer = std::thread::spawn(move || {
        write_all(&mut *raw, &wire);
        raw.shutdown();
        raw
    });
    let mut got = Vec::new();
    let mut buf = vec![0u8; 50_000];
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let err = loop {
        assert!(std::time::Instant::now() < deadline, "no end");
        match rx.try_read(&mut [&mut buf]) {
            Ok(0) => break None,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                crate::transport::testutil::sleep_on(&mut rx, true, false)
            }
            Err(e) => break Some(e),
        }
    };
    // After an error, every call repeats it.
    if err.is_some() {
        assert!(rx.try_read(&mut [&mut buf]).is_err() && rx.peek(&mut buf).is_err());
    }
    let _ = writer.join();
    (got, err)
}

#[test]
fn tampering_ends_in_an_error_after_a_correct_prefix() {
    let msg = random_bytes(5 * MAX_PLAIN + 1234, 7);
    let recs = records_of(&msg);
    assert_eq!(recs.len(), 6);
    let join = |r: &[Vec<u8>]| r.concat();
    // Untouched, it reads back whole.
    let (got, err) = deliver(&join(&recs));
    assert!(err.is_none() && got == msg);
    let mut cases: Vec<(&str, Vec<u8>)> = Vec::new();
    let mut flipped = recs.clone();
    flipped[2][HEADER + 100] ^= 1;
    cases.push(("a flipped byte", join(&flipped)));
    let mut tag = recs.clone();
    let last = tag[1].len() - 1;
    tag[1][last] ^= 0x80;
    cases.push(("a flipped tag", join(&tag)));
    let mut header = recs.clone();
    header[3][0] = 0x16;
    cases.push(("a changed record type", join(&header)));
    let mut replayed = recs.clone();
    replayed.insert(3, recs[2].clone());
    cases.push(("a replayed record", join(&replayed)));
    let mut reordered = recs.clone();
    reordered.swap(1, 2);
    cases.push(("two records swapped", join(&reordered)));
    let mut dropped = recs.clone();
    dropped.remove(2);
    cases.push(("a dropped record", join(&dropped)));
    let mut cut = join(&recs);
    cut.truncate(cut.len() - 10);
    cases.push(("a stream cut inside a record", cut));
    for (what, wire) in cases {
        let (got, err) = deliver(&wire);
        let err = err.unwrap_or_else(|| panic!("{what}: no error"));
        assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{what}: {err}");
        assert!(err.to_string().contains("rank 0"), "{what}: the error names the link: {err}");
        assert!(got.len() < msg.len() && got[..] == msg[..got.len()], "{what}: wrong data before the error");
    }
}

#[test]
fn a_write_reports_bytes_only_once_their_records_are_out() {
    // The receiver does not read: the sender's socket fills, and `try_write` must stop
    // counting at what is out, with the rest presented again later.
    let (mut a, mut b) = sealed_pair(EPOCH_RECORDS);
    let msg = random_bytes(16 << 20, 3);
    let mut sent = 0;
    let mut blocked = 0;
    while sent < msg.len() && blocked < 3 {
        match a.try_write(&[&msg[sent..]]) {
            Ok(n) => sent += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => blocked += 1,
            Err(e) => panic!("{e}"),
        }
    }
    assert!(sent < msg.len(), "16 MiB did not fill the socket buffers");
    let reader = std::thread::spawn(move || {
        let mut got = vec![0u8; 16 << 20];
        crate::transport::testutil::read_exact(&mut b, &mut got);
        got
    });
    write_all(&mut a, &msg[sent..]);
    assert!(reader.join().unwrap() == msg);
}
