//! Peak-EWMA latency estimate, as in Finagle's `PeakEwma` balancer and
//! linkerd/tower's `load::PeakEwma`.
//!
//! * A sample above the estimate replaces it at once: a backend that gets
//!   slow is penalised on its first slow response ("peak" sensitivity).
//! * Between samples the estimate drifts towards the cold-start value, as
//!   in [`crate::estimate::ewma::Ewma`] (time-weighted, `w = exp(-Δt/τ)`).
//! * "The estimate" is the drifted one, what P2C saw: a sample is compared
//!   with it, and one at or below it is blended in without ever raising
//!   it ([`Ewma::blend_at_most`]). Compared with and blended into the
//!   value of the last sample instead, a backend held for one 300 ms
//!   answer and avoided for 20 s (decayed to 41.5 ms) went back up to
//!   49 ms with its next answer, a 10 ms one: held again by its own fast
//!   answer. Finagle and tower decay the stored cost on every read, so
//!   there too a sample meets the decayed estimate.

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

    /// Records one latency sample taken at `now`: a peak above the
    /// estimate at `now` is taken, anything else never raises it.
    pub fn observe(&mut self, sample: Duration, now: Nanos) {
        let estimate = self.average.estimate_ns(now);
        if sample.as_nanos() as f64 > estimate {
            self.average.replace(sample, now);
        } else {
            self.average.blend_at_most(sample, now, estimate);
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
    fn lower_samples_decay_it_with_a_half_life_of_tau_ln2_and_never_raise_it() {
        let clock = ManualClock::starting_at(0);
        let mut e = PeakEwma::new(COLD, TAU, clock.now());
        e.observe(Duration::from_millis(10), clock.now());
        let mut twin = e.clone();
        clock.advance(half_life());
        // w = 1/2: the estimate drifted halfway to cold start, 5.5 ms. A
        // 2 ms sample leaves it there (blended into the 10 ms of the last
        // sample it gave 6 ms, more than before the sample).
        e.observe(Duration::from_millis(2), clock.now());
        assert!(close(e.estimate_ns(clock.now()), 5.5 * MS));
        // One below cold start pulls it below the drift: halfway between
        // 10 ms and 0.2 ms.
        twin.observe(Duration::from_micros(200), clock.now());
        assert!(close(twin.estimate_ns(clock.now()), 5.1 * MS));
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

    /// A backend held for one 300 ms answer, idle for 20 s (its estimate
    /// decayed to about 41.5 ms), answers a retry in 10 ms: the answer
    /// must not put it back up (it gave about 49 ms, as if the 300 ms
    /// memory had not decayed), so it is not held again by its own fast
    /// answer.
    #[test]
    fn a_fast_answer_after_an_idle_spell_never_raises_the_estimate() {
        let clock = ManualClock::starting_at(0);
        let mut e = PeakEwma::new(COLD, TAU, clock.now());
        e.observe(Duration::from_millis(300), clock.now());
        clock.advance(Duration::from_secs(20));
        let before = e.estimate_ns(clock.now());
        assert!((41.0..42.0).contains(&(before / MS)), "{before}");
        let mut twin = e.clone();
        e.observe(Duration::from_millis(10), clock.now());
        let after = e.estimate_ns(clock.now());
        assert!(
            after <= before,
            "{} ms after, {} ms before",
            after / MS,
            before / MS
        );
        // A sample just above the decayed estimate is a peak: it is taken
        // as it is, not blended into the 300 ms memory (about 79 ms).
        twin.observe(Duration::from_millis(45), clock.now());
        assert!(close(twin.estimate_ns(clock.now()), 45.0 * MS));
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
