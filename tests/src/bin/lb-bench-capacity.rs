//! `cargo xtask bench capacity`: the new-connection rate one VIP with one
//! backend and 4 SNAT addresses sustains with nothing refused and no SYN
//! retransmitted, against the client's own ceiling measured in the same
//! run (see `lb_lab::capacity`). A run at the 60 s writes
//! `capacity.md` and `capacity.json`; shorter runs only print.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Parser;
use lb_lab::{
    Binaries,
    capacity::{
        self, CapacityReport, Plan,
        report::{TARGET_DURATION_S, TARGET_PER_S, parse_duration_s},
    },
};

#[derive(Parser, Debug)]
#[command(
    name = "lb-bench-capacity",
    about = "New connections/s through one VIP to one backend, against the client's ceiling"
)]
struct Args {
    /// Target rate (new connections a second).
    #[arg(long, default_value_t = TARGET_PER_S)]
    target: f64,
    /// Length of each run through the VIP (e.g. 60s, 10s).
    #[arg(long, default_value = "60s", value_parser = parse_duration_s)]
    duration: f64,
    /// Length of each run of the ceiling search (straight to the backend).
    #[arg(long, default_value = "10s", value_parser = parse_duration_s)]
    ceiling_step: f64,
    /// First rate of the ceiling search.
    #[arg(long, default_value_t = 1_000.0)]
    ceiling_start: f64,
    /// Highest rate the ceiling search tries (default: twice the target).
    #[arg(long)]
    ceiling_max: Option<f64>,
    /// Bisection runs after the ceiling search's first miss.
    #[arg(long, default_value_t = 3)]
    ceiling_refine: u32,
    /// Lower runs through the VIP when the goal is missed (bisection).
    #[arg(long, default_value_t = 4)]
    refine: u32,
    /// SNAT addresses (`--snat-ip` repeated).
    #[arg(long, default_value_t = 4)]
    snat_addresses: u32,
    /// Run on the lab's plain interfaces instead of emulating a real NIC's
    /// RSS. By default the balancer's veth pair has one queue per CPU (the
    /// bridge spreads flows over them by hash) and receive packet steering
    /// keeps each flow on one CPU on every interface. Without that a veth
    /// hands a frame to the CPU that sent it, so a flow's segments can be
    /// reordered across CPUs, and the balancer's single 256-frame XDP ring
    /// drops bursts (README, "Capacity").
    #[arg(long)]
    no_rss: bool,
    /// Output directory (written only when --duration is the 60 s).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/bench"))]
    out: PathBuf,
    /// Measure nothing: print the markdown of a `capacity.json` written before.
    #[arg(long)]
    render: Option<PathBuf>,
}

fn main() {
    lb_lab::lab::exit_with("lb-bench-capacity", run(Args::parse()))
}

fn run(args: Args) -> Result<()> {
    // Ctrl-C or SIGTERM removes this run's labs before it exits.
    lb_lab::lab::clean_up_on_signals("lb-bench-capacity")?;
    if let Some(json) = &args.render {
        let text =
            std::fs::read_to_string(json).with_context(|| format!("reading {}", json.display()))?;
        let report: CapacityReport =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", json.display()))?;
        print!("{}", report.markdown());
        return Ok(());
    }
    if !lb_lab::root::is_root() {
        bail!("the benchmark builds network namespaces and attaches XDP: run it as root");
    }
    let ceiling_max = args.ceiling_max.unwrap_or(2.0 * args.target);
    if args.target <= 0.0 || args.ceiling_start <= 0.0 || ceiling_max < args.ceiling_start {
        bail!(
            "--target and --ceiling-start must be positive, --ceiling-max at least --ceiling-start"
        );
    }
    let plan = Plan {
        target_per_s: args.target,
        duration_s: args.duration,
        ceiling_step_s: args.ceiling_step,
        ceiling_start_per_s: args.ceiling_start,
        ceiling_max_per_s: ceiling_max,
        ceiling_refinements: args.ceiling_refine,
        vip_refinements: args.refine,
        snat_addresses: args.snat_addresses,
        steer_flows: !args.no_rss,
    };
    let report = capacity::run(&Binaries::locate()?, &plan)?;
    let md = report.markdown();
    println!("{md}");
    if args.duration == TARGET_DURATION_S && args.target == TARGET_PER_S {
        std::fs::create_dir_all(&args.out)?;
        std::fs::write(args.out.join("capacity.md"), &md)?;
        std::fs::write(
            args.out.join("capacity.json"),
            serde_json::to_string_pretty(&report)?,
        )?;
        eprintln!(
            "bench capacity: wrote {}/capacity.md and capacity.json",
            args.out.display()
        );
    } else {
        eprintln!("bench capacity: not the issue's 10,000/s for 60 s: nothing written");
    }
    if !report.pass() {
        eprintln!("bench capacity: goal missed");
    }
    Ok(())
}
