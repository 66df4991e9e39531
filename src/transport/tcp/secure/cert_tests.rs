//! Encrypted links with certificate files (`TOROID_TLS_CA/CERT/KEY`): certificates of the
//! site's CA make a working link; an expired certificate, one of another CA, one whose key is
//! not the one its rank published, and a peer with raw keys are refused with errors that say
//! so; a rank's own expired certificate or mismatched key is refused when it is loaded.

use std::path::PathBuf;
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    date_time_ymd,
};

use super::tests::handshake;
use super::*;
use crate::transport::testutil::{exchange, random_bytes};

/// A directory of PEM files, removed at the end.
struct Dir(PathBuf);

impl Dir {
    fn new(tag: &str) -> Dir {
        let p = std::env::temp_dir().join(format!("toroid-certs-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&p).unwrap();
        Dir(p)
    }
    fn write(&self, name: &str, text: &str) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

type Ca = CertifiedIssuer<'static, KeyPair>;

fn ca(name: &str) -> Ca {
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.distinguished_name.push(rcgen::DnType::CommonName, name);
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    CertifiedIssuer::self_signed(p, KeyPair::generate().unwrap()).unwrap()
}

/// A rank's certificate from `ca` (valid now unless `expired`), and its key, as PEM.
fn rank_cert(ca: &Ca, expired: bool) -> (String, String) {
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(vec!["rank.example".to_string()]).unwrap();
    p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    if expired {
        p.not_before = date_time_ymd(2020, 1, 1);
        p.not_after = date_time_ymd(2021, 1, 1);
    }
    (p.signed_by(&key, ca).unwrap().pem(), key.serialize_pem())
}

/// Files of one rank: the CA it trusts, its certificate and key.
fn files(dir: &Dir, name: &str, trusted: &Ca, cert: &(String, String)) -> (PathBuf, PathBuf, PathBuf) {
    (
        dir.write(&format!("{name}-ca.pem"), &trusted.pem()),
        dir.write(&format!("{name}-cert.pem"), &cert.0),
        dir.write(&format!("{name}-key.pem"), &cert.1),
    )
}

fn load(f: &(PathBuf, PathBuf, PathBuf)) -> Result<Identity> {
    Identity::from_files(&f.0, &f.1, &f.2)
}

fn load_unchecked(f: &(PathBuf, PathBuf, PathBuf)) -> Arc<Identity> {
    Arc::new(Identity::load(&f.0, &f.1, &f.2).unwrap())
}

fn keys(a: &Identity, b: &Identity) -> Vec<Vec<u8>> {
    vec![a.public_key().to_vec(), b.public_key().to_vec()]
}

#[test]
fn certificates_of_the_sites_ca_make_a_working_link() {
    let dir = Dir::new("ok");
    let site = ca("site");
    let a = Arc::new(load(&files(&dir, "a", &site, &rank_cert(&site, false))).unwrap());
    let b = Arc::new(load(&files(&dir, "b", &site, &rank_cert(&site, false))).unwrap());
    let k = keys(&a, &b);
    let (s, c) = handshake(a, k.clone(), b"t", b, k, b"t");
    let (mut s, mut c) = (s.unwrap(), c.unwrap());
    let (x, y) = (random_bytes(200_003, 3), random_bytes(100_001, 4));
    let (at_c, at_s) = exchange(&mut *c, &mut *s, &x, &y);
    assert!(at_s == x && at_c == y);
}

/// Rank 0 (a valid certificate of `site`) accepts rank 1 presenting `bad`; both must fail,
/// and rank 0's error must contain `want`. Then the same with the roles swapped (rank 1 valid
/// dials a rank 0 presenting `bad`).
fn refused_both_ways(dir: &Dir, site: &Ca, bad: Arc<Identity>, want: &str) {
    let good = Arc::new(load(&files(dir, "good", site, &rank_cert(site, false))).unwrap());
    let k = keys(&good, &bad);
    let (s, c) = handshake(good.clone(), k.clone(), b"t", bad.clone(), k, b"t");
    let e = s.expect_err("the accepting rank took a bad certificate").to_string();
    eprintln!("accepting: {e}");
    assert!(e.contains(want), "accepting: {e}");
    assert!(c.is_err(), "the bad side got a link");
    let k = keys(&bad, &good);
    let (s, c) = handshake(bad, k.clone(), b"t", good, k, b"t");
    let e = c.expect_err("the dialing rank took a bad certificate").to_string();
    assert!(e.contains(want), "dialing: {e}");
    assert!(s.is_err(), "the bad side got a link");
}

#[test]
fn an_expired_certificate_is_refused_by_its_peer_and_when_loaded() {
    let dir = Dir::new("expired");
    let site = ca("site");
    let f = files(&dir, "old", &site, &rank_cert(&site, true));
    let e = load(&f).unwrap_err().to_string();
    assert!(e.contains("expired") && e.contains("old-cert.pem"), "{e}");
    refused_both_ways(&dir, &site, load_unchecked(&f), "has expired");
}

#[test]
fn a_certificate_of_another_ca_is_refused_by_its_peer_and_when_loaded() {
    let dir = Dir::new("foreign");
    let (site, other) = (ca("site"), ca("elsewhere"));
    // It trusts the site's CA, but its certificate is from another.
    let f = (
        dir.write("f-ca.pem", &site.pem()),
        dir.write("f-cert.pem", &rank_cert(&other, false).0),
        dir.write("f-key.pem", &rank_cert(&other, false).1),
    );
    // (A key of another certificate: refused first for that.)
    let e = load(&f).unwrap_err().to_string();
    assert!(e.contains("does not belong to the certificate"), "{e}");
    let foreign = rank_cert(&other, false);
    let f = files(&dir, "f", &site, &foreign);
    let e = load(&f).unwrap_err().to_string();
    assert!(e.contains("foreign certificate"), "{e}");
    refused_both_ways(&dir, &site, load_unchecked(&f), "foreign certificate");
}

#[test]
fn a_valid_certificate_without_the_published_key_is_refused() {
    let dir = Dir::new("unpinned");
    let site = ca("site");
    let a = Arc::new(load(&files(&dir, "a", &site, &rank_cert(&site, false))).unwrap());
    let b = Arc::new(load(&files(&dir, "b", &site, &rank_cert(&site, false))).unwrap());
    let thief = Arc::new(load(&files(&dir, "t", &site, &rank_cert(&site, false))).unwrap());
    // A holder of another valid certificate of the site dials as rank 1.
    let (s, c) = handshake(a.clone(), keys(&a, &b), b"t", thief, keys(&a, &b), b"t");
    let e = s.expect_err("accepted a certificate without the published key").to_string();
    assert!(e.contains("key other than the one its rank published"), "{e}");
    assert!(c.is_err());
}

#[test]
fn certificates_and_raw_keys_do_not_mix() {
    let dir = Dir::new("mixed");
    let site = ca("site");
    let cert = Arc::new(load(&files(&dir, "c", &site, &rank_cert(&site, false))).unwrap());
    let raw = Arc::new(Identity::generate().unwrap());
    let k = keys(&cert, &raw);
    let (s, c) = handshake(cert, k.clone(), b"t", raw, k, b"t");
    let (s, c) = (s.expect_err("certificate side").to_string(), c.expect_err("raw-key side").to_string());
    eprintln!("certificate side: {s}\nraw-key side: {c}");
    assert!(s.contains("TOROID_TLS") || c.contains("TOROID_TLS"), "neither names the setting: {s} / {c}");
}
