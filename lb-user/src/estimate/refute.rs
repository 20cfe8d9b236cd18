//! Refuting a latency memory with a run of fast responses.
//!
//! Peak-EWMA (Finagle, linkerd/tower) keeps a peak until time wears it
//! down: with the default τ of 10 s, a backend that was slow for one
//! second (and answered the requests queued during that second with a
//! second's delay) stays above its pool for several more seconds after
//! it turned fast again, although every response it has given since says
//! it is fast. Time is the only evidence the EWMA knows; the responses
//! are better evidence.
//!
//! The rule: a response counts as *refuting* when it took at most
//! 1 / [`REFUTE_RATIO`] of the current estimate. Once `ewma_refute_after`
//! (16 by default, [`crate::settings::config::DEFAULT_EWMA_REFUTE_AFTER`])
//! refuting responses arrived in a row (a response that does not refute
//! ends the run), the memory is refuted: the estimate restarts from what
//! the run measured (its peak for the peak memory, its mean for the long
//! memory of means). 0 turns the rule off.
//!
//! **Relapse.** A backend whose slowness comes back (a GC pause every few
//! seconds) would be refuted after every episode and given its full share
//! again just in time for the next one, which then catches every request
//! it holds: the tail is the episode's length. So a backend that turns
//! slow again (a tick whose responses took [`EPISODE_RATIO`] times its
//! estimate or more on average) within the long memory τ (`ewma_tau`) of
//! being refuted is *barred*: no refutation until it has gone τ without
//! such a tick, and only time wears its memory down, as in plain
//! Peak-EWMA. A one-off episode is
//! refuted once; a recurring one is remembered for as long as it recurs.
//!
//! Why this keeps what the memories are for:
//! * a backend that *stays* slow never answers in half its estimate, so
//!   its memory is never refuted (`hetero`'s slow nodes stay out);
//! * a backend whose slowness is intermittent shows it within the run:
//!   if a quarter of its responses are still slow, a run of 16 fast ones
//!   happens with probability 0.75¹⁶ ≈ 1 %;
//! * an avoided backend gets no responses, so nothing is refuted without
//!   fresh user evidence; the idle drift and (opt-in) latency probes stay
//!   the only way back for it.
//!
//! The kernel aggregates responses per score tick (count, mean, peak), so
//! a tick refutes only as a whole: its peak must be fast.

use std::time::Duration;

use crate::{estimate::sample::LatencySample, kernel::clock::Nanos};

/// A response refutes the estimate when it took at most 1/this of it.
pub const REFUTE_RATIO: f64 = 2.0;
/// Only an estimate lowered by at least this factor (by a refutation or a
/// probe), after a tick whose mean was this far above where it came down
/// to, is watched for a relapse: an episode such as a pause (300 ms over
/// 12 ms) or a slow phase (10×), not the noise of a busy host, which moves
/// a fast backend's peaks by 2–3× and would otherwise bar the next real
/// episode from ever being forgiven early. (The lab caught exactly that: a
/// backend P2C left idle at light load was probed down from 8 to 5 ms, so
/// its one-off slowdown seconds later counted as a relapse.)
///
/// A relapse is episode-sized too: a tick whose responses took this many
/// times the estimate or more *on average*. A slow phase slows every
/// response, and a pause delays every request it caught, so either moves
/// the tick's mean; a stall of the host delays the one or two responses
/// that were due during it. Judged on single responses, a busy host's
/// noise counted twice in the clean clone's fault test: a backend probed
/// down from 21 to 3 ms after a slow phase answered once in 9.8 ms half a
/// second later (at 2×) and, with 4×, once in about 19 ms (CI, stop 32);
/// each time it was barred for τ and got 0.2–6 % of the new connections
/// instead of a third.
pub const EPISODE_RATIO: f64 = 4.0;

/// The current run of refuting responses, and the relapse bar.
#[derive(Clone, Debug)]
pub struct Refutation {
    /// Refuting responses in a row that refute the memory (0: never).
    needed: u64,
    /// How long a refuted backend is watched for a relapse, and how long
    /// a relapse bars refutation.
    watch: Duration,
    responses: u64,
    /// Σ latency of the run's responses, in nanoseconds.
    total_ns: f64,
    peak: Duration,
    /// The highest tick mean users measured within about `watch`, and
    /// when it began to count (see [`Refutation::lowered`]): whether a
    /// lowering ends an episode ([`EPISODE_RATIO`]).
    highest_mean: Duration,
    highest_since: Nanos,
    refuted_at: Option<Nanos>,
    barred_until: Option<Nanos>,
}

impl Refutation {
    pub fn new(needed: u64, watch: Duration) -> Self {
        Self {
            needed,
            watch,
            responses: 0,
            total_ns: 0.0,
            peak: Duration::ZERO,
            highest_mean: Duration::ZERO,
            highest_since: Nanos(0),
            refuted_at: None,
            barred_until: None,
        }
    }

    /// Adds one tick's responses, measured at `now` while the estimate was
    /// `estimate_ns`. Returns what the run measured (count, mean, peak)
    /// once it reaches `needed` responses and refutes the memory; the run
    /// starts over then.
    pub fn record(
        &mut self,
        sample: LatencySample,
        estimate_ns: f64,
        now: Nanos,
    ) -> Option<LatencySample> {
        if sample.count == 0 {
            // A peak alone (see `LatencySample::count`): its response was
            // counted in the run as the mean of its tick; a slow one ends it.
            if sample.peak.as_nanos() as f64 * REFUTE_RATIO > estimate_ns {
                self.end_run();
            }
            return None;
        }
        let peak_ns = sample.peak.as_nanos() as f64;
        let mean_ns = sample.mean.as_nanos() as f64;
        self.note_mean(sample.mean, now);
        if mean_ns >= estimate_ns * EPISODE_RATIO && self.watching(now) {
            self.barred_until = Some(now.plus(self.watch));
        }
        if self.needed == 0 || peak_ns * REFUTE_RATIO > estimate_ns || self.barred(now) {
            self.end_run();
            return None;
        }
        self.responses += sample.count;
        self.total_ns += sample.mean.as_nanos() as f64 * sample.count as f64;
        self.peak = self.peak.max(sample.peak);
        if self.responses < self.needed {
            return None;
        }
        let run = LatencySample {
            mean: Duration::from_nanos((self.total_ns / self.responses as f64) as u64),
            peak: self.peak,
            count: self.responses,
        };
        self.end_run();
        self.lowered(estimate_ns, run.peak.as_nanos() as f64, now);
        Some(run)
    }

    /// Something other than a run (a latency probe) lowered the estimate
    /// from `from_ns` to `to_ns` at `now`.
    pub fn lowered_by_probe(&mut self, from_ns: f64, to_ns: f64, now: Nanos) {
        self.end_run();
        self.lowered(from_ns, to_ns, now);
    }

    /// Watches for a relapse if the estimate came down by an episode's
    /// worth ([`EPISODE_RATIO`]) after an episode: a tick whose mean was
    /// that far above where it came down to. The peaks alone say nothing
    /// of an episode: one noisy response among fast ones (a hiccup of the
    /// host) puts a fast backend's peak memory 4× up as well, and a
    /// watch armed by its lowering takes the first real episode after it
    /// for a relapse and bars forgiving it for τ.
    ///
    /// The episode is remembered until a lowering ends it, not only until
    /// the next lowering: probes replace the peak memory every interval,
    /// and one that catches a pause (150 ms of a 300 ms one) lowers it by
    /// less than an episode's worth, so the one after it (to 12 ms) is the
    /// lowering that ends the pause.
    fn lowered(&mut self, from_ns: f64, to_ns: f64, now: Nanos) {
        let episode = self.highest_mean.as_nanos() as f64 >= to_ns * EPISODE_RATIO;
        if episode && from_ns >= to_ns * EPISODE_RATIO {
            self.refuted_at = Some(now);
            self.highest_mean = Duration::ZERO;
        }
    }

    /// Keeps the highest tick mean of about the last `watch`: one older
    /// than that gives way to the next tick's (an episode that no
    /// lowering ended within τ is forgotten, as the memories forget it).
    fn note_mean(&mut self, mean: Duration, now: Nanos) {
        if mean >= self.highest_mean || now.since(self.highest_since) >= self.watch {
            self.highest_mean = mean;
            self.highest_since = now;
        }
    }

    /// Whether a relapse at `now` counts: within `watch` of the last
    /// refutation, or while barred (a relapse extends the bar).
    fn watching(&self, now: Nanos) -> bool {
        self.refuted_at.is_some_and(|t| now.since(t) < self.watch) || self.barred(now)
    }

    /// Whether a relapse bars refutation at `now`.
    pub fn barred(&self, now: Nanos) -> bool {
        self.barred_until.is_some_and(|t| now < t)
    }

    fn end_run(&mut self) {
        self.responses = 0;
        self.total_ns = 0.0;
        self.peak = Duration::ZERO;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: f64 = 1_000_000.0;
    const WATCH: Duration = Duration::from_secs(10);

    fn tick(count: u64, mean_ms: u64, peak_ms: u64) -> LatencySample {
        LatencySample {
            mean: Duration::from_millis(mean_ms),
            peak: Duration::from_millis(peak_ms),
            count,
        }
    }

    fn at_ms(ms: u64) -> Nanos {
        Nanos(ms * 1_000_000)
    }

    #[test]
    fn sixteen_fast_responses_in_a_row_refute() {
        let mut r = Refutation::new(16, WATCH);
        assert_eq!(r.record(tick(5, 10, 12), 100.0 * MS, at_ms(50)), None);
        assert_eq!(r.record(tick(5, 10, 14), 100.0 * MS, at_ms(100)), None);
        assert_eq!(r.record(tick(5, 10, 11), 100.0 * MS, at_ms(150)), None);
        let run = r
            .record(tick(1, 14, 14), 100.0 * MS, at_ms(200))
            .expect("refuted");
        assert_eq!(run.count, 16);
        assert_eq!(run.peak, Duration::from_millis(14));
        // (15 × 10 + 14) / 16 = 10.25 ms.
        assert_eq!(run.mean, Duration::from_micros(10_250));
        // The run starts over.
        assert_eq!(r.record(tick(15, 10, 10), 100.0 * MS, at_ms(250)), None);
    }

    /// A peak alone (its response counted by the tick before, as part of
    /// its mean): a slow one ends the run, a fast one adds nothing.
    #[test]
    fn a_slow_peak_alone_ends_the_run() {
        let mut r = Refutation::new(16, WATCH);
        assert_eq!(r.record(tick(15, 10, 12), 100.0 * MS, at_ms(50)), None);
        assert_eq!(r.record(tick(0, 12, 12), 100.0 * MS, at_ms(100)), None);
        assert!(r.record(tick(1, 10, 10), 100.0 * MS, at_ms(150)).is_some());
        assert_eq!(r.record(tick(15, 10, 12), 100.0 * MS, at_ms(200)), None);
        assert_eq!(r.record(tick(0, 60, 60), 100.0 * MS, at_ms(250)), None);
        assert_eq!(r.record(tick(1, 10, 10), 100.0 * MS, at_ms(300)), None);
    }

    #[test]
    fn one_slow_response_ends_the_run() {
        let mut r = Refutation::new(16, WATCH);
        assert_eq!(r.record(tick(15, 10, 12), 100.0 * MS, at_ms(50)), None);
        // Its peak is above half the estimate: the run starts over.
        assert_eq!(r.record(tick(1, 60, 60), 100.0 * MS, at_ms(100)), None);
        assert_eq!(r.record(tick(15, 10, 12), 100.0 * MS, at_ms(150)), None);
        assert!(r.record(tick(1, 10, 10), 100.0 * MS, at_ms(200)).is_some());
    }

    #[test]
    fn responses_as_slow_as_the_estimate_never_refute() {
        let mut r = Refutation::new(16, WATCH);
        for i in 0..1_000 {
            assert_eq!(r.record(tick(10, 90, 100), 100.0 * MS, at_ms(i * 50)), None);
        }
        // Exactly half the estimate still refutes (at most 1/2).
        assert!(
            r.record(tick(16, 50, 50), 100.0 * MS, at_ms(50_050))
                .is_some()
        );
    }

    #[test]
    fn a_tick_without_responses_neither_counts_nor_ends_the_run() {
        let mut r = Refutation::new(16, WATCH);
        assert_eq!(r.record(tick(10, 10, 10), 100.0 * MS, at_ms(50)), None);
        assert_eq!(r.record(tick(0, 0, 0), 100.0 * MS, at_ms(100)), None);
        assert!(r.record(tick(6, 10, 10), 100.0 * MS, at_ms(150)).is_some());
    }

    #[test]
    fn zero_needed_never_refutes() {
        let mut r = Refutation::new(0, WATCH);
        for i in 0..100 {
            assert_eq!(r.record(tick(50, 1, 1), 100.0 * MS, at_ms(i * 50)), None);
        }
    }

    /// One pause, then fast: refuted. Pauses every 2 s: refuted after the
    /// first only, barred while they go on, refutable again τ after the
    /// last.
    #[test]
    fn a_recurring_slowness_is_refuted_once_then_barred_while_it_recurs() {
        let mut r = Refutation::new(16, WATCH);
        let pause = tick(2, 300, 300);
        let fast = tick(16, 10, 12);
        // The first pause (estimate ~12 ms) is no relapse: nothing refuted.
        assert_eq!(r.record(pause, 12.0 * MS, at_ms(1_000)), None);
        assert!(r.record(fast, 300.0 * MS, at_ms(1_300)).is_some());
        for cycle in 1..=5u64 {
            let start = 1_000 + cycle * 2_000;
            // The estimate is the refuted one (or the pause's, barred).
            assert_eq!(r.record(pause, 12.0 * MS, at_ms(start)), None);
            assert!(r.barred(at_ms(start)));
            assert_eq!(r.record(fast, 300.0 * MS, at_ms(start + 300)), None);
        }
        // The last pause at 11 s: barred until 21 s.
        assert!(r.barred(at_ms(20_999)));
        assert_eq!(r.record(fast, 300.0 * MS, at_ms(20_999)), None);
        assert!(!r.barred(at_ms(21_000)));
        assert!(r.record(fast, 300.0 * MS, at_ms(21_000)).is_some());
    }

    #[test]
    fn a_slow_episode_long_after_a_refutation_is_no_relapse() {
        let mut r = Refutation::new(16, WATCH);
        // An episode, refuted: watched for τ.
        assert_eq!(r.record(tick(2, 300, 300), 12.0 * MS, at_ms(700)), None);
        assert!(
            r.record(tick(16, 10, 10), 100.0 * MS, at_ms(1_000))
                .is_some()
        );
        // τ later a new episode: refuted again at once.
        assert_eq!(r.record(tick(2, 300, 300), 12.0 * MS, at_ms(11_000)), None);
        assert!(!r.barred(at_ms(11_000)));
        assert!(
            r.record(tick(16, 10, 10), 300.0 * MS, at_ms(11_300))
                .is_some()
        );
    }

    /// Noise (a fast backend's peaks 2–3× its norm) refuted, then a real
    /// episode: no relapse, so the episode is forgiven on evidence too.
    #[test]
    fn a_refuted_noise_peak_is_not_watched_for_a_relapse() {
        let mut r = Refutation::new(16, WATCH);
        // 15 ms of noise over a 5 ms backend, refuted by 16 answers of 5.
        assert!(r.record(tick(16, 5, 5), 15.0 * MS, at_ms(1_000)).is_some());
        // Two seconds later a real slow phase (50 ms): no bar.
        assert_eq!(r.record(tick(2, 50, 50), 5.0 * MS, at_ms(3_000)), None);
        assert!(!r.barred(at_ms(3_000)));
        assert!(r.record(tick(16, 5, 5), 50.0 * MS, at_ms(3_500)).is_some());
        // That one was an episode (50 over 5): the next slow phase is a relapse.
        assert_eq!(r.record(tick(2, 50, 50), 5.0 * MS, at_ms(5_000)), None);
        assert!(r.barred(at_ms(5_000)));
    }

    /// After an episode was refuted, one noisy answer (3× the estimate,
    /// or 6× among fast ones: a stall of the host) is no relapse; a slow
    /// phase (every answer 4× or more) is.
    #[test]
    fn only_an_episode_sized_rise_is_a_relapse() {
        let mut r = Refutation::new(16, WATCH);
        // A slow phase (21 ms answers), probed down to 3.2 ms.
        assert_eq!(r.record(tick(3, 21, 22), 21.0 * MS, at_ms(900)), None);
        r.lowered_by_probe(21.0 * MS, 3.2 * MS, at_ms(1_000));
        assert_eq!(r.record(tick(3, 4, 9), 3.2 * MS, at_ms(1_500)), None);
        assert!(!r.barred(at_ms(1_500)));
        // Five answers, one of them 19 ms: a mean of 6 ms, under 2×.
        assert_eq!(r.record(tick(5, 6, 19), 3.2 * MS, at_ms(1_550)), None);
        assert!(!r.barred(at_ms(1_550)));
        assert!(r.record(tick(16, 3, 3), 9.0 * MS, at_ms(2_000)).is_some());
        assert_eq!(r.record(tick(3, 21, 22), 21.0 * MS, at_ms(2_900)), None);
        r.lowered_by_probe(21.0 * MS, 3.2 * MS, at_ms(3_000));
        assert_eq!(r.record(tick(3, 13, 20), 3.2 * MS, at_ms(3_500)), None);
        assert!(r.barred(at_ms(3_500)));
    }

    /// Noise can put one response at 4× a fast backend's norm (a host
    /// hiccup of 10 ms over 2.5 ms), and a probe then lowers the peak
    /// memory by as much; but no tick's *mean* rose by an episode, so the
    /// slow phase that follows is a first episode, not a relapse. (Most
    /// likely what a fresh clone's fault test met at stop 55: a backend
    /// slow for 0.5 s got 1 of 600 new connections 2–5 s after it
    /// recovered, its estimate decaying untouched by its probes.)
    #[test]
    fn a_lowering_after_noise_peaks_alone_arms_no_watch() {
        let mut r = Refutation::new(16, WATCH);
        // Four answers, one of them 12 ms: a mean of 4.4 ms over 2.5.
        assert_eq!(r.record(tick(4, 4, 12), 2.5 * MS, at_ms(1_000)), None);
        r.lowered_by_probe(12.0 * MS, 2.5 * MS, at_ms(1_300));
        // A slow phase (20 ms answers) a second later: no bar, and it is
        // forgiven on evidence.
        assert_eq!(r.record(tick(2, 20, 25), 2.5 * MS, at_ms(2_300)), None);
        assert!(!r.barred(at_ms(2_300)));
        // That one was an episode: a probe lowering it arms the watch.
        r.lowered_by_probe(25.0 * MS, 2.5 * MS, at_ms(3_000));
        assert_eq!(r.record(tick(2, 20, 25), 2.5 * MS, at_ms(4_000)), None);
        assert!(r.barred(at_ms(4_000)));
    }

    /// `stall` with probes: a probe that caught the pause lowers the
    /// estimate by less than an episode's worth (300 to 150 ms), the next
    /// one to 12 ms ends the pause, and the next pause is a relapse.
    #[test]
    fn a_pause_probed_down_in_two_steps_is_still_watched() {
        let mut r = Refutation::new(16, WATCH);
        assert_eq!(r.record(tick(3, 12, 14), 12.0 * MS, at_ms(800)), None);
        assert_eq!(r.record(tick(2, 200, 300), 12.0 * MS, at_ms(1_000)), None);
        r.lowered_by_probe(300.0 * MS, 150.0 * MS, at_ms(1_250));
        r.lowered_by_probe(150.0 * MS, 12.0 * MS, at_ms(1_500));
        assert_eq!(r.record(tick(3, 12, 14), 12.0 * MS, at_ms(2_000)), None);
        assert_eq!(r.record(tick(2, 200, 300), 12.0 * MS, at_ms(3_000)), None);
        assert!(r.barred(at_ms(3_000)));
    }

    /// A tick mean older than τ no longer makes an episode of a lowering.
    #[test]
    fn an_episode_no_lowering_ended_is_forgotten_after_tau() {
        let mut r = Refutation::new(16, WATCH);
        assert_eq!(r.record(tick(2, 50, 50), 5.0 * MS, at_ms(1_000)), None);
        // Worn down by time alone; 12 s later noise is probed down.
        assert_eq!(r.record(tick(4, 4, 20), 5.0 * MS, at_ms(13_000)), None);
        r.lowered_by_probe(20.0 * MS, 5.0 * MS, at_ms(13_300));
        assert_eq!(r.record(tick(2, 50, 50), 5.0 * MS, at_ms(14_000)), None);
        assert!(!r.barred(at_ms(14_000)));
    }

    #[test]
    fn only_a_probe_that_lowers_by_an_episode_arms_the_watch() {
        let mut r = Refutation::new(16, WATCH);
        r.lowered_by_probe(8.0 * MS, 5.0 * MS, at_ms(1_000));
        assert_eq!(r.record(tick(2, 50, 50), 5.0 * MS, at_ms(2_000)), None);
        assert!(!r.barred(at_ms(2_000)));
        r.lowered_by_probe(50.0 * MS, 5.0 * MS, at_ms(3_000));
        assert_eq!(r.record(tick(2, 50, 50), 5.0 * MS, at_ms(4_000)), None);
        assert!(r.barred(at_ms(4_000)));
    }
}
