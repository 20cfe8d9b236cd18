//! `cargo xtask bench balance`: our algorithms against HAProxy, nginx,
//! nftables and an oracle, in the namespace lab with real backend servers.
//! Writes `balance.md`, `balance.json` and one `balance-<scenario>.png`
//! latency CDF per scenario (see `lb_lab::balance`).

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Parser;
use lb_lab::{
    Binaries,
    balance::{
        self, Plan, RowResult, plot, report,
        scenario::{Kind, Row},
    },
};

/// Load duration of each row in a full run and with `--quick`.
const FULL_DURATION_S: f64 = 15.0;
const QUICK_DURATION_S: f64 = 6.0;

#[derive(Parser, Debug)]
#[command(
    name = "lb-bench-balance",
    about = "Balancing benchmark against HAProxy, nginx, nftables"
)]
struct Args {
    /// Short runs (6 s per row instead of 15 s), for iteration.
    #[arg(long)]
    quick: bool,
    /// Only these scenarios (hetero, stall, degrade); repeatable.
    #[arg(long = "scenario")]
    scenarios: Vec<String>,
    /// Only rows whose name contains this text (e.g. "p2c", "haproxy"); repeatable.
    #[arg(long = "row")]
    rows: Vec<String>,
    /// Load duration per row in seconds (overrides --quick).
    #[arg(long)]
    duration_s: Option<f64>,
    /// Output directory.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/bench"))]
    out: PathBuf,
}

fn main() {
    if let Err(e) = run(Args::parse()) {
        eprintln!("lb-bench-balance: error: {e:#}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<()> {
    if !lb_lab::root::is_root() {
        bail!("the benchmark builds network namespaces and attaches XDP: run it as root");
    }
    let scenarios: Vec<Kind> = if args.scenarios.is_empty() {
        Kind::ALL.to_vec()
    } else {
        args.scenarios
            .iter()
            .map(|s| {
                Kind::ALL
                    .into_iter()
                    .find(|k| k.name() == s)
                    .with_context(|| format!("unknown scenario '{s}' (hetero, stall, degrade)"))
            })
            .collect::<Result<_>>()?
    };
    let rows: Vec<Row> = Row::all()
        .into_iter()
        .filter(|r| args.rows.is_empty() || args.rows.iter().any(|f| r.name().contains(f.as_str())))
        .collect();
    if rows.is_empty() {
        bail!("no row matches {:?}", args.rows);
    }
    let duration_s = args.duration_s.unwrap_or(if args.quick {
        QUICK_DURATION_S
    } else {
        FULL_DURATION_S
    });
    balance::peers::ensure_installed()?;
    let binaries = Binaries::locate()?;
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let plan = Plan {
        scenarios,
        rows,
        duration_s,
    };
    eprintln!(
        "bench: {} scenario(s) × {} row(s), {duration_s} s of load each",
        plan.scenarios.len(),
        plan.rows.len()
    );
    let results = balance::run(&binaries, &plan, |r| {
        eprintln!(
            "bench: {:8} {:34} {:6.0} req/s  errors {:5}  p50 {:6.1}  p99 {:7.1}  p99.9 {:7.1} ms  slow {:5.1}%",
            r.scenario,
            r.row,
            r.achieved_rps,
            r.errors,
            r.p50_ms,
            r.p99_ms,
            r.p999_ms,
            r.slow_share * 100.0
        );
    })?;
    write_outputs(&args.out, &results)
}

fn write_outputs(out: &std::path::Path, results: &[RowResult]) -> Result<()> {
    let md = report::markdown(results);
    std::fs::write(out.join("balance.md"), &md)?;
    std::fs::write(
        out.join("balance.json"),
        serde_json::to_string_pretty(results)?,
    )?;
    let mut scenarios: Vec<&str> = results.iter().map(|r| r.scenario.as_str()).collect();
    scenarios.dedup();
    for scenario in scenarios {
        let series: Vec<plot::Series> = results
            .iter()
            .filter(|r| r.scenario == scenario)
            .map(|r| plot::Series {
                label: &r.row,
                points: &r.cdf,
            })
            .collect();
        let path = out.join(format!("balance-{scenario}.png"));
        plot::latency_cdf(&path, &format!("{scenario}: latency CDF"), &series)?;
    }
    println!("{md}");
    eprintln!(
        "bench: wrote {}/balance.md, balance.json and balance-*.png",
        out.display()
    );
    Ok(())
}
