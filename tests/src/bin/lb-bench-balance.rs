//! `cargo xtask bench balance`: our algorithms against HAProxy, nginx,
//! nftables and an oracle, in the namespace lab with real backend servers.
//! Writes `balance.md`, `balance.json` and one `balance-<scenario>.png`
//! latency CDF per scenario (see `lb_lab::balance`). A run of some
//! scenarios (`--scenario`) replaces their tables and plots and keeps the
//! published results of the others. A run that publishes to `docs/bench/`
//! also rewrites the README's generated section with the same tables.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Parser;
use lb_lab::{
    Binaries,
    balance::{
        self, Plan, RowResult, plot, report,
        scenario::{self, Kind, Row},
    },
};

/// Where a run publishes by default.
const PUBLISHED_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/bench");

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
    /// Only these scenarios (hetero, stall, degrade, zones, recover, and the
    /// held-out hetero-20 and big-slow); repeatable.
    #[arg(long = "scenario")]
    scenarios: Vec<String>,
    /// Only rows whose name contains this text (e.g. "p2c", "haproxy"); repeatable.
    #[arg(long = "row")]
    rows: Vec<String>,
    /// Open-loop load in percent of each pool's capacity (10 to 100). Any
    /// other than 70 publishes its own tables ("hetero at 85%").
    #[arg(long, default_value_t = scenario::LOAD_PERCENT,
          value_parser = clap::value_parser!(u32).range(10..=100))]
    load: u32,
    /// Load duration per row in seconds (overrides --quick).
    #[arg(long)]
    duration_s: Option<f64>,
    /// An extra lb-user argument for our rows (repeatable; e.g.
    /// `--lb-arg=--health-check --lb-arg=http`), to compare settings.
    #[arg(long = "lb-arg", allow_hyphen_values = true)]
    lb_args: Vec<String>,
    /// Appended to our rows' names (e.g. "probes"), to tell runs apart.
    #[arg(long)]
    lb_suffix: Option<String>,
    /// Output directory.
    #[arg(long, default_value = PUBLISHED_DIR)]
    out: PathBuf,
    /// The README whose generated section gets the tables (default: the
    /// workspace's README when `--out` is the default, none otherwise).
    #[arg(long)]
    readme: Option<PathBuf>,
}

fn main() {
    lb_lab::lab::exit_with("lb-bench-balance", run(Args::parse()))
}

fn run(args: Args) -> Result<()> {
    // Ctrl-C or SIGTERM removes this run's labs before it exits.
    lb_lab::lab::clean_up_on_signals("lb-bench-balance")?;
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
                    .with_context(|| {
                        let known: Vec<&str> = Kind::ALL.iter().map(|k| k.name()).collect();
                        format!("unknown scenario '{s}' ({})", known.join(", "))
                    })
            })
            .collect::<Result<_>>()?
    };
    let rows: Vec<Row> = Row::all()
        .into_iter()
        .filter(|r| args.rows.is_empty() || args.rows.iter().any(|f| r.name().contains(f.as_str())))
        .collect();
    let runs: usize = scenarios
        .iter()
        .map(|k| rows.iter().filter(|&&r| k.runs(r)).count())
        .sum();
    // The rows some chosen scenario runs: only they need their peer.
    let rows_run: Vec<Row> = rows
        .iter()
        .copied()
        .filter(|&r| scenarios.iter().any(|k| k.runs(r)))
        .collect();
    if runs == 0 {
        bail!("no row matches {:?} in the chosen scenarios", args.rows);
    }
    let duration_s = args.duration_s.unwrap_or(if args.quick {
        QUICK_DURATION_S
    } else {
        FULL_DURATION_S
    });
    balance::peers::ensure_installed(&rows_run)?;
    let binaries = Binaries::locate()?;
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let publishing =
        std::fs::canonicalize(&args.out).ok() == std::fs::canonicalize(PUBLISHED_DIR).ok();
    let readme = args
        .readme
        .clone()
        .or_else(|| publishing.then(lb_lab::readme::workspace_readme));
    if let Some(readme) = &readme {
        // Checked before a run of half an hour, not after it.
        let text = std::fs::read_to_string(readme)
            .with_context(|| format!("reading {}", readme.display()))?;
        lb_lab::readme::section(&text, lb_lab::readme::BALANCE_SECTION)
            .with_context(|| format!("{} cannot take the tables", readme.display()))?;
    }
    let plan = Plan {
        scenarios,
        rows,
        duration_s,
        load_percent: args.load,
        lb_args: args.lb_args,
        lb_suffix: args.lb_suffix,
    };
    eprintln!(
        "bench: {} scenario(s), {runs} row run(s), {duration_s} s of load each at {}% of capacity",
        plan.scenarios.len(),
        plan.load_percent,
    );
    let results = balance::run(&binaries, &plan, |r| {
        eprintln!(
            "bench: {:8} {:34} {:6.0} req/s  errors {:5}  p50 {:6.1}  p99 {:7.1}  p99.9 {:7.1} ms  {} {:5.1}%",
            r.scenario,
            r.row,
            r.achieved_rps,
            r.errors,
            r.p50_ms,
            r.p99_ms,
            r.p999_ms,
            if r.cross_zone_share.is_some() {
                "cross-zone"
            } else {
                "slow"
            },
            r.cross_zone_share.unwrap_or(r.slow_share) * 100.0
        );
    })?;
    write_outputs(&args.out, readme.as_deref(), &results)
}

fn write_outputs(
    out: &std::path::Path,
    readme: Option<&std::path::Path>,
    results: &[RowResult],
) -> Result<()> {
    let json_path = out.join("balance.json");
    let previous: Vec<RowResult> = match std::fs::read_to_string(&json_path) {
        Ok(text) => serde_json::from_str(&text)
            .with_context(|| format!("reading the published {}", json_path.display()))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(e).with_context(|| format!("reading {}", json_path.display())),
    };
    let published = report::merge_published(previous, results);
    let mut kept: Vec<&str> = published
        .iter()
        .filter(|p| !results.iter().any(|r| r.scenario == p.scenario))
        .map(|p| p.scenario.as_str())
        .collect();
    kept.dedup();
    if !kept.is_empty() {
        eprintln!(
            "bench: kept the published results of {} (not run now)",
            kept.join(", ")
        );
    }
    let md = report::markdown(&published);
    std::fs::write(out.join("balance.md"), &md)?;
    std::fs::write(&json_path, serde_json::to_string_pretty(&published)?)?;
    // Plots of the scenarios run now only; the others' stay as published.
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
        let file = scenario.replace(" at ", "-").replace('%', "");
        let path = out.join(format!("balance-{file}.png"));
        plot::latency_cdf(&path, &format!("{scenario}: latency CDF"), &series)?;
    }
    println!("{md}");
    eprintln!(
        "bench: wrote {}/balance.md, balance.json and balance-*.png",
        out.display()
    );
    if let Some(readme) = readme {
        lb_lab::readme::update_file(readme, lb_lab::readme::BALANCE_SECTION, &md)?;
        eprintln!("bench: wrote the tables into {}", readme.display());
    }
    Ok(())
}
