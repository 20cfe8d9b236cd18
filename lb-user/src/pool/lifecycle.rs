//! The life of one backend in the control plane: administrative state
//! (active, draining, removed), health-check state (rise/fall), outlier
//! ejection (Envoy-style growing ejection time), and the effective weight
//! that slow start and weight smoothing derive from the configured weight.
//!
//! Pure logic: every method takes the current time, so the whole model is
//! tested with a hand-driven clock. Every state change is logged with
//! `tracing` (structured fields `backend`, `from`, `to`, `why`).

use std::time::Duration;

use lb_common::{BACKEND_ACTIVE, BACKEND_DOWN, BACKEND_DRAINING, BACKEND_EJECTED};
use tracing::info;

use crate::{estimate::WEIGHT_UNITS, kernel::clock::Nanos, settings::ops::LifecycleParams};

/// Administrative state, set by the operator (CLI, socket, config reload).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admin {
    Active,
    /// Keeps its flows, takes no new ones; `undrain` brings it back.
    Draining,
    /// Gone from the configuration; kept (as draining) until its flows end.
    Removed,
}

/// The state reported in logs, status and metrics, most severe first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum State {
    Active,
    Draining,
    Ejected,
    /// Failed its active health checks.
    Down,
}

impl State {
    pub const ALL: [State; 4] = [State::Active, State::Draining, State::Ejected, State::Down];

    pub const fn name(self) -> &'static str {
        match self {
            State::Active => "active",
            State::Draining => "draining",
            State::Ejected => "ejected",
            State::Down => "down",
        }
    }
}

/// One backend's lifecycle.
#[derive(Clone, Debug)]
pub struct Lifecycle {
    /// Backend id, for logs.
    id: u32,
    admin: Admin,
    healthy: bool,
    /// Consecutive check results in the direction opposite to `healthy`.
    streak: u32,
    ejected_until: Option<Nanos>,
    /// Ejections so far, decayed by one per `ejection_base` spent in service.
    ejections: u32,
    /// Total ejections ever (for metrics).
    pub ejections_total: u64,
    last_decay: Nanos,
    /// Weight before the last change, the change's target, and its time.
    weight_from: u32,
    weight_to: u32,
    weight_changed: Nanos,
    /// When the current slow-start ramp began (`None`: at full weight).
    ramp_start: Option<Nanos>,
    /// When the backend last passed its health checks again after failing
    /// them (`None`: it never failed them).
    back_since: Option<Nanos>,
    last_state: State,
}

impl Lifecycle {
    /// A backend present from the start: active, healthy, full weight.
    pub fn new(id: u32, weight: u32, now: Nanos) -> Self {
        Self {
            id,
            admin: Admin::Active,
            healthy: true,
            streak: 0,
            ejected_until: None,
            ejections: 0,
            ejections_total: 0,
            last_decay: now,
            weight_from: weight,
            weight_to: weight,
            weight_changed: now,
            ramp_start: None,
            back_since: None,
            last_state: State::Active,
        }
    }

    /// A backend the previous process had down by its health checks
    /// (`Plan::down`): down until it passes `rise` checks, then back
    /// through slow start, as without the restart.
    pub fn down_before_restart(id: u32, weight: u32, now: Nanos) -> Self {
        info!(
            backend = id,
            "backend was down before the restart: down until it passes its health checks"
        );
        Self {
            healthy: false,
            last_state: State::Down,
            ..Self::new(id, weight, now)
        }
    }

    /// A backend added at runtime: starts its slow-start ramp now.
    pub fn added(id: u32, weight: u32, now: Nanos) -> Self {
        Self {
            ramp_start: Some(now),
            ..Self::new(id, weight, now)
        }
    }

    pub fn admin(&self) -> Admin {
        self.admin
    }

    pub fn weight(&self) -> u32 {
        self.weight_to
    }

    pub fn ejections(&self) -> u32 {
        self.ejections
    }

    pub fn state(&self, now: Nanos) -> State {
        match self.admin {
            Admin::Draining | Admin::Removed => State::Draining,
            Admin::Active if !self.healthy => State::Down,
            Admin::Active if self.ejected_until.is_some_and(|t| now < t) => State::Ejected,
            Admin::Active => State::Active,
        }
    }

    /// The state the kernel gets when this backend is not overridden by
    /// the pool's panic mode.
    pub fn kernel_state(&self, now: Nanos) -> u8 {
        match self.state(now) {
            State::Active => BACKEND_ACTIVE,
            State::Draining => BACKEND_DRAINING,
            State::Ejected => BACKEND_EJECTED,
            State::Down => BACKEND_DOWN,
        }
    }

    pub fn set_admin(&mut self, admin: Admin, now: Nanos, p: &LifecycleParams) {
        let was_serving = self.admin == Admin::Active;
        self.admin = admin;
        if admin == Admin::Active && !was_serving {
            self.ramp_start = Some(now);
        }
        self.note(now, p, "operator");
    }

    /// A new configured weight, reached over `weight_smoothing`.
    pub fn set_weight(&mut self, weight: u32, now: Nanos, p: &LifecycleParams) {
        self.weight_from = self.target_weight(now, p).round() as u32;
        self.weight_to = weight;
        self.weight_changed = now;
        info!(
            backend = self.id,
            from = self.weight_from,
            to = weight,
            over = ?p.weight_smoothing,
            "backend weight changed"
        );
    }

    /// One active health-check result; returns true if the health state flipped.
    pub fn check_result(&mut self, passed: bool, now: Nanos, p: &LifecycleParams) -> bool {
        if passed == self.healthy {
            self.streak = 0;
            return false;
        }
        self.streak += 1;
        let needed = if self.healthy { p.fall } else { p.rise };
        if self.streak < needed.max(1) {
            return false;
        }
        self.streak = 0;
        self.healthy = passed;
        if passed {
            self.ramp_start = Some(now);
            self.back_since = Some(now);
        }
        self.note(now, p, "health check");
        true
    }

    /// Whether users' responses of one score tick, the slowest of which
    /// took `peak`, read at `now`, measure how fast the backend serves.
    ///
    /// Not while it fails its health checks, and not when the slowest
    /// answers a request sent before it passed them again (`peak` longer
    /// than the time since): that request waited on the outage (packets
    /// lost on a cut link and the retransmission timeouts after), not on
    /// the service. In the zones lab such answers read 2 s from backends
    /// that serve in 5 ms, and made their zone look 400× slower than its
    /// peers for seconds. The rule is Karn's (Karn and Partridge,
    /// 1987), which keeps retransmitted segments out of TCP's round-trip
    /// estimate. The tick's other answers go with the slowest: the kernel
    /// aggregates a tick (sum, count, peak), so it is taken or left whole.
    pub fn measures_service(&self, peak: Duration, now: Nanos) -> bool {
        self.healthy && self.back_since.is_none_or(|back| peak <= now.since(back))
    }

    /// Ejects for `ejection_base × ejections` (capped), counting this one.
    pub fn eject(&mut self, now: Nanos, p: &LifecycleParams, why: &str) {
        self.ejections += 1;
        self.ejections_total += 1;
        let time = p
            .ejection_base
            .saturating_mul(self.ejections)
            .min(p.ejection_max);
        self.ejected_until = Some(Nanos(now.0.saturating_add(time.as_nanos() as u64)));
        self.last_decay = now;
        self.note(now, p, why);
    }

    pub fn is_ejected(&self, now: Nanos) -> bool {
        self.ejected_until.is_some_and(|t| now < t)
    }

    /// Advances time-driven transitions: the end of an ejection (which
    /// starts a slow-start ramp) and the decay of the ejection count.
    pub fn tick(&mut self, now: Nanos, p: &LifecycleParams) {
        if let Some(until) = self.ejected_until
            && now >= until
        {
            self.ejected_until = None;
            self.ramp_start = Some(now);
            self.last_decay = now;
        }
        // Hysteresis: the count that lengthens the next ejection only falls
        // after a whole base time in service, so a flapping backend stays
        // out longer each time instead of thrashing. Time down or drained
        // is not in service: the base time starts again on return.
        if self.state(now) != State::Active {
            self.last_decay = now;
        } else if self.ejections > 0
            && !p.ejection_base.is_zero()
            && now.since(self.last_decay) >= p.ejection_base
        {
            self.ejections -= 1;
            self.last_decay = now;
        }
        if let Some(start) = self.ramp_start
            && now.since(start) >= p.slow_start
        {
            self.ramp_start = None;
        }
        self.note(now, p, "timer");
    }

    /// Configured weight as it moves towards a new value (weight units).
    fn target_weight(&self, now: Nanos, p: &LifecycleParams) -> f64 {
        let (from, to) = (f64::from(self.weight_from), f64::from(self.weight_to));
        let progress = fraction(now.since(self.weight_changed), p.weight_smoothing);
        from + (to - from) * progress
    }

    /// The largest configured weight of the smoothing under way (the
    /// configured weight once it is over), in weight units: a table-based
    /// VIP's ramp is rounded to steps of this (`fleet::coarse_weight`), so a
    /// lowered weight moves in as few steps as a raised one.
    pub fn ramp_span(&self, now: Nanos, p: &LifecycleParams) -> u32 {
        let smoothing = fraction(now.since(self.weight_changed), p.weight_smoothing) < 1.0;
        let span = if smoothing {
            self.weight_from.max(self.weight_to)
        } else {
            self.weight_to
        };
        span.saturating_mul(WEIGHT_UNITS)
    }

    /// The configured weight as weight smoothing moves it, in weight
    /// units (no slow-start ramp).
    pub fn smoothed_weight(&self, now: Nanos, p: &LifecycleParams) -> u32 {
        (self.target_weight(now, p) * f64::from(WEIGHT_UNITS)).round() as u32
    }

    /// Slow-start factor: `max(floor, elapsed / window)`, 1 when not ramping.
    pub fn ramp_factor(&self, now: Nanos, p: &LifecycleParams) -> f64 {
        match self.ramp_start {
            Some(start) => fraction(now.since(start), p.slow_start).max(p.slow_start_floor),
            None => 1.0,
        }
    }

    /// Weight used for selection, in [`WEIGHT_UNITS`], at least 1.
    pub fn effective_weight(&self, now: Nanos, p: &LifecycleParams) -> u32 {
        let w = self.target_weight(now, p) * self.ramp_factor(now, p) * f64::from(WEIGHT_UNITS);
        (w.round() as u32).max(1)
    }

    /// Logs a state change, if there was one.
    fn note(&mut self, now: Nanos, p: &LifecycleParams, why: &str) {
        let state = self.state(now);
        if state != self.last_state {
            info!(
                backend = self.id,
                from = self.last_state.name(),
                to = state.name(),
                why,
                ejections = self.ejections,
                weight = self.effective_weight(now, p),
                "backend state changed"
            );
            self.last_state = state;
        }
    }
}

/// `elapsed / window` clamped to 0..=1; a zero window is already complete.
fn fraction(elapsed: Duration, window: Duration) -> f64 {
    if window.is_zero() {
        return 1.0;
    }
    (elapsed.as_secs_f64() / window.as_secs_f64()).min(1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: u64 = 1_000_000_000;
    const P: LifecycleParams = LifecycleParams {
        slow_start: Duration::from_secs(10),
        slow_start_floor: 0.5,
        weight_smoothing: Duration::from_secs(4),
        rise: 2,
        fall: 3,
        ejection_base: Duration::from_secs(30),
        ejection_max: Duration::from_secs(300),
    };

    fn at(s: u64) -> Nanos {
        Nanos(1_000 * SEC + s * SEC)
    }

    #[test]
    fn a_configured_backend_starts_active_at_full_weight() {
        let b = Lifecycle::new(0, 2, at(0));
        assert_eq!(b.state(at(0)), State::Active);
        assert_eq!(b.kernel_state(at(0)), BACKEND_ACTIVE);
        assert_eq!(b.effective_weight(at(0), &P), 200);
    }

    #[test]
    fn answers_that_waited_on_a_health_outage_do_not_measure_the_service() {
        let ms = Duration::from_millis;
        let mut b = Lifecycle::new(0, 1, at(0));
        // Never down: any answer counts, however slow.
        assert!(b.measures_service(ms(5), at(1)));
        assert!(b.measures_service(Duration::from_secs(30), at(1)));
        for t in 2..5 {
            b.check_result(false, at(t), &P);
        }
        assert_eq!(b.state(at(4)), State::Down);
        // Down: nothing it answers counts, fast or slow.
        assert!(!b.measures_service(ms(5), at(5)));
        b.check_result(true, at(5), &P);
        b.check_result(true, at(6), &P);
        assert_eq!(b.state(at(6)), State::Active);
        // Back at 6 s. At 6.5 s an answer of 2 s was asked for while it
        // was down; one of 400 ms after its return.
        let half = Nanos(at(6).0 + SEC / 2);
        assert!(!b.measures_service(ms(2_000), half));
        assert!(b.measures_service(ms(400), half));
        assert!(b.measures_service(ms(500), half));
        assert!(!b.measures_service(ms(501), half));
        // Later, a slow answer is the backend's own again.
        assert!(b.measures_service(ms(2_000), at(9)));
        // Ejection is not an outage: its answers still count.
        b.eject(at(10), &P, "test");
        assert_eq!(b.state(at(10)), State::Ejected);
        assert!(b.measures_service(ms(2_000), at(10)));
    }

    #[test]
    fn falls_after_fall_failures_and_rises_after_rise_passes() {
        let mut b = Lifecycle::new(0, 1, at(0));
        assert!(!b.check_result(false, at(1), &P));
        assert!(!b.check_result(false, at(2), &P));
        // A pass in between resets the streak.
        assert!(!b.check_result(true, at(3), &P));
        assert!(!b.check_result(false, at(4), &P));
        assert!(!b.check_result(false, at(5), &P));
        assert!(b.check_result(false, at(6), &P));
        assert_eq!(b.state(at(6)), State::Down);
        assert_eq!(b.kernel_state(at(6)), BACKEND_DOWN);
        assert!(!b.check_result(true, at(7), &P));
        assert_eq!(b.state(at(7)), State::Down);
        assert!(b.check_result(true, at(8), &P));
        assert_eq!(b.state(at(8)), State::Active);
        // Recovered: slow start from the floor.
        assert_eq!(b.effective_weight(at(8), &P), 50);
    }

    #[test]
    fn slow_start_ramps_from_the_floor_to_full_weight() {
        let mut b = Lifecycle::added(0, 4, at(0));
        assert_eq!(b.effective_weight(at(0), &P), 200);
        assert_eq!(b.effective_weight(at(2), &P), 200);
        assert_eq!(b.effective_weight(at(5), &P), 200);
        assert_eq!(b.effective_weight(at(8), &P), 320);
        b.tick(at(10), &P);
        assert_eq!(b.effective_weight(at(10), &P), 400);
        assert_eq!(b.ramp_factor(at(20), &P), 1.0);
    }

    #[test]
    fn ejections_grow_with_each_ejection_and_decay_in_service() {
        let mut b = Lifecycle::new(0, 1, at(0));
        b.eject(at(0), &P, "test");
        assert_eq!(b.state(at(29)), State::Ejected);
        b.tick(at(30), &P);
        assert_eq!(b.state(at(30)), State::Active);
        assert_eq!(b.effective_weight(at(30), &P), 50);
        // Ejected again soon after: twice as long.
        b.eject(at(31), &P, "test");
        assert_eq!(b.ejections(), 2);
        b.tick(at(90), &P);
        assert!(b.is_ejected(at(90)));
        b.tick(at(91), &P);
        assert!(!b.is_ejected(at(91)));
        // A base time in service forgives one ejection.
        b.tick(at(121), &P);
        assert_eq!(b.ejections(), 1);
        b.tick(at(151), &P);
        assert_eq!(b.ejections(), 0);
        assert_eq!(b.ejections_total, 2);
    }

    #[test]
    fn ejection_time_is_capped() {
        let mut b = Lifecycle::new(0, 1, at(0));
        for _ in 0..20 {
            b.eject(at(0), &P, "test");
        }
        assert!(b.is_ejected(at(299)));
        assert!(!b.is_ejected(at(300)));
    }

    #[test]
    fn draining_wins_over_other_states_and_undrain_ramps() {
        let mut b = Lifecycle::new(0, 1, at(0));
        b.eject(at(0), &P, "test");
        b.set_admin(Admin::Draining, at(1), &P);
        assert_eq!(b.state(at(1)), State::Draining);
        assert_eq!(b.kernel_state(at(1)), BACKEND_DRAINING);
        b.set_admin(Admin::Active, at(100), &P);
        b.tick(at(100), &P);
        assert_eq!(b.state(at(100)), State::Active);
        assert_eq!(b.effective_weight(at(100), &P), 50);
    }

    #[test]
    fn weight_changes_are_smoothed() {
        let mut b = Lifecycle::new(0, 1, at(0));
        b.set_weight(5, at(0), &P);
        assert_eq!(b.effective_weight(at(0), &P), 100);
        assert_eq!(b.effective_weight(at(2), &P), 300);
        assert_eq!(b.effective_weight(at(4), &P), 500);
        // A change mid-way starts from where the weight is.
        b.set_weight(1, at(4), &P);
        assert_eq!(b.effective_weight(at(6), &P), 300);
        let instant = LifecycleParams {
            weight_smoothing: Duration::ZERO,
            ..P
        };
        b.set_weight(7, at(10), &instant);
        assert_eq!(b.effective_weight(at(10), &instant), 700);
    }
}
