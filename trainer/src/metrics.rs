//! Metrics: CSV files (one row per logged step, one per epoch, one per evaluation) and a PNG of
//! the curves.

use std::io::Write;
use std::path::{Path, PathBuf};

use plotters::prelude::*;

use crate::error::{Context, Error, Result};

/// One logged training step (averaged over the steps since the previous row).
#[derive(Debug, Clone, Copy, Default)]
pub struct StepRow {
    /// Optimiser steps so far.
    pub step: u64,
    /// Fractional epoch.
    pub epoch: f64,
    /// Global batch.
    pub batch: usize,
    /// Learning rate.
    pub lr: f64,
    /// Mean training loss (over ranks and steps since the last row).
    pub loss: f64,
    /// Training images per second, all ranks together.
    pub images_per_s: f64,
    /// Mean step time in seconds.
    pub step_s: f64,
    /// Mean time per step blocked on gradient all-reduce, seconds.
    pub comm_s: f64,
    /// Examples consumed so far, all ranks (echoes included).
    pub examples: f64,
    /// Fresh examples consumed so far, all ranks.
    pub fresh: f64,
    /// Training payload bytes all-reduced so far, per rank.
    pub bytes: f64,
    /// Echo factor in force.
    pub echo: usize,
    /// Upstream seconds per fresh per-rank batch (t_up).
    pub t_up_s: f64,
    /// Downstream seconds per step: the step less its wait for input (t_down).
    pub t_down_s: f64,
    /// R = t_up / t_down.
    pub r: f64,
}

/// One evaluation on the test set (every `--eval-every` steps and at epoch ends).
#[derive(Debug, Clone, Copy, Default)]
pub struct EvalRow {
    /// Optimiser steps so far.
    pub step: u64,
    /// Fractional epoch.
    pub epoch: f64,
    /// Examples consumed so far, all ranks (echoes included).
    pub examples: f64,
    /// Fresh examples consumed so far, all ranks.
    pub fresh: f64,
    /// Training payload bytes all-reduced so far, per rank.
    pub bytes: f64,
    /// Seconds since the start of the run.
    pub wall_s: f64,
    /// Seconds since the start, less the time spent evaluating.
    pub train_s: f64,
    /// Mean training loss over the steps since the previous evaluation (all ranks).
    pub train_loss: f64,
    /// Test loss.
    pub test_loss: f64,
    /// Test top-1 accuracy.
    pub test_acc: f64,
}

/// One finished epoch.
#[derive(Debug, Clone, Copy, Default)]
pub struct EpochRow {
    /// Epoch number.
    pub epoch: u64,
    /// Optimiser steps so far.
    pub step: u64,
    /// Global batch.
    pub batch: usize,
    /// Learning rate at the end of the epoch.
    pub lr: f64,
    /// Mean training loss.
    pub train_loss: f64,
    /// Training top-1 accuracy (on augmented examples, as seen).
    pub train_acc: f64,
    /// Test loss.
    pub test_loss: f64,
    /// Test top-1 accuracy.
    pub test_acc: f64,
    /// Training images per second, all ranks.
    pub images_per_s: f64,
    /// Fraction of step time blocked on gradient all-reduce.
    pub comm_fraction: f64,
    /// Seconds spent in this epoch's training steps.
    pub epoch_s: f64,
    /// Seconds since the start of the run.
    pub wall_s: f64,
    /// Epochs completed, fractional when --max-steps ended the epoch early.
    pub epochs_done: f64,
}

/// CSV writers and the history for plotting (rank 0 only).
pub struct Metrics {
    dir: PathBuf,
    steps: Vec<StepRow>,
    epochs: Vec<EpochRow>,
    step_file: std::fs::File,
    epoch_file: std::fs::File,
    eval_file: std::fs::File,
}

const STEP_HEADER: &str = "step,epoch,global_batch,lr,loss,images_per_s,step_s,allreduce_wait_s,examples,fresh,bytes,echo,t_up_s,t_down_s,r";
/// The columns of `evals.csv`.
pub const EVAL_HEADER: &str = "step,epoch,examples,fresh,bytes,wall_s,train_s,train_loss,test_loss,test_acc";
const EPOCH_HEADER: &str = "epoch,step,global_batch,lr,train_loss,train_acc,test_loss,test_acc,images_per_s,allreduce_fraction,epoch_s,wall_s,epochs_done";

impl Metrics {
    /// Creates `dir` and the CSV files `steps.csv` and `epochs.csv` in it. With `append` (a
    /// resumed run, or an elastic survivor taking over from a rank 0 that died) existing files
    /// are kept and their rows become the start of the history, so the plot covers the whole
    /// run; a last row the previous writer did not finish (it was killed inside the write) is
    /// cut off first, or the next row would be appended to its fragment and lost in it.
    pub fn create(dir: &Path, append: bool) -> Result<Metrics> {
        Metrics::open(dir, append, None)
    }

    /// Under `--elastic`, the survivor that became rank 0 after rank 0 died takes over `dir`'s
    /// files from the steps up to `step`, the one the survivors go back to: rows of later steps
    /// go (the dead rank may have finished and logged the failed step, which the survivors now
    /// redo and log again).
    pub fn take_over(dir: &Path, step: u64) -> Result<Metrics> {
        Metrics::open(dir, true, Some(step))
    }

    fn open(dir: &Path, append: bool, after: Option<u64>) -> Result<Metrics> {
        std::fs::create_dir_all(dir)
            .context(|| format!("cannot create output directory {}", dir.display()))?;
        // `rows_after`: the file's rows are by step, cut past `after`.
        let open = |name: &str, header: &str, rows_after: Option<u64>| -> Result<std::fs::File> {
            let path = dir.join(name);
            // A file the previous writer left without a complete header counts as absent.
            let exists = append && path.exists() && cut_rows(&path, rows_after)? > 0;
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(exists)
                .write(true)
                .truncate(!exists)
                .open(&path)
                .context(|| format!("cannot write {}", path.display()))?;
            if !exists {
                write_row(&mut f, format_args!("{header}"))?;
            }
            Ok(f)
        };
        let (step_file, epoch_file, eval_file) = (
            open("steps.csv", STEP_HEADER, after)?,
            open("epochs.csv", EPOCH_HEADER, None)?,
            open("evals.csv", EVAL_HEADER, after)?,
        );
        // Read after the opens have cut any torn row.
        let (steps, epochs) = if append { read_history(dir)? } else { (vec![], vec![]) };
        Ok(Metrics { dir: dir.to_path_buf(), steps, epochs, step_file, epoch_file, eval_file })
    }

    /// Records a step row.
    pub fn step(&mut self, r: StepRow) -> Result<()> {
        write_row(
            &mut self.step_file,
            format_args!(
                "{},{:.4},{},{:.6},{:.5},{:.1},{:.4},{:.5},{},{},{},{},{:.5},{:.5},{:.3}",
                r.step,
                r.epoch,
                r.batch,
                r.lr,
                r.loss,
                r.images_per_s,
                r.step_s,
                r.comm_s,
                r.examples,
                r.fresh,
                r.bytes,
                r.echo,
                r.t_up_s,
                r.t_down_s,
                r.r
            ),
        )?;
        self.steps.push(r);
        Ok(())
    }

    /// The training loss of the last `steps.csv` row (NaN before the first).
    pub fn last_loss(&self) -> f64 {
        self.steps.last().map_or(f64::NAN, |s| s.loss)
    }

    /// Records an evaluation row.
    pub fn eval(&mut self, r: EvalRow) -> Result<()> {
        write_row(
            &mut self.eval_file,
            format_args!(
                "{},{:.4},{},{},{},{:.2},{:.2},{:.5},{:.5},{:.4}",
                r.step,
                r.epoch,
                r.examples,
                r.fresh,
                r.bytes,
                r.wall_s,
                r.train_s,
                r.train_loss,
                r.test_loss,
                r.test_acc
            ),
        )
    }

    /// Records an epoch row.
    pub fn epoch(&mut self, r: EpochRow) -> Result<()> {
        write_row(
            &mut self.epoch_file,
            format_args!(
                "{},{},{},{:.6},{:.5},{:.4},{:.5},{:.4},{:.1},{:.4},{:.1},{:.1},{:.4}",
                r.epoch,
                r.step,
                r.batch,
                r.lr,
                r.train_loss,
                r.train_acc,
                r.test_loss,
                r.test_acc,
                r.images_per_s,
                r.comm_fraction,
                r.epoch_s,
                r.wall_s,
                r.epochs_done
            ),
        )?;
        self.epochs.push(r);
        Ok(())
    }

    /// Draws `curves.png`: loss, accuracy, images/s and all-reduce share of step time.
    pub fn plot(&self, title: &str) -> Result<PathBuf> {
        let path = self.dir.join("curves.png");
        plot(&path, title, &self.steps, &self.epochs)?;
        Ok(path)
    }
}

/// Writes one CSV row and its newline with a single `write`: `writeln!` on a file makes a system
/// call per formatted piece, and a rank killed between two of them (an elastic run's rank 0)
/// would leave a fragment that the next writer's row is glued to.
fn write_row(file: &mut std::fs::File, row: std::fmt::Arguments) -> Result<()> {
    let mut line = row.to_string();
    line.push('\n');
    file.write_all(line.as_bytes())?;
    Ok(())
}

/// Cuts `path` back to the end of its last complete line (see [`Metrics::create`]) and, with
/// `after`, to before its first row of a later step (see [`Metrics::take_over`]); returns the
/// length kept.
fn cut_rows(path: &Path, after: Option<u64>) -> Result<usize> {
    let text = std::fs::read(path).context(|| format!("cannot read {}", path.display()))?;
    let mut keep = 0;
    for (i, line) in text.split_inclusive(|&b| b == b'\n').enumerate() {
        let step = || std::str::from_utf8(line).ok()?.split(',').next()?.trim().parse::<u64>().ok();
        if !line.ends_with(b"\n") || (i > 0 && after.is_some_and(|a| step().is_some_and(|s| s > a))) {
            break;
        }
        keep += line.len();
    }
    if keep < text.len() {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .context(|| format!("cannot write {}", path.display()))?;
        f.set_len(keep as u64).context(|| format!("cannot truncate {}", path.display()))?;
    }
    Ok(keep)
}

/// Reads the rows of `dir/steps.csv` and `dir/epochs.csv` (missing files: no rows).
pub fn read_history(dir: &Path) -> Result<(Vec<StepRow>, Vec<EpochRow>)> {
    fn rows(path: &Path) -> Result<Vec<Vec<f64>>> {
        let Ok(text) = std::fs::read_to_string(path) else { return Ok(vec![]) };
        text.lines()
            .skip(1)
            .filter(|l| !l.trim().is_empty())
            .enumerate()
            .map(|(i, l)| {
                l.split(',')
                    .map(|f| f.trim().parse::<f64>())
                    .collect::<std::result::Result<Vec<f64>, _>>()
                    .context(|| format!("{}: malformed row {}", path.display(), i + 2))
            })
            .collect()
    }
    let steps = rows(&dir.join("steps.csv"))?
        .into_iter()
        .filter(|r| r.len() >= 8)
        .map(|r| StepRow {
            step: r[0] as u64,
            epoch: r[1],
            batch: r[2] as usize,
            lr: r[3],
            loss: r[4],
            images_per_s: r[5],
            step_s: r[6],
            comm_s: r[7],
            // Files from before these columns: unknown.
            examples: r.get(8).copied().unwrap_or(f64::NAN),
            fresh: r.get(9).copied().unwrap_or(f64::NAN),
            bytes: r.get(10).copied().unwrap_or(f64::NAN),
            echo: r.get(11).map_or(1, |&e| e as usize),
            t_up_s: r.get(12).copied().unwrap_or(f64::NAN),
            t_down_s: r.get(13).copied().unwrap_or(f64::NAN),
            r: r.get(14).copied().unwrap_or(f64::NAN),
        })
        .collect();
    let epochs = rows(&dir.join("epochs.csv"))?
        .into_iter()
        .filter(|r| r.len() >= 12)
        .map(|r| EpochRow {
            epoch: r[0] as u64,
            step: r[1] as u64,
            batch: r[2] as usize,
            lr: r[3],
            train_loss: r[4],
            train_acc: r[5],
            test_loss: r[6],
            test_acc: r[7],
            images_per_s: r[8],
            comm_fraction: r[9],
            epoch_s: r[10],
            wall_s: r[11],
            // Files from before this column: a whole epoch.
            epochs_done: r.get(12).copied().unwrap_or(r[0] + 1.0),
        })
        .collect();
    Ok((steps, epochs))
}

/// Fonts tried in order (plotters draws text with ab_glyph from a TTF file; Debian's
/// fonts-dejavu-core provides the first).
const FONTS: [&str; 3] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
];

pub(crate) fn register_font() -> Result<()> {
    static DONE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let ok = *DONE.get_or_init(|| {
        FONTS.iter().any(|p| {
            std::fs::read(p)
                .ok()
                .map(|bytes| {
                    // plotters keeps the font for the life of the process.
                    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok()
                })
                .unwrap_or(false)
        })
    });
    if ok {
        Ok(())
    } else {
        Err(Error::msg(format!(
            "no TrueType font for the plot labels (looked for {FONTS:?}; apt-get install fonts-dejavu-core)"
        )))
    }
}

pub(crate) fn pe<E: std::fmt::Debug>(e: E) -> Error {
    Error::msg(format!("plot: {e:?}"))
}

/// A named, coloured line of (x, y) points.
pub(crate) type Series<'a> = (&'a str, RGBColor, Vec<(f64, f64)>);

/// A line chart of `series` (name, colour, points) in one panel, with a legend when there is
/// more than one series.
pub(crate) fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    caption: &str,
    xlabel: &str,
    series: &[Series],
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    panel_with(area, caption, (xlabel, ""), series, series.len() > 1)
}

/// A line chart of `series` with axis descriptions `(x, y)` (empty: none) and the legend only
/// when `legend` (a figure of several panels shows it once).
pub(crate) fn panel_with<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    caption: &str,
    (xlabel, ylabel): (&str, &str),
    series: &[Series],
    legend: bool,
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let pts = series.iter().flat_map(|s| s.2.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in pts {
        if x.is_finite() && y.is_finite() {
            x0 = x0.min(x);
            x1 = x1.max(x);
            y0 = y0.min(y);
            y1 = y1.max(y);
        }
    }
    if x0 > x1 {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    if x1 - x0 < 1e-9 {
        x1 = x0 + 1.0;
    }
    // A flat or single-point series still gets a readable axis.
    let pad = ((y1 - y0) * 0.05).max(y1.abs().max(y0.abs()) * 0.01).max(1e-3);
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(if ylabel.is_empty() { 60 } else { 75 })
        .build_cartesian_2d(x0..x1, (y0 - pad)..(y1 + pad))
        .map_err(pe)?;
    let ticks = |v: &f64| {
        let a = v.abs();
        if a >= 10.0 || a == 0.0 {
            format!("{v:.0}")
        } else if a >= 1.0 {
            format!("{v:.1}")
        } else if a >= 0.1 {
            format!("{v:.2}")
        } else {
            format!("{v:.3}")
        }
    };
    chart
        .configure_mesh()
        .x_desc(xlabel)
        .y_desc(ylabel)
        .x_label_formatter(&ticks)
        .y_label_formatter(&ticks)
        .label_style(("sans-serif", 13))
        .axis_desc_style(("sans-serif", 15))
        .draw()
        .map_err(pe)?;
    for (name, colour, points) in series {
        let c = *colour;
        // Markers as well as lines: per-epoch series may have a single point.
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 3, c.filled()))).map_err(pe)?;
        chart
            .draw_series(LineSeries::new(points.iter().copied(), c.stroke_width(2)))
            .map_err(pe)?
            .label(*name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
    }
    if legend {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .label_font(("sans-serif", 14))
            .border_style(BLACK)
            .background_style(WHITE.mix(0.85))
            .draw()
            .map_err(pe)?;
    }
    Ok(())
}

/// Draws the four panels to `path`.
pub fn plot(path: &Path, title: &str, steps: &[StepRow], epochs: &[EpochRow]) -> Result<()> {
    draw_png(path, (1400, 1000), title, |root| {
        let areas = root.split_evenly((2, 2));
        let blue = RGBColor(31, 119, 180);
        let orange = RGBColor(255, 127, 14);
        let green = RGBColor(44, 160, 44);
        panel(
            &areas[0],
            "training loss",
            "epoch",
            &[
                ("per logged step", blue, steps.iter().map(|s| (s.epoch, s.loss)).collect()),
                (
                    "test (per epoch)",
                    orange,
                    epochs
                        .iter()
                        .filter(|e| e.test_loss.is_finite())
                        .map(|e| (e.epochs_done, e.test_loss))
                        .collect(),
                ),
            ],
        )?;
        panel(
            &areas[1],
            "top-1 accuracy",
            "epoch",
            &[
                ("train", blue, epochs.iter().map(|e| (e.epochs_done, e.train_acc)).collect()),
                (
                    "test",
                    orange,
                    epochs
                        .iter()
                        .filter(|e| e.test_acc.is_finite())
                        .map(|e| (e.epochs_done, e.test_acc))
                        .collect(),
                ),
            ],
        )?;
        panel(
            &areas[2],
            "images/s (all ranks)",
            "epoch",
            &[("images/s", green, steps.iter().map(|s| (s.epoch, s.images_per_s)).collect())],
        )?;
        panel(
            &areas[3],
            "share of step time waiting on all-reduce",
            "epoch",
            &[(
                "all-reduce wait / step",
                RED,
                steps
                    .iter()
                    .map(|s| (s.epoch, if s.step_s > 0.0 { s.comm_s / s.step_s } else { 0.0 }))
                    .collect(),
            )],
        )?;
        Ok(())
    })
}

/// Draws a `w x h` titled figure with `draw` and writes it as a PNG at `path`. Drawn into memory
/// and encoded with the `image` crate the trainer already uses, rather than plotters' encoder
/// (which would pull in a second, older `image`).
pub fn draw_png(
    path: &Path,
    (w, h): (u32, u32),
    title: &str,
    draw: impl FnOnce(&DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>) -> Result<()>,
) -> Result<()> {
    register_font()?;
    let mut pixels = vec![0u8; (w * h * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut pixels, (w, h)).into_drawing_area();
        root.fill(&WHITE).map_err(pe)?;
        let titled = root.titled(title, ("sans-serif", 24)).map_err(pe)?;
        draw(&titled)?;
        root.present().map_err(pe)?;
    }
    let img = image::RgbImage::from_raw(w, h, pixels).ok_or_else(|| Error::msg("plot: bad buffer size"))?;
    img.save(path).map_err(|e| Error::msg(format!("cannot write {}: {e}", path.display())))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_csv_and_png() {
        let dir = std::env::temp_dir().join(format!("toroid-metrics-{}", std::process::id()));
        let mut m = Metrics::create(&dir, false).unwrap();
        for i in 0..20 {
            m.step(StepRow {
                step: i,
                epoch: i as f64 / 10.0,
                batch: 64,
                lr: 0.1,
                loss: 2.0 / (1.0 + i as f64),
                images_per_s: 500.0,
                step_s: 0.1,
                comm_s: 0.01,
                ..Default::default()
            })
            .unwrap();
        }
        m.epoch(EpochRow { epoch: 0, test_acc: 0.5, train_acc: 0.4, test_loss: 1.0, ..Default::default() })
            .unwrap();
        m.epoch(EpochRow { epoch: 1, test_acc: 0.7, train_acc: 0.6, test_loss: 0.8, ..Default::default() })
            .unwrap();
        let csv = std::fs::read_to_string(dir.join("epochs.csv")).unwrap();
        assert_eq!(csv.lines().count(), 3);
        assert!(csv.starts_with("epoch,step"));
        if register_font().is_ok() {
            let png = m.plot("test").unwrap();
            let img = image::open(&png).unwrap();
            assert_eq!((img.width(), img.height()), (1400, 1000));
        }
        // Appending keeps the header single.
        drop(m);
        let mut m = Metrics::create(&dir, true).unwrap();
        assert_eq!((m.steps.len(), m.epochs.len()), (20, 2));
        assert_eq!(m.epochs[1].test_acc, 0.7);
        m.epoch(EpochRow { epoch: 2, ..Default::default() }).unwrap();
        let csv = std::fs::read_to_string(dir.join("epochs.csv")).unwrap();
        assert_eq!(csv.lines().count(), 4);
        // A writer killed inside a row left a fragment: the next one cuts it and its own row
        // starts a line of its own.
        drop(m);
        let mut f = std::fs::OpenOptions::new().append(true).open(dir.join("steps.csv")).unwrap();
        f.write_all(b"20,2.0000,64,0.100000,0.5,500.0,0.1,0.01,0,0,0,1,Na").unwrap();
        drop(f);
        let mut m = Metrics::create(&dir, true).unwrap();
        assert_eq!(m.steps.len(), 20);
        m.step(StepRow { step: 20, loss: 0.5, ..Default::default() }).unwrap();
        let csv = std::fs::read_to_string(dir.join("steps.csv")).unwrap();
        let steps: Vec<&str> = csv.lines().skip(1).map(|l| l.split(',').next().unwrap()).collect();
        assert_eq!(steps, (0..=20).map(|i| i.to_string()).collect::<Vec<_>>());
        assert!(csv.ends_with('\n') && csv.lines().all(|l| l.split(',').count() == 15), "{csv}");
        // A header the writer did not finish is written again.
        drop(m);
        std::fs::write(dir.join("evals.csv"), "step,epo").unwrap();
        drop(Metrics::create(&dir, true).unwrap());
        assert_eq!(std::fs::read_to_string(dir.join("evals.csv")).unwrap(), format!("{EVAL_HEADER}\n"));
        // Taking over from step 12 drops the rows of steps 13-20 (the dead writer's, redone).
        let m = Metrics::take_over(&dir, 12).unwrap();
        assert_eq!(m.steps.iter().map(|r| r.step).collect::<Vec<_>>(), (0..=12).collect::<Vec<_>>());
        let csv = std::fs::read_to_string(dir.join("steps.csv")).unwrap();
        assert_eq!(csv.lines().count(), 14);
        assert_eq!(std::fs::read_to_string(dir.join("epochs.csv")).unwrap().lines().count(), 4);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
