//! A backend's latency estimate: a short-memory Peak-EWMA next to a
//! long-memory EWMA of mean latency, the larger of the two counting.
//!
//! One Peak-EWMA with a long τ (Finagle's and linkerd's default is 10 s)
//! punishes a backend for a single slow response for as long as τ·ln(peak
//! ÷ normal): a 40 ms outlier on a 6 ms backend keeps it out of a P2C
//! pool with a 3× re-draw bound for about 8 s, and nothing but time brings
//! it back, since an avoided backend produces no samples. A pause's
//! 300 ms samples do the same to a backend that resumed long ago.
//!
//! So the two jobs are split:
//! * [`PeakEwma`] with its own τ (`ewma_peak_tau`: by default as long as
//!   `ewma_tau`, which makes it one Finagle Peak-EWMA; shorter trades tail
//!   for forgiveness) keeps the peak sensitivity: the first slow response
//!   still counts at once, and a backend that stays slow keeps it high
//!   with every sample;
//! * an [`Ewma`] of each refresh interval's *mean* latency with the long
//!   τ (`ewma_tau`) remembers persistent slowness: a backend that was slow
//!   for many samples stays avoided after its peaks are forgotten, while
//!   one outlier among many fast samples moves it by a few percent.
//!
//! This is the "short-memory estimate next to the long one" of issue 13;
//! the kernel's stall age covers the first milliseconds of a pause before
//! any sample exists.
//!
//! **Refutation** ([`crate::estimate::refute`]): both memories forget by
//! time only, so a backend that was slow once and answers fast again
//! would wait out τ·ln(peak ÷ bound) while its fast responses arrive.
//! A run of `ewma_refute_after` responses each at most half the estimate
//! restarts both memories from what the run measured, unless the backend
//! relapsed within τ of its last refutation (recurring slowness stays
//! remembered).
//!
//! **Latency probes** (issue 13's out-of-band probes): a backend whose
//! estimate is far above its pool is avoided, so it gets no requests and
//! no samples, and with a long peak memory only time brings it back. An
//! active health check's timing fixes that without spending a user
//! request ([`LatencyEstimate::observe_probe`]). The rule:
//! * a probe counts only for a backend *avoided* for at least `idle` (no
//!   user response that long, `--latency-probe-interval`): a backend that
//!   users measure keeps exactly the estimate their samples give;
//! * it then stands for a tick whose peak is the probe's latency: it
//!   *replaces* the peak memory, downwards as well as upwards. The stored
//!   peak is a memory of responses older than `idle` that nothing can
//!   refute any more; the probe is the one fresh measurement. (Blending it
//!   in like a user peak, with `w = exp(-Δt/τ)`, would not pull a 10 s
//!   peak memory down at all: that is no faster than the idle drift);
//! * it never enters the long memory of user means: a persistently slow
//!   backend stays avoided by it whatever one probe says, and probes never
//!   dilute what users measured; a probe below the estimate only takes
//!   that memory down to what users measured over τ (or to the probe, if
//!   they never did), removing the cold-start guess and its idle drift
//!   ([`LatencyEstimate::observe_probe`]);
//! * a probe that only proves the backend's kernel answers (a TCP
//!   connect) or that timed out can raise the estimate, never lower it; a
//!   failed probe gives no sample at all.
//!
//! **Comparing zones** needs a third figure, [`LatencyEstimate::recent_mean_ns`]:
//! an EWMA of the interval means with a fixed short memory
//! ([`RECENT_MEAN_TAU`]), no peaks, no idle drift, users' samples only.
//! The estimate above is biased by how often a backend is sampled: a
//! backend serving 40 requests a second keeps the largest of its last few
//! hundred responses in its peak memory, while a backend of a failover
//! zone that only gets the zone's probe share (a sample every few seconds)
//! keeps one; between samples it drifts towards the cold-start guess as
//! well. Two zones of equally fast backends then look 3× apart as soon as
//! scheduling noise puts a 15 ms response among a 5 ms zone's hundreds,
//! and a healthy local zone spills. The recent mean weighs one slow
//! response among many by its share of the interval, and a zone 10×
//! slower than its peers still shows 6× within half a second.

use std::time::Duration;

pub use crate::{estimate::sample::LatencySample, settings::config::EstimateParams};
use crate::{
    estimate::{ewma::Ewma, mean::MeasuredMean, peak_ewma::PeakEwma, refute::Refutation},
    kernel::clock::Nanos,
};

/// One probe's measurement (see the module's rule).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeSample {
    /// Request sent to first response byte: what a user sample measures.
    Response(Duration),
    /// A lower bound only: a TCP connect time (answered by the backend's
    /// kernel, not the server), or the timeout of a probe with no answer.
    AtLeast(Duration),
}

/// What [`LatencyEstimate::observe_probe`] did with a probe.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeOutcome {
    /// Users were answered within `idle`: their samples rule.
    Busy,
    /// The peak memory now holds the probe.
    Applied,
    /// A lower bound at or below the estimate: nothing to learn.
    Unchanged,
    /// A lower latency, ignored: the backend relapsed soon after its
    /// estimate was last lowered (see [`crate::estimate::refute`]).
    Barred,
}

/// The memory of [`LatencyEstimate::recent_mean_ns`]: a zone whose
/// backends turn 10× slower reads 6× slower after about 0.4 s.
pub const RECENT_MEAN_TAU: Duration = Duration::from_millis(500);

#[derive(Clone, Debug)]
pub struct LatencyEstimate {
    recent: PeakEwma,
    sustained: Ewma,
    /// Users' interval means over about [`RECENT_MEAN_TAU`].
    recent_mean: Ewma,
    /// Users' interval means over τ, with no prior and no idle drift:
    /// the cost of a held backend ([`LatencyEstimate::held_ns`]).
    measured: MeasuredMean,
    /// When the last user sample arrived (probes do not count).
    last_user: Option<Nanos>,
    /// When users were last answered, their latency taken or not (see
    /// [`LatencyEstimate::answered`]).
    last_answer: Option<Nanos>,
    /// The current run of fast responses (see [`crate::estimate::refute`]).
    refutation: Refutation,
}

impl LatencyEstimate {
    /// A backend with no samples yet: both parts are at the cold-start value.
    pub fn new(params: EstimateParams, now: Nanos) -> Self {
        let EstimateParams {
            cold_start,
            tau,
            peak_tau,
            refute_after,
        } = params;
        Self {
            recent: PeakEwma::new(cold_start, peak_tau.min(tau), now),
            sustained: Ewma::new(cold_start, tau, now),
            recent_mean: Ewma::new(cold_start, RECENT_MEAN_TAU, now),
            measured: MeasuredMean::new(tau, now),
            last_user: None,
            last_answer: None,
            refutation: Refutation::new(refute_after, tau),
        }
    }

    /// One tick's user samples. A run of `refute_after` fast ones refutes
    /// both memories, unless the backend relapsed lately (see
    /// [`crate::estimate::refute`]).
    ///
    /// A tick never raises the estimate above both what it was and the
    /// tick's peak: the peak memory sees to it for itself (see
    /// [`PeakEwma`]); the long memory of means blends as a plain
    /// time-weighted average (exact under load), capped there. After an
    /// idle spell that blend gives back what the drift had taken (the
    /// mean stands for the whole idle time), and a 10 ms tick took a
    /// backend avoided for 20 s after 10 s at 300 ms from 27 to 34 ms.
    /// Under load the cap does not bind as long as the peaks keep the
    /// estimate above the means, so the mean stays unbiased.
    pub fn observe(&mut self, sample: LatencySample, now: Nanos) {
        let estimate = self.estimate_ns(now);
        let refuted = self.refutation.record(sample, estimate, now);
        if sample.count == 0 {
            // A peak alone: its response, and so its mean, came with an
            // earlier tick.
            self.recent.observe(sample.peak, now);
            return;
        }
        match refuted {
            Some(run) => {
                self.recent.reset(run.peak, now);
                self.sustained.replace(run.mean, now);
                self.measured.replace(run.mean, now);
            }
            None => {
                self.recent.observe(sample.peak, now);
                let ceiling = estimate.max(sample.peak.as_nanos() as f64);
                self.sustained.blend_at_most(sample.mean, now, ceiling);
                self.measured.blend(sample.mean, now);
            }
        }
        // The first sample is the mean, not a blend with the cold-start guess.
        if self.recent_mean.last_sample().is_none() {
            self.recent_mean.replace(sample.mean, now);
        } else {
            self.recent_mean.blend(sample.mean, now);
        }
        self.last_user = Some(self.last_user.map_or(now, |t| t.max(now)));
        self.answered(now);
    }

    /// Users were answered by `now`, whether or not their latency is
    /// taken: answers that waited on a health outage
    /// (`Lifecycle::measures_service`) are not latency, yet they show the
    /// backend serves users, so a probe then has nothing to add
    /// ([`LatencyEstimate::observe_probe`]).
    pub fn answered(&mut self, now: Nanos) {
        self.last_answer = Some(self.last_answer.map_or(now, |t| t.max(now)));
    }

    /// When users were last answered, if ever (see
    /// [`LatencyEstimate::answered`]).
    pub fn last_answer(&self) -> Option<Nanos> {
        self.last_answer
    }

    /// An out-of-band probe's measurement, taken at `now`; it counts only
    /// if users were not answered within `idle` (see the module's rule).
    pub fn observe_probe(
        &mut self,
        probe: ProbeSample,
        now: Nanos,
        idle: Duration,
    ) -> ProbeOutcome {
        if self.last_answer.is_some_and(|t| now.since(t) < idle) {
            return ProbeOutcome::Busy;
        }
        match probe {
            ProbeSample::Response(latency) => {
                let estimate = self.estimate_ns(now);
                let lowers = (latency.as_nanos() as f64) < estimate;
                if lowers && self.refutation.barred(now) {
                    return ProbeOutcome::Barred;
                }
                if lowers {
                    self.refutation
                        .lowered_by_probe(estimate, latency.as_nanos() as f64, now);
                    self.lower_the_guess(latency, now);
                }
                self.recent.reset(latency, now);
                ProbeOutcome::Applied
            }
            ProbeSample::AtLeast(bound) if bound.as_nanos() as f64 > self.estimate_ns(now) => {
                self.recent.reset(bound, now);
                ProbeOutcome::Applied
            }
            ProbeSample::AtLeast(_) => ProbeOutcome::Unchanged,
        }
    }

    /// A probe's `latency` below the estimate takes the long memory of
    /// means down as far as the evidence allows: to what users measured
    /// over τ ([`MeasuredMean`]: no prior, no idle drift), or to the probe
    /// where users never measured it. What is above that in the long
    /// memory is the cold-start guess (`--ewma-cold-start`), the memory's
    /// start and where it drifts while idle, not a measurement. Without
    /// this a backend faster than a third of that guess (a pool of 100 µs
    /// servers, against 1 ms) stayed at the guess, beyond its pool's
    /// re-draw bound, while never measured or once idle a few seconds, and
    /// its probes could not bring it back: they reset only the peak
    /// memory. A slow backend's own means stay (a fast probe does not
    /// forget 10 s of users' 100 ms answers).
    fn lower_the_guess(&mut self, latency: Duration, now: Nanos) {
        let probe = latency.as_nanos() as f64;
        let floor = self.measured.mean_ns().map_or(probe, |m| m.max(probe));
        if self.sustained.estimate_ns(now) > floor {
            self.sustained
                .replace(Duration::from_nanos(floor as u64), now);
        }
    }

    /// When the last user sample arrived, if ever (probes do not count:
    /// this says whether users measured the backend lately).
    pub fn last_sample(&self) -> Option<Nanos> {
        self.last_user
    }

    /// The mean latency users measured lately, as of their last sample
    /// (`None` before the first); what zones are compared by (see the
    /// module's docs).
    pub fn recent_mean_ns(&self) -> Option<f64> {
        self.last_user?;
        Some(self.recent_mean.stored_ns())
    }

    /// What a backend held far above its pool competes with
    /// ([`lb_common::SCORE_FAR_ABOVE`], as its cost): its mean latency
    /// rather than its peaks, never above [`LatencyEstimate::estimate_ns`].
    /// The mean is the larger of the [measured mean](MeasuredMean) over τ
    /// (no prior, no idle drift: an avoided backend keeps the mean users
    /// last measured) and the recent mean (which follows a backend turning
    /// slow within about half a second, while the long memory is still
    /// catching up). A backend users never measured is held at its
    /// estimate: what probes measured, the only evidence there is (the
    /// long memory would still hold the cold-start guess, far below it).
    pub fn held_ns(&self, now: Nanos) -> f64 {
        self.held_ns_below(self.estimate_ns(now), now)
    }

    /// [`LatencyEstimate::held_ns`] for a caller that has the estimate at
    /// `now` already (one tick computes it once per backend).
    pub fn held_ns_below(&self, estimate: f64, now: Nanos) -> f64 {
        match self.measured.mean_ns() {
            Some(measured) => measured
                .max(self.recent_mean.estimate_ns(now))
                .min(estimate),
            None => estimate,
        }
    }

    /// The estimate at `now`: the larger of the two, each with its idle
    /// drift towards cold start.
    pub fn estimate_ns(&self, now: Nanos) -> f64 {
        self.recent
            .estimate_ns(now)
            .max(self.sustained.estimate_ns(now))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::config::DEFAULT_EWMA_REFUTE_AFTER;
    use crate::{
        estimate::testing::{COLD, MS, TAU},
        kernel::clock::{Clock, ManualClock},
    };

    const PEAK_TAU: Duration = Duration::from_secs(1);
    const PARAMS: EstimateParams = EstimateParams {
        cold_start: COLD,
        tau: TAU,
        peak_tau: PEAK_TAU,
        refute_after: DEFAULT_EWMA_REFUTE_AFTER,
    };
    const TICK: Duration = Duration::from_millis(50);

    fn ms(v: u64) -> LatencySample {
        LatencySample::single(Duration::from_millis(v))
    }

    /// `seconds` of ticks each measuring `sample`.
    fn feed(e: &mut LatencyEstimate, clock: &ManualClock, sample: LatencySample, seconds: f64) {
        let ticks = (seconds / TICK.as_secs_f64()).round() as u32;
        for _ in 0..ticks {
            clock.advance(TICK);
            e.observe(sample, clock.now());
        }
    }

    #[test]
    fn a_staller_is_held_at_its_mean_not_its_pause() {
        let clock = ManualClock::starting_at(0);
        let mut e = LatencyEstimate::new(PARAMS, clock.now());
        // 2 s of 10 ms answers, then a tick that caught a 300 ms pause
        // (mean over the tick's answers 60 ms), then 10 ms again.
        feed(&mut e, &clock, ms(10), 2.0);
        clock.advance(TICK);
        e.observe(
            LatencySample {
                mean: Duration::from_millis(60),
                peak: Duration::from_millis(300),
                count: 5,
            },
            clock.now(),
        );
        let peak = e.estimate_ns(clock.now()) / MS;
        let held = e.held_ns(clock.now()) / MS;
        assert!(peak >= 299.0, "{peak}");
        assert!((10.0..=60.0).contains(&held), "{held}");
        // Half a second of 10 ms answers (10 ticks: fewer than a
        // refutation's run, as for a staller the relapse bar keeps from
        // refuting).
        feed(&mut e, &clock, ms(10), 0.5);
        let (peak, held) = (e.estimate_ns(clock.now()) / MS, e.held_ns(clock.now()) / MS);
        // The peak memory (τ 1 s here) still says 100+ ms; the recent mean
        // (τ 0.5 s) is most of the way back: 10 + 50/e ≈ 28 ms.
        assert!(peak > 100.0, "{peak}");
        assert!((10.0..35.0).contains(&held), "{held}");
        // Never above the estimate, even for a backend never sampled.
        let fresh = LatencyEstimate::new(PARAMS, Nanos(0));
        assert!(fresh.held_ns(Nanos(0)) <= fresh.estimate_ns(Nanos(0)));
        // A backend that turned slow for good: held at its new latency.
        let mut slow = e.clone();
        feed(&mut slow, &clock, ms(100), 1.0);
        let held = slow.held_ns(clock.now()) / MS;
        assert!(held > 80.0, "{held}");
    }

    #[test]
    fn a_slow_backend_held_after_two_ticks_is_held_at_its_latency_for_good() {
        // hetero: a 100 ms backend among 12 ms ones is avoided after its
        // first ticks, and gets no user sample after that.
        let clock = ManualClock::starting_at(0);
        let mut e = LatencyEstimate::new(PARAMS, clock.now());
        clock.advance(Duration::from_secs(3));
        feed(&mut e, &clock, ms(100), 0.1);
        let held = e.held_ns(clock.now()) / MS;
        assert!((95.0..=100.5).contains(&held), "{held}");
        // 20 s avoided, its peak kept up by 100 ms probes (they touch the
        // peak memory only): still held at 100 ms, not drifting to the
        // cold start below its fast peers.
        let probe_100ms = |e: &mut LatencyEstimate, now| {
            e.observe_probe(
                ProbeSample::Response(Duration::from_millis(100)),
                now,
                Duration::from_millis(250),
            )
        };
        for _ in 0..80 {
            clock.advance(Duration::from_millis(250));
            probe_100ms(&mut e, clock.now());
        }
        let held = e.held_ns(clock.now()) / MS;
        assert!((95.0..=100.5).contains(&held), "{held}");
        // Measured by probes only (they came back before any user's
        // answer): held at what they measured, not at the cold start.
        let mut probed = LatencyEstimate::new(PARAMS, Nanos(0));
        probe_100ms(&mut probed, clock.now());
        let held = probed.held_ns(clock.now()) / MS;
        assert!((95.0..=100.5).contains(&held), "{held}");
        // Before this mean, the long memory of means blended the two ticks
        // into its 1 ms cold start and then drifted back towards it.
        let sustained = e.sustained.estimate_ns(clock.now()) / MS;
        assert!(sustained < 5.0, "{sustained}");
    }

    #[test]
    fn the_first_slow_response_counts_at_once() {
        let clock = ManualClock::starting_at(0);
        let mut e = LatencyEstimate::new(PARAMS, clock.now());
        feed(&mut e, &clock, ms(6), 5.0);
        clock.advance(TICK);
        e.observe(ms(60), clock.now());
        assert!(e.estimate_ns(clock.now()) >= 60.0 * MS);
    }

    #[test]
    fn one_outlier_is_forgotten_in_about_a_second_not_tau() {
        let clock = ManualClock::starting_at(0);
        let mut e = LatencyEstimate::new(PARAMS, clock.now());
        feed(&mut e, &clock, ms(6), 5.0);
        // One 40 ms response, then the backend is avoided (no samples).
        clock.advance(TICK);
        e.observe(
            LatencySample {
                mean: Duration::from_millis(10),
                peak: Duration::from_millis(40),
                count: 1,
            },
            clock.now(),
        );
        clock.advance(Duration::from_millis(1_500));
        let after = e.estimate_ns(clock.now()) / MS;
        // Below a 3× re-draw bound over 6 ms peers again.
        assert!(after < 18.0, "{after}");
        // A single Peak-EWMA with τ = 10 s would still say about 34 ms.
        let mut single = PeakEwma::new(COLD, TAU, Nanos(0));
        single.observe(Duration::from_millis(40), Nanos(0));
        let single_after = single.estimate_ns(Nanos(1_500_000_000)) / MS;
        assert!(single_after > 30.0, "{single_after}");
    }

    #[test]
    fn persistent_slowness_is_remembered_after_the_peaks_fade() {
        let clock = ManualClock::starting_at(0);
        let mut e = LatencyEstimate::new(PARAMS, clock.now());
        feed(&mut e, &clock, ms(60), 20.0);
        // Avoided for 3 s: the short memory is back near cold start, the
        // long one still well above a 6 ms pool's 18 ms bound.
        clock.advance(Duration::from_secs(3));
        let after = e.estimate_ns(clock.now()) / MS;
        assert!(after > 30.0, "{after}");
        assert!(e.recent.estimate_ns(clock.now()) / MS < 10.0);
    }

    /// The estimate never rises with a tick whose responses were all at
    /// or below it: after an idle spell, a fast tick used to give the
    /// decayed memories back what time had taken (both blended into the
    /// value of their last sample, not into what they had decayed to).
    #[test]
    fn a_fast_tick_after_an_idle_spell_never_raises_the_estimate() {
        // The defaults (one memory τ of 10 s): one 300 ms answer, then
        // 20 s avoided; the peak memory said 49 ms after a 10 ms answer.
        let clock = ManualClock::starting_at(0);
        // 20 s avoided, then a 10 ms answer: the estimate does not rise.
        let avoided_then_fast = |e: &mut LatencyEstimate| {
            clock.advance(Duration::from_secs(20));
            let before = e.estimate_ns(clock.now());
            e.observe(ms(10), clock.now());
            let after = e.estimate_ns(clock.now());
            assert!(
                after <= before,
                "{} ms after, {} ms before",
                after / MS,
                before / MS
            );
        };
        let mut e = LatencyEstimate::new(DEFAULT_PARAMS, clock.now());
        e.observe(ms(300), clock.now());
        avoided_then_fast(&mut e);
        // A short peak memory (1 s): 10 s slow, then 20 s avoided. The
        // long memory of means said 34 ms after a 10 ms tick, from 27.
        let mut e = LatencyEstimate::new(PARAMS, clock.now());
        feed(&mut e, &clock, ms(300), 10.0);
        avoided_then_fast(&mut e);
        // A tick above the estimate raises it to the tick's peak, no further.
        clock.advance(Duration::from_secs(20));
        let peak = e.estimate_ns(clock.now()) / MS + 1.0;
        let tick = LatencySample {
            mean: Duration::from_secs_f64(peak * 0.8 / 1e3),
            peak: Duration::from_secs_f64(peak / 1e3),
            count: 4,
        };
        e.observe(tick, clock.now());
        let after = e.estimate_ns(clock.now()) / MS;
        assert!(after <= peak + 1e-6, "{after} ms, above the {peak} ms peak");
    }

    #[test]
    fn a_recovered_backend_comes_down_with_its_samples() {
        let clock = ManualClock::starting_at(0);
        let mut e = LatencyEstimate::new(PARAMS, clock.now());
        feed(&mut e, &clock, ms(60), 3.0);
        feed(&mut e, &clock, ms(6), 10.0);
        let after = e.estimate_ns(clock.now()) / MS;
        assert!(after < 20.0, "{after}");
    }

    /// `recover`: a second of 100 ms answers, the queue it built drained
    /// with a 1 s peak, then 10 ms answers at a few per tick (a share of
    /// traffic well under the backend's fair one).
    #[test]
    fn a_run_of_fast_responses_refutes_a_slow_phase_in_well_under_a_second() {
        let clock = ManualClock::starting_at(0);
        let mut e = LatencyEstimate::new(DEFAULT_PARAMS, clock.now());
        feed(&mut e, &clock, ms(10).counted(5), 5.0);
        feed(&mut e, &clock, ms(100).counted(1), 1.0);
        clock.advance(TICK);
        e.observe(
            LatencySample {
                mean: Duration::from_millis(500),
                peak: Duration::from_millis(1_000),
                count: 20,
            },
            clock.now(),
        );
        let mut without = e.clone();
        let mut ticks = 0;
        while e.estimate_ns(clock.now()) / MS > 15.0 {
            ticks += 1;
            assert!(ticks <= 6, "not refuted after {ticks} ticks of 3");
            clock.advance(TICK);
            e.observe(ms(10).counted(3), clock.now());
        }
        // 16 responses: the sixth tick.
        assert_eq!(ticks, 6);
        // Fifteen fast responses over 3 s, one short of a run, leave it far
        // above a 3× bound: time alone wears a peak down slowly.
        for _ in 0..15 {
            clock.advance(Duration::from_millis(200));
            without.observe(ms(10), clock.now());
        }
        let slow = without.estimate_ns(clock.now()) / MS;
        assert!(slow > 100.0, "{slow}");
    }

    #[test]
    fn a_backend_slow_one_response_in_four_is_not_refuted() {
        let clock = ManualClock::starting_at(0);
        let mut e = LatencyEstimate::new(DEFAULT_PARAMS, clock.now());
        // Ticks of 4 responses, one of them 100 ms, the rest 10 ms.
        let mixed = LatencySample {
            mean: Duration::from_micros(32_500),
            peak: Duration::from_millis(100),
            count: 4,
        };
        feed(&mut e, &clock, mixed, 10.0);
        assert!(e.estimate_ns(clock.now()) / MS > 90.0);
    }

    /// A tick whose 300 ms response was counted without its peak (it
    /// raced the kernel's epoch change), then that peak alone: the peak
    /// memory takes it, the means and the last user sample stay.
    #[test]
    fn a_peak_alone_feeds_the_peak_memory_only() {
        let clock = ManualClock::starting_at(0);
        let mut e = LatencyEstimate::new(DEFAULT_PARAMS, clock.now());
        feed(&mut e, &clock, ms(10).counted(4), 2.0);
        let mean = Duration::from_millis(68);
        let raced = LatencySample {
            mean,
            peak: mean,
            count: 5,
        };
        clock.advance(TICK);
        e.observe(raced, clock.now());
        let counted = e.clone();
        clock.advance(TICK);
        let alone = LatencySample::single(Duration::from_millis(300)).counted(0);
        e.observe(alone, clock.now());
        assert!(e.estimate_ns(clock.now()) / MS >= 299.0);
        assert_eq!(e.last_sample(), counted.last_sample());
        assert_eq!(
            e.held_ns_below(1e12, clock.now()),
            counted.held_ns_below(1e12, clock.now())
        );
        assert_eq!(e.recent_mean_ns(), counted.recent_mean_ns());
    }

    /// The default: one memory τ for peaks and means.
    const DEFAULT_PARAMS: EstimateParams = EstimateParams {
        cold_start: COLD,
        tau: TAU,
        peak_tau: TAU,
        refute_after: DEFAULT_EWMA_REFUTE_AFTER,
    };
    const PROBE_EVERY: Duration = Duration::from_millis(250);

    /// 5 s of 6 ms ticks, then one tick with a 40 ms response.
    fn spiked(params: EstimateParams) -> (ManualClock, LatencyEstimate) {
        let clock = ManualClock::starting_at(0);
        let mut e = LatencyEstimate::new(params, clock.now());
        feed(&mut e, &clock, ms(6), 5.0);
        clock.advance(TICK);
        e.observe(
            LatencySample {
                mean: Duration::from_millis(7),
                peak: Duration::from_millis(40),
                count: 1,
            },
            clock.now(),
        );
        (clock, e)
    }

    fn probe_ms(v: u64) -> ProbeSample {
        ProbeSample::Response(Duration::from_millis(v))
    }

    #[test]
    fn a_fast_probe_brings_an_avoided_backend_back_below_the_redraw_bound() {
        let (clock, mut e) = spiked(DEFAULT_PARAMS);
        let mut without = e.clone();
        // Avoided: no user samples. The first probe counts once the backend
        // went a probe interval without any.
        clock.advance(PROBE_EVERY);
        assert_eq!(
            e.observe_probe(probe_ms(6), clock.now(), PROBE_EVERY),
            ProbeOutcome::Applied
        );
        let after = e.estimate_ns(clock.now()) / MS;
        // Within a 3× re-draw bound over 6 ms peers, at the first probe.
        assert!(after < 18.0, "{after}");
        assert!(after >= 6.0, "{after}: the probe, not cold start");
        // Without probes the 10 s peak memory holds it out for seconds.
        clock.advance(Duration::from_secs(3));
        without.observe(ms(6), clock.now());
        let without_after = without.estimate_ns(clock.now()) / MS;
        assert!(without_after > 18.0, "{without_after}");
    }

    /// `stall`: a backend pauses for 300 ms every 2 s. A probe brings it
    /// back after its first pause; after the second (a relapse) probes are
    /// barred until it has gone τ without one.
    #[test]
    fn a_probe_cannot_bring_back_a_backend_that_relapsed() {
        let clock = ManualClock::starting_at(0);
        let mut e = LatencyEstimate::new(DEFAULT_PARAMS, clock.now());
        let pause = LatencySample {
            mean: Duration::from_millis(200),
            peak: Duration::from_millis(300),
            count: 2,
        };
        feed(&mut e, &clock, ms(10).counted(3), 5.0);
        clock.advance(TICK);
        e.observe(pause, clock.now());
        clock.advance(PROBE_EVERY);
        assert_eq!(
            e.observe_probe(probe_ms(10), clock.now(), PROBE_EVERY),
            ProbeOutcome::Applied
        );
        // Back in use, then the next pause.
        feed(&mut e, &clock, ms(10).counted(3), 1.5);
        clock.advance(TICK);
        e.observe(pause, clock.now());
        clock.advance(PROBE_EVERY);
        assert_eq!(
            e.observe_probe(probe_ms(10), clock.now(), PROBE_EVERY),
            ProbeOutcome::Barred
        );
        assert!(e.estimate_ns(clock.now()) / MS > 250.0);
        // A probe that raises it still counts.
        clock.advance(PROBE_EVERY);
        assert_eq!(
            e.observe_probe(probe_ms(400), clock.now(), PROBE_EVERY),
            ProbeOutcome::Applied
        );
        // τ after the relapse, with no pause seen since: probes count again.
        clock.advance(TAU);
        assert_eq!(
            e.observe_probe(probe_ms(10), clock.now(), PROBE_EVERY),
            ProbeOutcome::Applied
        );
        assert!(e.estimate_ns(clock.now()) / MS < 60.0);
    }

    /// The fault lab's case with probes and the default memory: a fast
    /// backend (2.5 ms) has one noisy response (12 ms, in a tick of four),
    /// is avoided and probed back down, and seconds later is slow for half
    /// a second (25 ms). Its first probe after it recovered brings it back:
    /// the noise was no episode, so the slow phase is no relapse.
    #[test]
    fn a_probe_brings_back_a_backend_slow_once_after_noise() {
        let clock = ManualClock::starting_at(0);
        let mut e = LatencyEstimate::new(DEFAULT_PARAMS, clock.now());
        let fast = LatencySample::single(Duration::from_micros(2_500)).counted(4);
        feed(&mut e, &clock, fast, 3.0);
        clock.advance(TICK);
        e.observe(
            LatencySample {
                mean: Duration::from_micros(4_375),
                peak: Duration::from_millis(12),
                count: 4,
            },
            clock.now(),
        );
        clock.advance(PROBE_EVERY);
        assert_eq!(
            e.observe_probe(probe_ms(2), clock.now(), PROBE_EVERY),
            ProbeOutcome::Applied
        );
        feed(&mut e, &clock, fast, 2.0);
        feed(&mut e, &clock, ms(25).counted(2), 0.5);
        clock.advance(PROBE_EVERY);
        assert_eq!(
            e.observe_probe(probe_ms(2), clock.now(), PROBE_EVERY),
            ProbeOutcome::Applied
        );
        let after = e.estimate_ns(clock.now()) / MS;
        assert!(after < 7.5, "{after}: within 3× of its 2.5 ms peers");
    }

    #[test]
    fn a_probe_of_a_backend_users_still_sample_changes_nothing() {
        let clock = ManualClock::starting_at(0);
        let mut busy = LatencyEstimate::new(DEFAULT_PARAMS, clock.now());
        let mut twin = busy.clone();
        // 5 s of 20 ms user ticks; a 1 ms probe every 250 ms in between.
        for tick in 1..=100u32 {
            clock.advance(TICK);
            busy.observe(ms(20), clock.now());
            twin.observe(ms(20), clock.now());
            if tick % 5 == 0 {
                clock.advance(Duration::from_millis(1));
                assert_eq!(
                    busy.observe_probe(probe_ms(1), clock.now(), PROBE_EVERY),
                    ProbeOutcome::Busy
                );
            }
            assert_eq!(busy.estimate_ns(clock.now()), twin.estimate_ns(clock.now()));
        }
        // A probe never counts as a user sample.
        assert_eq!(busy.last_sample(), twin.last_sample());
    }

    #[test]
    fn a_probe_counts_only_after_a_whole_probe_interval_without_users() {
        let (clock, mut e) = spiked(DEFAULT_PARAMS);
        let before = e.clone();
        clock.advance(PROBE_EVERY - Duration::from_millis(1));
        assert_eq!(
            e.observe_probe(probe_ms(6), clock.now(), PROBE_EVERY),
            ProbeOutcome::Busy
        );
        assert_eq!(e.estimate_ns(clock.now()), before.estimate_ns(clock.now()));
    }

    #[test]
    fn a_failed_connect_only_or_timed_out_probe_never_lowers_the_estimate() {
        let (clock, mut e) = spiked(DEFAULT_PARAMS);
        clock.advance(Duration::from_secs(1));
        let before = e.estimate_ns(clock.now());
        // A connect time (answered by the backend's kernel, not the server).
        assert_eq!(
            e.observe_probe(
                ProbeSample::AtLeast(Duration::from_micros(100)),
                clock.now(),
                PROBE_EVERY
            ),
            ProbeOutcome::Unchanged
        );
        assert_eq!(e.estimate_ns(clock.now()), before);
        // A timeout is a latency of at least the timeout: it raises.
        assert_eq!(
            e.observe_probe(
                ProbeSample::AtLeast(Duration::from_millis(500)),
                clock.now(),
                PROBE_EVERY
            ),
            ProbeOutcome::Applied
        );
        assert!(e.estimate_ns(clock.now()) >= 500.0 * MS);
        // A failed check gives no sample at all (see `pool::health`), so
        // the estimate just goes on drifting as if nothing happened.
    }

    /// A pool faster than a third of the cold-start guess: a backend users
    /// never measured, and one left idle long enough for the long memory
    /// to drift up towards the guess, are brought to what their probes
    /// measure (both were held at about the 1 ms guess before, beyond a
    /// 100 µs pool's 0.3 ms re-draw bound, probes or not).
    #[test]
    fn a_fast_probe_brings_a_backend_below_the_cold_start_guess() {
        let clock = ManualClock::starting_at(0);
        let mut never = LatencyEstimate::new(DEFAULT_PARAMS, clock.now());
        let mut idle = never.clone();
        let fast = LatencySample::single(Duration::from_micros(100)).counted(20);
        feed(&mut idle, &clock, fast, 2.0);
        clock.advance(Duration::from_secs(3));
        let drifted = idle.estimate_ns(clock.now()) / MS;
        assert!(
            drifted > 0.3,
            "{drifted}: the idle drift took it past the bound"
        );
        let probe = ProbeSample::Response(Duration::from_micros(100));
        for e in [&mut never, &mut idle] {
            assert_eq!(
                e.observe_probe(probe, clock.now(), PROBE_EVERY),
                ProbeOutcome::Applied
            );
            let after = e.estimate_ns(clock.now()) / MS;
            assert!(after < 0.15, "{after}: the probe's 0.1 ms, not the guess");
        }
        // What users measured stays the floor: a probe faster than users'
        // 0.1 ms means takes the long memory to those means, not below.
        clock.advance(Duration::from_secs(3));
        let faster = ProbeSample::Response(Duration::from_micros(20));
        idle.observe_probe(faster, clock.now(), PROBE_EVERY);
        let floor = idle.sustained.estimate_ns(clock.now()) / MS;
        assert!((0.099..0.101).contains(&floor), "{floor}");
    }

    #[test]
    fn a_slow_probe_keeps_a_slow_backend_out_and_the_long_memory_keeps_users_means() {
        let clock = ManualClock::starting_at(0);
        let mut e = LatencyEstimate::new(DEFAULT_PARAMS, clock.now());
        feed(&mut e, &clock, ms(100), 10.0);
        clock.advance(PROBE_EVERY);
        e.observe_probe(probe_ms(100), clock.now(), PROBE_EVERY);
        assert!(e.estimate_ns(clock.now()) / MS > 90.0);
        // Even a fast probe leaves the long memory of 10 s of 100 ms means.
        clock.advance(PROBE_EVERY);
        e.observe_probe(probe_ms(6), clock.now(), PROBE_EVERY);
        assert!(e.estimate_ns(clock.now()) / MS > 50.0);
    }

    #[test]
    fn a_peak_tau_longer_than_tau_is_capped() {
        let clock = ManualClock::starting_at(0);
        let mut e = LatencyEstimate::new(
            EstimateParams {
                cold_start: COLD,
                tau: PEAK_TAU,
                peak_tau: TAU,
                refute_after: DEFAULT_EWMA_REFUTE_AFTER,
            },
            clock.now(),
        );
        e.observe(ms(40), clock.now());
        clock.advance(Duration::from_secs(5));
        // Both parts forget with τ = 1 s.
        assert!(e.estimate_ns(clock.now()) / MS < 2.0);
    }
}
