//! What every rank of the IPC paths publishes about its device window ([`WindowRecord`], a
//! fixed wire layout validated on arrival), how this rank reaches each window from those
//! records ([`map_windows`]: its own, a same-process peer's pointer, or an opened IPC handle),
//! and what the records say about where the ranks are (one process each; how many share a
//! device). Plain logic, unit-tested without a GPU (`ipc_tests.rs`).

use crate::error::{Error, Result};

/// Bytes of a [`WindowRecord`] on the wire.
pub const RECORD: usize = 96;
const MAGIC: [u8; 4] = *b"TRDW";
const VERSION: u16 = 1;

/// What a rank publishes about its window (through the communicator's all-gather, whose
/// connections are authenticated): fixed layout, [`RECORD`] bytes, validated on arrival.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WindowRecord {
    /// The rank made its window and loaded the kernels (and did not turn IPC off).
    pub usable: bool,
    /// Its device ordinal.
    pub device: u32,
    /// Its process id (ranks in one process share pointers instead of handles).
    pub pid: u32,
    /// Its window's size.
    pub bytes: u64,
    /// Its window's device address in its own process.
    pub ptr: u64,
    /// The IPC memory handle of the window (`cuIpcGetMemHandle`).
    pub handle: [u8; 64],
}

impl WindowRecord {
    /// The record of a rank that cannot take part.
    pub fn unusable() -> WindowRecord {
        WindowRecord { usable: false, device: 0, pid: std::process::id(), bytes: 0, ptr: 0, handle: [0; 64] }
    }

    /// The wire form.
    pub fn encode(&self) -> [u8; RECORD] {
        let mut b = [0u8; RECORD];
        b[0..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        b[6..8].copy_from_slice(&u16::from(self.usable).to_le_bytes());
        b[8..12].copy_from_slice(&self.device.to_le_bytes());
        b[12..16].copy_from_slice(&self.pid.to_le_bytes());
        b[16..24].copy_from_slice(&self.bytes.to_le_bytes());
        b[24..32].copy_from_slice(&self.ptr.to_le_bytes());
        b[32..96].copy_from_slice(&self.handle);
        b
    }

    /// Parses and checks a record from rank `from`.
    pub fn decode(from: usize, b: &[u8]) -> Result<WindowRecord> {
        let bad = |why: &str| Error::Remote(format!("rank {from}'s device window record: {why}").into());
        if b.len() != RECORD {
            return Err(bad(&format!("{} bytes, not {RECORD}", b.len())));
        }
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(x)
        };
        if b[0..4] != MAGIC || u16_at(4) != VERSION {
            return Err(bad("not a version-1 record (another libtoroid?)"));
        }
        let usable = match u16_at(6) {
            0 => false,
            1 => true,
            f => return Err(bad(&format!("flags {f}"))),
        };
        let mut handle = [0u8; 64];
        handle.copy_from_slice(&b[32..96]);
        Ok(WindowRecord {
            usable,
            device: u32_at(8),
            pid: u32_at(12),
            bytes: u64_at(16),
            ptr: u64_at(24),
            handle,
        })
    }
}

/// How this rank reaches one rank's window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mapping {
    /// Its own window.
    Own(u64),
    /// The window of a rank in this process: its pointer as published.
    SameProcess(u64),
    /// The window of a rank in another process, through its opened IPC handle (closed when the
    /// communicator goes).
    Opened(u64),
}

impl Mapping {
    /// The device address of the window in this process.
    pub fn ptr(self) -> u64 {
        match self {
            Mapping::Own(p) | Mapping::SameProcess(p) | Mapping::Opened(p) => p,
        }
    }
}

/// Maps every rank's window from the records all ranks published: `open(rank, handle)` is
/// called once for each rank of another process; rank `me`'s own record gives its window.
/// Every rank must be usable, with a window of the same size; ranks of this process must be on
/// its device (a kernel reads their windows without peer mappings). On an error, the handles
/// already opened are closed with `close`.
pub fn map_windows(
    me: usize,
    records: &[WindowRecord],
    mut open: impl FnMut(usize, &[u8; 64]) -> Result<u64>,
    mut close: impl FnMut(u64),
) -> Result<Vec<Mapping>> {
    let mine = records.get(me).ok_or_else(|| Error::Internal(format!("no record for rank {me}").into()))?;
    let mut out: Vec<Mapping> = Vec::with_capacity(records.len());
    let fail = |out: &mut Vec<Mapping>, close: &mut dyn FnMut(u64), e: Error| {
        for m in out.drain(..) {
            if let Mapping::Opened(p) = m {
                close(p);
            }
        }
        Err(e)
    };
    for (k, r) in records.iter().enumerate() {
        let m = if !r.usable {
            let why = format!("rank {k} has no device window (no CUDA, no kernels, or TOROID_CUDA_IPC=0)");
            return fail(&mut out, &mut close, Error::Unsupported(why.into()));
        } else if r.bytes != mine.bytes {
            let why = format!("rank {k}'s device window has {} bytes, this rank's {}", r.bytes, mine.bytes);
            return fail(&mut out, &mut close, Error::Remote(why.into()));
        } else if k == me {
            Mapping::Own(r.ptr)
        } else if r.pid == mine.pid {
            if r.device != mine.device {
                let why = format!(
                    "ranks {me} and {k} of one process are on devices {} and {}",
                    mine.device, r.device
                );
                return fail(&mut out, &mut close, Error::Unsupported(why.into()));
            }
            Mapping::SameProcess(r.ptr)
        } else {
            match open(k, &r.handle) {
                Ok(p) => Mapping::Opened(p),
                Err(e) => return fail(&mut out, &mut close, e),
            }
        };
        out.push(m);
    }
    Ok(out)
}

/// Whether every rank is a process of its own (the same answer on every rank: from every
/// rank's record).
pub fn separate_processes(records: &[WindowRecord]) -> bool {
    let mut pids: Vec<u32> = records.iter().map(|r| r.pid).collect();
    pids.sort_unstable();
    pids.dedup();
    pids.len() == records.len()
}

/// How many ranks use rank `me`'s device, `me` included (at least 1).
pub fn ranks_on_device(me: usize, records: &[WindowRecord]) -> usize {
    let mine = records.get(me).map_or(u32::MAX, |r| r.device);
    records.iter().filter(|r| r.device == mine).count().max(1)
}
