//! A time-weighted exponentially weighted moving average of latency, the
//! building block of [`crate::estimate::peak_ewma::PeakEwma`] and
//! [`crate::estimate::latency::LatencyEstimate`].
//!
//! * A sample is blended in with a weight that depends on the time since
//!   the previous one, not on the sample count: `w = exp(-Δt/τ)`,
//!   `new = old·w + sample·(1-w)`. So the average forgets with a half-life
//!   of `τ·ln 2` whatever the request rate.
//! * Between samples it drifts towards the cold-start value with the same
//!   τ, so a backend nobody has used for a while is tried again instead of
//!   being judged forever on its last measurement.

use std::time::Duration;

use crate::kernel::clock::Nanos;

#[derive(Clone, Debug)]
pub struct Ewma {
    /// Value as of `updated`, in nanoseconds (before the idle drift).
    value_ns: f64,
    updated: Nanos,
    tau_ns: f64,
    cold_start_ns: f64,
    /// When the last sample arrived (`None`: never).
    last_sample: Option<Nanos>,
}

impl Ewma {
    /// No samples yet: the value is the cold-start one.
    pub fn new(cold_start: Duration, tau: Duration, now: Nanos) -> Self {
        Self {
            value_ns: cold_start.as_nanos() as f64,
            updated: now,
            tau_ns: (tau.as_nanos() as f64).max(1.0),
            cold_start_ns: cold_start.as_nanos() as f64,
            last_sample: None,
        }
    }

    /// When the last sample arrived, if ever.
    pub fn last_sample(&self) -> Option<Nanos> {
        self.last_sample
    }

    /// The value as of the last sample, without the idle drift (what a new
    /// sample is compared with and blended into).
    pub fn stored_ns(&self) -> f64 {
        self.value_ns
    }

    /// `exp(-Δt/τ)` for the time since the last update.
    fn decay_weight(&self, now: Nanos) -> f64 {
        decay_weight(now.since(self.updated), self.tau_ns)
    }

    /// Blends one sample taken at `now` in.
    pub fn blend(&mut self, sample: Duration, now: Nanos) {
        let w = self.decay_weight(now);
        self.value_ns = self.value_ns * w + sample.as_nanos() as f64 * (1.0 - w);
        self.touch(now);
    }

    /// Replaces the value with a sample taken at `now`.
    pub fn replace(&mut self, sample: Duration, now: Nanos) {
        self.value_ns = sample.as_nanos() as f64;
        self.touch(now);
    }

    fn touch(&mut self, now: Nanos) {
        self.updated = self.updated.max(now);
        self.last_sample = Some(self.last_sample.map_or(now, |t| t.max(now)));
    }

    /// The value at `now`, including the idle drift towards cold start.
    pub fn estimate_ns(&self, now: Nanos) -> f64 {
        let w = self.decay_weight(now);
        self.cold_start_ns + (self.value_ns - self.cold_start_ns) * w
    }
}

/// The weight `exp(-Δt/τ)` a time-weighted average keeps of what it held
/// `elapsed` ago (`tau_ns` at least 1).
pub fn decay_weight(elapsed: Duration, tau_ns: f64) -> f64 {
    (-(elapsed.as_nanos() as f64) / tau_ns).exp()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        estimate::testing::{COLD, MS, TAU, close, half_life},
        kernel::clock::{Clock, ManualClock},
    };

    #[test]
    fn a_sample_above_the_average_is_blended_not_taken() {
        let clock = ManualClock::starting_at(0);
        let mut e = Ewma::new(COLD, TAU, clock.now());
        clock.advance(half_life());
        e.blend(Duration::from_millis(9), clock.now());
        // w = 1/2 since creation: halfway between 1ms and 9ms.
        assert!(close(e.estimate_ns(clock.now()), 5.0 * MS));
    }

    #[test]
    fn replace_takes_the_sample() {
        let clock = ManualClock::starting_at(0);
        let mut e = Ewma::new(COLD, TAU, clock.now());
        e.replace(Duration::from_millis(50), clock.now());
        assert!(close(e.estimate_ns(clock.now()), 50.0 * MS));
        assert_eq!(e.last_sample(), Some(clock.now()));
    }

    #[test]
    fn idle_drift_and_a_clock_that_steps_back_are_harmless() {
        let clock = ManualClock::starting_at(1_000_000_000);
        let mut e = Ewma::new(COLD, TAU, clock.now());
        e.replace(Duration::from_millis(9), clock.now());
        clock.advance(half_life());
        assert!(close(e.estimate_ns(clock.now()), 5.0 * MS));
        // A sample stamped earlier than the last update: weight 1, no panic.
        e.blend(Duration::from_millis(2), Nanos(0));
        assert!(e.estimate_ns(clock.now()).is_finite());
    }
}
