//! Unit tests of connecting on demand ([`super`]).

use super::super::handshake;
use super::super::{Interface, listen};
use super::*;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

const COMM: u64 = 4242;

fn ctx(rank: usize, size: usize, auth: Option<&str>) -> LazyCtx {
    LazyCtx {
        rank,
        size,
        comm_id: COMM,
        auth: auth.map(|t| AuthToken::new(t.as_bytes())),
        lanes: vec![1; size],
        rdma: Vec::new(),
        rdma_cfg: None,
        shm: Vec::new(),
        shm_opts: None,
    }
}

/// Rank 0 of `size` with its listener served by a control thread that feeds an inbox; the
/// addresses (rank 0's real, the others unused) and a stop function.
struct Served {
    inbox: Arc<Inbox>,
    addrs: Arc<[SocketAddr]>,
    stop: Arc<EventFd>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Served {
    fn new(size: usize, auth: Option<&str>) -> Served {
        let lo = Interface { name: "lo".into(), addr: IpAddr::V4(Ipv4Addr::LOCALHOST) };
        let ep = listen(&lo, size).expect("listen");
        let mut addrs = vec![ep.addr; size];
        // Ranks above 0 never listen in these tests: their addresses refuse.
        let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr");
        for a in addrs.iter_mut().skip(1) {
            *a = closed;
        }
        let inbox = Arc::new(Inbox::new(ctx(0, size, auth)).expect("inbox"));
        let stop = Arc::new(EventFd::new().expect("eventfd"));
        let (i, s) = (inbox.clone(), stop.clone());
        let cctx = control::ControlCtx {
            rank: 0,
            size,
            comm_id: COMM,
            auth: auth.map(|t| AuthToken::new(t.as_bytes())),
            encrypt: false,
        };
        let thread = std::thread::spawn(move || {
            let answer = |_: u8, _: usize| Vec::new();
            let _ = control::serve(&ep.listener, &cctx, s.as_raw_fd(), &answer, Some(&i));
        });
        Served { inbox, addrs: addrs.into(), stop, thread: Some(thread) }
    }

    fn dialer(&self, rank: usize, auth: Option<&str>) -> Dialer {
        let size = self.addrs.len();
        let own = Arc::new(Inbox::new(ctx(rank, size, auth)).expect("inbox"));
        Dialer::new(ctx(rank, size, auth), self.addrs.clone(), SocketOptions::default(), own)
    }

    /// What rank 0's engine takes within `limit`.
    fn take(&self, want: usize, limit: Duration) -> Vec<(usize, Box<dyn Transport>)> {
        let mut d = Dialer::new(
            ctx(0, self.addrs.len(), None),
            self.addrs.clone(),
            SocketOptions::default(),
            self.inbox.clone(),
        );
        let end = Instant::now() + limit;
        let mut got = Vec::new();
        while got.len() < want && Instant::now() < end {
            got.extend(d.arrived().expect("arrived"));
            let mut fds = [PollFd::new(d.arrival_fd(), PollFd::IN)];
            let _ = poll(&mut fds, 50);
        }
        got
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.stop.signal();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn roundtrip(a: &mut dyn Transport, b: &mut dyn Transport) {
    let msg = b"on demand";
    assert_eq!(a.try_write(&[msg]).expect("write"), msg.len());
    let mut buf = [0u8; 9];
    let mut got = 0;
    let end = Instant::now() + Duration::from_secs(5);
    while got < buf.len() && Instant::now() < end {
        match b.try_read(&mut [&mut buf[got..]]) {
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::yield_now(),
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(&buf, msg);
}

#[test]
fn a_dial_is_accepted_by_the_control_thread_with_and_without_a_token() {
    for auth in [None, Some("s3cret")] {
        let served = Served::new(3, auth);
        let abort = AbortSignal::new().expect("abort");
        let mut d2 = served.dialer(2, auth);
        assert!(d2.dials(0) && d2.dials(1) && !d2.dials(2));
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut t = d2.dial(0, deadline, &abort).expect("dial");
        let mut got = served.take(1, Duration::from_secs(5));
        assert_eq!(got.len(), 1, "token {auth:?}");
        assert_eq!(got[0].0, 2);
        roundtrip(t.as_mut(), got[0].1.as_mut());
        assert_eq!(d2.sockets(), 1);
    }
}

#[test]
fn strangers_and_a_second_claim_are_dropped_and_the_genuine_link_goes_through() {
    let served = Served::new(3, None);
    let addr = served.addrs[0];
    let mut garbage = TcpStream::connect(addr).expect("connect");
    garbage.write_all(&[0xA5; 200]).expect("write");
    let _silent = TcpStream::connect(addr).expect("connect");
    let abort = AbortSignal::new().expect("abort");
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut t = served.dialer(1, None).dial(0, deadline, &abort).expect("dial");
    let mut got = served.take(1, Duration::from_secs(5));
    assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), vec![1]);
    roundtrip(t.as_mut(), got[0].1.as_mut());
    // A second connection claiming rank 1 lane 0: no ack, and nothing reaches the engine.
    let mut dup = TcpStream::connect(addr).expect("connect");
    let (hello, _) = handshake::hello_message(COMM, 1, 0, None, 0).expect("hello");
    dup.write_all(&hello).expect("write");
    dup.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    let mut b = [0u8; 1];
    assert!(matches!(dup.read(&mut b), Ok(0) | Err(_)), "a second claim must get no ack");
    assert!(served.take(1, Duration::from_millis(300)).is_empty());
    // The garbage connection was dropped too.
    garbage.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    assert!(matches!(garbage.read(&mut b), Ok(0) | Err(_)));
}

#[test]
fn after_close_a_later_link_gets_the_abort_frame() {
    let served = Served::new(2, None);
    served.inbox.close(b"ABORT-FRAME");
    let abort = AbortSignal::new().expect("abort");
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut t = served.dialer(1, None).dial(0, deadline, &abort).expect("the handshake still completes");
    let mut buf = [0u8; 11];
    let mut got = 0;
    let end = Instant::now() + Duration::from_secs(5);
    while got < buf.len() && Instant::now() < end {
        match t.try_read(&mut [&mut buf[got..]]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
    assert_eq!(&buf[..got], b"ABORT-FRAME");
    assert!(served.take(1, Duration::from_millis(200)).is_empty());
}

#[test]
fn a_dial_to_a_process_that_is_gone_fails_at_once() {
    let served = Served::new(3, None);
    let abort = AbortSignal::new().expect("abort");
    let t = Instant::now();
    let e = served.dialer(2, None).dial(1, t + Duration::from_secs(30), &abort).unwrap_err();
    assert!(e.to_string().contains("gone"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    assert!(served.dialer(2, None).peer_gone(1).is_some());
    assert!(served.dialer(2, None).peer_gone(0).is_none());
}
