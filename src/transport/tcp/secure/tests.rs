//! Handshakes of encrypted links over loopback: pinned keys accepted both ways, a key other
//! than the published one refused on both ends, a different token refused by the binding.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::transport::testutil::{exchange, random_bytes};

/// One end's outcome.
type Secured = Result<Box<dyn Transport>>;

/// Secures both ends at once: rank 1 dials rank 0. `keys0`/`keys1`: the keys each side pins
/// (index = rank).
pub(super) fn handshake(
    id0: Arc<Identity>,
    keys0: Vec<Vec<u8>>,
    tok0: &[u8],
    id1: Arc<Identity>,
    keys1: Vec<Vec<u8>>,
    tok1: &[u8],
) -> (Secured, Secured) {
    let (t1, t0) = tcp_pair();
    let timeout = Duration::from_secs(10);
    let s0 = LinkSecurity::new(id0, keys0, AuthToken::new(tok0), timeout);
    let s1 = LinkSecurity::new(id1, keys1, AuthToken::new(tok1), timeout);
    let deadline = Instant::now() + timeout;
    let server = std::thread::spawn(move || secure_link(t0, 0, 1, false, &s0, deadline, None));
    let client = secure_link(t1, 1, 0, true, &s1, deadline, None);
    (server.join().unwrap(), client)
}

fn ids() -> (Arc<Identity>, Arc<Identity>, Arc<Identity>) {
    let g = || Arc::new(Identity::generate().unwrap());
    (g(), g(), g())
}

#[test]
fn pinned_keys_make_a_working_link() {
    let (a, b, _) = ids();
    let keys = vec![a.public_key().to_vec(), b.public_key().to_vec()];
    let (s, c) = handshake(a, keys.clone(), b"t", b, keys, b"t");
    let (mut s, mut c) = (s.unwrap(), c.unwrap());
    let (x, y) = (random_bytes(700_001, 1), random_bytes(300_007, 2));
    let (at_c, at_s) = exchange(&mut *c, &mut *s, &x, &y);
    assert!(at_s == x && at_c == y);
    assert_eq!(s.kind(), "tcp+tls");
}

#[test]
fn a_key_other_than_the_published_one_is_refused_on_both_ends() {
    let (a, b, stranger) = ids();
    let published = vec![a.public_key().to_vec(), b.public_key().to_vec()];
    // The dialer holds the token but not rank 1's key.
    let (s, c) = handshake(a.clone(), published.clone(), b"t", stranger.clone(), published.clone(), b"t");
    let s = s.expect_err("server accepted a stranger's key").to_string();
    assert!(s.contains("key other than the one its rank published"), "{s}");
    assert!(c.is_err(), "the stranger got a link");
    // The accepting side is the stranger: the dialer refuses it.
    let (s, c) = handshake(stranger, published.clone(), b"t", b, published, b"t");
    let c = c.expect_err("client accepted a stranger's key").to_string();
    assert!(c.contains("key other than the one its rank published"), "{c}");
    assert!(s.is_err());
}

#[test]
fn a_different_token_fails_the_binding() {
    let (a, b, _) = ids();
    let keys = vec![a.public_key().to_vec(), b.public_key().to_vec()];
    let (s, c) = handshake(a, keys.clone(), b"one", b, keys, b"two");
    for e in [s.expect_err("server"), c.expect_err("client")] {
        assert!(e.to_string().contains("token binding"), "{e}");
    }
}

#[test]
fn a_peer_that_does_not_encrypt_is_an_error_not_a_hang() {
    let (a, _, _) = ids();
    let (mut plain, t0) = tcp_pair();
    let sec = LinkSecurity::new(
        a.clone(),
        vec![a.public_key().to_vec(); 2],
        AuthToken::new(b"t"),
        Duration::from_secs(5),
    );
    // The peer sends plaintext frames and then closes.
    crate::transport::testutil::write_all(&mut *plain, &[0u8; 64]);
    plain.shutdown();
    let t = Instant::now();
    let e = secure_link(t0, 0, 1, false, &sec, Instant::now() + Duration::from_secs(5), None).unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(4), "{e}");
}
