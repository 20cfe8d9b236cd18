//! The balance benchmark (`cargo xtask bench balance`): the lab with real
//! backend servers, our algorithms against HAProxy, nginx, nftables and an
//! oracle, under five scenarios (see [`scenario`]).
//!
//! Each scenario builds one lab; each row then runs its balancer, drives
//! the same open-loop load through it, and is torn down before the next.

pub mod cpu;
pub mod peers;
pub mod plot;
pub mod report;
pub mod scenario;

use std::{collections::BTreeMap, net::SocketAddr, time::Duration};

use anyhow::{Context, Result, bail};
use hdrhistogram::Histogram;
use nix::sys::signal::Signal;
use serde::{Deserialize, Serialize};

use self::scenario::{Kind, LOCAL_ZONE, RECOVER_SLOW_MS, Row};
use crate::{
    Binaries, Lab,
    lab::{BalancerSpec, ProcessId, XdpMode},
    loadgen::{LoadConfig, Protocol, Summary},
    netcounters,
    server::ACCEPT_REPORT_MS,
};

/// Pause between rows, so one row's closing connections do not load the next.
const SETTLE: Duration = Duration::from_secs(2);
/// lb-user's SNAT pool in the benchmark (see `run_row`): every port below
/// the host's ephemeral range, which the health checks need.
const SNAT_PORTS: &str = "1024-32767";
/// Our rows run as a deployment would: with an HTTP health check of every
/// backend (1 s, spread; with the default latency probes of avoided
/// backends). The peers run without checks, which only spares them the
/// checks' load on the backends.
const LB_HEALTH_ARGS: [&str; 2] = ["--health-check", "http"];
/// Rolling window over which `degrade`'s share is judged: 0.25 s, over the
/// servers' 50 ms accept reports. (Until stop 21 it was 1 s over 250 ms
/// reports, which no balancer could beat: the first window after the
/// slowdown ended 0.75–1.25 s after it, so every reacting row read
/// 0.76–0.98 s whatever it did. Now the floor is 0.30–0.35 s.)
const DEGRADE_WINDOW_MS: u64 = 250;
/// Rolling window over which `recover`'s share is judged (0.5 s: the
/// recovery is expected within seconds).
const RECOVER_WINDOW_MS: u64 = 500;

/// What to run.
#[derive(Clone, Debug)]
pub struct Plan {
    pub scenarios: Vec<Kind>,
    /// Rows to run, each in the scenarios that run it ([`Kind::runs`]).
    pub rows: Vec<Row>,
    /// Load duration of each row.
    pub duration_s: f64,
    /// Open-loop load in percent of each pool's capacity
    /// ([`scenario::LOAD_PERCENT`] by default; another load publishes its
    /// own tables, [`Kind::table`]).
    pub load_percent: u32,
    /// Extra lb-user arguments of our rows (e.g. `--health-check http`),
    /// to compare settings.
    pub lb_args: Vec<String>,
    /// Appended to our rows' names, to tell such runs apart.
    pub lb_suffix: Option<String>,
}

/// One row's measurements in one scenario.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RowResult {
    pub scenario: String,
    pub row: String,
    pub target_rps: f64,
    pub achieved_rps: f64,
    pub completed: u64,
    pub errors: u64,
    /// SYNs the client namespace sent again during the row (`nstat`
    /// `TcpExtTCPSynRetrans`): each is a connection that waited a second.
    /// Absent in results written before it was measured.
    #[serde(default)]
    pub syn_retransmits: Option<u64>,
    pub error_kinds: BTreeMap<String, u64>,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    /// Share of answered requests served by the scenario's misbehaving backends.
    pub slow_share: f64,
    /// `zones`: share of answered requests served by zone b's backends
    /// (the same count as `slow_share` there, named for what it is).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cross_zone_share: Option<f64>,
    /// User + system CPU of the balancer's processes per 10k requests.
    pub process_cpu_s_per_10k: f64,
    /// Machine-wide softirq time per 10k requests (see [`cpu`]).
    pub softirq_s_per_10k: f64,
    /// `degrade`: seconds from the slowdown until the slow backend's share
    /// of new connections, as the servers count their accepts over a 0.25 s
    /// window, fell below half its fair share.
    pub degrade_reaction_s: Option<f64>,
    /// `recover`: seconds from the slow backend being fast again until its
    /// share of new connections over a 0.5 s window is back to at least
    /// half its fair share.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovery_s: Option<f64>,
    /// `(latency ms, quantile)` of the whole run, for the plots.
    pub cdf: Vec<(f64, f64)>,
}

/// Runs every scenario of `plan`, calling `done` after each row.
pub fn run(
    binaries: &Binaries,
    plan: &Plan,
    mut done: impl FnMut(&RowResult),
) -> Result<Vec<RowResult>> {
    let mut results = Vec::new();
    for &kind in &plan.scenarios {
        let mut builder = Lab::builder(binaries.clone());
        for spec in kind.backends() {
            builder = builder.backend(spec);
        }
        let lab = builder
            .build()
            .with_context(|| format!("building the {} lab", kind.name()))?;
        widen_client_ports(&lab)?;
        for &row in plan.rows.iter().filter(|&&r| kind.runs(r)) {
            let result = run_row(&lab, kind, row, plan)
                .with_context(|| format!("{} / {}", kind.name(), row.label(kind)))?;
            done(&result);
            results.push(result);
            std::thread::sleep(SETTLE);
        }
    }
    Ok(results)
}

/// A new connection per request at this rate needs more than the default
/// ephemeral range once TIME_WAIT is counted.
fn widen_client_ports(lab: &Lab) -> Result<()> {
    let ns = &lab.client().ns;
    lab.exec_ok(
        ns,
        &["sysctl", "-qw", "net.ipv4.ip_local_port_range=1024 65000"],
    )?;
    lab.exec_ok(ns, &["sysctl", "-qw", "net.ipv4.tcp_tw_reuse=1"])?;
    Ok(())
}

/// What a row started, to stop it again.
enum Running {
    Processes(Vec<ProcessId>),
    Nftables,
    Nothing,
}

fn run_row(lab: &Lab, kind: Kind, row: Row, plan: &Plan) -> Result<RowResult> {
    let backends: Vec<SocketAddr> = lab.backends().iter().map(|b| b.addr()).collect();
    let vip = lab.tcp_vip();
    // Our rows reserve every port in the namespace (see
    // `Lab::restoring_reserved_ports`); the proxy rows after them need some.
    let mut result =
        lab.restoring_reserved_ports(|| run_row_inner(lab, kind, row, plan, &backends, vip))?;
    if let (Row::Ours(_) | Row::OursZoneAware(_), Some(suffix)) = (row, &plan.lb_suffix) {
        result.row = format!("{} {suffix}", result.row);
    }
    // A row where nothing got through measured a broken setup, not a
    // balancer: stop instead of publishing it.
    if result.completed == 0 {
        bail!(
            "no request completed ({} errors: {:?})",
            result.errors,
            result.error_kinds
        );
    }
    Ok(result)
}

fn run_row_inner(
    lab: &Lab,
    kind: Kind,
    row: Row,
    plan: &Plan,
    backends: &[SocketAddr],
    vip: SocketAddr,
) -> Result<RowResult> {
    let backends = backends.to_vec();
    let running = match row {
        Row::Ours(algorithm) | Row::OursZoneAware(algorithm) => {
            let mut spec = lab.balancer_spec(algorithm, XdpMode::Native);
            // Closed flows keep their SNAT tuple for 65 s (TIME_WAIT-like
            // quarantine) per (address, backend), so each backend's share
            // must stay below 31,744 / 65 s ≈ 490 new connections/s: it
            // does at every load here. (The row's arguments may give their
            // own range, or their own health check.)
            if !plan.lb_args.iter().any(|a| a.starts_with("--snat-ports")) {
                spec.extra_args
                    .extend(["--snat-ports".to_string(), SNAT_PORTS.to_string()]);
            }
            if !plan.lb_args.iter().any(|a| a.starts_with("--health-check")) {
                spec.extra_args
                    .extend(LB_HEALTH_ARGS.iter().map(|a| a.to_string()));
            }
            spec.extra_args.extend(plan.lb_args.iter().cloned());
            if let Row::OursZoneAware(_) = row {
                zone_aware(lab, kind, &mut spec)?;
            }
            Running::Processes(vec![lab.start_balancer(&spec)?])
        }
        Row::Haproxy(algorithm) => {
            Running::Processes(vec![peers::start_haproxy(lab, algorithm, vip, &backends)?])
        }
        Row::Nginx(method) => {
            Running::Processes(vec![peers::start_nginx(lab, method, vip, &backends)?])
        }
        Row::Nftables => {
            peers::start_nftables(lab, vip, &backends)?;
            Running::Nftables
        }
        Row::Oracle => Running::Nothing,
    };
    let measured = measure(lab, kind, row, plan);
    match running {
        Running::Processes(ps) => {
            for p in ps {
                lab.signal(p, Signal::SIGTERM)?;
                lab.wait(p, Duration::from_secs(15))?;
            }
        }
        Running::Nftables => peers::stop_nftables(lab)?,
        Running::Nothing => {}
    }
    measured
}

/// Puts lb-user in [`LOCAL_ZONE`] and gives every backend its zone, which
/// turns zone-aware routing on for every VIP.
fn zone_aware(lab: &Lab, kind: Kind, spec: &mut BalancerSpec) -> Result<()> {
    let mut zones = BTreeMap::new();
    for (i, backend) in lab.backends().iter().enumerate() {
        let zone = kind
            .zone(i)
            .with_context(|| format!("{} has no zones", kind.name()))?;
        zones.insert(backend.addr(), zone.to_string());
    }
    for vip in &mut spec.vips {
        vip.zones = zones.clone();
    }
    spec.extra_args
        .extend(["--zone".to_string(), LOCAL_ZONE.to_string()]);
    Ok(())
}

/// Drives the load (and, in `degrade`, the slowdown) and collects the row.
fn measure(lab: &Lab, kind: Kind, row: Row, plan: &Plan) -> Result<RowResult> {
    let duration_s = plan.duration_s;
    let rate = kind.rate(plan.load_percent);
    let slow_names: Vec<String> = kind
        .slow()
        .iter()
        .map(|&i| lab.backends()[i].name.clone())
        .collect();
    let targets: Vec<SocketAddr> = match row {
        Row::Oracle => lab
            .backends()
            .iter()
            .filter(|b| !slow_names.contains(&b.name))
            .map(|b| b.addr())
            .collect(),
        _ => vec![lab.tcp_vip()],
    };
    let per_target = rate / targets.len() as f64;
    let configs: Vec<LoadConfig> = targets
        .iter()
        .map(|&target| LoadConfig {
            target,
            protocol: Protocol::Tcp,
            rate: per_target,
            duration_s,
            max_requests: u64::MAX,
            timeout_ms: 2_000,
            max_outstanding: 4_000,
            path: "/".into(),
            payload_bytes: 0,
        })
        .collect();
    let cpu_before = cpu::sample(&lab.balancer().ns)?;
    let syn_before = netcounters::syn_retransmits(lab, &lab.client().ns)?;
    let processes = configs
        .iter()
        .map(|c| lab.spawn_loadgen(c))
        .collect::<Result<Vec<_>>>()?;
    let degraded = lab.backends()[kind.slow()[0]].process;
    let mut degraded_at_ms = None;
    let mut recovered_at_ms = None;
    if kind == Kind::Degrade {
        std::thread::sleep(Duration::from_secs_f64(duration_s / 2.0));
        lab.signal(degraded, Signal::SIGUSR1)?;
        degraded_at_ms = Some(unix_ms());
    }
    if kind == Kind::Recover {
        std::thread::sleep(Duration::from_secs_f64(duration_s / 3.0));
        lab.signal(degraded, Signal::SIGUSR1)?;
        std::thread::sleep(Duration::from_millis(RECOVER_SLOW_MS));
        lab.signal(degraded, Signal::SIGUSR1)?;
        recovered_at_ms = Some(unix_ms());
    }
    let summaries = processes
        .iter()
        .zip(&configs)
        .map(|(&p, c)| lab.loadgen_summary(p, c))
        .collect::<Result<Vec<_>>>();
    if kind == Kind::Degrade {
        // Back to normal for the next row.
        lab.signal(degraded, Signal::SIGUSR1)?;
    }
    let summaries = summaries?;
    let cpu = cpu::sample(&lab.balancer().ns)?.since(cpu_before);
    let syn_retransmits =
        netcounters::syn_retransmits(lab, &lab.client().ns)?.saturating_sub(syn_before);
    let merged = merge(&summaries)?;
    let requests = merged.completed + merged.errors.values().sum::<u64>();
    let per_10k = |s: f64| {
        if requests == 0 {
            0.0
        } else {
            s * 10_000.0 / requests as f64
        }
    };
    let slow: u64 = slow_names
        .iter()
        .filter_map(|n| merged.per_backend.get(n))
        .sum();
    let slow_share = if merged.completed == 0 {
        0.0
    } else {
        slow as f64 / merged.completed as f64
    };
    Ok(RowResult {
        scenario: kind.table(plan.load_percent),
        row: row.label(kind),
        target_rps: rate,
        achieved_rps: merged.completed as f64 / duration_s,
        completed: merged.completed,
        errors: merged.errors.values().sum(),
        syn_retransmits: Some(syn_retransmits),
        error_kinds: merged.errors.clone(),
        p50_ms: merged.quantile_ms(0.50),
        p90_ms: merged.quantile_ms(0.90),
        p99_ms: merged.quantile_ms(0.99),
        p999_ms: merged.quantile_ms(0.999),
        slow_share,
        // `slow()` of `zones` is zone b.
        cross_zone_share: (kind == Kind::Zones).then_some(slow_share),
        process_cpu_s_per_10k: per_10k(cpu.processes_s),
        softirq_s_per_10k: per_10k(cpu.softirq_s),
        degrade_reaction_s: match degraded_at_ms {
            Some(at) if row != Row::Oracle => {
                reaction_time(&accept_buckets(lab, at), &slow_names[0], at)
            }
            _ => None,
        },
        recovery_s: match recovered_at_ms {
            Some(at) if row != Row::Oracle => {
                recovery_time(&accept_buckets(lab, at), &slow_names[0], at)
            }
            _ => None,
        },
        cdf: merged.cdf(),
    })
}

/// Several loadgen runs as one.
struct Merged {
    histogram: Histogram<u64>,
    completed: u64,
    errors: BTreeMap<String, u64>,
    per_backend: BTreeMap<String, u64>,
}

fn merge(summaries: &[Summary]) -> Result<Merged> {
    let mut m = Merged {
        histogram: Histogram::new_with_bounds(1, 300_000_000, 3)?,
        completed: 0,
        errors: BTreeMap::new(),
        per_backend: BTreeMap::new(),
    };
    for s in summaries {
        for &(us, n) in &s.histogram_us {
            m.histogram.saturating_record_n(us, n);
        }
        m.completed += s.completed;
        for (k, v) in &s.errors {
            *m.errors.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &s.per_backend {
            *m.per_backend.entry(k.clone()).or_default() += v;
        }
    }
    Ok(m)
}

impl Merged {
    fn quantile_ms(&self, q: f64) -> f64 {
        self.histogram.value_at_quantile(q) as f64 / 1000.0
    }

    /// Points at quantiles dense in the tail (0 … 0.9999).
    fn cdf(&self) -> Vec<(f64, f64)> {
        if self.histogram.is_empty() {
            return Vec::new();
        }
        let mut qs: Vec<f64> = (0..=90).map(|i| f64::from(i) / 100.0).collect();
        for nines in 1..=4 {
            let base = 1.0 - 10f64.powi(-nines);
            let step = 9.0 * 10f64.powi(-nines - 1) / 20.0;
            qs.extend((0..20).map(|i| base + step * f64::from(i)));
        }
        qs.push(0.9999);
        qs.into_iter().map(|q| (self.quantile_ms(q), q)).collect()
    }
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64
}

/// Connections each backend accepted per report period, keyed by period
/// number (unix ms / period), from the `accepts` lines the servers print.
type AcceptBuckets = BTreeMap<String, BTreeMap<u64, u64>>;

fn accept_buckets(lab: &Lab, since_ms: u64) -> AcceptBuckets {
    let start = since_ms.saturating_sub(10_000);
    lab.backends()
        .iter()
        .map(|b| {
            let mut buckets = BTreeMap::new();
            for line in lab.stdout(b.process).lines() {
                let mut words = line.split_whitespace();
                if words.next() != Some("accepts") {
                    continue;
                }
                let (Some(Ok(ms)), Some(Ok(count))) = (
                    words.next().map(str::parse::<u64>),
                    words.next().map(str::parse::<u64>),
                ) else {
                    continue;
                };
                if ms >= start {
                    *buckets.entry(ms / ACCEPT_REPORT_MS).or_default() += count;
                }
            }
            (b.name.clone(), buckets)
        })
        .collect()
}

/// Seconds after `from_ms` until `backend`'s share of the connections all
/// backends accepted in a rolling window first drops below half its fair
/// share; `None` if it never does.
fn reaction_time(accepts: &AcceptBuckets, backend: &str, from_ms: u64) -> Option<f64> {
    let fair = 1.0 / accepts.len().max(1) as f64;
    first_window(accepts, backend, from_ms, DEGRADE_WINDOW_MS, |share| {
        share < fair / 2.0
    })
}

/// Seconds after `from_ms` until `backend`'s share of the connections all
/// backends accepted in a rolling 0.5 s window is first back to at least
/// half its fair share; `None` if it never is.
fn recovery_time(accepts: &AcceptBuckets, backend: &str, from_ms: u64) -> Option<f64> {
    let fair = 1.0 / accepts.len().max(1) as f64;
    first_window(accepts, backend, from_ms, RECOVER_WINDOW_MS, |share| {
        share >= fair / 2.0
    })
}

/// Seconds after `from_ms` to the end of the first rolling window of
/// `window_ms`, wholly after `from_ms`, in which `backend`'s share of all
/// accepted connections satisfies `found`.
///
/// A server's `accepts` line at time `t` counts the accepts of
/// `(t - P, t]` (`P` = [`ACCEPT_REPORT_MS`]), and the servers' periods are
/// not aligned, so bucket `b` (lines with `t` in `[bP, bP + P)`) covers
/// `(bP - P, bP + P)`: the first bucket wholly after `from_ms` is the
/// first with `bP - P >= from_ms`, and a window ending with bucket `e - 1`
/// is complete at `eP`.
fn first_window(
    accepts: &AcceptBuckets,
    backend: &str,
    from_ms: u64,
    window_ms: u64,
    found: impl Fn(f64) -> bool,
) -> Option<f64> {
    let window = (window_ms / ACCEPT_REPORT_MS).max(1);
    let first = (from_ms + ACCEPT_REPORT_MS).div_ceil(ACCEPT_REPORT_MS);
    let last = accepts
        .values()
        .filter_map(|b| b.keys().next_back())
        .max()
        .copied()?;
    let at = |name: &str, i: u64| {
        accepts
            .get(name)
            .and_then(|b| b.get(&i))
            .copied()
            .unwrap_or(0)
    };
    for end in first + window..=last + 1 {
        let total: u64 = (end - window..end)
            .map(|i| accepts.keys().map(|k| at(k, i)).sum::<u64>())
            .sum();
        let mine: u64 = (end - window..end).map(|i| at(backend, i)).sum();
        if total > 0 && found(mine as f64 / total as f64) {
            let end_ms = end * ACCEPT_REPORT_MS;
            return Some(end_ms.saturating_sub(from_ms) as f64 / 1000.0);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two backends (fair share 1/2) of 40 report periods; "b" has
    /// `before` of every 20 accepts until period `switch`, `after` from then.
    fn two(switch: u64, before: u64, after: u64) -> AcceptBuckets {
        let mut t = AcceptBuckets::new();
        let b: BTreeMap<u64, u64> = (0..40)
            .map(|i| (i, if i < switch { before } else { after }))
            .collect();
        let a: BTreeMap<u64, u64> = b.iter().map(|(&i, &n)| (i, 20 - n)).collect();
        t.insert("a".to_string(), a);
        t.insert("b".to_string(), b);
        t
    }

    const P: u64 = ACCEPT_REPORT_MS;

    #[test]
    fn reaction_is_the_end_of_the_first_quarter_second_below_half_fair_share() {
        // "b" falls to 2 in 20 from period 16 on.
        let t = two(16, 10, 2);
        // Slowed at 15P: period 16's lines count from 15P on, so the first
        // window is periods 16..21, complete at 21P: 6P later.
        assert_eq!(
            reaction_time(&t, "b", 15 * P),
            Some(6.0 * P as f64 / 1000.0)
        );
        // Half a period later, the window starts one period later.
        assert_eq!(
            reaction_time(&t, "b", 15 * P + P / 2),
            Some(6.5 * P as f64 / 1000.0)
        );
        // A window that still holds a period from before the switch is not
        // below half: slowed at 12P, the first window 13..18 holds 3 periods
        // at 10 and 2 at 2 (34 of 100), 14..19 26, and 15..20 18, below a
        // quarter: complete at 20P.
        assert_eq!(
            reaction_time(&t, "b", 12 * P),
            Some(8.0 * P as f64 / 1000.0)
        );
        assert_eq!(reaction_time(&t, "a", 15 * P), None);
    }

    #[test]
    fn recovery_is_the_end_of_the_first_half_second_back_at_half_fair_share() {
        // "b" gets 2 in 20 until period 24, then its share.
        let t = two(24, 2, 10);
        // Fast again at 15P: windows of 10 periods from 16; 16..26 holds
        // 2 periods at 10 (36 of 200), 17..27 3 (44), 18..28 4 (52 ≥ 50):
        // complete at 28P, 13P later.
        assert_eq!(
            recovery_time(&t, "b", 15 * P),
            Some(13.0 * P as f64 / 1000.0)
        );
        // Never back: none.
        assert_eq!(recovery_time(&two(40, 2, 2), "b", 15 * P), None);
    }
}
