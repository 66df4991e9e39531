//! The alpha-beta-gamma cost model: link costs, the communicator's shape, and the predicted time
//! of each algorithm's schedule (see the [module documentation](super)).

use super::ProbeResult;
use crate::collective::Algorithm;
use crate::error::{Error, Result};

/// Latency and inverse bandwidth of one class of link.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkCost {
    /// Seconds per message.
    pub alpha: f64,
    /// Seconds per byte.
    pub beta: f64,
}

/// The alpha-beta-gamma model of a communicator's links.
#[derive(Debug, Clone, PartialEq)]
pub struct CostModel {
    /// Links between ranks of one host.
    pub intra: LinkCost,
    /// Links between hosts, as one stream (one pair of ranks, over all its lanes) sees them.
    pub inter: LinkCost,
    /// Seconds per byte of a host's whole link, when several streams leave the host at once
    /// (measured with every rank of two hosts sending); `None`: the streams share one stream's
    /// bandwidth. A network that caps each flow below the link rate (clouds, or one flow's share of
    /// a fast NIC) makes the two differ: each of c concurrent streams then runs at
    /// min(stream, link / c).
    pub host_link_beta: Option<f64>,
    /// Seconds per byte reduced.
    pub gamma: f64,
    /// Where the numbers came from (for logs).
    pub source: String,
}

impl Default for CostModel {
    /// Loopback TCP on a 2-core VM inside a host; 10 Gbit/s Ethernet between hosts.
    fn default() -> CostModel {
        CostModel {
            intra: LinkCost { alpha: 8e-6, beta: 1.0 / 2.5e9 },
            inter: LinkCost { alpha: 30e-6, beta: 1.0 / 1.25e9 },
            host_link_beta: None,
            gamma: 1.0 / 10e9,
            source: "defaults".into(),
        }
    }
}

/// What the model needs to know about a communicator.
#[derive(Debug, Clone, PartialEq)]
pub struct Shape {
    /// Number of ranks.
    pub n: usize,
    /// Number of hosts.
    pub hosts: usize,
    /// Largest number of ranks on one host.
    pub per_host: usize,
    /// Torus grid `(X, Y)`.
    pub grid: (usize, usize),
    /// The grid's rows are hosts (ranks-per-host by hosts).
    pub rows_are_hosts: bool,
    /// Ranks of one host outnumber its cores by this factor (at least 1): loopback links
    /// then share CPUs.
    pub cpu_share: f64,
    /// Network interfaces per host: parallel streams leaving a host (the torus's columns,
    /// halving-doubling's pairs) use up to this many; one stream uses one.
    pub nics: usize,
    /// Frame size on the wire (`TOROID_SEGMENT_SIZE`): a phase moving more than one frame
    /// pays one frame's transfer to fill its pipeline.
    pub segment: usize,
    /// Chunk of the pipelined 2D torus (0: not pipelined).
    pub pipeline_chunk: usize,
    /// Pipelined wherever a call has two chunks, whatever the model predicts
    /// (`TOROID_PIPELINE_CHUNK` set).
    pub pipeline_forced: bool,
}

impl Shape {
    /// `n` ranks on `hosts` hosts of `per_host` ranks, grid `per_host x hosts`.
    pub fn uniform(n: usize, hosts: usize) -> Shape {
        let per_host = n.div_ceil(hosts.max(1));
        Shape {
            n,
            hosts,
            per_host,
            grid: (per_host, hosts),
            rows_are_hosts: true,
            cpu_share: 1.0,
            nics: 1,
            segment: crate::config::DEFAULT_SEGMENT_SIZE,
            pipeline_chunk: crate::config::DEFAULT_PIPELINE_CHUNK,
            pipeline_forced: false,
        }
    }
}

/// A predicted run of one algorithm.
#[derive(Debug, Clone, PartialEq)]
pub struct Prediction {
    /// The algorithm.
    pub algo: Algorithm,
    /// Predicted seconds.
    pub time: f64,
    /// Sequential communication steps (the latency count).
    pub steps: usize,
    /// Bytes that leave the busiest host through its link.
    pub inter_bytes: f64,
    /// Chunks the 2D torus pipelines the call in (1: not pipelined, and for every other
    /// algorithm): the cheaper of the two forms.
    pub chunks: usize,
}

fn log2_floor(n: usize) -> usize {
    (usize::BITS - 1 - n.max(1).leading_zeros()) as usize
}

fn log2_ceil(n: usize) -> usize {
    (usize::BITS - (n.max(1) - 1).leading_zeros()) as usize
}

impl CostModel {
    /// Parses `TOROID_COST_MODEL`: `probe` (the default; handled by the caller), `default`, or
    /// `intra=ALPHA_US/GBPS,inter=ALPHA_US/GBPS,reduce=GBPS[,link=GBPS]` (bandwidths in GB/s;
    /// `link`: a host's whole link when it exceeds one stream's `inter`).
    pub fn parse(spec: &str) -> Result<Option<CostModel>> {
        let spec = spec.trim();
        if spec.is_empty() || spec.eq_ignore_ascii_case("probe") {
            return Ok(None);
        }
        let mut m = CostModel::default();
        if spec.eq_ignore_ascii_case("default") {
            return Ok(Some(m));
        }
        let bad = || {
            Error::InvalidArgument(format!(
                "TOROID_COST_MODEL={spec}: expected probe, default or intra=US/GBPS,inter=US/GBPS,reduce=GBPS"
            ).into())
        };
        let num =
            |s: &str| s.trim().parse::<f64>().ok().filter(|v| *v > 0.0 && v.is_finite()).ok_or_else(bad);
        for part in spec.split(',') {
            let (k, v) = part.split_once('=').ok_or_else(bad)?;
            match k.trim() {
                "intra" | "inter" => {
                    let (a, b) = v.split_once('/').ok_or_else(bad)?;
                    let link = LinkCost { alpha: num(a)? * 1e-6, beta: 1.0 / (num(b)? * 1e9) };
                    if k.trim() == "intra" { m.intra = link } else { m.inter = link }
                }
                "reduce" => m.gamma = 1.0 / (num(v)? * 1e9),
                "link" => m.host_link_beta = Some(1.0 / (num(v)? * 1e9)),
                _ => return Err(bad()),
            }
        }
        m.source = format!("TOROID_COST_MODEL={spec}");
        Ok(Some(m))
    }

    /// Predicts an all-reduce of `bytes` with `algo` on `shape`.
    pub fn predict(&self, algo: Algorithm, bytes: usize, shape: &Shape) -> Prediction {
        self.predict_narrowed(algo, bytes, shape, None)
    }

    /// Predicts the compressed all-reduce (`comm/compressed.rs`) of `bytes` of data whose elements
    /// travel at `ratio` of their size (1/2 for f32 as bf16). As it runs: with several ranks on
    /// each of several hosts, the 2D torus compressed in its column phase only (exact rows);
    /// otherwise the flat form, an all-to-all and an all-gather, the ring's steps and bytes
    /// (times `ratio`). Rounding the input and widening the output cost a reduction's time per
    /// byte of the data's own type.
    pub fn predict_compressed(&self, bytes: usize, ratio: f64, shape: &Shape) -> Prediction {
        let torus = shape.hosts > 1 && shape.grid.0 > 1 && shape.grid.1 > 1;
        let algo = if torus { Algorithm::Torus2d } else { Algorithm::Ring };
        self.predict_narrowed(algo, bytes, shape, Some(ratio.clamp(0.0, 1.0)))
    }

    /// The chunks the 2D torus pipelines an all-reduce of `bytes` in (1: not pipelined), as
    /// [`predict`](Self::predict) prices it; `narrow`: a compressed call's byte ratio. Every
    /// rank holds the same model and shape, so every rank gets the same answer.
    pub fn torus_chunks(&self, bytes: usize, shape: &Shape, narrow: Option<f64>) -> usize {
        self.predict_narrowed(Algorithm::Torus2d, bytes, shape, narrow.map(|r| r.clamp(0.0, 1.0))).chunks
    }

    /// [`predict`](Self::predict), with `narrow` the compressed form's byte ratio (ring and
    /// torus2d only: the algorithms the compressed all-reduce runs as).
    fn predict_narrowed(
        &self,
        algo: Algorithm,
        bytes: usize,
        shape: &Shape,
        narrow: Option<f64>,
    ) -> Prediction {
        let n = shape.n.max(1);
        let b = bytes as f64;
        let cross = shape.hosts > 1;
        let k = shape.per_host.max(1);
        // When ranks outnumber cores, every message waits for its receiver to get a core, and
        // loopback transfers (which are CPU copies) share the cores too.
        let intra =
            LinkCost { alpha: self.intra.alpha * shape.cpu_share, beta: self.intra.beta * shape.cpu_share };
        let inter = LinkCost { alpha: self.inter.alpha * shape.cpu_share, beta: self.inter.beta };
        // `c` streams leaving a host at once, counted as the bytes of all of them on its link:
        // each runs at min(one stream, link / c), i.e. the link's bytes at max(beta / c, link).
        let shared = |c: f64| LinkCost {
            alpha: inter.alpha,
            beta: self.host_link_beta.map_or(inter.beta, |l| (inter.beta / c.max(1.0)).max(l)),
        };
        let worst = if cross {
            LinkCost { alpha: inter.alpha.max(intra.alpha), beta: inter.beta.max(intra.beta) }
        } else {
            intra
        };
        let g = self.gamma * shape.cpu_share;
        let mut t = 0.0;
        let mut steps = 0;
        let mut inter_bytes = 0.0;
        // One phase: `s` steps on `link`, moving `bytes_on_link` through the busiest link. A
        // phase of more than one frame also pays one frame's transfer before its pipeline is
        // full, where a frame is the segment or one step's piece if that is smaller: streamed
        // rings pay it once per phase, round-based algorithms once per round (measured on the
        // emulated cluster: halving-doubling's large rounds each lose about one frame time,
        // and rings of small pieces fill with a small frame).
        let seg = shape.segment as f64;
        let cost = |s: usize, link: LinkCost, bytes_on_link: f64| {
            let frame = seg.min(bytes_on_link / s.max(1) as f64);
            let fill = if s > 0 && bytes_on_link > frame { frame * link.beta } else { 0.0 };
            s as f64 * link.alpha + bytes_on_link * link.beta + fill
        };
        let mut phase = |s: usize, link: LinkCost, bytes_on_link: f64, is_inter: bool| {
            t += cost(s, link, bytes_on_link);
            steps += s;
            if is_inter {
                inter_bytes += bytes_on_link;
            }
        };
        if n == 1 {
            return Prediction { algo, time: 0.0, steps: 0, inter_bytes: 0.0, chunks: 1 };
        }
        let nf = n as f64;
        let mut reduced = 0.0;
        let mut chunks = 1;
        match algo {
            Algorithm::Ring => {
                // One stream per link; a ring of consecutive ranks crosses each host link once.
                // Compressed: an all-to-all and an all-gather of the narrowed pieces instead,
                // the same steps and bytes per link; the whole input is rounded and the whole
                // output widened.
                let r = narrow.unwrap_or(1.0);
                phase(2 * (n - 1), worst, r * 2.0 * (nf - 1.0) / nf * b, cross);
                reduced = (nf - 1.0) / nf * b + narrow.map_or(0.0, |_| 2.0 * b);
            }
            Algorithm::Doubling | Algorithm::HalvingDoubling => {
                let p = 1usize << log2_floor(n);
                let rounds = log2_floor(n);
                let folded = p != n;
                if folded {
                    phase(1, intra, b, false);
                    reduced += b;
                }
                for j in 0..rounds {
                    // Partners 2^j apart: across hosts once 2^j reaches the ranks per host, and
                    // then every rank of a host sends through the host's link at once.
                    let remote = cross && (1usize << j) >= k;
                    let per_rank = if algo == Algorithm::Doubling { b } else { b / (2 << j) as f64 };
                    let parallel = k.min(shape.nics.max(1)) as f64;
                    let (link, on_link) = if remote {
                        (shared(k as f64 / parallel), per_rank * k as f64 / parallel)
                    } else {
                        (intra, per_rank)
                    };
                    let reps = if algo == Algorithm::Doubling { 1 } else { 2 };
                    for _ in 0..reps {
                        phase(1, link, on_link, remote);
                    }
                    reduced += per_rank;
                }
                if folded {
                    phase(1, intra, b, false);
                }
            }
            Algorithm::HierarchicalRing => {
                let kf = k as f64;
                let m = shape.hosts.max(1);
                let mf = m as f64;
                // Reduce to the root: ring reduce-scatter, then the root gathers the pieces.
                phase(2 * (k - 1), intra, 2.0 * (kf - 1.0) / kf * b, false);
                phase(2 * (m - 1), inter, 2.0 * (mf - 1.0) / mf * b, cross);
                phase(2 * (k - 1), intra, 2.0 * (kf - 1.0) / kf * b, false);
                reduced = (kf - 1.0) / kf * b + (mf - 1.0) / mf * b;
            }
            Algorithm::Torus2d => {
                let (x, y) = shape.grid;
                let (xf, yf) = (x as f64, y as f64);
                // Rows are X consecutive ranks. A row stays inside a host when rows are hosts,
                // or when hosts are equal blocks of consecutive ranks that X divides; otherwise
                // its ring crosses host links (each one once, like a flat ring).
                let aligned = n.is_multiple_of(k) && x <= k && k.is_multiple_of(x);
                let row_crosses = cross && !shape.rows_are_hosts && !aligned;
                let row = if row_crosses { worst } else { intra };
                let row_bytes = (xf - 1.0) / xf * b;
                // The column rings through a host (one per column among its ranks: min(X, k))
                // share its link(s): each carries 2(Y-1)/Y * b/X bytes, spread over up to
                // `nics` interfaces.
                let streams = x.min(k);
                let col_share = streams as f64 / streams.min(shape.nics.max(1)) as f64;
                let col = if cross { shared(col_share) } else { intra };
                // Compressed: the column's all-to-all and all-gather carry the narrowed piece
                // (the ring's steps and bytes, times the ratio), rounded and widened once.
                let r = narrow.unwrap_or(1.0);
                let col_bytes = r * col_share * 2.0 * (yf - 1.0) / yf * b / xf;
                let p = crate::algorithm::torus2d::pipeline_chunks(bytes, x, y, shape.pipeline_chunk);
                let (row_t, col_t) = (cost(x - 1, row, row_bytes), cost(2 * (y - 1), col, col_bytes));
                // Pipelined in p chunks: chunk c's column phase runs beside the row's
                // reduce-scatter of chunk c + 1 and all-gather of chunk c - 1; the first
                // reduce-scatter and the last all-gather run alone. Each chunk pays the phases'
                // latencies again, the column's fill once: the chunks' column phases follow each
                // other on links that the other columns of the host keep busy (measured at 4 x 2
                // on 1 Gbit/s: 4 chunks saved 6-16 ms where a fill per chunk predicted a loss).
                // Taken only where the model finds it cheaper.
                let pf = p as f64;
                let row1 = cost(x - 1, row, row_bytes / pf);
                let col_latency = (2 * (y - 1)) as f64 * col.alpha;
                let col1 = col_latency + col_bytes / pf * col.beta;
                let col_fill = col_t - (col_latency + col_bytes * col.beta);
                let lanes: f64 = (0..p)
                    .map(|c| col1.max(row1 * (usize::from(c + 1 < p) + usize::from(c > 0)) as f64))
                    .sum();
                let piped = 2.0 * row1 + lanes + col_fill;
                if p > 1 && (shape.pipeline_forced || piped < 2.0 * row_t + col_t) {
                    chunks = p;
                    t += piped;
                } else {
                    t += 2.0 * row_t + col_t;
                }
                steps += chunks * (2 * (x - 1) + 2 * (y - 1));
                inter_bytes +=
                    if cross { col_bytes } else { 0.0 } + if row_crosses { 2.0 * row_bytes } else { 0.0 };
                reduced =
                    (xf - 1.0) / xf * b + (yf - 1.0) / yf * b / xf + narrow.map_or(0.0, |_| 2.0 * b / xf);
            }
            Algorithm::Chain => {
                // Pipelined: n - 1 frame latencies (the fill), then the whole message once.
                phase(n - 2, worst, 0.0, cross);
                phase(1, worst, b.min(seg), cross);
                phase(0, worst, b, cross);
            }
            Algorithm::Tree => {
                phase(log2_ceil(n), worst, log2_ceil(n) as f64 * b, cross);
            }
            _ => phase(n - 1, worst, b, cross),
        }
        Prediction { algo, time: t + reduced * g, steps, inter_bytes, chunks }
    }
}

impl CostModel {
    /// The model from probe results, with defaults where nothing was measured (a single host
    /// has no inter-host link; a host of one rank no intra-host one).
    pub fn from_probe(r: &ProbeResult) -> CostModel {
        let d = CostModel::default();
        let link = |a: f64, b: f64, def: LinkCost| {
            if a > 0.0 && b > 0.0 { LinkCost { alpha: a, beta: b } } else { def }
        };
        CostModel {
            intra: link(r[0], r[1], d.intra),
            inter: link(r[2], r[3], d.inter),
            host_link_beta: (r[6] > 0.0 && r[3] > 0.0).then_some(r[6]),
            gamma: if r[4] > 0.0 { r[4] } else { d.gamma },
            source: "probe".into(),
        }
    }
}

impl std::fmt::Display for CostModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "intra {:.1} us + {:.2} GB/s, inter {:.1} us + {:.3} GB/s{}, reduce {:.1} GB/s ({})",
            self.intra.alpha * 1e6,
            1e-9 / self.intra.beta,
            self.inter.alpha * 1e6,
            1e-9 / self.inter.beta,
            self.host_link_beta.map_or(String::new(), |l| format!(" (host link {:.3} GB/s)", 1e-9 / l)),
            1e-9 / self.gamma,
            self.source
        )
    }
}
