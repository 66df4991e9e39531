//! RDMA verbs transport: the ring protocol of the shared-memory transport, over RDMA WRITE with
//! immediate between RC queue pairs (docs/ARCHITECTURE.md 5.6).
//!
//! Why the same protocol: a byte ring with a writer's `head`, a reader's `tail` and credits is
//! what both a shared segment and a NIC writing into registered memory need; only how the
//! counters travel differs (a store into shared memory, an immediate). So both rings keep
//! their counters in [`crate::transport::ledger`], one tested state machine, and this module
//! adds only what RDMA needs: slots as the ledger's units (one write per slot, so a write never
//! overruns the receives the peer has posted), immediates that carry lengths and credits, and
//! completions polled until the call's deadline.
//!
//! Nothing here has run on RDMA hardware: no machine with an RDMA device was available. The
//! ring runs in the unit tests over [`fake::FakeVerbs`], an in-memory queue pair that keeps
//! RC's ordering and error rules and injects delays, held-back completions, failed writes
//! and a vanished peer.
//!
//! | part | what |
//! |---|---|
//! | [`verbs`] | the [`Verbs`] trait: exactly the verbs the ring uses; [`MrCache`] |
//! | [`ring`] | [`RdmaRing`]: send and receive over one queue pair; [`RingInfo`], exchanged before connecting |
//! | [`fake`] | the in-memory fake of the verbs |
//! | `hca` | the verbs on a real device through `sideway` (cargo feature `rdma`): presence check, `can_connect` |
//!
//! Not done yet: choosing this transport for a pair in the communicator (the hook is
//! [`ring::RdmaRing`] plus `hca::can_connect` under the feature; the communicator keeps TCP
//! and says so at INFO), and sleeping on a completion channel instead of polling with pauses.

pub mod fake;
#[cfg(feature = "rdma")]
pub mod hca;
pub mod ring;
pub mod verbs;

pub use ring::{Geometry, RdmaRing, RingInfo};
pub use verbs::{Completion, MrCache, QpInfo, Region, RemoteRegion, Verbs, WcOp};

#[cfg(test)]
mod tests;
