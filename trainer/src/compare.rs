//! `--compare PNG`: one figure comparing several runs from their `evals.csv` files, a panel per
//! (y, x) pair, e.g. test accuracy against fresh examples and against bytes all-reduced. The
//! experiment scripts under `trainer/experiments/` use it, so the figures need nothing beyond
//! the trainer.

use std::path::{Path, PathBuf};

use plotters::prelude::*;

use crate::bail;
use crate::error::{Context, Result};
use crate::metrics::{EVAL_HEADER, Series, draw_png, panel};

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

/// Draws `runs` to `out`: one row of panels per `ys` column, one column per `xs` column.
pub fn compare(out: &Path, title: &str, runs: &[Run], xs: &[String], ys: &[String]) -> Result<()> {
    if runs.is_empty() || xs.is_empty() || ys.is_empty() {
        bail!("--compare needs --compare-runs, --compare-x and --compare-y");
    }
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
        data.push((r.label.as_str(), rows, cols));
    }
    let (pw, ph) = (700u32, 450u32);
    let size = (pw * xs.len() as u32, ph * ys.len() as u32 + 40);
    draw_png(out, size, title, |root| {
        let areas = root.split_evenly((ys.len(), xs.len()));
        for (yi, y) in ys.iter().enumerate() {
            for (xi, x) in xs.iter().enumerate() {
                let series: Vec<Series> = data
                    .iter()
                    .enumerate()
                    .map(|(k, (label, rows, cols))| {
                        let (cx, cy) = (cols[xi], cols[xs.len() + yi]);
                        let pts = rows.iter().filter_map(|r| Some((*r.get(cx)?, *r.get(cy)?))).collect();
                        (*label, PALETTE[k % PALETTE.len()], pts)
                    })
                    .collect();
                panel(&areas[yi * xs.len() + xi], &format!("{y} vs {x}"), x, &series)?;
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
        let err = compare(&out, "t", &runs, &["nope".to_string()], &ys).unwrap_err();
        assert!(err.0.contains("no column 'nope'"), "{err}");
        std::fs::remove_dir_all(&base).unwrap();
    }
}
