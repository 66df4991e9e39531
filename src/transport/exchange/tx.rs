//! The sending half of an exchange: frames cut from the source as it becomes available.

use super::frame::{HEADER_LEN, frame_len, set_len};
use super::{Link, Source};
use std::io;

use crate::error::{Error, Result};

/// The sending half of an exchange.
pub(super) struct Tx<'a> {
    pub(super) peer: usize,
    pub(super) src: Source<'a>,
    pub(super) total: usize,
    pub(super) header: [u8; HEADER_LEN],
    pub(super) segment: usize,
    /// Payload offset where the current frame starts.
    pub(super) frame_start: usize,
    /// Header bytes of the current frame sent.
    pub(super) hdr_sent: usize,
    /// Payload bytes of the current frame sent.
    pub(super) frame_sent: usize,
    pub(super) frame_open: bool,
    pub(super) done: bool,
}

impl<'a> Tx<'a> {
    pub(super) fn new(
        peer: usize,
        src: Source<'a>,
        total: usize,
        header: [u8; HEADER_LEN],
        segment: usize,
    ) -> Tx<'a> {
        Tx {
            peer,
            src,
            total,
            header,
            segment,
            frame_start: 0,
            hdr_sent: 0,
            frame_sent: 0,
            frame_open: false,
            done: false,
        }
    }

    /// True when the send cannot progress for want of bytes to forward (everything `avail`
    /// holds is sent): only the receive that produces them can unblock it.
    pub(super) fn starved(&self, avail: usize) -> bool {
        !self.done && self.frame_open && self.hdr_sent == HEADER_LEN && self.sent_payload() >= avail
    }

    pub(super) fn sent_payload(&self) -> usize {
        self.frame_start + self.frame_sent
    }

    /// Writes what it can. `forwarded` is the receive's final output so far (for `Forward`).
    pub(super) fn pump(&mut self, link: &mut Link, forwarded: Option<&[u8]>) -> Result<bool> {
        let mut progressed = false;
        while !self.done {
            let len = frame_len(self.total, self.frame_start, self.segment);
            if !self.frame_open {
                set_len(&mut self.header, len as u32);
                self.hdr_sent = 0;
                self.frame_sent = 0;
                self.frame_open = true;
            }
            let data: &[u8] = match &self.src {
                Source::Bytes(b) => b,
                Source::Forward => forwarded.unwrap_or(&[]),
            };
            let end = (self.frame_start + len).min(data.len());
            let payload = &data[(self.frame_start + self.frame_sent).min(end)..end];
            let hdr = &self.header[self.hdr_sent..];
            if hdr.is_empty() && payload.is_empty() && self.frame_sent < len {
                break; // waiting for forwarded bytes
            }
            let n = if hdr.is_empty() && payload.is_empty() {
                0
            } else {
                match link.transport.try_write(&[hdr, payload]) {
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) => {
                        return Err(Error::Remote(
                            format!(
                                "sending to rank {} failed: {e} (rank {} exited, crashed or aborted)",
                                self.peer, self.peer
                            )
                            .into(),
                        ));
                    }
                }
            };
            progressed |= n > 0;
            let h = n.min(hdr.len());
            self.hdr_sent += h;
            self.frame_sent += n - h;
            link.out_mid_frame = true;
            if self.hdr_sent == HEADER_LEN && self.frame_sent == len {
                link.out_mid_frame = false;
                self.frame_open = false;
                self.frame_start += len;
                if self.frame_start == self.total {
                    self.done = true;
                }
            } else if n == 0 {
                break;
            }
        }
        Ok(progressed)
    }
}
