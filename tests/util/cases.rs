//! The correctness matrix shared by the collective tests: cases, running one case, and
//! checking every element of the output against the independent reference in `data`.

use std::time::Instant;

use toroid::{Algorithm, CallOptions, Communicator, DataType, OpKind, ReduceOp};

use super::data::{Inputs, Val, decode, fill, matches};

#[derive(Debug, Clone, Copy)]
pub enum Coll {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast(usize),
    Reduce(usize),
    AllToAll,
    /// Blocks of 0..=count elements, a size of their own for each pair of ranks.
    AllToAllV,
}

/// The elements rank `from` sends rank `to` in all-to-all-v case `id` (0..=max).
pub fn v_count(id: u64, from: usize, to: usize, max: usize) -> usize {
    (super::data::mix(id << 20 ^ (from as u64) << 10 ^ to as u64) % (max as u64 + 1)) as usize
}

#[derive(Debug, Clone, Copy)]
pub struct Case {
    pub coll: Coll,
    pub dtype: DataType,
    pub op: ReduceOp,
    pub count: usize,
    pub in_place: bool,
    pub algo: Option<Algorithm>,
}

const GARBAGE: u8 = 0xA5;

/// Runs one case and checks every element of this rank's output.
pub fn check(comm: &Communicator, id: u64, c: &Case) -> Result<(), String> {
    let n = comm.size();
    let r = comm.rank();
    let d = c.dtype;
    let s = d.size();
    let opts = CallOptions { timeout: None, algorithm: c.algo, wire: None };
    let inputs = Inputs::new(id, n, d, c.op);
    let elem = |buf: &[u8], k: usize| decode(d, &buf[k * s..(k + 1) * s]);
    let mut bad = Vec::new();
    let mut expect = |what: &str, k: usize, got: Val, want: Val, tol: f64| {
        if !matches(got, want, tol) && bad.len() < 5 {
            bad.push(format!("{what}[{k}] = {got:?}, expected {want:?} (tol {tol:e})"));
        }
    };
    let run = |kind: OpKind, send: Option<&[u8]>, recv: Option<&mut [u8]>| {
        comm.run_bytes(kind, d, send, recv, opts).map_err(|e| format!("rank {r}: {c:?}: {e}"))
    };
    match c.coll {
        Coll::AllReduce => {
            let mut inp = vec![0u8; c.count * s];
            fill(&mut inp, id, r, 0, d, c.op);
            let out = if c.in_place {
                run(OpKind::AllReduce(c.op), None, Some(&mut inp))?;
                inp
            } else {
                let mut out = vec![GARBAGE; c.count * s];
                run(OpKind::AllReduce(c.op), Some(&inp), Some(&mut out))?;
                out
            };
            inputs.check_reduced(0, &out, &mut bad);
        }
        Coll::ReduceScatter => {
            let mut inp = vec![0u8; n * c.count * s];
            fill(&mut inp, id, r, 0, d, c.op);
            let (out, base) = if c.in_place {
                run(OpKind::ReduceScatter(c.op), None, Some(&mut inp))?;
                (inp, r * c.count)
            } else {
                let mut out = vec![GARBAGE; c.count * s];
                run(OpKind::ReduceScatter(c.op), Some(&inp), Some(&mut out))?;
                (out, 0)
            };
            inputs.check_reduced(r * c.count, &out[base * s..(base + c.count) * s], &mut bad);
        }
        Coll::AllGather => {
            let mut mine = vec![0u8; c.count * s];
            fill(&mut mine, id, r, 0, d, c.op);
            let mut out = vec![GARBAGE; n * c.count * s];
            if c.in_place {
                out[r * c.count * s..(r + 1) * c.count * s].copy_from_slice(&mine);
                run(OpKind::AllGather, None, Some(&mut out))?;
            } else {
                run(OpKind::AllGather, Some(&mine), Some(&mut out))?;
            }
            for j in 0..n {
                for k in 0..c.count {
                    expect("out", j * c.count + k, elem(&out, j * c.count + k), inputs.of(j, k), 0.0);
                }
            }
        }
        Coll::Broadcast(root) => {
            let mut inp = vec![GARBAGE; c.count * s];
            if r == root {
                fill(&mut inp, id, r, 0, d, c.op);
            }
            let out = if c.in_place {
                run(OpKind::Broadcast(root), None, Some(&mut inp))?;
                inp
            } else {
                let mut out = vec![GARBAGE ^ 0xFF; c.count * s];
                run(OpKind::Broadcast(root), Some(&inp), Some(&mut out))?;
                out
            };
            for k in 0..c.count {
                expect("out", k, elem(&out, k), inputs.of(root, k), 0.0);
            }
        }
        Coll::Reduce(root) => {
            let mut inp = vec![0u8; c.count * s];
            fill(&mut inp, id, r, 0, d, c.op);
            let original = inp.clone();
            let mut out = vec![GARBAGE; c.count * s];
            if c.in_place {
                run(OpKind::Reduce(c.op, root), None, Some(&mut inp))?;
            } else {
                run(OpKind::Reduce(c.op, root), Some(&inp), Some(&mut out))?;
            }
            let result = if c.in_place { &inp } else { &out };
            if r == root {
                inputs.check_reduced(0, result, &mut bad);
            } else if inp != original || (!c.in_place && out.iter().any(|b| *b != GARBAGE)) {
                bad.push("a non-root rank's buffers were modified".to_string());
            }
        }
        Coll::AllToAll => {
            let mut inp = vec![0u8; n * c.count * s];
            fill(&mut inp, id, r, 0, d, c.op);
            let out = if c.in_place {
                run(OpKind::AllToAll, None, Some(&mut inp))?;
                inp
            } else {
                let mut out = vec![GARBAGE; n * c.count * s];
                run(OpKind::AllToAll, Some(&inp), Some(&mut out))?;
                out
            };
            for j in 0..n {
                for k in 0..c.count {
                    let idx = j * c.count + k;
                    expect("out", idx, elem(&out, idx), inputs.of(j, r * c.count + k), 0.0);
                }
            }
        }
        Coll::AllToAllV => {
            // Block j of rank i's input starts after its blocks for the ranks below j.
            let before =
                |from: usize, to: usize| (0..to).map(|t| v_count(id, from, t, c.count)).sum::<usize>();
            let sends: Vec<usize> = (0..n).map(|j| v_count(id, r, j, c.count)).collect();
            let recvs: Vec<usize> = (0..n).map(|j| v_count(id, j, r, c.count)).collect();
            let mut inp = vec![0u8; sends.iter().sum::<usize>() * s];
            fill(&mut inp, id, r, 0, d, c.op);
            let mut out = vec![GARBAGE; recvs.iter().sum::<usize>() * s];
            comm.all_to_all_v_bytes(d, &inp, &sends, &mut out, &recvs)
                .map_err(|e| format!("rank {r}: {c:?}: {e}"))?;
            let mut at = 0;
            for (j, &len) in recvs.iter().enumerate() {
                for k in 0..len {
                    expect("out", at + k, elem(&out, at + k), inputs.of(j, before(j, r) + k), 0.0);
                }
                at += len;
            }
        }
    }
    if bad.is_empty() { Ok(()) } else { Err(format!("rank {r}: {c:?}: {}", bad.join("; "))) }
}

const FLOATS: [DataType; 4] = [DataType::F32, DataType::F64, DataType::BF16, DataType::F16];
pub const ALL_TYPES: [DataType; 10] = [
    DataType::F32,
    DataType::F64,
    DataType::BF16,
    DataType::F16,
    DataType::I32,
    DataType::I64,
    DataType::I8,
    DataType::U8,
    DataType::U32,
    DataType::U64,
];

pub fn ops_for(d: DataType) -> Vec<ReduceOp> {
    ReduceOp::ALL.iter().copied().filter(|o| *o != ReduceOp::Avg || d.is_float()).collect()
}

/// The whole matrix for `n` ranks. `large` adds the 1<<20 cases; `window` (every rank on one
/// host with the shared window) adds `shm_direct` forced where it applies.
pub fn cases(n: usize, large: bool, window: bool) -> Vec<Case> {
    let mut v = Vec::new();
    let both = [false, true];
    let roots = if n > 1 { vec![0, n - 1] } else { vec![0] };
    let mut push =
        |coll, dtype, op, count, in_place, algo| v.push(Case { coll, dtype, op, count, in_place, algo });
    for count in [0usize, 1, 7, 4099] {
        for d in ALL_TYPES {
            for op in ops_for(d) {
                for ip in both {
                    for algo in [None, Some(Algorithm::Ring), Some(Algorithm::Doubling)] {
                        push(Coll::AllReduce, d, op, count, ip, algo);
                    }
                    if window {
                        push(Coll::AllReduce, d, op, count, ip, Some(Algorithm::ShmDirect));
                    }
                    push(Coll::ReduceScatter, d, op, count, ip, None);
                    push(Coll::ReduceScatter, d, op, count, ip, Some(Algorithm::Ring));
                    for &root in &roots {
                        for algo in [Algorithm::Chain, Algorithm::Tree] {
                            push(Coll::Reduce(root), d, op, count, ip, Some(algo));
                        }
                    }
                }
            }
        }
        for d in [DataType::F32, DataType::I64, DataType::U8, DataType::BF16] {
            for ip in both {
                push(Coll::AllGather, d, ReduceOp::Sum, count, ip, None);
                push(Coll::AllGather, d, ReduceOp::Sum, count, ip, Some(Algorithm::Ring));
                push(Coll::AllToAll, d, ReduceOp::Sum, count, ip, None);
                if !ip {
                    push(Coll::AllToAllV, d, ReduceOp::Sum, count, ip, None);
                }
                for &root in &roots {
                    for algo in [Algorithm::Chain, Algorithm::Tree] {
                        push(Coll::Broadcast(root), d, ReduceOp::Sum, count, ip, Some(algo));
                    }
                    if window {
                        push(Coll::Broadcast(root), d, ReduceOp::Sum, count, ip, Some(Algorithm::ShmDirect));
                    }
                }
            }
        }
    }
    if large {
        let m = 1 << 20;
        for ip in both {
            for op in ReduceOp::ALL {
                push(Coll::AllReduce, DataType::F32, op, m, ip, None);
            }
            push(Coll::AllReduce, DataType::F64, ReduceOp::Avg, m, ip, None);
            push(Coll::AllReduce, DataType::BF16, ReduceOp::Sum, m, ip, None);
            push(Coll::AllReduce, DataType::I32, ReduceOp::Prod, m, ip, None);
            push(Coll::AllReduce, DataType::I64, ReduceOp::Sum, m, ip, None);
            push(Coll::ReduceScatter, DataType::F32, ReduceOp::Sum, m, ip, None);
            push(Coll::ReduceScatter, DataType::F32, ReduceOp::Sum, m, ip, Some(Algorithm::Ring));
            push(Coll::AllGather, DataType::F32, ReduceOp::Sum, m, ip, None);
            push(Coll::AllGather, DataType::F32, ReduceOp::Sum, m, ip, Some(Algorithm::Ring));
            push(Coll::AllReduce, DataType::F32, ReduceOp::Avg, m, ip, Some(Algorithm::Ring));
            push(Coll::AllToAll, DataType::I32, ReduceOp::Sum, m, ip, None);
            if !ip {
                push(Coll::AllToAllV, DataType::I32, ReduceOp::Sum, m, ip, None);
            }
            push(Coll::Broadcast(n / 2), DataType::F32, ReduceOp::Sum, m, ip, Some(Algorithm::Chain));
            push(Coll::Reduce(n / 2), DataType::F32, ReduceOp::Sum, m, ip, Some(Algorithm::Chain));
        }
        push(Coll::AllReduce, DataType::F16, ReduceOp::Sum, m, true, None);
        push(Coll::AllReduce, DataType::BF16, ReduceOp::Max, m, false, None);
        push(Coll::AllReduce, DataType::I64, ReduceOp::Min, m, false, None);
        push(Coll::AllReduce, DataType::F32, ReduceOp::Sum, m, true, Some(Algorithm::Doubling));
        push(Coll::ReduceScatter, DataType::I64, ReduceOp::Max, m, false, None);
        push(Coll::ReduceScatter, DataType::BF16, ReduceOp::Avg, m, false, None);
        push(Coll::Broadcast(0), DataType::I64, ReduceOp::Sum, m, false, Some(Algorithm::Tree));
        push(Coll::Reduce(0), DataType::I64, ReduceOp::Max, m, true, Some(Algorithm::Tree));
        push(Coll::Reduce(n - 1), DataType::F64, ReduceOp::Avg, m, false, Some(Algorithm::Chain));
    }
    let _ = FLOATS;
    v
}

/// Runs the matrix on one communicator; stops at the first failed call (the communicator is
/// aborted after it) but collects value mismatches.
pub fn run_matrix(comm: &Communicator, large: bool) -> Vec<String> {
    let mut failures = Vec::new();
    let t = Instant::now();
    let all = cases(comm.size(), large, comm.has_shared_window());
    for (id, c) in all.iter().enumerate() {
        if let Err(e) = check(comm, id as u64 + 1, c) {
            let fatal = comm.is_aborted();
            failures.push(e);
            if fatal {
                break;
            }
        }
    }
    if comm.rank() == 0 {
        println!("{} ranks: {} cases in {:.2?}", comm.size(), all.len(), t.elapsed());
    }
    failures
}
