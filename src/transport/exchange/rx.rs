//! The receiving half of an exchange: headers checked before use, payload copied or reduced
//! as whole elements arrive (or straight out of a lending transport).
//!
//! No payload byte reaches the caller's memory before its frame's header has been checked: a
//! mismatched collective or an abort must leave an in-place buffer as it was. A reduction reads
//! into scratch anyway; a copy reads a small frame together with its header into scratch and
//! moves it once the header passed (one receive call per frame, which is what small-message
//! latency needs), and reads the header of a large frame alone (one more call per frame, nothing
//! next to its payload's cost).

use super::frame::{HEADER_LEN, KIND_ABORT, decode, frame_len, read_abort};
use super::{Link, Sink, mismatch};
use crate::collective::Fingerprint;
use std::io;

use crate::error::{Error, Result};
use crate::reduce;

/// Payload bytes up to which a copied frame is read together with its header into scratch
/// (the exchange's scratch is always at least this long).
pub(super) const STAGE_MAX: usize = 4096;

/// The receiving half of an exchange.
pub(super) struct Rx {
    pub(super) peer: usize,
    pub(super) total: usize,
    pub(super) segment: usize,
    pub(super) header: [u8; HEADER_LEN],
    pub(super) hdr_got: usize,
    pub(super) frame_start: usize,
    pub(super) frame_len: usize,
    pub(super) frame_got: usize,
    /// Bytes of the current frame already reduced into the output.
    pub(super) processed: usize,
    pub(super) frame_open: bool,
    /// The current frame's payload received so far is in scratch, not yet in the sink (a
    /// small copied frame whose header is being checked).
    pub(super) staged: bool,
    pub(super) done: bool,
}

impl Rx {
    /// A receive of `total` bytes from `peer`; the sink is passed to every `pump`.
    pub(super) fn new(peer: usize, total: usize, segment: usize) -> Rx {
        Rx {
            peer,
            total,
            segment,
            header: [0; HEADER_LEN],
            hdr_got: 0,
            frame_start: 0,
            frame_len: 0,
            frame_got: 0,
            processed: 0,
            frame_open: false,
            staged: false,
            done: false,
        }
    }

    /// How many leading output bytes are final (received, and reduced for reducing sinks).
    pub(super) fn final_len(&self, reducing: bool) -> usize {
        if self.done {
            return self.total;
        }
        let in_frame = match (reducing, self.hdr_got == HEADER_LEN) {
            (_, false) => 0,
            (true, true) => self.processed,
            (false, true) => self.frame_got,
        };
        self.frame_start + in_frame
    }

    pub(super) fn pump(
        &mut self,
        sink: &mut Sink<'_>,
        rank: usize,
        link: &mut Link,
        fp: &Fingerprint,
        step: u16,
        scratch: &mut [u8],
    ) -> Result<bool> {
        let mut progressed = false;
        while !self.done {
            if !self.frame_open {
                self.frame_len = frame_len(self.total, self.frame_start, self.segment);
                self.hdr_got = 0;
                self.frame_got = 0;
                self.processed = 0;
                self.staged = false;
                self.frame_open = true;
            }
            let (fs, fl, fg) = (self.frame_start, self.frame_len, self.frame_got);
            // Zero copy: reduce straight out of the transport's memory.
            if link.zero_copy
                && self.hdr_got == HEADER_LEN
                && fg < fl
                && let Sink::Reduce { dst, other, dtype, op } = &mut *sink
            {
                let es = dtype.size();
                let (dtype, op) = (*dtype, *op);
                let mut at = fs + fg;
                let frame_end = fs + fl;
                let mut consume = |bytes: &[u8]| {
                    let take = if at + bytes.len() == frame_end {
                        bytes.len()
                    } else {
                        bytes.len() - bytes.len() % es
                    };
                    if take > 0 {
                        let (a, b) = (at, at + take);
                        match other {
                            Some(o) => {
                                reduce::reduce_into(dtype, op, &mut dst[a..b], &o[a..b], &bytes[..take])
                            }
                            None => reduce::reduce_inplace(dtype, op, &mut dst[a..b], &bytes[..take]),
                        }
                        at = b;
                    }
                    take
                };
                match link.transport.read_with(fl - fg, &mut consume) {
                    Ok(0) => {
                        return Err(Error::Remote(
                            format!(
                                "rank {} closed its connection during {fp} (it exited, crashed or aborted)",
                                self.peer
                            )
                            .into(),
                        )
                        .with_peer(self.peer));
                    }
                    Ok(n) => {
                        progressed = true;
                        self.frame_got += n;
                        self.processed = self.frame_got;
                        if self.frame_got == self.frame_len {
                            self.frame_open = false;
                            self.frame_start += self.frame_len;
                            if self.frame_start == self.total {
                                self.done = true;
                            }
                        }
                        continue;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) => {
                        return Err(Error::Remote(
                            format!("receiving from rank {} failed during {fp}: {e}", self.peer).into(),
                        ));
                    }
                }
            }
            let zero_copy_header = link.zero_copy && matches!(sink, Sink::Reduce { .. });
            let hdr_missing = HEADER_LEN - self.hdr_got;
            let res = if hdr_missing > 0 {
                let hdr = &mut self.header[self.hdr_got..];
                // Payload bytes can arrive only once the header is whole, so before that `fg`
                // is 0 and whatever comes with the header starts the frame.
                match sink {
                    // shm: the payload is read in place once the header is validated
                    Sink::Reduce { .. } if zero_copy_header => link.transport.try_read(&mut [hdr]),
                    Sink::Reduce { .. } => link.transport.try_read(&mut [hdr, &mut scratch[fg..fl]]),
                    Sink::Copy(_) if fl <= STAGE_MAX && fl <= scratch.len() => {
                        self.staged = true;
                        link.transport.try_read(&mut [hdr, &mut scratch[fg..fl]])
                    }
                    Sink::Copy(_) => link.transport.try_read(&mut [hdr]),
                }
            } else {
                let payload: &mut [u8] = match sink {
                    Sink::Copy(d) => &mut d[fs + fg..fs + fl],
                    Sink::Reduce { .. } => &mut scratch[fg..fl],
                };
                if payload.is_empty() {
                    Ok(usize::MAX) // header complete and empty payload: frame complete
                } else {
                    link.transport.try_read(&mut [payload])
                }
            };
            let n = match res {
                Ok(0) => {
                    return Err(Error::Remote(
                        format!(
                            "rank {} closed its connection during {fp} (it exited, crashed or aborted)",
                            self.peer
                        )
                        .into(),
                    )
                    .with_peer(self.peer));
                }
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    return Err(Error::Remote(
                        format!("receiving from rank {} failed during {fp}: {e}", self.peer).into(),
                    ));
                }
            };
            let n = if n == usize::MAX { 0 } else { n };
            progressed |= n > 0;
            let h = n.min(hdr_missing);
            self.hdr_got += h;
            if h > 0 && self.hdr_got == HEADER_LEN {
                self.frame_got += n - h;
                self.validate(sink, rank, link, fp, step, scratch)?;
                if self.staged
                    && let Sink::Copy(d) = &mut *sink
                {
                    let got = self.frame_got;
                    d[fs..fs + got].copy_from_slice(&scratch[..got]);
                    self.staged = false;
                }
            } else {
                self.frame_got += n - h;
            }
            if self.hdr_got == HEADER_LEN {
                self.process(sink, scratch);
                if self.frame_got == self.frame_len {
                    self.frame_open = false;
                    self.frame_start += self.frame_len;
                    if self.frame_start == self.total {
                        self.done = true;
                    }
                    continue;
                }
            }
            if n == 0 {
                break;
            }
        }
        Ok(progressed)
    }

    pub(super) fn validate(
        &mut self,
        sink: &Sink<'_>,
        rank: usize,
        link: &mut Link,
        fp: &Fingerprint,
        step: u16,
        scratch: &[u8],
    ) -> Result<()> {
        let header = decode(&self.header).map_err(|e| {
            Error::Remote(format!("rank {} sent a bad frame during {fp}: {e}", self.peer).into())
        })?;
        if header.kind == KIND_ABORT {
            let already: &[u8] = match sink {
                Sink::Copy(d) if !self.staged => &d[self.frame_start..self.frame_start + self.frame_got],
                _ => &scratch[..self.frame_got],
            };
            let already = already.to_vec();
            return Err(read_abort(link, self.peer, true, &already, header.len as usize));
        }
        let theirs = header.fp.map_err(|e| {
            Error::Remote(format!("rank {} sent a bad frame during {fp}: {e}", self.peer).into())
        })?;
        if theirs != *fp {
            return Err(mismatch(rank, self.peer, fp, &theirs));
        }
        if header.step != step || header.len as usize != self.frame_len {
            return Err(Error::Remote(format!(
                "rank {} sent step {} frame of {} bytes during {fp}, expected step {step} frame of {} bytes \
                 (streams out of step: ranks disagree on the schedule)",
                self.peer, header.step, header.len, self.frame_len
            ).into()));
        }
        Ok(())
    }

    /// Reduces the whole elements of the current frame that arrived since the last call.
    pub(super) fn process(&mut self, sink: &mut Sink<'_>, scratch: &[u8]) {
        if let Sink::Reduce { dst, other, dtype, op } = sink {
            let esize = dtype.size();
            let upto = if self.frame_got == self.frame_len {
                self.frame_got
            } else {
                self.frame_got - self.frame_got % esize
            };
            if upto > self.processed {
                let (a, b) = (self.frame_start + self.processed, self.frame_start + upto);
                let incoming = &scratch[self.processed..upto];
                match other {
                    Some(o) => reduce::reduce_into(*dtype, *op, &mut dst[a..b], &o[a..b], incoming),
                    None => reduce::reduce_inplace(*dtype, *op, &mut dst[a..b], incoming),
                }
                self.processed = upto;
            }
        }
    }
}
