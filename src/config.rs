//! Configuration: the only module that reads environment variables.
//!
//! Every variable is read once into [`Config`] (cached for the process), logged once at INFO
//! under the `env` subsystem, and documented in `docs/ENV.md`. Launcher variables (torchrun,
//! Slurm, MPI) are captured here too; `rendezvous::env` decides what they mean.

use std::collections::BTreeMap;
use std::sync::OnceLock;
use std::time::Duration;

use crate::error::{Error, Result};

mod logging;
mod parse;
mod vars;

pub use vars::{LAUNCHER_VARS, TOROID_VARS};

pub use logging::init_logging;
pub use parse::parse_size;
use parse::{parse_bool, parse_num, parse_rate, parse_seconds, parse_wire};

/// Default deadline of every blocking wait.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
/// Default time a waiting rank polls before it blocks in the kernel.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);
/// The longest deadline toroid accepts (30 days): `TOROID_TIMEOUT` above it is an error, and
/// longer timeouts passed through the APIs (a `Duration::MAX` meant as "forever") are cut to it,
/// so no deadline arithmetic can overflow.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(30 * 24 * 3600);
/// Operations the flight recorder keeps per communicator by default (80 bytes each).
pub const DEFAULT_TRACE_BUFFER: usize = 2048;
/// The most `TOROID_TRACE_BUFFER` may ask for (80 MB per communicator).
pub const MAX_TRACE_BUFFER: usize = 1 << 20;
/// The longest time a waiting rank may poll before it blocks (`TOROID_SPIN_US`): 1 s.
pub const MAX_SPIN: Duration = Duration::from_secs(1);

/// The instant `timeout` from now, with the timeout cut to [`MAX_TIMEOUT`]: never overflows.
pub fn deadline_in(timeout: Duration) -> std::time::Instant {
    deadline_from(std::time::Instant::now(), timeout)
}

/// `timeout` (capped at [`MAX_TIMEOUT`]) after `start`.
pub fn deadline_from(start: std::time::Instant, timeout: Duration) -> std::time::Instant {
    // CLOCK_MONOTONIC counts from boot in a 64-bit timespec: 30 days more always fits.
    start.checked_add(timeout.min(MAX_TIMEOUT)).unwrap_or(start)
}

/// A site's certificate files for encrypted links (PEM): the CAs that sign the ranks'
/// certificates, this rank's certificate chain, and its private key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// `TOROID_TLS_CA`.
    pub ca: std::path::PathBuf,
    /// `TOROID_TLS_CERT`.
    pub cert: std::path::PathBuf,
    /// `TOROID_TLS_KEY`.
    pub key: std::path::PathBuf,
}

/// Settings of the library, from the environment or built by hand.
#[derive(Debug, Clone)]
pub struct Config {
    /// Deadline of every blocking wait (`TOROID_TIMEOUT`, seconds).
    pub timeout: Duration,
    /// Interface selection (`TOROID_SOCKET_IFNAME`): NCCL syntax, e.g. `eth0`, `^lo,docker`, `=eth1`.
    pub socket_ifname: Option<String>,
    /// Address family to prefer (`TOROID_SOCKET_FAMILY`: `AF_INET` or `AF_INET6`).
    pub socket_family: Option<String>,
    /// SO_SNDBUF/SO_RCVBUF in bytes (`TOROID_SOCKET_BUFFER`); 0 keeps Linux autotuning.
    pub socket_buffer: usize,
    /// TCP congestion control of every connection between ranks (`TOROID_TCP_CONGESTION`, e.g.
    /// `cubic`); `None` keeps the system default (`net.ipv4.tcp_congestion_control`).
    pub tcp_congestion: Option<String>,
    /// Shared secret that authenticates every connection between ranks (`TOROID_AUTH_TOKEN`):
    /// challenge and response at the handshake, the token itself never on the wire.
    pub auth_token: Option<AuthToken>,
    /// Poll time before blocking (`TOROID_SPIN_US`); `None` picks from cores and local ranks.
    pub spin: Option<Duration>,
    /// Largest frame (segment) on the wire in bytes (`TOROID_SEGMENT_SIZE`).
    pub segment_size: usize,
    /// Bytes per chunk of the pipelined 2D torus (`TOROID_PIPELINE_CHUNK`): `None` pipelines in
    /// [`DEFAULT_PIPELINE_CHUNK`] chunks where the cost model finds it cheaper; `Some(0)` never;
    /// `Some(bytes)` always, in chunks of `bytes`, wherever a call has two.
    pub pipeline_chunk: Option<usize>,
    /// Operations the flight recorder keeps per communicator (`TOROID_TRACE_BUFFER`; 0: off).
    pub trace_buffer: usize,
    /// Where the timeline goes (`TOROID_TIMELINE`): each process writes `<path>.rank<R>.json`.
    pub timeline: Option<std::path::PathBuf>,
    /// Algorithm override (`TOROID_ALGO`), NCCL list syntax.
    pub algo: Option<String>,
    /// Host identity override (`TOROID_HOST_ID`), for emulating several hosts on one machine.
    pub host_id: Option<String>,
    /// Torus grid override (`TOROID_TORUS_SHAPE=XxY`).
    pub torus_shape: Option<(usize, usize)>,
    /// Cost model source (`TOROID_COST_MODEL`): `probe` (default), `default`, or explicit values.
    pub cost_model: Option<String>,
    /// Keep TCP between ranks of one host (`TOROID_SHM_DISABLE=1`).
    pub shm_disable: bool,
    /// Collectives on device memory between ranks of one host through CUDA IPC
    /// (`TOROID_CUDA_IPC`, default on); off, they are staged through pinned host memory.
    pub cuda_ipc: bool,
    /// On the CUDA IPC path between processes, collectives enqueued on the caller's stream as
    /// one kernel each, the ranks meeting on the device (`TOROID_CUDA_ORDERED`, default off
    /// until it has run on a GPU); off, the host drives each chunk.
    pub cuda_ordered: bool,
    /// The RDMA device (and port) to use (`TOROID_IB_HCA`, `name` or `name:port`, e.g.
    /// `mlx5_0:1`); unset, the first device's port 1. Read by the RDMA transport (cargo feature
    /// `rdma`).
    pub ib_hca: Option<String>,
    /// The GID table index of the RDMA port (`TOROID_IB_GID_INDEX`, default 0; RoCE v2 often
    /// needs 3).
    pub ib_gid_index: u32,
    /// Whether pairs of ranks on different hosts use RDMA (`TOROID_RDMA`).
    pub rdma: RdmaMode,
    /// Open connections between ranks on demand (`TOROID_CONNECT=lazy`, the default): a pair
    /// connects the first time an operation needs it, and set-up reads O(1) store keys per
    /// rank. `false` (`TOROID_CONNECT=mesh`): every pair connects at set-up, as before.
    pub connect_lazy: bool,
    /// Encrypt and authenticate every TCP link between ranks (`TOROID_ENCRYPT=1`): TLS 1.3
    /// with keys pinned through the store, then AES-GCM records
    /// (`transport::tcp::secure`). Needs `auth_token`.
    pub encrypt: bool,
    /// With `encrypt`: certificate files instead of keys made at start-up
    /// (`TOROID_TLS_CA`, `TOROID_TLS_CERT`, `TOROID_TLS_KEY`, all three or none).
    pub tls_files: Option<TlsFiles>,
    /// `SIGUSR1` prints the stall report of every live communicator to stderr
    /// (`TOROID_DUMP_ON_SIGNAL`, default on).
    pub dump_on_signal: bool,
    /// Directory of shared-memory segments (`TOROID_SHM_DIR`, a tmpfs).
    pub shm_dir: std::path::PathBuf,
    /// Directory where every communicator's ranks leave a status entry (their control-plane
    /// address) for the health query of `toroid-run --status` (`TOROID_STATUS_DIR`; `toroid-run`
    /// sets it; none: no entries).
    pub status_dir: Option<std::path::PathBuf>,
    /// Bytes of each point-to-point shared-memory ring, per direction (`TOROID_SHM_RING_SIZE`).
    pub shm_ring_size: usize,
    /// Bytes each rank contributes per chunk to the shared window (`TOROID_SHM_CHUNK_SIZE`;
    /// 0: no window).
    pub shm_chunk_size: usize,
    /// Float all-reduces travel in this narrower type (`TOROID_WIRE_DTYPE=bf16|f16`), their
    /// reductions accumulated wide (`comm/compressed.rs`); `None`: in their own type.
    pub wire: Option<crate::dtype::DataType>,
    /// TCP connections per pair of ranks (`TOROID_NSOCKS`, 1 to 16); 0 chooses from the link
    /// (`transport::tcp::striped::lanes_for`).
    pub nsocks: usize,
    /// Progress threads per communicator that move the bytes of its TCP connections
    /// (`TOROID_NTHREADS`, 0 to 16; `transport::tcp::progress`); 0: the calling thread does.
    pub nthreads: usize,
    /// Test-only cap on every data connection's sending rate, bytes per second
    /// (`TOROID_TEST_FLOW_RATE`, e.g. `1gbit`): emulates a network that limits each flow.
    pub test_flow_rate: u64,
    /// Every variable read, by name (for `rendezvous::env` and the one-time log).
    pub vars: BTreeMap<String, String>,
}

/// The values `TOROID_RDMA` takes in this build (`fake` only with the test double).
#[cfg(any(test, feature = "rdma-fake"))]
const RDMA_MODES: &str = "auto, off or fake";
#[cfg(not(any(test, feature = "rdma-fake")))]
const RDMA_MODES: &str = "auto or off";

/// Whether pairs of ranks on different hosts use RDMA (`TOROID_RDMA`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RdmaMode {
    /// TCP between hosts (`off`).
    Off,
    /// RDMA where both ranks of a pair have a usable device (cargo feature `rdma`), else TCP
    /// (`auto`, the default).
    Auto,
    /// The in-process fake of the verbs (`fake`): for tests whose ranks are threads of one
    /// process; ranks in different processes find they cannot pair and keep TCP. A test double:
    /// only in the unit tests and with the cargo feature `rdma-fake` (which the tests enable).
    #[cfg(any(test, feature = "rdma-fake"))]
    Fake,
}

/// Most connections between one pair of ranks (`TOROID_NSOCKS`): the TCP handshake carries the
/// lane in the flags' high four bits (`transport::tcp::handshake`). Defined here, not in the
/// transport, so that config depends on nothing above it (the transport imports it).
pub const MAX_LANES: usize = 16;
/// Most progress threads per communicator (`TOROID_NTHREADS`; `transport::tcp::progress`).
pub const MAX_THREADS: usize = 16;

/// Default directory of shared-memory segments.
pub const DEFAULT_SHM_DIR: &str = "/dev/shm";
/// Default point-to-point ring size (per direction; a pair of ranks maps twice this).
pub const DEFAULT_SHM_RING_SIZE: usize = 512 * 1024;
/// Default window chunk per rank (the window holds two per rank).
pub const DEFAULT_SHM_CHUNK_SIZE: usize = 512 * 1024;

/// Default socket buffer request. Measured on loopback: autotuning keeps buffers small after a
/// run of small messages and large transfers then stall on them (1 MiB all-reduce at 1.6 instead
/// of 4.3 GB/s); a fixed 2 MiB (the kernel doubles it) does not. Capped by `net.core.[rw]mem_max`
/// at connection time, falling back to autotuning when the cap is lower.
pub const DEFAULT_SOCKET_BUFFER: usize = 2 << 20;

/// What logs and `Debug` show instead of a secret.
const REDACTED: &str = "<redacted>";

/// A shared secret (`TOROID_AUTH_TOKEN`). `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct AuthToken(Vec<u8>);

impl AuthToken {
    /// A token from its bytes (any length; HMAC-SHA256 keys accept all).
    pub fn new(secret: &[u8]) -> AuthToken {
        AuthToken(secret.to_vec())
    }

    /// The secret.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for AuthToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(REDACTED)
    }
}

/// Default largest frame on the wire. Gloo uses segments of at most 1 MiB; smaller segments start
/// the reduction earlier, larger ones pay fewer headers and system calls.
pub const DEFAULT_SEGMENT_SIZE: usize = 512 * 1024;

/// Default chunk of the pipelined 2D torus (`algorithm/torus2d.rs`): calls of at least two
/// chunks overlap the row phases of one chunk with the column phases of another.
pub const DEFAULT_PIPELINE_CHUNK: usize = 4 << 20;

impl Default for Config {
    fn default() -> Config {
        Config {
            timeout: DEFAULT_TIMEOUT,
            socket_ifname: None,
            socket_family: None,
            socket_buffer: DEFAULT_SOCKET_BUFFER,
            tcp_congestion: None,
            auth_token: None,
            spin: None,
            segment_size: DEFAULT_SEGMENT_SIZE,
            pipeline_chunk: None,
            trace_buffer: DEFAULT_TRACE_BUFFER,
            timeline: None,
            algo: None,
            host_id: None,
            torus_shape: None,
            cost_model: None,
            shm_disable: false,
            cuda_ipc: true,
            cuda_ordered: false,
            ib_hca: None,
            ib_gid_index: 0,
            rdma: RdmaMode::Auto,
            connect_lazy: true,
            encrypt: false,
            tls_files: None,
            dump_on_signal: true,
            wire: None,
            nsocks: 0,
            nthreads: 0,
            test_flow_rate: 0,
            shm_dir: DEFAULT_SHM_DIR.into(),
            status_dir: None,
            shm_ring_size: DEFAULT_SHM_RING_SIZE,
            shm_chunk_size: DEFAULT_SHM_CHUNK_SIZE,
            vars: BTreeMap::new(),
        }
    }
}

impl Config {
    /// The process-wide configuration from the environment, read and logged on first use.
    ///
    /// # Errors
    /// When a variable is set to something that does not parse.
    pub fn global() -> Result<&'static Config> {
        static CONFIG: OnceLock<Result<Config>> = OnceLock::new();
        CONFIG
            .get_or_init(|| {
                let cfg = Config::from_lookup(|name| std::env::var(name).ok())?;
                cfg.log();
                Ok(cfg)
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Builds a configuration from any variable lookup (tests pass a map).
    ///
    /// ```
    /// let cfg = toroid::Config::from_lookup(|k| (k == "TOROID_TIMEOUT").then(|| "7".into())).unwrap();
    /// assert_eq!(cfg.timeout, std::time::Duration::from_secs(7));
    /// ```
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Config> {
        let mut vars = BTreeMap::new();
        for &name in TOROID_VARS.iter().chain(LAUNCHER_VARS) {
            if let Some(v) = lookup(name) {
                vars.insert(name.to_string(), v);
            }
        }
        let mut cfg = Config::default();
        if let Some(v) = vars.get_mut("TOROID_AUTH_TOKEN") {
            // The secret is kept exactly as given and never logged or printed.
            if !v.is_empty() {
                cfg.auth_token = Some(AuthToken::new(v.as_bytes()));
            }
            *v = REDACTED.to_string();
        }
        let get = |name: &str| vars.get(name).map(|s| s.trim()).filter(|s| !s.is_empty());
        if let Some(v) = get("TOROID_TIMEOUT") {
            cfg.timeout = parse_seconds("TOROID_TIMEOUT", v)?;
        }
        cfg.socket_ifname = get("TOROID_SOCKET_IFNAME").map(str::to_string);
        cfg.socket_family = get("TOROID_SOCKET_FAMILY").map(str::to_string);
        if let Some(v) = get("TOROID_SOCKET_BUFFER") {
            cfg.socket_buffer = parse_size("TOROID_SOCKET_BUFFER", v)?;
        }
        if let Some(v) = get("TOROID_TCP_CONGESTION") {
            // Linux's TCP_CA_NAME_MAX is 16 bytes with the terminating NUL.
            if v.len() > 15 || !v.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') {
                return Err(Error::InvalidArgument(
                    format!(
                        "TOROID_TCP_CONGESTION={v}: not a congestion control name (e.g. cubic, reno, bbr)"
                    )
                    .into(),
                ));
            }
            cfg.tcp_congestion = Some(v.to_string());
        }
        if let Some(v) = get("TOROID_SPIN_US") {
            let us: u64 = parse_num("TOROID_SPIN_US", v)?;
            let spin = Duration::from_micros(us);
            if spin > MAX_SPIN {
                return Err(Error::InvalidArgument(
                    format!("TOROID_SPIN_US={v}: above the maximum of {} us", MAX_SPIN.as_micros()).into(),
                ));
            }
            cfg.spin = Some(spin);
        }
        if let Some(v) = get("TOROID_SEGMENT_SIZE") {
            let s = parse_size("TOROID_SEGMENT_SIZE", v)?;
            if s < 4096 {
                return Err(Error::InvalidArgument(
                    format!("TOROID_SEGMENT_SIZE={v}: must be at least 4096 bytes").into(),
                ));
            }
            cfg.segment_size = s;
        }
        if let Some(v) = get("TOROID_PIPELINE_CHUNK") {
            let s = parse_size("TOROID_PIPELINE_CHUNK", v)?;
            if s != 0 && s < 4096 {
                return Err(Error::InvalidArgument(
                    format!("TOROID_PIPELINE_CHUNK={v}: must be 0 (off) or at least 4096 bytes").into(),
                ));
            }
            cfg.pipeline_chunk = Some(s);
        }
        if let Some(v) = get("TOROID_TRACE_BUFFER") {
            let n: u64 = parse_num("TOROID_TRACE_BUFFER", v)?;
            if n > MAX_TRACE_BUFFER as u64 {
                return Err(Error::InvalidArgument(
                    format!("TOROID_TRACE_BUFFER={v}: above the maximum of {MAX_TRACE_BUFFER} operations")
                        .into(),
                ));
            }
            cfg.trace_buffer = n as usize;
        }
        cfg.timeline = get("TOROID_TIMELINE").filter(|v| !v.is_empty()).map(std::path::PathBuf::from);
        cfg.algo = get("TOROID_ALGO").map(str::to_string);
        cfg.host_id = get("TOROID_HOST_ID").map(str::to_string);
        if let Some(v) = get("TOROID_TORUS_SHAPE") {
            cfg.torus_shape = Some(crate::topology::parse_shape(v)?);
        }
        cfg.cost_model = get("TOROID_COST_MODEL").map(str::to_string);
        if let Some(v) = get("TOROID_SHM_DISABLE") {
            cfg.shm_disable = parse_bool("TOROID_SHM_DISABLE", v)?;
        }
        if let Some(v) = get("TOROID_CUDA_IPC") {
            cfg.cuda_ipc = parse_bool("TOROID_CUDA_IPC", v)?;
        }
        if let Some(v) = get("TOROID_CUDA_ORDERED") {
            cfg.cuda_ordered = parse_bool("TOROID_CUDA_ORDERED", v)?;
        }
        cfg.ib_hca = get("TOROID_IB_HCA").map(str::to_string);
        if let Some(v) = get("TOROID_IB_GID_INDEX") {
            cfg.ib_gid_index = match parse_num::<u32>("TOROID_IB_GID_INDEX", v)? {
                n @ 0..=255 => n,
                _ => {
                    return Err(Error::InvalidArgument(
                        format!("TOROID_IB_GID_INDEX={v}: expected 0 to 255").into(),
                    ));
                }
            };
        }
        if let Some(v) = get("TOROID_RDMA") {
            cfg.rdma = match v.to_ascii_lowercase().as_str() {
                "auto" | "1" | "on" => RdmaMode::Auto,
                "0" | "off" => RdmaMode::Off,
                #[cfg(any(test, feature = "rdma-fake"))]
                "fake" => RdmaMode::Fake,
                _ => {
                    return Err(Error::InvalidArgument(
                        format!("TOROID_RDMA={v}: expected {RDMA_MODES}").into(),
                    ));
                }
            };
        }
        if let Some(v) = get("TOROID_CONNECT") {
            cfg.connect_lazy = match v.to_ascii_lowercase().as_str() {
                "lazy" => true,
                "mesh" => false,
                _ => {
                    return Err(Error::InvalidArgument(
                        format!("TOROID_CONNECT={v}: expected lazy or mesh").into(),
                    ));
                }
            };
        }
        if let Some(v) = get("TOROID_ENCRYPT") {
            cfg.encrypt = parse_bool("TOROID_ENCRYPT", v)?;
        }
        let tls =
            ["TOROID_TLS_CA", "TOROID_TLS_CERT", "TOROID_TLS_KEY"].map(|k| get(k).filter(|v| !v.is_empty()));
        cfg.tls_files = match tls {
            [Some(ca), Some(cert), Some(key)] => {
                Some(TlsFiles { ca: ca.into(), cert: cert.into(), key: key.into() })
            }
            [None, None, None] => None,
            _ => {
                return Err(Error::InvalidArgument(
                    "TOROID_TLS_CA, TOROID_TLS_CERT and TOROID_TLS_KEY go together: set all three or none"
                        .into(),
                ));
            }
        };
        if let Some(v) = get("TOROID_DUMP_ON_SIGNAL") {
            cfg.dump_on_signal = parse_bool("TOROID_DUMP_ON_SIGNAL", v)?;
        }
        if let Some(v) = get("TOROID_WIRE_DTYPE") {
            cfg.wire = parse_wire(v)?;
        }
        if let Some(v) = get("TOROID_NSOCKS") {
            let max = MAX_LANES;
            cfg.nsocks = match parse_num::<usize>("TOROID_NSOCKS", v)? {
                n @ 1.. if n <= max => n,
                _ => {
                    return Err(Error::InvalidArgument(
                        format!("TOROID_NSOCKS={v}: expected 1 to {max}").into(),
                    ));
                }
            };
        }
        if let Some(v) = get("TOROID_NTHREADS") {
            let max = MAX_THREADS;
            cfg.nthreads = match parse_num::<usize>("TOROID_NTHREADS", v)? {
                n if n <= max => n,
                _ => {
                    return Err(Error::InvalidArgument(
                        format!("TOROID_NTHREADS={v}: expected 0 to {max}").into(),
                    ));
                }
            };
        }
        if let Some(v) = get("TOROID_TEST_FLOW_RATE") {
            cfg.test_flow_rate = parse_rate("TOROID_TEST_FLOW_RATE", v)?;
        }
        if let Some(v) = get("TOROID_SHM_DIR") {
            cfg.shm_dir = v.into();
        }
        if let Some(v) = get("TOROID_STATUS_DIR") {
            cfg.status_dir = (!v.is_empty()).then(|| v.into());
        }
        if let Some(v) = get("TOROID_SHM_RING_SIZE") {
            let s = parse_size("TOROID_SHM_RING_SIZE", v)?;
            if !(4096..=1 << 30).contains(&s) {
                return Err(Error::InvalidArgument(
                    format!("TOROID_SHM_RING_SIZE={v}: must be between 4K and 1G").into(),
                ));
            }
            cfg.shm_ring_size = s;
        }
        if let Some(v) = get("TOROID_SHM_CHUNK_SIZE") {
            let s = parse_size("TOROID_SHM_CHUNK_SIZE", v)?;
            if s != 0 && !(4096..=1 << 30).contains(&s) {
                return Err(Error::InvalidArgument(
                    format!("TOROID_SHM_CHUNK_SIZE={v}: must be 0 (no window) or between 4K and 1G").into(),
                ));
            }
            cfg.shm_chunk_size = s;
        }
        cfg.vars = vars;
        Ok(cfg)
    }

    /// A launcher or `TOROID_*` variable as read (empty values count as unset).
    pub fn var(&self, name: &str) -> Option<&str> {
        self.vars.get(name).map(|s| s.trim()).filter(|s| !s.is_empty())
    }

    fn log(&self) {
        for (k, v) in &self.vars {
            if k.starts_with("TOROID_") {
                tracing::info!(target: "toroid::env", "{k} set by environment to {v}");
            }
        }
    }
}

/// The timeline path a launcher was given in its own environment (`TOROID_TIMELINE`; unset or
/// empty: none). `toroid-run` merges the ranks' timeline files there; the ranks read the same
/// variable through [`Config::from_lookup`].
pub fn timeline_path_from_env() -> Option<std::path::PathBuf> {
    std::env::var_os("TOROID_TIMELINE").filter(|v| !v.is_empty()).map(std::path::PathBuf::from)
}

/// The status directory a launcher was given in its own environment (`TOROID_STATUS_DIR`;
/// unset or empty: none): `toroid-run` then leaves it to the ranks instead of making its own,
/// and `toroid-run --status` asks that job by default.
pub fn status_dir_from_env() -> Option<std::path::PathBuf> {
    std::env::var_os("TOROID_STATUS_DIR").filter(|v| !v.is_empty()).map(std::path::PathBuf::from)
}

/// The job's `TOROID_AUTH_TOKEN` as the launcher's own environment has it (what `toroid-run
/// --status` proves itself with); a malformed one is an error, as it is for the ranks.
pub fn auth_token_from_env() -> Result<Option<AuthToken>> {
    Config::from_lookup(|k| (k == "TOROID_AUTH_TOKEN").then(|| std::env::var(k).ok()).flatten())
        .map(|c| c.auth_token)
}

/// Where NVRTC is, if the user says (`TOROID_NVRTC_PATH`); unset: the loader searches
/// (`gpu::load_nvrtc`).
#[cfg(feature = "cuda")]
pub(crate) fn nvrtc_path() -> Option<std::path::PathBuf> {
    std::env::var_os("TOROID_NVRTC_PATH").map(std::path::PathBuf::from)
}

#[cfg(test)]
mod tests;
