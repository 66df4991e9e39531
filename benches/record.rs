//! What encryption costs one core: the AES-128-GCM records of encrypted links
//! (`TOROID_ENCRYPT`, `src/transport/tcp/secure/record.rs`) sealed and opened back to back on
//! one thread, for records of 4 KiB (a small message) and 32 KiB (the largest, what large
//! messages are cut into). Throughput counts plaintext bytes.
//!
//! Run with `cargo bench --bench record`; `scripts/encryption-bench.sh` runs it beside the
//! links' own comparison.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use toroid::internals::transport::tcp::{Direction, MAX_PLAIN, MAX_RECORD, SECRET_LEN};

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("record");
    for (len, name) in [(4096usize, "4KiB"), (MAX_PLAIN, "32KiB")] {
        let plain = vec![0x5au8; len];
        let mut rec = vec![0u8; MAX_RECORD];
        g.throughput(Throughput::Bytes(len as u64));
        let mut tx = Direction::new(&[7; SECRET_LEN]).expect("keys");
        g.bench_with_input(BenchmarkId::new("seal", name), &len, |b, &len| {
            b.iter(|| black_box(tx.seal(&[&plain], len, &mut rec).expect("seal")))
        });
        // Opening needs the records in order: seal one, open it, and count both.
        let (mut tx, mut rx) = (
            Direction::new(&[9; SECRET_LEN]).expect("keys"),
            Direction::new(&[9; SECRET_LEN]).expect("keys"),
        );
        let mut out = vec![0u8; len];
        g.bench_with_input(BenchmarkId::new("seal+open", name), &len, |b, &len| {
            b.iter(|| {
                let n = tx.seal(&[&plain], len, &mut rec).expect("seal");
                assert!(rx.open_into(&rec[..n], &mut out).expect("open"), "a record failed to open");
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
