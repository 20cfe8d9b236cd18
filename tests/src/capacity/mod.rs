//! The capacity benchmark (`cargo xtask bench capacity`, issue 9): the
//! new-connection rate one VIP with one backend sustains, with 4 SNAT
//! addresses, 0 refused and 0 SYN retransmits.
//!
//! 1. **Ceiling.** The client's own limit, measured in the same lab: open
//!    loop runs straight to the backend (no balancer in the path), a new
//!    connection per request, upward from 1,000/s ([`RateSearch`]).
//! 2. **Through the VIP.** A fresh lb-user per run (its own flow table,
//!    and its own 4 SNAT addresses, so no run meets the backend's
//!    TIME_WAIT of an earlier one), first at min(target, ceiling), then
//!    lower by bisection when missed. (Before time-wait reuse the search
//!    stayed below the quarantine's bound, [`SnatBudget::run_per_s`];
//!    that bound is still reported, for comparison.)
//!
//! Every run reads the client namespace's SYN retransmits with `nstat`
//! before and after; runs through the VIP also read lb-user's metrics
//! (refused, drops, ring-buffer events, flow-table entries once a second)
//! and the balancer namespace's CPU from /proc. The lab removes everything
//! when dropped, also on failure.

pub mod report;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{Ipv4Addr, SocketAddr},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use nix::sys::signal::Signal;

use self::report::{BalancerSide, parse_nstat};
pub use self::report::{CapacityReport, RateSearch, SnatBudget, Step};
use crate::{
    Binaries, Lab,
    balance::cpu,
    control_bench::{
        report::thousands,
        scrape::{self, Sample},
    },
    lab::{Algorithm, BackendSpec, BalancerSpec, Protocol, VipSpec},
    loadgen::{self, LoadConfig, Summary},
    netcounters::Snapshot,
};

/// How hard and how long.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Issue 9's 10,000/s, unless told otherwise.
    pub target_per_s: f64,
    /// Length of each run through the VIP.
    pub duration_s: f64,
    /// Length of each run of the ceiling search.
    pub ceiling_step_s: f64,
    /// First rate of the ceiling search, and where it stops going up.
    pub ceiling_start_per_s: f64,
    pub ceiling_max_per_s: f64,
    /// Bisection runs after the first miss (ceiling, and through the VIP).
    pub ceiling_refinements: u32,
    pub vip_refinements: u32,
    /// SNAT addresses of lb-user (`--snat-ip` repeated).
    pub snat_addresses: u32,
    /// RSS as on a real NIC: one queue per CPU on the balancer's veth pair
    /// (`LabBuilder::balancer_queues`) and receive packet steering on
    /// every interface (`Lab::steer_flows_by_hash`).
    pub steer_flows: bool,
}

/// SNAT ports given to lb-user. The balancer namespace's own ephemeral
/// ports (metrics scrapes) move above them.
pub const SNAT_FIRST_PORT: u16 = 1024;
pub const SNAT_LAST_PORT: u16 = 64_511;
const BALANCER_EPHEMERAL_PORTS: &str = "64512 65535";
/// Flow table: two entries per open connection, one per quarantined tuple
/// (10,000/s × 70 s fits).
pub const FLOW_TABLE_SIZE: u64 = 1 << 20;
/// SNAT addresses are taken from here upwards, fresh ones for every run
/// through the VIP (above the VIP .100, below the broadcast).
const FIRST_SNAT_OCTET: u8 = 110;
/// Most runs through the VIP (so their addresses fit below .255).
const MAX_VIP_RUNS: u32 = 30;
/// One backend: no service time, enough slots never to queue.
const BACKEND_WORKERS: u32 = 4_096;
/// Per-request timeout (from the scheduled send).
const REQUEST_TIMEOUT_MS: u64 = 3_000;
/// Requests in flight at once before the client counts `concurrency_cap`.
const MAX_OUTSTANDING: usize = 8_000;
/// Pause before each run (a new lb-user settles, TIME_WAIT drains a little).
const SETTLE: Duration = Duration::from_secs(2);
/// After the load: a SYN unanswered for `--syn-timeout` (3 s) is counted
/// refused at the next sweep, so the window runs on past it.
const LOAD_TAIL: Duration = Duration::from_secs(5);
/// How often flow-table entries are sampled (lb-user updates them once a second).
const SAMPLE_EVERY: Duration = Duration::from_secs(1);
/// Extra time a load run may take beyond its duration and timeout.
const LOAD_SLACK: Duration = Duration::from_secs(20);
/// Drop reasons of a new flow, read from `lb_packets_total`.
const DROP_PREFIX: &str = "drop_";

/// Linux's TIME_WAIT length: a closed connection stays in the table this long.
const TIME_WAIT_S: f64 = 60.0;
/// The least TIME_WAIT table the backend gets (`tcp_max_tw_buckets`).
const MIN_BACKEND_TW_BUCKETS: u64 = 2_000_000;

/// TIME_WAIT entries the backend needs so that none is skipped: every
/// connection of a TIME_WAIT's length at the highest rate the plan runs,
/// twice over (the runs follow each other closely).
fn backend_time_wait_buckets(plan: &Plan) -> u64 {
    let rate = plan.target_per_s.max(plan.ceiling_max_per_s).max(0.0);
    ((rate * TIME_WAIT_S * 2.0) as u64).max(MIN_BACKEND_TW_BUCKETS)
}

/// Runs the ceiling search and then the search through the VIP in one lab.
pub fn run(binaries: &Binaries, plan: &Plan) -> Result<CapacityReport> {
    ensure!(
        plan.vip_refinements < MAX_VIP_RUNS,
        "at most {} refinements through the VIP",
        MAX_VIP_RUNS - 1
    );
    ensure!(
        (1..=16).contains(&plan.snat_addresses),
        "1 to 16 SNAT addresses"
    );
    let machine = machine()?;
    let cpus = crate::lab::rss_cpus();
    let lab = Lab::builder(binaries.clone())
        .backends(1, BackendSpec::new(0, BACKEND_WORKERS))
        .balancer_queues(if plan.steer_flows { cpus } else { 1 })
        .build()
        .context("building the lab")?;
    let client = lab.client().ns.clone();
    lab.exec_ok(
        &client,
        &["sysctl", "-qw", "net.ipv4.ip_local_port_range=1024 65000"],
    )?;
    lab.exec_ok(&client, &["sysctl", "-qw", "net.ipv4.tcp_tw_reuse=1"])?;
    // The backend keeps every connection's TIME_WAIT for the whole run, as
    // a server tuned for this rate would. With Linux's default table
    // (131,072 entries on a small VM) it filled after about 13 s at
    // 10,000/s; from then on the backend closed without TIME_WAIT and
    // answered each late FIN with an RST (`TcpExtTCPTimeWaitOverflow`,
    // the backend's `TcpOutRsts`, the client's `TcpEstabResets`), and
    // time-wait reuse met tuples the backend no longer held.
    let backend_ns = lab.backends()[0].host.ns.clone();
    let time_wait_buckets = backend_time_wait_buckets(plan);
    lab.exec_ok(
        &backend_ns,
        &[
            "sysctl",
            "-qw",
            &format!("net.ipv4.tcp_max_tw_buckets={time_wait_buckets}"),
        ],
    )?;
    lab.set_balancer_ephemeral_ports(BALANCER_EPHEMERAL_PORTS)?;
    let machine = if plan.steer_flows {
        lab.steer_flows_by_hash()?;
        format!(
            "{machine}; RSS as on a real NIC (the default; `--no-rss` turns it off): the \
             balancer's interface has {cpus} queues, and RPS keeps each flow on one CPU on every \
             interface"
        )
    } else {
        machine
    };
    let machine = format!(
        "{machine}; the backend's TIME_WAIT table holds {} entries \
         (`net.ipv4.tcp_max_tw_buckets`), so every connection keeps its TIME_WAIT for the whole run",
        thousands(time_wait_buckets)
    );
    let backend = lab.backends()[0].addr();

    let mut ceiling = RateSearch::new(
        plan.ceiling_start_per_s,
        plan.ceiling_max_per_s,
        plan.ceiling_refinements,
    );
    let mut ceiling_steps = Vec::new();
    while let Some(rate) = ceiling.next_rate() {
        eprintln!(
            "bench capacity: straight to the backend at {rate:.0}/s for {:.0} s ...",
            plan.ceiling_step_s
        );
        std::thread::sleep(SETTLE);
        let step = direct_run(&lab, backend, rate, plan.ceiling_step_s)?;
        eprintln!("bench capacity:   {}", verdict(&step));
        ceiling.record(rate, step.sustained());
        ceiling_steps.push(step);
    }
    let ceiling_per_s = ceiling.best();
    let goal = ceiling_per_s
        .map(|c| c.min(plan.target_per_s))
        .context("the client sustained no rate straight to the backend")?;

    let snat = SnatBudget {
        addresses: plan.snat_addresses,
        ports: u32::from(SNAT_LAST_PORT - SNAT_FIRST_PORT) + 1,
        quarantine_s: lb_common::DEFAULT_SNAT_QUARANTINE_NS as f64 / 1e9,
    };
    // No known limit: with `--snat-time-wait-reuse` (the default) a tuple
    // goes back into use before its quarantine ends, so the quarantine's
    // bound (`SnatBudget`, reported for comparison) is not one.
    let mut through = RateSearch::new(goal, goal, plan.vip_refinements);
    let mut vip_steps = Vec::new();
    while let Some(rate) = through.next_rate() {
        let first = vip_steps.len() as u32 * plan.snat_addresses;
        let snat: Vec<Ipv4Addr> = (first..first + plan.snat_addresses)
            .map(|i| Ipv4Addr::new(10, 213, 0, FIRST_SNAT_OCTET + i as u8))
            .collect();
        eprintln!(
            "bench capacity: through the VIP at {rate:.0}/s for {:.0} s (SNAT {}) ...",
            plan.duration_s,
            join(&snat)
        );
        let step = vip_run(&lab, backend, &snat, rate, plan.duration_s, vip_steps.len())?;
        eprintln!("bench capacity:   {}", verdict(&step));
        through.record(rate, step.sustained());
        vip_steps.push(step);
    }
    Ok(CapacityReport {
        target_per_s: plan.target_per_s,
        duration_s: plan.duration_s,
        backend: format!("{backend}"),
        vip: lab.tcp_vip().to_string(),
        snat,
        flow_table_size: FLOW_TABLE_SIZE,
        machine,
        ceiling_steps,
        ceiling_step_s: plan.ceiling_step_s,
        ceiling_per_s,
        ceiling_capped: ceiling.capped(),
        vip_steps,
        sustained_per_s: through.best(),
    })
}

fn verdict(step: &Step) -> String {
    let head = format!(
        "{} of {} answered, {:.0}/s, p99 {:.1} ms, {} SYN retransmits",
        step.completed,
        step.scheduled,
        step.achieved_per_s(),
        step.p99_ms,
        step.syn_retrans
    );
    if step.sustained() {
        format!("{head}: sustained")
    } else {
        format!("{head}: not sustained ({})", step.shortfall())
    }
}

fn join(ips: &[Ipv4Addr]) -> String {
    ips.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// CPUs, kernel release and load average, for the report.
fn machine() -> Result<String> {
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .context("reading the kernel release")?;
    let load = std::fs::read_to_string("/proc/loadavg").context("reading /proc/loadavg")?;
    let load: Vec<&str> = load.split_whitespace().take(3).collect();
    Ok(format!(
        "{cpus} CPUs, kernel {}, load average {} at the start",
        kernel.trim(),
        load.join(" ")
    ))
}

fn load_config(target: SocketAddr, rate: f64, duration_s: f64) -> LoadConfig {
    LoadConfig {
        target,
        protocol: loadgen::Protocol::Tcp,
        rate,
        duration_s,
        max_requests: u64::MAX,
        timeout_ms: REQUEST_TIMEOUT_MS,
        max_outstanding: MAX_OUTSTANDING,
        path: "/".into(),
        payload_bytes: 0,
    }
}

/// `TcpExtTCPSynRetrans` and `TcpRetransSegs` of the client namespace.
fn client_retransmits(lab: &Lab) -> Result<(u64, u64)> {
    let text = lab.exec_ok(
        &lab.client().ns,
        &["nstat", "-asz", "TcpExtTCPSynRetrans", "TcpRetransSegs"],
    )?;
    let counters = parse_nstat(&text);
    let get = |name: &str| {
        counters
            .get(name)
            .copied()
            .with_context(|| format!("no {name} in nstat's output: {text}"))
    };
    Ok((get("TcpExtTCPSynRetrans")?, get("TcpRetransSegs")?))
}

/// Fills a step from the load generator's summary and the retransmit deltas.
fn step_from(
    config: &LoadConfig,
    summary: &Summary,
    before: (u64, u64),
    after: (u64, u64),
) -> Step {
    Step {
        rate_per_s: config.rate,
        duration_s: config.duration_s,
        scheduled: summary.scheduled,
        completed: summary.completed,
        errors: summary.errors.clone(),
        elapsed_s: summary.elapsed_s,
        p99_ms: summary.latency_ms.p99,
        syn_retrans: after.0.saturating_sub(before.0),
        retrans_segs: after.1.saturating_sub(before.1),
        balancer: None,
        kernel: Default::default(),
    }
}

/// One run straight from the client to the backend.
fn direct_run(lab: &Lab, backend: SocketAddr, rate: f64, duration_s: f64) -> Result<Step> {
    let config = load_config(backend, rate, duration_s);
    let kernel = Snapshot::take(lab)?;
    let before = client_retransmits(lab)?;
    let summary = lab.run_loadgen(&config)?;
    let after = client_retransmits(lab)?;
    let mut step = step_from(&config, &summary, before, after);
    step.kernel = kernel.delta(&Snapshot::take(lab)?);
    Ok(step)
}

/// lb-user's counters that a run reads before and after.
#[derive(Default)]
struct Counters {
    opened: f64,
    refused: f64,
    events: f64,
    lost: f64,
    latency_reads: f64,
    drops: BTreeMap<String, f64>,
}

fn sum(samples: &[Sample], name: &str) -> f64 {
    samples
        .iter()
        .filter(|s| s.name == name)
        .map(|s| s.value)
        .sum()
}

fn counters(lab: &Lab) -> Result<Counters> {
    let samples = scrape::parse(&lab.scrape_metrics()?);
    ensure!(
        samples
            .iter()
            .any(|s| s.name == "lb_ring_buffer_events_total"),
        "no lb_ring_buffer_events_total in lb-user's metrics"
    );
    let drops = samples
        .iter()
        .filter(|s| s.name == "lb_packets_total")
        .filter_map(|s| {
            let reason = s.labels.get("reason")?;
            reason
                .starts_with(DROP_PREFIX)
                .then(|| (reason.clone(), s.value))
        })
        .collect();
    Ok(Counters {
        opened: sum(&samples, "lb_backend_connections_opened_total"),
        refused: sum(&samples, "lb_backend_connections_refused_total"),
        events: sum(&samples, "lb_ring_buffer_events_total"),
        lost: sum(&samples, "lb_ring_buffer_events_lost_total"),
        latency_reads: sum(&samples, "lb_latency_aggregates_read_total"),
        drops,
    })
}

fn flow_entries(lab: &Lab) -> Result<u64> {
    let samples = scrape::parse(&lab.scrape_metrics()?);
    scrape::value(&samples, "lb_flow_table_entries", &[])
        .map(|v| v as u64)
        .context("no lb_flow_table_entries in lb-user's metrics")
}

/// One run through the VIP with a fresh lb-user using `snat` addresses.
fn vip_run(
    lab: &Lab,
    backend: SocketAddr,
    snat: &[Ipv4Addr],
    rate: f64,
    duration_s: f64,
    index: usize,
) -> Result<Step> {
    let iface = lab.balancer().iface.clone();
    for ip in snat {
        lab.ip(
            &lab.balancer().ns,
            &["addr", "add", &format!("{ip}/32"), "dev", &iface],
        )?;
    }
    let state = lab.log_dir().join(format!("state-capacity-{index}"));
    let mut extra: Vec<String> = Vec::new();
    for ip in snat {
        extra.extend(["--snat-ip".into(), ip.to_string()]);
    }
    extra.extend([
        "--snat-ports".into(),
        format!("{SNAT_FIRST_PORT}-{SNAT_LAST_PORT}"),
        "--flow-table-size".into(),
        FLOW_TABLE_SIZE.to_string(),
        "--state-dir".into(),
        state.display().to_string(),
    ]);
    let mut spec = BalancerSpec::one_vip(
        VipSpec::new(lab.tcp_vip(), Protocol::Tcp, vec![(backend, 1)]),
        Algorithm::P2cEwma,
        &[],
    );
    spec.extra_args = extra;
    let config = load_config(lab.tcp_vip(), rate, duration_s);
    lab.restoring_reserved_ports(|| {
        let process = lab.start_balancer(&spec)?;
        let result = loaded(lab, &config, snat);
        let stopped = lab.stop_balancer(process, Signal::SIGTERM);
        let step = result?;
        let status = stopped?;
        ensure!(status.success(), "lb-user stopped with {status}");
        Ok(step)
    })
}

/// The load through the VIP, with lb-user's view of it.
fn loaded(lab: &Lab, config: &LoadConfig, snat: &[Ipv4Addr]) -> Result<Step> {
    std::thread::sleep(SETTLE);
    let ns = lab.balancer().ns.clone();
    let before = counters(lab)?;
    let kernel_before = Snapshot::take(lab)?;
    let retrans_before = client_retransmits(lab)?;
    let cpu_before = cpu::sample(&ns)?.processes_s;
    let started = Instant::now();
    let process = lab.spawn_loadgen(config)?;
    let deadline = started
        + Duration::from_secs_f64(config.duration_s)
        + Duration::from_millis(config.timeout_ms)
        + LOAD_SLACK;
    let mut peak = 0;
    let mut end = 0;
    loop {
        std::thread::sleep(SAMPLE_EVERY);
        end = flow_entries(lab).unwrap_or(end);
        peak = peak.max(end);
        if lab.exit_status(process)?.is_some() {
            break;
        }
        if Instant::now() >= deadline {
            bail!("lb-loadgen still running after {deadline:?}");
        }
    }
    let summary = lab.loadgen_summary(process, config)?;
    std::thread::sleep(LOAD_TAIL);
    let cpu_after = cpu::sample(&ns)?.processes_s;
    let window_s = started.elapsed().as_secs_f64();
    let retrans_after = client_retransmits(lab)?;
    let after = counters(lab)?;
    peak = peak.max(flow_entries(lab)?);
    let delta = |a: f64, b: f64| (a - b).max(0.0).round() as u64;
    let reasons: BTreeSet<&String> = after.drops.keys().collect();
    let drops = reasons
        .into_iter()
        .map(|r| {
            let was = before.drops.get(r).copied().unwrap_or(0.0);
            (r.clone(), delta(after.drops[r], was))
        })
        .filter(|(_, n)| *n > 0)
        .collect();
    let mut step = step_from(config, &summary, retrans_before, retrans_after);
    step.kernel = kernel_before.delta(&Snapshot::take(lab)?);
    step.balancer = Some(BalancerSide {
        snat_ips: snat.iter().map(ToString::to_string).collect(),
        opened: delta(after.opened, before.opened),
        refused: delta(after.refused, before.refused),
        drops,
        flow_entries_peak: peak,
        flow_entries_end: end,
        ring_events: delta(after.events, before.events),
        ring_events_lost: delta(after.lost, before.lost),
        latency_reads: delta(after.latency_reads, before.latency_reads),
        cpu_s: (cpu_after - cpu_before).max(0.0),
        window_s,
    });
    Ok(step)
}
