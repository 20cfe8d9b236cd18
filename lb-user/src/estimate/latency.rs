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
//! * [`PeakEwma`] with a short τ (`ewma_peak_tau`, 1 s by default) keeps
//!   the peak sensitivity: the first slow response still counts at once,
//!   and a backend that stays slow keeps it high with every sample;
//! * an [`Ewma`] of each refresh interval's *mean* latency with the long
//!   τ (`ewma_tau`) remembers persistent slowness: a backend that was slow
//!   for many samples stays avoided after its peaks are forgotten, while
//!   one outlier among many fast samples moves it by a few percent.
//!
//! This is the "short-memory estimate next to the long one" of issue 13;
//! the kernel's stall age covers the first milliseconds of a pause before
//! any sample exists.

use std::time::Duration;

pub use crate::settings::config::EstimateParams;
use crate::{
    estimate::{ewma::Ewma, peak_ewma::PeakEwma},
    kernel::clock::Nanos,
};

/// What one refresh interval measured for a backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LatencySample {
    pub mean: Duration,
    pub peak: Duration,
}

impl LatencySample {
    /// One response's latency.
    pub fn single(latency: Duration) -> Self {
        Self {
            mean: latency,
            peak: latency,
        }
    }
}

#[derive(Clone, Debug)]
pub struct LatencyEstimate {
    recent: PeakEwma,
    sustained: Ewma,
}

impl LatencyEstimate {
    /// A backend with no samples yet: both parts are at the cold-start value.
    pub fn new(params: EstimateParams, now: Nanos) -> Self {
        let EstimateParams {
            cold_start,
            tau,
            peak_tau,
        } = params;
        Self {
            recent: PeakEwma::new(cold_start, peak_tau.min(tau), now),
            sustained: Ewma::new(cold_start, tau, now),
        }
    }

    pub fn observe(&mut self, sample: LatencySample, now: Nanos) {
        self.recent.observe(sample.peak, now);
        self.sustained.blend(sample.mean, now);
    }

    /// When the last sample arrived, if ever.
    pub fn last_sample(&self) -> Option<Nanos> {
        self.recent.last_sample()
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
    use crate::{
        estimate::testing::{COLD, MS, TAU},
        kernel::clock::{Clock, ManualClock},
    };

    const PEAK_TAU: Duration = Duration::from_secs(1);
    const PARAMS: EstimateParams = EstimateParams {
        cold_start: COLD,
        tau: TAU,
        peak_tau: PEAK_TAU,
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

    #[test]
    fn a_recovered_backend_comes_down_with_its_samples() {
        let clock = ManualClock::starting_at(0);
        let mut e = LatencyEstimate::new(PARAMS, clock.now());
        feed(&mut e, &clock, ms(60), 3.0);
        feed(&mut e, &clock, ms(6), 10.0);
        let after = e.estimate_ns(clock.now()) / MS;
        assert!(after < 20.0, "{after}");
    }

    #[test]
    fn a_peak_tau_longer_than_tau_is_capped() {
        let clock = ManualClock::starting_at(0);
        let mut e = LatencyEstimate::new(
            EstimateParams {
                cold_start: COLD,
                tau: PEAK_TAU,
                peak_tau: TAU,
            },
            clock.now(),
        );
        e.observe(ms(40), clock.now());
        clock.advance(Duration::from_secs(5));
        // Both parts forget with τ = 1 s.
        assert!(e.estimate_ns(clock.now()) / MS < 2.0);
    }
}
