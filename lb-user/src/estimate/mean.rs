//! The mean latency a backend's users measured, over a long time-weighted
//! memory, with no prior and no idle drift: what a backend held far above
//! its pool competes with (see [`crate::estimate::latency::LatencyEstimate::held_ns`]).
//!
//! [`crate::estimate::ewma::Ewma`] starts at the cold-start guess and
//! blends each sample in with `1 - exp(-Δt/τ)`, so with τ = 10 s and a
//! sample every 50 ms it takes seconds of samples to move away from the
//! guess, and between samples it drifts back to it. A backend held after
//! its first few ticks (a 10× slower one is held within a tick or two, or
//! before any user sample when a latency probe answers first) never gets
//! there: in `hetero` at 85 % the two 100 ms backends were held at a cost
//! of 1–5 ms, below the fast backends' 16 ms. The cost of a held backend
//! counts once every backend within the bound is saturated, and then each
//! of them took new flows until `cost × (inflight + 1)²` caught up with
//! the saturated fast ones: about ten at 100 ms each, instead of one.
//!
//! This mean is the bias-corrected EWMA instead: samples and their weights
//! decay alike, `sum = sum·w + x·(1-w)` and `mass = mass·w + (1-w)`, and the
//! mean is `sum / mass`. The first sample is the mean at once; later ones
//! move it as much as their share of the memory. Between samples the ratio
//! does not change, so an avoided backend keeps the mean it was last
//! measured at rather than drifting towards the guess (its peak memory,
//! which probes refresh, decides when it stops being held).
use std::time::Duration;

use crate::{estimate::ewma::decay_weight, kernel::clock::Nanos};

#[derive(Clone, Debug)]
pub struct MeasuredMean {
    /// Time-weighted sum of the samples, in nanoseconds.
    sum_ns: f64,
    /// The samples' total weight: 0 before the first, at most 1.
    mass: f64,
    updated: Nanos,
    tau_ns: f64,
}

impl MeasuredMean {
    pub fn new(tau: Duration, now: Nanos) -> Self {
        Self {
            sum_ns: 0.0,
            mass: 0.0,
            updated: now,
            tau_ns: (tau.as_nanos() as f64).max(1.0),
        }
    }

    /// Adds a sample taken at `now`, weighted by the time since the last
    /// one (a sample stamped before it weighs nothing).
    pub fn blend(&mut self, sample: Duration, now: Nanos) {
        let w = decay_weight(now.since(self.updated), self.tau_ns);
        self.sum_ns = self.sum_ns * w + sample.as_nanos() as f64 * (1.0 - w);
        self.mass = self.mass * w + (1.0 - w);
        self.updated = self.updated.max(now);
    }

    /// Forgets every sample but `sample`, taken at `now`.
    pub fn replace(&mut self, sample: Duration, now: Nanos) {
        self.sum_ns = sample.as_nanos() as f64;
        self.mass = 1.0;
        self.updated = self.updated.max(now);
    }

    /// The mean of the samples, `None` before any sample with a weight.
    pub fn mean_ns(&self) -> Option<f64> {
        (self.mass > 0.0).then(|| self.sum_ns / self.mass)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        estimate::testing::{MS, TAU, close},
        kernel::clock::{Clock, ManualClock},
    };

    const TICK: Duration = Duration::from_millis(50);

    #[test]
    fn the_first_sample_is_the_mean_and_idle_time_changes_nothing() {
        let clock = ManualClock::starting_at(0);
        let mut m = MeasuredMean::new(TAU, clock.now());
        assert_eq!(m.mean_ns(), None);
        clock.advance(TICK);
        m.blend(Duration::from_millis(100), clock.now());
        assert!(close(m.mean_ns().unwrap(), 100.0 * MS));
        // A minute without samples: still what was measured.
        clock.advance(Duration::from_secs(60));
        assert!(close(m.mean_ns().unwrap(), 100.0 * MS));
    }

    #[test]
    fn samples_weigh_by_their_share_of_the_memory() {
        let clock = ManualClock::starting_at(0);
        let mut m = MeasuredMean::new(TAU, clock.now());
        // Two ticks, equally weighted (the same interval): the average.
        clock.advance(TICK);
        m.blend(Duration::from_millis(100), clock.now());
        clock.advance(TICK);
        m.blend(Duration::from_millis(20), clock.now());
        let mean = m.mean_ns().unwrap() / MS;
        assert!((59.0..61.0).contains(&mean), "{mean}");
        // τ of 10 ms samples: the first two now weigh little.
        for _ in 0..(TAU.as_millis() / TICK.as_millis()) {
            clock.advance(TICK);
            m.blend(Duration::from_millis(10), clock.now());
        }
        let mean = m.mean_ns().unwrap() / MS;
        assert!((10.0..12.0).contains(&mean), "{mean}");
        // A long history: one more tick of 100 ms moves it by its share.
        clock.advance(TICK);
        m.blend(Duration::from_millis(100), clock.now());
        let moved = m.mean_ns().unwrap() / MS - mean;
        assert!((0.1..5.0).contains(&moved), "{moved}");
    }

    /// Unlike [`crate::estimate::ewma::Ewma`], no idle drift: a sample
    /// after a long silence is blended into the mean it would otherwise
    /// still read, so one below it can only lower it.
    #[test]
    fn a_sample_below_the_mean_lowers_it_even_after_an_idle_spell() {
        let clock = ManualClock::starting_at(0);
        let mut m = MeasuredMean::new(TAU, clock.now());
        for _ in 0..20 {
            clock.advance(TICK);
            m.blend(Duration::from_millis(300), clock.now());
        }
        clock.advance(Duration::from_secs(20));
        let before = m.mean_ns().unwrap();
        m.blend(Duration::from_millis(10), clock.now());
        let after = m.mean_ns().unwrap();
        assert!((10.0 * MS..before).contains(&after), "{after}");
    }

    #[test]
    fn replace_forgets_and_a_clock_that_steps_back_is_harmless() {
        let clock = ManualClock::starting_at(1_000_000_000);
        let mut m = MeasuredMean::new(TAU, clock.now());
        clock.advance(TICK);
        m.blend(Duration::from_millis(100), clock.now());
        m.replace(Duration::from_millis(8), clock.now());
        assert!(close(m.mean_ns().unwrap(), 8.0 * MS));
        // Stamped before the last update: weight 0, the mean stays.
        m.blend(Duration::from_millis(500), Nanos(0));
        assert!(close(m.mean_ns().unwrap(), 8.0 * MS));
    }
}
