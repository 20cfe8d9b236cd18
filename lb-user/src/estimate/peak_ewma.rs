//! Peak-EWMA latency estimate, as in Finagle's `PeakEwma` balancer and
//! linkerd/tower's `load::PeakEwma`.
//!
//! * A sample above the estimate replaces it at once: a backend that gets
//!   slow is penalised on its first slow response ("peak" sensitivity).
//! * A sample at or below it is blended in, and between samples the
//!   estimate drifts towards the cold-start value, as in
//!   [`crate::estimate::ewma::Ewma`] (time-weighted, `w = exp(-Δt/τ)`).

use std::time::Duration;

use crate::{estimate::ewma::Ewma, kernel::clock::Nanos};

#[derive(Clone, Debug)]
pub struct PeakEwma {
    average: Ewma,
}

impl PeakEwma {
    /// A backend with no samples yet: the estimate is the cold-start value.
    pub fn new(cold_start: Duration, tau: Duration, now: Nanos) -> Self {
        Self {
            average: Ewma::new(cold_start, tau, now),
        }
    }

    /// When the last sample arrived, if ever.
    pub fn last_sample(&self) -> Option<Nanos> {
        self.average.last_sample()
    }

    /// Records one latency sample taken at `now`.
    pub fn observe(&mut self, sample: Duration, now: Nanos) {
        if sample.as_nanos() as f64 > self.average.stored_ns() {
            self.average.replace(sample, now);
        } else {
            self.average.blend(sample, now);
        }
    }

    /// Sets the estimate to `sample`, above or below (a latency probe of
    /// an avoided backend, see [`crate::estimate::latency`]).
    pub fn reset(&mut self, sample: Duration, now: Nanos) {
        self.average.replace(sample, now);
    }

    /// The estimate at `now`, including the idle drift towards cold start.
    pub fn estimate_ns(&self, now: Nanos) -> f64 {
        self.average.estimate_ns(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        estimate::testing::{COLD, MS, TAU, close, half_life},
        kernel::clock::{Clock, ManualClock},
    };

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
