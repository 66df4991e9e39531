//! Compressed all-reduce (`TOROID_WIRE_DTYPE`, `CallOptions::wire`; `src/comm/compressed.rs`): on
//! random data, every element of every rank's result is within the documented bound of the
//! exact reduction (2u S + u^2 S for a sum, S the sum of magnitudes; /n for an average; u |x|
//! for min and max), and every rank holds the same bits; the operation travels as an all-to-all
//! and an all-gather in the wire type; a call can opt in or out. As threads on 1, 2, 3 and 5
//! ranks, and as processes over TCP. With several ranks on each of several (emulated) hosts it
//! runs as the 2D torus, compressed between hosts only, within the same bound.

mod util;

use toroid::internals::collective::CollKind;
use toroid::{CallOptions, Communicator, Config, DataType, OpKind, ReduceOp};
use util::data::mix;

/// A random value of either sign, magnitude between 2^-scale and 2^scale.
fn val(seed: u64, rank: usize, i: usize, scale: i32) -> f64 {
    let h = mix(seed ^ ((rank as u64) << 48) ^ i as u64);
    let m = 1.0 + (h & 0xffff_ffff) as f64 / 4294967296.0; // [1, 2)
    let e = ((h >> 32) % (2 * scale as u64 + 1)) as i32 - scale;
    let s = if (h >> 63) == 1 { -1.0 } else { 1.0 };
    s * m * 2f64.powi(e)
}

fn unit_roundoff(wire: DataType) -> f64 {
    if wire == DataType::F16 { 2f64.powi(-11) } else { 2f64.powi(-8) }
}

fn count_of(comm: &Communicator, kind: CollKind) -> u64 {
    comm.stats().cells().iter().filter(|c| c.kind == kind).map(|c| c.count).sum()
}

/// Runs one all-reduce of `count` random elements of `dtype` (f32 or f64) with `opts` and
/// checks every element against the bound for `wire` (None: exact); returns the result's bits
/// hashed.
fn check_one(
    comm: &Communicator,
    seed: u64,
    dtype: DataType,
    count: usize,
    op: ReduceOp,
    opts: CallOptions,
    wire: Option<DataType>,
) -> u64 {
    let (n, me) = (comm.size(), comm.rank());
    let scale = if wire == Some(DataType::F16) { 5 } else { 20 };
    let value = |r: usize, i: usize| -> f64 {
        let v = val(seed, r, i, scale);
        if dtype == DataType::F32 { v as f32 as f64 } else { v }
    };
    let es = dtype.size();
    let mut buf = vec![0u8; count * es];
    for i in 0..count {
        let v = value(me, i);
        match dtype {
            DataType::F32 => buf[i * 4..i * 4 + 4].copy_from_slice(&(v as f32).to_le_bytes()),
            _ => buf[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes()),
        }
    }
    comm.run_bytes(OpKind::AllReduce(op), dtype, None, Some(&mut buf), opts).expect("all_reduce");
    let u = wire.map_or(0.0, unit_roundoff);
    let mut hash = 0xcbf29ce484222325u64;
    for i in 0..count {
        let got = match dtype {
            DataType::F32 => f32::from_le_bytes(buf[i * 4..i * 4 + 4].try_into().unwrap()) as f64,
            _ => f64::from_le_bytes(buf[i * 8..i * 8 + 8].try_into().unwrap()),
        };
        hash = mix(hash ^ got.to_bits());
        let xs: Vec<f64> = (0..n).map(|r| value(r, i)).collect();
        let mag: f64 = xs.iter().map(|x| x.abs()).sum();
        let (exact, bound) = match op {
            ReduceOp::Sum => (xs.iter().sum::<f64>(), (2.0 * u + u * u) * mag),
            ReduceOp::Avg => (xs.iter().sum::<f64>() / n as f64, (2.0 * u + u * u) * mag / n as f64),
            ReduceOp::Max => {
                let m = xs.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                (m, u * m.abs())
            }
            ReduceOp::Min => {
                let m = xs.iter().cloned().fold(f64::INFINITY, f64::min);
                (m, u * m.abs())
            }
            ReduceOp::Prod => unreachable!("not tested here"),
        };
        // The uncompressed f32 path and the f64 sum add their own (much smaller) rounding.
        let slack = if dtype == DataType::F32 { 2f64.powi(-22) * n as f64 * mag } else { 1e-13 * mag };
        assert!(
            (got - exact).abs() <= bound + slack,
            "rank {me}: {dtype} {op:?} over {wire:?}, {count} elements: element {i} is {got}, exact {exact}, \
             error {} above the bound {bound}",
            (got - exact).abs()
        );
    }
    hash
}

/// Every rank's hash, gathered (an ordinary all-gather of u64).
fn same_everywhere(comm: &Communicator, h: u64, what: &str) {
    let mut all = vec![0u64; comm.size()];
    all[comm.rank()] = h;
    comm.all_gather_in_place(&mut all).expect("all_gather");
    assert!(
        all.iter().all(|x| *x == h),
        "rank {}: {what}: results differ across ranks: {all:x?}",
        comm.rank()
    );
}

fn bf16_world(comm: Communicator) {
    let mut seed = 1;
    let n = comm.size();
    for dtype in [DataType::F32, DataType::F64] {
        for count in [0, 1, 7, 1000, 100_003] {
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
                seed += 1;
                let (a2a, ag, ar) = (
                    count_of(&comm, CollKind::AllToAll),
                    count_of(&comm, CollKind::AllGather),
                    count_of(&comm, CollKind::AllReduce),
                );
                let wire = (n > 1).then_some(DataType::BF16);
                let h = check_one(&comm, seed, dtype, count, op, CallOptions::default(), wire);
                if n > 1 {
                    let now = (
                        count_of(&comm, CollKind::AllToAll),
                        count_of(&comm, CollKind::AllGather),
                        count_of(&comm, CollKind::AllReduce),
                    );
                    assert_eq!(
                        now,
                        (a2a + 1, ag + 1, ar),
                        "a compressed all-reduce is an all-to-all and an all-gather"
                    );
                }
                same_everywhere(&comm, h, &format!("{dtype} {op:?} {count}"));
            }
        }
    }
    // A call can opt out (its own type on the wire: exact up to the ordinary rounding).
    let own = CallOptions { wire: Some(DataType::F64), ..CallOptions::default() };
    let h = check_one(&comm, 999, DataType::F64, 5000, ReduceOp::Sum, own, None);
    same_everywhere(&comm, h, "opted out");
    // An integer wire type is refused.
    let bad = CallOptions { wire: Some(DataType::I32), ..CallOptions::default() };
    let mut x = vec![1f32; 4];
    let e = comm.run_bytes(
        OpKind::AllReduce(ReduceOp::Sum),
        DataType::F32,
        None,
        Some(bytemuck::cast_slice_mut(&mut x)),
        bad,
    );
    assert!(matches!(e, Err(toroid::Error::InvalidArgument(_))), "{e:?}");
}

#[test]
fn bf16_wire_is_within_the_bound_and_identical_on_every_rank() {
    if util::is_child() {
        return;
    }
    for n in [1, 2, 3, 5] {
        let cfg = Config { wire: Some(DataType::BF16), ..util::test_config(60.0) };
        util::run_threads(n, &cfg, bf16_world);
    }
}

#[test]
fn the_probe_agrees_its_link_costs_exactly_under_an_f16_wire() {
    if util::is_child() {
        return;
    }
    // The ranks agree the probe's measurements (microseconds, nanoseconds per byte) by an
    // all-reduce of f64 maxima: in f16 they would flush to zero and the model fall back to its
    // defaults for every link.
    let cfg = Config { wire: Some(DataType::F16), ..util::test_config(60.0) };
    util::run_threads(2, &cfg, |comm| {
        let (m, _) = comm.cost_model();
        let d = toroid::internals::tuning::CostModel::default();
        assert_eq!(m.source, "probe");
        assert!(
            m.intra != d.intra && m.gamma != d.gamma,
            "rank {}: the probe's costs were lost: {m}",
            comm.rank()
        );
        assert!(m.intra.beta > 1e-12 && m.gamma > 1e-12, "{m}");
    });
}

/// All-reduces that ran as the 2D torus.
fn torus_count(comm: &Communicator) -> u64 {
    let torus = toroid::Algorithm::Torus2d as u8;
    comm.stats()
        .cells()
        .iter()
        .filter(|c| c.kind == CollKind::AllReduce && c.algo == torus)
        .map(|c| c.count)
        .sum()
}

#[test]
fn several_ranks_per_host_compress_only_between_hosts() {
    if util::is_child() {
        return;
    }
    // 3 emulated hosts of 2 ranks (a 2 x 3 torus), bf16 for every call; then 2 hosts of 2, f16
    // asked per call. Each all-reduce runs as the 2D torus with the column phase compressed:
    // within the bound on every element, the same bits on every rank, no all-to-all.
    // Then pipelined in 4 KiB chunks (`TOROID_PIPELINE_CHUNK`): 65,537 elements in 8 chunks,
    // each chunk's column phase compressed while the row reduces the next one.
    let default = toroid::Config::default().pipeline_chunk;
    let layouts = [
        (6, 2, DataType::BF16, default),
        (4, 2, DataType::F16, default),
        (6, 2, DataType::BF16, Some(4096)),
        (8, 2, DataType::F16, Some(4096)),
    ];
    for (n, per_host, wire, pipeline_chunk) in layouts {
        let cfg_of = move |r: usize| Config {
            host_id: Some(format!("host{}", r / per_host)),
            wire: (wire == DataType::BF16).then_some(wire),
            pipeline_chunk,
            ..util::test_config(60.0)
        };
        util::run_threads_with(n, cfg_of, move |comm| {
            let opts = CallOptions { wire: Some(wire), ..CallOptions::default() };
            let mut seed = 300;
            for dtype in [DataType::F32, DataType::F64] {
                for count in [1, 5, 1000, 65_537] {
                    for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
                        seed += 1;
                        let (a2a, torus) = (count_of(&comm, CollKind::AllToAll), torus_count(&comm));
                        let h = check_one(&comm, seed, dtype, count, op, opts, Some(wire));
                        assert_eq!(count_of(&comm, CollKind::AllToAll), a2a, "no all-to-all on a torus");
                        assert_eq!(torus_count(&comm), torus + 1, "{n} ranks: not the 2D torus");
                        same_everywhere(&comm, h, &format!("torus {wire} {dtype} {op:?} {count}"));
                    }
                }
                // Compressed for real: the same data in its own type gives other bits.
                let own = CallOptions { wire: Some(dtype), ..CallOptions::default() };
                let narrow = check_one(&comm, 7, dtype, 65_537, ReduceOp::Sum, opts, Some(wire));
                let exact = check_one(&comm, 7, dtype, 65_537, ReduceOp::Sum, own, None);
                assert_ne!(narrow, exact, "{wire} {dtype}: the torus did not round");
            }
        });
    }
}

#[test]
fn a_call_opts_into_f16_on_an_uncompressed_communicator() {
    if util::is_child() {
        return;
    }
    util::run_threads(3, &util::test_config(60.0), |comm| {
        let f16 = CallOptions { wire: Some(DataType::F16), ..CallOptions::default() };
        for (k, op) in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max].into_iter().enumerate() {
            for dtype in [DataType::F32, DataType::F64] {
                let h = check_one(&comm, 50 + k as u64, dtype, 20_001, op, f16, Some(DataType::F16));
                same_everywhere(&comm, h, &format!("f16 {dtype} {op:?}"));
            }
        }
    });
}

#[test]
fn bf16_wire_in_processes_over_tcp() {
    if util::is_child() {
        let comm = Communicator::from_env().expect("communicator from toroid-run's environment");
        let h = check_one(
            &comm,
            7,
            DataType::F32,
            1 << 20,
            ReduceOp::Sum,
            CallOptions::default(),
            Some(DataType::BF16),
        );
        same_everywhere(&comm, h, "processes");
        println!("wire passed");
        return;
    }
    let env = [("TOROID_SHM_DISABLE", "1"), ("TOROID_WIRE_DTYPE", "bf16"), ("TOROID_TIMEOUT", "60")];
    let out = util::launch("bf16_wire_in_processes_over_tcp", 3, &env, 300);
    util::assert_success(&out, "3 ranks over TCP with TOROID_WIRE_DTYPE=bf16");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout.lines().filter(|l| l.contains("wire passed")).count(), 3, "{stdout}");
}
