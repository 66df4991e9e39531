//! The record layer of an encrypted link: [`Sealed`], a [`Transport`] that carries the byte
//! stream of another transport as AES-128-GCM records, with the keys a TLS 1.3 handshake
//! exported ([`super::tls`]).
//!
//! A record on the wire is TLS 1.3's application-data record (RFC 8446 section 5.2) without
//! the inner content type: a 5-byte header (`0x17`, `0x03 0x03`, the length of what follows,
//! big-endian), the ciphertext, a 16-byte tag. The header is the additional data; the nonce
//! is the direction's IV XOR the record's sequence number (section 5.3), counted by both ends
//! and never sent. So a record flipped, dropped, replayed, reordered or cut short fails its tag
//! or the stream's framing, and the link returns an error from then on: never other data.
//!
//! Records carry up to [`MAX_PLAIN`] bytes, 4x TLS's 16 KiB: fewer tags and headers for the
//! same bytes, one `sendmsg` for up to [`OUT_RECORDS`] records. AES-GCM keys wear out: after
//! 2^24 records in one direction (RFC 8446 section 5.5 allows 2^24.5 of 16 KiB; ours are larger,
//! so fewer) both ends move to the next key epoch, derived from the direction's exported
//! secret with HKDF-SHA256 (RFC 5869) and the epoch's number.
//!
//! Writing keeps the [`Transport`] contract exactly: `try_write` reports bytes written only
//! once their records are in the inner transport, so a caller that stops writing never leaves
//! records behind. A record that went out in part holds the bytes it carries; they are reported
//! when the rest goes, and the caller presents them again meanwhile (every caller does: a
//! stream only moves forward).

use std::io;
use std::os::fd::RawFd;

use aws_lc_rs::aead::{AES_128_GCM, Aad, LessSafeKey, Nonce, UnboundKey};
use aws_lc_rs::hkdf;

use crate::sys::poll::Events;
use crate::transport::Transport;

/// The record header: type, legacy version, length of ciphertext and tag.
pub const HEADER: usize = 5;
/// The AES-GCM tag.
pub const TAG: usize = 16;
/// Most plaintext bytes in one record.
pub const MAX_PLAIN: usize = 32 << 10;
/// Most bytes of one record on the wire.
pub const MAX_RECORD: usize = HEADER + MAX_PLAIN + TAG;
/// Records sealed before they are handed to the inner transport together.
pub const OUT_RECORDS: usize = 4;
/// Records of one direction under one key (RFC 8446 section 5.5).
const EPOCH_RECORDS: u64 = 1 << 24;
const RECORD_TYPE: u8 = 0x17;
const LEGACY_VERSION: [u8; 2] = [0x03, 0x03];

/// Bytes of a direction's secret exported by the handshake.
pub const SECRET_LEN: usize = 32;

/// An HKDF output length.
struct Len(usize);

impl hkdf::KeyType for Len {
    fn len(&self) -> usize {
        self.0
    }
}

/// One direction's key schedule: the secret, the key and IV of the current epoch, and the
/// sequence number of the next record.
pub struct Direction {
    secret: hkdf::Prk,
    epoch: u64,
    seq: u64,
    /// Records per key: [`EPOCH_RECORDS`] (fewer in tests).
    epoch_records: u64,
    key: LessSafeKey,
    iv: [u8; 12],
}

impl std::fmt::Debug for Direction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the keys.
        f.debug_struct("Direction")
            .field("epoch", &self.epoch)
            .field("seq", &self.seq)
            .finish_non_exhaustive()
    }
}

impl Direction {
    /// The schedule of a direction whose exported secret is `secret`, at epoch 0.
    pub fn new(secret: &[u8; SECRET_LEN]) -> io::Result<Direction> {
        let secret = hkdf::Prk::new_less_safe(hkdf::HKDF_SHA256, secret);
        let (key, iv) = epoch_keys(&secret, 0)?;
        Ok(Direction { secret, epoch: 0, seq: 0, epoch_records: EPOCH_RECORDS, key, iv })
    }

    /// The same with `n` records per key (tests reach the next epoch with few records).
    #[cfg(test)]
    fn with_epoch_records(secret: &[u8; SECRET_LEN], n: u64) -> Direction {
        let mut d = Direction::new(secret).unwrap();
        d.epoch_records = n;
        d
    }

    /// The nonce of the next record, moving to the next epoch's keys when this one is used up.
    fn next_nonce(&mut self) -> io::Result<Nonce> {
        if self.seq == self.epoch_records {
            self.epoch += 1;
            (self.key, self.iv) = epoch_keys(&self.secret, self.epoch)?;
            self.seq = 0;
        }
        let mut n = self.iv;
        for (b, s) in n[4..].iter_mut().zip(self.seq.to_be_bytes()) {
            *b ^= s;
        }
        self.seq += 1;
        Ok(Nonce::assume_unique_for_key(n))
    }

    /// Seals `plain` (gathered from the slices) into `out` as one record; returns its length.
    /// `out` holds at least [`MAX_RECORD`] bytes and `plain` at most [`MAX_PLAIN`]. A record
    /// from one slice is encrypted straight from it; one gathered from several is copied
    /// first and encrypted in place.
    pub fn seal(&mut self, plain: &[&[u8]], len: usize, out: &mut [u8]) -> io::Result<usize> {
        let body = len + TAG;
        let header = header_of(body);
        out[..HEADER].copy_from_slice(&header);
        let nonce = self.next_nonce()?;
        let failed = |_| io::Error::other("AES-GCM sealing failed");
        let (text, tag) = out[HEADER..HEADER + body].split_at_mut(len);
        if let [one] = plain {
            self.key
                .seal_out_of_place_scatter(nonce, Aad::from(header), one, text, &[], tag)
                .map_err(failed)?;
        } else {
            let mut at = 0;
            for p in plain {
                crate::reduce::copy(&mut text[at..at + p.len()], p);
                at += p.len();
            }
            let t = self.key.seal_in_place_separate_tag(nonce, Aad::from(header), text).map_err(failed)?;
            tag.copy_from_slice(t.as_ref());
        }
        Ok(HEADER + body)
    }

    /// Opens the record `rec` (header included) in place; returns the plaintext's length (it
    /// starts at [`HEADER`]). `None`: the tag does not match.
    pub fn open(&mut self, rec: &mut [u8]) -> io::Result<Option<usize>> {
        let header: [u8; HEADER] = rec[..HEADER].try_into().map_err(|_| io::Error::other("short record"))?;
        let nonce = self.next_nonce()?;
        Ok(self.key.open_in_place(nonce, Aad::from(header), &mut rec[HEADER..]).ok().map(|p| p.len()))
    }

    /// Opens the record `rec` (header included) into `dst`, which holds exactly its
    /// plaintext. `false`: the tag does not match (and `dst` holds garbage).
    pub fn open_into(&mut self, rec: &[u8], dst: &mut [u8]) -> io::Result<bool> {
        let header: [u8; HEADER] = rec[..HEADER].try_into().map_err(|_| io::Error::other("short record"))?;
        let (text, tag) = rec[HEADER..].split_at(rec.len() - HEADER - TAG);
        let nonce = self.next_nonce()?;
        Ok(self.key.open_separate_gather(nonce, Aad::from(header), text, tag, dst).is_ok())
    }
}

fn epoch_keys(secret: &hkdf::Prk, epoch: u64) -> io::Result<(LessSafeKey, [u8; 12])> {
    let e = epoch.to_be_bytes();
    let mut key = [0u8; 16];
    let mut iv = [0u8; 12];
    let failed = |_| io::Error::other("HKDF expansion failed");
    secret.expand(&[b"toroid link key", &e], Len(16)).map_err(failed)?.fill(&mut key).map_err(failed)?;
    secret.expand(&[b"toroid link iv", &e], Len(12)).map_err(failed)?.fill(&mut iv).map_err(failed)?;
    let key = UnboundKey::new(&AES_128_GCM, &key).map_err(|_| io::Error::other("bad AES-128-GCM key"))?;
    Ok((LessSafeKey::new(key), iv))
}

fn header_of(body: usize) -> [u8; HEADER] {
    let [hi, lo] = (body as u16).to_be_bytes();
    [RECORD_TYPE, LEGACY_VERSION[0], LEGACY_VERSION[1], hi, lo]
}

/// The length of the record body that `header` announces, if it is one this layer sends.
fn body_len(header: &[u8]) -> Option<usize> {
    if header[0] != RECORD_TYPE || header[1..3] != LEGACY_VERSION {
        return None;
    }
    let body = usize::from(u16::from_be_bytes([header[3], header[4]]));
    (TAG < body && body <= MAX_PLAIN + TAG).then_some(body)
}

fn would_block() -> io::Error {
    io::ErrorKind::WouldBlock.into()
}

/// An encrypted link: records over `inner`. See the module documentation.
pub struct Sealed {
    inner: Box<dyn Transport>,
    /// The peer's rank, for errors.
    peer: usize,
    kind: &'static str,
    tx: Direction,
    rx: Direction,
    /// Sealed records not yet taken by `inner`: `out[out_at..out_end]`.
    out: Box<[u8]>,
    out_at: usize,
    out_end: usize,
    /// Bytes of the caller's stream in the records of `out` (reported once they are gone).
    unacked: usize,
    /// Received bytes: `inb[plain_at..plain_end]` opened and not yet read, then records
    /// `inb[in_at..in_end]` not yet opened.
    inb: Box<[u8]>,
    plain_at: usize,
    plain_end: usize,
    in_at: usize,
    in_end: usize,
    /// Set by the first record that fails: every later call returns it.
    failed: Option<String>,
}

impl std::fmt::Debug for Sealed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sealed").field("peer", &self.peer).field("inner", &self.inner).finish_non_exhaustive()
    }
}

impl Sealed {
    /// The link to `peer` over `inner`, sending with `tx` and receiving with `rx`.
    pub fn new(inner: Box<dyn Transport>, peer: usize, tx: Direction, rx: Direction) -> Sealed {
        let kind = match inner.kind() {
            "tcp-striped" => "tcp-striped+tls",
            _ => "tcp+tls",
        };
        Sealed {
            inner,
            peer,
            kind,
            tx,
            rx,
            out: vec![0u8; OUT_RECORDS * MAX_RECORD].into_boxed_slice(),
            out_at: 0,
            out_end: 0,
            unacked: 0,
            inb: vec![0u8; 4 * MAX_RECORD].into_boxed_slice(),
            plain_at: 0,
            plain_end: 0,
            in_at: 0,
            in_end: 0,
            failed: None,
        }
    }

    fn fail(&mut self, why: String) -> io::Error {
        let e = io::Error::new(io::ErrorKind::InvalidData, why.clone());
        self.failed = Some(why);
        e
    }

    fn check(&self) -> io::Result<()> {
        match &self.failed {
            Some(why) => Err(io::Error::new(io::ErrorKind::InvalidData, why.clone())),
            None => Ok(()),
        }
    }

    /// Hands `out` to the inner transport. `Ok(true)`: all of it is gone.
    fn flush(&mut self) -> io::Result<bool> {
        while self.out_at < self.out_end {
            match self.inner.try_write(&[&self.out[self.out_at..self.out_end]]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => self.out_at += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) => return Err(e),
            }
        }
        self.out_at = 0;
        self.out_end = 0;
        Ok(true)
    }

    /// Seals up to [`OUT_RECORDS`] records of the stream `bufs` from byte `skip` into `out`
    /// (empty); returns the stream bytes they carry.
    fn seal_from(&mut self, bufs: &[&[u8]], skip: usize) -> io::Result<usize> {
        let mut pos = (0usize, skip);
        // Skip whole slices first.
        while pos.0 < bufs.len() && pos.1 >= bufs[pos.0].len() {
            pos.1 -= bufs[pos.0].len();
            pos.0 += 1;
        }
        let mut taken = 0;
        for _ in 0..OUT_RECORDS {
            let mut parts: [&[u8]; 8] = [&[]; 8];
            let (mut n, mut len) = (0, 0);
            while pos.0 < bufs.len() && len < MAX_PLAIN && n < parts.len() {
                let s = &bufs[pos.0][pos.1..];
                let k = s.len().min(MAX_PLAIN - len);
                parts[n] = &s[..k];
                n += 1;
                len += k;
                pos.1 += k;
                if pos.1 == bufs[pos.0].len() {
                    pos = (pos.0 + 1, 0);
                }
            }
            if len == 0 {
                break;
            }
            let end = self.out_end;
            let w = self.tx.seal(&parts[..n], len, &mut self.out[end..end + MAX_RECORD])?;
            self.out_end += w;
            taken += len;
        }
        Ok(taken)
    }

    /// The body length of the next record if it is all here; an error if its header is not
    /// one this layer sends.
    fn whole_record(&mut self) -> io::Result<Option<usize>> {
        match self.next_record() {
            Ok(body) => Ok(body),
            Err(()) => Err(self.fail(format!(
                "the encrypted link to rank {} received a malformed record header (corrupted or forged)",
                self.peer
            ))),
        }
    }

    /// The body length of the next record if it is all here; `Err` for a header this layer
    /// does not send.
    fn next_record(&self) -> std::result::Result<Option<usize>, ()> {
        let have = self.in_end - self.in_at;
        if have < HEADER {
            return Ok(None);
        }
        let body = body_len(&self.inb[self.in_at..self.in_at + HEADER]).ok_or(())?;
        Ok((have >= HEADER + body).then_some(body))
    }

    fn forged(&mut self) -> io::Error {
        self.fail(format!(
            "a record on the encrypted link to rank {} failed authentication (altered, replayed, \
             reordered or dropped in transit)",
            self.peer
        ))
    }

    /// Opens the next whole record received in place, if any. `Ok(true)`: plaintext is ready.
    fn open_next(&mut self) -> io::Result<bool> {
        let Some(body) = self.whole_record()? else { return Ok(false) };
        let at = self.in_at;
        match self.rx.open(&mut self.inb[at..at + HEADER + body])? {
            Some(len) => {
                self.plain_at = at + HEADER;
                self.plain_end = at + HEADER + len;
                self.in_at = at + HEADER + body;
                Ok(true)
            }
            None => Err(self.forged()),
        }
    }

    /// Opens the next whole record straight into `dst` when its plaintext fits; returns the
    /// bytes it wrote (0: no whole record, or it does not fit).
    fn open_next_into(&mut self, dst: &mut [u8]) -> io::Result<usize> {
        let Some(body) = self.whole_record()? else { return Ok(0) };
        let len = body - TAG;
        if len > dst.len() {
            return Ok(0);
        }
        let at = self.in_at;
        if !self.rx.open_into(&self.inb[at..at + HEADER + body], &mut dst[..len])? {
            return Err(self.forged());
        }
        self.in_at = at + HEADER + body;
        Ok(len)
    }

    /// Reads what `inner` has into the free end of `inb`. `Ok(false)`: the peer closed.
    fn fill(&mut self) -> io::Result<bool> {
        if self.plain_at == self.plain_end && self.in_at > 0 && self.inb.len() - self.in_end < MAX_RECORD {
            self.inb.copy_within(self.in_at..self.in_end, 0);
            self.in_end -= self.in_at;
            self.in_at = 0;
            self.plain_at = 0;
            self.plain_end = 0;
        }
        let end = self.in_end;
        match self.inner.try_read(&mut [&mut self.inb[end..]])? {
            0 if self.in_at < self.in_end => Err(self.fail(format!(
                "the encrypted link to rank {} closed inside a record (cut short in transit?)",
                self.peer
            ))),
            0 => Ok(false),
            n => {
                self.in_end += n;
                Ok(true)
            }
        }
    }

    /// Waits for nothing: true when opened plaintext or a whole record is here, receiving
    /// what has arrived if neither is. `Ok(false)`: the peer closed the stream.
    fn ready(&mut self) -> io::Result<bool> {
        self.check()?;
        loop {
            if self.plain_at < self.plain_end || self.whole_record()?.is_some() {
                return Ok(true);
            }
            if !self.fill()? {
                return Ok(false);
            }
        }
    }
}

impl Transport for Sealed {
    fn kind(&self) -> &'static str {
        self.kind
    }

    fn try_write(&mut self, bufs: &[&[u8]]) -> io::Result<usize> {
        self.check()?;
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if total < self.unacked {
            return Err(io::Error::other(format!(
                "encrypted link to rank {}: the stream went back on {} bytes already sealed",
                self.peer, self.unacked
            )));
        }
        if !self.flush()? {
            return Err(would_block());
        }
        let mut written = std::mem::take(&mut self.unacked);
        while written < total {
            let k = self.seal_from(bufs, written)?;
            if self.flush()? {
                written += k;
            } else {
                self.unacked = k;
                break;
            }
        }
        if written == 0 && total > 0 { Err(would_block()) } else { Ok(written) }
    }

    fn try_read(&mut self, bufs: &mut [&mut [u8]]) -> io::Result<usize> {
        if bufs.iter().all(|b| b.is_empty()) {
            return Ok(0);
        }
        if !self.ready()? {
            return Ok(0);
        }
        // Whatever is opened or can be opened without waiting, slice after slice; a record
        // that fits in what is left of a slice is opened straight into it.
        let mut n = 0;
        'bufs: for b in bufs.iter_mut() {
            let mut at = 0;
            while at < b.len() {
                if self.plain_at == self.plain_end {
                    let k = self.open_next_into(&mut b[at..])?;
                    if k > 0 {
                        at += k;
                        n += k;
                        continue;
                    }
                    if !self.open_next()? {
                        break 'bufs;
                    }
                }
                let k = (b.len() - at).min(self.plain_end - self.plain_at);
                crate::reduce::copy(&mut b[at..at + k], &self.inb[self.plain_at..self.plain_at + k]);
                self.plain_at += k;
                at += k;
                n += k;
            }
        }
        Ok(n)
    }

    fn peek(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        // The bytes of the record being read; a peek never reaches into the next record
        // (fewer bytes than asked are allowed).
        if !self.ready()? {
            return Ok(0);
        }
        if self.plain_at == self.plain_end && !self.open_next()? {
            return Err(would_block());
        }
        let k = buf.len().min(self.plain_end - self.plain_at);
        buf[..k].copy_from_slice(&self.inb[self.plain_at..self.plain_at + k]);
        Ok(k)
    }

    fn pollable(&self) -> RawFd {
        self.inner.pollable()
    }

    fn shutdown(&mut self) {
        let _ = self.flush();
        self.inner.shutdown();
    }

    fn arm(&mut self, read: bool, write: bool) -> Option<Events> {
        if read && self.failed.is_none() && (self.plain_at < self.plain_end || self.next_record() != Ok(None))
        {
            return None;
        }
        self.inner.arm(read, write || self.out_at < self.out_end)
    }
}

#[cfg(test)]
#[path = "record_tests.rs"]
mod tests;
