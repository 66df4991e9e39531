//! Point-to-point bandwidth of the shared-memory transport next to this machine's `memcpy`,
//! measured in the same run.
//!
//! - `memcpy/<size>`: one thread copies `size` bytes between two buffers (the bound of any
//!   transport that copies into shared memory and out again is about half of this).
//! - `shm_copy/<size>`: a sender thread streams `size` bytes through a shared-memory ring pair
//!   (the transport's `try_write`, in 512 KiB frames as the engine sends them) and the receiver
//!   copies them out with `try_read`: two copies per byte, on two cores.
//! - `shm_reduce/<size>`: the same stream, the receiver adds it to an `f32` buffer straight out
//!   of the ring (`read_with`, the engine's zero-copy path for reducing receives).
//!
//! Throughput counts payload bytes moved from sender to receiver (for `memcpy`, bytes copied).
//! Run with `cargo bench --bench transport`; `TOROID_SHM_RING_SIZE` is not read here, the ring is
//! the default 512 KiB per direction unless `TOROID_BENCH_RING` names another size.

use std::hint::black_box;
use std::io;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use toroid::internals::transport::Transport;
use toroid::internals::transport::shm::ShmTransport;
use toroid::{DataType, ReduceOp};

const SIZES: [(usize, &str); 4] =
    [(64 << 10, "64KiB"), (1 << 20, "1MiB"), (16 << 20, "16MiB"), (64 << 20, "64MiB")];
const FRAME: usize = 512 << 10;

fn ring() -> usize {
    std::env::var("TOROID_BENCH_RING")
        .ok()
        .and_then(|v| toroid::internals::config::parse_size("TOROID_BENCH_RING", &v).ok())
        .unwrap_or(toroid::internals::config::DEFAULT_SHM_RING_SIZE)
}

fn wait(t: &mut dyn Transport, read: bool) {
    if let Some(events) = t.arm(read, !read) {
        let mut pfd = libc::pollfd { fd: t.pollable(), events, revents: 0 };
        // SAFETY: one live pollfd.
        unsafe { libc::poll(&mut pfd, 1, 100) };
    }
}

fn send_all(t: &mut ShmTransport, data: &[u8]) {
    for frame in data.chunks(FRAME) {
        let mut off = 0;
        let mut idle = 0u32;
        while off < frame.len() {
            match t.try_write(&[&frame[off..]]) {
                Ok(n) => {
                    off += n;
                    idle = 0;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    idle += 1;
                    if idle > 2000 {
                        wait(t, false);
                    } else {
                        std::hint::spin_loop();
                    }
                }
                Err(e) => panic!("{e}"),
            }
        }
    }
}

enum Mode {
    Copy,
    Reduce,
}

fn recv_all(t: &mut ShmTransport, dst: &mut [u8], mode: &Mode) {
    let mut got = 0;
    let mut idle = 0u32;
    while got < dst.len() {
        let r = match mode {
            Mode::Copy => t.try_read(&mut [&mut dst[got..]]),
            Mode::Reduce => {
                let mut at = got;
                let end = dst.len();
                t.read_with(end - got, &mut |s: &[u8]| {
                    let take = if at + s.len() == end { s.len() } else { s.len() - s.len() % 4 };
                    toroid::internals::reduce::reduce_inplace(
                        DataType::F32,
                        ReduceOp::Sum,
                        &mut dst[at..at + take],
                        &s[..take],
                    );
                    at += take;
                    take
                })
            }
        };
        match r {
            Ok(0) => panic!("sender closed"),
            Ok(n) => {
                got += n;
                idle = 0;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                idle += 1;
                if idle > 2000 {
                    wait(t, true);
                } else {
                    std::hint::spin_loop();
                }
            }
            Err(e) => panic!("{e}"),
        }
    }
}

fn bench(c: &mut Criterion) {
    let dir = std::path::PathBuf::from(toroid::internals::config::DEFAULT_SHM_DIR);
    let mut g = c.benchmark_group("p2p");
    g.sample_size(10).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(2));
    for &(size, label) in &SIZES {
        g.throughput(Throughput::Bytes(size as u64));
        let src: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
        let mut dst = vec![0u8; size];
        g.bench_function(BenchmarkId::new("memcpy", label), |b| {
            b.iter(|| {
                dst.copy_from_slice(black_box(&src));
                black_box(&dst);
            })
        });
        for (name, mode) in [("shm_copy", Mode::Copy), ("shm_reduce", Mode::Reduce)] {
            let (mut tx, mut rx) = ShmTransport::pair(&dir, ring()).expect("shared-memory pair");
            let (go_tx, go_rx) = mpsc::channel::<u64>();
            let data: Vec<u8> = (0..size / 4).flat_map(|i| ((i % 7) as f32 * 0.25).to_le_bytes()).collect();
            let sender = thread::spawn(move || {
                while let Ok(iters) = go_rx.recv() {
                    for _ in 0..iters {
                        send_all(&mut tx, &data);
                    }
                }
            });
            let mut out = vec![0u8; size];
            g.bench_function(BenchmarkId::new(name, label), |b| {
                b.iter_custom(|iters| {
                    out.fill(0);
                    let t = Instant::now();
                    go_tx.send(iters).expect("sender alive");
                    for _ in 0..iters {
                        recv_all(&mut rx, &mut out, &mode);
                    }
                    t.elapsed()
                })
            });
            drop(go_tx);
            sender.join().expect("sender thread");
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
