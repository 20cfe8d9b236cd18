//! `cargo xtask bench tail`: where a connection that waits 1 s for its SYN
//! comes from (see `lb_lab::tail`). Writes `docs/bench/tail.md` and
//! `tail.json` for the default size and every case once; other runs only print.

use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::Parser;
use lb_lab::{Binaries, tail};

const DEFAULT_REQUESTS: u32 = 60_000;

#[derive(Parser, Debug)]
#[command(
    name = "lb-bench-tail",
    about = "ApacheBench through the VIP with and without SNAT tuples reused inside TIME_WAIT"
)]
struct Args {
    /// Connections per case.
    #[arg(long, default_value_t = DEFAULT_REQUESTS)]
    requests: u32,
    /// ab runs per case (the connections split evenly).
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// Only the cases whose name contains this (e.g. "inside").
    #[arg(long)]
    only: Option<String>,
    /// Run the chosen cases this many times each, one after the other.
    #[arg(long, default_value_t = 1)]
    repeat: u32,
    /// Output directory (written only at the default size, every case once).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/bench"))]
    out: PathBuf,
}

fn main() {
    lb_lab::lab::exit_with("lb-bench-tail", run(Args::parse()))
}

fn run(args: Args) -> Result<()> {
    // Ctrl-C or SIGTERM removes this run's labs before it exits.
    lb_lab::lab::clean_up_on_signals("lb-bench-tail")?;
    if !lb_lab::root::is_root() {
        bail!("the benchmark builds network namespaces and attaches XDP: run it as root");
    }
    if args.rounds == 0 || args.requests < args.rounds {
        bail!("--rounds must be at least 1 and at most --requests");
    }
    let machine = machine()?;
    let chosen: Vec<tail::Case> = tail::Case::all()
        .into_iter()
        .filter(|c| {
            args.only
                .as_ref()
                .is_none_or(|o| c.name.contains(o.as_str()))
        })
        .collect();
    if chosen.is_empty() || args.repeat == 0 || args.repeat > 20 {
        bail!("--only matches no case, or --repeat is not 1..=20");
    }
    let cases: Vec<tail::Case> = (0..args.repeat).flat_map(|_| chosen.clone()).collect();
    let outcomes = tail::run(&Binaries::locate()?, &cases, args.requests, args.rounds)?;
    let md = tail::markdown(&outcomes, &machine);
    println!("{md}");
    if args.requests == DEFAULT_REQUESTS && args.only.is_none() && args.repeat == 1 {
        std::fs::create_dir_all(&args.out)?;
        std::fs::write(args.out.join("tail.md"), &md)?;
        std::fs::write(
            args.out.join("tail.json"),
            serde_json::to_string_pretty(&outcomes)?,
        )?;
        eprintln!(
            "bench tail: wrote {}/tail.md and tail.json",
            args.out.display()
        );
    }
    Ok(())
}

fn machine() -> Result<String> {
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")?;
    Ok(format!("{cpus} CPUs, kernel {}", kernel.trim()))
}
