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
//! * A sample stands for the whole time since the previous one, so it
//!   takes the drift's place: `old·w + sample·(1-w)` blends into the value
//!   as of the last sample, not into what it has drifted to. That keeps a
//!   memory of means exact (a backend measured at 20 ms every tick reads
//!   20 ms, not something pulled towards cold start by the drift between
//!   ticks), but after an idle spell any sample above cold start gives
//!   back what the drift had taken, even one far below the estimate. An
//!   estimate that must never rise with a sample at or below it blends
//!   with [`Ewma::blend_at_most`].

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

    /// The value as of the last sample, without the idle drift (what
    /// [`Ewma::blend`] blends a new sample into).
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

    /// [`Ewma::blend`], but no higher than `ceiling_ns` (a value as of
    /// `now`, at least the sample). With the estimate at `now` as the
    /// ceiling, a sample at or below it lowers the estimate or leaves it
    /// where the drift brought it, and the memory keeps decaying with
    /// `w = exp(-Δt/τ)`: the blend is `old·w + min(sample, cold)·(1-w)`.
    /// Folding the drift in and then blending the sample with `1-w` as
    /// well would never raise it either, but under load it forgets twice
    /// as fast as τ says (each tick's `w` applied twice: a 40 ms peak among
    /// 6 ms answers falls below 18 ms after 4.7 s instead of 10.5 s).
    pub fn blend_at_most(&mut self, sample: Duration, now: Nanos, ceiling_ns: f64) {
        self.blend(sample, now);
        self.value_ns = self.value_ns.min(ceiling_ns);
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
    fn a_memory_of_means_stays_exact_and_a_ceiling_keeps_it_from_rising() {
        let clock = ManualClock::starting_at(0);
        let mut e = Ewma::new(COLD, TAU, clock.now());
        e.replace(Duration::from_millis(20), clock.now());
        // A sample every tick: the drift between ticks is undone, the
        // value stays what was measured.
        for _ in 0..200 {
            clock.advance(Duration::from_millis(50));
            e.blend(Duration::from_millis(20), clock.now());
        }
        assert!(close(e.estimate_ns(clock.now()), 20.0 * MS));
        // After half a life idle (10.5 ms), a 5 ms sample blended plainly
        // stands for the idle time: 12.5 ms. Capped at the estimate, it
        // leaves the value where the drift brought it.
        clock.advance(half_life());
        let before = e.estimate_ns(clock.now());
        let mut plain = e.clone();
        plain.blend(Duration::from_millis(5), clock.now());
        assert!(close(plain.estimate_ns(clock.now()), 12.5 * MS));
        e.blend_at_most(Duration::from_millis(5), clock.now(), before);
        assert!(close(e.estimate_ns(clock.now()), before));
        assert_eq!(e.last_sample(), Some(clock.now()));
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
