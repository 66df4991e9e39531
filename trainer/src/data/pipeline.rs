//! The input pipeline: worker threads joined by bounded crossbeam channels.
//!
//! ```text
//!  shard of the epoch's permutation
//!    -> decode pool (W threads: read + decode)
//!    -> sequencer: restore order | SEAM after_decode | shuffle buffer
//!    -> augment pool (W threads: resize, random crop with padding, flip, normalise)
//!    -> batcher: restore order | SEAM after_augment | shuffle buffer | batch
//!                | SEAM after_batch | shuffle buffer of batches
//!    -> bounded queue of ready batches (prefetch) -> trainer
//! ```
//!
//! The output does not depend on the number of workers or on thread timing: the two pools' results
//! are put back in sequence order before the next single-threaded stage, and every random choice
//! (shuffle buffer, crop, flip) comes from a generator derived from (seed, epoch, rank, sequence
//! number). That is what lets the data-parallel test compare runs with different rank counts.
//!
//! The three seams are where data echoing (Choi et al.) plugs in: a stage may emit each item
//! any number of times. Example echoing before augmentation uses `after_decode` (the shuffle
//! buffer right after it keeps repeats apart), after augmentation `after_augment`, batch echoing
//! `after_batch`. A stage must be deterministic for the same reason as above.
//!
//! The first item a seam emits for an input is that input's fresh use; any further ones are
//! repeats. Samples and batches carry that mark ([`Sample::fresh`], [`Batch::fresh`]), so the
//! trainer counts exactly the fresh examples it consumed, however the buffers reorder them.
//! Each pool also adds its busy time to an optional [`StageClock`], from which the trainer
//! measures the upstream time per batch (and which holds the pools while it is stopped).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam::channel::{Receiver, Sender, bounded, unbounded};

use super::echo::{ShuffleBuffer, StageClock};
use super::{Dataset, Example, Image};
use crate::error::{Error, Result};
use crate::rng::Rng;

/// An augmented example: normalised f32 pixels, channel-major (CHW).
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// `channels * size * size` values.
    pub pixels: Vec<f32>,
    /// Class.
    pub label: u32,
    /// True for the example's first use in the epoch, false for an echo of it.
    pub fresh: bool,
}

/// A batch ready for the model.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// `len * channels * size * size` values, NCHW.
    pub images: Vec<f32>,
    /// One class per example.
    pub labels: Vec<u32>,
    /// Channels.
    pub channels: usize,
    /// Side of the square images.
    pub size: usize,
    /// Examples used for the first time (the rest are echoes; 0 for a repeated batch).
    pub fresh: usize,
}

impl Batch {
    /// Number of examples.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }
}

/// A pipeline stage at a seam: receives each item in order and emits zero or more items.
pub trait Stage<T>: Send + Sync {
    /// Processes one item; calls `emit` for every item it passes on.
    fn process(&self, item: T, emit: &mut dyn FnMut(T));
}

/// Optional stages at the three seams (none: items pass through).
#[derive(Clone, Default)]
pub struct Seams {
    /// After read and decode, before the shuffle buffer.
    pub after_decode: Option<Arc<dyn Stage<Example>>>,
    /// After augmentation, before batching.
    pub after_augment: Option<Arc<dyn Stage<Sample>>>,
    /// After batching.
    pub after_batch: Option<Arc<dyn Stage<Batch>>>,
}

impl std::fmt::Debug for Seams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Seams")
            .field("after_decode", &self.after_decode.is_some())
            .field("after_augment", &self.after_augment.is_some())
            .field("after_batch", &self.after_batch.is_some())
            .finish()
    }
}

/// Augmentation and normalisation.
#[derive(Debug, Clone, PartialEq)]
pub struct Augment {
    /// Side of the (square) model input; images of another size are resized (bilinear) first.
    pub size: usize,
    /// Random crop: pad by this many zero pixels on each side, then crop `size` x `size` at a
    /// random offset (0: no crop).
    pub crop_pad: usize,
    /// Random horizontal flip with probability 1/2.
    pub flip: bool,
    /// Per-channel mean, subtracted after scaling pixels to [0, 1].
    pub mean: Vec<f32>,
    /// Per-channel standard deviation, divided by.
    pub std: Vec<f32>,
}

impl Augment {
    /// The same resize and normalisation with no random transformation (evaluation).
    pub fn deterministic(&self) -> Augment {
        Augment { crop_pad: 0, flip: false, ..self.clone() }
    }

    /// Applies the transformation to `img` with randomness from `rng`.
    pub fn apply(&self, img: &Image, rng: &mut Rng) -> Result<Vec<f32>> {
        let c = img.channels;
        if self.mean.len() != c || self.std.len() != c {
            return Err(Error::msg(format!(
                "normalisation has {} means for {c}-channel images",
                self.mean.len()
            )));
        }
        if img.pixels.len() != img.height * img.width * c || img.height == 0 || img.width == 0 {
            return Err(Error::msg(format!(
                "malformed image {}x{}x{c} with {} bytes",
                img.height,
                img.width,
                img.pixels.len()
            )));
        }
        let s = self.size;
        let resized;
        let img = if img.height != s || img.width != s {
            resized = resize_bilinear(img, s);
            &resized
        } else {
            img
        };
        let (dy, dx) = if self.crop_pad > 0 {
            (
                rng.below(2 * self.crop_pad + 1) as isize - self.crop_pad as isize,
                rng.below(2 * self.crop_pad + 1) as isize - self.crop_pad as isize,
            )
        } else {
            (0, 0)
        };
        let flip = self.flip && rng.below(2) == 1;
        let mut out = vec![0f32; c * s * s];
        for ch in 0..c {
            let (m, inv) = (self.mean[ch], 1.0 / self.std[ch]);
            let zero = (0.0 - m) * inv; // padding is a black pixel, normalised like any other
            for y in 0..s {
                let sy = y as isize + dy;
                for x in 0..s {
                    let xx = if flip { s - 1 - x } else { x };
                    let sx = xx as isize + dx;
                    let v = if sy < 0 || sx < 0 || sy >= s as isize || sx >= s as isize {
                        zero
                    } else {
                        (img.pixels[(sy as usize * s + sx as usize) * c + ch] as f32 / 255.0 - m) * inv
                    };
                    out[ch * s * s + y * s + x] = v;
                }
            }
        }
        Ok(out)
    }
}

/// Bilinear resize to `s` x `s` (pixel centres aligned, as PIL and OpenCV do).
fn resize_bilinear(img: &Image, s: usize) -> Image {
    let (h, w, c) = (img.height, img.width, img.channels);
    let mut out = vec![0u8; s * s * c];
    let (fy, fx) = (h as f32 / s as f32, w as f32 / s as f32);
    for y in 0..s {
        let sy = ((y as f32 + 0.5) * fy - 0.5).clamp(0.0, (h - 1) as f32);
        let (y0, ty) = (sy.floor() as usize, sy - sy.floor());
        let y1 = (y0 + 1).min(h - 1);
        for x in 0..s {
            let sx = ((x as f32 + 0.5) * fx - 0.5).clamp(0.0, (w - 1) as f32);
            let (x0, tx) = (sx.floor() as usize, sx - sx.floor());
            let x1 = (x0 + 1).min(w - 1);
            for ch in 0..c {
                let p = |yy: usize, xx: usize| img.pixels[(yy * w + xx) * c + ch] as f32;
                let v = (p(y0, x0) * (1.0 - tx) + p(y0, x1) * tx) * (1.0 - ty)
                    + (p(y1, x0) * (1.0 - tx) + p(y1, x1) * tx) * ty;
                out[(y * s + x) * c + ch] = v.round().clamp(0.0, 255.0) as u8;
            }
        }
    }
    Image { height: s, width: s, channels: c, pixels: out }
}

/// Everything one epoch's pipeline needs.
#[derive(Debug, Clone)]
pub struct PipelineConfig {
    /// Examples per batch.
    pub batch_size: usize,
    /// Threads in each of the decode and augment pools (at least 1).
    pub workers: usize,
    /// Shuffle buffer capacity in examples after the after-decode seam (0 or 1: none).
    pub shuffle_buffer: usize,
    /// Shuffle buffer capacity in examples after the after-augment seam (0 or 1: none).
    pub augment_shuffle: usize,
    /// Shuffle buffer capacity in batches after the after-batch seam (0 or 1: none).
    pub batch_shuffle: usize,
    /// Random augmentation (training) or deterministic (evaluation).
    pub train: bool,
    /// Keep a last partial batch (evaluation) or drop it (training, so ranks step together).
    pub keep_partial: bool,
    /// Ready batches queued ahead of the trainer.
    pub prefetch: usize,
    /// Seed for every random choice.
    pub seed: u64,
    /// Epoch number (part of every random stream).
    pub epoch: u64,
    /// This rank (part of every random stream).
    pub rank: usize,
    /// Augmentation.
    pub augment: Augment,
    /// Stages at the seams.
    pub seams: Seams,
    /// Where the pools add their busy time (None: not measured).
    pub clock: Option<Arc<StageClock>>,
}

/// A running epoch: an iterator of batches. Dropping it stops the threads.
pub struct Pipeline {
    rx: Option<Receiver<Result<Batch>>>,
    threads: Vec<JoinHandle<()>>,
}

impl Iterator for Pipeline {
    type Item = Result<Batch>;
    fn next(&mut self) -> Option<Result<Batch>> {
        self.rx.as_ref()?.recv().ok()
    }
}

impl Drop for Pipeline {
    fn drop(&mut self) {
        // Closing the output makes every stage's next send fail, so each thread returns.
        self.rx.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Receives `(seq, item)` pairs in any order and hands them on in sequence order.
struct Reorder<T> {
    next: u64,
    pending: BTreeMap<u64, T>,
}

impl<T> Reorder<T> {
    fn new() -> Self {
        Reorder { next: 0, pending: BTreeMap::new() }
    }

    fn push(&mut self, seq: u64, item: T, mut f: impl FnMut(T) -> bool) -> bool {
        self.pending.insert(seq, item);
        while let Some(item) = self.pending.remove(&self.next) {
            self.next += 1;
            if !f(item) {
                return false;
            }
        }
        true
    }
}

/// Starts the pipeline over `indices` (this rank's shard of the epoch) of `data`.
pub fn start(data: Arc<dyn Dataset>, indices: Vec<usize>, cfg: PipelineConfig) -> Pipeline {
    let workers = cfg.workers.max(1);
    let depth = 4 * workers + 2 * cfg.batch_size.max(1);
    let (job_tx, job_rx) = unbounded::<(u64, usize)>();
    for (seq, &i) in indices.iter().enumerate() {
        let _ = job_tx.send((seq as u64, i));
    }
    drop(job_tx);
    let (dec_tx, dec_rx) = bounded::<(u64, Result<Example>)>(depth);
    let (aug_in_tx, aug_in_rx) = bounded::<(u64, Result<(Example, bool)>)>(depth);
    let (aug_out_tx, aug_out_rx) = bounded::<(u64, Result<Sample>)>(depth);
    let (out_tx, out_rx) = bounded::<Result<Batch>>(cfg.prefetch.max(1));
    let mut threads = vec![];
    let spawn = |threads: &mut Vec<JoinHandle<()>>, name: String, f: Box<dyn FnOnce() + Send>| {
        // Thread creation fails only when the process is out of resources; the pipeline then
        // ends early and the trainer reports a short epoch through its step count check.
        if let Ok(h) = std::thread::Builder::new().name(name).spawn(f) {
            threads.push(h);
        }
    };

    for w in 0..workers {
        let (rx, tx, data, clock) = (job_rx.clone(), dec_tx.clone(), data.clone(), cfg.clock.clone());
        spawn(
            &mut threads,
            format!("decode-{w}"),
            Box::new(move || {
                for (seq, i) in rx.iter() {
                    if let Some(c) = &clock {
                        c.wait_while_stopped();
                    }
                    let t = std::time::Instant::now();
                    let ex = data.get(i);
                    if let Some(c) = &clock {
                        c.add_decode(t.elapsed());
                    }
                    if tx.send((seq, ex)).is_err() {
                        return;
                    }
                }
            }),
        );
    }
    drop(dec_tx);

    {
        let cfg = cfg.clone();
        spawn(&mut threads, "sequencer".into(), Box::new(move || sequencer(dec_rx, aug_in_tx, &cfg)));
    }

    for w in 0..workers {
        let (rx, tx, cfg) = (aug_in_rx.clone(), aug_out_tx.clone(), cfg.clone());
        spawn(
            &mut threads,
            format!("augment-{w}"),
            Box::new(move || {
                let aug = if cfg.train { cfg.augment.clone() } else { cfg.augment.deterministic() };
                for (seq, ex) in rx.iter() {
                    if let Some(c) = &cfg.clock {
                        c.wait_while_stopped();
                    }
                    let t = std::time::Instant::now();
                    let mut rng = Rng::derive(cfg.seed, &[0x0041_5547, cfg.epoch, cfg.rank as u64, seq]);
                    let s = ex.and_then(|(ex, fresh)| {
                        Ok(Sample { pixels: aug.apply(&ex.image, &mut rng)?, label: ex.label, fresh })
                    });
                    if let Some(c) = &cfg.clock {
                        c.add_augment(t.elapsed());
                    }
                    if tx.send((seq, s)).is_err() {
                        return;
                    }
                }
            }),
        );
    }
    drop(aug_out_tx);

    spawn(&mut threads, "batcher".into(), Box::new(move || batcher(aug_out_rx, out_tx, &cfg)));
    Pipeline { rx: Some(out_rx), threads }
}

/// Restores decode order, runs the after-decode seam (marking each input's first emission
/// fresh), then the shuffle buffer.
fn sequencer(
    rx: Receiver<(u64, Result<Example>)>,
    tx: Sender<(u64, Result<(Example, bool)>)>,
    cfg: &PipelineConfig,
) {
    let rng = Rng::derive(cfg.seed, &[0x5348_5546, cfg.epoch, cfg.rank as u64]);
    let mut buffer = ShuffleBuffer::new(cfg.shuffle_buffer, rng);
    let mut out_seq = 0u64;
    let mut send = |item: Result<(Example, bool)>| {
        let ok = tx.send((out_seq, item)).is_ok();
        out_seq += 1;
        ok
    };
    let mut reorder = Reorder::new();
    for (seq, item) in rx.iter() {
        let alive = reorder.push(seq, item, |item| match item {
            Err(e) => {
                send(Err(e));
                false // the first error ends the epoch
            }
            Ok(ex) => {
                let mut staged = Vec::with_capacity(1);
                match &cfg.seams.after_decode {
                    Some(stage) => stage.process(ex, &mut |e| {
                        let fresh = staged.is_empty();
                        staged.push((e, fresh))
                    }),
                    None => staged.push((ex, true)),
                }
                staged.into_iter().all(|ex| buffer.push(ex, &mut |ex| send(Ok(ex))))
            }
        });
        if !alive {
            return;
        }
    }
    buffer.drain(&mut |ex| send(Ok(ex)));
}

/// Restores augmentation order, runs the after-augment seam and its shuffle buffer, batches,
/// runs the after-batch seam and its shuffle buffer of batches.
fn batcher(rx: Receiver<(u64, Result<Sample>)>, tx: Sender<Result<Batch>>, cfg: &PipelineConfig) {
    let (c, s) = (cfg.augment.mean.len(), cfg.augment.size);
    let b = cfg.batch_size.max(1);
    let new_batch = || Batch {
        images: Vec::with_capacity(b * c * s * s),
        labels: Vec::with_capacity(b),
        channels: c,
        size: s,
        fresh: 0,
    };
    let mut batch = new_batch();
    let part = |tag: u64| Rng::derive(cfg.seed, &[tag, cfg.epoch, cfg.rank as u64]);
    let mut samples = ShuffleBuffer::new(cfg.augment_shuffle, part(0x4543_4853));
    let mut batches = ShuffleBuffer::new(cfg.batch_shuffle, part(0x4543_4842));
    // Runs the after-batch seam (the first emission keeps the fresh count, repeats have none),
    // then the batch shuffle buffer.
    let mut emit_batch = |batch: Batch| -> bool {
        let mut staged = Vec::with_capacity(1);
        match &cfg.seams.after_batch {
            Some(stage) => stage.process(batch, &mut |mut x| {
                if !staged.is_empty() {
                    x.fresh = 0;
                }
                staged.push(x)
            }),
            None => staged.push(batch),
        }
        staged.into_iter().all(|x| batches.push(x, &mut |x| tx.send(Ok(x)).is_ok()))
    };
    let add = |sample: Sample, batch: &mut Batch, emit_batch: &mut dyn FnMut(Batch) -> bool| -> bool {
        batch.images.extend_from_slice(&sample.pixels);
        batch.labels.push(sample.label);
        batch.fresh += sample.fresh as usize;
        batch.len() < b || emit_batch(std::mem::replace(batch, new_batch()))
    };
    let mut reorder = Reorder::new();
    for (seq, item) in rx.iter() {
        let alive = reorder.push(seq, item, |item| match item {
            Err(e) => {
                let _ = tx.send(Err(e));
                false
            }
            Ok(sample) => {
                let mut staged = Vec::with_capacity(1);
                match &cfg.seams.after_augment {
                    Some(stage) => stage.process(sample, &mut |mut x| {
                        if !staged.is_empty() {
                            x.fresh = false;
                        }
                        staged.push(x)
                    }),
                    None => staged.push(sample),
                }
                staged.into_iter().all(|x| samples.push(x, &mut |x| add(x, &mut batch, &mut emit_batch)))
            }
        });
        if !alive {
            return;
        }
    }
    if !samples.drain(&mut |x| add(x, &mut batch, &mut emit_batch)) {
        return;
    }
    if cfg.keep_partial && !batch.is_empty() && !emit_batch(batch) {
        return;
    }
    batches.drain(&mut |x| tx.send(Ok(x)).is_ok());
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A synthetic data set: image i is filled with i mod 251, label i mod 7.
    struct Synthetic(usize, usize);
    impl Dataset for Synthetic {
        fn len(&self) -> usize {
            self.0
        }
        fn num_classes(&self) -> usize {
            7
        }
        fn channels(&self) -> usize {
            1
        }
        fn get(&self, i: usize) -> Result<Example> {
            if i == self.1 {
                return Err(Error::msg(format!("example {i} is corrupt")));
            }
            Ok(Example {
                image: Image { height: 4, width: 4, channels: 1, pixels: vec![(i % 251) as u8; 16] },
                label: (i % 7) as u32,
            })
        }
        fn describe(&self) -> String {
            "synthetic".into()
        }
    }

    fn cfg(workers: usize, shuffle_buffer: usize, train: bool) -> PipelineConfig {
        PipelineConfig {
            batch_size: 5,
            workers,
            shuffle_buffer,
            train,
            keep_partial: !train,
            prefetch: 2,
            seed: 1,
            epoch: 0,
            rank: 0,
            augment: Augment { size: 4, crop_pad: 1, flip: true, mean: vec![0.0], std: vec![1.0 / 255.0] },
            seams: Seams::default(),
            augment_shuffle: 0,
            batch_shuffle: 0,
            clock: None,
        }
    }

    fn ids(p: Pipeline) -> Vec<Vec<u32>> {
        // Pixel values identify examples when there is no augmentation: the centre is untouched.
        p.map(|b| {
            let b = b.unwrap();
            (0..b.len()).map(|i| b.images[i * 16 + 5].round() as u32).collect()
        })
        .collect()
    }

    #[test]
    fn order_does_not_depend_on_worker_count_and_every_example_arrives_once() {
        let data: Arc<dyn Dataset> = Arc::new(Synthetic(103, usize::MAX));
        let idx: Vec<usize> = (0..103).rev().collect();
        let one = ids(start(data.clone(), idx.clone(), cfg(1, 0, false)));
        let four = ids(start(data.clone(), idx.clone(), cfg(4, 0, false)));
        assert_eq!(one, four);
        assert_eq!(one.len(), 21); // 20 full batches and a partial one
        assert_eq!(one[0], vec![102, 101, 100, 99, 98]);

        // With a shuffle buffer: reproducible, a permutation of the input, not the input order.
        let a = ids(start(data.clone(), idx.clone(), cfg(3, 16, false)));
        let b = ids(start(data.clone(), idx.clone(), cfg(1, 16, false)));
        assert_eq!(a, b);
        let mut flat: Vec<u32> = a.concat();
        assert_ne!(flat, one.concat());
        flat.sort_unstable();
        assert_eq!(flat, (0..103).collect::<Vec<_>>());

        // Training drops the partial batch; augmentation is random but reproducible.
        let t1: Vec<Batch> = start(data.clone(), idx.clone(), cfg(3, 0, true)).map(|b| b.unwrap()).collect();
        let t2: Vec<Batch> = start(data.clone(), idx.clone(), cfg(1, 0, true)).map(|b| b.unwrap()).collect();
        assert_eq!(t1.len(), 20);
        assert_eq!(t1, t2);
    }

    #[test]
    fn a_decode_error_reaches_the_trainer() {
        let data: Arc<dyn Dataset> = Arc::new(Synthetic(50, 17));
        let out: Vec<Result<Batch>> = start(data, (0..50).collect(), cfg(2, 4, true)).collect();
        let err = out.iter().find_map(|b| b.as_ref().err()).unwrap();
        assert!(err.0.contains("example 17 is corrupt"));
    }

    struct Twice;
    impl<T: Clone> Stage<T> for Twice {
        fn process(&self, item: T, emit: &mut dyn FnMut(T)) {
            emit(item.clone());
            emit(item);
        }
    }

    #[test]
    fn seams_can_repeat_items() {
        let data: Arc<dyn Dataset> = Arc::new(Synthetic(20, usize::MAX));
        let mut c = cfg(2, 0, false);
        c.seams.after_decode = Some(Arc::new(Twice));
        assert_eq!(ids(start(data.clone(), (0..20).collect(), c.clone())).concat().len(), 40);
        c.seams.after_augment = Some(Arc::new(Twice));
        assert_eq!(ids(start(data.clone(), (0..20).collect(), c.clone())).concat().len(), 80);
        c.seams.after_batch = Some(Arc::new(Twice));
        let b = ids(start(data, (0..20).collect(), c));
        assert_eq!(b.len(), 32);
        assert_eq!(b[0], b[1]);
    }

    /// Each example's id, per batch, and how many examples are fresh in each.
    fn ids_and_fresh(p: Pipeline) -> (Vec<Vec<u32>>, Vec<usize>) {
        let batches: Vec<Batch> = p.map(|b| b.unwrap()).collect();
        let ids = batches.iter().map(|b| (0..b.len()).map(|i| b.images[i * 16 + 5].round() as u32).collect());
        (ids.collect(), batches.iter().map(|b| b.fresh).collect())
    }

    #[test]
    fn echo_at_each_seam_repeats_exactly_and_counts_fresh_examples() {
        use crate::data::echo::Echo;
        let data: Arc<dyn Dataset> = Arc::new(Synthetic(40, usize::MAX));
        let idx: Vec<usize> = (0..40).collect();
        for e in 1..=3 {
            for point in 0..3 {
                let mut c = cfg(2, 0, false);
                let echo = Echo { factor: e };
                match point {
                    0 => {
                        c.seams.after_decode = Some(Arc::new(echo));
                        c.shuffle_buffer = 16;
                    }
                    1 => {
                        c.seams.after_augment = Some(Arc::new(echo));
                        c.augment_shuffle = 16;
                    }
                    _ => {
                        c.seams.after_batch = Some(Arc::new(echo));
                        c.batch_shuffle = 4;
                    }
                }
                let clock = Arc::new(StageClock::default());
                c.clock = Some(clock.clone());
                let (ids, fresh) = ids_and_fresh(start(data.clone(), idx.clone(), c.clone()));
                assert_eq!(ids.len(), 8 * e, "e {e} point {point}");
                let flat = ids.concat();
                for i in 0..40 {
                    assert_eq!(
                        flat.iter().filter(|&&x| x == i).count(),
                        e,
                        "example {i}, e {e}, point {point}"
                    );
                }
                // Every example is fresh exactly once, whatever the buffers did to the order.
                assert_eq!(fresh.iter().sum::<usize>(), 40);
                if point == 2 {
                    assert_eq!(fresh.iter().filter(|&&f| f == 5).count(), 8);
                }
                // The clock saw every read; the same run again is the same stream.
                let r = clock.read();
                assert_eq!(r.decoded, 40.0);
                assert_eq!(r.augmented, if point == 0 { 40.0 * e as f64 } else { 40.0 });
                assert_eq!(ids_and_fresh(start(data.clone(), idx.clone(), c)).0, ids);
            }
        }
    }

    #[test]
    fn a_shuffle_buffer_after_the_echo_stage_separates_repeats() {
        use crate::data::echo::Echo;
        let data: Arc<dyn Dataset> = Arc::new(Synthetic(200, usize::MAX));
        // Batches holding the same example twice.
        let dup = |buffer: usize| {
            let mut c = cfg(1, buffer, false);
            c.seams.after_decode = Some(Arc::new(Echo { factor: 2 }));
            let (ids, _) = ids_and_fresh(start(data.clone(), (0..200).collect(), c));
            ids.iter()
                .filter(|b| {
                    let mut s = (*b).clone();
                    s.sort_unstable();
                    s.windows(2).any(|w| w[0] == w[1])
                })
                .count()
        };
        assert_eq!(dup(0), 80); // every batch of 5 holds two or three pairs
        assert!(dup(64) < 20, "{}", dup(64));
    }

    #[test]
    fn augmentation_crops_flips_and_normalises() {
        let img = Image { height: 2, width: 2, channels: 1, pixels: vec![0, 51, 102, 255] };
        let a = Augment { size: 2, crop_pad: 0, flip: false, mean: vec![0.5], std: vec![0.5] };
        let v = a.apply(&img, &mut Rng::new(0)).unwrap();
        let want = [-1.0, 51.0 / 255.0 * 2.0 - 1.0, 102.0 / 255.0 * 2.0 - 1.0, 1.0];
        assert!(v.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-6), "{v:?}");
        // Flips and crops are seen over many draws, and a crop shifts in zero padding.
        let a = Augment { size: 2, crop_pad: 1, flip: true, mean: vec![0.0], std: vec![1.0] };
        let mut r = Rng::new(5);
        let mut flipped = false;
        let mut padded = false;
        for _ in 0..200 {
            let v = a.apply(&img, &mut r).unwrap();
            flipped |= v == vec![51.0 / 255.0, 0.0, 1.0, 102.0 / 255.0];
            padded |= v.iter().filter(|&&x| x == 0.0).count() >= 2;
        }
        assert!(flipped && padded);
        // Resizing: a 4x4 image to 2x2 averages 2x2 blocks.
        let img = Image { height: 4, width: 4, channels: 1, pixels: (0..16).map(|i| i as u8 * 10).collect() };
        let a = Augment { size: 2, crop_pad: 0, flip: false, mean: vec![0.0], std: vec![1.0 / 255.0] };
        let v = a.apply(&img, &mut Rng::new(0)).unwrap();
        let want = [25.0, 45.0, 105.0, 125.0];
        assert!(v.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-3), "{v:?}");
        // A malformed image is an error.
        let bad = Image { height: 3, width: 3, channels: 1, pixels: vec![0; 4] };
        assert!(a.apply(&bad, &mut Rng::new(0)).is_err());
    }
}
