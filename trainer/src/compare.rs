//! `--compare PNG`: one figure comparing several runs from their `evals.csv` files, a panel per
//! (y, x) pair, e.g. test accuracy against fresh examples and against bytes all-reduced. The
//! experiment scripts under `trainer/experiments/` use it, so the figures need nothing beyond
//! the trainer.

use std::path::{Path, PathBuf};

use plotters::prelude::*;

use crate::bail;
use crate::error::{Context, Result};
use crate::metrics::{EVAL_HEADER, Series, draw_png, panel_with};

/// A run to draw: its label and its output directory.
#[derive(Debug, Clone, PartialEq)]
pub struct Run {
    /// Legend label.
    pub label: String,
    /// Directory holding `evals.csv`.
    pub dir: PathBuf,
}

/// Parses `LABEL=DIR` (split at the last `=`, so labels may hold one) or just `DIR`, labelled
/// by its last component.
pub fn parse_run(s: &str) -> Run {
    match s.rsplit_once('=') {
        Some((l, d)) => Run { label: l.to_string(), dir: PathBuf::from(d) },
        None => {
            let dir = PathBuf::from(s);
            let label = dir.file_name().map_or_else(|| s.to_string(), |n| n.to_string_lossy().into_owned());
            Run { label, dir }
        }
    }
}

/// The columns of `dir/evals.csv` by name, plus `mb` (bytes / 1e6) for readable axes.
fn read_evals(dir: &Path) -> Result<(Vec<String>, Vec<Vec<f64>>)> {
    let path = dir.join("evals.csv");
    let text = std::fs::read_to_string(&path).context(|| format!("cannot read {}", path.display()))?;
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let header: Vec<String> = lines.next().unwrap_or(EVAL_HEADER).split(',').map(str::to_string).collect();
    let rows = lines
        .enumerate()
        .map(|(i, l)| {
            l.split(',')
                .map(|f| f.trim().parse::<f64>())
                .collect::<std::result::Result<Vec<f64>, _>>()
                .context(|| format!("{}: malformed row {}", path.display(), i + 2))
        })
        .collect::<Result<Vec<Vec<f64>>>>()?;
    let mut header = header;
    let mut rows = rows;
    if let Some(b) = header.iter().position(|h| h == "bytes") {
        header.push("mb".into());
        for r in &mut rows {
            let mb = r.get(b).map_or(f64::NAN, |x| x / 1e6);
            r.push(mb);
        }
    }
    Ok((header, rows))
}

const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

/// The axis description of a column of `evals.csv` (with its unit), and the factor its values
/// are drawn with (accuracies as percentages).
fn axis(col: &str) -> (String, f64) {
    let (d, k) = match col {
        "examples" => ("training examples, all ranks", 1.0),
        "fresh" => ("fresh training examples", 1.0),
        "mb" => ("MB all-reduced per rank", 1.0),
        "bytes" => ("bytes all-reduced per rank", 1.0),
        "step" => ("steps per rank", 1.0),
        "epoch" => ("epochs", 1.0),
        "wall_s" => ("wall time (s)", 1.0),
        "train_s" => ("training time, evaluations excluded (s)", 1.0),
        "test_acc" => ("test top-1 accuracy (%)", 100.0),
        "train_loss" => ("training loss (cross-entropy)", 1.0),
        "test_loss" => ("test loss (cross-entropy)", 1.0),
        other => return (other.to_string(), 1.0),
    };
    (d.to_string(), k)
}

/// Runs that share a label are seeds of one configuration: their rows are averaged point by
/// point (the k-th evaluation of each; they are evaluated on the same schedule), up to the
/// shortest. Returns (legend label, averaged rows) in the order the labels first appear.
fn average_by_label<'a>(data: &'a [(&'a str, Vec<Vec<f64>>)]) -> Vec<(String, Vec<Vec<f64>>)> {
    let mut labels: Vec<&str> = vec![];
    for (l, _) in data {
        if !labels.contains(l) {
            labels.push(l);
        }
    }
    labels
        .into_iter()
        .map(|label| {
            let group: Vec<&Vec<Vec<f64>>> =
                data.iter().filter(|(l, _)| *l == label).map(|(_, r)| r).collect();
            let len = group.iter().map(|r| r.len()).min().unwrap_or(0);
            let rows = (0..len)
                .map(|i| {
                    let width = group.iter().map(|r| r[i].len()).min().unwrap_or(0);
                    (0..width)
                        .map(|c| group.iter().map(|r| r[i][c]).sum::<f64>() / group.len() as f64)
                        .collect()
                })
                .collect();
            let name = if group.len() > 1 {
                format!("{label} (mean of {})", group.len())
            } else {
                label.to_string()
            };
            (name, rows)
        })
        .collect()
}

/// The points of one line: NaNs dropped, and of two points closer in x than `gap` the later
/// kept (a run evaluated at an epoch's end just after a scheduled evaluation would otherwise draw
/// a near-vertical jump).
fn line(points: impl Iterator<Item = (f64, f64)>, gap: f64) -> Vec<(f64, f64)> {
    let mut out: Vec<(f64, f64)> = vec![];
    for (x, y) in points.filter(|(x, y)| x.is_finite() && y.is_finite()) {
        match out.last_mut() {
            Some(last) if (x - last.0).abs() < gap => *last = (x, y),
            _ => out.push((x, y)),
        }
    }
    out
}

/// Draws `runs` to `out`: one row of panels per `ys` column, one column per `xs` column. Runs
/// with the same label are averaged (see [`average_by_label`]); a run whose x column is
/// constant (e.g. no bytes all-reduced by one worker) is left out of that panel; the legend is
/// drawn once, in the first panel.
pub fn compare(out: &Path, title: &str, runs: &[Run], xs: &[String], ys: &[String]) -> Result<()> {
    if runs.is_empty() || xs.is_empty() || ys.is_empty() {
        bail!("--compare needs --compare-runs, --compare-x and --compare-y");
    }
    // Each run's rows projected to the requested columns (xs, then ys), so runs whose files
    // order their columns differently still line up.
    let mut data = vec![];
    for r in runs {
        let (header, rows) = read_evals(&r.dir)?;
        let col = |name: &str| -> Result<usize> {
            match header.iter().position(|h| h == name) {
                Some(i) => Ok(i),
                None => bail!(
                    "{}: no column '{name}' in evals.csv (columns: {})",
                    r.dir.display(),
                    header.join(",")
                ),
            }
        };
        let cols: Vec<usize> = xs.iter().chain(ys).map(|c| col(c)).collect::<Result<_>>()?;
        let picked = rows
            .iter()
            .map(|row| cols.iter().map(|&c| row.get(c).copied().unwrap_or(f64::NAN)).collect())
            .collect();
        data.push((r.label.as_str(), picked));
    }
    let lines = average_by_label(&data);
    let (pw, ph) = (700u32, 450u32);
    let size = (pw * xs.len() as u32, ph * ys.len() as u32 + 40);
    draw_png(out, size, title, |root| {
        let areas = root.split_evenly((ys.len(), xs.len()));
        for (yi, y) in ys.iter().enumerate() {
            for (xi, x) in xs.iter().enumerate() {
                let ((xd, xk), (yd, yk)) = (axis(x), axis(y));
                let (cx, cy) = (xi, xs.len() + yi);
                let raw: Vec<Vec<(f64, f64)>> = lines
                    .iter()
                    .map(|(_, rows)| {
                        rows.iter().filter_map(|r| Some((*r.get(cx)? * xk, *r.get(cy)? * yk))).collect()
                    })
                    .collect();
                let (lo, hi) =
                    raw.iter().flatten().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
                let gap = if hi > lo { (hi - lo) * 0.005 } else { 0.0 };
                let series: Vec<Series> = lines
                    .iter()
                    .zip(raw)
                    .enumerate()
                    .filter(|(_, (_, pts))| pts.iter().any(|p| p.0 != pts[0].0))
                    .map(|(k, ((label, _), pts))| {
                        (label.as_str(), PALETTE[k % PALETTE.len()], line(pts.into_iter(), gap))
                    })
                    .collect();
                let caption = format!(
                    "{} against {}",
                    yd.split(" (").next().unwrap_or(&yd),
                    xd.split(" (").next().unwrap_or(&xd)
                );
                let first = yi == 0 && xi == 0;
                panel_with(&areas[yi * xs.len() + xi], &caption, (&xd, &yd), &series, first)?;
            }
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::register_font;

    #[test]
    fn draws_runs_from_their_evals_csv() {
        let base = std::env::temp_dir().join(format!("toroid-compare-{}", std::process::id()));
        let mut runs = vec![];
        for (k, name) in ["a", "b"].iter().enumerate() {
            let dir = base.join(name);
            std::fs::create_dir_all(&dir).unwrap();
            let mut csv = format!("{EVAL_HEADER}\n");
            for i in 1..5 {
                let acc = 0.5 + 0.1 * i as f64 - 0.05 * k as f64;
                csv +=
                    &format!("{i},{},{},{},{},1,1,0.5,0.4,{acc}\n", i as f64 / 4.0, i * 64, i * 32, i * 1000);
            }
            std::fs::write(dir.join("evals.csv"), csv).unwrap();
            runs.push(parse_run(&format!("{name}={}", dir.display())));
        }
        assert_eq!(parse_run("/x/y").label, "y");
        assert_eq!(parse_run("E=2=/x/y"), Run { label: "E=2".into(), dir: PathBuf::from("/x/y") });
        let out = base.join("cmp.png");
        let (xs, ys) = (vec!["fresh".to_string(), "mb".to_string()], vec!["test_acc".to_string()]);
        if register_font().is_ok() {
            compare(&out, "t", &runs, &xs, &ys).unwrap();
            let img = image::open(&out).unwrap();
            assert_eq!((img.width(), img.height()), (1400, 490));
        }
        // Two seeds under one label draw one line (their mean).
        let twice = [runs.clone(), vec![Run { label: "a".into(), dir: runs[1].dir.clone() }]].concat();
        if register_font().is_ok() {
            compare(&out, "t", &twice, &xs, &ys).unwrap();
        }
        let err = compare(&out, "t", &runs, &["nope".to_string()], &ys).unwrap_err();
        assert!(err.0.contains("no column 'nope'"), "{err}");
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn seeds_of_one_label_are_averaged_up_to_the_shortest() {
        let data = vec![
            ("a", vec![vec![1.0, 10.0], vec![2.0, 20.0], vec![3.0, 30.0]]),
            ("b", vec![vec![1.0, 5.0]]),
            ("a", vec![vec![1.0, 14.0], vec![2.0, 26.0]]),
        ];
        let lines = average_by_label(&data);
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0], ("a (mean of 2)".to_string(), vec![vec![1.0, 12.0], vec![2.0, 23.0]]));
        assert_eq!(lines[1], ("b".to_string(), vec![vec![1.0, 5.0]]));
    }

    #[test]
    fn close_points_keep_the_later_and_nans_are_dropped() {
        let pts = [(0.0, 1.0), (10.0, 2.0), (10.2, 3.0), (f64::NAN, 4.0), (20.0, f64::NAN), (30.0, 5.0)];
        assert_eq!(line(pts.into_iter(), 0.5), vec![(0.0, 1.0), (10.2, 3.0), (30.0, 5.0)]);
        assert_eq!(axis("test_acc"), ("test top-1 accuracy (%)".to_string(), 100.0));
        assert_eq!(axis("other").0, "other");
    }
}
