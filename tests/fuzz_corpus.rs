//! Replays the fuzz targets' committed inputs on stable, so a crash once found stays fixed.
//!
//! `fuzz/seeds/<target>/` holds the seed corpus: well-formed messages built here (checked
//! byte for byte against the committed files, so seeds follow the wire format when it
//! changes; `TOROID_WRITE_FUZZ_SEEDS=1` rewrites them) and a few mutations of each.
//! `fuzz/regressions/<target>/` holds every input a fuzzer ever crashed on. Every file of both
//! goes through the same entry point as the fuzz target (`toroid::fuzzing`).

use std::path::{Path, PathBuf};

use toroid::fuzzing::{self, FrameVerdict};

const TARGETS: [&str; 6] = ["frame", "handshake", "store", "shm_offer", "store_decode", "record"];

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz")
}

fn run(target: &str, data: &[u8]) {
    match target {
        "frame" => drop(fuzzing::frame(data)),
        "handshake" => drop(fuzzing::handshake(data)),
        "store" => drop(fuzzing::store_session(data)),
        "shm_offer" => drop(fuzzing::shm_offer(data)),
        "store_decode" => drop(fuzzing::store_decode(data)),
        "record" => drop(fuzzing::record(data)),
        _ => panic!("no fuzz target {target}"),
    }
}

/// Files of `fuzz/<kind>/<target>/`, sorted.
fn inputs(kind: &str, target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = fuzz_dir().join(kind).join(target);
    let Ok(entries) = std::fs::read_dir(&dir) else { return Vec::new() };
    let mut files: Vec<PathBuf> = entries.map(|e| e.expect("directory entry").path()).collect();
    files.sort();
    files.into_iter().map(|p| (p.clone(), std::fs::read(&p).expect("reading a corpus file"))).collect()
}

fn frame_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let fp = fuzzing::expected_fingerprint();
    let step = fuzzing::EXPECTED_STEP;
    let len = fuzzing::EXPECTED_LEN as u32;
    let mut valid = fuzzing::frame_header(1, &fp, step, len).to_vec();
    valid.extend_from_slice(&[7; 64]);
    let mut abort = fuzzing::frame_header(2, &fp, 0, 9).to_vec();
    abort.extend_from_slice(b"it failed");
    let other = toroid::internals::collective::Fingerprint { seq: 6, root: 2, ..fp };
    let mut bad_dtype = valid.clone();
    bad_dtype[HEADER_LEN_FP + 1] = 200;
    let mut bad_magic = valid.clone();
    bad_magic[0] ^= 0xff;
    vec![
        ("valid", valid),
        ("abort", abort),
        ("abort_huge_len", fuzzing::frame_header(2, &fp, 0, u32::MAX).to_vec()),
        ("mismatch", fuzzing::frame_header(1, &other, step, len).to_vec()),
        ("wrong_step", fuzzing::frame_header(1, &fp, step + 1, len).to_vec()),
        ("huge_len", fuzzing::frame_header(1, &fp, step, u32::MAX).to_vec()),
        ("bad_dtype", bad_dtype),
        ("bad_magic", bad_magic),
    ]
}
/// Where the fingerprint starts in a frame header (40 - 28).
const HEADER_LEN_FP: usize = 12;

fn handshake_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let open = fuzzing::handshake_hello(None);
    let auth = fuzzing::handshake_hello(Some([0x5a; 16]));
    let mut bad_mac = auth.clone();
    let last = bad_mac.len() - 1;
    bad_mac[last] ^= 1;
    let mut wrong_rank = open.clone();
    wrong_rank[20] = 9;
    vec![
        ("hello", open),
        ("hello_auth", auth.clone()),
        ("hello_auth_short", auth[..30].to_vec()),
        ("hello_auth_bad_mac", bad_mac),
        ("hello_wrong_rank", wrong_rank),
        ("ack", fuzzing::handshake_ack(false)),
        ("ack_auth", fuzzing::handshake_ack(true)),
    ]
}

fn store_frame(payload: &[u8]) -> Vec<u8> {
    let mut f = (payload.len() as u32).to_le_bytes().to_vec();
    f.extend_from_slice(payload);
    f
}
fn bytes(b: &[u8]) -> Vec<u8> {
    let mut v = (b.len() as u32).to_le_bytes().to_vec();
    v.extend_from_slice(b);
    v
}

/// Store request payloads, one per kind (GET and WAIT with short timeouts).
fn store_requests() -> Vec<(&'static str, Vec<u8>)> {
    let wait = [&[4u8][..], &20u64.to_le_bytes(), &2u32.to_le_bytes(), &bytes(b"k"), &bytes(b"j")].concat();
    vec![
        ("set", [&[1u8][..], &bytes(b"k"), &bytes(b"value")].concat()),
        ("get", [&[2u8][..], &20u64.to_le_bytes(), &bytes(b"k")].concat()),
        ("add", [&[3u8][..], &5i64.to_le_bytes(), &bytes(b"n")].concat()),
        ("wait", wait),
        ("delete", [&[5u8][..], &bytes(b"k")].concat()),
    ]
}

/// A client's hello without authentication (protocol version 2: magic, version, flags 0).
fn store_hello() -> Vec<u8> {
    [&b"TRDV"[..], &2u32.to_le_bytes(), &[0u8][..]].concat()
}

fn store_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let hello = store_frame(&store_hello());
    let mut seeds: Vec<(&'static str, Vec<u8>)> = store_requests()
        .into_iter()
        .map(|(name, r)| (name, [&[1u8][..], &hello, &store_frame(&r)].concat()))
        .collect();
    let all: Vec<u8> = store_requests().iter().flat_map(|(_, r)| store_frame(r)).collect();
    seeds.push(("all_split3", [&[3u8][..], &hello, &all].concat()));
    seeds.push(("huge_frame_len", [&[0u8][..], &hello, &u32::MAX.to_le_bytes()].concat()));
    seeds.push(("no_hello", [&[0u8][..], &store_frame(&store_requests()[0].1)].concat()));
    seeds
}

/// Frames for `fuzzing::store_decode`: each payload behind a one-byte length.
fn store_decode_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let short = |p: Vec<u8>| [&[p.len() as u8][..], &p].concat();
    let mut seeds: Vec<(&'static str, Vec<u8>)> =
        store_requests().into_iter().map(|(name, r)| (name, short(r))).collect();
    seeds.push(("hello", short(store_hello())));
    seeds.push((
        "wait_huge_count",
        short([&[4u8][..], &0u64.to_le_bytes(), &u32::MAX.to_le_bytes()].concat()),
    ));
    seeds.push(("set_huge_len", short([&[1u8][..], &u32::MAX.to_le_bytes()].concat())));
    seeds.push(("set_truncated", short([&[1u8][..], &bytes(b"k"), &5u32.to_le_bytes(), &b"v"[..]].concat())));
    seeds
}

fn shm_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let [offer, win] = fuzzing::SHM_OFFER_KINDS;
    let pair_len = toroid::internals::transport::shm::pair_segment_len(1 << 16) as u64;
    let win_len = fuzzing::SHM_WINDOW_LEN as u64;
    let m = |kind, size, text: &str| fuzzing::shm_message(kind, 9, size, text).to_vec();
    vec![
        ("pair", m(offer, pair_len, "/dev/shm/toroid-1-0000000000000009-p0-1")),
        ("window", m(win, win_len, "/dev/shm/toroid-1-0000000000000009-win")),
        ("escape_dotdot", m(offer, pair_len, "/dev/shm/../etc/toroid-x")),
        ("other_dir", m(offer, pair_len, "/var/lib/toroid-x")),
        ("relative", m(offer, pair_len, "toroid-x")),
        ("huge_size", m(offer, u64::MAX, "/dev/shm/toroid-x")),
        ("window_wrong_size", m(win, win_len * 2, "/dev/shm/toroid-x-win")),
        ("decline", m(2, 0, "shared memory disabled")),
    ]
}

/// Encrypted links' record streams (first byte: the size of each socket read).
fn record_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let plain: Vec<u8> = (0..40_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
    let stream = fuzzing::record_stream(&plain, 32 << 10);
    let with = |piece: u8, s: &[u8]| [&[piece][..], s].concat();
    let mut flipped = stream.clone();
    flipped[20_000] ^= 4;
    let mut bad_len = stream.clone();
    bad_len[3] = 0xff;
    let mut replayed = stream.clone();
    let first = 5 + (32 << 10) + 16;
    replayed.splice(first..first, stream[..first].to_vec());
    vec![
        ("valid", with(200, &stream)),
        ("valid_small_reads", with(0, &fuzzing::record_stream(&plain[..5000], 700))),
        ("flipped", with(13, &flipped)),
        ("bad_length", with(255, &bad_len)),
        ("replayed", with(90, &replayed)),
        ("cut", with(7, &stream[..stream.len() - 3])),
        ("plaintext_frame", with(1, &fuzzing::frame_header(1, &fuzzing::expected_fingerprint(), 0, 16))),
    ]
}

fn seeds(target: &str) -> Vec<(&'static str, Vec<u8>)> {
    match target {
        "frame" => frame_seeds(),
        "handshake" => handshake_seeds(),
        "store" => store_seeds(),
        "shm_offer" => shm_seeds(),
        "store_decode" => store_decode_seeds(),
        "record" => record_seeds(),
        _ => panic!("no fuzz target {target}"),
    }
}

#[test]
fn committed_seeds_are_the_generated_ones() {
    let write = std::env::var_os("TOROID_WRITE_FUZZ_SEEDS").is_some();
    for target in TARGETS {
        let dir = fuzz_dir().join("seeds").join(target);
        for (name, bytes) in seeds(target) {
            let path = dir.join(name);
            if write {
                std::fs::create_dir_all(&dir).expect("creating the seed directory");
                std::fs::write(&path, &bytes).expect("writing a seed");
            }
            let committed = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert_eq!(committed, bytes, "{} is stale: rerun with TOROID_WRITE_FUZZ_SEEDS=1", path.display());
        }
    }
}

#[test]
fn well_formed_seeds_are_accepted_and_bad_ones_refused() {
    let frame: Vec<_> = frame_seeds().into_iter().map(|(n, b)| (n, fuzzing::frame(&b))).collect();
    let verdict = |name: &str| &frame.iter().find(|(n, _)| *n == name).expect("seed").1;
    assert_eq!(*verdict("valid"), FrameVerdict::Accepted);
    assert_eq!(*verdict("abort"), FrameVerdict::Abort(9));
    assert_eq!(*verdict("abort_huge_len"), FrameVerdict::Abort(2048));
    assert_eq!(*verdict("mismatch"), FrameVerdict::Mismatch);
    assert_eq!(*verdict("wrong_step"), FrameVerdict::OutOfStep);
    assert_eq!(*verdict("huge_len"), FrameVerdict::OutOfStep);
    assert_eq!(*verdict("bad_dtype"), FrameVerdict::Bad);
    assert_eq!(*verdict("bad_magic"), FrameVerdict::Bad);
    assert_eq!(fuzzing::frame(&[0; 39]), FrameVerdict::Incomplete);

    let hs = |name: &str| {
        let seeds = handshake_seeds();
        fuzzing::handshake(&seeds.iter().find(|(n, _)| *n == name).expect("seed").1)
    };
    let open = hs("hello");
    assert_eq!((open.hello_from, open.open, open.authenticated), (Some(3), true, false));
    let auth = hs("hello_auth");
    assert_eq!((auth.hello_from, auth.open, auth.authenticated), (Some(3), false, true));
    assert!(!hs("hello_auth_short").authenticated);
    assert!(!hs("hello_auth_bad_mac").authenticated);
    assert_eq!(hs("hello_wrong_rank").hello_from, None);
    assert!(hs("ack_auth").ack_authentic);
    assert!(!hs("ack").ack_authentic);

    for (name, bytes) in shm_seeds() {
        let mapped = fuzzing::shm_offer(&bytes);
        assert_eq!(mapped.is_some(), name == "pair" || name == "window", "{name}: {mapped:?}");
    }
    for (name, bytes) in store_decode_seeds() {
        // Requests are handled (answered; those over a cap with a refusal); the hello is not a
        // request and a value longer than its frame is malformed.
        assert_eq!(fuzzing::store_decode(&bytes), !(name == "set_truncated" || name == "hello"), "{name}");
    }
    // A well-formed record stream reads back whole; any change to it is an error after a
    // correct prefix.
    for (name, bytes) in record_seeds() {
        let v = fuzzing::record(&bytes);
        match name {
            "valid" => assert_eq!(v, fuzzing::RecordVerdict { plain: 40_000, failed: false }),
            "valid_small_reads" => assert_eq!(v, fuzzing::RecordVerdict { plain: 5000, failed: false }),
            _ => assert!(v.failed && v.plain < 40_000, "{name}: {v:?}"),
        }
    }
    // The store answers the hello and a request: more than the hello's answer alone.
    let set = store_seeds().into_iter().find(|(n, _)| *n == "set").expect("seed").1;
    assert!(fuzzing::store_session(&set) > 5);
}

#[test]
fn every_committed_input_replays_without_a_crash() {
    let mut replayed = 0;
    for target in TARGETS {
        for kind in ["seeds", "regressions"] {
            for (path, bytes) in inputs(kind, target) {
                let r = std::panic::catch_unwind(|| run(target, &bytes));
                assert!(r.is_ok(), "{} crashes {target}", path.display());
                replayed += 1;
            }
        }
    }
    // The seeds of every target at least (a missing directory must not pass silently).
    let expected: usize = TARGETS.iter().map(|t| seeds(t).len()).sum();
    assert!(replayed >= expected, "replayed {replayed} inputs, expected at least {expected}");
}
