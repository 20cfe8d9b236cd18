//! The balance benchmark (`cargo xtask bench balance`): the lab with real
//! backend servers, our algorithms against HAProxy, nginx, nftables and an
//! oracle, under three scenarios (see [`scenario`]).
//!
//! Each scenario builds one lab; each row then runs its balancer, drives
//! the same open-loop load through it, and is torn down before the next.

pub mod cpu;
pub mod peers;
pub mod plot;
pub mod report;
pub mod scenario;

use std::{collections::BTreeMap, net::SocketAddr, time::Duration};

use anyhow::{Context, Result};
use hdrhistogram::Histogram;
use nix::sys::signal::Signal;
use serde::Serialize;

use self::scenario::{Kind, Row};
use crate::{
    Binaries, Lab,
    lab::{ProcessId, XdpMode},
    loadgen::{LoadConfig, Protocol, Summary, TIMELINE_BUCKET_MS},
};

/// Pause between rows, so one row's closing connections do not load the next.
const SETTLE: Duration = Duration::from_secs(2);
/// Rolling window over which `degrade`'s share is judged.
const DEGRADE_WINDOW_BUCKETS: usize = 4;

/// What to run.
#[derive(Clone, Debug)]
pub struct Plan {
    pub scenarios: Vec<Kind>,
    pub rows: Vec<Row>,
    /// Load duration of each row.
    pub duration_s: f64,
}

/// One row's measurements in one scenario.
#[derive(Clone, Debug, Serialize)]
pub struct RowResult {
    pub scenario: String,
    pub row: String,
    pub target_rps: f64,
    pub achieved_rps: f64,
    pub completed: u64,
    pub errors: u64,
    pub error_kinds: BTreeMap<String, u64>,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    /// Share of answered requests served by the scenario's misbehaving backends.
    pub slow_share: f64,
    /// User + system CPU of the balancer's processes per 10k requests.
    pub process_cpu_s_per_10k: f64,
    /// Machine-wide softirq time per 10k requests (see [`cpu`]).
    pub softirq_s_per_10k: f64,
    /// `degrade`: seconds from the slowdown until the slow backend's share
    /// of new connections (over a 1 s window) fell below half its fair share.
    pub degrade_reaction_s: Option<f64>,
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
        for &row in &plan.rows {
            let result = run_row(&lab, kind, row, plan.duration_s)
                .with_context(|| format!("{} / {}", kind.name(), row.name()))?;
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

fn run_row(lab: &Lab, kind: Kind, row: Row, duration_s: f64) -> Result<RowResult> {
    let backends: Vec<SocketAddr> = lab.backends().iter().map(|b| b.addr()).collect();
    let vip = lab.tcp_vip();
    let running = match row {
        Row::Ours(algorithm) => {
            let spec = lab.balancer_spec(algorithm, XdpMode::Native);
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
    let measured = measure(lab, kind, row, duration_s);
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

/// Drives the load (and, in `degrade`, the slowdown) and collects the row.
fn measure(lab: &Lab, kind: Kind, row: Row, duration_s: f64) -> Result<RowResult> {
    let rate = kind.rate();
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
    let processes = configs
        .iter()
        .map(|c| lab.spawn_loadgen(c))
        .collect::<Result<Vec<_>>>()?;
    let degrade_at_s = duration_s / 2.0;
    let degraded = lab.backends()[kind.slow()[0]].process;
    if kind == Kind::Degrade {
        std::thread::sleep(Duration::from_secs_f64(degrade_at_s));
        lab.signal(degraded, Signal::SIGUSR1)?;
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
    Ok(RowResult {
        scenario: kind.name().into(),
        row: row.name(),
        target_rps: rate,
        achieved_rps: merged.completed as f64 / duration_s,
        completed: merged.completed,
        errors: merged.errors.values().sum(),
        error_kinds: merged.errors.clone(),
        p50_ms: merged.quantile_ms(0.50),
        p90_ms: merged.quantile_ms(0.90),
        p99_ms: merged.quantile_ms(0.99),
        p999_ms: merged.quantile_ms(0.999),
        slow_share: if merged.completed == 0 {
            0.0
        } else {
            slow as f64 / merged.completed as f64
        },
        process_cpu_s_per_10k: per_10k(cpu.processes_s),
        softirq_s_per_10k: per_10k(cpu.softirq_s),
        degrade_reaction_s: (kind == Kind::Degrade && row != Row::Oracle)
            .then(|| reaction_time(&merged.timeline, &slow_names[0], degrade_at_s))
            .flatten(),
        cdf: merged.cdf(),
    })
}

/// Several loadgen runs as one.
struct Merged {
    histogram: Histogram<u64>,
    completed: u64,
    errors: BTreeMap<String, u64>,
    per_backend: BTreeMap<String, u64>,
    timeline: BTreeMap<String, Vec<u64>>,
}

fn merge(summaries: &[Summary]) -> Result<Merged> {
    let mut m = Merged {
        histogram: Histogram::new_with_bounds(1, 300_000_000, 3)?,
        completed: 0,
        errors: BTreeMap::new(),
        per_backend: BTreeMap::new(),
        timeline: BTreeMap::new(),
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
        for (k, series) in &s.timeline {
            let into = m.timeline.entry(k.clone()).or_default();
            if into.len() < series.len() {
                into.resize(series.len(), 0);
            }
            for (a, b) in into.iter_mut().zip(series) {
                *a += b;
            }
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

/// Seconds after `from_s` until `backend`'s share of the answered requests
/// sent in a rolling window first drops below half its fair share.
fn reaction_time(timeline: &BTreeMap<String, Vec<u64>>, backend: &str, from_s: f64) -> Option<f64> {
    let fair = 1.0 / timeline.len().max(1) as f64;
    let buckets = timeline.values().map(Vec::len).max()?;
    let bucket_s = TIMELINE_BUCKET_MS as f64 / 1000.0;
    let first = (from_s / bucket_s).floor() as usize;
    let at = |name: &str, i: usize| {
        timeline
            .get(name)
            .and_then(|s| s.get(i))
            .copied()
            .unwrap_or(0)
    };
    for end in first + DEGRADE_WINDOW_BUCKETS..=buckets {
        let window = end - DEGRADE_WINDOW_BUCKETS..end;
        let total: u64 = window
            .clone()
            .map(|i| timeline.keys().map(|k| at(k, i)).sum::<u64>())
            .sum();
        let mine: u64 = window.map(|i| at(backend, i)).sum();
        if total > 0 && (mine as f64 / total as f64) < fair / 2.0 {
            return Some(end as f64 * bucket_s - from_s);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reaction_is_the_end_of_the_first_window_below_half_fair_share() {
        // Two backends (fair share 1/2); "b" falls to 1 in 10 from bucket 8 on.
        let mut t = BTreeMap::new();
        t.insert("a".to_string(), [vec![10; 8], vec![18; 8]].concat());
        t.insert("b".to_string(), [vec![10; 8], vec![2; 8]].concat());
        // From 2 s (bucket 8): the first 4-bucket window wholly after is 8..12.
        assert_eq!(reaction_time(&t, "b", 2.0), Some(1.0));
        assert_eq!(reaction_time(&t, "a", 2.0), None);
    }
}
