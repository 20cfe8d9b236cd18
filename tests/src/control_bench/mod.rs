//! The control-plane benchmark (`cargo xtask bench control`): what lb-user
//! itself costs, against issue 10's targets, in one namespace lab.
//!
//! 1. **Connections**: CPU per 10,000 new connections under an open-loop
//!    load, lb-user against HAProxy on the same VIP and backends.
//! 2. **Idle**: CPU while idle with 1,000,000 entries in the flow table,
//!    written through the pinned map ([`flows`]).
//! 3. **Maglev add**: a backend added over the control socket to a
//!    1,000-backend Maglev VIP, until the daemon has written it.
//! 4. **Ticks**: 4,096 backends at 50 ms score ticks, from lb-user's own
//!    tick histogram.
//!
//! CPU is the user + system time of the processes in the balancer's
//! namespace (only the balancer under test runs there during a window),
//! read from /proc, so it does not depend on how busy the machine is.
//! Each part starts and stops its own lb-user; the lab goes when dropped.

pub mod flows;
pub mod report;
pub mod scrape;

use std::{
    net::{IpAddr, SocketAddr},
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use nix::sys::signal::Signal;

use self::{
    flows::FlowPlan,
    report::{
        ConnectionCost, ControlReport, IDLE_FLOW_ENTRIES, IdleFlows, MAGLEV_BACKENDS, MaglevAdd,
        ProcessRun, ScoreTicks, TICK_BACKENDS, TICK_INTERVAL_MS,
    },
    scrape::Histogram,
};
use crate::{
    Binaries, Lab,
    balance::{cpu, peers, scenario::Row},
    lab::{Algorithm, BackendSpec, BalancerSpec, ProcessId, Protocol, VipSpec, XdpMode},
    loadgen::{self, LoadConfig},
    netcounters,
};

/// What to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Part {
    Connections,
    Idle,
    Maglev,
    Ticks,
}

impl Part {
    pub const ALL: [Part; 4] = [Part::Connections, Part::Idle, Part::Maglev, Part::Ticks];
}

/// How long and how hard.
#[derive(Clone, Debug)]
pub struct Plan {
    pub parts: Vec<Part>,
    /// New connections per second, and for how long.
    pub rate_per_s: f64,
    pub load_s: f64,
    /// Idle windows (idle with the full table, and the tick count).
    pub window_s: f64,
    /// Backends added one at a time to the Maglev VIP.
    pub maglev_adds: usize,
}

/// Backend servers of the lab (only the connections part sends them traffic).
const LAB_BACKENDS: usize = 4;
/// Pause after a balancer is ready, before a window starts.
const SETTLE: Duration = Duration::from_secs(2);
/// Pause after the load ends, so its last closes are handled in the window.
const LOAD_TAIL: Duration = Duration::from_secs(1);
/// lb-user's SNAT pool: every port but the balancer namespace's own
/// ephemeral ones (lb-user refuses a range that leaves the host fewer than
/// 1,024 of those: its health checks and the scrapes need them).
const SNAT_PORTS: &str = "1024-64511";
/// The balancer namespace's ephemeral ports, out of `SNAT_PORTS`.
const BALANCER_EPHEMERAL_PORTS: &str = "64512 65535";
/// Flow table for the idle part: twice what it holds, so the LRU never evicts.
const IDLE_FLOW_TABLE_SIZE: u64 = 2 * 1_048_576;
/// How long lb-user may take to count the written entries.
const COUNT_TIMEOUT: Duration = Duration::from_secs(15);
/// Longest wait for one more reconciliation pass: lb-user's longest pass
/// interval (a large table) plus the pass itself.
const PASS_TIMEOUT: Duration =
    Duration::from_secs(lb_user::ingest::reconcile::MAX_PASS_INTERVAL.as_secs() * 2 + 15);
/// Pause between two Maglev adds (lets the previous publish settle).
const ADD_GAP: Duration = Duration::from_millis(300);
/// VIPs of the tick part (per-VIP limit × 4 = MAX_BACKENDS).
const TICK_VIPS: u32 = 4;

/// Runs every part of `plan` in one lab. A part that fails is reported in
/// the returned errors and leaves its result `None`; the others still run.
pub fn run(binaries: &Binaries, plan: &Plan) -> Result<(ControlReport, Vec<String>)> {
    let lab = Lab::builder(binaries.clone())
        .backends(LAB_BACKENDS, BackendSpec::new(1, 32))
        .build()
        .context("building the lab")?;
    let client = &lab.client().ns;
    lab.exec_ok(
        client,
        &["sysctl", "-qw", "net.ipv4.ip_local_port_range=1024 65000"],
    )?;
    lab.exec_ok(client, &["sysctl", "-qw", "net.ipv4.tcp_tw_reuse=1"])?;
    lab.set_balancer_ephemeral_ports(BALANCER_EPHEMERAL_PORTS)?;
    let mut report = ControlReport::default();
    let mut errors = Vec::new();
    for &part in &plan.parts {
        eprintln!("bench control: {part:?} ...");
        let outcome = match part {
            Part::Connections => connections(&lab, plan).map(|r| report.connections = Some(r)),
            Part::Idle => idle(&lab, plan).map(|r| report.idle = Some(r)),
            Part::Maglev => maglev(&lab, plan).map(|r| report.maglev = Some(r)),
            Part::Ticks => ticks(&lab, plan).map(|r| report.ticks = Some(r)),
        };
        if let Err(e) = outcome {
            eprintln!("bench control: {part:?} not measured: {e:#}");
            errors.push(format!("{part:?}: {e:#}"));
        }
    }
    Ok((report, errors))
}

/// CPU seconds of every process in the balancer's namespace.
fn balancer_cpu(lab: &Lab) -> Result<f64> {
    Ok(cpu::sample(&lab.balancer().ns)?.processes_s)
}

/// A fresh state directory per lb-user run (runtime adds must not carry over).
fn fresh_state_dir(lab: &Lab, name: &str) -> Result<String> {
    let dir = lab.log_dir().join(format!("state-{name}"));
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    Ok(dir.display().to_string())
}

/// Starts lb-user with `spec`, runs `f`, stops lb-user (SIGTERM) and puts
/// the namespace's reserved ports back as they were, whatever `f` returned.
fn with_lb_user<T>(
    lab: &Lab,
    spec: &BalancerSpec,
    f: impl FnOnce(ProcessId) -> Result<T>,
) -> Result<T> {
    lab.restoring_reserved_ports(|| {
        let process = lab.start_balancer(spec)?;
        let result = f(process);
        let stopped = lab.stop_balancer(process, Signal::SIGTERM);
        let result = result?;
        let status = stopped?;
        ensure!(status.success(), "lb-user stopped with {status}");
        Ok(result)
    })
}

/// `count` backends on the lab's backend addresses, `ports_from` upwards
/// (nothing listens on them unless the port is the servers' own).
fn many_backends(lab: &Lab, count: usize, ports_from: u16) -> Vec<(SocketAddr, u32)> {
    let ips: Vec<IpAddr> = lab.backends().iter().map(|b| b.addr().ip()).collect();
    (0..count)
        .map(|i| {
            let ip = ips[i % ips.len()];
            (SocketAddr::new(ip, ports_from + (i / ips.len()) as u16), 1)
        })
        .collect()
}

fn spec(vips: Vec<VipSpec>, algorithm: Algorithm, extra: &[&str]) -> BalancerSpec {
    BalancerSpec {
        vips,
        algorithm,
        xdp_mode: XdpMode::Native,
        extra_args: extra.iter().map(|s| s.to_string()).collect(),
    }
}

fn tcp_vip(addr: SocketAddr, backends: Vec<(SocketAddr, u32)>) -> VipSpec {
    VipSpec::new(addr, Protocol::Tcp, backends)
}

/// Part 1: lb-user and then HAProxy under the same load.
fn connections(lab: &Lab, plan: &Plan) -> Result<ConnectionCost> {
    // HAProxy is the one peer this part runs.
    peers::ensure_installed(&[Row::Haproxy("roundrobin")])?;
    let vip = lab.tcp_vip();
    let backends: Vec<(SocketAddr, u32)> = lab.backends().iter().map(|b| (b.addr(), 1)).collect();
    let load = LoadConfig {
        target: vip,
        protocol: loadgen::Protocol::Tcp,
        rate: plan.rate_per_s,
        duration_s: plan.load_s,
        max_requests: u64::MAX,
        timeout_ms: 2_000,
        max_outstanding: 4_000,
        path: "/".into(),
        payload_bytes: 0,
    };
    let state = fresh_state_dir(lab, "connections")?;
    let ours = spec(
        vec![tcp_vip(vip, backends.clone())],
        Algorithm::P2cEwma,
        &["--snat-ports", SNAT_PORTS, "--state-dir", &state],
    );
    let (idle_percent, lb_user) = with_lb_user(lab, &ours, |_| {
        std::thread::sleep(SETTLE);
        let (idle_cpu, idle_s) = cpu_over(lab, || {
            std::thread::sleep(Duration::from_secs_f64(plan.window_s.min(10.0)));
            Ok(())
        })?;
        let run = loaded_run(lab, &load)?;
        Ok((report::core_percent(idle_cpu, idle_s), run))
    })
    .context("lb-user under load")?;
    let addrs: Vec<SocketAddr> = backends.iter().map(|b| b.0).collect();
    let haproxy = peers::start_haproxy(lab, "roundrobin", vip, &addrs)?;
    std::thread::sleep(SETTLE);
    let run = loaded_run(lab, &load);
    lab.signal(haproxy, Signal::SIGTERM)?;
    lab.wait(haproxy, Duration::from_secs(15))?;
    let haproxy = run.context("HAProxy under load")?;
    Ok(ConnectionCost {
        rate_per_s: plan.rate_per_s,
        duration_s: plan.load_s,
        lb_user,
        haproxy,
        lb_user_idle_core_percent: idle_percent,
    })
}

/// CPU seconds of the balancer namespace while `f` runs, and the seconds.
fn cpu_over(lab: &Lab, f: impl FnOnce() -> Result<()>) -> Result<(f64, f64)> {
    let before = balancer_cpu(lab)?;
    let start = Instant::now();
    f()?;
    let after = balancer_cpu(lab)?;
    Ok(((after - before).max(0.0), start.elapsed().as_secs_f64()))
}

/// One load run through whatever balances the VIP now.
fn loaded_run(lab: &Lab, load: &LoadConfig) -> Result<ProcessRun> {
    let mut summary = None;
    let syn_before = netcounters::syn_retransmits(lab, &lab.client().ns)?;
    let (cpu_s, window_s) = cpu_over(lab, || {
        summary = Some(lab.run_loadgen(load)?);
        std::thread::sleep(LOAD_TAIL);
        Ok(())
    })?;
    let summary = summary.context("no load summary")?;
    let syn_retransmits =
        netcounters::syn_retransmits(lab, &lab.client().ns)?.saturating_sub(syn_before);
    let errors: u64 = summary.errors.values().sum();
    let connections = summary.completed + errors;
    if summary.completed == 0 {
        bail!(
            "no connection completed ({errors} errors: {:?})",
            summary.errors
        );
    }
    Ok(ProcessRun {
        connections,
        completed: summary.completed,
        errors,
        syn_retransmits,
        cpu_s,
        window_s,
        cpu_s_per_10k: report::per_10k(cpu_s, connections).context("no connections")?,
    })
}

/// Scrapes lb-user's metrics and parses them.
fn scrape(lab: &Lab) -> Result<Vec<scrape::Sample>> {
    Ok(scrape::parse(&lab.scrape_metrics()?))
}

fn flow_entries(lab: &Lab) -> Result<u64> {
    let samples = scrape(lab)?;
    scrape::value(&samples, "lb_flow_table_entries", &[])
        .map(|v| v as u64)
        .context("no lb_flow_table_entries in lb-user's metrics")
}

/// Reconciliation passes lb-user has run (`lb_reconcile_seconds_count`).
fn reconcile_passes(lab: &Lab) -> Result<f64> {
    Histogram::from_samples(&scrape(lab)?, "lb_reconcile_seconds", &[])
        .map(|h| h.count)
        .context("no lb_reconcile_seconds in lb-user's metrics")
}

/// Waits until lb-user has run `passes` reconciliation passes in all; at
/// most [`PASS_TIMEOUT`].
fn wait_for_passes(lab: &Lab, passes: f64) -> Result<()> {
    let deadline = Instant::now() + PASS_TIMEOUT;
    loop {
        let n = reconcile_passes(lab)?;
        if n >= passes {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "lb-user ran {n} reconciliation passes, not {passes}, within {PASS_TIMEOUT:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Part 2: idle with a million flow entries.
fn idle(lab: &Lab, plan: &Plan) -> Result<IdleFlows> {
    // 16 backends (4 addresses × 4 ports): enough SNAT tuples for 500,000
    // connections from one SNAT address.
    let backends = many_backends(lab, 16, 8080);
    let state = fresh_state_dir(lab, "idle")?;
    let size = IDLE_FLOW_TABLE_SIZE.to_string();
    let s = spec(
        vec![tcp_vip(lab.tcp_vip(), backends.clone())],
        Algorithm::P2cEwma,
        // Idle timeouts longer than the part (several pass intervals of
        // up to two minutes each), so the table stays full throughout.
        &[
            "--flow-table-size",
            &size,
            "--state-dir",
            &state,
            "--tcp-idle-timeout",
            "1h",
        ],
    );
    with_lb_user(lab, &s, |_| {
        let status = lab.status()?;
        let vip = status
            .vip(&lab.tcp_vip().to_string())
            .context("the VIP is not in lb-user's status")?;
        let ids: Vec<(SocketAddr, u32)> = backends
            .iter()
            .map(|(addr, _)| {
                let id = vip
                    .backends
                    .iter()
                    .find(|b| b.address == addr.to_string())
                    .map(|b| b.id)
                    .with_context(|| format!("backend {addr} is not in lb-user's status"))?;
                Ok((*addr, id))
            })
            .collect::<Result<_>>()?;
        let flow_plan = FlowPlan {
            vip: lab.tcp_vip(),
            vip_id: vip_id(&lab.pin_dir(), lab.tcp_vip())?,
            backends: ids,
            snat: IpAddr::V4(lab.balancer_addr()),
            snat_first_port: 1024,
        };
        let started = Instant::now();
        let written = flows::fill(&lab.pin_dir(), &flow_plan, IDLE_FLOW_ENTRIES / 2)?;
        eprintln!(
            "bench control: wrote {written} flow entries in {:.1} s",
            started.elapsed().as_secs_f64()
        );
        // A pass that started after the fill counts every entry; passes
        // are spaced by their cost (up to a minute with a full table).
        let filled = reconcile_passes(lab)?;
        wait_for_passes(lab, filled + 2.0)?;
        let deadline = Instant::now() + COUNT_TIMEOUT;
        let counted_before = loop {
            let n = flow_entries(lab)?;
            if n >= written {
                break n;
            }
            if Instant::now() >= deadline {
                let gone = flows::broken(&lab.pin_dir(), &flow_plan, written / 2)?;
                let shown: Vec<String> = gone
                    .iter()
                    .take(10)
                    .map(|(i, [f, r])| format!("connection {i} (forward open {f}, reply open {r})"))
                    .collect();
                bail!(
                    "lb-user counted {n} flow entries, not the {written} written; {} connections lack an entry: {}",
                    gone.len(),
                    shown.join(", ")
                );
            }
            std::thread::sleep(Duration::from_millis(500));
        };
        // The window runs from just after one pass to just after the
        // second one from there (and for at least `window_s`), so it
        // holds whole pass cycles: the sweep's cost is in it exactly
        // twice, with the idle time between.
        let at = reconcile_passes(lab)?;
        wait_for_passes(lab, at + 1.0)?;
        let (cpu_s, window_s) = cpu_over(lab, || {
            let start = reconcile_passes(lab)?;
            let min_end = Instant::now() + Duration::from_secs_f64(plan.window_s);
            wait_for_passes(lab, start + 2.0)?;
            std::thread::sleep(min_end.saturating_duration_since(Instant::now()));
            Ok(())
        })?;
        let counted_after = flow_entries(lab)?;
        Ok(IdleFlows {
            flow_table_size: IDLE_FLOW_TABLE_SIZE,
            written,
            counted_before,
            counted_after,
            window_s,
            cpu_s,
            core_percent: report::core_percent(cpu_s, window_s),
        })
    })
}

/// The id lb-user gave VIP `addr` (TCP), from the pinned VIPS map.
fn vip_id(pin_dir: &Path, addr: SocketAddr) -> Result<u32> {
    let vips = lb_user::kernel::maps::vips(pin_dir)?;
    let (words, family) = lb_user::kernel::wire::ip_to_words(addr.ip());
    for item in vips.iter() {
        let (key, meta) = item?;
        if key.addr == words
            && key.family == family
            && key.port == lb_user::kernel::wire::port_to_wire(addr.port())
            && key.proto == lb_common::IPPROTO_TCP
        {
            return Ok(meta.vip_id);
        }
    }
    bail!("VIP {addr} is not in the pinned VIPS map")
}

/// Part 3: backends added to a 1,000-backend Maglev VIP.
fn maglev(lab: &Lab, plan: &Plan) -> Result<MaglevAdd> {
    let backends = many_backends(lab, MAGLEV_BACKENDS as usize, 20_000);
    let state = fresh_state_dir(lab, "maglev")?;
    let s = spec(
        vec![tcp_vip(lab.tcp_vip(), backends)],
        Algorithm::Maglev,
        &["--state-dir", &state],
    );
    let instance = lab.instance();
    let vip_arg = format!("{}/tcp", lab.tcp_vip());
    with_lb_user(lab, &s, |_| {
        std::thread::sleep(SETTLE);
        let pin_dir = lab.pin_dir();
        let vip_id = vip_id(&pin_dir, lab.tcp_vip())?;
        let table = crate::production::read_vip_maglev_table(&pin_dir, vip_id)?;
        let distinct: std::collections::BTreeSet<u32> = table.iter().copied().collect();
        ensure!(
            distinct.len() >= MAGLEV_BACKENDS as usize,
            "the VIP's Maglev table holds {} backends, not {MAGLEV_BACKENDS}",
            distinct.len()
        );
        let before = publish_histogram(lab)?;
        let new = many_backends(lab, plan.maglev_adds, 24_000);
        let mut samples_ms = Vec::new();
        let mut verified = 0;
        for (addr, _) in new {
            let request = lb_user::surface::control::Request {
                command: lb_user::settings::cli::ControlCommand::Add,
                vip: vip_arg.clone(),
                backend: addr.to_string(),
                weight: None,
                backends: Vec::new(),
                algorithm: None,
                peer: None,
            };
            let sent = Instant::now();
            let answer = lb_user::surface::control::send(&instance, &request)?;
            let took = sent.elapsed();
            ensure!(
                answer.ok,
                "adding {addr}: {}",
                answer.error.unwrap_or_default()
            );
            samples_ms.push(took.as_secs_f64() * 1000.0);
            let id = answer
                .backend_id
                .context("the add answered no backend id")?;
            if crate::production::read_vip_maglev_table(&pin_dir, vip_id)?.contains(&id) {
                verified += 1;
            }
            std::thread::sleep(ADD_GAP);
        }
        let after = publish_histogram(lab)?;
        let during = after.since(&before);
        Ok(MaglevAdd {
            backends_before: MAGLEV_BACKENDS,
            p50_ms: report::median(&samples_ms).context("no adds")?,
            max_ms: samples_ms.iter().copied().fold(0.0, f64::max),
            samples_ms,
            verified_in_table: verified,
            publish_mean_ms: during.mean().map(|s| s * 1000.0),
        })
    })
}

fn publish_histogram(lab: &Lab) -> Result<Histogram> {
    Histogram::from_samples(
        &scrape(lab)?,
        "lb_map_update_seconds",
        &[("kind", "publish")],
    )
    .context("no lb_map_update_seconds{kind=\"publish\"} in lb-user's metrics")
}

fn tick_histogram(lab: &Lab) -> Result<Histogram> {
    Histogram::from_samples(&scrape(lab)?, "lb_score_tick_seconds", &[])
        .context("no lb_score_tick_seconds in lb-user's metrics")
}

/// Part 4: 4,096 backends over four VIPs at 50 ms score ticks.
fn ticks(lab: &Lab, plan: &Plan) -> Result<ScoreTicks> {
    let per_vip = (TICK_BACKENDS / TICK_VIPS) as usize;
    let vips: Vec<VipSpec> = (0..TICK_VIPS as u16)
        .map(|v| {
            let addr = SocketAddr::new(lab.tcp_vip().ip(), 80 + v);
            let backends = many_backends(lab, per_vip, 30_000 + v * 2_000);
            tcp_vip(addr, backends)
        })
        .collect();
    let state = fresh_state_dir(lab, "ticks")?;
    let interval = format!("{TICK_INTERVAL_MS}ms");
    let s = spec(
        vips,
        Algorithm::P2cEwma,
        &["--score-interval", &interval, "--state-dir", &state],
    );
    with_lb_user(lab, &s, |_| {
        let status = lab.status()?;
        let backends: usize = status.vips.iter().map(|v| v.backends.len()).sum();
        ensure!(
            backends == TICK_BACKENDS as usize,
            "lb-user runs {backends} backends, not {TICK_BACKENDS}"
        );
        std::thread::sleep(SETTLE);
        let before = tick_histogram(lab)?;
        let (cpu_s, window_s) = cpu_over(lab, || {
            std::thread::sleep(Duration::from_secs_f64(plan.window_s));
            Ok(())
        })?;
        let during = tick_histogram(lab)?.since(&before);
        let ms = |s: Option<f64>| s.map(|v| v * 1000.0);
        Ok(ScoreTicks {
            backends: TICK_BACKENDS,
            vips: TICK_VIPS,
            interval_ms: TICK_INTERVAL_MS,
            window_s,
            ticks: during.count as u64,
            expected_ticks: (window_s * 1000.0 / TICK_INTERVAL_MS).floor() as u64,
            mean_ms: ms(during.mean()).context("no score tick in the window")?,
            p99_bound_ms: ms(during.quantile_bound(0.99)).context("no score tick")?,
            max_bound_ms: ms(during.max_bound()).context("no score tick")?,
            core_percent: report::core_percent(cpu_s, window_s),
        })
    })
}
