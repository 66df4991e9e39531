//! Unit tests of the control connection ([`super`]).

use super::*;
use crate::sys::eventfd::EventFd;
use std::net::Ipv4Addr;

fn ctx(rank: usize, token: Option<&str>) -> ControlCtx {
    ControlCtx {
        rank,
        size: 4,
        comm_id: 0x5eed,
        auth: token.map(|t| AuthToken::new(t.as_bytes())),
        encrypt: false,
    }
}

/// As [`ctx`], with encryption.
fn ctx_tls(rank: usize, token: &str) -> ControlCtx {
    ControlCtx { encrypt: true, ..ctx(rank, Some(token)) }
}

/// Serves rank 2's listener on a thread until the returned closure stops it (it returns
/// what was parked).
fn server(token: Option<&str>) -> (SocketAddr, impl FnOnce() -> Vec<Parked>) {
    server_of(ctx(2, token))
}

fn server_of(c: ControlCtx) -> (SocketAddr, impl FnOnce() -> Vec<Parked>) {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    l.set_nonblocking(true).unwrap();
    let addr = l.local_addr().unwrap();
    let stop = Arc::new(EventFd::new().unwrap());
    let s2 = stop.clone();
    let h = std::thread::spawn(move || {
        let answer = |req: u8, from: usize| format!("request {req} from rank {from}").into_bytes();
        serve(&l, &c, s2.as_raw_fd(), &answer, None)
    });
    (addr, move || {
        stop.signal();
        h.join().unwrap()
    })
}
use std::sync::Arc;

#[test]
fn a_member_gets_its_answer_and_strangers_do_not_stop_it() {
    for token in [None, Some("secret")] {
        let (addr, stop) = server(token);
        // Strangers: garbage, a silent connection, a hello for another communicator.
        let mut garbage = TcpStream::connect(addr).unwrap();
        garbage.write_all(&[0xab; 40]).unwrap();
        let _silent = TcpStream::connect(addr).unwrap();
        let mut foreign = TcpStream::connect(addr).unwrap();
        let (h, _) = handshake::hello_message(control_id(0xbad), 1, 2, None, 0).unwrap();
        foreign.write_all(&h).unwrap();
        let t0 = Instant::now();
        let r = ask(&ctx(1, token), 2, addr, REQUEST_SNAPSHOT, Duration::from_secs(3));
        assert_eq!(r, Reply::Answer(b"request 1 from rank 1".to_vec()));
        assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
        // Only the silent one could still be a survivor's: it goes to a shrink, to check.
        let parked = stop();
        assert_eq!(parked.len(), 1, "{:?}", parked.iter().map(|p| p.2).collect::<Vec<_>>());
        assert_eq!(parked[0].2, UNIDENTIFIED);
    }
}

#[test]
fn a_wrong_token_gets_nothing() {
    let (addr, stop) = server(Some("secret"));
    for token in [None, Some("guess")] {
        let r = ask(&ctx(1, token), 2, addr, REQUEST_SNAPSHOT, Duration::from_secs(2));
        assert!(!matches!(r, Reply::Answer(_)), "{r:?}");
    }
    stop();
}

#[test]
fn a_dead_rank_is_told_from_a_stopped_one() {
    // Nobody listens: the port of a listener that was closed.
    let gone = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap().local_addr().unwrap();
    assert!(matches!(ask(&ctx(1, None), 2, gone, REQUEST_SNAPSHOT, Duration::from_secs(2)), Reply::Dead(_)));
    // A listener whose process never runs: the kernel accepts, nobody answers.
    let stopped = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let t0 = Instant::now();
    let r =
        ask(&ctx(1, None), 2, stopped.local_addr().unwrap(), REQUEST_SNAPSHOT, Duration::from_millis(500));
    assert_eq!(r, Reply::Silent);
    assert!(t0.elapsed() < Duration::from_secs(2));
}

#[test]
fn a_rank_whose_listener_closes_while_asked_is_dead() {
    // An exiting process: the kernel takes the connection into the listener's backlog,
    // then the listener closes (the connection is reset) and nothing listens any more.
    let exiting = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let addr = exiting.local_addr().unwrap();
    let closer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        drop(exiting);
    });
    let r = ask(&ctx(1, None), 2, addr, REQUEST_SNAPSHOT, Duration::from_secs(5));
    closer.join().unwrap();
    assert!(matches!(r, Reply::Dead(_)), "{r:?}");
    // A live listener that takes the connection and drops it unanswered stays a failure.
    let live = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let addr = live.local_addr().unwrap();
    let dropper = std::thread::spawn(move || {
        let (s, _) = live.accept().unwrap();
        drop(s);
        live // keeps listening until joined
    });
    let r = ask(&ctx(1, None), 2, addr, REQUEST_SNAPSHOT, Duration::from_secs(5));
    let _live = dropper.join().unwrap();
    assert!(matches!(r, Reply::Failed(_)), "{r:?}");
}

#[test]
fn a_shrink_hello_is_parked_unread() {
    let (addr, stop) = server(None);
    let mut s = TcpStream::connect(addr).unwrap();
    let (h, _) = handshake::hello_message(shrink_id(0x5eed, 2), 3, 2, None, 0).unwrap();
    s.write_all(&h).unwrap();
    // A hello for an attempt past the bound is a stranger's.
    let mut far = TcpStream::connect(addr).unwrap();
    let (h9, _) =
        handshake::hello_message(shrink_id(0x5eed, MAX_SHRINK_ATTEMPTS + 1), 3, 2, None, 0).unwrap();
    far.write_all(&h9).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let parked = stop();
    assert_eq!(parked.len(), 1);
    let (mut p, _, attempt) = parked.into_iter().next().unwrap();
    assert_eq!(attempt, 2);
    p.set_nonblocking(false).unwrap();
    let mut got = vec![0u8; h.len()];
    p.read_exact(&mut got).unwrap();
    assert_eq!(got, h, "the shrink's handshake must find the hello where it was");
}

#[test]
fn a_hello_still_arriving_when_the_shrink_takes_over_is_handed_to_it() {
    // A survivor connected and sent part of its hello as this rank started to shrink:
    // closing it would reset the survivor's shrink (a race seen in CI).
    let (addr, stop) = server(None);
    let mut s = TcpStream::connect(addr).unwrap();
    let (h, _) = handshake::hello_message(shrink_id(0x5eed, 1), 3, 2, None, 0).unwrap();
    s.write_all(&h[..5]).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let parked = stop();
    assert_eq!(parked.len(), 1, "the connection must not be dropped");
    let (mut p, _, attempt) = parked.into_iter().next().unwrap();
    assert_eq!(attempt, UNIDENTIFIED);
    s.write_all(&h[5..]).unwrap();
    p.set_nonblocking(false).unwrap();
    let mut got = vec![0u8; h.len()];
    p.read_exact(&mut got).unwrap();
    assert_eq!(got, h, "the shrink's handshake must find the whole hello");
}

#[test]
fn ids_are_distinct_per_purpose_and_attempt() {
    let c = control_id(7);
    assert_ne!(c, 7);
    assert_ne!(shrink_id(7, 1), shrink_id(7, 2));
    assert_ne!(shrink_id(7, 1), c);
    assert_ne!(shrink_id(7, 1), shrink_id(8, 1));
}

/// A TCP proxy for one connection to `real`: returns its address and what crossed it.
fn recording_proxy(real: SocketAddr) -> (SocketAddr, std::thread::JoinHandle<Vec<u8>>) {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let addr = l.local_addr().unwrap();
    let h = std::thread::spawn(move || {
        let (c, _) = l.accept().unwrap();
        let s = TcpStream::connect(real).unwrap();
        let pump = |mut from: TcpStream, mut to: TcpStream| {
            std::thread::spawn(move || {
                let mut seen = Vec::new();
                let mut buf = [0u8; 4096];
                while let Ok(n) = from.read(&mut buf) {
                    if n == 0 || to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                    seen.extend_from_slice(&buf[..n]);
                }
                let _ = to.shutdown(std::net::Shutdown::Write);
                seen
            })
        };
        let up = pump(c.try_clone().unwrap(), s.try_clone().unwrap());
        let down = pump(s, c);
        let mut seen = up.join().unwrap();
        seen.extend(down.join().unwrap());
        seen
    });
    (addr, h)
}

#[test]
fn an_encrypted_control_plane_answers_a_member_in_tls_and_refuses_the_rest() {
    let (addr, stop) = server_of(ctx_tls(2, "secret"));
    let grace = Duration::from_secs(3);
    let r = ask(&ctx_tls(1, "secret"), 2, addr, REQUEST_SNAPSHOT, grace);
    assert_eq!(r, Reply::Answer(b"request 1 from rank 1".to_vec()));
    // Through a proxy: the answer does not cross in the clear (and does without TLS below).
    let (front, seen) = recording_proxy(addr);
    let r = ask(&ctx_tls(1, "secret"), 2, front, REQUEST_SNAPSHOT, grace);
    assert_eq!(r, Reply::Answer(b"request 1 from rank 1".to_vec()));
    let seen = seen.join().unwrap();
    assert!(seen.len() > 500, "{} bytes crossed", seen.len());
    assert!(!seen.windows(9).any(|w| w == b"from rank"), "the answer crossed in the clear");
    // A wrong token, and an asker that does not encrypt: no answer, and no hang.
    for c in [ctx_tls(1, "guess"), ctx(1, Some("secret"))] {
        let t0 = Instant::now();
        let r = ask(&c, 2, addr, REQUEST_SNAPSHOT, grace);
        assert!(!matches!(r, Reply::Answer(_)), "{c:?}: {r:?}");
        assert!(t0.elapsed() < grace + Duration::from_secs(1), "{c:?}: {:?}", t0.elapsed());
    }
    // The rank still answers a member afterwards.
    let r = ask(&ctx_tls(1, "secret"), 2, addr, REQUEST_SNAPSHOT, grace);
    assert_eq!(r, Reply::Answer(b"request 1 from rank 1".to_vec()));
    stop();
    // The same through the proxy without TLS: the answer is visible (so the check can fail).
    let (addr, stop) = server(Some("secret"));
    let (front, seen) = recording_proxy(addr);
    let r = ask(&ctx(1, Some("secret")), 2, front, REQUEST_SNAPSHOT, grace);
    assert_eq!(r, Reply::Answer(b"request 1 from rank 1".to_vec()));
    assert!(seen.join().unwrap().windows(9).any(|w| w == b"from rank"));
    stop();
    // An encrypting asker of a rank that does not encrypt: no answer, no hang.
    let (addr, stop) = server(Some("secret"));
    let r = ask(&ctx_tls(1, "secret"), 2, addr, REQUEST_SNAPSHOT, grace);
    assert!(!matches!(r, Reply::Answer(_)), "{r:?}");
    stop();
}
