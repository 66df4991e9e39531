//! What a communicator remembers about its operations, and what it tells when a job is stuck:
//! the flight recorder (a fixed ring of the last operations, with the live state of the
//! running one), the snapshot a rank publishes of it, and the stall report that compares the
//! snapshots of every rank and names the one the others wait on, and the health document built
//! from the same answers (`health`).
//!
//! This layer sits beside `comm` (which feeds it) and below nothing else: it imports only
//! `collective` and `dtype`, so that the transport layer can update the live progress of an
//! operation without knowing about communicators.

pub mod health;
pub mod recorder;
pub mod report;
pub mod snapshot;
pub mod stats;
pub mod timeline;

pub use health::{Asked, Health};
pub use recorder::{Progress, Recorder};
pub use report::{PeerAnswer, Report};
pub use snapshot::{OpState, Phase, Snapshot};
pub use stats::Stats;

/// Nanoseconds since the Unix epoch (the clock every record and snapshot uses, so that ranks
/// compare times; 0 if the clock is before the epoch).
pub fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos().min(u64::MAX as u128) as u64)
        .unwrap_or(0)
}
