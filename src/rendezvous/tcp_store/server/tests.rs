//! Unit tests of the TCP store server ([`super`]).

use super::super::TcpStore;
use super::super::auth::{NONCE_LEN, TAG_LEN, client_tag};
use super::super::protocol::*;
use super::super::tests::{T, raw_frame, raw_read, server};
use super::*;
use crate::rendezvous::Store;
use std::io::{Read, Write};
use std::net::TcpStream;

fn token(s: &[u8]) -> AuthToken {
    AuthToken::new(s)
}

fn raw(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    s
}

/// Reads until the server closes; what it sent on the way.
fn read_to_close(s: &mut TcpStream) -> Vec<u8> {
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    rest
}

#[test]
fn server_rejects_oversized_frames_and_bad_hellos_and_keeps_serving() {
    let s = server();
    let addr = s.server_addr().unwrap();

    let mut c = raw(addr);
    c.write_all(&Enc::hello(None).finish().unwrap()).unwrap();
    assert_eq!(raw_read(&mut c), [ST_OK, 0]);
    // Claim 1 GiB and send nothing more: the server must answer, not allocate and wait.
    c.write_all(&(1u32 << 30).to_le_bytes()).unwrap();
    let a = raw_read(&mut c);
    assert_eq!(a[0], ST_BAD_REQUEST);
    assert!(String::from_utf8_lossy(&a[1..]).contains("exceeds"));
    assert!(read_to_close(&mut c).is_empty());

    let mut c = raw(addr);
    raw_frame(&mut c, b"HTTP/1.1");
    assert_eq!(raw_read(&mut c)[0], ST_BAD_REQUEST);

    // Before the hello, frames are capped at a few dozen bytes.
    let mut c = raw(addr);
    c.write_all(&(MAX_HELLO_FRAME as u32 + 1).to_le_bytes()).unwrap();
    assert_eq!(raw_read(&mut c)[0], ST_BAD_REQUEST);

    // A malformed request is answered and the connection stays open.
    let mut c = raw(addr);
    c.write_all(&Enc::hello(None).finish().unwrap()).unwrap();
    assert_eq!(raw_read(&mut c), [ST_OK, 0]);
    raw_frame(&mut c, &[OP_SET, 9, 0, 0]);
    assert_eq!(raw_read(&mut c)[0], ST_BAD_REQUEST);
    raw_frame(&mut c, &[OP_DELETE, 1, 0, 0, 0, b'z']);
    assert_eq!(raw_read(&mut c), [ST_OK, 0]);

    s.set("still", b"fine").unwrap();
    assert_eq!(s.get("still", T).unwrap(), b"fine");
}

#[test]
fn keys_and_values_over_their_caps_get_a_clear_error() {
    let s = server();
    let err = s.set(&"k".repeat(MAX_KEY + 1), b"v").unwrap_err();
    assert!(matches!(&err, Error::Remote(m) if m.contains("key of 1025 bytes exceeds")), "{err}");
    // The client refuses a frame over the limit before sending it.
    let err = s.set("k", &vec![0; MAX_FRAME]).unwrap_err();
    assert!(matches!(&err, Error::InvalidArgument(m) if m.contains("limit")), "{err}");
    let err = s.set("k", &vec![0; MAX_VALUE + 1]).unwrap_err();
    assert!(matches!(&err, Error::Remote(m) if m.contains("value of")), "{err}");
    // The connection is still in step.
    s.set("k", &vec![7; MAX_VALUE]).unwrap();
    assert_eq!(s.get("k", T).unwrap().len(), MAX_VALUE);
}

#[test]
fn the_same_token_on_both_sides_authenticates() {
    let t = token(b"s3cret");
    let s = TcpStore::serve_with_token("127.0.0.1:0", T, Some(&t)).unwrap();
    let addr = s.server_addr().unwrap().to_string();
    let c = TcpStore::connect_with_token(&addr, T, Some(&t)).unwrap();
    c.set("k", b"v").unwrap();
    assert_eq!(s.get("k", T).unwrap(), b"v");
}

#[test]
fn a_different_token_or_none_is_refused_on_both_sides() {
    let t = token(b"s3cret");
    let s = TcpStore::serve_with_token("127.0.0.1:0", T, Some(&t)).unwrap();
    let addr = s.server_addr().unwrap().to_string();
    for (who, tok) in [("another token", Some(token(b"guess"))), ("no token", None)] {
        let err = TcpStore::connect_with_token(&addr, T, tok.as_ref()).unwrap_err();
        assert!(matches!(&err, Error::Remote(m) if m.contains("TOROID_AUTH_TOKEN")), "{who}: {err}");
    }
    // A server without a token refuses a client with one, and the client refuses it.
    let plain = server();
    let addr = plain.server_addr().unwrap().to_string();
    let err = TcpStore::connect_with_token(&addr, T, Some(&t)).unwrap_err();
    assert!(matches!(&err, Error::Remote(m) if m.contains("TOROID_AUTH_TOKEN")), "{err}");
    // Nothing the strangers did reached the table.
    s.set("k", b"v").unwrap();
    assert_eq!(s.get("k", T).unwrap(), b"v");
}

#[test]
fn a_stranger_without_the_token_gets_nothing_and_changes_nothing() {
    let t = token(b"s3cret");
    let s = TcpStore::serve_with_token("127.0.0.1:0", T, Some(&t)).unwrap();
    s.set("secret", b"value").unwrap();
    let addr = s.server_addr().unwrap();
    // A plain hello, then requests pipelined behind it.
    let mut c = raw(addr);
    c.write_all(&Enc::hello(None).finish().unwrap()).unwrap();
    let mut g = Enc::new(OP_GET);
    g.u64(0);
    g.bytes(b"secret");
    c.write_all(&g.finish().unwrap()).unwrap();
    let mut d = Enc::new(OP_DELETE);
    d.bytes(b"secret");
    c.write_all(&d.finish().unwrap()).unwrap();
    let a = raw_read(&mut c);
    assert_eq!(a[0], ST_BAD_REQUEST);
    assert!(String::from_utf8_lossy(&a).contains("TOROID_AUTH_TOKEN"));
    let rest = read_to_close(&mut c);
    assert!(!rest.windows(5).any(|w| w == b"value"), "{rest:?}");
    // A request in place of the proof is a failed proof.
    let mut c = raw(addr);
    c.write_all(&Enc::hello(Some(&[1; NONCE_LEN])).finish().unwrap()).unwrap();
    assert_eq!(raw_read(&mut c).len(), 2 + NONCE_LEN + TAG_LEN);
    let mut g = Enc::new(OP_GET);
    g.u64(0);
    g.bytes(b"secret");
    c.write_all(&g.finish().unwrap()).unwrap();
    let a = raw_read(&mut c);
    assert_eq!(a[0], ST_BAD_REQUEST);
    assert!(read_to_close(&mut c).is_empty());
    assert_eq!(s.get("secret", T).unwrap(), b"value");
}

/// Runs the client's side of the handshake by hand; returns the stream, the hello and the
/// server's nonce, and the proof sent.
fn handshake_by_hand(addr: SocketAddr, t: &AuthToken, nc: [u8; NONCE_LEN]) -> (TcpStream, Vec<u8>, u8) {
    let mut c = raw(addr);
    let hello = Enc::hello(Some(&nc));
    let payload = hello.payload().to_vec();
    c.write_all(&hello.finish().unwrap()).unwrap();
    let a = raw_read(&mut c);
    assert_eq!(a[..2], [ST_OK, FLAG_AUTH]);
    let ns: Nonce = a[2..2 + NONCE_LEN].try_into().unwrap();
    let proof = client_tag(t, &payload, &ns);
    raw_frame(&mut c, &proof);
    let status = raw_read(&mut c)[0];
    (c, proof.to_vec(), status)
}

#[test]
fn replayed_messages_are_refused_on_both_sides() {
    let t = token(b"s3cret");
    let s = TcpStore::serve_with_token("127.0.0.1:0", T, Some(&t)).unwrap();
    let addr = s.server_addr().unwrap();
    let nc = [9; NONCE_LEN];
    let (_c, proof, status) = handshake_by_hand(addr, &t, nc);
    assert_eq!(status, ST_OK);
    // The same hello and proof on a new connection: the server drew a new nonce.
    let mut c = raw(addr);
    c.write_all(&Enc::hello(Some(&nc)).finish().unwrap()).unwrap();
    let _challenge = raw_read(&mut c);
    raw_frame(&mut c, &proof);
    let a = raw_read(&mut c);
    assert_eq!(a[0], ST_BAD_REQUEST);
    assert!(String::from_utf8_lossy(&a).contains("authentication failed"));

    // A fake server replaying a real server's challenge and proof to a new client: the
    // client drew a new nonce, so the proof does not verify.
    let mut c = raw(addr);
    c.write_all(&Enc::hello(Some(&nc)).finish().unwrap()).unwrap();
    let recorded = raw_read(&mut c);
    let fake = TcpListener::bind("127.0.0.1:0").unwrap();
    let fake_addr = fake.local_addr().unwrap().to_string();
    let th = std::thread::spawn(move || {
        let (mut f, _) = fake.accept().unwrap();
        f.set_read_timeout(Some(T)).unwrap();
        let _hello = raw_read(&mut f);
        raw_frame(&mut f, &recorded);
        read_to_close(&mut f) // the client sends no proof
    });
    let err = TcpStore::connect_with_token(&fake_addr, T, Some(&t)).unwrap_err();
    assert!(matches!(&err, Error::Remote(m) if m.contains("TOROID_AUTH_TOKEN")), "{err}");
    assert!(th.join().unwrap().is_empty());
}

#[test]
fn pipelined_gets_of_a_large_value_are_answered_as_the_peer_reads() {
    let s = server();
    s.set("big", &vec![5; MAX_VALUE]).unwrap();
    let mut c = raw(s.server_addr().unwrap());
    c.write_all(&Enc::hello(None).finish().unwrap()).unwrap();
    assert_eq!(raw_read(&mut c), [ST_OK, 0]);
    let mut g = Enc::new(OP_GET);
    g.u64(0);
    g.bytes(b"big");
    let g = g.finish().unwrap();
    c.write_all(&g.repeat(200)).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    // Others are served while that peer does not read.
    s.set("other", b"x").unwrap();
    assert_eq!(s.get("other", T).unwrap(), b"x");
    // Every answer comes, in order, once the peer reads.
    for _ in 0..200 {
        let a = raw_read(&mut c);
        assert_eq!((a[0], a.len()), (ST_OK, 1 + MAX_VALUE));
    }
}

#[test]
fn silent_and_dripping_strangers_are_dropped_at_the_handshake_deadline() {
    let s = server();
    let addr = s.server_addr().unwrap();
    let silent = std::thread::spawn(move || {
        let mut c = raw(addr);
        c.set_read_timeout(Some(HANDSHAKE_DEADLINE + T)).unwrap();
        let start = Instant::now();
        (read_to_close(&mut c), start.elapsed())
    });
    let mut drip = raw(addr);
    // One byte every 400 ms: the 13 bytes of a hello would take over 5 s.
    for b in Enc::hello(None).finish().unwrap() {
        if drip.write_all(&[b]).is_err() {
            break;
        }
        // Meanwhile real clients get through at once.
        let c = TcpStore::connect(&addr.to_string(), T).unwrap();
        c.set("k", b"v").unwrap();
        std::thread::sleep(Duration::from_millis(400));
    }
    // Closed without an answer.
    assert!(read_to_close(&mut drip).is_empty());
    let (got, took) = silent.join().unwrap();
    assert!(got.is_empty());
    assert!(took >= HANDSHAKE_DEADLINE && took < HANDSHAKE_DEADLINE + Duration::from_secs(2), "{took:?}");
}

#[test]
fn past_the_connection_cap_new_connections_wait_for_a_slot() {
    // The cap of a real server is MAX_CONNECTIONS; 64 here keeps the test fast (thousands of
    // connections overflow the listen backlog, and the kernel retries those after seconds).
    let cap = 64;
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let _server = start(listener, addr, None, false, cap).unwrap();
    let mut held: Vec<TcpStream> = Vec::new();
    let hello = Enc::hello(None).finish().unwrap();
    for _ in 0..cap {
        let mut c = raw(addr);
        c.write_all(&hello).unwrap();
        assert_eq!(raw_read(&mut c), [ST_OK, 0]);
        held.push(c);
    }
    // No slot: the connection waits in the backlog, unanswered.
    let err = TcpStore::connect(&addr.to_string(), Duration::from_millis(500)).unwrap_err();
    assert!(matches!(err, Error::Timeout(_)), "{err}");
    held.truncate(10);
    let c = TcpStore::connect(&addr.to_string(), T).unwrap();
    c.set("k", b"v").unwrap();
    assert_eq!(c.get("k", T).unwrap(), b"v");
    assert!(super::super::MAX_CONNECTIONS >= cap);
}

/// Sends a GET of `key` (parked until it is set, for at most a minute) without reading
/// the answer.
fn park_get(c: &mut TcpStream, key: &str) {
    let mut e = Enc::new(OP_GET);
    e.u64(60_000);
    e.bytes(key.as_bytes());
    c.write_all(&e.finish().unwrap()).unwrap();
}

#[test]
fn a_set_read_in_the_same_round_as_the_get_it_answers_wakes_it() {
    let s = server();
    let addr = s.server_addr().unwrap();
    let hello = Enc::hello(None).finish().unwrap();
    let open = || {
        let mut c = raw(addr);
        c.write_all(&hello).unwrap();
        assert_eq!(raw_read(&mut c), [ST_OK, 0]);
        c
    };
    let (mut a, mut b) = (open(), open());
    // The GET parks; were it not woken by the SET read just after it in the same round,
    // it would be answered only at its deadline, a minute away, and reading its answer
    // would fail after T. Each answered GET leaves its deadline in the heap: 1,500 of them
    // pass the point where the heap is rebuilt from the live deadlines.
    for i in 0..1500 {
        park_get(&mut a, &format!("race/{i}"));
        let mut e = Enc::new(OP_SET);
        e.bytes(format!("race/{i}").as_bytes());
        e.bytes(b"v");
        b.write_all(&e.finish().unwrap()).unwrap();
        assert_eq!(raw_read(&mut b), [ST_OK]);
        assert_eq!(raw_read(&mut a), [ST_OK, b'v'], "round {i}");
    }
}

#[test]
fn parked_requests_on_many_connections_each_get_their_own_key() {
    let s = server();
    let addr = s.server_addr().unwrap();
    let hello = Enc::hello(None).finish().unwrap();
    let n = 200;
    // Connection i parks a GET of key i, then (pipelined behind it) a GET of key "all".
    let mut conns: Vec<TcpStream> = (0..n)
        .map(|i| {
            let mut c = raw(addr);
            c.write_all(&hello).unwrap();
            assert_eq!(raw_read(&mut c), [ST_OK, 0]);
            park_get(&mut c, &format!("key/{i}"));
            park_get(&mut c, "all");
            c
        })
        .collect();
    // One more connection parks on a key and closes before it is set: its listing goes.
    let mut gone = raw(addr);
    gone.write_all(&hello).unwrap();
    assert_eq!(raw_read(&mut gone), [ST_OK, 0]);
    park_get(&mut gone, "key/0");
    drop(gone);
    // A WAIT on three keys that arrive one by one from different connections.
    let w = TcpStore::connect(&addr.to_string(), T).unwrap();
    let waiter = std::thread::spawn(move || w.wait(&["w/0", "w/1", "w/2"], T));
    // Set the keys in reverse order: each connection gets its own value, and nothing else
    // before "all".
    for i in (0..n).rev() {
        s.set(&format!("key/{i}"), format!("value {i}").as_bytes()).unwrap();
        let a = raw_read(&mut conns[i]);
        assert_eq!((a[0], &a[1..]), (ST_OK, format!("value {i}").as_bytes()), "connection {i}");
    }
    for i in 0..3 {
        TcpStore::connect(&addr.to_string(), T).unwrap().set(&format!("w/{i}"), b"").unwrap();
    }
    waiter.join().unwrap().unwrap();
    s.set("all", b"done").unwrap();
    for (i, c) in conns.iter_mut().enumerate() {
        let a = raw_read(c);
        assert_eq!((a[0], &a[1..]), (ST_OK, &b"done"[..]), "connection {i}");
    }
}
