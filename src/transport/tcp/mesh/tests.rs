//! Unit tests of the TCP mesh set-up ([`super`]).

use super::super::handshake::{self, HELLO_LEN, KIND_HELLO, MAC_LEN, NONCE_LEN, check_hello_auth};
use super::*;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::BorrowedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

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
    mesh_lanes(tokens, opts, secs, vec![vec![1; n]; n])
}

/// [`mesh_of`] with `lanes[r]`: rank `r`'s lanes to each rank.
fn mesh_lanes(
    tokens: &[Option<&str>],
    opts: &SocketOptions,
    secs: u64,
    lanes: Vec<Vec<usize>>,
) -> Vec<Result<Mesh>> {
    let n = tokens.len();
    let eps: Vec<Endpoint> = (0..n).map(|_| listen(&lo(), n).expect("listen")).collect();
    let addrs: Vec<SocketAddr> = eps.iter().map(|e| e.addr).collect();
    let deadline = Instant::now() + Duration::from_secs(secs);
    let handles: Vec<_> = eps
        .into_iter()
        .zip(tokens)
        .zip(lanes)
        .enumerate()
        .map(|(r, ((ep, t), lanes))| {
            let (addrs, opts) = (addrs.clone(), opts.clone());
            let token = t.map(|t| AuthToken::new(t.as_bytes()));
            std::thread::spawn(move || {
                let m = connect_mesh(
                    &MeshSpec { rank: r, addrs: &addrs, comm_id: 99, lanes: &lanes, auth: token.as_ref() },
                    &ep,
                    Vec::new(),
                    &opts,
                    deadline,
                );
                (m, ep)
            })
        })
        .collect();
    // Every listener stays open until every rank is done, as a communicator's does (its
    // control plane keeps it): a rank that finished early does not refuse a late connection.
    let (meshes, _eps): (Vec<_>, Vec<_>) =
        handles.into_iter().map(|h| h.join().expect("rank thread")).unzip();
    meshes
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

/// Moves `msg` from `from` to `to` in as many writes and reads as it takes.
fn stream(from: &mut dyn Transport, to: &mut dyn Transport, msg: &[u8]) {
    let (mut sent, mut got, mut buf) = (0, 0, vec![0u8; msg.len()]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while got < msg.len() {
        assert!(Instant::now() < deadline, "stuck at {got} of {} bytes", msg.len());
        if sent < msg.len() {
            match from.try_write(&[&msg[sent..]]) {
                Ok(n) => sent += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => panic!("{e}"),
            }
        }
        match to.try_read(&mut [&mut buf[got..]]) {
            Ok(0) => panic!("closed"),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::yield_now(),
            Err(e) => panic!("{e}"),
        }
    }
    assert!(buf == msg, "bytes differ");
}

#[test]
fn striped_links_connect_lane_by_lane_with_authentication_and_carry_a_stream() {
    // Ranks 0-1 and 1-2 use three lanes, 0-2 one.
    let lanes = vec![vec![1, 3, 1], vec![3, 1, 3], vec![1, 3, 1]];
    let mut meshes: Vec<Mesh> = mesh_lanes(&[Some("tok"); 3], &SocketOptions::default(), 10, lanes)
        .into_iter()
        .map(|m| m.expect("striped mesh"))
        .collect();
    assert_eq!(meshes[0][1].as_ref().map(|t| t.kind()), Some("tcp-striped"));
    assert_eq!(meshes[0][2].as_ref().map(|t| t.kind()), Some("tcp"));
    let msg: Vec<u8> = (0..700_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    for (a, b) in [(0, 1), (1, 0), (2, 1), (0, 2)] {
        let mut from = meshes[a][b].take().expect("link");
        stream(&mut *from, &mut **meshes[b][a].as_mut().expect("link"), &msg);
        meshes[a][b] = Some(from);
    }
}

#[test]
fn ranks_that_disagree_on_lanes_fail_naming_the_setting() {
    // The connector opens more lanes than the acceptor takes: its extra lane is refused.
    let r = mesh_lanes(&[None, None], &SocketOptions::default(), 2, vec![vec![1, 2], vec![3, 1]]);
    let connector = r[1].as_ref().map(|_| ()).expect_err("the connector must fail").to_string();
    assert!(connector.contains("TOROID_NSOCKS"), "{connector}");
    // The acceptor waits for more lanes than the connector opens: it never gets them, and
    // the connector's link is useless to it (its first collective meets a closed peer).
    let r = mesh_lanes(&[None, None], &SocketOptions::default(), 2, vec![vec![1, 3], vec![2, 1]]);
    let acceptor = r[0].as_ref().map(|_| ()).expect_err("the acceptor must fail").to_string();
    assert!(acceptor.contains("never connected"), "{acceptor}");
}

#[test]
fn every_connection_gets_the_chosen_congestion_control() {
    // reno is built into every Linux kernel and always allowed.
    let opts = SocketOptions { congestion: Some("reno".into()), ..SocketOptions::default() };
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
    let opts = SocketOptions { congestion: Some("nosuchcc".into()), ..SocketOptions::default() };
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
        connect_mesh(
            &MeshSpec { rank: 1, addrs: &addrs, comm_id: 5, lanes: &[1, 1], auth: Some(&t) },
            &ep,
            Vec::new(),
            &SocketOptions::default(),
            deadline,
        )
        .map(|_| ())
    });
    let (mut s, _) = raw.accept().expect("accept");
    let mut sent = vec![0u8; HELLO_LEN + NONCE_LEN + MAC_LEN];
    s.read_exact(&mut sent).expect("hello, nonce and MAC");
    assert!(!sent.windows(token.len()).any(|w| w == token.as_bytes()));
    let mut h = [0u8; HELLO_LEN];
    h.copy_from_slice(&sent[..HELLO_LEN]);
    assert_eq!(handshake::check_hello(&h, KIND_HELLO, 5, 0, 2).expect("a valid hello"), 1);
    let extra = &sent[HELLO_LEN..];
    check_hello_auth(&h, Some(extra), Some(&AuthToken::new(token.as_bytes()))).expect("MAC under the token");
    assert!(check_hello_auth(&h, Some(extra), Some(&AuthToken::new(b"other"))).is_err());
    drop(s); // no ack: the connector fails
    assert!(connector.join().expect("connector thread").is_err());
}

/// What a stranger does to a rank's listener during set-up.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Attack {
    /// Connects, then closes at once.
    Close,
    /// Connects and sends nothing.
    Silent,
    /// Sends a valid-looking hello one byte every 100 ms.
    Drip,
    /// Sends 64 KiB of garbage.
    Garbage,
    /// Sends a hello whose MAC is under another token.
    WrongMac,
    /// Once rank 1 is connected, claims rank 1 (to rank 0) or rank 0 (to rank 1) on a
    /// second connection, with a hello that is valid without a token.
    Duplicate,
}

/// The communicator id of [`mesh_of`] and [`mesh_attacked`].
const COMM: u64 = 99;
/// Rank 2 starts this much later than ranks 0 and 1, so that strangers meet a set-up that
/// is waiting for a genuine peer.
const STAGGER: Duration = Duration::from_millis(300);

/// Connects a stranger to `addr` (rank `to`'s listener) now and runs `attack` on a thread
/// until `stop`.
fn stranger(
    attack: Attack,
    addr: SocketAddr,
    to: usize,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<()> {
    let mut s = TcpStream::connect(addr).expect("a stranger connects");
    s.set_write_timeout(Some(Duration::from_secs(2))).expect("SO_SNDTIMEO");
    // A plausible claim: the highest rank, which every lower listener expects.
    let claim = if to < 2 { 2 } else { 0 };
    std::thread::spawn(move || {
        let wait_stop = || {
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(10));
            }
        };
        match attack {
            Attack::Close => drop(s),
            Attack::Silent => wait_stop(),
            Attack::Drip => {
                let (msg, _) = handshake::hello_message(COMM, claim, to, None, 0).expect("hello");
                for b in msg {
                    if stop.load(Ordering::Relaxed) || s.write_all(&[b]).is_err() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
                wait_stop();
            }
            Attack::Garbage => {
                let _ = s.write_all(&vec![0xA5; 64 << 10]);
                wait_stop();
            }
            Attack::WrongMac => {
                let wrong = AuthToken::new(b"not the job's token");
                let (msg, _) = handshake::hello_message(COMM, claim, to, Some(&wrong), 0).expect("hello");
                let _ = s.write_all(&msg);
                wait_stop();
            }
            Attack::Duplicate => {
                // By now rank 1 has long connected to rank 0 (rank 2 is still to come).
                std::thread::sleep(STAGGER / 2);
                let claim = if to == 0 { 1 } else { 0 };
                let (msg, _) = handshake::hello_message(COMM, claim, to, None, 0).expect("hello");
                let _ = s.write_all(&msg);
                wait_stop();
            }
        }
    })
}

/// Connects 3 ranks (threads, rank 2 started [`STAGGER`] late) with `token`, with a stranger
/// running `attack` on every listener from before set-up starts. Each rank's mesh and how
/// long its set-up took.
fn mesh_attacked(token: Option<&str>, attack: Option<Attack>) -> Vec<(Mesh, Duration)> {
    let n = 3;
    let eps: Vec<Endpoint> = (0..n).map(|_| listen(&lo(), n).expect("listen")).collect();
    let addrs: Vec<SocketAddr> = eps.iter().map(|e| e.addr).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let strangers: Vec<_> =
        attack.map(|a| (0..n).map(|r| stranger(a, addrs[r], r, stop.clone())).collect()).unwrap_or_default();
    let start = Instant::now();
    let deadline = start + Duration::from_secs(10);
    let ranks: Vec<_> = eps
        .into_iter()
        .enumerate()
        .map(|(r, ep)| {
            let addrs = addrs.clone();
            let token = token.map(|t| AuthToken::new(t.as_bytes()));
            std::thread::spawn(move || {
                if r == 2 {
                    std::thread::sleep(STAGGER);
                }
                let m = connect_mesh(
                    &MeshSpec {
                        rank: r,
                        addrs: &addrs,
                        comm_id: COMM,
                        lanes: &vec![1; addrs.len()],
                        auth: token.as_ref(),
                    },
                    &ep,
                    Vec::new(),
                    &SocketOptions::default(),
                    deadline,
                );
                (m, start.elapsed())
            })
        })
        .collect();
    let out: Vec<_> = ranks
        .into_iter()
        .enumerate()
        .map(|(r, h)| {
            let (m, took) = h.join().expect("rank thread");
            (m.unwrap_or_else(|e| panic!("{attack:?}, token {token:?}: rank {r} failed: {e}")), took)
        })
        .collect();
    stop.store(true, Ordering::Relaxed);
    for s in strangers {
        s.join().expect("stranger thread");
    }
    out
}

/// Set-up with a stranger running `attack` on every listener succeeds on every rank, with
/// and without a token, every link reaches the genuine peer, and no rank waits for the
/// stranger (its handshake allowance is 5 s, a drip of a hello takes 2.4 s or more).
fn survives(attack: Attack) {
    for token in [None, Some("s3cret")] {
        let base = mesh_attacked(token, None).iter().map(|m| m.1).max().expect("ranks");
        let mut meshes = mesh_attacked(token, Some(attack));
        for (r, (_, took)) in meshes.iter().enumerate() {
            assert!(
                *took < base + Duration::from_secs(1),
                "{attack:?}, token {token:?}: rank {r} took {took:?}, {base:?} without the stranger"
            );
        }
        for p in 1..3 {
            for r in 0..p {
                let mut link = meshes[p].0[r].take().expect("link");
                let msg = format!("from {p} to {r}");
                send_and_receive(&mut *link, &mut **meshes[r].0[p].as_mut().expect("link"), msg.as_bytes());
            }
        }
    }
}

#[test]
fn a_stranger_that_connects_and_closes_does_not_fail_set_up() {
    survives(Attack::Close);
}

#[test]
fn a_silent_stranger_does_not_fail_or_delay_set_up() {
    survives(Attack::Silent);
}

#[test]
fn a_stranger_dripping_a_hello_does_not_fail_or_delay_set_up() {
    survives(Attack::Drip);
}

#[test]
fn a_stranger_sending_garbage_does_not_fail_set_up() {
    survives(Attack::Garbage);
}

#[test]
fn a_stranger_with_a_wrong_mac_does_not_fail_set_up() {
    survives(Attack::WrongMac);
}

#[test]
fn a_second_connection_claiming_a_connected_rank_is_dropped() {
    survives(Attack::Duplicate);
}

/// Reads what `s` receives until it closes or `limit` passes; whether it closed.
fn closed_within(s: &mut TcpStream, limit: Duration) -> bool {
    s.set_read_timeout(Some(limit)).expect("SO_RCVTIMEO");
    let mut buf = [0u8; 128];
    matches!(s.read(&mut buf), Ok(0))
        || matches!(s.read(&mut buf), Err(e) if e.kind() == io::ErrorKind::ConnectionReset)
}

#[test]
fn a_silent_connection_is_dropped_at_its_own_deadline_and_set_up_goes_on() {
    // Rank 0 of 2 waits for rank 1, which joins only after the strangers' allowance.
    let allowance = Duration::from_millis(800);
    let ep = listen(&lo(), 2).expect("listen");
    let mut silent = TcpStream::connect(ep.addr).expect("connect");
    let mut dripping = TcpStream::connect(ep.addr).expect("connect");
    let peer = listen(&lo(), 2).expect("listen");
    let addrs = vec![ep.addr, peer.addr];
    let deadline = Instant::now() + Duration::from_secs(10);
    let a = addrs.clone();
    let rank0 = std::thread::spawn(move || {
        let ctx = Ctx { rank: 0, size: 2, comm_id: COMM, auth: None, lanes: &[1, 1] };
        let mut mesh = MeshLoop::new(ctx, &a, &ep.listener, deadline).expect("set-up");
        mesh.allowance = allowance;
        mesh.run().map(|links| links.iter().filter(|l| !l.is_empty()).count())
    });
    let start = Instant::now();
    // Bytes trickling in every 100 ms do not extend a connection's deadline.
    let drip = std::thread::spawn(move || {
        while start.elapsed() < allowance * 3 {
            if dripping.write_all(b"T").is_err() {
                return Some(start.elapsed());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        None
    });
    assert!(closed_within(&mut silent, allowance * 3), "silent connection kept");
    let held = start.elapsed();
    assert!(held >= allowance - Duration::from_millis(100), "dropped after {held:?}");
    let cut = drip.join().expect("drip thread").expect("dripping connection kept past its allowance");
    assert!(cut < allowance * 2, "dripping connection dropped only after {cut:?}");
    let rank1 = connect_mesh(
        &MeshSpec { rank: 1, addrs: &addrs, comm_id: COMM, lanes: &[1, 1], auth: None },
        &peer,
        Vec::new(),
        &SocketOptions::default(),
        deadline,
    );
    assert!(rank1.is_ok(), "{:?}", rank1.err());
    assert_eq!(rank0.join().expect("rank 0").expect("rank 0 connects"), 1);
}

#[test]
fn a_flood_of_silent_connections_does_not_block_genuine_peers() {
    // More silent strangers than MAX_STRANGERS on every listener, all before set-up starts
    // (non-blocking connects, so those beyond the backlog complete as the ranks accept).
    let n = 3;
    let eps: Vec<Endpoint> = (0..n).map(|_| listen(&lo(), n).expect("listen")).collect();
    let addrs: Vec<SocketAddr> = eps.iter().map(|e| e.addr).collect();
    let flood: Vec<TcpStream> = addrs
        .iter()
        .flat_map(|a| {
            (0..MAX_STRANGERS + 36).map(|_| crate::sys::socket::connect_nonblocking(a).expect("connect"))
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    let start = Instant::now();
    let ranks: Vec<_> = eps
        .into_iter()
        .enumerate()
        .map(|(r, ep)| {
            let addrs = addrs.clone();
            std::thread::spawn(move || {
                connect_mesh(
                    &MeshSpec {
                        rank: r,
                        addrs: &addrs,
                        comm_id: COMM,
                        lanes: &vec![1; addrs.len()],
                        auth: None,
                    },
                    &ep,
                    Vec::new(),
                    &SocketOptions::default(),
                    deadline,
                )
            })
        })
        .collect();
    for (r, h) in ranks.into_iter().enumerate() {
        let m = h.join().expect("rank thread").unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!(m.iter().filter(|l| l.is_some()).count(), n - 1, "rank {r}");
    }
    assert!(start.elapsed() < Duration::from_secs(2), "set-up took {:?}", start.elapsed());
    drop(flood);
}

#[test]
fn connections_accepted_before_set_up_count_and_strangers_among_them_are_dropped() {
    // A shrink feeds in what the control plane accepted: here rank 1's genuine connection
    // and a stranger's garbage, both accepted before rank 0 starts its mesh.
    let eps: Vec<Endpoint> = (0..2).map(|_| listen(&lo(), 2).expect("listen")).collect();
    let addrs: Vec<SocketAddr> = eps.iter().map(|e| e.addr).collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut stranger = TcpStream::connect(addrs[0]).expect("stranger connects");
    stranger.write_all(&[0xee; HELLO_LEN]).expect("stranger writes");
    let mut eps = eps.into_iter();
    let (ep0, ep1) = (eps.next().unwrap(), eps.next().unwrap());
    let a1 = addrs.clone();
    let rank1 = std::thread::spawn(move || {
        connect_mesh(
            &MeshSpec { rank: 1, addrs: &a1, comm_id: 42, lanes: &[1, 1], auth: None },
            &ep1,
            Vec::new(),
            &SocketOptions::default(),
            deadline,
        )
    });
    let mut accepted = Vec::new();
    while accepted.len() < 2 {
        assert!(Instant::now() < deadline, "connections never arrived");
        match ep0.listener.accept() {
            Ok(c) => accepted.push(c),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => panic!("{e}"),
        }
    }
    // Nothing else will connect: rank 0 can only finish with what it was handed.
    let mut m0 = connect_mesh(
        &MeshSpec { rank: 0, addrs: &addrs, comm_id: 42, lanes: &[1, 1], auth: None },
        &ep0,
        accepted,
        &SocketOptions::default(),
        deadline,
    )
    .expect("rank 0");
    let mut m1 = rank1.join().expect("rank 1 thread").expect("rank 1");
    let (t0, t1) = (m0[1].as_deref_mut().expect("link 0-1"), m1[0].as_deref_mut().expect("link 1-0"));
    send_and_receive(t0, t1, b"shrunk");
    let mut b = [0u8; 1];
    assert!(matches!(stranger.read(&mut b), Ok(0) | Err(_)), "the stranger must be dropped unanswered");
}
