//! Frames on the wire: the 40-byte header (magic, kind, step, payload length and the
//! operation's [`Fingerprint`]), its encoding and validation, and abort frames.

use std::io;
use std::time::{Duration, Instant};

use super::{ABORT_SEND_BUDGET, Link};
use crate::collective::{FINGERPRINT_LEN, Fingerprint};
use crate::error::Error;

/// "TRD1" little-endian.
pub(crate) const MAGIC: u32 = u32::from_le_bytes(*b"TRD1");
pub(crate) const KIND_DATA: u8 = 1;
pub(crate) const KIND_ABORT: u8 = 2;
/// Size of a frame header on the wire.
pub const HEADER_LEN: usize = 40;
/// Longest abort reason carried on the wire.
pub(crate) const MAX_REASON: usize = 2048;

/// A decoded frame header.
#[derive(Debug, Clone)]
pub(crate) struct Header {
    pub(crate) kind: u8,
    pub(crate) fp: Result<Fingerprint, String>,
    pub(crate) step: u16,
    pub(crate) len: u32,
}

/// Where the fingerprint starts in a frame header.
pub(crate) const FP_AT: usize = HEADER_LEN - FINGERPRINT_LEN;

/// A frame header.
pub(crate) fn encode(kind: u8, fp: &Fingerprint, step: u16, len: u32) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    h[4] = kind;
    h[6..8].copy_from_slice(&step.to_le_bytes());
    h[8..12].copy_from_slice(&len.to_le_bytes());
    h[FP_AT..].copy_from_slice(&fp.encode());
    h
}

/// Sets the payload length of an encoded header (one header is reused for every frame of a
/// step).
pub(super) fn set_len(h: &mut [u8; HEADER_LEN], len: u32) {
    h[8..12].copy_from_slice(&len.to_le_bytes());
}

/// Decodes a frame header; the error says what is wrong with it.
pub(crate) fn decode(h: &[u8; HEADER_LEN]) -> std::result::Result<Header, String> {
    let magic = u32::from_le_bytes([h[0], h[1], h[2], h[3]]);
    if magic != MAGIC {
        return Err(format!("bad frame magic {magic:#010x}"));
    }
    let kind = h[4];
    if kind != KIND_DATA && kind != KIND_ABORT {
        return Err(format!("unknown frame kind {kind}"));
    }
    let mut fp = [0u8; FINGERPRINT_LEN];
    fp.copy_from_slice(&h[FP_AT..]);
    Ok(Header {
        kind,
        fp: Fingerprint::decode(&fp),
        step: u16::from_le_bytes([h[6], h[7]]),
        len: u32::from_le_bytes([h[8], h[9], h[10], h[11]]),
    })
}

/// Reads the reason of an abort frame from `peer` and returns the error to report.
///
/// `header_consumed` says whether the header was already read (or only peeked); `already` holds
/// the reason bytes read together with it.
pub(super) fn read_abort(
    link: &mut Link,
    peer: usize,
    header_consumed: bool,
    already: &[u8],
    len: usize,
) -> Error {
    let len = len.min(MAX_REASON);
    let skip = if header_consumed { 0 } else { HEADER_LEN };
    let mut reason = already[..already.len().min(len)].to_vec();
    let mut buf = vec![0u8; skip + len - reason.len()];
    let deadline = Instant::now() + ABORT_SEND_BUDGET;
    let mut got = 0;
    while got < buf.len() && Instant::now() < deadline {
        match link.transport.try_read(&mut [&mut buf[got..]]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(1)),
            Err(_) => break,
        }
    }
    if got == buf.len() {
        reason.extend_from_slice(&buf[skip..]);
        let text = String::from_utf8_lossy(&reason);
        let msg = format!("rank {peer} aborted: {text}");
        // A revoke is no failure of the peer: every rank reports it as aborted, as the rank
        // that revoked does (relayed by a rank that learnt of it first, too).
        if text.contains(super::abort::REVOKED) {
            Error::Aborted(msg.into()).with_peer(peer)
        } else {
            Error::Remote(msg.into()).with_peer(peer)
        }
    } else {
        Error::Remote(format!("rank {peer} aborted (its reason did not arrive)").into()).with_peer(peer)
    }
}

/// Number of frames for `total` bytes (a step with no bytes still sends one empty frame, so
/// every step carries a fingerprint).
pub(super) fn frame_len(total: usize, start: usize, segment: usize) -> usize {
    (total - start).min(segment)
}

#[cfg(test)]
mod tests {
    //! Frames that fail validation, sent by a hand-driven peer over a real TCP connection.
    use super::super::*;
    use super::*;
    use crate::transport::tcp::{Interface, MeshSpec, connect_mesh, listen};
    use std::net::{IpAddr, Ipv4Addr, SocketAddr};

    fn fingerprint(seq: u64, count: u64) -> Fingerprint {
        Fingerprint {
            seq,
            kind: CollKind::AllReduce,
            dtype: DataType::F32,
            op: ReduceOp::Sum,
            count,
            root: -1,
            algo: 1,
        }
    }

    /// Rank 1 receives 64 bytes at step 3 of `fingerprint(5, 16)` while rank 0 writes `wire`
    /// (raw bytes) and closes; returns what rank 1 received.
    fn receive_after(wire: Vec<u8>) -> Result<Vec<u8>> {
        let iface = Interface { name: "lo".into(), addr: IpAddr::V4(Ipv4Addr::LOCALHOST) };
        let eps: Vec<_> = (0..2).map(|_| listen(&iface, 2).expect("listening on loopback")).collect();
        let addrs: Vec<SocketAddr> = eps.iter().map(|e| e.addr).collect();
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut handles: Vec<_> = eps
            .into_iter()
            .enumerate()
            .map(|(r, ep)| {
                let addrs = addrs.clone();
                std::thread::spawn(move || {
                    connect_mesh(
                        &MeshSpec { rank: r, addrs: &addrs, comm_id: 7, lanes: &[1, 1], auth: None },
                        &ep,
                        Vec::new(),
                        &Default::default(),
                        deadline,
                    )
                    .expect("mesh")
                })
            })
            .collect();
        let mut mesh1 = handles.pop().expect("two").join().expect("rank 1 connects");
        let mut mesh0 = handles.pop().expect("two").join().expect("rank 0 connects");
        let writer = std::thread::spawn(move || {
            let t = mesh0[1].as_mut().expect("link to rank 1");
            let mut at = 0;
            while at < wire.len() {
                match t.try_write(&[&wire[at..]]) {
                    Ok(n) => at += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::yield_now(),
                    Err(e) => panic!("writing: {e}"),
                }
            }
            drop(mesh0);
        });
        let spin = SpinPolicy { spin: Duration::from_micros(50), yield_between: true };
        let mut peers = Peers::new(1, std::mem::take(&mut mesh1), AbortSignal::new()?.into(), spin, 1 << 16);
        peers.begin_op();
        let mut out = vec![0u8; 64];
        let fp = fingerprint(5, 16);
        let r = peers.exchange(&fp, 3, deadline, None, Some((0, Sink::Copy(&mut out))));
        writer.join().expect("writer");
        r.map(|()| out)
    }

    fn frame(fp: &Fingerprint, step: u16, payload: &[u8]) -> Vec<u8> {
        let mut v = encode(KIND_DATA, fp, step, payload.len() as u32).to_vec();
        v.extend_from_slice(payload);
        v
    }

    fn message(r: Result<Vec<u8>>) -> String {
        match r {
            Ok(_) => panic!("a bad frame was accepted"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn headers_round_trip_with_their_length_step_and_fingerprint() {
        let fp = fingerprint(9, 1 << 33);
        let mut h = encode(KIND_DATA, &fp, 513, 0);
        set_len(&mut h, 524_288);
        let d = decode(&h).expect("a valid header");
        assert_eq!((d.kind, d.step, d.len), (KIND_DATA, 513, 524_288));
        assert_eq!(d.fp, Ok(fp));
    }

    #[test]
    fn a_well_formed_frame_is_received() {
        let payload: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(37)).collect();
        let got = receive_after(frame(&fingerprint(5, 16), 3, &payload)).expect("a valid frame");
        assert_eq!(got, payload);
    }

    #[test]
    fn bad_magic_is_a_bad_frame_error() {
        let mut wire = frame(&fingerprint(5, 16), 3, &[7u8; 64]);
        wire[0] ^= 0xff;
        let m = message(receive_after(wire));
        assert!(m.contains("bad frame") && m.contains("magic"), "{m}");
    }

    #[test]
    fn unknown_kind_and_undecodable_fields_are_bad_frames() {
        let mut wire = frame(&fingerprint(5, 16), 3, &[7u8; 64]);
        wire[4] = 77;
        let m = message(receive_after(wire));
        assert!(m.contains("unknown frame kind 77"), "{m}");
        let mut wire = frame(&fingerprint(5, 16), 3, &[7u8; 64]);
        wire[FP_AT + 1] = 200; // no such data type
        let m = message(receive_after(wire));
        assert!(m.contains("undecodable"), "{m}");
    }

    #[test]
    fn another_collective_is_a_mismatch_naming_both() {
        let m = message(receive_after(frame(&fingerprint(5, 17), 3, &[7u8; 68])));
        assert!(m.contains("collective mismatch"), "{m}");
        assert!(m.contains("rank 1 called all_reduce #5 (16 x float"), "{m}");
        assert!(m.contains("rank 0 called all_reduce #5 (17 x float"), "{m}");
    }

    #[test]
    fn wrong_step_or_length_is_out_of_step() {
        let m = message(receive_after(frame(&fingerprint(5, 16), 4, &[7u8; 64])));
        assert!(m.contains("out of step"), "{m}");
        let m = message(receive_after(frame(&fingerprint(5, 16), 3, &[7u8; 32])));
        assert!(m.contains("out of step"), "{m}");
    }

    #[test]
    fn a_truncated_frame_then_close_is_a_remote_error() {
        let mut wire = frame(&fingerprint(5, 16), 3, &[7u8; 64]);
        wire.truncate(HEADER_LEN + 10);
        let r = receive_after(wire);
        assert!(matches!(r, Err(Error::Remote(_))), "{r:?}");
        assert!(message(r).contains("closed its connection"));
    }
}
