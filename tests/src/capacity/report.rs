//! The capacity bench's pure parts: the rate search, what counts as a
//! sustained run, the SNAT arithmetic, `nstat` parsing, and the report with
//! its markdown tables.

use std::{collections::BTreeMap, fmt::Write as _};

use serde::{Deserialize, Serialize};

use crate::control_bench::report::thousands;

/// Issue 9's target: new connections a second to one backend.
pub const TARGET_PER_S: f64 = 10_000.0;
/// Issue 9's duration, and the default of `--duration`.
pub const TARGET_DURATION_S: f64 = 60.0;
/// A run keeps up when it completed its connections at least this close to
/// the asked rate (open loop: a client that falls behind ends late).
pub const KEEP_UP_SHARE: f64 = 0.95;
/// Rates the search tries are multiples of this.
pub const RATE_QUANTUM: f64 = 50.0;

/// One open-loop run: a new TCP connection (one HTTP request) per arrival.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Step {
    /// Asked arrival rate and duration.
    pub rate_per_s: f64,
    pub duration_s: f64,
    pub scheduled: u64,
    pub completed: u64,
    /// Failed requests by the load generator's error kind.
    pub errors: BTreeMap<String, u64>,
    /// First scheduled send to last answer.
    pub elapsed_s: f64,
    pub p99_ms: f64,
    /// Deltas of the client namespace's `TcpExtTCPSynRetrans` and `TcpRetransSegs`.
    pub syn_retrans: u64,
    pub retrans_segs: u64,
    /// What the balancer saw; `None` for a run straight to the backend.
    pub balancer: Option<BalancerSide>,
    /// The kernel's loss counters of every lab namespace that moved over
    /// the run (`crate::netcounters`): where a reset or a retransmit came from.
    #[serde(default)]
    pub kernel: Delta,
}

/// What lb-user and its data path reported over a run through the VIP.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct BalancerSide {
    pub snat_ips: Vec<String>,
    /// `lb_backend_connections_opened_total` delta.
    pub opened: u64,
    /// `lb_backend_connections_refused_total` delta (RST to a SYN, or a SYN
    /// unanswered for `--syn-timeout`).
    pub refused: u64,
    /// Nonzero `lb_packets_total{reason="drop_…"}` deltas.
    pub drops: BTreeMap<String, u64>,
    /// `lb_flow_table_entries`, sampled once a second: the highest, and at
    /// the end of the load (before its tail).
    pub flow_entries_peak: u64,
    pub flow_entries_end: u64,
    /// `lb_ring_buffer_events_total` and `…_lost_total` deltas: records
    /// on the ring (failures only).
    pub ring_events: u64,
    pub ring_events_lost: u64,
    /// `lb_latency_aggregates_read_total` delta: the per-backend latency
    /// aggregates lb-user read at its score ticks (what replaced a ring
    /// event per response). Missing in reports written before it was kept.
    #[serde(default)]
    pub latency_reads: u64,
    /// User + system CPU of the balancer namespace's processes (lb-user)
    /// over `window_s` (the load and its tail).
    pub cpu_s: f64,
    pub window_s: f64,
}

impl Step {
    pub fn error_count(&self) -> u64 {
        self.errors.values().sum()
    }

    /// Connections attempted: completed and failed.
    pub fn connections(&self) -> u64 {
        self.completed + self.error_count()
    }

    /// Completed connections a second over the run.
    pub fn achieved_per_s(&self) -> f64 {
        if self.elapsed_s > 0.0 {
            self.completed as f64 / self.elapsed_s
        } else {
            0.0
        }
    }

    /// Refused connections: the client's `connect_refused`, and those the
    /// balancer counted as refused.
    pub fn refused(&self) -> u64 {
        self.errors.get("connect_refused").copied().unwrap_or(0)
            + self.balancer.as_ref().map_or(0, |b| b.refused)
    }

    /// Packets the data path dropped, by reason (`reason n, …`; `–` for
    /// a run without the balancer).
    pub fn drops(&self) -> String {
        match &self.balancer {
            None => "–".into(),
            Some(b) if b.drops.is_empty() => "0".into(),
            Some(b) => b
                .drops
                .iter()
                .map(|(reason, n)| format!("{reason} {n}"))
                .collect::<Vec<_>>()
                .join(", "),
        }
    }

    pub fn events_per_connection(&self) -> Option<f64> {
        let b = self.balancer.as_ref()?;
        (self.connections() > 0).then(|| b.ring_events as f64 / self.connections() as f64)
    }

    /// Latency aggregates read per connection (see `BalancerSide::latency_reads`).
    pub fn latency_reads_per_connection(&self) -> Option<f64> {
        let b = self.balancer.as_ref()?;
        (self.connections() > 0).then(|| b.latency_reads as f64 / self.connections() as f64)
    }

    pub fn cpu_s_per_10k(&self) -> Option<f64> {
        let b = self.balancer.as_ref()?;
        (self.connections() > 0).then(|| b.cpu_s * 10_000.0 / self.connections() as f64)
    }

    /// Sustained: every scheduled connection answered, none failed or
    /// refused, no SYN retransmitted, and the client kept up with the rate.
    /// Packets the data path dropped are not judged on their own: a dropped
    /// SYN shows as a retransmit, and a stray segment of a finished
    /// connection (`drop_no_flow`) loses nothing.
    pub fn sustained(&self) -> bool {
        self.scheduled > 0
            && self.completed == self.scheduled
            && self.error_count() == 0
            && self.refused() == 0
            && self.syn_retrans == 0
            && self.achieved_per_s() >= KEEP_UP_SHARE * self.rate_per_s
    }

    /// Why a run was not sustained (empty when it was).
    pub fn shortfall(&self) -> String {
        let mut why = Vec::new();
        if self.completed < self.scheduled {
            why.push(format!("{} of {} answered", self.completed, self.scheduled));
        }
        for (kind, n) in &self.errors {
            why.push(format!("{n} {kind}"));
        }
        if let Some(b) = &self.balancer
            && b.refused > 0
        {
            why.push(format!("{} refused (lb-user)", b.refused));
        }
        if self.syn_retrans > 0 {
            why.push(format!("{} SYN retransmits", self.syn_retrans));
        }
        if self.achieved_per_s() < KEEP_UP_SHARE * self.rate_per_s {
            why.push(format!("only {:.0}/s achieved", self.achieved_per_s()));
        }
        if !why.is_empty()
            && let Some(b) = &self.balancer
        {
            for (reason, n) in &b.drops {
                why.push(format!("{n} {reason}"));
            }
        }
        // Where retransmitted SYNs were lost outside the balancer's
        // program, say so: the lab's plumbing, not a verdict of ours.
        let plumbing = self.kernel.plumbing_losses();
        if !why.is_empty() && !plumbing.is_empty() {
            why.push(format!("lab: {plumbing}"));
        }
        why.join(", ")
    }
}

/// The highest sustained rate, found by trying rates one run at a time.
///
/// Upwards from `first`, doubling while runs are sustained and `max` is not
/// reached; after the first miss, bisection between the highest sustained
/// rate (or 0) and the lowest missed one, at most `refinements` more runs.
/// With `first == max` it is a step-down search: the target, then lower.
#[derive(Clone, Debug, PartialEq)]
pub struct RateSearch {
    first: f64,
    max: f64,
    refinements: u32,
    /// Highest sustained rate, lowest missed rate so far.
    best: Option<f64>,
    missed: Option<f64>,
    /// A rate known to miss without trying it (the SNAT bound): bisection
    /// stays below it.
    known_limit: Option<f64>,
}

impl RateSearch {
    pub fn new(first: f64, max: f64, refinements: u32) -> Self {
        Self {
            first: quantize(first.min(max)),
            max: quantize(max),
            refinements,
            best: None,
            missed: None,
            known_limit: None,
        }
    }

    /// The same search, told that rates from `limit` up miss anyway: after
    /// the first miss it bisects below `limit` (the first rate is still
    /// tried, to show what happens there).
    pub fn with_limit(self, limit: f64) -> Self {
        Self {
            known_limit: Some(limit),
            ..self
        }
    }

    /// The next rate to try, or `None` when the search is over.
    pub fn next_rate(&self) -> Option<f64> {
        match (self.best, self.missed) {
            (None, None) => Some(self.first),
            (Some(best), None) => (best < self.max).then(|| quantize((best * 2.0).min(self.max))),
            (best, Some(missed)) => {
                if self.refinements == 0 {
                    return None;
                }
                let low = best.unwrap_or(0.0);
                let missed = self.known_limit.map_or(missed, |l| missed.min(l));
                let mid = quantize((low + missed) / 2.0);
                (mid > low && mid < missed).then_some(mid)
            }
        }
    }

    /// Records a run at `rate`.
    pub fn record(&mut self, rate: f64, sustained: bool) {
        if self.missed.is_some() {
            self.refinements = self.refinements.saturating_sub(1);
        }
        if sustained {
            self.best = Some(self.best.map_or(rate, |b| b.max(rate)));
        } else {
            self.missed = Some(self.missed.map_or(rate, |m| m.min(rate)));
        }
    }

    /// Highest sustained rate so far.
    pub fn best(&self) -> Option<f64> {
        self.best
    }

    /// Whether the search stopped at `max` without a miss above the best
    /// (the true limit may be higher).
    pub fn capped(&self) -> bool {
        self.missed.is_none() && self.best.is_some_and(|b| b >= self.max)
    }
}

/// `rate` rounded to a multiple of [`RATE_QUANTUM`], at least one quantum.
fn quantize(rate: f64) -> f64 {
    ((rate / RATE_QUANTUM).round() * RATE_QUANTUM).max(RATE_QUANTUM)
}

/// The SNAT tuple space of one backend and what it allows.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct SnatBudget {
    pub addresses: u32,
    pub ports: u32,
    pub quarantine_s: f64,
}

impl SnatBudget {
    /// Tuples towards one backend: addresses × ports.
    pub fn tuples(&self) -> u64 {
        u64::from(self.addresses) * u64::from(self.ports)
    }

    /// The steady-state formula: new connections/s per backend =
    /// addresses × ports ÷ quarantine.
    pub fn steady_per_s(&self) -> f64 {
        self.tuples() as f64 / self.quarantine_s
    }

    /// Most new connections a second over a run of `duration_s` from a
    /// fresh balancer: a tuple is freed a quarantine after its close, so a
    /// run no longer than the quarantine reuses none (all tuples ÷ the
    /// duration), and a longer one is held to the steady state.
    pub fn run_per_s(&self, duration_s: f64) -> f64 {
        self.tuples() as f64 / duration_s.min(self.quarantine_s)
    }
}

use crate::netcounters::Delta;
pub use crate::netcounters::parse_nstat;

/// Parses a duration flag: seconds as a number, or with `ms`, `s`, `m`.
pub fn parse_duration_s(text: &str) -> Result<f64, String> {
    let text = text.trim();
    let (number, scale) = if let Some(n) = text.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = text.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = text.strip_suffix('m') {
        (n, 60.0)
    } else {
        (text, 1.0)
    };
    match number.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v * scale),
        _ => Err(format!(
            "{text:?} is not a positive duration (e.g. 60s, 10s, 1m)"
        )),
    }
}

/// Everything one run measured.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct CapacityReport {
    pub target_per_s: f64,
    pub duration_s: f64,
    pub backend: String,
    pub vip: String,
    pub snat: SnatBudget,
    pub flow_table_size: u64,
    /// The machine: CPUs, kernel, load average at the start.
    pub machine: String,
    /// Runs straight from the client to the backend (no balancer).
    pub ceiling_steps: Vec<Step>,
    pub ceiling_step_s: f64,
    /// Highest rate sustained straight to the backend; `ceiling_capped`
    /// when the search stopped at its maximum without a miss.
    pub ceiling_per_s: Option<f64>,
    pub ceiling_capped: bool,
    /// Runs through the VIP, the first at the goal.
    pub vip_steps: Vec<Step>,
    /// Highest rate sustained through the VIP.
    pub sustained_per_s: Option<f64>,
}

impl CapacityReport {
    /// What the run must sustain: the target, or the client's ceiling if lower.
    pub fn goal_per_s(&self) -> Option<f64> {
        self.ceiling_per_s.map(|c| c.min(self.target_per_s))
    }

    /// The goal sustained through the VIP.
    pub fn pass(&self) -> bool {
        match (self.goal_per_s(), self.sustained_per_s) {
            (Some(goal), Some(rate)) => rate >= goal,
            _ => false,
        }
    }

    /// Issue 9's criterion on its own: the highest rate through the VIP
    /// with 0 refused and 0 SYN retransmits at which the client kept up,
    /// whatever else failed (a reset mid-connection is neither).
    pub fn no_refused_no_retransmit_per_s(&self) -> Option<f64> {
        self.vip_steps
            .iter()
            .filter(|s| {
                s.refused() == 0
                    && s.syn_retrans == 0
                    && s.achieved_per_s() >= KEEP_UP_SHARE * s.rate_per_s
            })
            .map(|s| s.rate_per_s)
            .max_by(f64::total_cmp)
    }

    /// The first VIP run that sustained the best rate.
    pub fn best_vip_step(&self) -> Option<&Step> {
        let best = self.sustained_per_s?;
        self.vip_steps
            .iter()
            .find(|s| s.rate_per_s == best && s.sustained())
    }

    /// The markdown report.
    pub fn markdown(&self) -> String {
        let mut md = String::from("# Capacity (`cargo xtask bench capacity`)\n\n");
        let _ = writeln!(
            md,
            "One VIP ({}) with one backend (`lb-backend`, a real HTTP server, {}), {} SNAT \
             addresses × {} ports, `--snat-quarantine` {:.0} s, `--flow-table-size` {}. Every \
             connection is a new TCP connection carrying one HTTP request (`Connection: close`), \
             sent open loop by `lb-loadgen` from the client namespace. Machine: {}.\n",
            self.vip,
            self.backend,
            self.snat.addresses,
            thousands(u64::from(self.snat.ports)),
            self.snat.quarantine_s,
            thousands(self.flow_table_size),
            self.machine,
        );
        md.push_str("| Measure | Value |\n|---|---|\n");
        let ceiling = match self.ceiling_per_s {
            Some(c) if self.ceiling_capped => {
                format!("≥ {} /s (search maximum)", thousands(c as u64))
            }
            Some(c) => format!("{} /s", thousands(c as u64)),
            None => "none sustained".into(),
        };
        let _ = writeln!(
            md,
            "| Client ceiling (straight to the backend, {:.0} s runs) | {ceiling} |",
            self.ceiling_step_s
        );
        let goal = self
            .goal_per_s()
            .map_or("–".into(), |g| format!("{} /s", thousands(g as u64)));
        let _ = writeln!(
            md,
            "| Goal: min({} /s, ceiling) for {:.0} s | {goal} |",
            thousands(self.target_per_s as u64),
            self.duration_s
        );
        let sustained = self
            .sustained_per_s
            .map_or("none".into(), |r| format!("{} /s", thousands(r as u64)));
        let _ = writeln!(
            md,
            "| Sustained through the VIP (every connection answered, 0 refused, 0 SYN retransmits) | {sustained} |"
        );
        let loose = self
            .no_refused_no_retransmit_per_s()
            .map_or("none".into(), |r| format!("{} /s", thousands(r as u64)));
        let _ = writeln!(
            md,
            "| Highest rate through the VIP with 0 refused and 0 SYN retransmits, other errors allowed | {loose} |"
        );
        let ratio = match (self.sustained_per_s, self.ceiling_per_s) {
            (Some(r), Some(c)) if c > 0.0 => format!("{:.2}", r / c),
            _ => "–".into(),
        };
        let _ = writeln!(md, "| Sustained ÷ ceiling | {ratio} |");
        let _ = writeln!(
            md,
            "| SNAT bound of the quarantine alone (no time-wait reuse), this run: {} tuples ÷ min({:.0} s, {:.0} s) | {} /s |",
            thousands(self.snat.tuples()),
            self.duration_s,
            self.snat.quarantine_s,
            thousands(self.snat.run_per_s(self.duration_s) as u64)
        );
        let _ = writeln!(
            md,
            "| The same, steady state: {} tuples ÷ {:.0} s | {} /s |",
            thousands(self.snat.tuples()),
            self.snat.quarantine_s,
            thousands(self.snat.steady_per_s() as u64)
        );
        if let Some(step) = self.best_vip_step() {
            let b = step.balancer.as_ref();
            let _ = writeln!(
                md,
                "| Flow-table entries at that rate (peak / end of load) | {} / {} |",
                thousands(b.map_or(0, |b| b.flow_entries_peak)),
                thousands(b.map_or(0, |b| b.flow_entries_end))
            );
            let _ = writeln!(
                md,
                "| Ring-buffer events per connection (failures only) | {} |",
                opt(step.events_per_connection(), 4)
            );
            let _ = writeln!(
                md,
                "| Latency aggregates read per connection (one per backend and score tick) | {} |",
                opt(step.latency_reads_per_connection(), 4)
            );
            let _ = writeln!(
                md,
                "| lb-user CPU over the run (per 10,000 connections) | {:.2} CPU-s ({} CPU-s) |",
                b.map_or(0.0, |b| b.cpu_s),
                opt(step.cpu_s_per_10k(), 3)
            );
        }
        let _ = writeln!(
            md,
            "| Result | {} |\n",
            if self.pass() { "PASS" } else { "**MISS**" }
        );
        md.push_str("## Every run\n\n");
        md.push_str(&steps_table(
            &self.ceiling_steps,
            &self.vip_steps,
            self.ceiling_per_s,
        ));
        md.push_str(
            "\nKernel loss counters that moved over each run (`nstat`, `ip -s link`, \
             `ethtool -S` of every lab namespace; `/proc/net/softnet_stat`):\n\n",
        );
        let runs = self
            .ceiling_steps
            .iter()
            .map(|s| ("direct", s))
            .chain(self.vip_steps.iter().map(|s| ("VIP", s)));
        for (path, s) in runs {
            let _ = writeln!(
                md,
                "- {path} {}/s: {}",
                thousands(s.rate_per_s as u64),
                s.kernel.summary()
            );
        }
        md
    }
}

/// One table of every run, straight runs first.
pub fn steps_table(ceiling: &[Step], vip: &[Step], ceiling_per_s: Option<f64>) -> String {
    let mut md = String::from(
        "| Path | Rate /s | s | Completed | Errors | Refused | SYN retrans | Retrans segs | \
         Achieved /s | p99 ms | Flow entries peak | Events/conn | lb-user CPU-s | per 10k | \
         ÷ ceiling | XDP drops | Sustained |\n\
         |---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|---|\n",
    );
    let rows = ceiling
        .iter()
        .map(|s| ("direct", s))
        .chain(vip.iter().map(|s| ("VIP", s)));
    for (path, s) in rows {
        let b = s.balancer.as_ref();
        let ratio = match ceiling_per_s {
            Some(c) if c > 0.0 && path == "VIP" => format!("{:.2}", s.rate_per_s / c),
            _ => "–".into(),
        };
        let verdict = if s.sustained() {
            "yes".to_string()
        } else {
            format!("no: {}", s.shortfall())
        };
        let _ = writeln!(
            md,
            "| {path} | {} | {:.0} | {} | {} | {} | {} | {} | {:.0} | {:.1} | {} | {} | {} | {} | {ratio} | {} | {verdict} |",
            thousands(s.rate_per_s as u64),
            s.duration_s,
            thousands(s.completed),
            s.error_count(),
            s.refused(),
            s.syn_retrans,
            s.retrans_segs,
            s.achieved_per_s(),
            s.p99_ms,
            b.map_or("–".into(), |b| thousands(b.flow_entries_peak)),
            opt(s.events_per_connection(), 4),
            b.map_or("–".into(), |b| format!("{:.2}", b.cpu_s)),
            opt(s.cpu_s_per_10k(), 3),
            s.drops(),
        );
    }
    md
}

fn opt(value: Option<f64>, decimals: usize) -> String {
    value.map_or("–".into(), |v| format!("{v:.decimals$}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(rate: f64, completed: u64) -> Step {
        Step {
            rate_per_s: rate,
            duration_s: 10.0,
            scheduled: (rate * 10.0) as u64,
            completed,
            elapsed_s: 10.0,
            p99_ms: 2.0,
            ..Step::default()
        }
    }

    /// Runs a search against a limit: rates up to `limit` are sustained.
    fn search(mut s: RateSearch, limit: f64) -> (Vec<f64>, RateSearch) {
        let mut tried = Vec::new();
        while let Some(rate) = s.next_rate() {
            assert!(tried.len() < 50, "the search must end: {tried:?}");
            tried.push(rate);
            s.record(rate, rate <= limit);
        }
        (tried, s)
    }

    #[test]
    fn the_upward_search_doubles_then_bisects() {
        let (tried, s) = search(RateSearch::new(1_000.0, 16_000.0, 3), 5_000.0);
        assert_eq!(
            tried,
            [
                1_000.0, 2_000.0, 4_000.0, 8_000.0, 6_000.0, 5_000.0, 5_500.0
            ]
        );
        assert_eq!(s.best(), Some(5_000.0));
        assert!(!s.capped());
    }

    #[test]
    fn the_upward_search_stops_at_its_maximum() {
        let (tried, s) = search(RateSearch::new(1_000.0, 3_000.0, 3), 1e9);
        assert_eq!(tried, [1_000.0, 2_000.0, 3_000.0]);
        assert_eq!(s.best(), Some(3_000.0));
        assert!(s.capped());
    }

    #[test]
    fn the_step_down_search_tries_the_target_first() {
        let (tried, s) = search(RateSearch::new(10_000.0, 10_000.0, 3), 1e9);
        assert_eq!(tried, [10_000.0]);
        assert_eq!(s.best(), Some(10_000.0));
        let (tried, s) = search(RateSearch::new(10_000.0, 10_000.0, 3), 3_000.0);
        assert_eq!(tried, [10_000.0, 5_000.0, 2_500.0, 3_750.0]);
        assert_eq!(s.best(), Some(2_500.0));
        assert!(!s.capped());
    }

    #[test]
    fn a_known_limit_keeps_the_bisection_below_it() {
        let s = RateSearch::new(10_000.0, 10_000.0, 4).with_limit(4_232.0);
        let (tried, s) = search(s, 3_000.0);
        assert_eq!(tried, [10_000.0, 2_100.0, 3_150.0, 2_650.0, 2_900.0]);
        assert_eq!(s.best(), Some(2_900.0));
        // A goal below the limit is tried and kept as usual.
        let (tried, _) = search(
            RateSearch::new(2_000.0, 2_000.0, 4).with_limit(4_232.0),
            1e9,
        );
        assert_eq!(tried, [2_000.0]);
    }

    #[test]
    fn nothing_sustained_is_no_best_and_the_search_ends() {
        let (tried, s) = search(RateSearch::new(1_000.0, 8_000.0, 3), 0.0);
        assert_eq!(tried, [1_000.0, 500.0, 250.0, 150.0]);
        assert_eq!(s.best(), None);
        // Without refinements a miss ends it at once.
        let (tried, _) = search(RateSearch::new(1_000.0, 8_000.0, 0), 0.0);
        assert_eq!(tried, [1_000.0]);
    }

    #[test]
    fn a_step_is_sustained_only_with_nothing_lost_refused_or_retransmitted() {
        let ok = step(1_000.0, 10_000);
        assert!(ok.sustained(), "{}", ok.shortfall());
        assert_eq!(ok.shortfall(), "");
        let late = Step {
            elapsed_s: 12.0,
            ..ok.clone()
        };
        assert!(!late.sustained());
        assert_eq!(late.shortfall(), "only 833/s achieved");
        let retrans = Step {
            syn_retrans: 1,
            ..ok.clone()
        };
        assert!(!retrans.sustained());
        let lost = Step {
            completed: 9_999,
            errors: BTreeMap::from([("timeout".to_string(), 1)]),
            ..ok.clone()
        };
        assert_eq!(lost.shortfall(), "9999 of 10000 answered, 1 timeout");
        let refused = Step {
            balancer: Some(BalancerSide {
                refused: 2,
                ..BalancerSide::default()
            }),
            ..ok.clone()
        };
        assert_eq!(refused.refused(), 2);
        assert!(!refused.sustained());
        // A stray segment dropped loses nothing; a dropped SYN is retransmitted.
        let stray = Step {
            balancer: Some(BalancerSide {
                drops: BTreeMap::from([("drop_no_flow".to_string(), 5)]),
                ..BalancerSide::default()
            }),
            ..ok
        };
        assert!(stray.sustained());
        assert_eq!(stray.drops(), "drop_no_flow 5");
        let exhausted = Step {
            syn_retrans: 9,
            balancer: Some(BalancerSide {
                drops: BTreeMap::from([("drop_snat_exhausted".to_string(), 9)]),
                ..BalancerSide::default()
            }),
            ..stray.clone()
        };
        assert_eq!(
            exhausted.shortfall(),
            "9 SYN retransmits, 9 drop_snat_exhausted"
        );
        // Frames the lab's veths or backlog lost are named with their count.
        let plumbing = Step {
            syn_retrans: 15,
            kernel: Delta {
                grew: BTreeMap::from([
                    ("lb lbl1n1b rx_queue_1_xdp_tx_errors".to_string(), 50),
                    ("lb lbl1n1b rx_queue_0_xdp_tx_errors".to_string(), 7),
                    ("lb lbl1n1b tx_dropped".to_string(), 57),
                    ("host softnet dropped".to_string(), 3),
                    ("host softnet time_squeeze".to_string(), 4),
                ]),
            },
            ..exhausted.clone()
        };
        assert!(!plumbing.sustained());
        assert_eq!(
            plumbing.shortfall(),
            "15 SYN retransmits, 9 drop_snat_exhausted, lab: 57 XDP_TX frames a veth could \
             not queue, 3 softnet backlog drops"
        );
        // A sustained run names nothing, whatever the plumbing counted.
        let quiet = Step {
            syn_retrans: 0,
            kernel: plumbing.kernel.clone(),
            ..stray.clone()
        };
        assert!(quiet.sustained());
        assert_eq!(quiet.shortfall(), "");
    }

    #[test]
    fn snat_arithmetic_follows_the_formula() {
        let snat = SnatBudget {
            addresses: 4,
            ports: 45_000,
            quarantine_s: 65.0,
        };
        assert_eq!(snat.tuples(), 180_000);
        assert_eq!(snat.steady_per_s().round(), 2_769.0);
        // A run shorter than the quarantine frees nothing: every tuple once.
        assert_eq!(snat.run_per_s(60.0), 3_000.0);
        assert_eq!(snat.run_per_s(10.0), 18_000.0);
        // A longer one is held to the steady state.
        assert_eq!(snat.run_per_s(90.0).round(), 2_769.0);
    }

    #[test]
    fn nstat_counters_are_read_by_name() {
        let text = "#kernel\nTcpRetransSegs                  17                 0.0\n\
                    TcpExtTCPSynRetrans             3                  0.0\n";
        let c = parse_nstat(text);
        assert_eq!(c["TcpRetransSegs"], 17);
        assert_eq!(c["TcpExtTCPSynRetrans"], 3);
        assert_eq!(c.len(), 2);
    }

    #[test]
    fn durations_take_units() {
        assert_eq!(parse_duration_s("60s"), Ok(60.0));
        assert_eq!(parse_duration_s("10"), Ok(10.0));
        assert_eq!(parse_duration_s("1m"), Ok(60.0));
        assert_eq!(parse_duration_s("500ms"), Ok(0.5));
        assert!(parse_duration_s("0s").is_err());
        assert!(parse_duration_s("soon").is_err());
    }

    #[test]
    fn the_report_judges_against_the_lower_of_target_and_ceiling() {
        let mut vip = step(4_000.0, 40_000);
        vip.balancer = Some(BalancerSide {
            flow_entries_peak: 120_000,
            flow_entries_end: 110_000,
            ring_events: 400,
            latency_reads: 200,
            cpu_s: 1.5,
            window_s: 15.0,
            ..BalancerSide::default()
        });
        let report = CapacityReport {
            target_per_s: TARGET_PER_S,
            duration_s: 10.0,
            backend: "10.213.0.21:8080".into(),
            vip: "10.213.0.100:80".into(),
            snat: SnatBudget {
                addresses: 4,
                ports: 63_488,
                quarantine_s: 65.0,
            },
            flow_table_size: 1 << 20,
            machine: "2 CPUs".into(),
            ceiling_steps: vec![step(4_000.0, 40_000), step(8_000.0, 70_000)],
            ceiling_step_s: 10.0,
            ceiling_per_s: Some(4_000.0),
            ceiling_capped: false,
            vip_steps: vec![vip],
            sustained_per_s: Some(4_000.0),
        };
        assert_eq!(report.goal_per_s(), Some(4_000.0));
        assert!(report.pass());
        let md = report.markdown();
        assert!(
            md.contains("| Goal: min(10,000 /s, ceiling) for 10 s | 4,000 /s |"),
            "{md}"
        );
        assert!(md.contains("| Sustained ÷ ceiling | 1.00 |"), "{md}");
        assert_eq!(report.no_refused_no_retransmit_per_s(), Some(4_000.0));
        assert!(
            md.contains("| Ring-buffer events per connection (failures only) | 0.0100 |"),
            "{md}"
        );
        assert!(
            md.contains(
                "| Latency aggregates read per connection (one per backend and score tick) | 0.0050 |"
            ),
            "{md}"
        );
        assert!(md.contains("| 1.50 CPU-s (0.375 CPU-s) |"), "{md}");
        assert!(md.contains("| Result | PASS |"), "{md}");
        assert!(
            md.contains("| direct | 8,000 | 10 | 70,000 | 0 | 0 | 0 | 0 | 7000 |"),
            "{md}"
        );
        assert!(md.contains("no: 70000 of 80000 answered"), "{md}");
        assert!(md.contains("| VIP | 4,000 | 10 | 40,000 |"), "{md}");
        let missed = CapacityReport {
            sustained_per_s: Some(3_000.0),
            ..report
        };
        assert!(!missed.pass());
        assert!(missed.markdown().contains("| Result | **MISS** |"));
    }

    #[test]
    fn thousands_are_grouped() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1_000), "1,000");
        assert_eq!(thousands(253_952), "253,952");
        assert_eq!(thousands(1_048_576), "1,048,576");
    }
}
