//! Setting up the mesh: every rank listens on its address; rank `j` connects to every lower
//! rank `i < j` and accepts from every higher one, and each connection is checked with the
//! handshake of [`super::handshake`] both ways before it becomes a [`TcpTransport`].

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd};
use std::time::{Duration, Instant};

use super::handshake::{self, HELLO_LEN, Hello, KIND_ACK, KIND_HELLO, MAC_LEN, NONCE_LEN, Nonce};
use super::{Interface, SocketOptions, TcpTransport};
use crate::config::AuthToken;
use crate::error::{Error, Result};
use crate::sys::poll::{PollFd, poll};
use crate::transport::Transport;

/// Where this rank listens, and the interface that address belongs to.
#[derive(Debug)]
pub struct Endpoint {
    /// The listening socket (non-blocking).
    pub listener: TcpListener,
    /// The address peers connect to.
    pub addr: SocketAddr,
    /// Interface name the address was taken from ("" when chosen by route only).
    pub ifname: String,
}

/// Opens the listening socket on `iface`.
pub fn listen(iface: &Interface, backlog_hint: usize) -> Result<Endpoint> {
    let listener = TcpListener::bind((iface.addr, 0))
        .map_err(|e| Error::system(format!("binding a listener on {} ({})", iface.addr, iface.name), e))?;
    // std's default backlog (128) covers the peers that connect before we accept; raise it for
    // very large worlds.
    if backlog_hint > 128 {
        let _ = crate::sys::socket::set_backlog(listener.as_fd(), backlog_hint);
    }
    listener.set_nonblocking(true).map_err(|e| Error::system("O_NONBLOCK on listener", e))?;
    let addr = listener.local_addr().map_err(|e| Error::system("getsockname", e))?;
    Ok(Endpoint { listener, addr, ifname: iface.name.clone() })
}

fn remaining(deadline: Instant) -> Result<Duration> {
    let d = deadline.saturating_duration_since(Instant::now());
    if d.is_zero() {
        return Err(Error::Timeout("connecting to peers: deadline passed".into()));
    }
    Ok(d)
}

fn read_hello(s: &mut TcpStream, deadline: Instant, what: &str) -> Result<Hello> {
    let mut h = [0u8; HELLO_LEN];
    read_exact_by(s, &mut h, deadline, what)?;
    Ok(h)
}

fn read_exact_by(s: &mut TcpStream, buf: &mut [u8], deadline: Instant, what: &str) -> Result<()> {
    s.set_read_timeout(Some(remaining(deadline)?)).map_err(|e| Error::system("SO_RCVTIMEO", e))?;
    s.read_exact(buf).map_err(|e| match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
            Error::Timeout(format!("{what}: no handshake before the deadline").into())
        }
        _ => Error::Remote(format!("{what}: handshake failed: {e}").into()),
    })
}

/// Connects this rank to every other rank: connects to lower ranks, accepts higher ones, and
/// checks the handshake both ways. Returns one transport per rank (`None` at `rank`).
pub fn connect_mesh(
    rank: usize,
    addrs: &[SocketAddr],
    endpoint: &Endpoint,
    comm_id: u64,
    opts: &SocketOptions,
    auth: Option<&AuthToken>,
    deadline: Instant,
) -> Result<Vec<Option<Box<dyn Transport>>>> {
    let size = addrs.len();
    let setup = Setup { rank, size, comm_id, auth, deadline };
    let mut streams: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
    // The nonce each connection to a lower rank sent, which that rank's ack must answer.
    let mut nonces: Vec<Nonce> = vec![[0; NONCE_LEN]; rank];
    // 1. Connect to every lower rank and say hello (the listener's backlog holds us until it
    //    accepts, so this never waits for the peer's code to run).
    for (peer, addr) in addrs.iter().enumerate().take(rank) {
        let mut s = setup.connect(peer, addr)?;
        s.set_write_timeout(Some(remaining(deadline)?)).map_err(|e| Error::system("SO_SNDTIMEO", e))?;
        let (msg, n) = handshake::hello_message(comm_id, rank, peer, auth)?;
        nonces[peer] = n;
        s.write_all(&msg).map_err(|e| {
            Error::Remote(format!("rank {rank}: hello to rank {peer} at {addr} failed: {e}").into())
        })?;
        streams[peer] = Some(s);
    }
    // 2. Accept every higher rank, check its hello, ack it.
    setup.accept_higher(&endpoint.listener, &mut streams)?;
    // 3. Read the acks of the lower ranks.
    for (peer, s) in streams.iter_mut().enumerate().take(rank) {
        let s = s.as_mut().ok_or_else(|| Error::Internal("missing stream".into()))?;
        setup.check_ack(peer, s, &nonces[peer])?;
    }
    let mut out: Vec<Option<Box<dyn Transport>>> = Vec::with_capacity(size);
    for s in streams {
        out.push(match s {
            Some(s) => {
                s.set_read_timeout(None).map_err(|e| Error::system("SO_RCVTIMEO", e))?;
                s.set_write_timeout(None).map_err(|e| Error::system("SO_SNDTIMEO", e))?;
                Some(Box::new(TcpTransport::new(s, opts)?) as Box<dyn Transport>)
            }
            None => None,
        });
    }
    Ok(out)
}

/// What every step of one rank's set-up shares.
struct Setup<'a> {
    rank: usize,
    size: usize,
    comm_id: u64,
    auth: Option<&'a AuthToken>,
    deadline: Instant,
}

impl Setup<'_> {
    /// Connects to rank `peer` at `addr`, retrying while it is not listening yet.
    fn connect(&self, peer: usize, addr: &SocketAddr) -> Result<TcpStream> {
        let (rank, deadline) = (self.rank, self.deadline);
        loop {
            match TcpStream::connect_timeout(addr, remaining(deadline)?.min(Duration::from_secs(5))) {
                Ok(s) => return Ok(s),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::ConnectionRefused
                            | io::ErrorKind::TimedOut
                            | io::ErrorKind::WouldBlock
                    ) =>
                {
                    if remaining(deadline).is_err() {
                        return Err(Error::Timeout(
                            format!("rank {rank}: could not connect to rank {peer} at {addr}: {e}").into(),
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => {
                    return Err(Error::system(
                        format!("rank {rank}: connecting to rank {peer} at {addr}"),
                        e,
                    ));
                }
            }
        }
    }

    /// Accepts every rank above this one on `listener`, checks its hello and acks it. A
    /// connection that fails the check is dropped with a WARN: a foreign or stale connection
    /// must not kill the job.
    fn accept_higher(&self, listener: &TcpListener, streams: &mut [Option<TcpStream>]) -> Result<()> {
        let Setup { rank, size, comm_id, auth, deadline } = *self;
        let mut pending = size - rank - 1;
        while pending > 0 {
            match listener.accept() {
                Ok((mut s, from_addr)) => {
                    s.set_nonblocking(false).map_err(|e| Error::system("accepted socket", e))?;
                    let h =
                        read_hello(&mut s, deadline, &format!("rank {rank}: connection from {from_addr}"))?;
                    let checked = handshake::check_hello(&h, KIND_HELLO, comm_id, rank, size).and_then(|f| {
                        let mut extra = [0u8; NONCE_LEN + MAC_LEN];
                        let announced = handshake::announces_auth(&h);
                        if announced {
                            read_exact_by(&mut s, &mut extra, deadline, "the authentication after a hello")?;
                        }
                        handshake::check_hello_auth(&h, announced.then_some(&extra[..]), auth)?;
                        Ok((f, extra))
                    });
                    let (from, extra) = match checked {
                        Ok(x) => x,
                        Err(e) => {
                            tracing::warn!(target: "toroid::net", "rank {rank}: rejected connection from {from_addr}: {e}");
                            continue;
                        }
                    };
                    if from < rank || streams[from].is_some() {
                        tracing::warn!(target: "toroid::net", "rank {rank}: unexpected second connection from rank {from}; dropped");
                        continue;
                    }
                    s.set_write_timeout(Some(remaining(deadline)?))
                        .map_err(|e| Error::system("SO_SNDTIMEO", e))?;
                    let msg = handshake::ack_message(comm_id, rank, from, auth, &extra);
                    s.write_all(&msg).map_err(|e| {
                        Error::Remote(format!("rank {rank}: ack to rank {from} failed: {e}").into())
                    })?;
                    streams[from] = Some(s);
                    pending -= 1;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let left = remaining(deadline).map_err(|_| {
                        let missing: Vec<usize> =
                            (rank + 1..size).filter(|r| streams[*r].is_none()).collect();
                        Error::Timeout(
                            format!("rank {rank}: ranks {missing:?} never connected before the deadline")
                                .into(),
                        )
                    })?;
                    let mut fds = [PollFd::new(listener.as_raw_fd(), PollFd::IN)];
                    let _ = poll(&mut fds, left.as_millis().clamp(1, 1000) as i32);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::system("accept", e)),
            }
        }
        Ok(())
    }

    /// Reads and checks the ack of rank `peer` on `s`, which answers the hello that sent `nonce`.
    fn check_ack(&self, peer: usize, s: &mut TcpStream, nonce: &Nonce) -> Result<()> {
        let rank = self.rank;
        let what = format!("rank {rank}: waiting for rank {peer}'s ack");
        let h = read_hello(s, self.deadline, &what).map_err(|e| match e {
            // A peer that rejects our hello closes the connection without an ack.
            Error::Remote(m) => Error::Remote(
                format!(
                    "{m} (rank {peer} drops connections whose TOROID_AUTH_TOKEN, communicator or protocol \
                 version differ from its own; its log says which)"
                )
                .into(),
            ),
            e => e,
        })?;
        let from = handshake::check_hello(&h, KIND_ACK, self.comm_id, rank, self.size)?;
        if let Some(t) = self.auth {
            let mut tag = [0u8; MAC_LEN];
            read_exact_by(s, &mut tag, self.deadline, &what)?;
            if !handshake::ack_is_authentic(&h, &tag, nonce, t) {
                return Err(Error::Remote(
                    format!(
                        "rank {rank}: rank {peer} failed authentication (a different TOROID_AUTH_TOKEN?)"
                    )
                    .into(),
                ));
            }
        }
        if from != peer {
            return Err(Error::Remote(
                format!("rank {rank}: ack from rank {from} on the connection to rank {peer}").into(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::handshake::check_hello_auth;
    use super::*;
    use std::net::{IpAddr, Ipv4Addr};
    use std::os::fd::BorrowedFd;

    type Mesh = Vec<Option<Box<dyn Transport>>>;

    fn lo() -> Interface {
        Interface { name: "lo".into(), addr: IpAddr::V4(Ipv4Addr::LOCALHOST) }
    }

    /// Connects `tokens.len()` ranks (threads) with those tokens; each rank's result.
    fn mesh_with(tokens: &[Option<&str>], secs: u64) -> Vec<Result<Mesh>> {
        mesh_of(tokens, &SocketOptions::default(), secs)
    }

    /// Connects `n` ranks (threads) with these socket options; each rank's result.
    fn mesh_opts(n: usize, opts: &SocketOptions) -> Vec<Result<Mesh>> {
        mesh_of(&vec![None; n], opts, 10)
    }

    /// Connects `tokens.len()` ranks (threads) with those tokens and socket options.
    fn mesh_of(tokens: &[Option<&str>], opts: &SocketOptions, secs: u64) -> Vec<Result<Mesh>> {
        let n = tokens.len();
        let eps: Vec<Endpoint> = (0..n).map(|_| listen(&lo(), n).expect("listen")).collect();
        let addrs: Vec<SocketAddr> = eps.iter().map(|e| e.addr).collect();
        let deadline = Instant::now() + Duration::from_secs(secs);
        let handles: Vec<_> = eps
            .into_iter()
            .zip(tokens)
            .enumerate()
            .map(|(r, (ep, t))| {
                let (addrs, opts) = (addrs.clone(), opts.clone());
                let token = t.map(|t| AuthToken::new(t.as_bytes()));
                std::thread::spawn(move || connect_mesh(r, &addrs, &ep, 99, &opts, token.as_ref(), deadline))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    }

    /// Writes `msg` on `from` and reads it back whole on `to`.
    fn send_and_receive(from: &mut dyn Transport, to: &mut dyn Transport, msg: &[u8]) {
        assert_eq!(from.try_write(&[msg]).expect("write"), msg.len());
        let mut buf = vec![0u8; msg.len()];
        let mut got = 0;
        while got < buf.len() {
            match to.try_read(&mut [&mut buf[got..]]) {
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::yield_now(),
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(buf, msg);
    }

    /// The congestion control of a link.
    fn congestion(t: &dyn Transport) -> String {
        // SAFETY: the descriptor belongs to `t`, which outlives this borrow.
        let fd = unsafe { BorrowedFd::borrow_raw(t.pollable()) };
        super::super::congestion_of(fd).expect("getsockopt")
    }

    #[test]
    fn mesh_of_three_threads_connects_and_moves_bytes() {
        let mut meshes: Vec<Mesh> =
            mesh_opts(3, &SocketOptions::default()).into_iter().map(|m| m.unwrap()).collect();
        for (r, m) in meshes.iter().enumerate() {
            for (p, t) in m.iter().enumerate() {
                assert_eq!(t.is_some(), r != p);
            }
        }
        let mut link_2_0 = meshes[2][0].take().unwrap();
        send_and_receive(&mut *link_2_0, &mut **meshes[0][2].as_mut().unwrap(), b"hello from 2");
    }

    #[test]
    fn every_connection_gets_the_chosen_congestion_control() {
        // reno is built into every Linux kernel and always allowed.
        let opts = SocketOptions { buffer: 0, congestion: Some("reno".into()) };
        let before = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control").unwrap_or_default();
        for (r, m) in mesh_opts(3, &opts).into_iter().enumerate() {
            let m = m.expect("mesh with reno");
            for (p, t) in m.iter().enumerate() {
                if let Some(t) = t {
                    assert_eq!(congestion(&**t), "reno", "rank {r} -> {p}");
                }
            }
        }
        // Without the option the system default stays.
        let default = before.trim();
        if !default.is_empty() {
            for m in mesh_opts(2, &SocketOptions::default()) {
                let m = m.expect("mesh");
                let t = m.iter().flatten().next().expect("a link");
                assert_eq!(congestion(&**t), default);
            }
        }
    }

    #[test]
    fn an_unknown_congestion_control_fails_every_rank_with_the_variable_named() {
        let opts = SocketOptions { buffer: 0, congestion: Some("nosuchcc".into()) };
        for (r, m) in mesh_opts(3, &opts).into_iter().enumerate() {
            let e = m.err().unwrap_or_else(|| panic!("rank {r} connected")).to_string();
            assert!(e.contains("TOROID_TCP_CONGESTION=nosuchcc") && e.contains("available"), "rank {r}: {e}");
        }
    }

    #[test]
    fn ranks_sharing_a_token_connect_and_move_bytes() {
        let mut meshes: Vec<_> =
            mesh_with(&[Some("s3cret"); 3], 10).into_iter().map(|m| m.expect("authenticated mesh")).collect();
        let mut link_1_2 = meshes[1][2].take().expect("link");
        send_and_receive(&mut *link_1_2, &mut **meshes[2][1].as_mut().expect("link"), b"authenticated");
    }

    /// Rank 1 connects to rank 0; both must fail, the connector with a hint and the acceptor
    /// (which drops the connection and keeps waiting for a genuine peer) at its deadline.
    fn refused(tokens: [Option<&str>; 2]) {
        let r = mesh_with(&tokens, 2);
        let connector = r[1].as_ref().map(|_| ()).expect_err("the connector must fail").to_string();
        assert!(connector.contains("TOROID_AUTH_TOKEN"), "{tokens:?}: {connector}");
        let acceptor = r[0].as_ref().map(|_| ()).expect_err("the acceptor must fail").to_string();
        assert!(acceptor.contains("never connected"), "{tokens:?}: {acceptor}");
    }

    #[test]
    fn a_different_token_is_refused() {
        refused([Some("one"), Some("two")]);
    }

    #[test]
    fn a_token_on_one_side_only_is_refused() {
        refused([Some("one"), None]);
        refused([None, Some("one")]);
    }

    #[test]
    fn the_token_never_goes_on_the_wire_and_the_hello_carries_its_mac() {
        let token = "a-long-and-recognisable-secret";
        let raw = TcpListener::bind("127.0.0.1:0").expect("bind");
        let ep = listen(&lo(), 2).expect("listen");
        let addrs = vec![raw.local_addr().expect("addr"), ep.addr];
        let deadline = Instant::now() + Duration::from_secs(2);
        let connector = std::thread::spawn(move || {
            let t = AuthToken::new(token.as_bytes());
            connect_mesh(1, &addrs, &ep, 5, &SocketOptions::default(), Some(&t), deadline).map(|_| ())
        });
        let (mut s, _) = raw.accept().expect("accept");
        let mut sent = vec![0u8; HELLO_LEN + NONCE_LEN + MAC_LEN];
        s.read_exact(&mut sent).expect("hello, nonce and MAC");
        assert!(!sent.windows(token.len()).any(|w| w == token.as_bytes()));
        let mut h = [0u8; HELLO_LEN];
        h.copy_from_slice(&sent[..HELLO_LEN]);
        assert_eq!(handshake::check_hello(&h, KIND_HELLO, 5, 0, 2).expect("a valid hello"), 1);
        let extra = &sent[HELLO_LEN..];
        check_hello_auth(&h, Some(extra), Some(&AuthToken::new(token.as_bytes())))
            .expect("MAC under the token");
        assert!(check_hello_auth(&h, Some(extra), Some(&AuthToken::new(b"other"))).is_err());
        drop(s); // no ack: the connector fails
        assert!(connector.join().expect("connector thread").is_err());
    }
}
