//! Set-up: upgrading same-host links to shared memory, and the window of all ranks (see the
//! [module documentation](super)).

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::byte_ring::{MIN_RING, pair_segment_len, ring_capacity};
use super::link::{ShmTransport, wait_ready};
use super::segment::{NAME_PREFIX, Segment, segment_name, sweep_stale};
use crate::error::{Error, Result};
use crate::transport::Transport;

/// Segment header magic ("TRSHMSEG").
const SEG_MAGIC: u64 = u64::from_le_bytes(*b"TRSHMSEG");
/// Layout version of segments.
const SEG_VERSION: u64 = 1;

/// Settings of the shared-memory transport (from `TOROID_SHM_*`).
#[derive(Debug, Clone)]
pub struct ShmOptions {
    /// Use shared memory at all (`TOROID_SHM_DISABLE=1` turns it off).
    pub enabled: bool,
    /// Directory of the segments (a tmpfs; `TOROID_SHM_DIR`, default `/dev/shm`).
    pub dir: PathBuf,
    /// Bytes of each point-to-point ring (per direction).
    pub ring: usize,
    /// Bytes of each member region of the window (0: no window).
    pub window_region: usize,
}

/// What set-up produced.
#[derive(Debug)]
pub struct ShmSetup {
    /// One transport per rank: shared memory where the upgrade succeeded, else the original.
    pub links: Vec<Option<Box<dyn Transport>>>,
    /// The window of all ranks, when every rank is on this host and it could be set up.
    pub window: Option<super::window::Window>,
    /// Ranks reached through shared memory.
    pub shm_peers: usize,
}

const MSG_MAGIC: u32 = u32::from_le_bytes(*b"TRSM");
pub(crate) const MSG_LEN: usize = 256;
const MSG_TEXT: usize = MSG_LEN - 32;
pub(crate) const OFFER: u8 = 1;
pub(crate) const DECLINE: u8 = 2;
pub(crate) const ACCEPT: u8 = 3;
pub(crate) const REFUSE: u8 = 4;
pub(crate) const WIN_OFFER: u8 = 5;
const WIN_NONE: u8 = 6;
const WIN_OK: u8 = 7;
const WIN_FAIL: u8 = 8;
const WIN_GO: u8 = 9;
const WIN_NOGO: u8 = 10;

#[derive(Debug)]
pub(crate) struct Msg {
    pub(crate) kind: u8,
    pub(crate) nonce: u64,
    pub(crate) size: u64,
    pub(crate) text: String,
}

/// Largest ring a peer may offer: `TOROID_SHM_RING_SIZE` is capped at 1 GiB.
const MAX_OFFER_RING: usize = 1 << 30;

pub(crate) fn encode_msg(kind: u8, nonce: u64, size: u64, text: &str) -> [u8; MSG_LEN] {
    let mut m = [0u8; MSG_LEN];
    m[0..4].copy_from_slice(&MSG_MAGIC.to_le_bytes());
    m[4] = kind;
    m[8..16].copy_from_slice(&nonce.to_le_bytes());
    m[16..24].copy_from_slice(&size.to_le_bytes());
    let t = text.as_bytes();
    let mut n = t.len().min(MSG_TEXT);
    while !text.is_char_boundary(n) {
        n -= 1;
    }
    m[24..26].copy_from_slice(&(n as u16).to_le_bytes());
    m[32..32 + n].copy_from_slice(&t[..n]);
    m
}

pub(crate) fn decode_msg(m: &[u8; MSG_LEN]) -> Result<Msg> {
    if m[0..4] != MSG_MAGIC.to_le_bytes() {
        return Err(Error::Remote("shared-memory set-up: peer sent a bad message".into()));
    }
    let u64_at = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&m[i..i + 8]);
        u64::from_le_bytes(b)
    };
    let n = (u16::from_le_bytes([m[24], m[25]]) as usize).min(MSG_TEXT);
    Ok(Msg {
        kind: m[4],
        nonce: u64_at(8),
        size: u64_at(16),
        text: String::from_utf8_lossy(&m[32..32 + n]).into_owned(),
    })
}

/// What the shared-memory set-up's messages are for (in errors).
const SHM_SETUP: &str = "shared-memory set-up";

fn send_msg(t: &mut dyn Transport, peer: usize, msg: &[u8; MSG_LEN], deadline: Instant) -> Result<()> {
    send_msg_as(SHM_SETUP, t, peer, msg, deadline)
}

fn recv_msg(t: &mut dyn Transport, peer: usize, deadline: Instant) -> Result<Msg> {
    recv_msg_as(SHM_SETUP, t, peer, deadline)
}

/// Sends one set-up message on a fresh link; `what` names the set-up in errors.
pub(crate) fn send_msg_as(
    what: &str,
    t: &mut dyn Transport,
    peer: usize,
    msg: &[u8; MSG_LEN],
    deadline: Instant,
) -> Result<()> {
    let mut done = 0;
    while done < MSG_LEN {
        match t.try_write(&[&msg[done..]]) {
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                crate::cancel::check(&format!("in {what}"))?;
                wait_ready(t, false, true, deadline).map_err(|e| setup_error(what, peer, e))?;
            }
            Err(e) => return Err(setup_error(what, peer, e)),
        }
    }
    Ok(())
}

/// Receives one set-up message (checked by [`decode_msg`]); `what` names the set-up in errors.
pub(crate) fn recv_msg_as(what: &str, t: &mut dyn Transport, peer: usize, deadline: Instant) -> Result<Msg> {
    let mut m = [0u8; MSG_LEN];
    let mut got = 0;
    while got < MSG_LEN {
        match t.try_read(&mut [&mut m[got..]]) {
            Ok(0) => {
                return Err(Error::Remote(format!("rank {peer} closed its connection during {what}").into()));
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                crate::cancel::check(&format!("in {what}"))?;
                wait_ready(t, true, false, deadline).map_err(|e| setup_error(what, peer, e))?;
            }
            Err(e) => return Err(setup_error(what, peer, e)),
        }
    }
    decode_msg(&m)
}

fn setup_error(what: &str, peer: usize, e: io::Error) -> Error {
    if e.kind() == io::ErrorKind::TimedOut {
        Error::Timeout(format!("{what} with rank {peer}: deadline passed").into())
    } else {
        Error::Remote(format!("{what} with rank {peer} failed: {e}").into())
    }
}

/// Header of a pair segment.
const PAIR_MAGIC: usize = 0;
const PAIR_NONCE: usize = 8;
const PAIR_CAP: usize = 16;

fn link_mut(links: &mut [Option<Box<dyn Transport>>], peer: usize) -> Result<&mut dyn Transport> {
    match links.get_mut(peer).and_then(Option::as_mut) {
        Some(t) => Ok(t.as_mut()),
        None => Err(Error::Internal(format!("no connection to rank {peer} for shared-memory set-up").into())),
    }
}

/// Who moves the same-host pairs to shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pairs {
    /// [`connect`] does, over the links set-up opened to every rank of this host (a mesh).
    AtSetUp,
    /// The connector does as each link opens on demand (`shm::pair`); [`connect`] only
    /// counts the pairs already moved and sets up the window.
    OnDemand,
}

/// Upgrades the links to every rank on this host (`host_of[r] == host_of[rank]`) to shared
/// memory (with [`Pairs::AtSetUp`]), and, when every rank is on this host and `window` is asked
/// for, sets up the window over the links to rank 0.
///
/// Runs over the freshly connected links before any frame moves, the same way on every rank:
/// the lower rank of each pair creates the segment and offers it, the higher one maps it and
/// accepts; either can decline (shared memory disabled, `/dev/shm` full, the segment not found
/// because the "same host" is not), and then the pair keeps TCP, with one WARN per rank.
pub fn connect(
    rank: usize,
    host_of: &[usize],
    mut links: Vec<Option<Box<dyn Transport>>>,
    opts: &ShmOptions,
    pairs: Pairs,
    comm_id: u64,
    deadline: Instant,
) -> Result<ShmSetup> {
    let size = host_of.len();
    let local: Vec<usize> = (0..size).filter(|&r| r != rank && host_of[r] == host_of[rank]).collect();
    if local.is_empty() {
        return Ok(ShmSetup { links, window: None, shm_peers: 0 });
    }
    if opts.enabled {
        let removed = sweep_stale(&opts.dir);
        if !removed.is_empty() {
            tracing::info!(target: "toroid::net", "rank {rank}: removed stale shared-memory names {removed:?}");
        }
    }
    let shm_peers = match pairs {
        Pairs::AtSetUp => upgrade_pairs(rank, &local, &mut links, opts, comm_id, deadline)?,
        Pairs::OnDemand => links.iter().flatten().filter(|t| t.kind() == "shm").count(),
    };
    // 4. The window of all ranks, when they all share this host.
    let window = if local.len() + 1 == size && opts.window_region > 0 {
        window_setup(rank, size, &mut links, opts, comm_id, deadline)?
    } else {
        None
    };
    Ok(ShmSetup { links, window, shm_peers })
}

/// Steps 1 to 3 of [`connect`] with [`Pairs::AtSetUp`]: offers, answers, and the links of the
/// pairs that agreed moved to shared memory; returns how many did.
fn upgrade_pairs(
    rank: usize,
    local: &[usize],
    links: &mut [Option<Box<dyn Transport>>],
    opts: &ShmOptions,
    comm_id: u64,
    deadline: Instant,
) -> Result<usize> {
    let cap = ring_capacity(opts.ring);
    let mut failures: Vec<String> = Vec::new();
    // 1. Offer a segment to every higher local rank (the messages fit in socket buffers, so
    //    offering to everyone before reading anything cannot deadlock).
    let mut offered: Vec<(usize, Segment)> = Vec::new();
    for &p in local.iter().filter(|&&p| p > rank) {
        let msg = match create_pair(opts, comm_id, rank, p) {
            Ok(made) => {
                offered.push((p, made.seg));
                made.offer
            }
            Err(reason) => {
                failures.push(reason.clone());
                encode_msg(DECLINE, 0, 0, &reason)
            }
        };
        send_msg(link_mut(links, p)?, p, &msg, deadline)?;
    }
    // 2. Answer the offers of the lower local ranks.
    let mut accepted: Vec<(usize, Segment, usize)> = Vec::new();
    for &p in local.iter().filter(|&&p| p < rank) {
        let t = link_mut(links, p)?;
        let m = recv_msg(t, p, deadline)?;
        match m.kind {
            OFFER => match map_offer(opts, &m) {
                Ok((seg, cap)) => {
                    send_msg(t, p, &encode_msg(ACCEPT, m.nonce, 0, ""), deadline)?;
                    accepted.push((p, seg, cap));
                }
                Err(reason) => {
                    failures.push(format!("rank {p}'s segment: {reason}"));
                    send_msg(t, p, &encode_msg(REFUSE, m.nonce, 0, &reason), deadline)?;
                }
            },
            DECLINE => failures.push(format!("rank {p}: {}", m.text)),
            k => {
                return Err(Error::Remote(
                    format!("shared-memory set-up: rank {p} sent message kind {k}").into(),
                ));
            }
        }
    }
    // 3. Collect the answers to our offers.
    for (p, mut seg) in offered {
        let m = recv_msg(link_mut(links, p)?, p, deadline)?;
        seg.unlink();
        match m.kind {
            ACCEPT => accepted.push((p, seg, cap)),
            REFUSE => failures.push(format!("rank {p}: {}", m.text)),
            k => {
                return Err(Error::Remote(
                    format!("shared-memory set-up: rank {p} sent message kind {k}").into(),
                ));
            }
        }
    }
    let shm_peers = accepted.len();
    for (p, seg, cap) in accepted {
        let Some(wake) = links[p].take() else { continue };
        links[p] = Some(Box::new(ShmTransport::new(seg, cap, rank < p, wake)));
    }
    if !failures.is_empty() {
        tracing::warn!(target: "toroid::net",
            "rank {rank}: shared memory unavailable for {} of {} peers on this host, using TCP for them: {}",
            local.len() - shm_peers, local.len(), failures[0]);
    }
    Ok(shm_peers)
}

/// Checks a peer's offer before anything is opened: the path must name a toroid segment
/// (`NAME_PREFIX`, one plain component) directly inside this rank's own segment directory `dir`,
/// and the size must be what this rank expects (`window_len`), or else a pair segment of a
/// power-of-two ring no larger than the configuration allows. Returns the path to open and
/// the number of bytes to map.
pub(crate) fn check_offer(
    dir: &Path,
    text: &str,
    size: u64,
    window_len: Option<usize>,
) -> std::result::Result<(PathBuf, usize), String> {
    let path = Path::new(text);
    let name = match (path.parent(), path.file_name().and_then(|n| n.to_str())) {
        (Some(parent), Some(name)) if parent == dir => name,
        _ => return Err(format!("refusing to map {text:?}: not in {}", dir.display())),
    };
    if !name.starts_with(NAME_PREFIX) || name.contains(['/', '\0']) {
        return Err(format!("refusing to map {text:?}: not a toroid segment name"));
    }
    let len = usize::try_from(size).map_err(|_| format!("offered size {size} does not fit in memory"))?;
    let size_ok = match window_len {
        Some(expected) => len == expected,
        None => {
            let ring = len.checked_sub(pair_segment_len(0)).map_or(0, |two| two / 2);
            ring.is_power_of_two()
                && (MIN_RING..=MAX_OFFER_RING).contains(&ring)
                && pair_segment_len(ring) == len
        }
    };
    if !size_ok {
        return Err(format!("refusing to map {text:?}: offered size {size} is not a valid segment size"));
    }
    Ok((dir.join(name), len))
}

fn open_pair(path: &Path, len: usize, nonce: u64) -> std::result::Result<(Segment, usize), String> {
    let seg = Segment::open(path, len).map_err(|e| format!("opening {}: {e}", path.display()))?;
    let magic = seg.u64_at(PAIR_MAGIC).load(Ordering::Acquire);
    let cap = seg.u64_at(PAIR_CAP).load(Ordering::Relaxed) as usize;
    if magic != SEG_MAGIC ^ SEG_VERSION || seg.u64_at(PAIR_NONCE).load(Ordering::Relaxed) != nonce {
        return Err(format!("{} is not the segment offered (a different host or job?)", path.display()));
    }
    if !cap.is_power_of_two() || cap < MIN_RING || pair_segment_len(cap) != len {
        return Err(format!("{}: bad ring size {cap}", path.display()));
    }
    Ok((seg, cap))
}

/// A pair segment this rank created, its header written, and the `OFFER` naming it.
pub(crate) struct Created {
    pub(crate) seg: Segment,
    pub(crate) cap: usize,
    pub(crate) nonce: u64,
    pub(crate) offer: [u8; MSG_LEN],
}

/// Why this rank makes no segment: shared memory is off here.
const DISABLED: &str = "shared memory disabled on this rank (TOROID_SHM_DISABLE)";

/// A pair segment for this rank and `peer` and the offer naming it, or why none could be made.
pub(crate) fn create_pair(
    opts: &ShmOptions,
    comm_id: u64,
    rank: usize,
    peer: usize,
) -> std::result::Result<Created, String> {
    if !opts.enabled {
        return Err(DISABLED.to_string());
    }
    let cap = ring_capacity(opts.ring);
    let len = pair_segment_len(cap);
    let nonce = crate::sys::random::id() ^ comm_id;
    let (lo, hi) = (rank.min(peer), rank.max(peer));
    let seg =
        Segment::create(&opts.dir, &segment_name(nonce, &format!("p{lo}-{hi}")), len).map_err(|e| e.0)?;
    seg.u64_at(PAIR_NONCE).store(nonce, Ordering::Relaxed);
    seg.u64_at(PAIR_CAP).store(cap as u64, Ordering::Relaxed);
    seg.u64_at(PAIR_MAGIC).store(SEG_MAGIC ^ SEG_VERSION, Ordering::Release);
    let path = seg.path().map(|p| p.to_string_lossy().into_owned()).unwrap_or_default();
    if path.len() > MSG_TEXT {
        return Err(format!("the segment path {path:?} is too long for the offer"));
    }
    let offer = encode_msg(OFFER, nonce, len as u64, &path);
    Ok(Created { seg, cap, nonce, offer })
}

/// Maps the pair segment a peer's `OFFER` names, after checking the offer and the segment's
/// header, and removes its name: the segment and its ring capacity, or why not.
pub(crate) fn map_offer(opts: &ShmOptions, m: &Msg) -> std::result::Result<(Segment, usize), String> {
    if !opts.enabled {
        return Err(DISABLED.to_string());
    }
    let (mut seg, cap) = check_offer(&opts.dir, &m.text, m.size, None)
        .and_then(|(path, len)| open_pair(&path, len, m.nonce))?;
    seg.unlink();
    Ok((seg, cap))
}

fn window_setup(
    rank: usize,
    size: usize,
    links: &mut [Option<Box<dyn Transport>>],
    opts: &ShmOptions,
    comm_id: u64,
    deadline: Instant,
) -> Result<Option<super::window::Window>> {
    use super::window::{Window, window_len};
    let region = opts.window_region.div_ceil(4096) * 4096;
    let len = window_len(size, region);
    if rank == 0 {
        let nonce = crate::sys::random::id() ^ comm_id;
        let made = if opts.enabled {
            Segment::create(&opts.dir, &segment_name(nonce, "win"), len).map_err(|e| e.0)
        } else {
            Err("shared memory disabled (TOROID_SHM_DISABLE)".to_string())
        };
        let (mut win, offer) = match made {
            Ok(seg) => {
                let path = seg.path().map(|p| p.to_string_lossy().into_owned()).unwrap_or_default();
                let w = Window::init(seg, size, 0, region, nonce)?;
                (Some(w), encode_msg(WIN_OFFER, nonce, len as u64, &path))
            }
            Err(reason) => {
                tracing::warn!(target: "toroid::net",
                    "rank 0: no shared-memory window, collectives use point-to-point links: {reason}");
                (None, encode_msg(WIN_NONE, 0, 0, &reason))
            }
        };
        for p in 1..size {
            send_msg(link_mut(links, p)?, p, &offer, deadline)?;
        }
        let Some(w) = win.as_mut() else { return Ok(None) };
        let mut refusal: Option<String> = None;
        for p in 1..size {
            let m = recv_msg(link_mut(links, p)?, p, deadline)?;
            match m.kind {
                WIN_OK => {}
                WIN_FAIL => {
                    refusal.get_or_insert(format!("rank {p}: {}", m.text));
                }
                k => {
                    return Err(Error::Remote(
                        format!("window set-up: rank {p} sent message kind {k}").into(),
                    ));
                }
            }
        }
        w.unlink();
        let verdict = match &refusal {
            None => encode_msg(WIN_GO, 0, 0, ""),
            Some(r) => encode_msg(WIN_NOGO, 0, 0, r),
        };
        for p in 1..size {
            send_msg(link_mut(links, p)?, p, &verdict, deadline)?;
        }
        if let Some(r) = refusal {
            tracing::warn!(target: "toroid::net", "rank 0: no shared-memory window: {r}");
            return Ok(None);
        }
        Ok(win)
    } else {
        let t = link_mut(links, 0)?;
        let m = recv_msg(t, 0, deadline)?;
        match m.kind {
            WIN_NONE => {
                tracing::info!(target: "toroid::net", "rank {rank}: no shared-memory window: {}", m.text);
                return Ok(None);
            }
            WIN_OFFER => {}
            k => return Err(Error::Remote(format!("window set-up: rank 0 sent message kind {k}").into())),
        }
        let attached = if !opts.enabled {
            Err(format!("shared memory disabled on rank {rank} (TOROID_SHM_DISABLE)"))
        } else {
            check_offer(&opts.dir, &m.text, m.size, Some(len)).and_then(|(path, len)| {
                Segment::open(&path, len)
                    .and_then(|seg| Window::attach(seg, size, rank, region, m.nonce))
                    .map_err(|e| format!("rank {rank} could not map {}: {e}", path.display()))
            })
        };
        let mut win = match attached {
            // The name stays until rank 0 has heard from every rank (it unlinks it then).
            Ok(w) => {
                send_msg(t, 0, &encode_msg(WIN_OK, 0, 0, ""), deadline)?;
                w
            }
            Err(reason) => {
                send_msg(t, 0, &encode_msg(WIN_FAIL, 0, 0, &reason), deadline)?;
                // Rank 0 still sends its verdict; read it so the stream stays in step.
                let _ = recv_msg(t, 0, deadline)?;
                return Ok(None);
            }
        };
        let v = recv_msg(t, 0, deadline)?;
        match v.kind {
            WIN_GO => {
                win.unlink();
                Ok(Some(win))
            }
            WIN_NOGO => {
                tracing::info!(target: "toroid::net", "rank {rank}: no shared-memory window: {}", v.text);
                Ok(None)
            }
            k => Err(Error::Remote(format!("window set-up: rank 0 sent message kind {k}").into())),
        }
    }
}

impl ShmOptions {
    /// The settings in `cfg`.
    pub fn from_config(cfg: &crate::config::Config) -> ShmOptions {
        ShmOptions {
            enabled: !cfg.shm_disable,
            dir: cfg.shm_dir.clone(),
            ring: cfg.shm_ring_size,
            window_region: cfg.shm_chunk_size,
        }
    }
}
