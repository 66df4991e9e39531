//! `--calls K`: many small all-reduces per step, one by one, grouped and as persistent
//! requests, against the cost model's prediction of each.

use std::time::Instant;

use toroid::{DataType, OpKind, ReduceOp};

use crate::{Bench, EXACT};

impl Bench {
    /// `--calls K`: K all-reduces of `-b` bytes of float per step, one by one and as one group
    /// (out of place, so a step can repeat without refilling), then as K persistent requests
    /// (in place); every element checked after each.
    pub(crate) fn step_of_calls(&self, k: usize) -> toroid::Result<u64> {
        let (c, cli) = (&self.comm, &self.cli);
        if self.dtype != DataType::F32 || self.op != ReduceOp::Sum {
            return Err(toroid::Error::InvalidArgument("--calls measures float sum all-reduces".into()));
        }
        let (n, me) = (c.size(), c.rank());
        let count = (cli.min_bytes / 4).max(1);
        let send: Vec<Vec<f32>> =
            (0..k).map(|j| (0..count).map(|i| ((me + j + i) % 7) as f32).collect()).collect();
        let mut recv = vec![vec![0f32; count]; k];
        let step = |grouped: bool, recv: &mut [Vec<f32>]| -> toroid::Result<()> {
            if grouped {
                let mut g = c.group();
                for (s, r) in send.iter().zip(recv.iter_mut()) {
                    g.all_reduce_into(s, r, ReduceOp::Sum);
                }
                g.run()
            } else {
                send.iter().zip(recv.iter_mut()).try_for_each(|(s, r)| c.all_reduce_into(s, r, ReduceOp::Sum))
            }
        };
        let mut us = [0f64; 3];
        let mut wrong = [0u64];
        for (slot, grouped) in [false, true].into_iter().enumerate() {
            for _ in 0..cli.warmup {
                step(grouped, &mut recv)?;
            }
            c.barrier()?;
            let t = Instant::now();
            for _ in 0..cli.iters.max(1) {
                step(grouped, &mut recv)?;
            }
            let mut secs = [t.elapsed().as_secs_f64() / cli.iters.max(1) as f64];
            c.all_reduce_with(&mut secs, ReduceOp::Avg, EXACT)?;
            us[slot] = secs[0] * 1e6;
            if cli.check != 0 {
                recv.iter_mut().for_each(|r| r.fill(-1.0));
                step(grouped, &mut recv)?;
                for (j, r) in recv.iter().enumerate() {
                    for (i, x) in r.iter().enumerate() {
                        let want: usize = (0..n).map(|q| (q + j + i) % 7).sum();
                        wrong[0] += u64::from(*x != want as f32);
                    }
                }
            }
        }
        // Persistent: K requests set up once (in place, so refilled before the check).
        let mut bufs = send.clone();
        let mut reqs = bufs
            .iter_mut()
            .map(|b| c.all_reduce_init(b, ReduceOp::Sum))
            .collect::<toroid::Result<Vec<_>>>()?;
        for _ in 0..cli.warmup {
            reqs.iter_mut().try_for_each(|r| r.start())?;
        }
        c.barrier()?;
        let t = Instant::now();
        for _ in 0..cli.iters.max(1) {
            reqs.iter_mut().try_for_each(|r| r.start())?;
        }
        let mut secs = [t.elapsed().as_secs_f64() / cli.iters.max(1) as f64];
        c.all_reduce_with(&mut secs, ReduceOp::Avg, EXACT)?;
        us[2] = secs[0] * 1e6;
        if cli.check != 0 {
            for (r, s) in reqs.iter_mut().zip(&send) {
                r.buffer().copy_from_slice(s);
                r.start()?;
            }
            drop(reqs);
            for (j, b) in bufs.iter().enumerate() {
                for (i, x) in b.iter().enumerate() {
                    let want: usize = (0..n).map(|q| (q + j + i) % 7).sum();
                    wrong[0] += u64::from(*x != want as f32);
                }
            }
        }
        c.all_reduce(&mut wrong, ReduceOp::Sum)?;
        let (sep_pred, grp_pred) = self.predict_calls(k, count * 4);
        if me == 0 {
            println!(
                "# toroid-bench {}: a step of {k} all-reduces of {} B (float, sum), {n} ranks; predicted: the cost model (persistent: as separate, it prices no per-call work)",
                env!("CARGO_PKG_VERSION"),
                count * 4
            );
            println!(
                "#{:>7}  {:>10}  {:>14}  {:>14}  {:>9}  {:>16}  {:>9}  {:>11}  {:>11}  {:>6}",
                "calls",
                "size (B)",
                "separate (us)",
                "grouped (us)",
                "speed-up",
                "persistent (us)",
                "speed-up",
                "pred sep us",
                "pred grp us",
                "#wrong"
            );
            println!(
                "{:>8}  {:>10}  {:>14.1}  {:>14.1}  {:>8.2}x  {:>16.1}  {:>8.2}x  {:>11.1}  {:>11.1}  {:>6}",
                k,
                count * 4,
                us[0],
                us[1],
                us[0] / us[1],
                us[2],
                us[0] / us[2],
                sep_pred * 1e6,
                grp_pred * 1e6,
                if cli.check != 0 { wrong[0].to_string() } else { "N/A".into() }
            );
        }
        if let (Some(path), 0) = (&cli.json, me) {
            let json = serde_json::json!({
                "calls": k, "size": count * 4, "ranks": n, "wrong": wrong[0],
                "separate_us": us[0], "grouped_us": us[1], "persistent_us": us[2],
                "predicted_separate_us": sep_pred * 1e6, "predicted_grouped_us": grp_pred * 1e6,
            });
            std::fs::write(path, serde_json::to_string_pretty(&json).unwrap_or_default())
                .map_err(|e| toroid::Error::system(format!("writing {path}"), e))?;
        }
        Ok(wrong[0])
    }

    /// The cost model's seconds for `k` float sum all-reduces of `bytes` each: one by one, and
    /// grouped as the group packs them (calls of at most `Group::FUSE_EACH` bytes in packs of
    /// at most `Group::FUSE_MAX`, each pack one all-reduce of the algorithm chosen for its
    /// size; larger calls back to back).
    fn predict_calls(&self, k: usize, bytes: usize) -> (f64, f64) {
        let c = &self.comm;
        let one = |b: usize| c.predict(c.algorithm_for(OpKind::AllReduce(ReduceOp::Sum), b, &self.opts), b);
        let separate = k as f64 * one(bytes);
        if bytes == 0 || bytes > toroid::Group::FUSE_EACH {
            return (separate, separate);
        }
        let per_pack = (toroid::Group::FUSE_MAX / bytes).max(1);
        let (full, rest) = (k / per_pack, k % per_pack);
        let grouped = full as f64 * one(per_pack * bytes) + if rest > 0 { one(rest * bytes) } else { 0.0 };
        (separate, grouped)
    }
}
