//! `cargo xtask demo`: one 10×-slower backend among four, under open-loop
//! load, first balanced by P2C over Peak-EWMA, then by round-robin.
//!
//! Every second it prints what the balancer reports per backend (its share of
//! the new connections, in-flight count, EWMA latency), and at the end the
//! client-side latency percentiles and the slow backend's share per
//! algorithm. Needs root. The lab removes itself at the end, and also after
//! Ctrl-C: SIGINT only sets a flag, so the run stops between ticks and the
//! lab's `Drop` still runs.

use std::{
    collections::BTreeMap,
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use clap::Parser;
use lb_lab::{
    Binaries, Lab,
    lab::{Algorithm, BackendSpec, XdpMode},
    loadgen::{LoadConfig, Protocol, Summary},
    netcounters,
    root::is_root,
    status::Status,
};
use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, sigaction};

/// How often the live table is printed.
const TICK: Duration = Duration::from_secs(1);

/// Defaults sized for a 2-core machine: 3 fast backends at 2 workers / 5 ms
/// (400 req/s each) and one slow at 2 workers / 50 ms (40 req/s) make a pool
/// of 1240 req/s; 800 req/s keeps it at about 65% of capacity, well inside
/// what the lab's veths and the load generator sustain (about 3000 new
/// connections a second measured directly). Round-robin still sends the slow
/// one a quarter of the load, five times its capacity: that is the point.
#[derive(Parser, Debug)]
#[command(
    name = "lb-demo",
    about = "P2C vs round-robin with one slow backend, in a namespace lab"
)]
struct Args {
    /// Seconds of load per algorithm.
    #[arg(long, default_value_t = 15.0)]
    duration_s: f64,
    /// New connections per second (open loop).
    #[arg(long, default_value_t = 800.0)]
    rate: f64,
    /// Service time of the fast backends.
    #[arg(long, default_value_t = 5)]
    fast_ms: u64,
    /// How many times slower the slow backend is.
    #[arg(long, default_value_t = 10)]
    slowdown: u64,
    /// Worker slots of every backend.
    #[arg(long, default_value_t = 2)]
    workers: u32,
    /// Per-request timeout of the load generator.
    #[arg(long, default_value_t = 10_000)]
    timeout_ms: u64,
    /// XDP attach mode of the balancer.
    #[arg(long, default_value = "native", value_parser = ["native", "skb"])]
    xdp_mode: String,
}

/// Set by SIGINT/SIGTERM; checked once per tick.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_interrupt(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::Relaxed);
}

/// Turns SIGINT and SIGTERM into a flag instead of an exit that would skip
/// the lab's cleanup.
fn catch_interrupts() -> Result<()> {
    let action = SigAction::new(
        SigHandler::Handler(on_interrupt),
        SaFlags::empty(),
        SigSet::empty(),
    );
    for signal in [Signal::SIGINT, Signal::SIGTERM] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe { sigaction(signal, &action) }
            .with_context(|| format!("installing a {signal} handler"))?;
    }
    Ok(())
}

/// What one algorithm's run produced.
struct Outcome {
    algorithm: Algorithm,
    client: Summary,
    /// New connections per backend address over the run (lb-user's counters).
    opened: BTreeMap<String, u64>,
}

fn main() {
    if !is_root() {
        eprintln!(
            "lb-demo: error: needs root (network namespaces and XDP); try `sudo cargo xtask demo`"
        );
        std::process::exit(1);
    }
    if let Err(error) = run(Args::parse()) {
        eprintln!("lb-demo: error: {error:#}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<()> {
    catch_interrupts()?;
    let xdp_mode = if args.xdp_mode == "skb" {
        XdpMode::Skb
    } else {
        XdpMode::Native
    };
    let fast = BackendSpec::new(args.fast_ms, args.workers);
    let slow = BackendSpec::new(args.fast_ms * args.slowdown, args.workers);
    println!(
        "Building the lab: client, balancer, 3 backends at {} ms and 1 at {} ms, {} workers each ...",
        fast.service_time_ms, slow.service_time_ms, args.workers
    );
    let lab = Lab::builder(Binaries::locate()?)
        .backends(3, fast)
        .backend(slow)
        .build()?;
    let slow_addr = lab.backends()[3].addr().to_string();
    let mut outcomes = Vec::new();
    for algorithm in [Algorithm::P2cEwma, Algorithm::RoundRobin] {
        outcomes.push(run_algorithm(&lab, &args, algorithm, xdp_mode)?);
    }
    print_comparison(&outcomes, &slow_addr, lab.backends().len());
    println!("\nCleaning up the lab ...");
    Ok(())
}

fn run_algorithm(
    lab: &Lab,
    args: &Args,
    algorithm: Algorithm,
    xdp_mode: XdpMode,
) -> Result<Outcome> {
    println!(
        "\n=== {}: {} new TCP connections/s for {} s through {} ===",
        algorithm.name(),
        args.rate,
        args.duration_s,
        lab.tcp_vip()
    );
    let balancer = lab.start_balancer(&lab.balancer_spec(algorithm, xdp_mode))?;
    let load = LoadConfig {
        target: lab.tcp_vip(),
        protocol: Protocol::Tcp,
        rate: args.rate,
        duration_s: args.duration_s,
        max_requests: 10_000_000,
        timeout_ms: args.timeout_ms,
        max_outstanding: 20_000,
        path: "/".into(),
        payload_bytes: 0,
    };
    let start_counts = opened(&lab.status()?, lab)?;
    let kernel_before = netcounters::Snapshot::take(lab)?;
    let loadgen = lab.spawn_loadgen(&load)?;
    let started = Instant::now();
    let mut previous = start_counts.clone();
    let load_duration = Duration::from_secs_f64(args.duration_s);
    let mut draining = false;
    while lab.exit_status(loadgen)?.is_none() {
        std::thread::sleep(TICK);
        if INTERRUPTED.load(Ordering::Relaxed) {
            bail!("interrupted; removing the lab");
        }
        if started.elapsed() > load_duration + TICK {
            if !draining {
                println!("load sent; waiting for outstanding requests to finish or time out ...");
                draining = true;
            }
            continue;
        }
        let status = lab.status()?;
        let now = opened(&status, lab)?;
        let elapsed = started.elapsed();
        print_live(lab, &status, elapsed, &previous, &now, &start_counts);
        previous = now;
    }
    let client = lab.loadgen_summary(loadgen, &load)?;
    let end_status = lab.status()?;
    let end_counts = opened(&end_status, lab)?;
    let drops: BTreeMap<_, _> = end_status
        .reasons
        .iter()
        .filter(|(name, count)| name.starts_with("drop") && **count > 0)
        .collect();
    println!("balancer drop counters: {drops:?}");
    let kernel = kernel_before.delta(&netcounters::Snapshot::take(lab)?);
    println!(
        "client SYN retransmits: {} (each a connection that waited >= 1 s); kernel loss counters that moved: {}",
        kernel.in_role("cl", "TcpExtTCPSynRetrans"),
        kernel.summary()
    );
    let exit = lab.stop_balancer(balancer, Signal::SIGTERM)?;
    if !exit.success() {
        bail!(
            "lb-user exited with {exit} after SIGTERM: {}",
            lab.stderr(balancer).trim()
        );
    }
    let opened = end_counts
        .iter()
        .map(|(addr, end)| {
            (
                addr.clone(),
                end - start_counts.get(addr).copied().unwrap_or(0),
            )
        })
        .collect();
    Ok(Outcome {
        algorithm,
        client,
        opened,
    })
}

/// Connections opened so far per backend address, on the TCP VIP.
fn opened(status: &Status, lab: &Lab) -> Result<BTreeMap<String, u64>> {
    let vip = status
        .vip(&lab.tcp_vip().to_string())
        .context("the TCP VIP is missing from lb-user status")?;
    Ok(vip
        .backends
        .iter()
        .map(|b| (b.address.clone(), b.opened))
        .collect())
}

fn share(part: u64, total: u64) -> f64 {
    100.0 * part as f64 / total.max(1) as f64
}

fn print_live(
    lab: &Lab,
    status: &Status,
    elapsed: Duration,
    previous: &BTreeMap<String, u64>,
    now: &BTreeMap<String, u64>,
    start: &BTreeMap<String, u64>,
) {
    let delta =
        |from: &BTreeMap<String, u64>, addr: &str| now[addr] - from.get(addr).copied().unwrap_or(0);
    let tick_total: u64 = now.keys().map(|a| delta(previous, a)).sum();
    let run_total: u64 = now.keys().map(|a| delta(start, a)).sum();
    println!(
        "t={:>4.1}s  {:<5} {:<17} {:>8} {:>7} {:>9} {:>9} {:>9}",
        elapsed.as_secs_f64(),
        "name",
        "backend",
        "service",
        "new/s",
        "share",
        "run share",
        "inflight"
    );
    let Some(vip) = status.vip(&lab.tcp_vip().to_string()) else {
        return;
    };
    for backend in &vip.backends {
        let name = lab
            .backends()
            .iter()
            .find(|b| b.addr().to_string() == backend.address);
        println!(
            "         {:<5} {:<17} {:>5} ms {:>7} {:>8.1}% {:>8.1}% {:>9}   ewma {:>7.2} ms",
            name.map_or("?", |b| b.name.as_str()),
            backend.address,
            name.map_or(0, |b| b.spec.service_time_ms),
            delta(previous, &backend.address),
            share(delta(previous, &backend.address), tick_total),
            share(delta(start, &backend.address), run_total),
            backend.inflight,
            backend.ewma_ms,
        );
    }
}

fn print_comparison(outcomes: &[Outcome], slow_addr: &str, backends: usize) {
    let fair = 100.0 / backends as f64;
    println!("\n=== Comparison (client-side latency from the scheduled send time) ===");
    println!(
        "{:<12} {:>9} {:>7} {:>8} {:>8} {:>9} {:>9} {:>11} {:>10}",
        "algorithm",
        "completed",
        "errors",
        "P50 ms",
        "P99 ms",
        "P99.9 ms",
        "max ms",
        "slow share",
        "vs fair"
    );
    for outcome in outcomes {
        let total: u64 = outcome.opened.values().sum();
        let slow = share(outcome.opened.get(slow_addr).copied().unwrap_or(0), total);
        let latency = &outcome.client.latency_ms;
        println!(
            "{:<12} {:>9} {:>7} {:>8.1} {:>8.1} {:>9.1} {:>9.1} {:>10.1}% {:>9.2}×",
            outcome.algorithm.name(),
            outcome.client.completed,
            outcome.client.error_count(),
            latency.p50,
            latency.p99,
            latency.p999,
            latency.max,
            slow,
            slow / fair,
        );
    }
    println!("(fair share of each backend: {fair:.1}%; the slow backend is {slow_addr})");
    for outcome in outcomes.iter().filter(|o| o.client.error_count() > 0) {
        println!(
            "{} errors by kind: {:?}",
            outcome.algorithm.name(),
            outcome.client.errors
        );
    }
}
