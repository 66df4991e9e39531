//! RDMA verbs transport: the ring protocol of the shared-memory transport, over RDMA WRITE with
//! immediate between RC queue pairs (docs/reference/rdma.md).
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
//! ring runs in the unit tests over `fake::FakeVerbs`, an in-memory queue pair that keeps
//! RC's ordering and error rules and injects delays, held-back completions, failed writes
//! and a vanished peer; `tests/rdma.rs` runs communicators over its fabric (ranks as threads,
//! `TOROID_RDMA=fake`). The fake is a test double: it is compiled only for the unit tests and
//! with the cargo feature `rdma-fake`, which only the tests turn on (Cargo.toml).
//!
//! | part | what |
//! |---|---|
//! | [`verbs`] | the [`Verbs`] trait: exactly the verbs the ring uses; [`MrCache`] |
//! | [`write_ring`] | [`RdmaRing`]: send and receive over one queue pair; [`RingInfo`], exchanged before connecting |
//! | [`link`] | [`RdmaTransport`]: the ring as a [`crate::transport::Transport`], the pair's TCP link as liveness channel |
//! | [`setup`] | moving a communicator's links between hosts to RDMA at set-up (`TOROID_RDMA`) |
//! | `fake` | the in-memory fake of the verbs, and its in-process fabric (tests, `rdma-fake`) |
//! | `hca` | the verbs on a real device through `sideway` (cargo feature `rdma`): presence check, completion channel |
//!
//! Not done yet: writing straight from registered user buffers (the sender copies into its
//! registered stage; the receiver lends the bytes where they landed).

#[cfg(any(test, feature = "rdma-fake"))]
pub mod fake;
#[cfg(feature = "rdma")]
pub mod hca;
pub mod link;
pub mod setup;
pub mod verbs;
pub mod write_ring;

pub use link::RdmaTransport;

#[cfg(test)]
mod tests;
