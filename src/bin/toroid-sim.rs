//! `toroid-sim`: predicts all-reduce time and step counts with toroid's cost model, for clusters
//! far larger than the one at hand.
//!
//! ```text
//! toroid-sim --ranks 1088,2176 --per-host 4 --intra 2/20 --inter 5/12.5 --sizes 4K,1M,100M
//! ```
//!
//! For each rank count it prints, per algorithm (ring, hring, torus2d, hd, rd): the number of
//! sequential steps, the bytes that leave each host through its link and, for the two
//! hierarchical algorithms, the bytes each rank moves in the inter-host phase (the torus moves
//! 1/X of the hierarchical ring's), then the predicted time per size; the cheapest is marked.

use clap::Parser;
use toroid::Algorithm;
use toroid::internals::tuning::{CostModel, LinkCost, Shape};

#[derive(Parser, Debug)]
#[command(name = "toroid-sim", version, about = "Predict all-reduce time and steps with toroid's cost model")]
struct Cli {
    /// Rank counts to simulate (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1088,2176")]
    ranks: Vec<usize>,
    /// Ranks per host (the torus's X unless --grid says otherwise).
    #[arg(long, default_value_t = 4)]
    per_host: usize,
    /// Torus grid XxY (X*Y must equal the rank count; repeat for several rank counts by
    /// listing one per count, comma-separated).
    #[arg(long, value_delimiter = ',')]
    grid: Vec<String>,
    /// Intra-host link: latency in us / bandwidth in GB/s.
    #[arg(long, default_value = "2/20")]
    intra: String,
    /// Inter-host link: latency in us / bandwidth in GB/s.
    #[arg(long, default_value = "5/12.5")]
    inter: String,
    /// Network interfaces per host (parallel streams leaving a host use up to this many).
    #[arg(long, default_value_t = 1)]
    nics: usize,
    /// Reduction speed in GB/s.
    #[arg(long, default_value_t = 100.0)]
    reduce: f64,
    /// Message sizes (K, M, G suffixes).
    #[arg(long, value_delimiter = ',', default_value = "4K,256K,4M,100M")]
    sizes: Vec<String>,
}

fn link(s: &str) -> Result<LinkCost, String> {
    let (a, b) = s.split_once('/').ok_or(format!("'{s}': expected ALPHA_US/GBPS"))?;
    let a: f64 = a.trim().parse().map_err(|_| format!("'{a}' is not a number"))?;
    let b: f64 = b.trim().parse().map_err(|_| format!("'{b}' is not a number"))?;
    Ok(LinkCost { alpha: a * 1e-6, beta: 1.0 / (b * 1e9) })
}

fn human(secs: f64) -> String {
    if secs < 1e-3 {
        format!("{:.1} us", secs * 1e6)
    } else if secs < 1.0 {
        format!("{:.2} ms", secs * 1e3)
    } else {
        format!("{secs:.2} s")
    }
}

fn main() {
    let cli = Cli::parse();
    let run = || -> Result<(), String> {
        let model = CostModel {
            intra: link(&cli.intra)?,
            inter: link(&cli.inter)?,
            host_link_beta: None,
            gamma: 1.0 / (cli.reduce * 1e9),
            source: "command line".into(),
        };
        let sizes: Vec<usize> = cli
            .sizes
            .iter()
            .map(|s| toroid::internals::config::parse_size("size", s).map_err(|e| e.to_string()))
            .collect::<Result<_, _>>()?;
        println!("# toroid-sim: {model}");
        for (i, &n) in cli.ranks.iter().enumerate() {
            let k = cli.per_host.max(1);
            if n % k != 0 {
                return Err(format!("{n} ranks do not fill hosts of {k}"));
            }
            let mut shape = Shape::uniform(n, n / k);
            shape.nics = cli.nics;
            if let Some(g) = cli.grid.get(i) {
                let (x, y) = toroid::internals::topology::parse_shape(g).map_err(|e| e.to_string())?;
                if x * y != n {
                    return Err(format!("grid {g} does not have {n} ranks"));
                }
                shape.grid = (x, y);
                shape.rows_are_hosts = x == k;
            }
            let (x, y) = shape.grid;
            let m = n / k;
            println!();
            println!("## N = {n}: {m} hosts x {k} ranks, {} NIC(s) per host, torus grid {x}x{y}", cli.nics);
            println!(
                "#  ring 2(N-1) = {}, torus2d 2(X-1)+2(Y-1) = {}, hring 4(k-1)+2(N/k-1) = {}",
                2 * (n - 1),
                2 * (x - 1) + 2 * (y - 1),
                4 * (k - 1) + 2 * (m - 1)
            );
            let b = *sizes.last().unwrap_or(&(100 << 20)) as f64;
            println!(
                "#  inter-host phase, bytes per rank for {:.0} MB: torus2d column all-reduce {:.3} MB \
                 (2(Y-1)/Y * n/X), hring ring among roots {:.3} MB (2(m-1)/m * n): {:.1}x less",
                b / 1e6,
                2.0 * (y as f64 - 1.0) / y as f64 * b / x as f64 / 1e6,
                2.0 * (m as f64 - 1.0) / m as f64 * b / 1e6,
                (2.0 * (m as f64 - 1.0) / m as f64 * b) / (2.0 * (y as f64 - 1.0) / y as f64 * b / x as f64)
            );
            print!("{:<10} {:>7} {:>16}", "algorithm", "steps", "host link (MB)");
            for s in &sizes {
                print!(" {:>12}", format!("{}B", toroid_size(*s)));
            }
            println!();
            let algos = [
                Algorithm::Ring,
                Algorithm::HierarchicalRing,
                Algorithm::Torus2d,
                Algorithm::HalvingDoubling,
                Algorithm::Doubling,
            ];
            let best: Vec<f64> = sizes
                .iter()
                .map(|&s| {
                    algos.iter().map(|a| model.predict(*a, s, &shape).time).fold(f64::INFINITY, f64::min)
                })
                .collect();
            for a in algos {
                let big = model.predict(a, *sizes.last().unwrap_or(&1), &shape);
                print!("{:<10} {:>7} {:>16.3}", a.name(), big.steps, big.inter_bytes / 1e6);
                for (j, &s) in sizes.iter().enumerate() {
                    let t = model.predict(a, s, &shape).time;
                    let mark = if t <= best[j] { "*" } else { " " };
                    print!(" {:>11}{mark}", human(t));
                }
                println!();
            }
        }
        Ok(())
    };
    if let Err(e) = run() {
        eprintln!("toroid-sim: {e}");
        std::process::exit(2);
    }
}

fn toroid_size(b: usize) -> String {
    for (shift, suffix) in [(30, "G"), (20, "M"), (10, "K")] {
        if b >= 1 << shift && b.is_multiple_of(1 << shift) {
            return format!("{}{suffix}", b >> shift);
        }
    }
    b.to_string()
}
