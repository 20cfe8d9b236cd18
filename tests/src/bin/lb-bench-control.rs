//! `cargo xtask bench control`: what lb-user itself costs, against the
//! targets of issue 10, in the namespace lab (see `lb_lab::control_bench`).
//! A full run writes `control.md` and `control.json`; a run of some parts
//! (`--part`) only prints its table. Exits non-zero when any part could
//! not be measured.

use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::Parser;
use lb_lab::{
    Binaries,
    control_bench::{self, Part, Plan},
};

#[derive(Parser, Debug)]
#[command(
    name = "lb-bench-control",
    about = "Control-plane cost of lb-user against issue 10's targets"
)]
struct Args {
    /// Only these parts; repeatable (default: all, and the report is written).
    #[arg(long = "part", value_enum)]
    parts: Vec<Part>,
    /// New connections per second in the connections part.
    #[arg(long, default_value_t = 1_000.0)]
    rate: f64,
    /// Seconds of load in the connections part.
    #[arg(long, default_value_t = 15.0)]
    load_s: f64,
    /// Seconds of each idle window (full table, score ticks).
    #[arg(long, default_value_t = 20.0)]
    window_s: f64,
    /// Backends added one by one to the Maglev VIP.
    #[arg(long, default_value_t = 20)]
    adds: usize,
    /// Output directory.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/bench"))]
    out: PathBuf,
}

fn main() {
    lb_lab::lab::exit_with("lb-bench-control", run(Args::parse()))
}

fn run(args: Args) -> Result<()> {
    // Ctrl-C or SIGTERM removes this run's labs before it exits.
    lb_lab::lab::clean_up_on_signals("lb-bench-control")?;
    if !lb_lab::root::is_root() {
        bail!("the benchmark builds network namespaces and attaches XDP: run it as root");
    }
    if args.rate <= 0.0 || args.load_s <= 0.0 || args.window_s <= 0.0 || args.adds == 0 {
        bail!("--rate, --load-s, --window-s and --adds must be positive");
    }
    let full = args.parts.is_empty();
    let plan = Plan {
        parts: if full {
            Part::ALL.to_vec()
        } else {
            args.parts.clone()
        },
        rate_per_s: args.rate,
        load_s: args.load_s,
        window_s: args.window_s,
        maglev_adds: args.adds,
    };
    let binaries = Binaries::locate()?;
    let (report, errors) = control_bench::run(&binaries, &plan)?;
    let md = report.markdown();
    println!("{md}");
    if !errors.is_empty() {
        bail!("not measured (nothing written): {}", errors.join("; "));
    }
    if full {
        std::fs::create_dir_all(&args.out)?;
        std::fs::write(args.out.join("control.md"), &md)?;
        std::fs::write(
            args.out.join("control.json"),
            serde_json::to_string_pretty(&report)?,
        )?;
        eprintln!(
            "bench control: wrote {}/control.md and control.json",
            args.out.display()
        );
    }
    let missed: Vec<String> = report
        .rows()
        .into_iter()
        .filter(|r| !r.pass)
        .map(|r| r.target)
        .collect();
    if !missed.is_empty() {
        eprintln!("bench control: targets missed: {}", missed.join("; "));
    }
    Ok(())
}
