//! A client of torch's `TCPStore` for one purpose: meeting under torchrun without a port of our
//! own to agree on. torchrun's agent serves a `TCPStore` at `MASTER_ADDR:MASTER_PORT` for the
//! job's whole life and tells its workers so (`TORCHELASTIC_USE_AGENT_STORE=True`). Rank 0
//! serves toroid's own store ([`TcpStore`](super::TcpStore): authenticated, bounded) on a free
//! port and publishes that port there; the others read it and connect. So no port is guessed:
//! `MASTER_PORT+1`, the old rule, fails whenever anything else holds that port.
//!
//! Only three requests of torch's wire format are used (`torch/csrc/distributed/c10d/TCPStore.cpp`
//! and `TCPStoreBackend.hpp` in PyTorch; integers little-endian, strings as `len: u64` then the
//! bytes). Checked against torch 2.15's server by `tests/launchers.rs`.
//!
//! ```text
//! VALIDATE  0u8, magic: u32 = 0x3C85F7CE          first message; no answer
//! SET       1u8, key: string, value: string       no answer
//! WAIT      6u8, n: u64 = 1, key: string          answer 0u8 (STOP_WAITING) once the key exists
//! GET       3u8, key: string                      answer value: string
//! ```
//!
//! Nothing from the socket is trusted: every read has the caller's deadline, and an answer
//! longer than [`MAX_ANSWER`] is refused before it is read. A WAIT that outlives the deadline
//! is not cancelled: the connection is dropped, which torch's server handles as any client
//! leaving.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

const VALIDATE: u8 = 0;
const SET: u8 = 1;
const GET: u8 = 3;
const WAIT: u8 = 6;
/// What torch's server expects in the VALIDATE message.
const MAGIC: u32 = 0x3C85_F7CE;
/// torch's answer to a WAIT whose keys exist.
const STOP_WAITING: u8 = 0;
/// The longest value this client reads (it stores a port number).
pub const MAX_ANSWER: u64 = 256;
/// Pause between connection attempts while the server is not up yet.
const RETRY: Duration = Duration::from_millis(20);

/// One connection to a torch `TCPStore`.
#[derive(Debug)]
pub struct TorchStore {
    stream: TcpStream,
    /// `host:port`, for messages.
    addr: String,
}

impl TorchStore {
    /// Connects to torch's store at `host:port`, trying again until `deadline` while nothing
    /// listens there yet (the errors `tcp_store` retries on), and sends the VALIDATE message.
    ///
    /// # Errors
    /// [`Error::Timeout`] when nothing accepted before `deadline`; [`Error::System`] for
    /// another socket error; [`Error::InvalidArgument`] for a host that does not resolve.
    pub fn connect(host: &str, port: u16, deadline: Instant) -> Result<TorchStore> {
        let addr = super::env::join_host_port(host, port);
        let targets: Vec<_> = (host, port)
            .to_socket_addrs()
            .map_err(|e| Error::InvalidArgument(format!("torch's store '{addr}': {e}").into()))?
            .collect();
        let mut last = format!("'{addr}' resolves to no address");
        loop {
            for a in &targets {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                match TcpStream::connect_timeout(a, left) {
                    Ok(stream) => {
                        let _ = stream.set_nodelay(true);
                        let mut s = TorchStore { stream, addr };
                        let mut msg = vec![VALIDATE];
                        msg.extend_from_slice(&MAGIC.to_le_bytes());
                        s.send(&msg, deadline)?;
                        return Ok(s);
                    }
                    Err(e) if super::tcp_store::retriable(&e) => last = format!("{a}: {e}"),
                    Err(e) => {
                        return Err(Error::system(format!("torch's store: connect to {addr} ({a})"), e));
                    }
                }
            }
            if Instant::now() + RETRY >= deadline {
                return Err(Error::Timeout(
                    format!("torch's store at {addr} (torchrun's MASTER_ADDR:MASTER_PORT): {last}").into(),
                ));
            }
            std::thread::sleep(RETRY);
        }
    }

    /// Sets `key` to `value`.
    ///
    /// # Errors
    /// [`Error::System`] or [`Error::Timeout`] when the socket fails or stalls past `deadline`.
    pub fn set(&mut self, key: &str, value: &[u8], deadline: Instant) -> Result<()> {
        let mut msg = vec![SET];
        put_string(&mut msg, key.as_bytes());
        put_string(&mut msg, value);
        self.send(&msg, deadline)
    }

    /// Waits until `deadline` for `key` to exist, then reads its value (at most [`MAX_ANSWER`]
    /// bytes).
    ///
    /// # Errors
    /// [`Error::Timeout`] when the key does not appear in time; [`Error::Remote`] for an answer
    /// torch's server would not give (a wrong status, a value over the bound).
    pub fn get(&mut self, key: &str, deadline: Instant) -> Result<Vec<u8>> {
        let mut msg = vec![WAIT];
        msg.extend_from_slice(&1u64.to_le_bytes());
        put_string(&mut msg, key.as_bytes());
        self.send(&msg, deadline)?;
        let mut status = [0u8; 1];
        self.recv(&mut status, deadline, key)?;
        if status[0] != STOP_WAITING {
            return Err(self.bad(&format!("answered WAIT with {}", status[0])));
        }
        let mut msg = vec![GET];
        put_string(&mut msg, key.as_bytes());
        self.send(&msg, deadline)?;
        let mut len = [0u8; 8];
        self.recv(&mut len, deadline, key)?;
        let len = u64::from_le_bytes(len);
        if len > MAX_ANSWER {
            return Err(self.bad(&format!("answered GET with {len} bytes (at most {MAX_ANSWER} expected)")));
        }
        let mut value = vec![0u8; len as usize];
        self.recv(&mut value, deadline, key)?;
        Ok(value)
    }

    fn send(&mut self, msg: &[u8], deadline: Instant) -> Result<()> {
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        let _ = self.stream.set_write_timeout(Some(left));
        self.stream.write_all(msg).map_err(|e| Error::system(format!("torch's store at {}", self.addr), e))
    }

    fn recv(&mut self, buf: &mut [u8], deadline: Instant, key: &str) -> Result<()> {
        let mut got = 0;
        while got < buf.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout(
                    format!("torch's store at {}: no value for '{key}' in time", self.addr).into(),
                ));
            }
            let _ = self.stream.set_read_timeout(Some(left));
            match self.stream.read(&mut buf[got..]) {
                Ok(0) => return Err(self.bad("closed the connection")),
                Ok(n) => got += n,
                Err(e)
                    if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::system(format!("torch's store at {}", self.addr), e)),
            }
        }
        Ok(())
    }

    fn bad(&self, what: &str) -> Error {
        Error::Remote(format!("torch's store at {} {what}: is it torch's TCPStore?", self.addr).into())
    }
}

/// torch's string: `len: u64`, then the bytes.
fn put_string(msg: &mut Vec<u8>, s: &[u8]) {
    msg.extend_from_slice(&(s.len() as u64).to_le_bytes());
    msg.extend_from_slice(s);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn deadline(ms: u64) -> Instant {
        Instant::now() + Duration::from_millis(ms)
    }

    /// A server that checks VALIDATE, SET, WAIT and GET byte for byte, then answers with
    /// `answer` after the GET.
    fn serve(answer: Vec<u8>) -> (u16, std::thread::JoinHandle<Vec<u8>>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let h = std::thread::spawn(move || {
            let (mut c, _) = l.accept().unwrap();
            c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            // VALIDATE, SET k=vv, WAIT [k]; then the GET, sent only once the WAIT is answered.
            let mut seen = vec![0u8; 5 + (1 + 8 + 1 + 8 + 2) + (1 + 8 + 8 + 1)];
            c.read_exact(&mut seen).unwrap();
            c.write_all(&[STOP_WAITING]).unwrap();
            let mut get = [0u8; 1 + 8 + 1];
            c.read_exact(&mut get).unwrap();
            seen.extend_from_slice(&get);
            c.write_all(&answer).unwrap();
            seen
        });
        (port, h)
    }

    #[test]
    fn speaks_torchs_wire_format() {
        let mut answer = 2u64.to_le_bytes().to_vec();
        answer.extend_from_slice(b"42");
        let (port, server) = serve(answer);
        let mut s = TorchStore::connect("127.0.0.1", port, deadline(5000)).unwrap();
        s.set("k", b"vv", deadline(5000)).unwrap();
        assert_eq!(s.get("k", deadline(5000)).unwrap(), b"42");
        let seen = server.join().unwrap();
        let mut want = vec![VALIDATE, 0xce, 0xf7, 0x85, 0x3c];
        want.extend_from_slice(&[SET, 1, 0, 0, 0, 0, 0, 0, 0, b'k', 2, 0, 0, 0, 0, 0, 0, 0, b'v', b'v']);
        want.extend_from_slice(&[WAIT, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, b'k']);
        want.extend_from_slice(&[GET, 1, 0, 0, 0, 0, 0, 0, 0, b'k']);
        assert_eq!(seen, want);
    }

    #[test]
    fn an_oversized_answer_is_refused_unread() {
        let answer = (MAX_ANSWER + 1).to_le_bytes().to_vec();
        let (port, server) = serve(answer);
        let mut s = TorchStore::connect("127.0.0.1", port, deadline(5000)).unwrap();
        s.set("k", b"vv", deadline(5000)).unwrap();
        let e = s.get("k", deadline(5000)).unwrap_err();
        assert!(matches!(e, Error::Remote(_)) && e.to_string().contains("257 bytes"), "{e}");
        server.join().unwrap();
    }

    #[test]
    fn a_key_that_never_comes_times_out() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let mut s = TorchStore::connect("127.0.0.1", port, deadline(5000)).unwrap();
        let start = Instant::now();
        let e = s.get("never", deadline(200)).unwrap_err();
        assert!(matches!(e, Error::Timeout(_)), "{e}");
        assert!(start.elapsed() < Duration::from_secs(3));
        drop(l);
    }

    #[test]
    fn nothing_listening_times_out() {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let e = TorchStore::connect("127.0.0.1", port, deadline(150)).err().unwrap();
        assert!(matches!(e, Error::Timeout(_)) && e.to_string().contains("MASTER_PORT"), "{e}");
    }
}
