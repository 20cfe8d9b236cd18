//! Peak-EWMA latency estimate, as in Finagle's `PeakEwma` balancer and
//! linkerd/tower's `load::PeakEwma`.
//!
//! * A sample above the estimate replaces it at once: a backend that gets
//!   slow is penalised on its first slow response ("peak" sensitivity).
//! * A sample at or below it is blended in with a weight that depends on the
//!   time since the previous sample, not on the sample count:
//!   `w = exp(-Δt/τ)`, `new = old·w + sample·(1-w)`. So the estimate forgets
//!   with a half-life of `τ·ln 2` whatever the request rate.
//! * Between samples the estimate drifts towards the cold-start value with
//!   the same τ, so a backend nobody has used for a while is tried again
//!   instead of being judged forever on its last measurement.

use std::time::Duration;

use crate::kernel::clock::Nanos;

#[derive(Clone, Debug)]
pub struct PeakEwma {
    /// Estimate as of `updated`, in nanoseconds.
    estimate_ns: f64,
    updated: Nanos,
    tau_ns: f64,
    cold_start_ns: f64,
    /// When the last sample arrived (`None`: never).
    last_sample: Option<Nanos>,
}

impl PeakEwma {
    /// A backend with no samples yet: the estimate is the cold-start value.
    pub fn new(cold_start: Duration, tau: Duration, now: Nanos) -> Self {
        Self {
            estimate_ns: cold_start.as_nanos() as f64,
            updated: now,
            tau_ns: tau.as_nanos() as f64,
            cold_start_ns: cold_start.as_nanos() as f64,
            last_sample: None,
        }
    }

    /// When the last sample arrived, if ever.
    pub fn last_sample(&self) -> Option<Nanos> {
        self.last_sample
    }

    /// `exp(-Δt/τ)` for the time since the last sample.
    fn decay_weight(&self, now: Nanos) -> f64 {
        (-(now.since(self.updated).as_nanos() as f64) / self.tau_ns).exp()
    }

    /// Records one latency sample taken at `now`.
    pub fn observe(&mut self, sample: Duration, now: Nanos) {
        let sample_ns = sample.as_nanos() as f64;
        if sample_ns > self.estimate_ns {
            self.estimate_ns = sample_ns;
        } else {
            let w = self.decay_weight(now);
            self.estimate_ns = self.estimate_ns * w + sample_ns * (1.0 - w);
        }
        self.updated = self.updated.max(now);
        self.last_sample = Some(self.last_sample.map_or(now, |t| t.max(now)));
    }

    /// The estimate at `now`, including the idle drift towards cold start.
    pub fn estimate_ns(&self, now: Nanos) -> f64 {
        let w = self.decay_weight(now);
        self.cold_start_ns + (self.estimate_ns - self.cold_start_ns) * w
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::clock::{Clock, ManualClock};

    const TAU: Duration = Duration::from_secs(10);
    const COLD: Duration = Duration::from_millis(1);
    const MS: f64 = 1e6;

    fn half_life() -> Duration {
        TAU.mul_f64(std::f64::consts::LN_2)
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-3 * b.abs().max(1.0)
    }

    #[test]
    fn starts_at_cold_start() {
        let clock = ManualClock::starting_at(1_000);
        let e = PeakEwma::new(COLD, TAU, clock.now());
        assert!(close(e.estimate_ns(clock.now()), 1.0 * MS));
        clock.advance(Duration::from_secs(100));
        assert!(close(e.estimate_ns(clock.now()), 1.0 * MS));
    }

    #[test]
    fn a_peak_replaces_the_estimate_immediately() {
        let clock = ManualClock::starting_at(0);
        let mut e = PeakEwma::new(COLD, TAU, clock.now());
        clock.advance(Duration::from_millis(1));
        e.observe(Duration::from_millis(50), clock.now());
        assert!(close(e.estimate_ns(clock.now()), 50.0 * MS));
    }

    #[test]
    fn lower_samples_blend_with_a_half_life_of_tau_ln2() {
        let clock = ManualClock::starting_at(0);
        let mut e = PeakEwma::new(COLD, TAU, clock.now());
        e.observe(Duration::from_millis(10), clock.now());
        clock.advance(half_life());
        e.observe(Duration::from_millis(2), clock.now());
        // w = 1/2: halfway between 10ms and 2ms.
        assert!(close(e.estimate_ns(clock.now()), 6.0 * MS));
    }

    #[test]
    fn back_to_back_samples_barely_move_a_high_estimate() {
        let clock = ManualClock::starting_at(0);
        let mut e = PeakEwma::new(COLD, TAU, clock.now());
        e.observe(Duration::from_millis(10), clock.now());
        clock.advance(Duration::from_millis(1));
        e.observe(Duration::from_micros(100), clock.now());
        let est = e.estimate_ns(clock.now()) / MS;
        assert!(est > 9.9 && est < 10.0, "{est}");
    }

    #[test]
    fn an_idle_backend_decays_towards_cold_start() {
        let clock = ManualClock::starting_at(0);
        let mut e = PeakEwma::new(COLD, TAU, clock.now());
        e.observe(Duration::from_millis(9), clock.now());
        clock.advance(half_life());
        // Halfway from 9ms to the 1ms cold start.
        assert!(close(e.estimate_ns(clock.now()), 5.0 * MS));
        clock.advance(TAU * 20);
        assert!(close(e.estimate_ns(clock.now()), 1.0 * MS));
    }

    #[test]
    fn a_fast_idle_backend_drifts_up_to_cold_start() {
        let clock = ManualClock::starting_at(0);
        let mut e = PeakEwma::new(COLD, TAU, clock.now());
        clock.advance(TAU * 20);
        e.observe(Duration::from_micros(100), clock.now());
        assert!(close(e.estimate_ns(clock.now()), 0.1 * MS));
        clock.advance(half_life());
        assert!(close(e.estimate_ns(clock.now()), 0.55 * MS));
    }
}
