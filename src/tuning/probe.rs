//! The probe that measures the cost model when a communicator is created: ping-pongs and bulk
//! transfers inside a host and between hosts, and a timed local reduction.

use crate::error::Result;
use crate::transport::{Sink, Source};

/// Entries of [`ProbeResult`].
pub const PROBE_LEN: usize = 7;

/// The probe's results: `[intra alpha, intra beta, inter alpha, inter beta, gamma, cpu share,
/// host link beta]`, zero where this rank measured nothing. Every rank contributes and the
/// communicator takes the maximum of each, so all ranks end with the same model.
pub type ProbeResult = [f64; PROBE_LEN];

/// Bytes of the larger bulk transfer that measures beta (the smaller is half of it).
pub const PROBE_BYTES: usize = 8 << 20;
const PROBE_PINGS: usize = 16;

/// Measures link costs: ping-pongs and bulk transfers between two ranks of one host and
/// between the roots of two hosts (only those ranks act; the others return at once), plus a
/// timed local reduction. `scratch` must hold [`PROBE_BYTES`].
pub fn probe(
    ctx: &mut crate::algorithm::OpContext<'_>,
    topology: &crate::topology::Topology,
    scratch: &mut [u8],
) -> Result<ProbeResult> {
    let mut out = [0.0; PROBE_LEN];
    let me = ctx.rank();
    let intra = topology.members.iter().find(|m| m.len() >= 2).map(|m| (m[0], m[1]));
    let inter = (topology.hosts >= 2).then(|| (topology.members[0][0], topology.members[1][0]));
    for (class, pair) in [(0usize, intra), (2, inter)] {
        let Some((a, b)) = pair else { continue };
        if me != a && me != b {
            continue;
        }
        let peer = if me == a { b } else { a };
        let base = class * 1000;
        let mut step = base;
        let mut next = || {
            step += 1;
            step
        };
        // Latency: ping-pongs of empty frames (two untimed to warm up).
        let mut rtt = f64::INFINITY;
        for i in 0..PROBE_PINGS + 2 {
            let t = std::time::Instant::now();
            if me == a {
                ctx.exchange(next(), Some((peer, Source::Bytes(&[]))), None)?;
                ctx.exchange(next(), None, Some((peer, Sink::Copy(&mut []))))?;
            } else {
                ctx.exchange(next(), None, Some((peer, Sink::Copy(&mut []))))?;
                ctx.exchange(next(), Some((peer, Source::Bytes(&[]))), None)?;
            }
            if i >= 2 {
                rtt = rtt.min(t.elapsed().as_secs_f64());
            }
        }
        let alpha = rtt / 2.0;
        if me == a {
            out[class] = alpha;
        }
        if let Some(secs) = bulk(ctx, me == a, peer, scratch, &mut next)? {
            out[class + 1] = (secs / (PROBE_BYTES / 2) as f64).max(1e-12);
        }
    }
    // The host link as a whole: the i-th ranks of hosts 0 and 1 pair up and all send at once
    // (the same two transfers, the first warming up and lining them up); each receiver reports
    // its time over all the pairs' bytes and the maximum (the slowest pair) wins. Only with two
    // pairs or more: one pair is the stream measured above.
    if topology.hosts >= 2 {
        let pairs = topology.members[0].len().min(topology.members[1].len());
        let slot = |h: usize| topology.members[h][..pairs].iter().position(|&r| r == me);
        let role = match (slot(0), slot(1)) {
            (Some(i), _) => Some((true, topology.members[1][i])),
            (_, Some(i)) => Some((false, topology.members[0][i])),
            _ => None,
        };
        if let (true, Some((sender, peer))) = (pairs >= 2, role) {
            let mut step = 4000;
            let mut next = || {
                step += 1;
                step
            };
            if let Some(secs) = bulk(ctx, sender, peer, scratch, &mut next)? {
                out[6] = (secs / (PROBE_BYTES / 2 * pairs) as f64).max(1e-12);
            }
        }
    }
    // Reduction speed, locally: f32 sums of a quarter of the scratch, best of three.
    let q = PROBE_BYTES / 4;
    let (dst, rest) = scratch.split_at_mut(q);
    let (a, b) = (&rest[..q], &rest[q..2 * q]);
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t = std::time::Instant::now();
        crate::reduce::reduce_into(crate::DataType::F32, crate::ReduceOp::Sum, dst, a, b);
        best = best.min(t.elapsed().as_secs_f64());
    }
    out[4] = best / q as f64;
    let cores = crate::sys::cpu::online_cpus();
    out[5] = (topology.machine_ranks(me) as f64 / cores as f64).max(1.0);
    Ok(out)
}

/// The probe's bandwidth measurement between `me` and `peer`: [`PROBE_BYTES`]/4 then /2 back to
/// back, timed by the receiver between the end of the first and the end of the second (the link
/// is busy the whole time, so neither the latency nor a burst a shaper lets through counts),
/// then an empty answer. Returns the receiver's seconds for the second transfer (`None` on the
/// sender). `next` numbers the steps.
fn bulk(
    ctx: &mut crate::algorithm::OpContext<'_>,
    sender: bool,
    peer: usize,
    scratch: &mut [u8],
    next: &mut dyn FnMut() -> usize,
) -> Result<Option<f64>> {
    let (first, second) = (PROBE_BYTES / 4, PROBE_BYTES / 2);
    if sender {
        ctx.exchange(next(), Some((peer, Source::Bytes(&scratch[..first]))), None)?;
        ctx.exchange(next(), Some((peer, Source::Bytes(&scratch[..second]))), None)?;
        ctx.exchange(next(), None, Some((peer, Sink::Copy(&mut []))))?;
        return Ok(None);
    }
    ctx.exchange(next(), None, Some((peer, Sink::Copy(&mut scratch[..first]))))?;
    let t = std::time::Instant::now();
    ctx.exchange(next(), None, Some((peer, Sink::Copy(&mut scratch[..second]))))?;
    let secs = t.elapsed().as_secs_f64();
    ctx.exchange(next(), Some((peer, Source::Bytes(&[]))), None)?;
    Ok(Some(secs))
}
