//! Strangers on every listening port of a job: each rank's data listener and the store, found
//! from outside in `/proc/<pid>/net/tcp` as they appear (so set-up can be attacked while it
//! runs), each attacked by one connection per kind until [`Attack::stop`].
//!
//! Included with `#[path]` by `tests/faults.rs`; it uses `crate::job`.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hmac::{KeyInit, Mac};
use toroid::rendezvous::{Store, TcpStore};

use crate::job::tcp_sockets;
use crate::util::data::mix;

/// What a stranger does once connected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// 4 KiB of random bytes, then close.
    Garbage,
    /// Connect and close at once, before a whole hello.
    Close,
    /// Connect and say nothing, until the job ends.
    Silence,
    /// One byte every 100 ms, until the job ends or the listener closes the connection.
    Drip,
    /// A well-formed authenticating hello of the current protocol (the real communicator id
    /// when the store gives it away), nonce and HMAC under the wrong token.
    WrongToken,
}

impl Kind {
    pub const ALL: [Kind; 5] = [Kind::Garbage, Kind::Close, Kind::Silence, Kind::Drip, Kind::WrongToken];
}

/// What an attack did.
#[derive(Debug, Default)]
pub struct Report {
    /// Distinct listening ports attacked.
    pub listeners: usize,
    /// Connections made (of all kinds).
    pub connections: usize,
    pub note: String,
}

/// A running attack on the listeners of a job's ranks.
pub struct Attack {
    stop: Arc<AtomicBool>,
    controller: JoinHandle<Report>,
}

struct Shared {
    stop: Arc<AtomicBool>,
    connections: Mutex<usize>,
}

impl Attack {
    /// Starts watching the ranks `pids` (index = rank) for listening sockets and attacks each
    /// new one with every kind in `kinds`. `store_port` is rank 0's store (named in the hello).
    pub fn start(pids: Vec<u32>, store_port: u16, kinds: Vec<Kind>) -> Attack {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let controller = std::thread::spawn(move || {
            let shared = Arc::new(Shared { stop: s, connections: Mutex::new(0) });
            let mut seen: Vec<SocketAddr> = Vec::new();
            let mut workers = Vec::new();
            let n = pids.len();
            while !shared.stop.load(Ordering::Relaxed) {
                for (rank, &pid) in pids.iter().enumerate() {
                    for sock in tcp_sockets(pid).into_iter().filter(|s| s.listening) {
                        if seen.contains(&sock.local) {
                            continue;
                        }
                        seen.push(sock.local);
                        let target = match sock.local.ip() {
                            IpAddr::V4(ip) if ip.is_unspecified() => {
                                SocketAddr::new(Ipv4Addr::LOCALHOST.into(), sock.local.port())
                            }
                            _ => sock.local,
                        };
                        let to = if sock.local.port() == store_port { 0 } else { rank };
                        for &k in &kinds {
                            let sh = shared.clone();
                            workers.push(std::thread::spawn(move || {
                                one(&sh, k, target, store_port, to, (to + 1) % n.max(1))
                            }));
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            for w in workers {
                let _ = w.join();
            }
            let connections = *shared.connections.lock().unwrap();
            Report { listeners: seen.len(), connections, note: format!("{connections} connections") }
        });
        Attack { stop, controller }
    }

    /// Ends every stranger's connection and returns what was done.
    pub fn stop(self) -> Report {
        self.stop.store(true, Ordering::Relaxed);
        self.controller.join().unwrap_or_default()
    }
}

/// Sleeps in small steps until `stop` or `d` passed; returns whether to stop.
fn nap(stop: &AtomicBool, d: Duration) -> bool {
    let end = Instant::now() + d;
    while Instant::now() < end {
        if stop.load(Ordering::Relaxed) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    stop.load(Ordering::Relaxed)
}

/// Reads and discards whatever the listener sends until it closes, or `stop`.
fn drain(sh: &Shared, s: &mut TcpStream) {
    let _ = s.set_read_timeout(Some(Duration::from_millis(50)));
    let mut buf = [0u8; 512];
    while !sh.stop.load(Ordering::Relaxed) {
        match s.read(&mut buf) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(_) => return,
        }
    }
}

fn one(sh: &Shared, kind: Kind, addr: SocketAddr, store_port: u16, to: usize, from: usize) {
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(1)) else { return };
    *sh.connections.lock().unwrap() += 1;
    let _ = s.set_write_timeout(Some(Duration::from_millis(500)));
    match kind {
        Kind::Garbage => {
            let seed = mix(addr.port() as u64);
            let bytes: Vec<u8> = (0..4096u64).map(|i| mix(seed ^ i) as u8).collect();
            let _ = s.write_all(&bytes);
        }
        Kind::Close => {}
        Kind::Silence => {
            let _ = nap(&sh.stop, Duration::from_secs(120));
        }
        Kind::Drip => {
            let mut i = 0u8;
            while !nap(&sh.stop, Duration::from_millis(100)) {
                i = i.wrapping_add(37);
                if s.write_all(&[i]).is_err() {
                    return;
                }
            }
        }
        Kind::WrongToken => {
            let id = communicator_id(store_port);
            let _ = s.write_all(&wrong_hello(id, from, to));
            drain(sh, &mut s);
        }
    }
}

/// The communicator id, read from the store as a stranger can on a store without a token;
/// random when the store does not give it.
fn communicator_id(store_port: u16) -> u64 {
    let addr = format!("127.0.0.1:{store_port}");
    TcpStore::connect(&addr, Duration::from_millis(500))
        .and_then(|st| st.get("toroid/gen1/id", Duration::from_millis(500)))
        .ok()
        .and_then(|v| <[u8; 8]>::try_from(v.as_slice()).ok())
        .map(u64::from_le_bytes)
        .unwrap_or_else(|| mix(store_port as u64))
}

/// An authenticating hello (the layout of `transport/tcp/handshake.rs`: magic `TRDH`, version,
/// kind 1, flag 1, communicator id, from, to), a nonce and an HMAC-SHA256 under a wrong token.
fn wrong_hello(id: u64, from: usize, to: usize) -> Vec<u8> {
    let mut h = Vec::with_capacity(24 + 16 + 32);
    h.extend_from_slice(b"TRDH");
    h.extend_from_slice(&toroid::internals::transport::tcp::PROTOCOL_VERSION.to_le_bytes());
    h.push(1);
    h.push(1);
    h.extend_from_slice(&id.to_le_bytes());
    h.extend_from_slice(&(from as u32).to_le_bytes());
    h.extend_from_slice(&(to as u32).to_le_bytes());
    let nonce: Vec<u8> = (0..16u64).map(|i| mix(id ^ i) as u8).collect();
    let mut mac = <hmac::Hmac<sha2::Sha256> as KeyInit>::new_from_slice(b"not the job's token").unwrap();
    mac.update(b"toroid hello");
    mac.update(&h);
    mac.update(&nonce);
    h.extend_from_slice(&nonce);
    h.extend_from_slice(&mac.finalize().into_bytes());
    h
}
