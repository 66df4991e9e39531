//! Shared-memory transport between ranks of one host.
//!
//! ## Segments
//!
//! Every pair of ranks with the same host identity that exchanges directly shares one segment
//! holding two single-producer/single-consumer rings, one per direction: every pair at set-up
//! with a mesh, each pair as its link opens with links on demand (`pair`; set-up then links
//! only rank 0 with each rank, for the window). One rank creates it (the lower at set-up, the
//! dialing one on demand) in the shared-memory directory (`TOROID_SHM_DIR`, default
//! `/dev/shm`) under an unguessable name `toroid-<pid>-<nonce>-p<lo>-<hi>`, reserves its pages
//! with `fallocate(2)` (a tmpfs that is too small fails here with a clear message instead of a
//! `SIGBUS` on first touch), maps it and offers it to the peer over their TCP connection. The
//! peer maps it, checks the nonce written in the header, unlinks the name and accepts; the
//! creator unlinks too (whoever is first wins). The name therefore exists only for the round
//! trip of that exchange: after a normal exit, an error or a `kill -9` at any later moment
//! nothing is left in `/dev/shm`, because the memory lives only as long as some process maps
//! it. Names left behind by a process killed inside that exchange are swept by the next set-up
//! on the host ([`sweep_stale`]).
//!
//! ```text
//! offset 0      header: magic, version, nonce, ring capacity        (one page)
//!        512    ring lo->hi control    head | tail | reader waiting | writer waiting
//!        1024   ring hi->lo control    (each field on its own 128-byte line)
//!        4096   ring lo->hi data       capacity bytes (a power of two)
//!        4096+C ring hi->lo data
//! ```
//!
//! ## Rings
//!
//! A ring is a byte stream: `head` counts bytes ever written (only the producer stores it),
//! `tail` bytes ever consumed (only the consumer stores it); both are 64-bit and never wrap.
//! The producer copies into the free space and publishes `head` with a release store every
//! [`PUBLISH`] bytes, so the consumer starts on the first bytes of a large write while the rest
//! is still being copied; the consumer reads after an acquire load of `head` and frees space
//! with a release store of `tail`. Each side caches the other's counter and reloads it only when
//! the cached value says "empty" or "full", so the hot loop touches the other side's cache line
//! only when it must.
//!
//! ## Waking and liveness
//!
//! The TCP connection of the pair stays open as the wake-up and liveness channel: the progress
//! engine keeps sleeping in `poll(2)` on it (see [`Transport::arm`]). Before sleeping, a reader
//! sets `reader_waiting` and re-checks the ring (a sequentially consistent fence on both sides:
//! either the reader sees the data or the writer sees the flag); a writer that publishes and
//! finds the flag set clears it and sends one byte on the socket. Writers waiting for space do
//! the same with `writer_waiting`. A peer that exits or is killed closes its socket, so a
//! sleeping rank wakes at once and sees end of stream; a peer that shuts down cleanly also marks
//! its ring closed (after its last data) so the reader sees end of stream in order.
//!
//! ## Zero copy
//!
//! [`Transport::read_with`] hands the reader's reduction the bytes straight out of the ring:
//! `dst = dst ⊕ ring` without first copying into a scratch buffer.
//!
//! ## Files
//!
//! | module | what |
//! |---|---|
//! | `segment` | [`Segment`]: create, open, map and unlink a segment; [`sweep_stale`] |
//! | `byte_ring` | the producer and consumer ends of a byte ring, over any shared memory (tested on the heap) |
//! | `link` | [`ShmTransport`], and the Unix socket pair that wakes in-process pairs |
//! | `setup` | [`connect`]: upgrading same-host links and setting up the window |
//! | `pair` | one pair's move to shared memory as its link opens on demand |
//! | [`window`] | the window: one segment mapped by every rank of a host |
//!
//! The operating-system calls (files, mappings, sockets, `poll`, futexes) are in `crate::sys`.
//!
//! [`Transport::arm`]: super::Transport::arm
//! [`Transport::read_with`]: super::Transport::read_with

mod byte_ring;
mod link;
pub(crate) mod pair;
mod segment;
pub(crate) mod setup;
pub mod window;

pub use byte_ring::pair_segment_len;
pub use link::ShmTransport;
pub use segment::{NAME_PREFIX, Segment, segment_name};
pub use setup::{Pairs, ShmOptions, ShmSetup, connect};
