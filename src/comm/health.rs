//! The health query: every rank of a communicator asked at once over the control plane, and
//! the answers made into one document (`trace::health`: alive, stopped or dead, the operation
//! each is in and for how long, the verdict, the stragglers).
//!
//! Two askers. A rank asks its peers ([`Communicator::health`], the C ABI's
//! `toroid_comm_health`, Python's `comm.health()`). A process outside the job asks every rank
//! ([`query_dir`], `toroid-run --status`): with `TOROID_STATUS_DIR` set (`toroid-run` sets it),
//! each rank of each communicator leaves a status entry there, a one-line file naming its
//! control-plane address, written when its control thread starts and removed when the
//! communicator goes (a killed rank's entry stays; its address then refuses, which is how the
//! query knows it dead). The observer proves itself as a member would: the communicator's id
//! from the entry and, with `TOROID_AUTH_TOKEN`, the token; the directory is the launcher's,
//! mode 0700, and each entry 0600.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::Communicator;
use super::control::ask_all;
use crate::config::AuthToken;
use crate::error::{Error, Result};
use crate::trace::{Asked, Health, PeerAnswer, now_ns};
use crate::transport::tcp::control::ControlCtx;

/// How long each rank has to answer the health query by default: a live rank answers from its
/// control thread within a few milliseconds whatever it is doing (64 ranks on 2 cores: the
/// whole query in 15-20 ms, `examples/health_query.rs`), and the whole query, a stopped rank's
/// silence included, must answer within 100 ms.
pub const HEALTH_GRACE: Duration = Duration::from_millis(60);

/// The longest status entry read (the line is well under 100 bytes).
const MAX_ENTRY: u64 = 512;
/// Entries read from one directory at most (every rank of every communicator of a job).
const MAX_ENTRIES: usize = 1 << 16;
const ENTRY_TAG: &str = "toroid-status1";
/// The largest communicator an entry may name (bounds what the query allocates).
const MAX_SIZE: usize = 1 << 16;
/// Communicators asked at once (each asks its ranks 64 at a time).
const COMMS_AT_ONCE: usize = 16;

/// One rank's status entry: the file and what it says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Entry {
    pub comm_id: u64,
    pub rank: usize,
    pub size: usize,
    pub addr: SocketAddr,
    pub pid: u32,
    /// Its control plane answers in TLS (`TOROID_ENCRYPT`): the word `tls` at the end.
    pub tls: bool,
}

impl Entry {
    fn file_name(&self) -> String {
        format!("{:016x}.{}", self.comm_id, self.rank)
    }

    fn line(&self) -> String {
        let tls = if self.tls { " tls" } else { "" };
        format!(
            "{ENTRY_TAG} {:016x} {} {} {} {}{tls}\n",
            self.comm_id, self.rank, self.size, self.addr, self.pid
        )
    }

    fn parse(text: &str) -> Option<Entry> {
        let mut w = text.trim_end_matches('\n').split(' ');
        if w.next()? != ENTRY_TAG {
            return None;
        }
        let comm_id = u64::from_str_radix(w.next()?, 16).ok()?;
        let rank: usize = w.next()?.parse().ok()?;
        let size: usize = w.next()?.parse().ok()?;
        let addr: SocketAddr = w.next()?.parse().ok()?;
        let pid: u32 = w.next()?.parse().ok()?;
        let tls = match w.next() {
            None => false,
            Some("tls") => true,
            Some(_) => return None,
        };
        (w.next().is_none() && rank < size && size <= MAX_SIZE).then_some(Entry {
            comm_id,
            rank,
            size,
            addr,
            pid,
            tls,
        })
    }
}

/// A rank's status entry in `TOROID_STATUS_DIR`, removed on drop.
#[derive(Debug)]
pub(crate) struct StatusFile {
    path: PathBuf,
}

impl StatusFile {
    /// Writes the entry of `rank` of `size` of communicator `comm_id`, listening at `addr`, in
    /// `dir` (best effort: a status entry that cannot be written is logged, never an error).
    pub(crate) fn write(
        dir: &Path,
        comm_id: u64,
        rank: usize,
        size: usize,
        addr: SocketAddr,
        tls: bool,
    ) -> Option<StatusFile> {
        use std::io::Write as _;
        use std::os::unix::fs::OpenOptionsExt as _;
        if let Err(why) = private_dir(dir) {
            tracing::warn!(target: "toroid::health",
                "rank {rank}: no status entry in {} ({why}): an entry names the communicator, which \
                 admits its holder to it (without TOROID_AUTH_TOKEN)", dir.display());
            return None;
        }
        let e = Entry { comm_id, rank, size, addr, pid: std::process::id(), tls };
        let path = dir.join(e.file_name());
        // Written whole under a temporary name, then renamed: a reader sees all of it or none.
        let tmp = dir.join(format!(".{}.{}", e.file_name(), e.pid));
        let written = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .and_then(|mut f| f.write_all(e.line().as_bytes()))
            .and_then(|()| std::fs::rename(&tmp, &path));
        match written {
            Ok(()) => Some(StatusFile { path }),
            Err(err) => {
                let _ = std::fs::remove_file(&tmp);
                tracing::warn!(target: "toroid::health",
                    "rank {rank}: no status entry in {} (the health query will not see it): {err}", dir.display());
                None
            }
        }
    }
}

/// `dir` is a directory of this process's user that nobody else may read or enter.
fn private_dir(dir: &Path) -> std::result::Result<(), String> {
    use std::os::unix::fs::MetadataExt as _;
    let m = std::fs::metadata(dir).map_err(|e| e.to_string())?;
    if !m.is_dir() {
        return Err("not a directory".into());
    }
    if m.uid() != crate::sys::user::euid() {
        return Err(format!("owned by uid {}, not this user", m.uid()));
    }
    if m.mode() & 0o077 != 0 {
        return Err(format!("mode {:o}: others may read it (make it 0700)", m.mode() & 0o777));
    }
    Ok(())
}

impl Drop for StatusFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Communicator {
    /// The health of this communicator now: asks every other rank over the control plane, each
    /// within `grace` (at most a minute; [`HEALTH_GRACE`] is the usual value), and returns
    /// every rank alive, stopped or dead, the operation each is in and for how long, the stall
    /// report's verdict and the stragglers. Callable from any thread, also while an operation
    /// runs or the job is stuck; fails nothing.
    pub fn health(&self, grace: Duration) -> Result<Health> {
        self.core.forked()?;
        let grace = grace.min(Duration::from_secs(60));
        let core = &self.core;
        let now = now_ns();
        let own = Asked {
            rank: core.ident.rank,
            answer: PeerAnswer::Report(core.own_snapshot()),
            sent_ns: now,
            got_ns: now,
        };
        let mut asked = core.ask_peers_timed(grace);
        asked.push(own);
        Ok(Health::build(core.ident.id, core.ident.size, &asked))
    }
}

/// The health of every communicator with status entries in `dir`, asked from outside the job
/// (`toroid-run --status`), each rank within `grace`, the ranks of all communicators at once.
/// `auth`: the job's `TOROID_AUTH_TOKEN`, if it has one. Communicators in the order of their
/// ids.
pub fn query_dir(dir: &Path, grace: Duration, auth: Option<&AuthToken>) -> Result<Vec<Health>> {
    let mut comms: std::collections::BTreeMap<u64, (usize, Vec<Option<Entry>>)> = Default::default();
    let rd = std::fs::read_dir(dir).map_err(|e| Error::system(format!("reading {}", dir.display()), e))?;
    for item in rd.flatten().take(MAX_ENTRIES) {
        let name = item.file_name();
        if name.to_string_lossy().starts_with('.') {
            continue;
        }
        let Some(e) = read_entry(&item.path()) else { continue };
        let slot = comms.entry(e.comm_id).or_insert_with(|| (e.size, vec![None; e.size]));
        // Entries of one communicator that disagree on its size: the first one read wins.
        if slot.0 == e.size {
            let r = e.rank;
            slot.1[r] = Some(e);
        }
    }
    let grace = grace.min(Duration::from_secs(60));
    let mut out = Vec::with_capacity(comms.len());
    // Every rank of every communicator asked at once: the query takes one grace, not one per
    // communicator.
    let jobs: Vec<(u64, usize, Vec<Option<Entry>>)> =
        comms.into_iter().map(|(id, (n, e))| (id, n, e)).collect();
    let mut asked: Vec<Vec<Asked>> = Vec::with_capacity(jobs.len());
    for batch in jobs.chunks(COMMS_AT_ONCE) {
        std::thread::scope(|s| {
            let hs: Vec<_> = batch
                .iter()
                .map(|(id, size, entries)| s.spawn(move || ask_comm(*id, *size, entries, grace, auth)))
                .collect();
            asked.extend(hs.into_iter().map(|h| h.join().unwrap_or_default()));
        });
    }
    for ((id, size, _), a) in jobs.iter().zip(asked) {
        out.push(Health::build(*id, *size, &a));
    }
    Ok(out)
}

fn ask_comm(
    comm_id: u64,
    size: usize,
    entries: &[Option<Entry>],
    grace: Duration,
    auth: Option<&AuthToken>,
) -> Vec<Asked> {
    // A rank without an entry stays unknown; the observer poses as a member (any rank other
    // than the one asked), which the handshake needs.
    let peers: Vec<usize> = (0..size).filter(|&r| entries[r].is_some()).collect();
    let unlisted: SocketAddr = SocketAddr::from(([0, 0, 0, 0], 0));
    let addrs: Vec<SocketAddr> = entries.iter().map(|e| e.as_ref().map_or(unlisted, |e| e.addr)).collect();
    if size < 2 {
        let t = now_ns();
        let why = "a communicator of one rank has no peer to be asked as".to_string();
        return peers
            .iter()
            .map(|&r| Asked { rank: r, answer: PeerAnswer::Failed(why.clone()), sent_ns: t, got_ns: t })
            .collect();
    }
    // The ranks say in their entries whether their control planes answer in TLS.
    let encrypt = entries.iter().flatten().any(|e| e.tls);
    let ctx_of =
        |p: usize| ControlCtx { rank: usize::from(p == 0), size, comm_id, auth: auth.cloned(), encrypt };
    ask_all(&ctx_of, &peers, &addrs, grace)
}

fn read_entry(path: &Path) -> Option<Entry> {
    use std::io::Read as _;
    let f = std::fs::File::open(path).ok()?;
    let mut text = String::new();
    f.take(MAX_ENTRY).read_to_string(&mut text).ok()?;
    Entry::parse(&text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_and_bad_ones_are_refused() {
        let e = Entry {
            comm_id: 0xabc,
            rank: 3,
            size: 8,
            addr: "127.0.0.1:4242".parse().unwrap(),
            pid: 77,
            tls: false,
        };
        assert_eq!(Entry::parse(&e.line()), Some(e.clone()));
        let t = Entry { tls: true, ..e.clone() };
        assert!(t.line().ends_with(" 77 tls\n"));
        assert_eq!(Entry::parse(&t.line()), Some(t));
        assert_eq!(e.file_name(), "0000000000000abc.3");
        for bad in [
            "",
            "toroid-status1 abc 8 8 127.0.0.1:1 7\n",
            "toroid-status1 abc 3 8 127.0.0.1:1 7 extra\n",
            "toroid-status2 abc 3 8 127.0.0.1:1 7\n",
            "toroid-status1 xyz 3 8 127.0.0.1:1 7\n",
            "toroid-status1 abc 3 8 nowhere 7\n",
            "toroid-status1 abc 3 99999999999 127.0.0.1:1 7\n",
        ] {
            assert_eq!(Entry::parse(bad), None, "{bad:?}");
        }
    }
}
