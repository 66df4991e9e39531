//! Throughput of the CPU reduction kernels against a `memcpy` of the same size.
//!
//! Sizes are per buffer: 64 KiB (all buffers in L2), 1 MiB (L2/L3) and 64 MiB (DRAM). The
//! throughput counts the bytes the kernel must move: `reduce_into` and `reduce_inplace` read
//! two buffers and write one (3 × size), `memcpy` reads one and writes one (2 × size). Cache
//! write-allocate traffic is not counted, so at 64 MiB the memory bus carries more than shown.
//!
//! Measurement is kept short (the whole run takes about a minute): `cargo bench --bench
//! reduce_kernels`, or add a filter such as `-- 'reduce_into/f32'`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use toroid::internals::reduce::{reduce_inplace, reduce_into};
use toroid::{DataType, ReduceOp};

const SIZES: [(usize, &str); 3] = [(64 << 10, "64KiB"), (1 << 20, "1MiB"), (64 << 20, "64MiB")];

const CASES: [(DataType, ReduceOp); 6] = [
    (DataType::F32, ReduceOp::Sum),
    (DataType::F64, ReduceOp::Sum),
    (DataType::BF16, ReduceOp::Sum),
    (DataType::F16, ReduceOp::Sum),
    (DataType::I32, ReduceOp::Sum),
    (DataType::F32, ReduceOp::Max),
];

/// `bytes` of small multiples of 1/4: no subnormal ever appears, even after many in-place sums
/// (they would take a slow microcode path on some CPUs and measure something else).
fn buffer(dtype: DataType, bytes: usize, seed: usize) -> Vec<u8> {
    let n = bytes / dtype.size();
    let v = |i: usize| ((i * 7 + seed) % 13) as f32 * 0.25 - 1.5;
    match dtype {
        DataType::F32 => (0..n).flat_map(|i| v(i).to_le_bytes()).collect(),
        DataType::F64 => (0..n).flat_map(|i| (v(i) as f64).to_le_bytes()).collect(),
        DataType::F16 => (0..n).flat_map(|i| half::f16::from_f32(v(i)).to_le_bytes()).collect(),
        DataType::BF16 => (0..n).flat_map(|i| half::bf16::from_f32(v(i)).to_le_bytes()).collect(),
        DataType::I32 => (0..n).flat_map(|i| ((v(i) * 4.0) as i32).to_le_bytes()).collect(),
        _ => unreachable!("not benchmarked"),
    }
}

fn kernels(c: &mut Criterion) {
    let mut g = c.benchmark_group("memcpy");
    for (size, label) in SIZES {
        let src = vec![1u8; size];
        let mut dst = vec![0u8; size];
        g.throughput(Throughput::Bytes(2 * size as u64));
        g.bench_function(BenchmarkId::from_parameter(label), |b| {
            b.iter(|| black_box(&mut dst).copy_from_slice(black_box(&src)))
        });
    }
    g.finish();

    for (dtype, op) in CASES {
        let name = format!("{}_{}", dtype.name(), op.name());
        let mut g = c.benchmark_group(format!("reduce_into/{name}"));
        for (size, label) in SIZES {
            let (a, b_, mut dst) = (buffer(dtype, size, 1), buffer(dtype, size, 2), vec![0; size]);
            g.throughput(Throughput::Bytes(3 * size as u64));
            g.bench_function(BenchmarkId::from_parameter(label), |b| {
                b.iter(|| reduce_into(dtype, op, black_box(&mut dst), &a, &b_))
            });
        }
        g.finish();

        let mut g = c.benchmark_group(format!("reduce_inplace/{name}"));
        for (size, label) in SIZES {
            let (src, mut dst) = (buffer(dtype, size, 2), buffer(dtype, size, 3));
            g.throughput(Throughput::Bytes(3 * size as u64));
            g.bench_function(BenchmarkId::from_parameter(label), |b| {
                b.iter(|| reduce_inplace(dtype, op, black_box(&mut dst), &src))
            });
        }
        g.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .measurement_time(Duration::from_secs(1))
        .warm_up_time(Duration::from_millis(300))
        .sample_size(10)
        .nresamples(10_000);
    targets = kernels
}
criterion_main!(benches);
