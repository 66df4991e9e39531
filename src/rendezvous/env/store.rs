//! Opening the store: rank 0 serves the TCP store and the others connect, or every rank opens
//! the file store; a single-host job's store is a fresh subdirectory per communicator, removed by
//! the last rank to drop it.

use std::collections::HashMap;
use std::fs;
use std::net::{IpAddr, SocketAddr, TcpListener, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::job_dir::{ensure_private_dir, is_job_dir};
use super::{Launch, StoreAddr, join_host_port};
use crate::config::AuthToken;
use crate::error::{Error, Result};
use crate::rendezvous::torch_store::TorchStore;
use crate::rendezvous::{FileStore, Store, TcpStore};

/// Store key counting the ranks that dropped a job store.
const LEFT_KEY: &str = "toroid/left";

/// The store of a launch, and the TCP server rank 0 runs for it.
pub struct OpenedStore {
    /// The store every rank uses.
    pub store: Arc<dyn Store>,
    /// Rank 0's TCP store, which serves the others.
    server: Option<Arc<TcpStore>>,
}

impl std::fmt::Debug for OpenedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenedStore").field("server", &self.server).finish_non_exhaustive()
    }
}

impl OpenedStore {
    /// Stops rank 0's TCP server (nothing for the other ranks and for file stores).
    pub fn stop_serving(&self) {
        if let Some(s) = &self.server {
            s.stop_serving();
            tracing::info!(target: "toroid::store", "rank 0 stopped serving the store: every rank has connected");
        }
    }
}

/// Opens the store of `launch`: rank 0 serves a TCP store, the others connect; or everyone opens
/// the file store (for a single-host job's private directory, a fresh subdirectory per
/// communicator, removed by the last rank to drop it). With `token` (`TOROID_AUTH_TOKEN`), the
/// TCP store's server and clients authenticate each other, and with `encrypt` as well
/// (`TOROID_ENCRYPT`) their connections are in TLS (see `tcp_store`).
///
/// Rank 0 binds the loopback address when the store host is a loopback name or address (a
/// single-host job); otherwise the first address of the store host that is an address of this
/// machine; and only when there is none (the name the other ranks use for rank 0's host need not
/// be an address rank 0 can bind: NAT, a load balancer, a name that resolves differently here)
/// every interface (`0.0.0.0`, or `[::]` for an IPv6-only host), with a warning. `timeout` bounds
/// connecting and every store call without its own timeout.
///
/// # Errors
/// As [`TcpStore::serve`], [`TcpStore::connect`] and [`FileStore::new`].
pub fn open_store(
    launch: &Launch,
    timeout: Duration,
    token: Option<&AuthToken>,
    encrypt: bool,
) -> Result<OpenedStore> {
    let plain = |store| Ok(OpenedStore { store, server: None });
    match &launch.store {
        StoreAddr::File(dir) if is_job_dir(dir) => plain(open_job_store(dir, launch, timeout)?),
        StoreAddr::File(dir) => plain(Arc::new(FileStore::new(dir)?.with_timeout(timeout))),
        StoreAddr::Tcp { host, port } if launch.rank == 0 => {
            let bind = bind_addr(host, *port, is_local);
            tracing::info!(target: "toroid::store", "rank 0 serves the store on {bind} for {}{}", launch.store,
            match (token.is_some(), encrypt) {
                (_, true) => " (authenticated, encrypted)",
                (true, false) => " (authenticated)",
                _ => "",
            });
            let s = Arc::new(TcpStore::serve_secured(&bind, timeout, token, encrypt)?);
            Ok(OpenedStore { store: s.clone(), server: Some(s) })
        }
        StoreAddr::Tcp { host, port } => {
            plain(Arc::new(TcpStore::connect_secured(&join_host_port(host, *port), timeout, token, encrypt)?))
        }
        StoreAddr::Torch { host, port, restart } => {
            let meeting = TorchMeeting { host, port: *port, restart: *restart };
            meeting.open(launch, timeout, token, encrypt)
        }
    }
}

/// Meeting through a torch `TCPStore` (torchrun's agent store): rank 0 serves toroid's store on
/// a free port and publishes it under a key of this attempt and communicator; the others read
/// it there and connect (`rendezvous::torch_store`).
struct TorchMeeting<'a> {
    host: &'a str,
    port: u16,
    restart: u32,
}

impl TorchMeeting<'_> {
    fn open(
        &self,
        launch: &Launch,
        timeout: Duration,
        token: Option<&AuthToken>,
        encrypt: bool,
    ) -> Result<OpenedStore> {
        // Communicators made from the environment, counted per torch store and rank in this
        // process: every rank creates them in the same order (as `open_job_store`).
        static OPENED: Counters<(String, u16, u32, usize)> = Mutex::new(None);
        let n = count(&OPENED, (self.host.to_string(), self.port, self.restart, launch.rank));
        // torch's own clients prefix keys with '/': `store.get("toroid/store/...")` in torch sees it.
        let key = format!("/toroid/store/{}/{n}", self.restart);
        let deadline = crate::config::deadline_in(timeout);
        let mut torch = TorchStore::connect(self.host, self.port, deadline)?;
        if launch.rank == 0 {
            let bind = bind_addr(self.host, 0, is_local);
            let s = Arc::new(TcpStore::serve_secured(&bind, timeout, token, encrypt)?);
            let addr = s.server_addr().ok_or_else(|| Error::Internal("store: no address".into()))?;
            let port = addr.port();
            torch.set(&key, port.to_string().as_bytes(), deadline)?;
            tracing::info!(target: "toroid::store",
                "rank 0 serves the store on {addr}, published as '{key}' in torch's store at {}",
                join_host_port(self.host, self.port));
            return Ok(OpenedStore { store: s.clone(), server: Some(s) });
        }
        let value = torch.get(&key, deadline).map_err(|e| match e {
            Error::Timeout(_) => Error::Timeout(
                format!(
                    "rank 0 did not publish its store's port as '{key}' in torch's store at {} within {timeout:?} \
                     (is rank 0 running toroid too?)",
                    join_host_port(self.host, self.port)
                )
                .into(),
            ),
            e => e,
        })?;
        let port = std::str::from_utf8(&value)
            .ok()
            .and_then(|v| v.parse::<u16>().ok())
            .filter(|p| *p != 0)
            .ok_or_else(|| {
            Error::Remote(
                format!(
                    "torch's store holds '{}' under '{key}', not a port number",
                    String::from_utf8_lossy(&value)
                )
                .into(),
            )
        })?;
        let store = TcpStore::connect_secured(&join_host_port(self.host, port), timeout, token, encrypt)?;
        Ok(OpenedStore { store: Arc::new(store), server: None })
    }
}

/// Whether `ip` is an address of this machine (one it can bind).
fn is_local(ip: IpAddr) -> bool {
    TcpListener::bind((ip, 0)).is_ok()
}

/// The address rank 0 listens on for a store that the others reach at `host:port`.
fn bind_addr(host: &str, port: u16, is_local: impl Fn(IpAddr) -> bool) -> String {
    let ips: Vec<_> = (host, port).to_socket_addrs().map(|a| a.map(|a| a.ip()).collect()).unwrap_or_default();
    if host.eq_ignore_ascii_case("localhost") || (!ips.is_empty() && ips.iter().all(|ip| ip.is_loopback())) {
        return join_host_port(host, port);
    }
    if let Some(ip) = ips.iter().find(|ip| !ip.is_unspecified() && is_local(**ip)) {
        return SocketAddr::new(*ip, port).to_string();
    }
    let any = if !ips.is_empty() && ips.iter().all(|ip| ip.is_ipv6()) {
        format!("[::]:{port}")
    } else {
        format!("0.0.0.0:{port}")
    };
    tracing::warn!(target: "toroid::store",
        "store host '{host}' names no address of this machine; rank 0 serves the store on every interface ({any})");
    any
}

/// A single-host job's store for one communicator: the file store `job/c<N>`; the last rank to
/// drop it removes it (and the job directory once empty).
struct JobStore {
    inner: FileStore,
    job_dir: PathBuf,
    size: usize,
}

impl Store for JobStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.set(key, value)
    }
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.inner.get(key, timeout)
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.inner.add(key, delta)
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.inner.wait(keys, timeout)
    }
    fn delete(&self, key: &str) -> Result<bool> {
        self.inner.delete(key)
    }
}

impl Drop for JobStore {
    fn drop(&mut self) {
        match self.inner.add(LEFT_KEY, 1) {
            Ok(n) if usize::try_from(n).is_ok_and(|n| n >= self.size) => {
                if let Err(e) = fs::remove_dir_all(self.inner.path()) {
                    tracing::warn!(target: "toroid::store", "removing {}: {e}", self.inner.path().display());
                }
                // Only when empty: another communicator of the job may have started already.
                let _ = fs::remove_dir(&self.job_dir);
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(target: "toroid::store", "leaving {}: {e}", self.inner.path().display()),
        }
    }
}

/// Per-process counters of the communicators opened from one meeting place.
type Counters<K> = Mutex<Option<HashMap<K, u64>>>;

/// Counts one more at `key` and returns the count (1 the first time).
fn count<K: std::hash::Hash + Eq>(counters: &Counters<K>, key: K) -> u64 {
    let mut map = counters.lock().unwrap_or_else(|e| e.into_inner());
    let c = map.get_or_insert_with(HashMap::new).entry(key).or_insert(0);
    *c += 1;
    *c
}

/// Opens the store of communicator number N (counted per job directory and rank in this process:
/// every rank creates its communicators in the same order) of a single-host job.
fn open_job_store(job_dir: &Path, launch: &Launch, timeout: Duration) -> Result<Arc<dyn Store>> {
    static OPENED: Counters<(PathBuf, usize)> = Mutex::new(None);
    if let Some(base) = job_dir.parent() {
        ensure_private_dir(base)?;
    }
    let n = count(&OPENED, (job_dir.to_path_buf(), launch.rank));
    let dir = job_dir.join(format!("c{n}"));
    // The last rank of the previous communicator may remove the (then empty) job directory
    // while this one creates it: try again.
    let mut tries = 0;
    let inner = loop {
        match FileStore::new(&dir) {
            Ok(s) => break s.with_timeout(timeout),
            Err(_) if tries < 3 => tries += 1,
            Err(e) => return Err(e),
        }
    };
    Ok(Arc::new(JobStore { inner, job_dir: job_dir.to_path_buf(), size: launch.size }))
}

#[cfg(test)]
mod tests {
    use super::super::Launcher;
    use super::super::job_dir::private_base;
    use super::super::tests::{RemoveOnDrop, detect_owned, job_dir, ompi, tcp};
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn bind_addresses() {
        let none = |_| false;
        assert_eq!(bind_addr("127.0.0.1", 5, none), "127.0.0.1:5");
        assert_eq!(bind_addr("localhost", 5, none), "localhost:5");
        assert_eq!(bind_addr("::1", 5, none), "[::1]:5");
        // Not an address of this machine: every interface, with a warning.
        assert_eq!(bind_addr("10.1.2.3", 5, none), "0.0.0.0:5");
        assert_eq!(bind_addr("fe80::1", 5, none), "[::]:5");
        // An address of this machine: that one only.
        let here = |ip: IpAddr| ip == IpAddr::from([10, 1, 2, 3]);
        assert_eq!(bind_addr("10.1.2.3", 5, here), "10.1.2.3:5");
        assert_eq!(bind_addr("10.9.9.9", 5, here), "0.0.0.0:5");
        assert!(is_local(IpAddr::from([127, 0, 0, 1])));
        assert!(!is_local(IpAddr::from([192, 0, 2, 1]))); // TEST-NET-1, never assigned
    }

    #[test]
    fn open_store_serves_on_rank_0_and_connects_the_others() {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let launch = move |rank| Launch {
            rank,
            size: 2,
            local_rank: None,
            local_size: None,
            store: tcp("127.0.0.1", port),
            launcher: Launcher::Toroid,
        };
        let t = Duration::from_secs(5);
        let peer = std::thread::spawn(move || {
            // Rank 1 may start first: connect retries until rank 0 serves.
            let s = open_store(&launch(1), t, None, false).unwrap().store;
            s.set("from1", b"hi").unwrap();
            s.get("from0", t).unwrap()
        });
        std::thread::sleep(Duration::from_millis(50));
        let s0 = open_store(&launch(0), t, None, false).unwrap().store;
        s0.set("from0", b"yo").unwrap();
        assert_eq!(s0.get("from1", t).unwrap(), b"hi");
        assert_eq!(peer.join().unwrap(), b"yo");

        let dir = std::env::temp_dir().join(format!("toroid-env-open-{}", std::process::id()));
        let mut l = launch(1);
        l.store = StoreAddr::File(dir.clone());
        let fs = open_store(&l, t, None, false).unwrap().store;
        fs.set("k", b"v").unwrap();
        assert_eq!(fs.get("k", t).unwrap(), b"v");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A stand-in for torch's `TCPStore` server: VALIDATE, SET, WAIT and GET in torch's wire
    /// format (`rendezvous::torch_store`), a thread per connection, until the client leaves.
    fn fake_torch_store() -> u16 {
        use std::io::{Read, Write};
        type Table = Arc<(Mutex<HashMap<Vec<u8>, Vec<u8>>>, std::sync::Condvar)>;
        fn read_n(c: &mut std::net::TcpStream, n: usize) -> Option<Vec<u8>> {
            let mut b = vec![0u8; n];
            c.read_exact(&mut b).ok().map(|_| b)
        }
        fn string(c: &mut std::net::TcpStream) -> Option<Vec<u8>> {
            let n = u64::from_le_bytes(read_n(c, 8)?.try_into().ok()?);
            read_n(c, usize::try_from(n).ok().filter(|n| *n < 4096)?)
        }
        fn serve(mut c: std::net::TcpStream, table: Table) -> Option<()> {
            let hello = read_n(&mut c, 5)?;
            assert_eq!(hello, [0, 0xce, 0xf7, 0x85, 0x3c], "VALIDATE first");
            loop {
                match read_n(&mut c, 1)?[0] {
                    1 => {
                        let (k, v) = (string(&mut c)?, string(&mut c)?);
                        table.0.lock().unwrap().insert(k, v);
                        table.1.notify_all();
                    }
                    6 => {
                        assert_eq!(u64::from_le_bytes(read_n(&mut c, 8)?.try_into().ok()?), 1);
                        let k = string(&mut c)?;
                        // Bounded, as every wait: a key that never comes ends this connection.
                        let t = table.0.lock().unwrap();
                        let (t, _) = table
                            .1
                            .wait_timeout_while(t, Duration::from_secs(10), |t| !t.contains_key(&k))
                            .unwrap();
                        if !t.contains_key(&k) {
                            return None;
                        }
                        drop(t);
                        c.write_all(&[0]).ok()?;
                    }
                    3 => {
                        let k = string(&mut c)?;
                        let v = table.0.lock().unwrap().get(&k).cloned().unwrap_or_default();
                        c.write_all(&(v.len() as u64).to_le_bytes()).ok()?;
                        c.write_all(&v).ok()?;
                    }
                    op => panic!("request {op} is not one toroid sends"),
                }
            }
        }
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let table: Table = Arc::default();
        std::thread::spawn(move || {
            for c in l.incoming().flatten() {
                let t = table.clone();
                std::thread::spawn(move || serve(c, t));
            }
        });
        port
    }

    #[test]
    fn under_torchrun_rank_0_publishes_its_port_in_torchs_store() {
        let torch_port = fake_torch_store();
        let launch = move |rank, restart| Launch {
            rank,
            size: 3,
            local_rank: None,
            local_size: None,
            store: StoreAddr::Torch { host: "127.0.0.1".into(), port: torch_port, restart },
            launcher: Launcher::Torchrun,
        };
        let t = Duration::from_secs(5);
        // Two communicators in a row, ranks 1 and 2 asking before rank 0 publishes: each meets
        // in a store of its own (the second is not the first's, served no longer).
        for round in 0..2 {
            let peers: Vec<_> = (1..3)
                .map(|r| {
                    std::thread::spawn(move || {
                        let s = open_store(&launch(r, 7), t, None, false).unwrap().store;
                        s.add("joined", 1).unwrap();
                        s.get("from0", t).unwrap()
                    })
                })
                .collect();
            std::thread::sleep(Duration::from_millis(50));
            let opened = open_store(&launch(0, 7), t, None, false).unwrap();
            let s0 = opened.store.clone();
            s0.wait(&["joined"], t).unwrap();
            s0.set("from0", format!("round {round}").as_bytes()).unwrap();
            for p in peers {
                assert_eq!(p.join().unwrap(), format!("round {round}").as_bytes());
            }
            // Both other ranks counted in this round's store alone.
            while s0.add("joined", 0).unwrap() < 2 {
                std::thread::sleep(Duration::from_millis(5));
            }
            assert_eq!(s0.add("joined", 0).unwrap(), 2);
            opened.stop_serving();
        }
        // A rank of a later restart does not take this attempt's port, and without a rank 0
        // it fails within its timeout, saying so.
        let start = std::time::Instant::now();
        let e = open_store(&launch(1, 8), Duration::from_millis(300), None, false).unwrap_err();
        assert!(matches!(e, Error::Timeout(_)) && e.to_string().contains("did not publish"), "{e}");
        assert!(start.elapsed() < Duration::from_secs(3), "{:?}", start.elapsed());
    }

    #[test]
    fn job_store_is_private_and_removed_by_the_last_rank() {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
        let mut vars = ompi("0", &format!("{}{nanos}", std::process::id()));
        let dir = job_dir(&detect_owned(&vars).unwrap(), "ompi");
        let _cleanup = RemoveOnDrop(dir.clone());
        let t = Duration::from_secs(5);
        for round in 1..=2 {
            let peer = {
                vars.retain(|(k, _)| *k != "OMPI_COMM_WORLD_RANK");
                vars.push(("OMPI_COMM_WORLD_RANK", "1".into()));
                let l1 = detect_owned(&vars).unwrap();
                std::thread::spawn(move || {
                    let s = open_store(&l1, t, None, false).unwrap().store;
                    s.set("from1", b"hi").unwrap();
                    let got = s.get("from0", t).unwrap();
                    s.wait(&["done0"], t).unwrap();
                    got
                })
            };
            vars.retain(|(k, _)| *k != "OMPI_COMM_WORLD_RANK");
            vars.push(("OMPI_COMM_WORLD_RANK", "0".into()));
            let s0 = open_store(&detect_owned(&vars).unwrap(), t, None, false).unwrap().store;
            let sub = dir.join(format!("c{round}"));
            assert!(sub.is_dir(), "{} for communicator {round}", sub.display());
            let meta = fs::metadata(private_base()).unwrap();
            assert_eq!(meta.mode() & 0o777, 0o700);
            s0.set("from0", b"yo").unwrap();
            assert_eq!(s0.get("from1", t).unwrap(), b"hi");
            s0.set("done0", b"").unwrap();
            assert_eq!(peer.join().unwrap(), b"yo");
            // Rank 1 has dropped its store; the directory stays until rank 0 drops too.
            assert!(sub.is_dir());
            drop(s0);
            assert!(!dir.exists(), "{} left behind", dir.display());
        }
    }
}
