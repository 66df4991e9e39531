//! Every all-reduce algorithm (ring, rd, hd, hring, torus2d) on every world size 1..=9, on one
//! host, on emulated hosts (even and uneven) and on forced grids, checked element by element.

mod util;

use toroid::{Algorithm, Communicator, Config, DataType, ReduceOp};
use util::cases::{Case, Coll, check};

const ALGOS: [Algorithm; 5] = [
    Algorithm::Ring,
    Algorithm::Doubling,
    Algorithm::HalvingDoubling,
    Algorithm::HierarchicalRing,
    Algorithm::Torus2d,
];

/// A few dtype/op/placement combinations per algorithm and count.
fn cases(large: bool) -> Vec<Case> {
    let mut v = Vec::new();
    let counts: &[usize] = if large { &[0, 1, 7, 4099, 1 << 20] } else { &[0, 1, 7, 4099] };
    for &count in counts {
        for algo in ALGOS {
            let mut push = |dtype, op, in_place| {
                v.push(Case { coll: Coll::AllReduce, dtype, op, count, in_place, algo: Some(algo) })
            };
            push(DataType::F32, ReduceOp::Sum, true);
            push(DataType::I64, ReduceOp::Max, false);
            if count < (1 << 20) {
                push(DataType::BF16, ReduceOp::Avg, true);
                push(DataType::F64, ReduceOp::Prod, false);
                push(DataType::U8, ReduceOp::Sum, true);
            }
        }
    }
    v
}

fn run_all(comm: &Communicator, large: bool) -> Vec<String> {
    let mut failures = Vec::new();
    for (id, c) in cases(large).iter().enumerate() {
        if let Err(e) = check(comm, 7_000 + id as u64, c) {
            failures.push(e);
            if comm.is_aborted() {
                break;
            }
        }
    }
    failures
}

/// Host of rank `r` of `n` on `h` emulated hosts: consecutive ranks share a host.
fn host(r: usize, n: usize, h: usize) -> String {
    format!("host{}", r * h / n)
}

fn config(host_id: Option<String>, shape: Option<(usize, usize)>) -> Config {
    Config { host_id, torus_shape: shape, ..util::test_config(60.0) }
}

#[test]
fn every_algorithm_on_every_layout_as_threads() {
    if util::is_child() {
        return;
    }
    for n in 1..=9usize {
        // One host, and every emulated host count (uneven splits included).
        for h in 1..=n.min(4) {
            util::run_threads_with(
                n,
                |r| config(Some(host(r, n, h)), None),
                move |comm| {
                    let t = comm.topology();
                    assert_eq!(t.hosts, h);
                    let f = run_all(&comm, false);
                    assert!(f.is_empty(), "{n} ranks on {h} hosts:\n{}", f.join("\n"));
                },
            );
        }
    }
    // Forced grids, including degenerate ones.
    for (x, y) in [(1, 4), (4, 1), (2, 2), (2, 3), (3, 2), (3, 3), (2, 4), (1, 7), (9, 1)] {
        let n = x * y;
        util::run_threads_with(
            n,
            |_| config(None, Some((x, y))),
            move |comm| {
                let f = run_all(&comm, false);
                assert!(f.is_empty(), "grid {x}x{y}:\n{}", f.join("\n"));
            },
        );
    }
}

#[test]
fn every_algorithm_on_emulated_hosts_in_processes() {
    if util::is_child() {
        let comm = Communicator::from_env().expect("communicator");
        let f = run_all(&comm, true);
        assert!(f.is_empty(), "{}", f.join("\n"));
        return;
    }
    // (ranks, hosts): uniform and uneven layouts, plus a forced grid.
    for (n, h, shape) in
        [(4, 2, None), (6, 3, None), (7, 3, None), (8, 4, None), (9, 3, Some("3x3")), (6, 1, Some("2x3"))]
    {
        let mut env = vec![("TOROID_TIMEOUT", "60")];
        if let Some(s) = shape {
            env.push(("TOROID_TORUS_SHAPE", s));
        }
        let out = util::launch_with(
            "every_algorithm_on_emulated_hosts_in_processes",
            n,
            &["--emulate-hosts", &h.to_string()],
            &env,
            600,
        );
        util::assert_success(&out, &format!("{n} ranks on {h} hosts"));
    }
}

/// The 2D torus pipelined in chunks (`TOROID_PIPELINE_CHUNK`, here 4 KiB so that small calls
/// split into 2 to 8 chunks, uneven ones included): the row phases of one chunk run beside the
/// column phases of another. Every element against the reference, in place and out of place,
/// on emulated hosts and forced grids (non-powers of two, more rows than columns and the
/// reverse).
#[test]
fn the_pipelined_torus_on_every_grid() {
    if util::is_child() {
        return;
    }
    let cases: Vec<Case> = [0, 1, 7, 2_049, 3_001, 40_000, 250_007]
        .into_iter()
        .flat_map(|count| {
            [
                (DataType::F32, ReduceOp::Sum, true),
                (DataType::F64, ReduceOp::Sum, false),
                (DataType::I64, ReduceOp::Max, false),
                (DataType::BF16, ReduceOp::Avg, true),
                (DataType::I32, ReduceOp::Prod, true),
            ]
            .map(|(dtype, op, in_place)| Case {
                coll: Coll::AllReduce,
                dtype,
                op,
                count,
                in_place,
                algo: Some(Algorithm::Torus2d),
            })
        })
        .collect();
    let cases = std::sync::Arc::new(cases);
    let run = |n: usize, cfg_of: &dyn Fn(usize) -> Config, what: String| {
        let cases = cases.clone();
        util::run_threads_with(
            n,
            |r| Config { pipeline_chunk: Some(4096), ..cfg_of(r) },
            move |comm| {
                let f: Vec<String> = cases
                    .iter()
                    .enumerate()
                    .filter_map(|(id, c)| check(&comm, 9_000 + id as u64, c).err())
                    .collect();
                assert!(f.is_empty(), "{what}:\n{}", f.join("\n"));
            },
        );
    };
    for (n, h) in [(4, 2), (6, 3), (6, 2), (8, 4), (9, 3)] {
        run(n, &|r| config(Some(host(r, n, h)), None), format!("{n} ranks on {h} hosts"));
    }
    for (x, y) in [(2, 2), (3, 2), (2, 3), (3, 3), (2, 5)] {
        run(x * y, &|_| config(None, Some((x, y))), format!("grid {x}x{y}"));
    }
}
