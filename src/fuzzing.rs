//! Entry points of the fuzz targets (`fuzz/`) and of their replay test (`tests/fuzz_corpus.rs`).
//!
//! Each takes arbitrary bytes, runs one decoder that reads bytes from a peer (and the checks
//! the receiving code applies after it), and returns normally whatever the bytes are: a panic,
//! an arithmetic overflow (fuzz builds keep debug assertions) or an allocation sized by the
//! input is a bug. The return values say what the decoder concluded, so the replay test can
//! also assert that well-formed seeds are accepted.
//!
//! Not part of the public API: hidden from the documentation and free to change.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::path::Path;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::collective::{CollKind, Fingerprint};
use crate::config::AuthToken;
use crate::dtype::{DataType, ReduceOp};
use crate::rendezvous::tcp_store::protocol::parse_hello;
use crate::rendezvous::{Store, TcpStore};
use crate::transport::exchange::frame::{self, HEADER_LEN, KIND_ABORT, MAX_REASON};
use crate::transport::shm::setup::{self, MSG_LEN, OFFER, WIN_OFFER};
use crate::transport::tcp::handshake::{
    self, HELLO_LEN, Hello, KIND_ACK, KIND_HELLO, MAC_LEN, NONCE_LEN, Nonce,
};

/// The operation the frame target's receiver expects.
pub fn expected_fingerprint() -> Fingerprint {
    Fingerprint {
        seq: 5,
        kind: CollKind::AllReduce,
        dtype: DataType::F32,
        op: ReduceOp::Sum,
        count: 16,
        root: -1,
        algo: 1,
    }
}
/// The step the frame target's receiver is at.
pub const EXPECTED_STEP: u16 = 3;
/// The payload length the frame target's receiver expects.
pub const EXPECTED_LEN: usize = 64;

/// A frame header with the given fields (for seeds).
pub fn frame_header(kind: u8, fp: &Fingerprint, step: u16, len: u32) -> [u8; HEADER_LEN] {
    frame::encode(kind, fp, step, len)
}

/// What the receiver concluded about a frame header.
#[derive(Debug, PartialEq, Eq)]
pub enum FrameVerdict {
    /// Fewer than [`HEADER_LEN`] bytes: the receiver keeps waiting.
    Incomplete,
    /// Not a valid header (magic, kind or fingerprint fields).
    Bad,
    /// An abort frame; the receiver would read at most this many reason bytes.
    Abort(usize),
    /// Another collective than the expected one.
    Mismatch,
    /// The expected collective but another step or length.
    OutOfStep,
    /// The frame the receiver expects.
    Accepted,
}

/// Decodes the first [`HEADER_LEN`] bytes of `data` as a frame header and applies the checks
/// of the receiving side (`exchange::rx`) against [`expected_fingerprint`], [`EXPECTED_STEP`]
/// and [`EXPECTED_LEN`], formatting every message it would report.
pub fn frame(data: &[u8]) -> FrameVerdict {
    let Some(h) = data.first_chunk::<HEADER_LEN>() else { return FrameVerdict::Incomplete };
    let fp = expected_fingerprint();
    let header = match frame::decode(h) {
        Ok(header) => header,
        Err(e) => {
            std::hint::black_box(format!("bad frame during {fp}: {e}"));
            return FrameVerdict::Bad;
        }
    };
    if header.kind == KIND_ABORT {
        // `read_abort` bounds the reason it reads by `MAX_REASON`, whatever the length says.
        let reason = (header.len as usize).min(MAX_REASON);
        let rest = &data[HEADER_LEN..];
        std::hint::black_box(String::from_utf8_lossy(&rest[..rest.len().min(reason)]));
        return FrameVerdict::Abort(reason);
    }
    let theirs = match header.fp {
        Ok(theirs) => theirs,
        Err(e) => {
            std::hint::black_box(format!("bad frame during {fp}: {e}"));
            return FrameVerdict::Bad;
        }
    };
    if theirs != fp {
        std::hint::black_box(format!("collective mismatch: called {fp} but the peer called {theirs}"));
        return FrameVerdict::Mismatch;
    }
    if header.step != EXPECTED_STEP || header.len as usize != EXPECTED_LEN {
        std::hint::black_box(format!("step {} frame of {} bytes during {fp}", header.step, header.len));
        return FrameVerdict::OutOfStep;
    }
    FrameVerdict::Accepted
}

/// Communicator id, rank and size of the handshake target's receiver.
pub const HANDSHAKE_COMM: u64 = 7;
/// This rank in the handshake target.
pub const HANDSHAKE_ME: usize = 1;
/// Ranks in the handshake target's communicator.
pub const HANDSHAKE_SIZE: usize = 4;
/// The token of the handshake target's authenticating receiver.
pub const HANDSHAKE_TOKEN: &[u8] = b"fuzz token";

/// A hello from rank 3 to [`HANDSHAKE_ME`], as the connector sends it: with `nonce`, also the
/// nonce and the MAC under [`HANDSHAKE_TOKEN`] (for seeds; deterministic, unlike a real one).
pub fn handshake_hello(nonce: Option<Nonce>) -> Vec<u8> {
    let h = handshake::hello(KIND_HELLO, HANDSHAKE_COMM, 3, HANDSHAKE_ME, nonce.is_some(), 0);
    let mut msg = h.to_vec();
    if let Some(n) = nonce {
        use hmac::Mac;
        let token = AuthToken::new(HANDSHAKE_TOKEN);
        msg.extend_from_slice(&n);
        msg.extend_from_slice(&handshake::mac(&token, b"toroid hello", &[&h, &n]).finalize().into_bytes());
    }
    msg
}

/// The ack of [`HANDSHAKE_ME`] to rank 3's hello, answering the all-zero nonce (for seeds).
pub fn handshake_ack(auth: bool) -> Vec<u8> {
    let token = AuthToken::new(HANDSHAKE_TOKEN);
    handshake::ack_message(HANDSHAKE_COMM, HANDSHAKE_ME, 3, auth.then_some(&token), &[0; NONCE_LEN], 0)
}

/// What the handshake checks concluded: for the hello as the acceptor reads it, without and
/// with a token, and for the ack as the connector reads it.
#[derive(Debug, PartialEq, Eq, Default)]
pub struct HandshakeVerdict {
    /// `check_hello` accepted it as a hello (and named this sender).
    pub hello_from: Option<usize>,
    /// `check_hello_auth` passed without a token here.
    pub open: bool,
    /// `check_hello_auth` passed with [`HANDSHAKE_TOKEN`] here.
    pub authenticated: bool,
    /// `check_hello` accepted it as an ack and `ack_is_authentic` passed for the zero nonce.
    pub ack_authentic: bool,
}

/// Runs the handshake checks on `data`: its first [`HELLO_LEN`] bytes as a hello or ack, the
/// rest as what followed (the acceptor reads a nonce and a MAC after a hello that announces
/// authentication; the connector reads a MAC after an ack).
pub fn handshake(data: &[u8]) -> HandshakeVerdict {
    let mut v = HandshakeVerdict::default();
    let Some(h) = data.first_chunk::<HELLO_LEN>() else { return v };
    let h: &Hello = h;
    let rest = &data[HELLO_LEN..];
    let token = AuthToken::new(HANDSHAKE_TOKEN);
    v.hello_from = handshake::check_hello(h, KIND_HELLO, HANDSHAKE_COMM, HANDSHAKE_ME, HANDSHAKE_SIZE).ok();
    // The acceptor reads exactly a nonce and a MAC after a hello that announces authentication.
    let extra = handshake::announces_auth(h).then(|| &rest[..rest.len().min(NONCE_LEN + MAC_LEN)]);
    v.open = handshake::check_hello_auth(h, extra, None).is_ok();
    v.authenticated = handshake::check_hello_auth(h, extra, Some(&token)).is_ok();
    let nonce: Nonce = [0; NONCE_LEN];
    let acked = handshake::check_hello(h, KIND_ACK, HANDSHAKE_COMM, 3, HANDSHAKE_SIZE).is_ok();
    v.ack_authentic = acked && handshake::ack_is_authentic(h, rest, &nonce, &token);
    v
}

/// The segment directory of the shm_offer target's receiver (never opened by the target).
pub const SHM_DIR: &str = "/dev/shm";
/// The window length the shm_offer target's receiver expects.
pub const SHM_WINDOW_LEN: usize = 1 << 20;

/// An encoded set-up message (for seeds).
pub fn shm_message(kind: u8, nonce: u64, size: u64, text: &str) -> [u8; MSG_LEN] {
    setup::encode_msg(kind, nonce, size, text)
}

/// Kinds of the offers in a set-up message (for seeds): a pair segment and the window.
pub const SHM_OFFER_KINDS: [u8; 2] = [OFFER, WIN_OFFER];

/// Decodes the first [`MSG_LEN`] bytes of `data` as a shared-memory set-up message and, for
/// an offer, runs the check done before anything is opened. Returns the path and length the
/// receiver would map, if any. Opens nothing itself.
pub fn shm_offer(data: &[u8]) -> Option<(std::path::PathBuf, usize)> {
    let m = setup::decode_msg(data.first_chunk::<MSG_LEN>()?).ok()?;
    let dir = Path::new(SHM_DIR);
    let window = match m.kind {
        OFFER => None,
        WIN_OFFER => Some(SHM_WINDOW_LEN),
        _ => return None,
    };
    let (path, len) = setup::check_offer(dir, &m.text, m.size, window).ok()?;
    // The promise of the check: a toroid name directly inside the directory, a bounded size.
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    assert!(path.parent() == Some(dir), "offer escapes {SHM_DIR}: {}", path.display());
    assert!(name.starts_with(crate::transport::shm::NAME_PREFIX), "not a toroid name: {name}");
    assert!(len <= window.unwrap_or(crate::transport::shm::pair_segment_len(1 << 30)), "unbounded: {len}");
    Some((path, len))
}

/// Feeds `data` to the store server's own request handler, as the payloads of one connection:
/// the first byte is a hello (parsed as the server does), then each frame is `len: u8` and that
/// many bytes, handled against one bounded table (the caps apply as in the server). Returns
/// whether any request was well formed.
pub fn store_decode(data: &[u8]) -> bool {
    use crate::rendezvous::tcp_store::requests::{Table, handle};
    let mut table = Table::default();
    let now = std::time::Instant::now();
    let _ = parse_hello(data);
    let mut rest = data;
    let mut any = false;
    while let Some((&len, tail)) = rest.split_first() {
        let len = (len as usize).min(tail.len());
        let (frame, next) = tail.split_at(len);
        any |= handle(frame, &mut table, now).is_ok();
        rest = next;
    }
    any
}

/// The store server of this process, started on first use.
fn store() -> Option<&'static (TcpStore, SocketAddr)> {
    static STORE: OnceLock<Option<(TcpStore, SocketAddr)>> = OnceLock::new();
    STORE
        .get_or_init(|| {
            let s = TcpStore::serve("127.0.0.1:0", Duration::from_secs(5)).ok()?;
            let addr = s.server_addr()?;
            Some((s, addr))
        })
        .as_ref()
}

/// Inputs sent to the store server so far (every [`STORE_CHECK_EVERY`] a genuine client
/// checks that it still serves).
static STORE_INPUTS: AtomicU64 = AtomicU64::new(0);
/// How often the store target checks the server with a genuine client.
pub const STORE_CHECK_EVERY: u64 = 64;
/// Longest the store target waits for the server's answers to one input.
const STORE_READ: Duration = Duration::from_millis(200);

/// Sends `data` to this process's store server as a stranger would: the first byte picks up
/// to 3 split points (the input is written in pieces, so the server sees partial frames),
/// then the write side is shut and the answers are read to EOF or a short deadline. Every
/// [`STORE_CHECK_EVERY`] inputs a genuine client sets and gets a key. Returns the bytes the
/// server answered; panics if the server no longer serves.
pub fn store_session(data: &[u8]) -> usize {
    let Some((store, addr)) = store() else { panic!("the store server did not start") };
    let (splits, body) = match data.split_first() {
        Some((&s, body)) => (s, body),
        None => (0, data),
    };
    let mut answered = 0;
    if let Ok(mut conn) = TcpStream::connect_timeout(addr, Duration::from_secs(2)) {
        let _ = conn.set_write_timeout(Some(STORE_READ));
        let _ = conn.set_read_timeout(Some(STORE_READ));
        let _ = conn.set_nodelay(true);
        let pieces = usize::from(splits & 3) + 1;
        let step = body.len().div_ceil(pieces).max(1);
        for piece in body.chunks(step) {
            if conn.write_all(piece).is_err() {
                break;
            }
        }
        let _ = conn.shutdown(Shutdown::Write);
        let deadline = Instant::now() + STORE_READ;
        let mut buf = [0u8; 4096];
        while Instant::now() < deadline {
            match conn.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => answered += n,
            }
        }
    }
    let n = STORE_INPUTS.fetch_add(1, Ordering::Relaxed);
    if n.is_multiple_of(STORE_CHECK_EVERY) {
        let key = format!("fuzz-check-{n}");
        let value = n.to_le_bytes();
        if let Err(e) = store.set(&key, &value) {
            panic!("the store no longer serves a genuine client (set): {e}");
        }
        match store.get(&key, Duration::from_secs(5)) {
            Ok(v) if v == value => {}
            other => panic!("the store no longer serves a genuine client (get): {other:?}"),
        }
    }
    answered
}

/// The secret of the direction the record target reads (its seeds are sealed with it).
pub const RECORD_SECRET: [u8; crate::transport::tcp::secure::record::SECRET_LEN] = [0x42; 32];

/// `plain` as the record stream of an encrypted link under [`RECORD_SECRET`], records of at most
/// `per_record` bytes (for seeds: deterministic).
pub fn record_stream(plain: &[u8], per_record: usize) -> Vec<u8> {
    use crate::transport::tcp::secure::record::{Direction, MAX_RECORD};
    let mut d = Direction::new(&RECORD_SECRET).expect("record keys");
    let mut out = Vec::new();
    let mut rec = vec![0u8; MAX_RECORD];
    for chunk in plain.chunks(per_record.max(1)) {
        let n = d.seal(&[chunk], chunk.len(), &mut rec).expect("sealing");
        out.extend_from_slice(&rec[..n]);
    }
    out
}

/// A transport that hands out `data` in pieces and takes (and counts) every write.
#[derive(Debug)]
struct Feed {
    data: Vec<u8>,
    at: usize,
    piece: usize,
    written: usize,
}

impl crate::transport::Transport for Feed {
    fn kind(&self) -> &'static str {
        "feed"
    }
    fn try_write(&mut self, bufs: &[&[u8]]) -> std::io::Result<usize> {
        let n = bufs.iter().map(|b| b.len()).sum();
        self.written += n;
        Ok(n)
    }
    fn try_read(&mut self, bufs: &mut [&mut [u8]]) -> std::io::Result<usize> {
        let Some(b) = bufs.iter_mut().find(|b| !b.is_empty()) else { return Ok(0) };
        let n = b.len().min(self.piece).min(self.data.len() - self.at);
        b[..n].copy_from_slice(&self.data[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
    fn peek(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = buf.len().min(self.data.len() - self.at);
        buf[..n].copy_from_slice(&self.data[self.at..self.at + n]);
        Ok(n)
    }
    fn pollable(&self) -> std::os::fd::RawFd {
        -1
    }
    fn shutdown(&mut self) {}
}

/// What the record layer made of a stream.
#[derive(Debug, PartialEq, Eq)]
pub struct RecordVerdict {
    /// Plaintext bytes it returned before the end or the error.
    pub plain: usize,
    /// It ended in an error (a record that failed, a malformed header, a cut stream).
    pub failed: bool,
}

/// Reads `data[1..]` through an encrypted link's record layer as the bytes its peer sent (the
/// first byte sets how many bytes each read of the socket returns), in reads of uneven sizes
/// with a peek between them, to the end or the first error.
pub fn record(data: &[u8]) -> RecordVerdict {
    use crate::transport::Transport;
    use crate::transport::tcp::secure::record::{Direction, Sealed};
    let Some((&first, rest)) = data.split_first() else { return RecordVerdict { plain: 0, failed: false } };
    let piece = 1 + usize::from(first) * 613;
    let feed = Feed { data: rest.to_vec(), at: 0, piece, written: 0 };
    let keys = || Direction::new(&RECORD_SECRET).expect("record keys");
    let mut link = Sealed::new(Box::new(feed), 1, keys(), keys());
    let mut buf = vec![0u8; 70_001];
    let mut plain = 0;
    for i in 0usize.. {
        let want = 1 + (i * 7919) % buf.len();
        let mut peeked = [0u8; 40];
        let _ = link.peek(&mut peeked);
        match link.try_read(&mut [&mut buf[..want]]) {
            Ok(0) => return RecordVerdict { plain, failed: false },
            Ok(n) => plain += n,
            Err(_) => return RecordVerdict { plain, failed: true },
        }
    }
    RecordVerdict { plain, failed: false }
}

/// The key pair of the `tls_handshake` target's rank (made once: key generation is slow).
fn tls_identity() -> &'static crate::tls::Identity {
    static ID: OnceLock<crate::tls::Identity> = OnceLock::new();
    ID.get_or_init(|| crate::tls::Identity::generate().expect("an Ed25519 key pair"))
}

/// What an encrypted link's TLS handshake made of a peer's bytes.
#[derive(Debug, PartialEq, Eq)]
pub struct TlsVerdict {
    /// Bytes this side sent back (its own flight, or an alert).
    pub answered: usize,
    /// The handshake completed (never, for bytes not made with the pinned peer's key).
    pub completed: bool,
}

/// Runs the TLS handshake of an encrypted link (`transport::tcp::secure::tls`) over
/// `data[1..]` as the bytes its peer sent: the first byte's low bit picks this side's role
/// (0: it was dialed, the server; 1: it dialed, the client), the rest how many bytes each read
/// returns. The peer's pinned key is this side's own, which no input can sign for.
pub fn tls_handshake(data: &[u8]) -> TlsVerdict {
    let Some((&first, rest)) = data.split_first() else {
        return TlsVerdict { answered: 0, completed: false };
    };
    let me = tls_identity();
    let dialer = first & 1 == 1;
    let mut feed = Feed { data: rest.to_vec(), at: 0, piece: 1 + usize::from(first >> 1) * 97, written: 0 };
    let Ok(mut conn) = crate::tls::link_connection(me, me.public_key(), dialer) else {
        panic!("a TLS configuration that cannot be built")
    };
    let deadline = Instant::now() + Duration::from_secs(1);
    let done = crate::transport::tcp::secure::tls::handshake(&mut conn, &mut feed, deadline, None, "fuzz");
    TlsVerdict { answered: feed.written, completed: done.is_ok() }
}

/// Real first flights of a link's handshake, for seeds: a client's hello, and a server's
/// answer to it. (They carry fresh randoms and key shares: no two calls give the same bytes.)
pub fn tls_flights() -> (Vec<u8>, Vec<u8>) {
    let me = tls_identity();
    let conn =
        |dialer| crate::tls::link_connection(me, me.public_key(), dialer).expect("a TLS configuration");
    let (mut client, mut server) = (conn(true), conn(false));
    let mut hello = Vec::new();
    while client.wants_write() {
        client.write_tls(&mut hello).expect("writing to memory");
    }
    server.read_tls(&mut hello.as_slice()).expect("reading from memory");
    server.process_new_packets().expect("a client hello of our own");
    let mut answer = Vec::new();
    while server.wants_write() {
        server.write_tls(&mut answer).expect("writing to memory");
    }
    (hello, answer)
}
