//! The store's wire format (see the module documentation of `tcp_store`): constants, and the
//! encoder and decoder of frames both sides use.

use crate::error::{Error, Result};

/// Longest key (bytes). toroid's own keys (`toroid/gen12/addr/4095`) are under 40 bytes.
pub const MAX_KEY: usize = 1024;
/// Largest value (bytes). toroid's largest value is a host identity line (about 100 bytes); the
/// store carries addresses and ids, not data, and every byte a stranger can make the server hold
/// scales with this.
pub const MAX_VALUE: usize = 64 << 10;
/// Largest frame either side accepts: a SET of the longest key and the largest value, plus its
/// header. A larger length header is answered with an error and the connection closed, without
/// allocating.
pub const MAX_FRAME: usize = MAX_VALUE + MAX_KEY + 64;
/// Largest frame of a connection that has not finished its hello (the hello, or its proof, is
/// under 64 bytes).
pub(super) const MAX_HELLO_FRAME: usize = 64;
/// Most keys one WAIT may name (a WAIT on every rank of a job of 16,384 ranks).
pub const MAX_WAIT_KEYS: usize = 16_384;
/// Most bytes the server stores, counting each entry as key + value + [`ENTRY_OVERHEAD`]. A job
/// of 10,000 ranks stores about 2 MiB (three keys of under 200 bytes per rank); a stranger
/// without the token can make the server hold no more than this.
pub const MAX_STORED: usize = 4 << 20;
/// What one entry is counted for beyond its key and value (the map's own bookkeeping), so that
/// millions of empty keys are bounded too.
pub(super) const ENTRY_OVERHEAD: usize = 64;
/// Buffered input per connection: one frame of the largest size and its header. The server reads
/// no more from a connection until it has answered what it holds.
pub(super) const MAX_INPUT: usize = MAX_FRAME + 4;
/// Unsent output per connection above which the server stops answering that connection's
/// requests and stops reading from it, until the peer reads: one answer may go past it, so at
/// most `MAX_OUTPUT + MAX_FRAME` bytes wait for a peer that does not read.
pub(super) const MAX_OUTPUT: usize = 64 << 10;
/// Most connections at once (a job of 4,000 ranks holds one each; beyond it, new connections
/// are closed at once).
pub const MAX_CONNECTIONS: usize = 4096;
/// Time a new connection has to complete its hello (and with a token its proof), and a
/// rejected one to go away. A toroid client sends its hello as soon as it connects.
pub const HANDSHAKE_DEADLINE: std::time::Duration = std::time::Duration::from_secs(4);
/// Longest a GET or WAIT may wait on the server (longer timeouts are cut to it): nothing is
/// parked without a deadline.
pub const MAX_PARK: std::time::Duration = std::time::Duration::from_secs(24 * 3600);

const MAGIC: &[u8; 4] = b"TRDV";
/// Store protocol version (2: the hello carries flags, and with a token a challenge-response).
pub(super) const VERSION: u32 = 2;
/// Hello flag: the client authenticates (its nonce follows the flags).
pub(super) const FLAG_AUTH: u8 = 1;
/// Hello flag: the client encrypts (`TOROID_ENCRYPT`). Sent alone, in plaintext, before a TLS
/// handshake; the hello with [`FLAG_AUTH`] then follows inside TLS.
pub(super) const FLAG_TLS: u8 = 2;

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
    /// The client's first frame: magic, version, flags, and with a token the client's nonce.
    pub(super) fn hello(nonce: Option<&[u8]>) -> Enc {
        let mut e = Enc(vec![0; 4]);
        e.0.extend_from_slice(MAGIC);
        e.u32(VERSION);
        e.0.push(if nonce.is_some() { FLAG_AUTH } else { 0 });
        if let Some(n) = nonce {
            e.0.extend_from_slice(n);
        }
        e
    }
    /// The plaintext hello of a client that encrypts: magic, version, [`FLAG_TLS`].
    pub(super) fn hello_tls() -> Enc {
        let mut e = Enc(vec![0; 4]);
        e.0.extend_from_slice(MAGIC);
        e.u32(VERSION);
        e.0.push(FLAG_TLS);
        e
    }
    /// A frame of raw bytes (the client's proof).
    pub(super) fn raw(payload: &[u8]) -> Enc {
        let mut e = Enc(vec![0; 4]);
        e.0.extend_from_slice(payload);
        e
    }
    /// The payload so far (without the length).
    pub(super) fn payload(&self) -> &[u8] {
        &self.0[4..]
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

/// A client's hello, parsed.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Hello<'a> {
    /// Not a toroid store client of this protocol version.
    Foreign,
    /// Without authentication.
    Plain,
    /// With authentication: the client's nonce.
    Auth(&'a [u8]),
    /// A request to continue in TLS.
    Tls,
}

/// Parses a client's first frame.
pub(crate) fn parse_hello(payload: &[u8]) -> Hello<'_> {
    if payload.len() < 9 || payload[..4] != *MAGIC || payload[4..8] != VERSION.to_le_bytes() {
        return Hello::Foreign;
    }
    match (payload[8], &payload[9..]) {
        (0, []) => Hello::Plain,
        (FLAG_AUTH, n) if n.len() == super::auth::NONCE_LEN => Hello::Auth(n),
        (FLAG_TLS, []) => Hello::Tls,
        _ => Hello::Foreign,
    }
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
        assert_eq!(parse_hello(&Enc::hello(None).finish().unwrap()[4..]), Hello::Plain);
        let n = [7; super::super::auth::NONCE_LEN];
        assert_eq!(parse_hello(&Enc::hello(Some(&n)).finish().unwrap()[4..]), Hello::Auth(&n[..]));
        assert_eq!(parse_hello(&Enc::hello(Some(&n[1..])).finish().unwrap()[4..]), Hello::Foreign);
        assert_eq!(parse_hello(b"HTTP/1.1"), Hello::Foreign);
        assert_eq!(parse_hello(&Enc::hello_tls().finish().unwrap()[4..]), Hello::Tls);
        let mut old = Enc::hello(None).finish().unwrap()[4..].to_vec();
        old[4] = 1; // version 1
        assert_eq!(parse_hello(&old), Hello::Foreign);
        assert!(Enc::hello(Some(&n)).finish().unwrap().len() - 4 <= MAX_HELLO_FRAME);
        let mut big = Enc::new(OP_SET);
        big.bytes(&vec![0; MAX_FRAME]);
        assert!(matches!(big.finish(), Err(Error::InvalidArgument(_))));
    }
}
