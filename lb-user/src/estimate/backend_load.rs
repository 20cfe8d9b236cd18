//! What the control plane knows about each backend's load, and the
//! [`BackendScore`] it derives for the kernel.
//!
//! The kernel's P2C compares `cost × (inflight+1)^bias` where `inflight` comes
//! from its own atomic counters (fresh at packet time, which is what keeps a
//! burst of SYNs inside one refresh interval from herding), and `cost` is the
//! slower-moving part written here: the Peak-EWMA latency divided by weight.

use std::time::Duration;

use lb_common::{BackendScore, SCORE_FAR_ABOVE, WEIGHT_SCALE};

use crate::{
    estimate::latency::{
        EstimateParams, LatencyEstimate, LatencySample, ProbeOutcome, ProbeSample,
    },
    ingest::events::{CloseReason, Event},
    kernel::clock::Nanos,
    settings::addr::Weight,
};

/// Effective weights are published in hundredths of a configured weight
/// unit, so slow start can give a weight-1 backend 0.5 without rounding it
/// away. [`lb_common::BackendScore::weight`] holds this unit.
pub const WEIGHT_UNITS: u32 = 100;

/// How far a published cost or latency may lag the fresh one before it is
/// written again ([`moved`]): 1/2^7 of it.
///
/// An estimate with no samples drifts towards cold start for minutes:
/// written to the nanosecond, a backend last measured at 5 ms (τ = 10 s,
/// cold start 1 ms) was rewritten every 50 ms tick for 100 s, 2,000 writes,
/// and every backend sampled in the last minute and a half made each tick
/// write, when an idle balancer should write nothing. By the step it is
/// about 170 writes in the first minute, and then none: within a step of
/// cold start the published estimate is cold start
/// ([`BackendScore::ewma_ns`] of [`BackendLoad::score`]), so the drift's
/// last nanoseconds do not trickle out one write at a time.
///
/// Why a lag of 0.8 % is harmless: P2C compares `cost × (inflight+1)^b`
/// of two backends, and the re-draw bound is 3× the median cost. A choice
/// the lag could change is one between backends within 0.8 % of each
/// other, a coin toss given how much one response moves an estimate (one
/// in-flight connection more is a factor of 1.02 even at 100). A backend
/// measured twice as slow moves by 100 %, and is written at once.
pub const SCORE_STEP_SHIFT: u32 = 7;

/// Whether `fresh` moved from the `written` figure (a cost or a latency)
/// by more than [`SCORE_STEP_SHIFT`]'s step of the larger.
pub fn moved(written: u64, fresh: u64) -> bool {
    written.abs_diff(fresh) > written.max(fresh) >> SCORE_STEP_SHIFT
}

/// Latency-per-weight in the kernel's fixed point (see [`BackendScore::cost`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Cost(pub u64);

impl Cost {
    /// `max(1, ewma_ns × WEIGHT_SCALE ÷ weight)`, `weight` in
    /// [`WEIGHT_UNITS`]: never 0, so that even an unmeasured-fast backend's
    /// in-flight term still counts.
    pub fn new(ewma_ns: u64, weight_units: u32) -> Self {
        Self((ewma_ns.saturating_mul(WEIGHT_SCALE) / u64::from(weight_units.max(1))).max(1))
    }
}

/// Event tallies per backend since this process started (for logs; the
/// kernel's counters in BACKEND_CONNS are the source of truth for in-flight).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    pub opened: u64,
    pub responded: u64,
    pub closed: u64,
    pub refused: u64,
    /// Flows the control plane expired (idle or SYN timeout), also in `closed`/`refused`.
    pub expired: u64,
}

#[derive(Clone, Debug)]
pub struct BackendLoad {
    /// Effective weight in [`WEIGHT_UNITS`] (slow start, smoothing applied).
    weight_units: u32,
    latency: LatencyEstimate,
    /// Where the estimate drifts to without samples, in nanoseconds.
    cold_start_ns: u64,
    pub tally: Tally,
}

impl BackendLoad {
    pub fn new(weight: Weight, params: EstimateParams, now: Nanos) -> Self {
        Self {
            weight_units: weight.get() * WEIGHT_UNITS,
            latency: LatencyEstimate::new(params, now),
            cold_start_ns: u64::try_from(params.cold_start.as_nanos()).unwrap_or(u64::MAX),
            tally: Tally::default(),
        }
    }

    pub fn apply(&mut self, event: Event, now: Nanos) {
        match event {
            Event::Opened { .. } => self.tally.opened += 1,
            Event::Responded { latency, .. } => {
                self.tally.responded += 1;
                self.latency.observe(LatencySample::single(latency), now);
            }
            Event::Closed { reason, .. } => {
                self.tally.closed += 1;
                if reason == CloseReason::Idle {
                    self.tally.expired += 1;
                }
            }
            Event::Refused { .. } => self.tally.refused += 1,
        }
    }

    /// The estimate at `now` as published: cold start itself once the
    /// idle drift has brought it within a step of it (see
    /// [`SCORE_STEP_SHIFT`]), so that the drift ends.
    fn published_ns(&self, now: Nanos) -> u64 {
        let estimate = self.latency.estimate_ns(now).round() as u64;
        if moved(self.cold_start_ns, estimate) {
            estimate
        } else {
            self.cold_start_ns
        }
    }

    /// The score published for this backend while it is held far above
    /// its pool ([`lb_common::SCORE_FAR_ABOVE`]): flagged, with the cost of
    /// its mean latency ([`LatencyEstimate::held_ns`]). `ewma_ns` stays the
    /// estimate: the stall age's threshold, and what `lb-user status`
    /// shows.
    pub fn held_score(&self, now: Nanos) -> BackendScore {
        let score = self.score(now);
        let held_ns = self
            .latency
            .held_ns_below(score.ewma_ns as f64, now)
            .round() as u64;
        BackendScore {
            cost: Cost::new(held_ns, self.weight_units).0,
            flags: SCORE_FAR_ABOVE,
            ..score
        }
    }

    /// The score published for this backend: its estimate as `ewma_ns`
    /// and cost.
    pub fn score(&self, now: Nanos) -> BackendScore {
        let ewma_ns = self.published_ns(now);
        BackendScore {
            ewma_ns,
            cost: Cost::new(ewma_ns, self.weight_units).0,
            weight: self.weight_units,
            flags: 0,
            updated_ns: now.0,
        }
    }
}

/// Loads of every configured backend, indexed by backend id.
#[derive(Debug)]
pub struct LoadTable {
    loads: Vec<BackendLoad>,
    /// What a backend that joins later starts from (dated when it joins).
    params: EstimateParams,
}

impl LoadTable {
    pub fn new(weights: &[Weight], params: EstimateParams, now: Nanos) -> Self {
        Self {
            loads: weights
                .iter()
                .map(|w| BackendLoad::new(*w, params, now))
                .collect(),
            params,
        }
    }

    /// A backend's load as it joins at `now`: the cold-start estimate,
    /// dated `now`. (A template made once at the start was dated then: an
    /// hour later, its memories weighed the first tick's sample as if the
    /// cold-start guess were an hour old, taking it whole.)
    fn fresh(&self, now: Nanos) -> BackendLoad {
        BackendLoad::new(Weight::DEFAULT, self.params, now)
    }

    /// Applies an event; events for unknown ids (a flow that outlived a
    /// reconfiguration) are ignored.
    pub fn apply(&mut self, event: Event, now: Nanos) {
        let backend = match event {
            Event::Opened { backend }
            | Event::Responded { backend, .. }
            | Event::Closed { backend, .. }
            | Event::Refused { backend } => backend,
        };
        if let Some(load) = self.loads.get_mut(backend as usize) {
            load.apply(event, now);
        }
    }

    /// Feeds backend `id` what the kernel measured since the last
    /// refresh: how many responses, their mean and peak (unknown ids are
    /// ignored).
    pub fn observe(&mut self, id: u32, sample: LatencySample, now: Nanos) {
        if let Some(load) = self.loads.get_mut(id as usize) {
            load.latency.observe(sample, now);
            load.tally.responded += sample.count;
        }
    }

    /// Backend `id`'s users had `count` answers by `now` whose latency
    /// is not taken (they waited on a health outage): they still show
    /// that users are served ([`LoadTable::answered_within`]).
    pub fn answered(&mut self, id: u32, count: u64, now: Nanos) {
        if let Some(load) = self.loads.get_mut(id as usize) {
            load.latency.answered(now);
            load.tally.responded += count;
        }
    }

    /// Feeds backend `id` a latency probe's measurement; it counts only
    /// if users were not answered by the backend within `idle` (see
    /// [`LatencyEstimate::observe_probe`]). `None` for an unknown id.
    pub fn observe_probe(
        &mut self,
        id: u32,
        probe: ProbeSample,
        now: Nanos,
        idle: Duration,
    ) -> Option<ProbeOutcome> {
        let load = self.loads.get_mut(id as usize)?;
        Some(load.latency.observe_probe(probe, now, idle))
    }

    /// Whether users were answered by backend `id` less than `idle` ago
    /// (their latency taken or not).
    pub fn answered_within(&self, id: u32, now: Nanos, idle: Duration) -> bool {
        self.loads
            .get(id as usize)
            .and_then(|l| l.latency.last_answer())
            .is_some_and(|t| now.since(t) < idle)
    }

    /// The backends users avoid, of `probed`: `(id, VIP index, latency
    /// probe interval)` of every backend whose check probes. Avoided: no
    /// user sample within its probe interval, in a VIP where another
    /// backend had one (an idle VIP needs no extra probes).
    pub fn avoided(&self, probed: &[(u32, usize, Duration)], now: Nanos) -> Vec<u32> {
        let in_use: std::collections::HashSet<usize> = probed
            .iter()
            .filter(|&&(id, _, idle)| self.answered_within(id, now, idle))
            .map(|&(_, vip, _)| vip)
            .collect();
        probed
            .iter()
            .filter(|&&(id, vip, idle)| {
                in_use.contains(&vip) && !self.answered_within(id, now, idle)
            })
            .map(|&(id, _, _)| id)
            .collect()
    }

    /// Sets the effective weight (in [`WEIGHT_UNITS`]) of backend `id`,
    /// growing the table for a backend added at runtime.
    pub fn set_weight(&mut self, id: u32, weight_units: u32, now: Nanos) {
        let index = id as usize;
        if self.loads.len() <= index {
            let fresh = self.fresh(now);
            self.loads.resize(index + 1, fresh);
        }
        self.loads[index].weight_units = weight_units;
    }

    /// Starts backend `id` afresh at `now` (a backend added at runtime, or
    /// a new backend reusing a freed id).
    pub fn reset(&mut self, id: u32, now: Nanos) {
        let index = id as usize;
        let fresh = self.fresh(now);
        if self.loads.len() <= index {
            self.loads.resize(index + 1, fresh.clone());
        }
        self.loads[index] = fresh;
    }

    /// The Peak-EWMA estimate of backend `id` (0 if unknown).
    pub fn ewma_ns(&self, id: u32, now: Nanos) -> u64 {
        self.loads
            .get(id as usize)
            .map_or(0, |l| l.latency.estimate_ns(now).round() as u64)
    }

    /// Backend `id`'s estimate ([`LoadTable::ewma_ns`]) if users sampled
    /// it within `max_age`: what latency outlier detection compares. A
    /// backend never measured holds the cold-start guess, and one idle
    /// longer drifts towards it: neither is a latency to eject for, nor
    /// one the pool's median should be taken from.
    pub fn sampled_ewma_ns(&self, id: u32, now: Nanos, max_age: Duration) -> Option<u64> {
        let latency = self.sampled_within(id, now, max_age)?;
        Some(latency.estimate_ns(now).round() as u64)
    }

    /// Backend `id`'s latency estimate, if users sampled it within
    /// `max_age` of `now`.
    fn sampled_within(&self, id: u32, now: Nanos, max_age: Duration) -> Option<&LatencyEstimate> {
        let latency = &self.loads.get(id as usize)?.latency;
        (now.since(latency.last_sample()?) <= max_age).then_some(latency)
    }

    /// The recent mean latency of backend `id` (what zones are compared
    /// by, [`LatencyEstimate::recent_mean_ns`]) if users sampled it within
    /// `max_age`: an older figure says nothing about how it would do.
    pub fn zone_latency_ns(&self, id: u32, now: Nanos, max_age: Duration) -> Option<u64> {
        let latency = self.sampled_within(id, now, max_age)?;
        Some(latency.recent_mean_ns()?.round() as u64)
    }

    /// Backend `id`'s [held score](BackendLoad::held_score) (`None` if
    /// unknown).
    pub fn held_score(&self, id: u32, now: Nanos) -> Option<BackendScore> {
        Some(self.loads.get(id as usize)?.held_score(now))
    }

    /// `(backend id, score)` for every backend.
    pub fn scores(&self, now: Nanos) -> impl Iterator<Item = (u32, BackendScore)> + '_ {
        self.loads
            .iter()
            .enumerate()
            .map(move |(id, load)| (id as u32, load.score(now)))
    }

    pub fn tallies(&self) -> impl Iterator<Item = (u32, Tally)> + '_ {
        self.loads
            .iter()
            .enumerate()
            .map(|(id, load)| (id as u32, load.tally))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::config::DEFAULT_EWMA_REFUTE_AFTER;
    use crate::{
        estimate::latency::ProbeSample,
        kernel::clock::{Clock, ManualClock},
    };

    const PARAMS: EstimateParams = EstimateParams {
        cold_start: Duration::from_millis(1),
        tau: Duration::from_secs(10),
        peak_tau: Duration::from_secs(1),
        refute_after: DEFAULT_EWMA_REFUTE_AFTER,
    };

    fn weight(w: u64) -> Weight {
        Weight::new(w).unwrap()
    }

    #[test]
    fn cost_divides_latency_by_weight_in_fixed_point() {
        assert_eq!(Cost::new(1_000_000, 100), Cost(1_000_000));
        assert_eq!(Cost::new(1_000_000, 400), Cost(250_000));
        assert_eq!(Cost::new(1_000_000, 50), Cost(2_000_000));
        assert_eq!(Cost::new(0, 100), Cost(1));
        assert_eq!(Cost::new(1, 6_553_500), Cost(1));
        assert_eq!(Cost::new(u64::MAX, 100), Cost(u64::MAX / 100));
    }

    #[test]
    fn score_reflects_samples_weight_and_time() {
        let clock = ManualClock::starting_at(5);
        let mut table = LoadTable::new(&[weight(1), weight(2)], PARAMS, clock.now());
        table.apply(
            Event::Responded {
                backend: 1,
                latency: Duration::from_millis(4),
            },
            clock.now(),
        );
        let scores: Vec<_> = table.scores(clock.now()).collect();
        assert_eq!(scores[0].1.ewma_ns, 1_000_000);
        assert_eq!(scores[0].1.cost, 1_000_000);
        assert_eq!(scores[1].1.ewma_ns, 4_000_000);
        assert_eq!(scores[1].1.cost, 2_000_000);
        assert_eq!(scores[1].1.weight, 200);
        assert_eq!(scores[1].1.updated_ns, 5);
    }

    /// The idle drift's last nanoseconds are not published one write at a
    /// time: within a step of cold start, the estimate is cold start.
    #[test]
    fn an_idle_estimate_within_a_step_of_cold_start_is_published_as_cold_start() {
        let clock = ManualClock::starting_at(0);
        let params = EstimateParams {
            peak_tau: Duration::from_secs(10),
            ..PARAMS
        };
        let mut table = LoadTable::new(&[weight(1)], params, clock.now());
        table.observe(0, ms(5), clock.now());
        let published = |table: &LoadTable, now| table.scores(now).next().unwrap().1;
        // τ·ln(4 ms × 127 ÷ 1 ms) ≈ 62 s: still more than a step above.
        clock.advance(Duration::from_secs(60));
        let drifting = published(&table, clock.now());
        assert!(drifting.ewma_ns > 1_007_000, "{drifting:?}");
        assert_eq!(drifting.ewma_ns, table.ewma_ns(0, clock.now()));
        clock.advance(Duration::from_secs(3));
        let settled = published(&table, clock.now());
        assert_eq!((settled.ewma_ns, settled.cost), (1_000_000, 1_000_000));
        assert!(
            table.ewma_ns(0, clock.now()) > 1_000_000,
            "the estimate itself"
        );
        assert!(moved(1_000_000, 1_007_875) && !moved(1_000_000, 1_007_874));
    }

    #[test]
    fn a_held_score_keeps_the_estimate_and_costs_the_mean() {
        let clock = ManualClock::starting_at(0);
        let mut table = LoadTable::new(&[weight(2)], PARAMS, clock.now());
        // A second of 10 ms ticks, then one that caught a 300 ms pause.
        for _ in 0..20 {
            clock.advance(Duration::from_millis(50));
            table.observe(0, ms(10), clock.now());
        }
        clock.advance(Duration::from_millis(50));
        let pause = LatencySample {
            mean: Duration::from_millis(60),
            peak: Duration::from_millis(300),
            count: 5,
        };
        table.observe(0, pause, clock.now());
        let plain = table.scores(clock.now()).next().unwrap().1;
        let held = table.held_score(0, clock.now()).unwrap();
        assert_eq!(plain.flags, 0);
        assert_eq!(held.flags, SCORE_FAR_ABOVE);
        assert_eq!(
            held.ewma_ns, plain.ewma_ns,
            "status and stall age see the estimate"
        );
        assert!(plain.ewma_ns >= 299_000_000, "{}", plain.ewma_ns);
        // The mean (at most 60 ms) at weight 2: half of it, in the same units.
        assert!(
            held.cost <= 30_000_000 && held.cost >= 5_000_000,
            "{}",
            held.cost
        );
        assert_eq!(
            (held.weight, held.updated_ns),
            (plain.weight, plain.updated_ns)
        );
        assert_eq!(table.held_score(7, clock.now()), None);
    }

    const PROBE_EVERY: Duration = Duration::from_millis(250);
    const TICK: Duration = Duration::from_millis(50);

    fn ms(v: u64) -> LatencySample {
        LatencySample::single(Duration::from_millis(v))
    }

    /// A backend added an hour after the start learns like one added at
    /// the start: its memories are dated when it joins.
    #[test]
    fn a_backend_added_later_starts_from_a_guess_dated_when_it_joins() {
        let clock = ManualClock::starting_at(0);
        let mut table = LoadTable::new(&[weight(1)], PARAMS, clock.now());
        clock.advance(Duration::from_secs(3600));
        table.reset(1, clock.now());
        let mut twin = LoadTable::new(&[weight(1)], PARAMS, clock.now());
        table.observe(1, ms(100), clock.now());
        twin.observe(0, ms(100), clock.now());
        clock.advance(Duration::from_millis(300));
        table.observe(1, ms(10), clock.now());
        twin.observe(0, ms(10), clock.now());
        let (added, fresh) = (table.ewma_ns(1, clock.now()), twin.ewma_ns(0, clock.now()));
        assert_eq!(
            added, fresh,
            "added an hour in: {added} ns, at the start: {fresh} ns"
        );
    }

    #[test]
    fn avoided_means_unsampled_within_the_probe_interval_while_the_vip_is_in_use() {
        let clock = ManualClock::starting_at(0);
        let mut table = LoadTable::new(&[weight(1); 5], PARAMS, clock.now());
        // VIP 0: backends 0, 1, 2; VIP 1: backends 3, 4.
        let probed: Vec<_> = [(0, 0), (1, 0), (2, 0), (3, 1), (4, 1)]
            .map(|(id, vip)| (id, vip, PROBE_EVERY))
            .to_vec();
        // Nothing in use: no extra probes anywhere.
        assert!(table.avoided(&probed, clock.now()).is_empty());
        clock.advance(TICK);
        table.observe(0, ms(6).counted(3), clock.now());
        table.observe(1, ms(6).counted(3), clock.now());
        assert_eq!(table.avoided(&probed, clock.now()), [2]);
        // Sampled a moment ago: not avoided; a probe interval later: avoided.
        table.observe(2, ms(6).counted(1), clock.now());
        assert!(table.avoided(&probed, clock.now()).is_empty());
        clock.advance(PROBE_EVERY);
        table.observe(0, ms(6).counted(3), clock.now());
        assert_eq!(table.avoided(&probed, clock.now()), [1, 2]);
    }

    /// Backend 2 of three answers one 40 ms response among 6 ms ones;
    /// users then send it requests only while its estimate is within a
    /// 3× re-draw bound over the median (as P2C's bound does), and with
    /// `probes`, an avoided backend gets a 6 ms probe every probe
    /// interval. Returns when it got user samples again, after the spike.
    fn back_in_the_draws_after(probes: bool) -> Option<Duration> {
        let clock = ManualClock::starting_at(0);
        let params = EstimateParams {
            peak_tau: Duration::from_secs(10),
            refute_after: DEFAULT_EWMA_REFUTE_AFTER,
            ..PARAMS
        };
        let mut table = LoadTable::new(&[weight(1); 3], params, clock.now());
        let probed: Vec<_> = (0..3).map(|id| (id, 0, PROBE_EVERY)).collect();
        for _ in 0..100 {
            clock.advance(TICK);
            for id in 0..3 {
                table.observe(id, ms(6).counted(5), clock.now());
            }
        }
        clock.advance(TICK);
        let spike = clock.now();
        let peak = LatencySample {
            mean: Duration::from_millis(8),
            peak: Duration::from_millis(40),
            count: 1,
        };
        table.observe(2, peak.counted(5), clock.now());
        let mut next_probe = Nanos(clock.now().0 + PROBE_EVERY.as_nanos() as u64);
        for _ in 0..200 {
            clock.advance(TICK);
            let now = clock.now();
            let median = table.ewma_ns(1, now) as f64;
            if table.ewma_ns(2, now) as f64 <= 3.0 * median {
                return Some(now.since(spike));
            }
            table.observe(0, ms(6).counted(5), now);
            table.observe(1, ms(6).counted(5), now);
            if probes && now >= next_probe {
                for id in table.avoided(&probed, now) {
                    let probe = ProbeSample::Response(Duration::from_millis(6));
                    table.observe_probe(id, probe, now, PROBE_EVERY);
                }
                next_probe = Nanos(now.0 + PROBE_EVERY.as_nanos() as u64);
            }
        }
        None
    }

    #[test]
    fn an_avoided_backend_with_fast_probes_is_back_within_half_a_second() {
        let with = back_in_the_draws_after(true).expect("never back with probes");
        assert!(with <= Duration::from_millis(600), "{with:?}");
        // Without probes the 10 s peak memory keeps it out for seconds
        // (τ·ln(40 ÷ 18) ≈ 8 s).
        let without = back_in_the_draws_after(false);
        assert!(
            without.is_none_or(|t| t > Duration::from_secs(5)),
            "{without:?}"
        );
    }

    #[test]
    fn tallies_count_events_and_ignore_unknown_backends() {
        let clock = ManualClock::starting_at(0);
        let mut table = LoadTable::new(&[weight(1)], PARAMS, clock.now());
        for event in [
            Event::Opened { backend: 0 },
            Event::Opened { backend: 0 },
            Event::Closed {
                backend: 0,
                reason: CloseReason::Fin,
            },
            Event::Closed {
                backend: 0,
                reason: CloseReason::Idle,
            },
            Event::Refused { backend: 0 },
            Event::Opened { backend: 9 },
        ] {
            table.apply(event, clock.now());
        }
        let (_, tally) = table.tallies().next().unwrap();
        assert_eq!(
            tally,
            Tally {
                opened: 2,
                responded: 0,
                closed: 2,
                refused: 1,
                expired: 1
            }
        );
    }

    fn median(mut v: Vec<u64>) -> u64 {
        v.sort_unstable();
        v[v.len() / 2]
    }

    /// Zone a's five backends serve 40 requests a second each at 5 ms,
    /// with a 20 ms response among them every second (scheduling noise);
    /// zone b's five, as fast, get only the probe share: a 5 ms sample
    /// each every 2 s. With the defaults (τ = 10 s for means and peaks),
    /// P2C's estimate puts zone a at 3× zone b and it would spill; the
    /// recent mean sees them alike. Then zone a turns 10× slower, and
    /// within 0.45 s its recent mean reads over 6× zone b's.
    #[test]
    fn zones_compare_by_recent_means_that_sampling_rates_do_not_bias() {
        let clock = ManualClock::starting_at(0);
        // Without refutation: here every 20 ms peak is followed by 16
        // answers of 5 ms, so refutation would take the bias away; with
        // noise more frequent than that (or under 2×) it stays.
        let params = EstimateParams {
            peak_tau: Duration::from_secs(10),
            refute_after: 0,
            ..PARAMS
        };
        let mut table = LoadTable::new(&[weight(1); 10], params, clock.now());
        let age = Duration::from_secs(10);
        let medians = |table: &LoadTable, now| {
            let ewma =
                |ids: std::ops::Range<u32>| median(ids.map(|id| table.ewma_ns(id, now)).collect());
            let zone = |ids: std::ops::Range<u32>| {
                median(
                    ids.map(|id| table.zone_latency_ns(id, now, age).unwrap())
                        .collect(),
                )
            };
            (ewma(0..5), ewma(5..10), zone(0..5), zone(5..10))
        };
        let noisy = LatencySample {
            mean: Duration::from_micros(12_500),
            peak: Duration::from_millis(20),
            count: 1,
        };
        for tick in 0..200u32 {
            clock.advance(TICK);
            let now = clock.now();
            for id in 0..5 {
                let sample = if (tick + id * 3) % 20 == 0 {
                    noisy
                } else {
                    ms(5)
                };
                table.observe(id, sample.counted(2), now);
            }
            for id in 5..10 {
                if (tick + id * 8) % 40 == 0 {
                    table.observe(id, ms(5).counted(1), now);
                }
            }
        }
        let (ewma_a, ewma_b, zone_a, zone_b) = medians(&table, clock.now());
        assert!(
            ewma_a as f64 >= 3.0 * ewma_b as f64,
            "the bias this guards against: {ewma_a} vs {ewma_b}"
        );
        assert!(
            (zone_a as f64) < 1.5 * zone_b as f64,
            "recent means {zone_a} vs {zone_b}"
        );
        for tick in 0..9u32 {
            clock.advance(TICK);
            let now = clock.now();
            for id in 0..5 {
                table.observe(id, ms(50).counted(2), now);
            }
            if tick == 4 {
                table.observe(7, ms(5).counted(1), now);
            }
        }
        let (_, _, zone_a, zone_b) = medians(&table, clock.now());
        assert!(
            zone_a as f64 >= 6.0 * zone_b as f64,
            "0.45 s after zone a turned 10× slower: {zone_a} vs {zone_b}"
        );
    }

    #[test]
    fn answers_not_taken_as_latency_still_show_the_backend_is_serving() {
        let clock = ManualClock::starting_at(0);
        let mut table = LoadTable::new(&[weight(1); 2], PARAMS, clock.now());
        let idle = Duration::from_secs(1);
        clock.advance(Duration::from_secs(5));
        table.observe(0, ms(5).counted(4), clock.now());
        table.observe(1, ms(5).counted(4), clock.now());
        clock.advance(Duration::from_secs(2));
        let estimate = table.ewma_ns(0, clock.now());
        let zone = table.zone_latency_ns(0, clock.now(), Duration::from_secs(3));
        assert!(!table.answered_within(0, clock.now(), idle));
        // Two answers of an outage: not latency, but users are served.
        table.answered(0, 2, clock.now());
        assert!(table.answered_within(0, clock.now(), idle));
        assert_eq!(table.ewma_ns(0, clock.now()), table.ewma_ns(1, clock.now()));
        assert_eq!(table.ewma_ns(0, clock.now()), estimate);
        assert_eq!(
            table.zone_latency_ns(0, clock.now(), Duration::from_secs(3)),
            zone
        );
        // So a probe now has nothing to add, as with users' samples.
        let probe = ProbeSample::AtLeast(Duration::from_millis(200));
        assert_eq!(
            table.observe_probe(0, probe, clock.now(), idle),
            Some(ProbeOutcome::Busy)
        );
        assert_eq!(
            table.observe_probe(1, probe, clock.now(), idle),
            Some(ProbeOutcome::Applied)
        );
        let responded = |table: &LoadTable, id| {
            table
                .tallies()
                .find(|&(i, _)| i == id)
                .map(|(_, t)| t.responded)
        };
        assert_eq!(responded(&table, 0), Some(6));
        // Unknown ids are ignored.
        table.answered(9, 1, clock.now());
    }

    #[test]
    fn an_unsampled_or_stale_backend_has_no_zone_latency() {
        let clock = ManualClock::starting_at(0);
        let mut table = LoadTable::new(&[weight(1); 2], PARAMS, clock.now());
        let age = Duration::from_secs(2);
        assert_eq!(table.zone_latency_ns(0, clock.now(), age), None);
        // A probe is not a user sample.
        table.observe_probe(
            0,
            ProbeSample::Response(Duration::from_millis(3)),
            clock.now(),
            age,
        );
        assert_eq!(table.zone_latency_ns(0, clock.now(), age), None);
        // The first user sample is the figure (no blend with cold start).
        clock.advance(Duration::from_secs(30));
        table.observe(0, ms(8).counted(1), clock.now());
        assert_eq!(table.zone_latency_ns(0, clock.now(), age), Some(8_000_000));
        clock.advance(Duration::from_secs(3));
        assert_eq!(table.zone_latency_ns(0, clock.now(), age), None);
        assert_eq!(table.zone_latency_ns(9, clock.now(), age), None);
    }
}
