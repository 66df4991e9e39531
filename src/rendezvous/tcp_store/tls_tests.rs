//! Tests of the encrypted store (`TOROID_ENCRYPT`): the contract over TLS, refusals that name
//! the cause, a stranger's junk, pipelined requests, and a machine in the middle that runs
//! TLS with both ends and relays the plaintext, which the token binding must defeat.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;

use super::TcpStore;
use super::auth::{self, BINDING_LABEL, BINDING_LEN, NONCE_LEN, TAG_LEN};
use super::protocol::{Enc, FLAG_AUTH, FLAG_TLS, OP_SET, ST_OK};
use super::tests::T;
use crate::config::AuthToken;
use crate::error::Error;
use crate::rendezvous::{Store, check_store_contract};

fn token(s: &[u8]) -> AuthToken {
    AuthToken::new(s)
}

fn serve() -> (TcpStore, String) {
    let s = TcpStore::serve_encrypted("127.0.0.1:0", T, &token(b"tls-secret")).unwrap();
    let addr = s.server_addr().unwrap().to_string();
    (s, addr)
}

fn write_frame(s: &mut impl Write, payload: &[u8]) {
    s.write_all(&(payload.len() as u32).to_le_bytes()).unwrap();
    s.write_all(payload).unwrap();
    s.flush().unwrap();
}

fn read_frame(s: &mut impl Read) -> std::io::Result<Vec<u8>> {
    let mut len = [0; 4];
    s.read_exact(&mut len)?;
    let mut body = vec![0; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut body)?;
    Ok(body)
}

/// A socket to `addr` after the plaintext hello that asks for TLS, and its answer.
fn asked_for_tls(addr: &str) -> (TcpStream, Vec<u8>) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    write_frame(&mut s, Enc::hello_tls().payload());
    let answer = read_frame(&mut s).unwrap();
    (s, answer)
}

/// A TLS client stream to `addr`, past the handshake but before the token's exchange.
fn tls_client(addr: &str) -> rustls::StreamOwned<rustls::ClientConnection, TcpStream> {
    let (mut s, answer) = asked_for_tls(addr);
    assert_eq!(answer, [ST_OK, FLAG_TLS]);
    let mut c = crate::tls::bound_client().unwrap();
    while c.is_handshaking() {
        c.complete_io(&mut s).unwrap();
    }
    rustls::StreamOwned::new(c, s)
}

fn binding<D>(c: &rustls::ConnectionCommon<D>) -> [u8; BINDING_LEN] {
    let mut b = [0; BINDING_LEN];
    crate::tls::export(c, BINDING_LABEL, &mut b).unwrap();
    b
}

/// The token's exchange inside `s`, by hand: true when the server proved the token.
fn authenticate(s: &mut rustls::StreamOwned<rustls::ClientConnection, TcpStream>, t: &AuthToken) -> bool {
    let hello = Enc::hello(Some(&[9; NONCE_LEN]));
    let mut bound = hello.payload().to_vec();
    bound.extend_from_slice(&binding(&s.conn));
    write_frame(s, hello.payload());
    let a = read_frame(s).unwrap();
    assert_eq!(&a[..2], [ST_OK, FLAG_AUTH]);
    let (nonce, tag) = a[2..].split_at(NONCE_LEN);
    let nonce: auth::Nonce = nonce.try_into().unwrap();
    assert_eq!(tag.len(), TAG_LEN);
    if !auth::server_tag_ok(t, &bound, &nonce, tag) {
        return false;
    }
    write_frame(s, &auth::client_tag(t, &bound, &nonce));
    read_frame(s).unwrap() == [ST_OK, 0]
}

#[test]
fn an_encrypted_store_keeps_the_contract_between_clients() {
    let (s, addr) = serve();
    check_store_contract(&s);
    let c = Arc::new(TcpStore::connect_encrypted(&addr, T, &token(b"tls-secret")).unwrap());
    // A GET parked on one client is answered by a SET of the largest value from the other.
    let waiter = {
        let c = c.clone();
        std::thread::spawn(move || c.get("big", T).unwrap())
    };
    let big: Vec<u8> = (0..super::MAX_VALUE).map(|i| (i * 7 + i / 251) as u8).collect();
    s.set("big", &big).unwrap();
    assert_eq!(waiter.join().unwrap(), big);
    assert_eq!(c.add("n", 5).unwrap(), 5);
    assert_eq!(s.add("n", -2).unwrap(), 3);
}

#[test]
fn mismatched_encryption_or_token_is_refused_naming_the_cause() {
    let (_s, addr) = serve();
    let plain = TcpStore::connect_with_token(&addr, T, Some(&token(b"tls-secret"))).unwrap_err();
    assert!(matches!(&plain, Error::Remote(m) if m.contains("TOROID_ENCRYPT")), "{plain}");
    let auth_only = TcpStore::serve_with_token("127.0.0.1:0", T, Some(&token(b"tls-secret"))).unwrap();
    let a = auth_only.server_addr().unwrap().to_string();
    let e = TcpStore::connect_encrypted(&a, T, &token(b"tls-secret")).unwrap_err();
    assert!(matches!(&e, Error::Remote(m) if m.contains("TOROID_ENCRYPT")), "{e}");
    let e = TcpStore::connect_encrypted(&addr, T, &token(b"another")).unwrap_err();
    assert!(matches!(&e, Error::Remote(m) if m.contains("TOROID_AUTH_TOKEN")), "{e}");
    let e = TcpStore::connect_secured(&addr, T, None, true).unwrap_err();
    assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("TOROID_AUTH_TOKEN")), "{e}");
    // The hand-made client passes with the right token: the refusals above were the causes.
    assert!(authenticate(&mut tls_client(&addr), &token(b"tls-secret")));
}

#[test]
fn junk_in_place_of_a_handshake_closes_only_that_connection() {
    let (s, addr) = serve();
    for junk in [vec![0x16; 40 << 10], b"GET / HTTP/1.1\r\n\r\n".to_vec(), vec![0; 3]] {
        let (mut raw, answer) = asked_for_tls(&addr);
        assert_eq!(answer, [ST_OK, FLAG_TLS]);
        let _ = raw.write_all(&junk);
        let mut rest = Vec::new();
        // The server closes it: at the first bad record, past the handshake cap, or at the
        // handshake deadline; never with a store answer.
        let _ = raw.read_to_end(&mut rest);
        assert!(rest.len() < 64, "{} bytes came back for junk", rest.len());
    }
    s.set("still", b"serving").unwrap();
    assert_eq!(s.get("still", T).unwrap(), b"serving");
}

#[test]
fn pipelined_requests_under_tls_are_all_answered() {
    let (s, addr) = serve();
    // Sizes whose last frames end up split between the server's input buffer and rustls.
    for (n, len) in [(3, 60_000), (5, 50_000), (7, 40_000), (40, 30_000), (200, 2_000)] {
        let mut c = tls_client(&addr);
        assert!(authenticate(&mut c, &token(b"tls-secret")));
        let mut batch = Vec::new();
        for i in 0..n {
            let mut e = Enc::new(OP_SET);
            e.bytes(format!("k{len}-{i}").as_bytes());
            e.bytes(&vec![i as u8; len]);
            batch.extend_from_slice(&e.finish().unwrap());
        }
        c.write_all(&batch).unwrap();
        c.flush().unwrap();
        for i in 0..n {
            assert_eq!(read_frame(&mut c).unwrap(), [ST_OK], "{len} bytes: set {i}");
        }
        for i in 0..n {
            assert_eq!(s.get(&format!("k{len}-{i}"), T).unwrap(), vec![i as u8; len], "{len}: {i}");
        }
    }
}

/// A machine in the middle: it runs TLS with the client as a server of its own key, TLS with
/// the real server as a client, and relays the plaintext frames both ways.
fn middle(real: String) -> (SocketAddr, std::thread::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let front = l.local_addr().unwrap();
    let h = std::thread::spawn(move || {
        let (mut c, _) = l.accept().unwrap();
        c.set_read_timeout(Some(T)).unwrap();
        let hello = read_frame(&mut c).unwrap();
        assert_eq!(hello, Enc::hello_tls().payload());
        write_frame(&mut c, &[ST_OK, FLAG_TLS]);
        let id = crate::tls::Identity::generate().unwrap();
        let mut sc = rustls::ServerConnection::new(crate::tls::bound_server(&id).unwrap()).unwrap();
        while sc.is_handshaking() {
            sc.complete_io(&mut c).unwrap();
        }
        let mut to_client = rustls::StreamOwned::new(sc, c);
        let mut to_server = tls_client(&real);
        // Relay frames until either side gives up.
        loop {
            let Ok(f) = read_frame(&mut to_client) else { return };
            write_frame(&mut to_server, &f);
            let Ok(a) = read_frame(&mut to_server) else { return };
            write_frame(&mut to_client, &a);
        }
    });
    (front, h)
}

#[test]
fn a_machine_in_the_middle_with_its_own_tls_fails_the_token_binding() {
    let (s, addr) = serve();
    s.set("secret", b"value").unwrap();
    let (front, relay) = middle(addr);
    let e = TcpStore::connect_encrypted(&front.to_string(), T, &token(b"tls-secret")).unwrap_err();
    assert!(matches!(&e, Error::Remote(m) if m.contains("failed authentication")), "{e}");
    // Both ends' handshakes completed; only the binding told them apart.
    relay.join().unwrap();
}
