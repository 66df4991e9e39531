//! What every rank publishes in the store at set-up and how it reads the others': its
//! listening address and host record, read either key by key (`TOROID_CONNECT=mesh`) or as one
//! roster that rank 0 assembles in chunks of at most [`ROSTER_CHUNK`] bytes (`lazy`), and the
//! errors that name the rank that did not join.

use std::net::SocketAddr;
use std::time::Instant;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::rendezvous::Store;
use crate::transport::tcp::striped::LinkPrefs;

/// Largest roster chunk in the store (below the TCP store's 64 KiB value limit).
pub(super) const ROSTER_CHUNK: usize = 60 << 10;

/// What every rank publishes at set-up: where it listens and its host record.
pub(super) struct Published {
    /// Every rank's listening address.
    pub addrs: Vec<SocketAddr>,
    /// Every rank's logical host.
    pub hosts: Vec<String>,
    /// Every rank's physical machine.
    pub machines: Vec<String>,
    /// What every rank asks of its links.
    pub prefs: Vec<LinkPrefs>,
    /// Every rank's public key for encrypted links (`TOROID_ENCRYPT`), if it published one.
    pub keys: Vec<Option<Vec<u8>>>,
}

impl Published {
    fn with_capacity(n: usize) -> Published {
        Published {
            addrs: Vec::with_capacity(n),
            hosts: Vec::with_capacity(n),
            machines: Vec::with_capacity(n),
            prefs: Vec::with_capacity(n),
            keys: Vec::with_capacity(n),
        }
    }

    /// Adds rank `r`'s address and host record as published in the store, checking that it
    /// links its pairs as this rank does (`lazy`: `TOROID_CONNECT`).
    fn push(&mut self, r: usize, addr: &[u8], host: &[u8], lazy: bool) -> Result<()> {
        let a = String::from_utf8_lossy(addr)
            .parse::<SocketAddr>()
            .map_err(|e| Error::Remote(format!("rank {r} published a bad address: {e}").into()))?;
        self.addrs.push(a);
        let ids = String::from_utf8_lossy(host).into_owned();
        let mut lines = ids.splitn(5, '\n');
        let (h, m, p) = (lines.next().unwrap_or(""), lines.next(), lines.next());
        if let Some(theirs) = lines.next().and_then(|c| c.strip_prefix("connect="))
            && theirs != connect_mode(lazy)
        {
            return Err(connect_mismatch(r, theirs, lazy));
        }
        let key = match lines.next().and_then(|k| k.strip_prefix("key=")) {
            None => None,
            Some(hex) => Some(decode_hex(hex).ok_or_else(|| {
                Error::Remote(format!("rank {r} published a malformed public key").into()).with_peer(r)
            })?),
        };
        self.keys.push(key);
        self.hosts.push(h.to_string());
        self.machines.push(m.unwrap_or(h).to_string());
        self.prefs.push(p.and_then(LinkPrefs::decode).ok_or_else(|| {
            Error::Remote(format!("rank {r} published malformed link settings {p:?}").into())
        })?);
        Ok(())
    }
}

/// The host record's line for this rank's public key (`TOROID_ENCRYPT`).
pub(super) fn key_line(key: &[u8]) -> String {
    let mut s = String::with_capacity(4 + 2 * key.len());
    s.push_str("key=");
    for b in key {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// The bytes of a public key as [`key_line`] writes them (at most 1 KiB).
fn decode_hex(hex: &str) -> Option<Vec<u8>> {
    if !hex.len().is_multiple_of(2) || hex.len() > 2048 {
        return None;
    }
    (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok()).collect()
}

/// `TOROID_CONNECT`'s value as published in the host record.
pub(super) fn connect_mode(lazy: bool) -> &'static str {
    if lazy { "lazy" } else { "mesh" }
}

/// Rank `r` links its pairs another way (`theirs`) than this rank.
pub(super) fn connect_mismatch(r: usize, theirs: &str, lazy: bool) -> Error {
    Error::InvalidUsage(
        format!(
            "rank {r} uses TOROID_CONNECT={theirs} and this rank {}: every rank must use the same",
            connect_mode(lazy)
        )
        .into(),
    )
    .with_peer(r)
}

/// Every rank's keys, each rank reading all of them (`TOROID_CONNECT=mesh`). Rank 0 that finds
/// a rank linking on demand says so in place of the roster that rank waits for, so that it
/// fails at once too.
pub(super) fn read_all(
    store: &dyn Store,
    prefix: &str,
    rank: usize,
    size: usize,
    deadline: Instant,
) -> Result<Published> {
    let mut out = Published::with_capacity(size);
    for r in 0..size {
        let a = get_key(store, &format!("{prefix}/addr/{r}"), deadline).map_err(|e| not_joined(e, r))?;
        let h = get_key(store, &format!("{prefix}/host/{r}"), deadline).map_err(|e| not_joined(e, r))?;
        if let Err(e) = out.push(r, &a, &h, false) {
            if rank == 0 && matches!(e, Error::InvalidUsage(_)) {
                let _ = store.set(&format!("{prefix}/roster/n"), format!("mismatch {r} {e}").as_bytes());
            }
            return Err(e);
        }
    }
    Ok(out)
}

/// Every rank's keys through the roster (`TOROID_CONNECT=lazy`): rank 0 reads every rank's keys
/// and publishes them ([`parse_roster`] for the bytes) as `roster/<c>` chunks of at most
/// [`ROSTER_CHUNK`] bytes and then `roster/n`, their number; the others read `roster/n` and the
/// chunks, a constant number of reads per rank up to a couple of thousand ranks (one more per
/// 60 KiB).
/// Each non-zero rank then sets `roster/read/<r>`, which rank 0 waits for before its store may
/// stop serving ([`finish_roster`]).
pub(super) fn read_roster(
    store: &dyn Store,
    prefix: &str,
    rank: usize,
    size: usize,
    deadline: Instant,
) -> Result<Published> {
    let stream: Vec<u8> = if rank == 0 {
        // A rank that never publishes fails rank 0 at its deadline: it tells the others which
        // one (they wait for the roster, and its store goes away as it exits).
        // It gives up a little before its own deadline, so that the others, which started
        // waiting at about the same time, are still waiting when it tells them.
        let left = deadline.saturating_duration_since(Instant::now());
        let early =
            deadline.checked_sub((left / 10).min(std::time::Duration::from_secs(1))).unwrap_or(deadline);
        let gather = |key: String, r: usize| {
            get_key(store, &key, early).map_err(|e| {
                let e = not_joined(e, r);
                let _ = store.set(&format!("{prefix}/roster/n"), format!("error {r} {e}").as_bytes());
                e
            })
        };
        // Host records repeat (every rank of a host publishes the same one): each goes in once
        // and ranks refer to it by index, so the roster stays about 25 bytes a rank.
        let mut records: Vec<Vec<u8>> = Vec::new();
        let mut index: std::collections::HashMap<Vec<u8>, u32> = std::collections::HashMap::new();
        let mut ranks: Vec<u8> = Vec::with_capacity(size * 28);
        for r in 0..size {
            let a = gather(format!("{prefix}/addr/{r}"), r)?;
            let h = gather(format!("{prefix}/host/{r}"), r)?;
            let i = *index.entry(h.clone()).or_insert_with(|| {
                records.push(h);
                (records.len() - 1) as u32
            });
            put(&mut ranks, &a);
            ranks.extend_from_slice(&i.to_le_bytes());
        }
        let mut stream =
            Vec::with_capacity(4 + ranks.len() + records.iter().map(|h| 4 + h.len()).sum::<usize>());
        stream.extend_from_slice(&(records.len() as u32).to_le_bytes());
        for h in &records {
            put(&mut stream, h);
        }
        stream.extend_from_slice(&ranks);
        let chunks: Vec<&[u8]> = stream.chunks(ROSTER_CHUNK).collect();
        for (c, bytes) in chunks.iter().enumerate() {
            store.set(&format!("{prefix}/roster/{c}"), bytes)?;
        }
        store.set(&format!("{prefix}/roster/n"), chunks.len().to_string().as_bytes())?;
        stream
    } else {
        let n = match get_key(store, &format!("{prefix}/roster/n"), deadline) {
            Ok(n) => n,
            Err(e) => return Err(missing_rank(store, prefix, size, e)),
        };
        let n = String::from_utf8_lossy(&n).into_owned();
        if let Some(e) = roster_error(&n) {
            return Err(e);
        }
        let n: usize = n.parse().map_err(|_| Error::Remote("rank 0 published a bad roster".into()))?;
        let mut stream = Vec::new();
        for c in 0..n {
            stream.extend(
                get_key(store, &format!("{prefix}/roster/{c}"), deadline).map_err(|e| not_joined(e, 0))?,
            );
        }
        // A key of its own (a caller's store may not add atomically, `ffi::store`).
        store.set(&format!("{prefix}/roster/read/{rank}"), b"1")?;
        stream
    };
    parse_roster(&stream, size, true)
}

/// Appends `v` as a `u32` length and its bytes.
pub(super) fn put(out: &mut Vec<u8>, v: &[u8]) {
    out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    out.extend_from_slice(v);
}

/// The roster's bytes (the chunks joined): `u32` H, H host records (`u32` length + bytes),
/// then per rank its address (`u32` length + bytes) and the `u32` index of its host record.
pub(super) fn parse_roster(mut rest: &[u8], size: usize, lazy: bool) -> Result<Published> {
    let bad = || Error::Remote("rank 0 published a malformed roster".into());
    let u32_of = |rest: &mut &[u8]| -> Result<usize> {
        let b = rest.get(..4).ok_or_else(bad)?;
        let v = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
        *rest = &rest[4..];
        Ok(v)
    };
    let field = |rest: &mut &[u8]| -> Result<Vec<u8>> {
        let len = u32_of(rest)?;
        let v = rest.get(..len).ok_or_else(bad)?.to_vec();
        *rest = &rest[len..];
        Ok(v)
    };
    let h = u32_of(&mut rest)?;
    if h > size {
        return Err(bad());
    }
    let records = (0..h).map(|_| field(&mut rest)).collect::<Result<Vec<_>>>()?;
    let mut out = Published::with_capacity(size);
    for r in 0..size {
        let a = field(&mut rest)?;
        let i = u32_of(&mut rest)?;
        out.push(r, &a, records.get(i).ok_or_else(bad)?, lazy)?;
    }
    if !rest.is_empty() {
        return Err(bad());
    }
    Ok(out)
}

/// Why the roster did not come: the first rank whose address is not in the store (rank 0
/// waits for it), found by asking for each key in turn without waiting (this runs only once
/// set-up has failed, so its `N` reads cost nothing while the job is healthy), else rank 0.
pub(super) fn missing_rank(store: &dyn Store, prefix: &str, size: usize, e: Error) -> Error {
    if !matches!(e, Error::Timeout(_)) {
        return not_joined(e, 0);
    }
    let quick = std::time::Duration::from_millis(1);
    // Rank 0 may have named the missing rank just now.
    if let Ok(v) = store.get(&format!("{prefix}/roster/n"), quick)
        && let Some(e) = roster_error(&String::from_utf8_lossy(&v))
    {
        return e;
    }
    for r in 0..size {
        match store.get(&format!("{prefix}/addr/{r}"), quick) {
            Ok(_) => {}
            Err(Error::Timeout(_)) => return not_joined(e, r),
            Err(_) => break, // the store went away: rank 0 gave up
        }
    }
    not_joined(e, 0)
}

/// The failure rank 0 published in place of the roster, if any: `error <rank> <message>` (a
/// rank that never joined) or `mismatch <rank> <message>` (a rank with another
/// `TOROID_CONNECT`).
pub(super) fn roster_error(n: &str) -> Option<Error> {
    let (mismatch, why) = match (n.strip_prefix("error "), n.strip_prefix("mismatch ")) {
        (Some(why), _) => (false, why),
        (None, Some(why)) => (true, why),
        (None, None) => return None,
    };
    let (r, why) = why.split_once(' ').unwrap_or(("0", why));
    let why = format!("rank 0's set-up failed: {why}");
    let e = if mismatch { Error::InvalidUsage(why.into()) } else { Error::Timeout(why.into()) };
    Some(e.with_peer(r.parse().unwrap_or(0)))
}

/// Rank 0 of a lazy set-up: waits until every rank has read the roster, so that the store it
/// serves can stop (`Communicator::from_launch`).
pub(super) fn finish_roster(
    store: &dyn Store,
    prefix: &str,
    rank: usize,
    size: usize,
    deadline: Instant,
) -> Result<()> {
    if rank != 0 || size < 2 {
        return Ok(());
    }
    for r in 1..size {
        get_key(store, &format!("{prefix}/roster/read/{r}"), deadline)
            .map_err(|e| e.context(&format!("waiting for rank {r} to read the roster")).with_peer(r))?;
    }
    Ok(())
}

/// A failed wait for rank `r`'s keys in the store becomes an error naming that rank: it did not
/// join in time, or the store went away (rank 0 gave up) while this rank waited for it.
pub(super) fn not_joined(e: Error, r: usize) -> Error {
    match e {
        Error::Timeout(d) => Error::Timeout(
            format!("rank {r} did not join within the set-up deadline (TOROID_TIMEOUT): {d}").into(),
        )
        .with_peer(r),
        e => e.context(&format!("waiting for rank {r} to join")).with_peer(r),
    }
}

/// `store.get(key)` bounded by `deadline`. A set-up that can be cancelled (`cancel.rs`) asks in
/// slices and checks between them; any other waits in one call.
pub(super) fn get_key(store: &dyn Store, key: &str, deadline: Instant) -> Result<Vec<u8>> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if !crate::cancel::active() {
            return store.get(key, left);
        }
        crate::cancel::check("waiting for the other ranks in the store")?;
        match store.get(key, left.min(crate::cancel::SLICE)) {
            Err(Error::Timeout(_)) if left > crate::cancel::SLICE => continue,
            r => return r,
        }
    }
}

/// This machine's identity: `TOROID_HOST_ID`, else hostname plus boot id.
pub(super) fn host_identity(cfg: &Config) -> String {
    cfg.host_id.clone().unwrap_or_else(machine_identity)
}

/// The physical machine: hostname plus boot id (ranks of emulated hosts share it).
pub(super) fn machine_identity() -> String {
    let read = |p: &str| std::fs::read_to_string(p).map(|s| s.trim().to_string()).unwrap_or_default();
    format!("{}/{}", read("/proc/sys/kernel/hostname"), read("/proc/sys/kernel/random/boot_id"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rendezvous::MemStore;

    #[test]
    fn the_roster_gives_every_rank_every_address_and_host_in_several_chunks() {
        // 3000 ranks on 375 hosts: about 75 KB of roster, two chunks.
        let n = 3000;
        let store = MemStore::new();
        let p = "toroid/gen1";
        for r in 0..n {
            store
                .set(
                    &format!("{p}/addr/{r}"),
                    format!("10.0.{}.{}:{}", r / 250, r % 250, 20000 + r).as_bytes(),
                )
                .unwrap();
            let host = format!("h{}\nm{}\nnsocks=0 shm={} auto=1", r / 8, r / 8, r % 2);
            store.set(&format!("{p}/host/{r}"), host.as_bytes()).unwrap();
        }
        let deadline = Instant::now() + std::time::Duration::from_secs(10);
        let zero = read_roster(&store, p, 0, n, deadline).unwrap();
        let chunks: usize =
            String::from_utf8(store.get(&format!("{p}/roster/n"), deadline - Instant::now()).unwrap())
                .unwrap()
                .parse()
                .unwrap();
        assert_eq!(chunks, 2);
        let other = read_roster(&store, p, 1234, n, deadline).unwrap();
        for got in [&zero, &other] {
            assert_eq!(got.addrs.len(), n);
            for r in [0, 7, 8, 1999, n - 1] {
                assert_eq!(got.addrs[r].to_string(), format!("10.0.{}.{}:{}", r / 250, r % 250, 20000 + r));
                assert_eq!(got.hosts[r], format!("h{}", r / 8));
                assert_eq!(got.machines[r], format!("m{}", r / 8));
                assert_eq!(got.prefs[r].shm, r % 2 == 1);
            }
        }
        assert!(store.get(&format!("{p}/roster/read/1234"), std::time::Duration::ZERO).is_ok());
    }

    #[test]
    fn a_malformed_roster_is_an_error_not_a_panic() {
        let mut good = Vec::new();
        good.extend_from_slice(&1u32.to_le_bytes());
        put(&mut good, b"h\nm\nnsocks=0 shm=1 auto=1");
        put(&mut good, b"127.0.0.1:5");
        good.extend_from_slice(&0u32.to_le_bytes());
        assert!(parse_roster(&good, 1, true).is_ok());
        for cut in 0..good.len() {
            assert!(parse_roster(&good[..cut], 1, true).is_err(), "cut at {cut}");
        }
        assert!(parse_roster(&good, 2, true).is_err());
        let mut bad_index = good.clone();
        let l = bad_index.len();
        bad_index[l - 4] = 9;
        assert!(parse_roster(&bad_index, 1, true).is_err());
        let mut huge = good.clone();
        huge[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(parse_roster(&huge, 1, true).is_err());
    }
}
