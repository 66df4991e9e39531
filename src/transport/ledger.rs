//! The ring protocol's bookkeeping, without memory: one tested state machine for every ring.
//!
//! Both ring transports speak the same protocol (docs/reference/shared-memory.md and docs/reference/rdma.md): a ring of
//! `cap` units (bytes for the shared-memory ring, slots for the RDMA ring), a 64-bit `head`
//! counting units ever written, which only the writer advances, and a 64-bit `tail` counting
//! units ever consumed, which only the reader advances. Neither wraps. The writer may fill a
//! unit only while `head - tail < cap`: the reader's `tail` is the writer's credit, and the
//! reader returns credits by publishing a larger `tail`. What differs is only how a counter
//! travels: a release store into shared memory, or an RDMA WRITE with an immediate.
//!
//! [`SendLedger`] is the writer's view, [`RecvLedger`] the reader's. Each keeps its own counter,
//! the part of it already published to the peer, and the last value of the peer's counter it
//! accepted. Every value that comes from the peer goes through [`SendLedger::credit`] or
//! [`RecvLedger::arrived`], which refuse a counter that moves backwards or beyond what the
//! protocol allows (a reader cannot consume what was never published; a writer cannot write
//! past the credits it was given), so a broken or hostile peer cannot make the arithmetic
//! below overflow or a span leave the ring.

/// A range of units at the ring position `pos`, `len` units long, never past the ring's end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// The first unit's position in the ring.
    pub pos: usize,
    /// How many units.
    pub len: usize,
}

/// A counter from the peer that the protocol does not allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Violation {
    /// What the peer sent.
    pub got: u64,
    /// The smallest and the largest values that were acceptable.
    pub allowed: (u64, u64),
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "counter {} outside the allowed {}..={}", self.got, self.allowed.0, self.allowed.1)
    }
}

/// The writer's side of a ring of `cap` units.
#[derive(Debug, Clone, Copy)]
pub struct SendLedger {
    cap: u64,
    /// Units written (ahead of `published` between publishes).
    head: u64,
    /// The `head` the reader was last told.
    published: u64,
    /// The reader's `tail` as last accepted: the credits.
    tail: u64,
}

impl SendLedger {
    /// An empty ring of `cap` units; `cap` is a power of two.
    pub fn new(cap: usize) -> SendLedger {
        assert!(cap.is_power_of_two(), "ring capacity {cap} is not a power of two");
        SendLedger { cap: cap as u64, head: 0, published: 0, tail: 0 }
    }

    /// Units written so far.
    #[inline]
    pub fn head(&self) -> u64 {
        self.head
    }

    /// The reader's `tail` as last accepted.
    #[inline]
    pub fn tail(&self) -> u64 {
        self.tail
    }

    /// Units that may be written now (the credits not yet used).
    #[inline]
    pub fn free(&self) -> usize {
        (self.cap - (self.head - self.tail)) as usize
    }

    /// Units written but not yet published.
    #[inline]
    pub fn unpublished(&self) -> usize {
        (self.head - self.published) as usize
    }

    /// Units published and not yet credited back (in the reader's hands).
    #[inline]
    pub fn in_flight(&self) -> usize {
        (self.published - self.tail) as usize
    }

    /// Where the next write goes: at most `max` units, within the credits, up to the ring's end.
    #[inline]
    pub fn span(&self, max: usize) -> Span {
        let pos = (self.head & (self.cap - 1)) as usize;
        Span { pos, len: self.free().min(max).min(self.cap as usize - pos) }
    }

    /// Records `n` units written at [`SendLedger::span`].
    #[inline]
    pub fn advance(&mut self, n: usize) {
        debug_assert!(n <= self.free(), "wrote {n} units with {} credits", self.free());
        self.head += n as u64;
    }

    /// The `head` to publish, when something was written since the last publish.
    #[inline]
    pub fn publish(&mut self) -> Option<u64> {
        if self.head == self.published {
            return None;
        }
        self.published = self.head;
        Some(self.head)
    }

    /// Accepts the reader's `tail`: it may not move backwards nor pass what was published.
    /// Returns the units it credited.
    #[inline]
    pub fn credit(&mut self, tail: u64) -> Result<usize, Violation> {
        if tail < self.tail || tail > self.published {
            return Err(Violation { got: tail, allowed: (self.tail, self.published) });
        }
        let n = (tail - self.tail) as usize;
        self.tail = tail;
        Ok(n)
    }
}

/// The reader's side of a ring of `cap` units.
#[derive(Debug, Clone, Copy)]
pub struct RecvLedger {
    cap: u64,
    /// Units consumed (ahead of `released` between releases).
    tail: u64,
    /// The `tail` the writer was last told: it may write up to `released + cap`.
    released: u64,
    /// The writer's `head` as last accepted.
    head: u64,
}

impl RecvLedger {
    /// An empty ring of `cap` units; `cap` is a power of two.
    pub fn new(cap: usize) -> RecvLedger {
        assert!(cap.is_power_of_two(), "ring capacity {cap} is not a power of two");
        RecvLedger { cap: cap as u64, tail: 0, released: 0, head: 0 }
    }

    /// Units consumed so far.
    #[inline]
    pub fn tail(&self) -> u64 {
        self.tail
    }

    /// The writer's `head` as last accepted.
    #[inline]
    pub fn head(&self) -> u64 {
        self.head
    }

    /// Units arrived and not yet consumed.
    #[inline]
    pub fn available(&self) -> usize {
        (self.head - self.tail) as usize
    }

    /// Units consumed but not yet released (credits the writer has not been given).
    #[inline]
    pub fn unreleased(&self) -> usize {
        (self.tail - self.released) as usize
    }

    /// The next units to read: at most `max`, those arrived, up to the ring's end.
    #[inline]
    pub fn span(&self, max: usize) -> Span {
        let pos = (self.tail & (self.cap - 1)) as usize;
        Span { pos, len: self.available().min(max).min(self.cap as usize - pos) }
    }

    /// Records `n` units consumed.
    #[inline]
    pub fn consume(&mut self, n: usize) {
        debug_assert!(n <= self.available(), "consumed {n} units of {}", self.available());
        self.tail += n as u64;
    }

    /// The `tail` to publish (credits to return), when something was consumed since.
    #[inline]
    pub fn release(&mut self) -> Option<u64> {
        if self.tail == self.released {
            return None;
        }
        self.released = self.tail;
        Some(self.tail)
    }

    /// Accepts the writer's `head`: it may not move backwards nor pass the credits given
    /// (`released + cap`). Returns the units that arrived.
    #[inline]
    pub fn arrived(&mut self, head: u64) -> Result<usize, Violation> {
        let limit = self.released + self.cap;
        if head < self.head || head > limit {
            return Err(Violation { got: head, allowed: (self.head, limit) });
        }
        let n = (head - self.head) as usize;
        self.head = head;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_stop_at_the_credits_and_at_the_rings_end() {
        let (mut s, mut r) = (SendLedger::new(8), RecvLedger::new(8));
        assert_eq!(s.span(100), Span { pos: 0, len: 8 });
        s.advance(6);
        assert_eq!(s.span(100), Span { pos: 6, len: 2 });
        assert_eq!(s.publish(), Some(6));
        assert_eq!(s.publish(), None, "nothing new");
        assert_eq!(r.arrived(6), Ok(6));
        assert_eq!(r.span(4), Span { pos: 0, len: 4 });
        r.consume(5);
        assert_eq!(r.release(), Some(5));
        assert_eq!(s.credit(5), Ok(5));
        // Free 7, but contiguous only to the ring's end.
        assert_eq!(s.free(), 7);
        assert_eq!(s.span(100), Span { pos: 6, len: 2 });
        s.advance(2);
        assert_eq!(s.span(100), Span { pos: 0, len: 5 });
        s.advance(5);
        assert_eq!((s.free(), s.span(9).len), (0, 0), "no credits: nothing to write");
        assert_eq!(s.publish(), Some(13));
        assert_eq!(r.arrived(13), Ok(7));
        assert_eq!(r.span(100), Span { pos: 5, len: 3 }, "to the ring's end");
    }

    #[test]
    fn counters_from_the_peer_that_break_the_protocol_are_refused_and_change_nothing() {
        let (mut s, mut r) = (SendLedger::new(4), RecvLedger::new(4));
        s.advance(3);
        s.publish();
        assert_eq!(s.credit(4), Err(Violation { got: 4, allowed: (0, 3) }), "credit for unpublished units");
        assert_eq!(s.credit(2), Ok(2));
        assert_eq!(s.credit(1), Err(Violation { got: 1, allowed: (2, 3) }), "backwards");
        assert_eq!(s.free(), 3);
        assert_eq!(r.arrived(5), Err(Violation { got: 5, allowed: (0, 4) }), "past the credits");
        assert_eq!(r.arrived(4), Ok(4));
        assert_eq!(r.arrived(3), Err(Violation { got: 3, allowed: (4, 4) }), "backwards");
        r.consume(1);
        assert_eq!(r.arrived(5), Err(Violation { got: 5, allowed: (4, 4) }), "consumed, not yet released");
        r.release();
        assert_eq!(r.arrived(5), Ok(1));
        assert_eq!(r.available(), 4);
        assert!(s.credit(u64::MAX).is_err() && r.arrived(u64::MAX).is_err(), "no overflow");
    }

    /// A seeded generator (splitmix64).
    fn next(state: &mut u64) -> u64 {
        *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = *state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    #[test]
    fn random_steps_keep_every_invariant_of_the_ring() {
        for cap in [1usize, 2, 8, 64] {
            let (mut s, mut r) = (SendLedger::new(cap), RecvLedger::new(cap));
            // Counters on their way: published heads to the reader, released tails back.
            let (mut heads, mut tails) = (Vec::new(), Vec::new());
            let mut rng = cap as u64;
            for _ in 0..20_000 {
                match next(&mut rng) % 6 {
                    0 => {
                        let sp = s.span((next(&mut rng) % (cap as u64 + 2)) as usize);
                        assert!(sp.pos + sp.len <= cap && sp.len <= s.free());
                        s.advance(sp.len);
                    }
                    1 => heads.extend(s.publish()),
                    2 if !heads.is_empty() => {
                        let h = heads.remove(0);
                        r.arrived(h).expect("in-order heads are always allowed");
                    }
                    3 => {
                        let sp = r.span((next(&mut rng) % (cap as u64 + 2)) as usize);
                        assert!(sp.pos + sp.len <= cap && sp.len <= r.available());
                        r.consume(sp.len);
                    }
                    4 => tails.extend(r.release()),
                    5 if !tails.is_empty() => {
                        let t = tails.remove(0);
                        s.credit(t).expect("in-order tails are always allowed");
                    }
                    _ => {}
                }
                // Never more in the ring than it holds, from either side's view.
                assert!(s.head() - r.tail() <= cap as u64);
                assert!(r.available() <= cap && s.in_flight() <= cap && s.free() <= cap);
                assert!(r.head() <= s.head() && r.tail() <= r.head());
            }
            assert!(s.head() > 100 * cap as u64, "the ring turned over many times (cap {cap}): {}", s.head());
        }
    }
}
