//! Encrypted links (`TOROID_ENCRYPT`): every collective exact over them, with links on demand
//! and as a mesh, striped lanes and progress threads; a relay between the ranks (a TCP proxy
//! in this test, on loopback) sees none of the data the ranks all-reduce and broadcast, and a
//! byte it flips, a stretch it replays or drops makes the next collective fail on every rank
//! within the timeout; ranks that disagree on encryption, or encrypt without a token, fail at
//! set-up with a clear error. The same relay in front of an encrypted TCP store sees none of
//! the values, and tampering fails the store call.

mod util;

use std::collections::HashSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use toroid::rendezvous::{MemStore, Store};
use toroid::{AuthToken, Communicator, Config};

fn encrypted(on: bool) -> Config {
    Config {
        shm_disable: true,
        encrypt: on,
        auth_token: Some(AuthToken::new(b"encrypted-links-test")),
        cost_model: Some("default".into()),
        ..util::test_config(20.0)
    }
}

#[test]
fn every_collective_is_exact_over_encrypted_links() {
    for (n, lazy, nsocks, nthreads) in
        [(2, true, 1, 0), (3, true, 2, 0), (3, false, 1, 1), (5, false, 3, 0), (4, true, 2, 1)]
    {
        let cfg = Config { connect_lazy: lazy, nsocks, nthreads, ..encrypted(true) };
        util::run_threads(n, &cfg, move |comm| {
            let failures = util::cases::run_matrix(&comm, false);
            assert!(
                failures.is_empty(),
                "{n} ranks, lazy {lazy}, {nsocks} lanes, {nthreads} threads: {failures:?}"
            );
            for p in (0..n).filter(|&p| p != comm.rank()) {
                let kind = comm.transport_to(p);
                assert!(
                    kind.is_none_or(|k| k.ends_with("+tls")),
                    "rank {} to {p}: {kind:?} is not encrypted",
                    comm.rank()
                );
            }
        });
    }
}

/// What the relay does to the bytes of one connection, once, in the whole run.
#[derive(Clone, Copy, Debug)]
enum Tamper {
    None,
    /// Flip a bit of the byte at this offset of a connection's stream.
    Flip(usize),
    /// At this offset, send the 5,000 bytes before it again.
    Replay(usize),
    /// Drop 5,000 bytes at this offset.
    Drop(usize),
}

/// A TCP proxy in front of every rank's listener: it records every byte that passes and may
/// tamper with one stretch of one connection.
struct Relay {
    seen: Mutex<Vec<u8>>,
    tamper: Tamper,
    tampered: AtomicBool,
    stop: AtomicBool,
}

impl Relay {
    fn new(tamper: Tamper) -> Arc<Relay> {
        Arc::new(Relay {
            seen: Mutex::new(Vec::new()),
            tamper,
            tampered: AtomicBool::new(false),
            stop: AtomicBool::new(false),
        })
    }

    /// A listener that forwards every connection to `real`; returns its address.
    fn front(self: &Arc<Relay>, real: SocketAddr) -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.set_nonblocking(true).unwrap();
        let addr = l.local_addr().unwrap();
        let relay = self.clone();
        std::thread::spawn(move || {
            while !relay.stop.load(Ordering::Relaxed) {
                match l.accept() {
                    Ok((c, _)) => {
                        c.set_nonblocking(false).unwrap();
                        let Ok(s) = TcpStream::connect(real) else { continue };
                        for (from, to) in [(c.try_clone().unwrap(), s.try_clone().unwrap()), (s, c)] {
                            let relay = relay.clone();
                            std::thread::spawn(move || relay.pump(from, to));
                        }
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
        });
        addr
    }

    fn pump(&self, mut from: TcpStream, mut to: TcpStream) {
        let _ = from.set_read_timeout(Some(Duration::from_millis(200)));
        let mut buf = vec![0u8; 64 << 10];
        let mut at = 0usize;
        loop {
            let n = match from.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e)
                    if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) =>
                {
                    if self.stop.load(Ordering::Relaxed) {
                        break;
                    }
                    continue;
                }
                Err(_) => break,
            };
            let mut chunk = buf[..n].to_vec();
            self.seen.lock().unwrap().extend_from_slice(&chunk);
            let off = match self.tamper {
                Tamper::Flip(o) | Tamper::Replay(o) | Tamper::Drop(o) => o,
                Tamper::None => usize::MAX,
            };
            if at <= off && off < at + n && off >= 5000 && !self.tampered.swap(true, Ordering::SeqCst) {
                let i = off - at;
                match self.tamper {
                    Tamper::Flip(_) => chunk[i] ^= 0x10,
                    Tamper::Replay(_) => {
                        // The 5,000 bytes before `off` were sent already: send them again.
                        let mut again = Vec::new();
                        let start = i.saturating_sub(5000);
                        again.extend_from_slice(&chunk[start..i]);
                        chunk.splice(i..i, again);
                    }
                    Tamper::Drop(_) => {
                        let end = (i + 5000).min(chunk.len());
                        chunk.drain(i..end);
                    }
                    Tamper::None => {}
                }
            }
            at += n;
            if to.write_all(&chunk).is_err() {
                break;
            }
        }
        let _ = to.shutdown(std::net::Shutdown::Write);
    }
}

impl Relay {
    /// Ends the relay's threads (they hold the relay, so dropping the test's handle cannot).
    fn close(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// A store that publishes the relay's address in place of every rank's own.
struct Relaying {
    inner: MemStore,
    relay: Arc<Relay>,
}

impl Store for Relaying {
    fn set(&self, key: &str, value: &[u8]) -> toroid::Result<()> {
        let real = std::str::from_utf8(value).ok().and_then(|s| s.parse::<SocketAddr>().ok());
        match real {
            Some(a) if key.contains("/addr/") => {
                self.inner.set(key, self.relay.front(a).to_string().as_bytes())
            }
            _ => self.inner.set(key, value),
        }
    }
    fn get(&self, key: &str, timeout: Duration) -> toroid::Result<Vec<u8>> {
        self.inner.get(key, timeout)
    }
    fn add(&self, key: &str, delta: i64) -> toroid::Result<i64> {
        self.inner.add(key, delta)
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> toroid::Result<()> {
        self.inner.wait(keys, timeout)
    }
    fn delete(&self, key: &str) -> toroid::Result<bool> {
        self.inner.delete(key)
    }
}

/// 1 MiB of rank `r`'s data: random bytes as u32s (what the ranks all-reduce and broadcast).
fn pattern(r: usize) -> Vec<u32> {
    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ (r as u64 + 1);
    (0..(1 << 18))
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Small values, so that sums of a few stay exact.
            (x as u32) >> 4
        })
        .collect()
}

/// Runs `n` ranks whose links all pass through `relay`; each runs `body` and returns its
/// result.
fn through_relay<T: Send + 'static>(
    n: usize,
    cfg: &Config,
    relay: &Arc<Relay>,
    body: impl Fn(Communicator) -> T + Send + Sync + 'static,
) -> Vec<toroid::Result<T>> {
    let store: Arc<dyn Store> = Arc::new(Relaying { inner: MemStore::new(), relay: relay.clone() });
    let body = Arc::new(body);
    let handles: Vec<_> = (0..n)
        .map(|r| {
            let (store, body, cfg) = (store.clone(), body.clone(), cfg.clone());
            std::thread::spawn(move || Communicator::with_store(r, n, store, &cfg).map(|c| body(c)))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Every 32-byte aligned block of `data`.
fn blocks(data: &[u8], into: &mut HashSet<[u8; 32]>) {
    for c in data.chunks_exact(32) {
        into.insert(c.try_into().unwrap());
    }
}

/// How many of the relay's byte positions start a block of `known`.
fn sightings(seen: &[u8], known: &HashSet<[u8; 32]>) -> usize {
    seen.windows(32).filter(|w| known.contains(*w)).count()
}

fn exchange_patterns(n: usize, cfg: &Config) -> (usize, usize) {
    let relay = Relay::new(Tamper::None);
    let results = through_relay(n, cfg, &relay, move |comm| {
        let r = comm.rank();
        let mut sum = pattern(r);
        comm.all_reduce(&mut sum, toroid::ReduceOp::Sum).unwrap();
        let mut b = if r == 0 { pattern(100) } else { vec![0u32; 1 << 18] };
        comm.broadcast(&mut b, 0).unwrap();
        assert!(b == pattern(100), "rank {r}: broadcast differs");
        let inputs: Vec<Vec<u32>> = (0..n).map(pattern).collect();
        for (i, v) in sum.iter().enumerate() {
            let want: u32 = inputs.iter().map(|p| p[i]).sum();
            assert_eq!(*v, want, "rank {r}: element {i}");
        }
        sum
    });
    let sums: Vec<Vec<u32>> = results.into_iter().map(|r| r.expect("set-up")).collect();
    let mut known = HashSet::new();
    for q in 0..n {
        blocks(bytemuck_bytes(&pattern(q)), &mut known);
    }
    blocks(bytemuck_bytes(&pattern(100)), &mut known);
    blocks(bytemuck_bytes(&sums[0]), &mut known);
    relay.close();
    let seen = relay.seen.lock().unwrap().clone();
    (sightings(&seen, &known), seen.len())
}

fn bytemuck_bytes(v: &[u32]) -> &[u8] {
    bytemuck::cast_slice(v)
}

#[test]
fn a_relay_sees_none_of_the_data_when_links_are_encrypted() {
    for n in [2, 3] {
        let (hits, bytes) = exchange_patterns(n, &encrypted(true));
        assert!(bytes > 2 << 20, "{n} ranks: the relay saw only {bytes} bytes: the links bypassed it");
        assert_eq!(hits, 0, "{n} ranks: the relay saw {hits} blocks of the data in {bytes} bytes");
    }
    // The same run in plaintext: the relay sees the data (so the check above can fail).
    let (hits, bytes) = exchange_patterns(2, &encrypted(false));
    assert!(hits > 10_000, "plaintext: only {hits} blocks of the data seen in {bytes} bytes");
}

#[test]
fn tampering_in_transit_fails_every_rank_within_the_timeout() {
    for tamper in [Tamper::Flip(700_001), Tamper::Replay(900_000), Tamper::Drop(800_000)] {
        let relay = Relay::new(tamper);
        let cfg = Config { timeout: Duration::from_secs(15), ..encrypted(true) };
        let start = Instant::now();
        let results = through_relay(3, &cfg, &relay, |comm| util::all_reduce_until_error(&comm, 1 << 18));
        let took = start.elapsed();
        relay.close();
        assert!(relay.tampered.load(Ordering::SeqCst), "{tamper:?}: the relay never tampered");
        let errors: Vec<String> = results
            .into_iter()
            .map(|r| match r {
                Ok((e, _)) => e.to_string(),
                Err(e) => format!("set-up: {e}"),
            })
            .collect();
        assert!(took < Duration::from_secs(40), "{tamper:?}: {took:?}: {errors:?}");
        assert!(
            errors.iter().any(|e| e.contains("failed authentication") || e.contains("malformed record")),
            "{tamper:?}: no rank names the tampered link: {errors:?}"
        );
    }
}

#[test]
fn ranks_that_disagree_on_encryption_fail_at_set_up() {
    let store: Arc<dyn Store> = Arc::new(MemStore::new());
    let handles: Vec<_> = (0..3)
        .map(|r| {
            let store = store.clone();
            let cfg = encrypted(r != 1);
            std::thread::spawn(move || Communicator::with_store(r, 3, store, &cfg).map(|_| ()))
        })
        .collect();
    for (r, h) in handles.into_iter().enumerate() {
        let e = h.join().unwrap().expect_err("set-up succeeded with encryption on some ranks only");
        assert!(e.to_string().contains("TOROID_ENCRYPT"), "rank {r}: {e}");
    }
    let no_token = Config { auth_token: None, ..encrypted(true) };
    let e = Communicator::with_store(0, 1, Arc::new(MemStore::new()), &no_token).map(|_| ()).unwrap_err();
    assert!(e.to_string().contains("needs TOROID_AUTH_TOKEN"), "{e}");
}

#[test]
fn splits_and_shrinks_keep_their_links_encrypted() {
    let cfg = encrypted(true);
    util::run_threads(4, &cfg, |comm| {
        let r = comm.rank();
        let check = |c: &Communicator, what: &str| {
            let n = c.size();
            let mut v: Vec<u64> = (0..4099).map(|i| (i * 31 + c.rank() * 7) as u64).collect();
            c.all_reduce(&mut v, toroid::ReduceOp::Sum).unwrap();
            for (i, x) in v.iter().enumerate() {
                let want: u64 = (0..n).map(|q| (i * 31 + q * 7) as u64).sum();
                assert_eq!(*x, want, "{what}: rank {}: element {i}", c.rank());
            }
            let kinds: Vec<_> = (0..n).filter(|&p| p != c.rank()).filter_map(|p| c.transport_to(p)).collect();
            assert!(!kinds.is_empty() && kinds.iter().all(|k| k.ends_with("+tls")), "{what}: {kinds:?}");
        };
        let half = comm.split(Some((r % 2) as u32), r as i64).unwrap().expect("a member");
        check(&half, "split");
        if r == 3 {
            return;
        }
        let shrunk = comm.shrink(&[3]).unwrap();
        assert_eq!(shrunk.size(), 3);
        check(&shrunk, "shrink");
    });
}

/// 1 MiB of a pattern through a TCP store behind `relay`: one client sets 16 values of 64 KiB,
/// another reads them back. Returns what the reads gave (or the first error), and the blocks
/// of the pattern the relay saw.
fn store_through_relay(encrypt: bool, relay: &Arc<Relay>) -> (Result<(), String>, usize) {
    use toroid::rendezvous::TcpStore;
    let token = AuthToken::new(b"encrypted-store-test");
    let t = Duration::from_secs(10);
    let server = if encrypt {
        TcpStore::serve_encrypted("127.0.0.1:0", t, &token)
    } else {
        TcpStore::serve_with_token("127.0.0.1:0", t, Some(&token))
    }
    .unwrap();
    let front = relay.front(server.server_addr().unwrap()).to_string();
    let connect = || {
        if encrypt {
            TcpStore::connect_encrypted(&front, t, &token)
        } else {
            TcpStore::connect_with_token(&front, t, Some(&token))
        }
    };
    let value = |k: usize| bytemuck_bytes(&pattern(200 + k)[..16 << 10]).to_vec();
    let run = || -> toroid::Result<()> {
        let (a, b) = (connect()?, connect()?);
        for k in 0..16 {
            a.set(&format!("v{k}"), &value(k))?;
        }
        for k in 0..16 {
            let got = b.get(&format!("v{k}"), t)?;
            // Tampering may fail a call, never change a value.
            assert!(got == value(k), "value {k} came back changed");
        }
        Ok(())
    };
    let res = run().map_err(|e| e.to_string());
    relay.close();
    let mut known = HashSet::new();
    for k in 0..16 {
        blocks(&value(k), &mut known);
    }
    let seen = relay.seen.lock().unwrap().clone();
    (res, sightings(&seen, &known))
}

#[test]
fn a_relay_sees_none_of_the_store_values_and_tampering_fails_the_call() {
    let relay = Relay::new(Tamper::None);
    let (res, hits) = store_through_relay(true, &relay);
    res.unwrap();
    let bytes = relay.seen.lock().unwrap().len();
    assert!(bytes > 2 << 20, "the relay saw only {bytes} bytes: the store bypassed it");
    assert_eq!(hits, 0, "the relay saw {hits} blocks of the store's values in {bytes} bytes");
    // The same in plaintext: the relay sees them (so the check above can fail).
    let (res, hits) = store_through_relay(false, &Relay::new(Tamper::None));
    res.unwrap();
    assert!(hits > 10_000, "plaintext store: only {hits} blocks of the values seen");
    for tamper in [Tamper::Flip(300_001), Tamper::Replay(400_000), Tamper::Drop(500_000)] {
        let relay = Relay::new(tamper);
        let start = Instant::now();
        let (res, _) = store_through_relay(true, &relay);
        assert!(relay.tampered.load(Ordering::SeqCst), "{tamper:?}: the relay never tampered");
        let e = res.expect_err("a tampered store connection went unnoticed");
        eprintln!("{tamper:?}: {e}");
        assert!(start.elapsed() < Duration::from_secs(30), "{tamper:?}: {:?}: {e}", start.elapsed());
        assert!(e.contains("store"), "{tamper:?}: {e}");
    }
}

/// A site CA, and one certificate of it for every rank (valid, or expired) in `dir`.
fn site_files(dir: &std::path::Path, expired: bool) -> toroid::TlsFiles {
    use rcgen::{
        BasicConstraints, CertificateParams, CertifiedIssuer, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    };
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(p, KeyPair::generate().unwrap()).unwrap();
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(vec!["ranks.example".to_string()]).unwrap();
    p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    if expired {
        p.not_before = rcgen::date_time_ymd(2019, 1, 1);
        p.not_after = rcgen::date_time_ymd(2020, 1, 1);
    }
    let cert = p.signed_by(&key, &ca).unwrap();
    std::fs::create_dir_all(dir).unwrap();
    let write = |name: &str, text: String| {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    toroid::TlsFiles {
        ca: write("ca.pem", ca.pem()),
        cert: write("cert.pem", cert.pem()),
        key: write("key.pem", key.serialize_pem()),
    }
}

#[test]
fn certificate_files_of_the_sites_ca_encrypt_every_link_and_an_expired_one_is_refused() {
    let dir = std::env::temp_dir().join(format!("toroid-encrypted-certs-{}", std::process::id()));
    let cfg = Config { tls_files: Some(site_files(&dir.join("ok"), false)), ..encrypted(true) };
    util::run_threads(3, &cfg, |comm| {
        let n = comm.size();
        let mut v: Vec<u32> = (0..100_003).map(|i| (i * 3 + comm.rank()) as u32).collect();
        comm.all_reduce(&mut v, toroid::ReduceOp::Sum).unwrap();
        for (i, x) in v.iter().enumerate() {
            let want: u32 = (0..n).map(|q| (i * 3 + q) as u32).sum();
            assert_eq!(*x, want, "rank {}: element {i}", comm.rank());
        }
        let kinds: Vec<_> =
            (0..n).filter(|&p| p != comm.rank()).filter_map(|p| comm.transport_to(p)).collect();
        assert!(!kinds.is_empty() && kinds.iter().all(|k| k.ends_with("+tls")), "{kinds:?}");
    });
    let old = Config { tls_files: Some(site_files(&dir.join("old"), true)), ..encrypted(true) };
    let e = Communicator::with_store(0, 1, Arc::new(MemStore::new()), &old).map(|_| ()).unwrap_err();
    assert!(e.to_string().contains("expired"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}
