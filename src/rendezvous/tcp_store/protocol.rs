//! The store's wire format (see the module documentation of `tcp_store`): constants, and the
//! encoder and decoder of frames both sides use.

use crate::error::{Error, Result};

/// Largest frame either side accepts (64 MiB): a store carries addresses and ids, not tensors.
pub const MAX_FRAME: usize = 64 << 20;

const MAGIC: &[u8; 4] = b"TRDV";
pub(super) const VERSION: u32 = 1;

pub(super) const OP_SET: u8 = 1;
pub(super) const OP_GET: u8 = 2;
pub(super) const OP_ADD: u8 = 3;
pub(super) const OP_WAIT: u8 = 4;
pub(super) const OP_DELETE: u8 = 5;

pub(super) const ST_OK: u8 = 0;
pub(super) const ST_TIMEOUT: u8 = 1;
pub(super) const ST_INVALID_USAGE: u8 = 2;
pub(super) const ST_BAD_REQUEST: u8 = 3;

/// A frame being built: 4 bytes kept for the length, then the payload.
pub(super) struct Enc(Vec<u8>);

impl Enc {
    /// A request for operation `op`.
    pub(super) fn new(op: u8) -> Enc {
        Enc(vec![0, 0, 0, 0, op])
    }
    /// The client's first frame.
    pub(super) fn hello() -> Enc {
        let mut e = Enc(vec![0; 4]);
        e.0.extend_from_slice(MAGIC);
        e.u32(VERSION);
        e
    }
    /// Fills in the length; fails for a payload above the limit.
    pub(super) fn finish(mut self) -> Result<Vec<u8>> {
        let len = self.0.len() - 4;
        if len > MAX_FRAME {
            return Err(Error::InvalidArgument(
                format!("store: message of {len} bytes exceeds the limit of {MAX_FRAME} bytes").into(),
            ));
        }
        // MAX_FRAME < u32::MAX, so the cast is exact.
        self.0[..4].copy_from_slice(&(len as u32).to_le_bytes());
        Ok(self.0)
    }
    pub(super) fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub(super) fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub(super) fn i64(&mut self, v: i64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub(super) fn bytes(&mut self, b: &[u8]) {
        // Lengths above u32 are caught by the frame limit before anything is sent.
        self.u32(u32::try_from(b.len()).unwrap_or(u32::MAX));
        self.0.extend_from_slice(b);
    }
}

/// Reads a payload front to back; each read fails with a message on a short payload.
pub(crate) struct Dec<'a>(pub(crate) &'a [u8]);

type DecResult<T> = std::result::Result<T, String>;

impl<'a> Dec<'a> {
    fn take(&mut self, n: usize) -> DecResult<&'a [u8]> {
        if self.0.len() < n {
            return Err(format!("truncated message: wanted {n} more bytes, have {}", self.0.len()));
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }
    fn array<const N: usize>(&mut self) -> DecResult<[u8; N]> {
        let mut a = [0; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    pub(crate) fn u8(&mut self) -> DecResult<u8> {
        Ok(self.array::<1>()?[0])
    }
    pub(crate) fn u32(&mut self) -> DecResult<u32> {
        self.array().map(u32::from_le_bytes)
    }
    pub(crate) fn u64(&mut self) -> DecResult<u64> {
        self.array().map(u64::from_le_bytes)
    }
    pub(crate) fn i64(&mut self) -> DecResult<i64> {
        self.array().map(i64::from_le_bytes)
    }
    pub(crate) fn bytes(&mut self) -> DecResult<&'a [u8]> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    /// Fails unless everything was read.
    pub(crate) fn end(&self) -> DecResult<()> {
        if self.0.is_empty() { Ok(()) } else { Err(format!("{} unexpected trailing bytes", self.0.len())) }
    }
}

/// Whether `payload` is a client's hello of this protocol version.
pub(crate) fn is_hello(payload: &[u8]) -> bool {
    payload.len() == 8 && payload[..4] == *MAGIC && payload[4..] == VERSION.to_le_bytes()
}

/// A response payload: the status, then the body.
pub(super) fn answer(status: u8, body: &[u8]) -> Vec<u8> {
    let mut a = Vec::with_capacity(1 + body.len());
    a.push(status);
    a.extend_from_slice(body);
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_decode_to_what_was_encoded() {
        let mut e = Enc::new(OP_WAIT);
        e.u64(7);
        e.i64(-2);
        e.bytes(b"key");
        let f = e.finish().unwrap();
        assert_eq!(u32::from_le_bytes(f[..4].try_into().unwrap()) as usize, f.len() - 4);
        let mut d = Dec(&f[4..]);
        assert_eq!((d.u8(), d.u64(), d.i64(), d.bytes()), (Ok(OP_WAIT), Ok(7), Ok(-2), Ok(&b"key"[..])));
        d.end().unwrap();
        assert!(d.u32().unwrap_err().contains("truncated"));
        assert!(Dec(&[1]).end().unwrap_err().contains("trailing"));
        assert!(is_hello(&Enc::hello().finish().unwrap()[4..]));
        assert!(!is_hello(b"HTTP/1.1"));
        let mut big = Enc::new(OP_SET);
        big.bytes(&vec![0; MAX_FRAME]);
        assert!(matches!(big.finish(), Err(Error::InvalidArgument(_))));
    }
}
