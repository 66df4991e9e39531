//! `toroid-bench`: nccl-tests' microbenchmark for toroid.
//!
//! Same command line (`-b -e -f -i -n -w -c -d -o -r -T -J`, sizes with K/M/G suffixes, type
//! names `float half bfloat16 double int8 uint8 int32 uint32 int64 uint64`) and the same output
//! columns: size, count, type, redop, root, then time (us), algbw, busbw (decimal GB/s) and
//! #wrong for out-of-place and in-place, plus the algorithm that ran. Every rank times its own
//! iterations; the printed time is the mean over ranks. Run it under a launcher:
//!
//! ```text
//! toroid-run -n 4 -- toroid-bench -b 4K -e 64M -f 4
//! ```
//!
//! Sizes follow nccl-tests: for reduce_scatter the size (`-b`/`-e`, and the `size` column) is
//! the whole input of a rank (each rank gets size/nranks bytes); for all_gather it is the whole
//! output (each rank gives size/nranks bytes); both are rounded down to a multiple of nranks
//! elements. The `count` column is the count passed to the collective, as in nccl-tests: the
//! elements per rank for reduce_scatter and all_gather (and per peer for all_to_all). algbw is
//! size / time and busbw is algbw x (n-1)/n for all three.
//!
//! `--device N` puts the buffers in memory of CUDA device N: every call then goes through the
//! stream entry points' path (CUDA IPC inside a host, else staged through pinned host memory;
//! the last column says which), with the same columns and checks ([`device`]).
//!
//! Exits non-zero when any checked value is wrong.

#[cfg(feature = "cuda")]
mod device;
#[cfg(not(feature = "cuda"))]
#[path = "device_stub.rs"]
mod device;

mod calls;
mod setup;
mod values;

use std::io::Write;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use setup::{cpu_ms, setup_report, unix_ms};
use toroid::{Algorithm, CallOptions, Communicator, DataType, OpKind, ReduceOp};
use values::{decode, encode, roundtrip};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
#[value(rename_all = "snake_case")]
enum Collective {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast,
    Reduce,
    AllToAll,
}

#[derive(Parser, Debug)]
#[command(
    name = "toroid-bench",
    version,
    about = "nccl-tests-style benchmark of toroid collectives",
    after_help = "Example:\n  toroid-run -n 4 -- toroid-bench -b 4K -e 64M -f 4 -d float -o sum"
)]
struct Cli {
    /// Smallest size in bytes (K, M, G suffixes: powers of 1024).
    #[arg(short = 'b', long = "minbytes", default_value = "32M", value_parser = size)]
    min_bytes: usize,
    /// Largest size in bytes.
    #[arg(short = 'e', long = "maxbytes", default_value = "32M", value_parser = size)]
    max_bytes: usize,
    /// Multiplication factor between sizes.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2)]
    step_factor: usize,
    /// Fixed increment between sizes (used instead of -f when set).
    #[arg(short = 'i', long = "stepbytes", value_parser = size)]
    step_bytes: Option<usize>,
    /// Timed iterations per size.
    #[arg(short = 'n', long = "iters", default_value_t = 20)]
    iters: usize,
    /// Warm-up iterations per size.
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 5)]
    warmup: usize,
    /// Check results (1) or not (0).
    #[arg(short = 'c', long = "check", default_value_t = 1)]
    check: u8,
    /// Element type.
    #[arg(short = 'd', long = "datatype", default_value = "float")]
    datatype: String,
    /// Reduction op (sum, prod, min, max, avg).
    #[arg(short = 'o', long = "op", default_value = "sum")]
    op: String,
    /// Root rank (broadcast, reduce).
    #[arg(short = 'r', long = "root", default_value_t = 0)]
    root: usize,
    /// Force an algorithm (ring, rd, chain, tree, ...).
    #[arg(short = 'a', long = "algorithm")]
    algorithm: Option<String>,
    /// Which collective to run.
    #[arg(long = "collective", value_enum, default_value = "all_reduce")]
    collective: Collective,
    /// Timeout of every call in seconds.
    #[arg(short = 'T', long = "timeout")]
    timeout: Option<f64>,
    /// Add the cost model's predicted time (us) after the algorithm.
    #[arg(long)]
    predict: bool,
    /// After the run, print rank 0's statistics (every collective it ran, the benchmark's own
    /// barriers and timing reductions included, per algorithm and size class) as `#` lines.
    #[arg(long)]
    stats: bool,
    /// Also write the results as JSON to this file.
    #[arg(short = 'J', long = "output_file")]
    json: Option<String>,
    /// A data-parallel step instead of the size sweep: this many float sum all-reduces of the
    /// `-b` size per step, timed one by one, as one group (`Communicator::group`, which packs
    /// them) and as persistent requests started one by one (`all_reduce_init`), with the ratios.
    #[arg(long = "calls")]
    calls: Option<usize>,
    /// Set-up cost instead of the size sweep: each rank times its set-up (`from_env`) and one
    /// float sum all-reduce of the `-b` size (checked), then prints one `SETUP` line with those
    /// times, its linked peers, its open sockets (`/proc/self/fd`) and its memory
    /// (`scripts/setup-scale.py` gathers them; `TOROID_CONNECT=mesh|lazy` compares the two).
    #[arg(long = "setup")]
    setup: bool,
    /// Buffers in memory of this CUDA device instead of host memory: each call through the
    /// stream entry points' path (CUDA IPC between the ranks of a host, else staged through
    /// pinned host memory), named in the last column. The size sweep only.
    #[arg(long = "device")]
    device: Option<usize>,
}

fn size(s: &str) -> Result<usize, String> {
    toroid::internals::config::parse_size("size", s).map_err(|e| e.to_string())
}

/// Formats a number into `width` characters the way nccl-tests does: two decimals, then one,
/// then none, then exponent form.
fn fit(v: f64, width: usize) -> String {
    for p in [2usize, 1, 0] {
        let s = format!("{v:.p$}");
        if s.len() <= width {
            return s;
        }
    }
    format!("{v:.1e}")
}

struct Row {
    bytes: usize,
    count: usize,
    algorithm: Algorithm,
    /// On device memory: the path the calls took ("ipc", "staged"), shown for the algorithm.
    path: Option<&'static str>,
    results: [(f64, f64, f64, u64); 2],
}

impl Row {
    fn algorithm_name(&self) -> &'static str {
        self.path.unwrap_or(self.algorithm.name())
    }
}

/// Bus bandwidth factor (nccl-tests' PERFORMANCE.md).
fn bus_factor(c: Collective, n: usize) -> f64 {
    let n = n as f64;
    match c {
        Collective::AllReduce => 2.0 * (n - 1.0) / n,
        Collective::ReduceScatter | Collective::AllGather | Collective::AllToAll => (n - 1.0) / n,
        Collective::Broadcast | Collective::Reduce => 1.0,
    }
}

struct Bench {
    comm: Communicator,
    cli: Cli,
    dtype: DataType,
    op: ReduceOp,
    opts: CallOptions,
}

impl Bench {
    /// How the call of a row runs when `TOROID_WIRE_DTYPE` compresses it, and the cost
    /// model's seconds for it.
    fn compressed(&self, bytes: usize) -> Option<(Algorithm, f64)> {
        match self.cli.collective {
            Collective::AllReduce => self.comm.predict_compressed(bytes, self.dtype),
            _ => None,
        }
    }

    /// The cost model's seconds for a row: the compressed form when `TOROID_WIRE_DTYPE`
    /// compresses this all-reduce, else `algo`'s.
    fn predict(&self, algo: Algorithm, bytes: usize) -> f64 {
        self.compressed(bytes).map_or_else(|| self.comm.predict(algo, bytes), |(_, t)| t)
    }

    fn kind(&self) -> OpKind {
        match self.cli.collective {
            Collective::AllReduce => OpKind::AllReduce(self.op),
            Collective::ReduceScatter => OpKind::ReduceScatter(self.op),
            Collective::AllGather => OpKind::AllGather,
            Collective::Broadcast => OpKind::Broadcast(self.cli.root),
            Collective::Reduce => OpKind::Reduce(self.op, self.cli.root),
            Collective::AllToAll => OpKind::AllToAll,
        }
    }

    /// Element counts of (input, output) for `total` elements in nccl-tests' terms.
    fn counts(&self, total: usize) -> (usize, usize) {
        let n = self.comm.size();
        match self.cli.collective {
            Collective::AllReduce | Collective::Broadcast | Collective::Reduce | Collective::AllToAll => {
                (total, total)
            }
            Collective::ReduceScatter => (total, total / n),
            Collective::AllGather => (total / n, total),
        }
    }

    /// The `count` column: the count argument of the collective in nccl-tests (its
    /// `paramcount`), per rank for reduce_scatter and all_gather, per peer for all_to_all.
    fn param_count(&self, total: usize) -> usize {
        match self.cli.collective {
            Collective::AllReduce | Collective::Broadcast | Collective::Reduce => total,
            Collective::ReduceScatter | Collective::AllGather | Collective::AllToAll => {
                total / self.comm.size()
            }
        }
    }

    /// The test value of element `i` of `rank`: small integers, so every type and op gives an
    /// exactly representable result (products stay powers of two).
    fn value(&self, rank: usize, i: usize) -> f64 {
        match self.op {
            ReduceOp::Prod => ((rank + i) % 2 + 1) as f64,
            _ => ((rank * 7 + i * 3) % 5) as f64,
        }
    }

    fn fill(&self, buf: &mut [u8], rank: usize, start: usize) {
        let s = self.dtype.size();
        for (k, c) in buf.chunks_exact_mut(s).enumerate() {
            encode(self.dtype, self.value(rank, start + k), c);
        }
    }

    /// Counts wrong elements of this rank's output for input layout `fill(rank, 0)`.
    fn wrong(&self, out: &[u8], in_place: bool, count_in: usize) -> u64 {
        let n = self.comm.size();
        let me = self.comm.rank();
        let s = self.dtype.size();
        let reduce = |i: usize| -> f64 {
            let vals = (0..n).map(|r| self.value(r, i));
            match self.op {
                ReduceOp::Sum => vals.sum(),
                ReduceOp::Avg => vals.sum::<f64>() / n as f64,
                ReduceOp::Prod => vals.product(),
                ReduceOp::Min => vals.fold(f64::INFINITY, f64::min),
                ReduceOp::Max => vals.fold(f64::NEG_INFINITY, f64::max),
            }
        };
        let tol = |want: f64| if self.op == ReduceOp::Avg { want.abs() * 1e-2 + 1e-3 } else { 0.0 };
        let elems = out.len() / s;
        let mut wrong = 0;
        let mut check = |k: usize, want: f64| {
            let want = roundtrip(self.dtype, want);
            let got = decode(self.dtype, &out[k * s..(k + 1) * s]);
            if (got - want).abs() > tol(want) {
                wrong += 1;
            }
        };
        match self.cli.collective {
            Collective::AllReduce => (0..elems).for_each(|k| check(k, reduce(k))),
            Collective::ReduceScatter => {
                let piece = count_in / n;
                let base = if in_place { me * piece } else { 0 };
                (0..piece).for_each(|k| check(base + k, reduce(me * piece + k)));
            }
            Collective::AllGather => {
                let piece = elems / n;
                (0..elems).for_each(|k| check(k, self.value(k / piece, k % piece)));
            }
            Collective::Broadcast => (0..elems).for_each(|k| check(k, self.value(self.cli.root, k))),
            Collective::Reduce if me == self.cli.root => (0..elems).for_each(|k| check(k, reduce(k))),
            Collective::Reduce => {}
            Collective::AllToAll => {
                let block = elems / n;
                (0..elems).for_each(|k| check(k, self.value(k / block, me * block + k % block)));
            }
        }
        wrong
    }

    /// One call; `recv` is exactly the output buffer (in place: the whole buffer, which for
    /// reduce_scatter is the input and gets this rank's piece). With `dev` the call runs on the
    /// device copies of both (`count`: the entry points' count, `param_count`).
    fn run_once(
        &self,
        dev: Option<&device::DeviceBufs>,
        send: &[u8],
        recv: &mut [u8],
        in_place: bool,
        count: usize,
    ) -> toroid::Result<()> {
        if let Some(d) = dev {
            return d.run(&self.comm, self.kind(), count, self.dtype, in_place);
        }
        let send = if in_place { None } else { Some(send) };
        self.comm.run_bytes(self.kind(), self.dtype, send, Some(recv), self.opts)
    }

    fn measure(&self, bytes: usize) -> toroid::Result<Option<Row>> {
        let n = self.comm.size();
        let s = self.dtype.size();
        let mut total = bytes / s;
        if matches!(
            self.cli.collective,
            Collective::ReduceScatter | Collective::AllGather | Collective::AllToAll
        ) {
            total -= total % n;
        }
        if total == 0 {
            // Fewer elements than ranks: nothing to move (nccl-tests skips these sizes too).
            return Ok(None);
        }
        let (cin, cout) = self.counts(total);
        let count = self.param_count(total);
        let mut send = vec![0u8; cin * s];
        let mut buf = vec![0u8; cin.max(cout) * s];
        let mut dev = match self.cli.device {
            Some(ordinal) => Some(device::DeviceBufs::new(ordinal, send.len(), buf.len())?),
            None => None,
        };
        let mut results = [(0.0, 0.0, 0.0, 0u64); 2];
        for (slot, in_place) in [false, true].into_iter().enumerate() {
            // Out of place the output is `cout` elements; in place the buffer holds the larger of
            // input and output (the whole input of reduce_scatter, the whole output of all_gather).
            let out_len = if in_place { cin.max(cout) } else { cout };
            let recv = &mut buf[..out_len * s];
            let me = self.comm.rank();
            let prepare = |send: &mut [u8], recv: &mut [u8]| {
                self.fill(send, me, 0);
                recv.fill(0);
                if in_place {
                    match self.cli.collective {
                        Collective::AllGather => {
                            let piece = cin * s;
                            recv[me * piece..(me + 1) * piece].copy_from_slice(send);
                        }
                        _ => recv[..send.len()].copy_from_slice(send),
                    }
                }
            };
            prepare(&mut send, recv);
            if let Some(d) = dev.as_mut() {
                d.upload(&send, recv)?;
            }
            for _ in 0..self.cli.warmup {
                self.run_once(dev.as_ref(), &send, recv, in_place, count)?;
            }
            if let Some(d) = dev.as_ref() {
                d.sync()?;
            }
            self.comm.barrier()?;
            let t = Instant::now();
            for _ in 0..self.cli.iters {
                self.run_once(dev.as_ref(), &send, recv, in_place, count)?;
            }
            if let Some(d) = dev.as_ref() {
                d.sync()?;
            }
            let mut secs = [t.elapsed().as_secs_f64() / self.cli.iters.max(1) as f64];
            self.comm.all_reduce_with(&mut secs, ReduceOp::Avg, EXACT)?;
            let mut wrong = [0u64];
            if self.cli.check != 0 {
                prepare(&mut send, recv);
                if let Some(d) = dev.as_mut() {
                    d.upload(&send, recv)?;
                }
                self.run_once(dev.as_ref(), &send, recv, in_place, count)?;
                if let Some(d) = dev.as_mut() {
                    d.download(recv)?;
                }
                wrong[0] = self.wrong(recv, in_place, cin);
                self.comm.all_reduce(&mut wrong, ReduceOp::Sum)?;
            }
            let size_bytes = total * s;
            let algbw = size_bytes as f64 / 1e9 / secs[0];
            let busbw = algbw * bus_factor(self.cli.collective, n);
            results[slot] = (secs[0] * 1e6, algbw, busbw, wrong[0]);
        }
        let algorithm = match self.compressed(total * s) {
            Some((compressed, _)) => compressed,
            None => self.comm.algorithm_for(self.kind(), total * s, &self.opts),
        };
        let path = dev.map(|_| device::route(&self.comm, self.kind()));
        Ok(Some(Row { bytes: total * s, count, algorithm, path, results }))
    }
}

fn main() {
    let cli = Cli::parse();
    match run(cli) {
        Ok(0) => {}
        Ok(wrong) => {
            eprintln!("toroid-bench: {wrong} wrong values");
            std::process::exit(1);
        }
        Err(e) => {
            eprintln!("toroid-bench: {e}");
            std::process::exit(2);
        }
    }
}

fn run(cli: Cli) -> toroid::Result<u64> {
    let dtype: DataType = cli.datatype.parse()?;
    let op: ReduceOp = cli.op.parse()?;
    let algorithm = match &cli.algorithm {
        Some(a) => Some(
            Algorithm::parse(a)
                .ok_or_else(|| toroid::Error::InvalidArgument(format!("unknown algorithm '{a}'").into()))?,
        ),
        None => None,
    };
    if cli.device.is_some() && (cli.setup || cli.calls.is_some()) {
        return Err(toroid::Error::InvalidArgument(
            "--device runs the size sweep only (not --setup or --calls)".into(),
        ));
    }
    if cli.device.is_some() && (cli.algorithm.is_some() || cli.timeout.is_some()) {
        return Err(toroid::Error::InvalidArgument(
            "--device takes neither -a nor -T: device memory takes its own path (the last column) under TOROID_TIMEOUT"
                .into(),
        ));
    }
    let started = Instant::now();
    let started_unix = unix_ms();
    let comm = Communicator::from_env()?;
    let setup_cpu = cpu_ms();
    let opts = CallOptions { timeout: cli.timeout.map(Duration::from_secs_f64), algorithm, wire: None };
    if cli.setup {
        return setup_report(&comm, started_unix, started.elapsed(), setup_cpu, cli.min_bytes, opts);
    }
    let n = comm.size();
    let bench = Bench { comm, cli, dtype, op, opts };
    if let Some(k) = bench.cli.calls {
        return bench.step_of_calls(k);
    }
    let cli = &bench.cli;
    let rooted = matches!(cli.collective, Collective::Broadcast | Collective::Reduce);
    let root_col = if rooted { cli.root.to_string() } else { "-1".into() };
    let redop =
        if matches!(cli.collective, Collective::AllReduce | Collective::ReduceScatter | Collective::Reduce) {
            op.name()
        } else {
            "none"
        };
    let me = bench.comm.rank();
    let mut out = std::io::stdout().lock();
    let mut p = |s: String| {
        if me == 0 {
            let _ = writeln!(out, "{s}");
            let _ = out.flush();
        }
    };
    p(format!("# toroid-bench {} ({:?})", env!("CARGO_PKG_VERSION"), cli.collective));
    p(format!(
        "# nRanks {n} minBytes {} maxBytes {} step: {} warmup iters: {} iters: {} validation: {}",
        cli.min_bytes,
        cli.max_bytes,
        cli.step_bytes.map_or(format!("{}(factor)", cli.step_factor), |b| format!("{b}(bytes)")),
        cli.warmup,
        cli.iters,
        cli.check
    ));
    let (model, shape) = bench.comm.cost_model();
    p(format!("# cost model: {model}; {} hosts, grid {}x{}", shape.hosts, shape.grid.0, shape.grid.1));
    if let Some(ordinal) = cli.device {
        p(format!(
            "# buffers in memory of CUDA device {ordinal}, through the stream entry points (blocking)"
        ));
    }
    // This rank's links by kind ("tcp-striped" where TOROID_NSOCKS or the link chose lanes).
    let mut kinds: Vec<(&str, usize)> = Vec::new();
    for peer in (0..n).filter(|&p| p != me) {
        let k = bench.comm.transport_to(peer).unwrap_or("none");
        match kinds.iter_mut().find(|(name, _)| *name == k) {
            Some((_, c)) => *c += 1,
            None => kinds.push((k, 1)),
        }
    }
    let links: Vec<String> = kinds.iter().map(|(k, c)| format!("{k} to {c}")).collect();
    p(format!("# links of rank {me}: {}", if links.is_empty() { "none".into() } else { links.join(", ") }));
    p("#".into());
    p(format!("#  Rank {me:>2} Pid {:>7} on {}", std::process::id(), hostname()));
    p("#".into());
    p(format!("#{:>60}{:>35}", "out-of-place", "in-place"));
    p(format!(
        "#{:>11}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}  {}",
        "size",
        "count",
        "type",
        "redop",
        "root",
        "time",
        "algbw",
        "busbw",
        "#wrong",
        "time",
        "algbw",
        "busbw",
        "#wrong",
        "algorithm"
    ));
    p(format!(
        "#{:>11}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}",
        "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", ""
    ));
    let mut rows = Vec::new();
    let mut bytes = cli.min_bytes.max(dtype.size());
    let mut total_wrong = 0u64;
    let (mut bw_sum, mut bw_count) = (0.0, 0usize);
    while bytes <= cli.max_bytes {
        if let Some(row) = bench.measure(bytes)? {
            let mut line = format!(
                "{:>12}  {:>12}  {:>8}  {:>6}  {:>6}",
                row.bytes,
                row.count,
                dtype.name(),
                redop,
                root_col
            );
            for (t, alg, bus, wrong) in row.results {
                let wrong_s = if cli.check != 0 { wrong.to_string() } else { "N/A".into() };
                line.push_str(&format!(
                    "  {:>7}  {:>6}  {:>6}  {:>6}",
                    fit(t, 7),
                    fit(alg, 6),
                    fit(bus, 6),
                    wrong_s
                ));
                total_wrong += wrong;
                bw_sum += bus;
                bw_count += 1;
            }
            line.push_str(&format!("  {}", row.algorithm_name()));
            if cli.predict && row.path.is_none() {
                let t = bench.predict(row.algorithm, row.bytes);
                line.push_str(&format!("  {:>9}", fit(t * 1e6, 9)));
            }
            p(line);
            rows.push(row);
        }
        let next = match cli.step_bytes {
            Some(step) => bytes + step.max(1),
            None => bytes * cli.step_factor.max(2),
        };
        bytes = next;
    }
    p(format!("# Out of bounds values : {total_wrong} {}", if total_wrong == 0 { "OK" } else { "FAILED" }));
    p(format!("# Avg bus bandwidth    : {}", fit(bw_sum / bw_count.max(1) as f64, 8)));
    p("#".into());
    if cli.stats && me == 0 {
        p("# Statistics of rank 0 (every operation it ran, the benchmark's own included):".into());
        for line in bench.comm.stats().to_string().lines() {
            p(format!("# {line}"));
        }
        p("#".into());
    }
    if let (Some(path), 0) = (&cli.json, me) {
        let json = serde_json::json!({
            "collective": format!("{:?}", cli.collective),
            "ranks": n,
            "type": dtype.name(),
            "redop": redop,
            "root": if rooted { cli.root as i64 } else { -1 },
            "iters": cli.iters,
            "warmup": cli.warmup,
            "results": rows.iter().map(|r| serde_json::json!({
                "size": r.bytes,
                "count": r.count,
                "algorithm": r.algorithm_name(),
                "predicted_us": r.path.is_none().then(|| bench.predict(r.algorithm, r.bytes) * 1e6),
                "out_of_place": {"time_us": r.results[0].0, "algbw": r.results[0].1, "busbw": r.results[0].2, "wrong": r.results[0].3},
                "in_place": {"time_us": r.results[1].0, "algbw": r.results[1].1, "busbw": r.results[1].2, "wrong": r.results[1].3},
            })).collect::<Vec<_>>(),
        });
        std::fs::write(path, serde_json::to_string_pretty(&json).unwrap_or_default())
            .map_err(|e| toroid::Error::system(format!("writing {path}"), e))?;
    }
    Ok(total_wrong)
}

/// The benchmark's own timing all-reduces travel in their own type (f64), whatever
/// `TOROID_WIRE_DTYPE` does to the measured ones.
const EXACT: CallOptions = CallOptions { timeout: None, algorithm: None, wire: Some(DataType::F64) };

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|s| s.trim().to_string()).unwrap_or_default()
}
