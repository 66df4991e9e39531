//! The RDMA ring over the in-memory fake of the verbs: streams, credits, failures, bounds.

use std::time::{Duration, Instant};

use super::fake::{FakeControl, FakeVerbs};
use super::verbs::{MrCache, QpInfo, Region, RemoteRegion, Verbs, WriteImm};
use super::write_ring::{Geometry, RdmaRing, RingInfo};
use crate::error::Error;
use crate::transport::testutil::{Rng, bytes};

/// Two connected rings over a fake queue pair (ring `a` is rank 0's, towards rank 1).
pub(super) fn pair(geo: Geometry) -> (RdmaRing<FakeVerbs>, RdmaRing<FakeVerbs>, FakeControl) {
    let (va, vb, ctl) = FakeVerbs::pair(geo.send_depth());
    let mut a = RdmaRing::new(va, 1, geo).expect("ring a");
    let mut b = RdmaRing::new(vb, 0, geo).expect("ring b");
    // Exchanged as bytes, as through the store.
    let (ia, ib) = (a.info().encode(), b.info().encode());
    a.connect(&RingInfo::decode(&ib).expect("b's info")).expect("connect a");
    b.connect(&RingInfo::decode(&ia).expect("a's info")).expect("connect b");
    (a, b, ctl)
}

/// The bounds every state must keep: nothing beyond the ring, from either side's view.
fn check_bounds(a: &RdmaRing<FakeVerbs>, b: &RdmaRing<FakeVerbs>, geo: Geometry, ctx: &str) {
    for (x, y) in [(a, b), (b, a)] {
        let (tx, rx) = (x.send_ledger(), y.recv_ledger());
        assert!(tx.in_flight() <= geo.slots && tx.free() <= geo.slots, "{ctx}");
        assert!(rx.available() <= geo.slots, "{ctx}");
        assert!(rx.head() <= tx.head() && tx.head() - rx.tail() <= geo.slots as u64, "{ctx}");
        assert!(x.send_queue_used() <= geo.send_depth(), "{ctx}");
    }
}

/// Frames of random sizes both ways through one thread that pumps both ends without
/// blocking; every frame arrives byte-exact and in order.
fn random_frames(seed: u64, geo: Geometry, frames: usize, delay: Option<Duration>, hold: bool) {
    let (mut a, mut b, ctl) = pair(geo);
    if let Some(d) = delay {
        ctl.set_delay(d);
    }
    ctl.hold_send_completions(hold);
    let mut rng = Rng(seed);
    let b_ = geo.slot_bytes;
    let sizes = [0, 1, b_ - 1, b_, b_ + 1, 3 * b_ + 7, geo.bytes(), geo.bytes() + 5];
    // Per direction: the stream to send (frames back to back) and how much was sent/received.
    let plan = |rng: &mut Rng| -> Vec<Vec<u8>> {
        let mut at = 0u64;
        (0..frames)
            .map(|_| {
                let n = if rng.upto(3) == 0 { sizes[rng.upto(sizes.len() - 1)] } else { rng.upto(2 * b_) };
                let f = bytes(at, n);
                at += n as u64;
                f
            })
            .collect()
    };
    let (fa, fb) = (plan(&mut rng), plan(&mut rng));
    let want = |f: &Vec<Vec<u8>>| f.concat();
    let (wa, wb) = (want(&fa), want(&fb));
    let (mut sent, mut got) = ([0usize; 2], [Vec::new(), Vec::new()]);
    let (mut frame, mut off) = ([0usize; 2], [0usize; 2]);
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut step = 0;
    while got[0].len() < wb.len() || got[1].len() < wa.len() {
        step += 1;
        assert!(Instant::now() < deadline, "seed {seed}: stuck at step {step}");
        if hold && step % 50 == 0 {
            // Let the held send completions go now and then (the send queue would fill).
            ctl.hold_send_completions(false);
            ctl.hold_send_completions(true);
        }
        for (side, (ring, frames)) in [(&mut a, &fa), (&mut b, &fb)].into_iter().enumerate() {
            // Write the rest of the current frame, in one or two pieces (vectored).
            if frame[side] < frames.len() {
                let f = &frames[frame[side]][off[side]..];
                let cut = rng.upto(f.len());
                let n = ring.write(&[&f[..cut], &f[cut..]]).expect("write");
                off[side] += n;
                sent[side] += n;
                if off[side] == frames[frame[side]].len() {
                    (frame[side], off[side]) = (frame[side] + 1, 0);
                }
            }
            // Read a random amount into one or two buffers.
            let (mut x, mut y) = (vec![0u8; rng.upto(2 * b_)], vec![0u8; rng.upto(b_)]);
            let n = ring.read(&mut [&mut x, &mut y]).expect("read");
            let both = [x, y].concat();
            got[side].extend_from_slice(&both[..n]);
        }
        check_bounds(&a, &b, geo, &format!("seed {seed}, step {step}"));
    }
    assert!(got[1] == wa && got[0] == wb, "seed {seed}: streams differ");
    assert!(ctl.max_in_flight(0) <= geo.slots && ctl.max_in_flight(1) <= geo.slots);
    // End of stream after the data.
    a.shutdown().expect("shutdown");
    let mut buf = [0u8; 8];
    while !b.at_end() {
        assert_eq!(b.read(&mut [&mut buf]).expect("read"), 0);
        assert!(Instant::now() < deadline);
    }
}

#[test]
fn random_frames_arrive_byte_exact_and_in_order_both_ways() {
    random_frames(1, Geometry { slots: 4, slot_bytes: 64 }, 300, None, false);
    random_frames(2, Geometry { slots: 1, slot_bytes: 16 }, 200, None, false);
    random_frames(3, Geometry { slots: 16, slot_bytes: 1000 }, 200, None, false);
    random_frames(4, Geometry { slots: 8, slot_bytes: 1 }, 100, None, false);
}

#[test]
fn writes_that_land_late_and_credits_before_the_local_completion_change_nothing() {
    random_frames(5, Geometry { slots: 4, slot_bytes: 128 }, 100, Some(Duration::from_micros(300)), false);
    random_frames(6, Geometry { slots: 8, slot_bytes: 64 }, 200, None, true);
}

#[test]
fn a_writer_without_credits_times_out_naming_the_peer_and_resumes_when_credits_return() {
    let geo = Geometry { slots: 4, slot_bytes: 32 };
    let (mut a, mut b, _ctl) = pair(geo);
    let data = bytes(0, geo.bytes() + 10);
    // Every slot fills; the rest waits for credits.
    assert_eq!(a.write(&[&data]).expect("write"), geo.bytes());
    assert_eq!(a.write(&[&data[geo.bytes()..]]).expect("write"), 0);
    assert_eq!(a.send_ledger().free(), 0);
    let t0 = Instant::now();
    let e = a.write_all(&data[geo.bytes()..], t0 + Duration::from_millis(50)).expect_err("no credits");
    assert!(t0.elapsed() >= Duration::from_millis(50));
    assert!(matches!(e, Error::Timeout(_)), "{e}");
    assert_eq!(e.peer(), Some(1));
    assert!(e.to_string().contains("rank 1") && e.to_string().contains("no credits"), "{e}");
    // The reader takes one slot and part of the next: one credit goes back.
    let mut buf = vec![0u8; 40];
    assert_eq!(b.read(&mut [&mut buf]).expect("read"), 40);
    assert_eq!(buf, data[..40]);
    assert_eq!(a.write(&[&data[geo.bytes()..]]).expect("write"), 10, "resumed with one slot");
    // Then everything flows; the rest arrives in order.
    let mut rest = vec![0u8; data.len() - 40];
    b.read_exact(&mut rest, Instant::now() + Duration::from_secs(10)).expect("read_exact");
    assert_eq!(rest, data[40..]);
    // A reader waiting for bytes that never come times out naming the peer too.
    let e = b.read_exact(&mut [0u8; 1], Instant::now() + Duration::from_millis(20)).expect_err("nothing");
    assert!(matches!(e, Error::Timeout(_)) && e.peer() == Some(0), "{e}");
}

#[test]
fn a_failed_write_is_an_error_on_both_sides() {
    let geo = Geometry { slots: 4, slot_bytes: 32 };
    let (mut a, mut b, ctl) = pair(geo);
    a.write_all(b"before", Instant::now() + Duration::from_secs(5)).expect("write");
    ctl.fail_next_write(0);
    a.write(&[b"lost"]).expect("posted");
    let e = a.progress().expect_err("a's write failed");
    assert!(matches!(e, Error::Remote(_)) && e.peer() == Some(1), "{e}");
    assert!(e.to_string().contains("remote access error"), "{e}");
    // The peer's queue pair went to the error state: its receives are flushed.
    let mut buf = [0u8; 16];
    let e = b.read_exact(&mut buf, Instant::now() + Duration::from_secs(5)).expect_err("b fails");
    assert!(matches!(e, Error::Remote(_)) && e.peer() == Some(0), "{e}");
    assert!(e.to_string().contains("Flushed"), "{e}");
    // Both stay failed.
    assert!(a.write(&[b"x"]).is_err() && b.read(&mut [&mut buf]).is_err());
}

#[test]
fn a_peer_that_is_gone_fails_the_writer_and_the_reader_once_its_bytes_are_read() {
    let geo = Geometry { slots: 2, slot_bytes: 16 };
    let (mut a, b, _ctl) = pair(geo);
    drop(b);
    let e = a.write_all(&[7u8; 40], Instant::now() + Duration::from_secs(5)).expect_err("peer gone");
    assert!(e.to_string().contains("retry counter exceeded") && e.peer() == Some(1), "{e}");
    let (mut a, mut b, _ctl) = pair(geo);
    // Two slots' worth, then the writer goes.
    a.write_all(b"abcdefghijklmnopqrst", Instant::now() + Duration::from_secs(5)).expect("write");
    drop(a);
    let mut first = [0u8; 16];
    b.read_exact(&mut first, Instant::now() + Duration::from_secs(5)).expect("data before the loss");
    assert_eq!(&first, b"abcdefghijklmnop");
    // The credit for the first slot failed, yet the second slot, which arrived before, is read.
    let mut buf = [0u8; 4];
    b.read_exact(&mut buf, Instant::now() + Duration::from_secs(5)).expect("the rest");
    assert_eq!(&buf, b"qrst");
    // Its credits cannot reach the peer and nothing is left: the next wait fails at once.
    let e = b.read_exact(&mut buf, Instant::now() + Duration::from_secs(5)).expect_err("peer gone");
    assert!(matches!(e, Error::Remote(_)) && e.peer() == Some(0), "{e}");
    assert!(e.to_string().contains("retry counter exceeded"), "{e}");
}

#[test]
fn two_threads_stream_through_a_delayed_pair() {
    let geo = Geometry { slots: 8, slot_bytes: 4096 };
    let (mut a, mut b, ctl) = pair(geo);
    ctl.set_delay(Duration::from_micros(50));
    let total = 3 * geo.bytes() + 123;
    let data = bytes(0, total);
    std::thread::scope(|s| {
        s.spawn(|| {
            let deadline = Instant::now() + Duration::from_secs(60);
            for chunk in data.chunks(5000) {
                a.write_all(chunk, deadline).expect("write");
            }
            let mut back = vec![0u8; 100];
            a.read_exact(&mut back, deadline).expect("reply");
            assert_eq!(back, bytes(7, 100));
        });
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut got = vec![0u8; total];
        b.read_exact(&mut got, deadline).expect("read");
        assert!(got == data, "stream differs");
        b.write_all(&bytes(7, 100), deadline).expect("reply");
    });
}

/// A raw fake endpoint as a misbehaving peer of a ring.
fn ring_and_raw_peer(geo: Geometry) -> (RdmaRing<FakeVerbs>, FakeVerbs, Region, RemoteRegion) {
    let (va, mut raw, _ctl) = FakeVerbs::pair(64);
    let mut a = RdmaRing::new(va, 3, geo).expect("ring");
    let mut mem = vec![0u8; 4 * geo.bytes()].into_boxed_slice();
    // SAFETY: leaked below, so it outlives the registration.
    let region = unsafe { raw.register(mem.as_mut_ptr(), mem.len()) }.expect("register");
    std::mem::forget(mem);
    raw.connect(&a.info().qp).expect("connect raw");
    let raw_info = RingInfo {
        qp: raw.local_qp(),
        ring: RemoteRegion { addr: region.addr, len: geo.bytes(), rkey: region.rkey },
        geometry: geo,
    };
    a.connect(&raw_info).expect("connect ring");
    for i in 0..64 {
        raw.post_recv(super::write_ring::RECV_TAG | i).expect("recv");
    }
    let remote = a.info().ring;
    (a, raw, region, remote)
}

#[test]
fn a_peer_that_breaks_the_protocol_is_an_error_naming_it() {
    let geo = Geometry { slots: 2, slot_bytes: 8 };
    let data = |n: u32| n;
    // More writes than credits.
    let (mut a, mut raw, region, remote) = ring_and_raw_peer(geo);
    for i in 0..3u64 {
        raw.post_write_imm(
            i,
            WriteImm {
                local: &region,
                offset: 0,
                len: 8,
                remote: &remote,
                remote_offset: (i as usize % 2) * 8,
                imm: data(8),
            },
        )
        .expect("post");
    }
    let e = a.read(&mut [&mut [0u8; 64]]).expect_err("past the credits");
    assert!(e.to_string().contains("beyond the credits") && e.peer() == Some(3), "{e}");
    // A length that does not fit a slot, or disagrees with the bytes written.
    for (len, announced) in [(8, 9u32), (4, 8), (0, 0)] {
        let (mut a, mut raw, region, remote) = ring_and_raw_peer(geo);
        raw.post_write_imm(
            0,
            WriteImm { local: &region, offset: 0, len, remote: &remote, remote_offset: 0, imm: announced },
        )
        .expect("post");
        let e = a.read(&mut [&mut [0u8; 64]]).expect_err("bad length");
        assert!(e.to_string().contains("announced"), "{e}");
    }
    // Data after close.
    let (mut a, mut raw, region, remote) = ring_and_raw_peer(geo);
    raw.post_write_imm(
        0,
        WriteImm { local: &region, offset: 0, len: 0, remote: &remote, remote_offset: 0, imm: 2 << 30 },
    )
    .expect("close");
    raw.post_write_imm(
        1,
        WriteImm { local: &region, offset: 0, len: 4, remote: &remote, remote_offset: 0, imm: 4 },
    )
    .expect("data");
    let e = a.read(&mut [&mut [0u8; 64]]).expect_err("data after close");
    assert!(e.to_string().contains("after it closed"), "{e}");
    // Credits for slots never sent, and an unknown kind.
    for imm in [(1 << 30) | 1, 3 << 30] {
        let (mut a, mut raw, region, remote) = ring_and_raw_peer(geo);
        raw.post_write_imm(
            0,
            WriteImm { local: &region, offset: 0, len: 0, remote: &remote, remote_offset: 0, imm },
        )
        .expect("post");
        let e = a.progress().expect_err("bad immediate");
        assert!(matches!(e, Error::Remote(_)) && e.peer() == Some(3), "{e}");
    }
}

#[test]
fn ring_info_round_trips_and_bad_descriptions_are_refused() {
    let geo = Geometry { slots: 16, slot_bytes: 65536 };
    let info = RingInfo {
        qp: QpInfo { qpn: 0x1234, psn: 77, lid: 9, gid: [3; 16], mtu: 5 },
        ring: RemoteRegion { addr: 0x7f00_0000_1000, len: geo.bytes(), rkey: 0xabcd },
        geometry: geo,
    };
    let b = info.encode();
    assert_eq!(RingInfo::decode(&b).expect("decode"), info);
    let bad = |f: &dyn Fn(&mut [u8; RingInfo::LEN])| {
        let mut c = b;
        f(&mut c);
        RingInfo::decode(&c).expect_err("refused").to_string()
    };
    assert!(bad(&|c| c[0] = b'X').contains("magic"));
    assert!(bad(&|c| c[4] = 9).contains("version"));
    assert!(bad(&|c| c[6] = 0).contains("MTU"));
    assert!(bad(&|c| c[56..60].copy_from_slice(&3u32.to_le_bytes())).contains("power of two"));
    assert!(bad(&|c| c[44..52].copy_from_slice(&1u64.to_le_bytes())).contains("a ring of 1 bytes"));
    assert!(bad(&|c| c[36..44].copy_from_slice(&u64::MAX.to_le_bytes())).contains("a ring of"));
    assert!(RingInfo::decode(&b[..10]).is_err());
    // Mismatched geometry at connect.
    let (va, _vb, _ctl) = FakeVerbs::pair(64);
    let mut a = RdmaRing::new(va, 1, Geometry { slots: 4, slot_bytes: 64 }).expect("ring");
    let e = a.connect(&info).expect_err("geometry");
    assert!(matches!(e, Error::InvalidUsage(_)) && e.to_string().contains("rank 1"), "{e}");
}

#[test]
fn the_registration_cache_registers_a_buffer_once() {
    let (mut v, _w, _ctl) = FakeVerbs::pair(8);
    let mut mem = vec![0u8; 4096];
    let p = mem.as_mut_ptr();
    let mut cache = MrCache::new();
    // SAFETY: `mem` outlives the cache's registrations (cleared below).
    let (r1, r2) = unsafe {
        (cache.get(&mut v, p, 4096).expect("reg"), cache.get(&mut v, p.add(100), 50).expect("hit"))
    };
    assert_eq!((r1, cache.len()), (r2, 1));
    cache.evict(&mut v, p.wrapping_add(4000), 10);
    assert!(cache.is_empty());
    // SAFETY: as above.
    let r3 = unsafe { cache.get(&mut v, p, 64) }.expect("registered again");
    assert_ne!(r3.lkey, r1.lkey);
    cache.clear(&mut v);
    assert!(cache.is_empty());
}
