//! The store's server: one thread runs a `poll(2)` loop over non-blocking sockets. A GET or
//! WAIT whose keys are missing parks its connection (later requests on it stay buffered) until a
//! SET or ADD supplies them or its deadline passes, so clients never poll. Dropping the
//! [`ServerHandle`] closes one end of a socket pair the loop watches; the thread then drops
//! every connection and is joined, and clients blocked on it see the connection close.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::protocol::{
    Dec, MAX_FRAME, OP_ADD, OP_DELETE, OP_GET, OP_SET, OP_WAIT, ST_BAD_REQUEST, ST_INVALID_USAGE, ST_OK,
    ST_TIMEOUT, VERSION, answer, is_hello,
};
use crate::error::{Error, Result};
use crate::sys::poll::{PollFd, poll};

/// Starts the server thread on `listener` (bound to `bound`); it serves until the handle drops.
pub(super) fn start(listener: TcpListener, bound: SocketAddr) -> Result<ServerHandle> {
    listener.set_nonblocking(true).map_err(|e| Error::system("store: set_nonblocking", e))?;
    let (wake_tx, wake_rx) = UnixStream::pair().map_err(|e| Error::system("store: socketpair", e))?;
    let server = Server { listener, wake: wake_rx, conns: Vec::new(), map: HashMap::new() };
    let thread = std::thread::Builder::new()
        .name("toroid-store".into())
        .spawn(move || server.run())
        .map_err(|e| Error::system("store: spawn server thread", e))?;
    tracing::info!(target: "toroid::store", "store server listening on {bound}");
    Ok(ServerHandle { addr: bound, wake: Some(wake_tx), thread: Some(thread) })
}

/// The running server: dropping it stops the thread.
pub(super) struct ServerHandle {
    /// Where it listens.
    pub(super) addr: SocketAddr,
    /// Dropping this end of the socket pair tells the server thread to stop.
    wake: Option<UnixStream>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        drop(self.wake.take());
        if let Some(t) = self.thread.take()
            && t.join().is_err()
        {
            tracing::error!(target: "toroid::store", "store server thread panicked");
        }
        tracing::info!(target: "toroid::store", "store server on {} stopped", self.addr);
    }
}

type Map = HashMap<Vec<u8>, Vec<u8>>;

struct Server {
    listener: TcpListener,
    wake: UnixStream,
    conns: Vec<Conn>,
    map: Map,
}

enum Want {
    Get(Vec<u8>),
    Wait(Vec<Vec<u8>>),
}

/// A GET or WAIT waiting for its keys.
struct Pending {
    want: Want,
    /// `None` when the timeout is too far to represent.
    deadline: Option<Instant>,
    timeout_ms: u64,
}

impl Pending {
    /// The answer, once the keys are there or the deadline passed.
    fn answer(&self, map: &Map, now: Instant) -> Option<Vec<u8>> {
        match &self.want {
            Want::Get(k) => {
                if let Some(v) = map.get(k) {
                    return Some(answer(ST_OK, v));
                }
            }
            Want::Wait(keys) => {
                if keys.iter().all(|k| map.contains_key(k)) {
                    return Some(answer(ST_OK, &[]));
                }
            }
        }
        if self.deadline.is_some_and(|d| now >= d) {
            let keys: Vec<&Vec<u8>> = match &self.want {
                Want::Get(k) => vec![k],
                Want::Wait(keys) => keys.iter().filter(|k| !map.contains_key(*k)).collect(),
            };
            let keys: Vec<_> = keys.iter().map(|k| String::from_utf8_lossy(k)).collect();
            let msg = format!("waited {} ms for keys {keys:?}", self.timeout_ms);
            return Some(answer(ST_TIMEOUT, msg.as_bytes()));
        }
        None
    }
}

#[derive(PartialEq, Eq)]
enum State {
    /// Waiting for the hello.
    New,
    Open,
    /// Flush what is queued, then shut down writing and discard input until the peer closes
    /// (closing with unread input would send a reset that can destroy our last answer).
    Closing,
    Dead,
}

struct Conn {
    stream: TcpStream,
    peer: SocketAddr,
    state: State,
    rbuf: Vec<u8>,
    wbuf: Vec<u8>,
    pending: Option<Pending>,
    eof: bool,
    write_shut: bool,
}

impl Server {
    fn run(mut self) {
        if let Err(e) = self.serve() {
            tracing::error!(target: "toroid::store", "store server failed: {e}; closing all connections");
        }
    }

    fn serve(&mut self) -> io::Result<()> {
        let mut fds = Vec::new();
        loop {
            let now = Instant::now();
            let timeout_ms =
                self.conns.iter().filter_map(|c| c.pending.as_ref()?.deadline).min().map_or(-1, |d| {
                    // Rounded up, so that we wake after the deadline rather than just before.
                    let ms = d.saturating_duration_since(now).as_nanos().div_ceil(1_000_000);
                    i32::try_from(ms).unwrap_or(i32::MAX)
                });
            fds.clear();
            fds.push(PollFd::new(self.wake.as_raw_fd(), PollFd::IN));
            fds.push(PollFd::new(self.listener.as_raw_fd(), PollFd::IN));
            for c in &self.conns {
                let out = if c.wbuf.is_empty() { 0 } else { PollFd::OUT };
                fds.push(PollFd::new(c.stream.as_raw_fd(), PollFd::IN | out));
            }
            // An interrupted poll reports nothing: the loop then re-checks every deadline.
            poll(&mut fds, timeout_ms)?;
            if fds[0].revents() != 0 {
                return Ok(()); // the owner dropped its end
            }
            for (c, fd) in self.conns.iter_mut().zip(&fds[2..]) {
                if fd.revents() != 0 {
                    c.fill();
                }
            }
            if fds[1].revents() != 0 {
                self.accept();
            }
            // A SET on one connection can complete a GET parked on another: repeat until quiet.
            let now = Instant::now();
            while self.conns.iter_mut().fold(false, |m, c| c.drive(&mut self.map, now) | m) {}
            for c in &mut self.conns {
                c.flush();
                if c.eof && c.state != State::Dead {
                    tracing::debug!(target: "toroid::store", "store client {} disconnected", c.peer);
                    c.state = State::Dead;
                }
            }
            self.conns.retain(|c| c.state != State::Dead);
        }
    }

    fn accept(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, peer)) => {
                    if let Err(e) = stream.set_nonblocking(true) {
                        tracing::warn!(target: "toroid::store", "store: dropping client {peer}: {e}");
                        continue;
                    }
                    let _ = stream.set_nodelay(true);
                    tracing::debug!(target: "toroid::store", "store client {peer} connected");
                    self.conns.push(Conn {
                        stream,
                        peer,
                        state: State::New,
                        rbuf: Vec::new(),
                        wbuf: Vec::new(),
                        pending: None,
                        eof: false,
                        write_shut: false,
                    });
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // Out of descriptors and the like: back off instead of spinning on poll.
                    tracing::warn!(target: "toroid::store", "store: accept failed: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                    return;
                }
            }
        }
    }
}

impl Conn {
    /// Reads everything available.
    fn fill(&mut self) {
        let mut chunk = [0u8; 64 * 1024];
        loop {
            match self.stream.read(&mut chunk) {
                Ok(0) => {
                    self.eof = true;
                    return;
                }
                // Input after a rejected request is read only to be dropped.
                Ok(_) if self.state == State::Closing => {}
                Ok(n) => self.rbuf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::debug!(target: "toroid::store", "store client {}: {e}", self.peer);
                    self.state = State::Dead;
                    return;
                }
            }
        }
    }

    fn send(&mut self, payload: &[u8]) {
        // Answers are bounded by what a client could send, which is bounded by MAX_FRAME.
        self.wbuf.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        self.wbuf.extend_from_slice(payload);
    }

    /// Answers with an error, then closes.
    fn reject(&mut self, msg: &str) {
        tracing::warn!(target: "toroid::store", "store client {}: {msg}; closing", self.peer);
        self.send(&answer(ST_BAD_REQUEST, msg.as_bytes()));
        self.rbuf = Vec::new();
        self.pending = None;
        self.state = State::Closing;
    }

    /// Answers every complete request it can; returns whether the map changed.
    fn drive(&mut self, map: &mut Map, now: Instant) -> bool {
        let mut mutated = false;
        while matches!(self.state, State::New | State::Open) {
            if let Some(p) = &self.pending {
                match p.answer(map, now) {
                    Some(a) => {
                        self.pending = None;
                        self.send(&a);
                    }
                    None => break,
                }
            }
            let Some(head) = self.rbuf.first_chunk::<4>() else {
                break;
            };
            let len = u32::from_le_bytes(*head) as usize;
            if len > MAX_FRAME {
                self.reject(&format!("frame of {len} bytes exceeds the limit of {MAX_FRAME} bytes"));
                break;
            }
            if self.rbuf.len() < 4 + len {
                break;
            }
            let frame = self.rbuf[4..4 + len].to_vec();
            self.rbuf.drain(..4 + len);
            if self.state == State::New {
                if is_hello(&frame) {
                    self.state = State::Open;
                    self.send(&answer(ST_OK, &[]));
                } else {
                    self.reject(&format!(
                        "bad hello: not a toroid store client of protocol version {VERSION}"
                    ));
                }
                continue;
            }
            match handle(&frame, map, now) {
                Ok(Handled::Answer(a, m)) => {
                    mutated |= m;
                    self.send(&a);
                }
                Ok(Handled::Park(p)) => self.pending = Some(p),
                Err(msg) => self.send(&answer(ST_BAD_REQUEST, msg.as_bytes())),
            }
        }
        mutated
    }

    /// Writes what the socket takes now.
    fn flush(&mut self) {
        while !self.wbuf.is_empty() && self.state != State::Dead {
            match self.stream.write(&self.wbuf) {
                Ok(0) => self.state = State::Dead,
                Ok(n) => {
                    self.wbuf.drain(..n);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::debug!(target: "toroid::store", "store client {}: {e}", self.peer);
                    self.state = State::Dead;
                }
            }
        }
        if self.state == State::Closing && self.wbuf.is_empty() && !self.write_shut {
            self.write_shut = true;
            let _ = self.stream.shutdown(Shutdown::Write);
        }
    }
}

enum Handled {
    /// The answer, and whether the map changed.
    Answer(Vec<u8>, bool),
    Park(Pending),
}

fn handle(frame: &[u8], map: &mut Map, now: Instant) -> std::result::Result<Handled, String> {
    let mut d = Dec(frame);
    let park = |want, timeout_ms: u64| {
        let deadline = now.checked_add(Duration::from_millis(timeout_ms));
        Handled::Park(Pending { want, deadline, timeout_ms })
    };
    let out = match d.u8()? {
        OP_SET => {
            let key = d.bytes()?.to_vec();
            let value = d.bytes()?.to_vec();
            d.end()?;
            map.insert(key, value);
            Handled::Answer(answer(ST_OK, &[]), true)
        }
        OP_GET => {
            let timeout_ms = d.u64()?;
            let key = d.bytes()?.to_vec();
            d.end()?;
            park(Want::Get(key), timeout_ms)
        }
        OP_ADD => {
            let delta = d.i64()?;
            let key = d.bytes()?;
            d.end()?;
            let name = String::from_utf8_lossy(key);
            let cur = match map.get(key) {
                Some(v) => match crate::rendezvous::parse_counter(&name, v) {
                    Ok(n) => n,
                    Err(e) => {
                        return Ok(Handled::Answer(answer(ST_INVALID_USAGE, e.detail().as_bytes()), false));
                    }
                },
                None => 0,
            };
            let new = cur.wrapping_add(delta);
            map.insert(key.to_vec(), new.to_string().into_bytes());
            Handled::Answer(answer(ST_OK, &new.to_le_bytes()), true)
        }
        OP_WAIT => {
            let timeout_ms = d.u64()?;
            let n = d.u32()?;
            // Each key takes at least its 4-byte length, so `n` is bounded by the frame.
            let mut keys = Vec::with_capacity((n as usize).min(frame.len() / 4));
            for _ in 0..n {
                keys.push(d.bytes()?.to_vec());
            }
            d.end()?;
            park(Want::Wait(keys), timeout_ms)
        }
        OP_DELETE => {
            let key = d.bytes()?;
            d.end()?;
            let existed = map.remove(key).is_some();
            Handled::Answer(answer(ST_OK, &[u8::from(existed)]), false)
        }
        op => return Err(format!("unknown operation {op}")),
    };
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::super::protocol::Enc;
    use super::super::tests::{T, raw_frame, raw_read, server};
    use super::*;
    use crate::rendezvous::Store;

    #[test]
    fn server_rejects_oversized_frames_and_bad_hellos_and_keeps_serving() {
        let s = server();
        let addr = s.server_addr().unwrap();

        let mut raw = TcpStream::connect(addr).unwrap();
        raw.set_read_timeout(Some(T)).unwrap();
        raw.write_all(&Enc::hello().finish().unwrap()).unwrap();
        assert_eq!(raw_read(&mut raw), [ST_OK]);
        // Claim 1 GiB and send nothing more: the server must answer, not allocate and wait.
        raw.write_all(&(1u32 << 30).to_le_bytes()).unwrap();
        let a = raw_read(&mut raw);
        assert_eq!(a[0], ST_BAD_REQUEST);
        assert!(String::from_utf8_lossy(&a[1..]).contains("exceeds"));
        let mut rest = Vec::new();
        raw.read_to_end(&mut rest).unwrap(); // the server closed it
        assert!(rest.is_empty());

        let mut raw = TcpStream::connect(addr).unwrap();
        raw.set_read_timeout(Some(T)).unwrap();
        raw_frame(&mut raw, b"HTTP/1.1");
        assert_eq!(raw_read(&mut raw)[0], ST_BAD_REQUEST);

        // A malformed request is answered and the connection stays open.
        let mut raw = TcpStream::connect(addr).unwrap();
        raw.set_read_timeout(Some(T)).unwrap();
        raw.write_all(&Enc::hello().finish().unwrap()).unwrap();
        assert_eq!(raw_read(&mut raw), [ST_OK]);
        raw_frame(&mut raw, &[OP_SET, 9, 0, 0]);
        assert_eq!(raw_read(&mut raw)[0], ST_BAD_REQUEST);
        raw_frame(&mut raw, &[OP_DELETE, 1, 0, 0, 0, b'z']);
        assert_eq!(raw_read(&mut raw), [ST_OK, 0]);

        s.set("still", b"fine").unwrap();
        assert_eq!(s.get("still", T).unwrap(), b"fine");
    }
}
