//! Passive outlier detection from the kernel's own flow events.
//!
//! Failures are what a client would see go wrong: a refused connection (RST
//! to the SYN), a SYN with no SYN-ACK in time (from the reconciler), and a
//! reset by the backend in the middle of a connection. Successes are
//! responses, counted per score tick. A backend is an outlier after
//! `consecutive` failures in a row (ticks without an answer, see
//! [`Detector`]), or when, within one `interval`, at least `min_volume` outcomes were
//! seen and the failure share exceeds `failure_rate`. Optionally a backend
//! whose latency estimate is `latency_factor` times the pool's median is an
//! outlier too. Ejection itself (and its cap) is the pool's business, see
//! `fleet.rs`.

use crate::{kernel::clock::Nanos, settings::ops::OutlierParams};

/// Why a backend was found to be an outlier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finding {
    Consecutive,
    /// New connections refused in a row, with none accepted in between,
    /// whatever its older connections answered.
    RefusedInRow,
    FailureRate,
    Latency,
}

impl Finding {
    pub const fn name(self) -> &'static str {
        match self {
            Finding::Consecutive => "consecutive failures",
            Finding::RefusedInRow => "connections refused in a row",
            Finding::FailureRate => "failure rate",
            Finding::Latency => "latency",
        }
    }
}

/// What went wrong, as the kernel's events tell it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// A new connection refused: an RST to the SYN, or no SYN-ACK in time.
    Refused,
    /// A live connection reset by the backend.
    Reset,
}

/// Per-backend outcome counters.
///
/// Failures arrive one by one from the ring buffer as they happen, but
/// successes (responses) only as each score tick's count: the kernel
/// aggregates them. So "in a row" cannot be judged per event (five
/// failures within one tick of a backend that answered thousands in
/// between would read as five in a row); it is judged at the tick
/// ([`Detector::judge`]): a tick in which the backend answered ends the
/// streak, and a tick in which it answered nothing adds its failures. A
/// backend that stops answering is found at most one tick later than per
/// event.
///
/// Answers are per request, so a backend that refuses every new connection
/// while its keep-alive connections go on answering would end every run.
/// Refused connections are also judged against the connections the
/// backend accepted (the kernel counts each SYN-ACK), as Envoy splits
/// connection failures from the rest: refusals with no connection
/// accepted in between make a run of their own ([`Finding::RefusedInRow`],
/// the same `consecutive` threshold).
#[derive(Clone, Debug, Default)]
pub struct Detector {
    consecutive: u32,
    /// Failures since the last tick, not judged yet.
    unjudged: u32,
    /// Refused connections in a row with none accepted in between.
    refused_in_row: u32,
    /// Of `unjudged`, the refused connections.
    unjudged_refused: u32,
    /// The kernel's count of connections the backend accepted, as last
    /// read (at a tick that judged refusals).
    handshakes_seen: Option<u64>,
    window_start: Nanos,
    failures: u32,
    successes: u64,
    /// Failures ever seen (for metrics).
    pub failures_total: u64,
}

impl Detector {
    /// Records a failure, judged at the next tick.
    pub fn failure(&mut self, failure: Failure, now: Nanos, p: &OutlierParams) {
        self.roll(now, p);
        self.unjudged = self.unjudged.saturating_add(1);
        if failure == Failure::Refused {
            self.unjudged_refused = self.unjudged_refused.saturating_add(1);
        }
        self.failures = self.failures.saturating_add(1);
        self.failures_total += 1;
    }

    /// Whether the next [`Detector::judge`] wants the kernel's count of
    /// connections the backend accepted (it has refusals to judge): read
    /// only then, so the tick's cost follows failures, not backends.
    pub fn needs_handshakes(&self) -> bool {
        self.unjudged_refused > 0
    }

    /// The tick: `answers` responses since the last one, and `handshakes`
    /// (the kernel's count of connections the backend accepted, when
    /// [`Detector::needs_handshakes`]; `None` if unread), then the failures
    /// recorded since; `Some` when they make the backend an outlier.
    pub fn judge(
        &mut self,
        answers: u64,
        handshakes: Option<u64>,
        now: Nanos,
        p: &OutlierParams,
    ) -> Option<Finding> {
        self.roll(now, p);
        self.successes = self.successes.saturating_add(answers);
        self.consecutive = if answers > 0 {
            0
        } else {
            self.consecutive.saturating_add(self.unjudged)
        };
        let refused = std::mem::take(&mut self.unjudged_refused);
        if let (true, Some(total)) = (refused > 0, handshakes) {
            // A connection accepted since the last refusals were judged
            // ends the run, these included (as an answer ends the other
            // run); a count that changed at all counts as accepted. The
            // first read has nothing to compare: any connection ever
            // accepted ends it, so a backend that accepted before needs
            // refusals at two ticks or more.
            let accepted = self.handshakes_seen.map_or(total > 0, |seen| total != seen);
            self.handshakes_seen = Some(total);
            self.refused_in_row = if accepted {
                0
            } else {
                self.refused_in_row.saturating_add(refused)
            };
        }
        let fresh = std::mem::take(&mut self.unjudged) > 0;
        if !fresh {
            return None;
        }
        if p.consecutive > 0 && self.consecutive >= p.consecutive {
            return Some(Finding::Consecutive);
        }
        if p.consecutive > 0 && self.refused_in_row >= p.consecutive {
            return Some(Finding::RefusedInRow);
        }
        let volume = u64::from(self.failures) + self.successes;
        if p.failure_rate > 0.0
            && volume >= u64::from(p.min_volume.max(1))
            && f64::from(self.failures) / volume as f64 > p.failure_rate
        {
            return Some(Finding::FailureRate);
        }
        None
    }

    /// Forgets the evidence (after an ejection, so the backend returns clean).
    pub fn reset(&mut self, now: Nanos) {
        self.consecutive = 0;
        self.unjudged = 0;
        self.refused_in_row = 0;
        self.unjudged_refused = 0;
        self.failures = 0;
        self.successes = 0;
        self.window_start = now;
    }

    fn roll(&mut self, now: Nanos, p: &OutlierParams) {
        if now.since(self.window_start) >= p.interval {
            self.failures = 0;
            self.successes = 0;
            self.window_start = now;
        }
    }
}

/// Indexes (into `ewma_ns`) of backends whose latency is `factor` times
/// the pool's median or more. Needs at least three backends, so that one
/// slow backend cannot drag the median up to itself.
pub fn latency_outliers(ewma_ns: &[u64], factor: f64) -> Vec<usize> {
    if factor <= 0.0 || ewma_ns.len() < 3 {
        return Vec::new();
    }
    let mut sorted = ewma_ns.to_vec();
    sorted.sort_unstable();
    let median = sorted[sorted.len() / 2] as f64;
    ewma_ns
        .iter()
        .enumerate()
        .filter(|&(_, &e)| median > 0.0 && e as f64 >= median * factor)
        .map(|(i, _)| i)
        .collect()
}

/// How many of `pool` backends may be ejected at once: `max_percent` of
/// the pool, but never all of it (the panic threshold).
pub fn ejection_cap(pool: usize, max_percent: u32) -> usize {
    let cap = pool * max_percent.min(100) as usize / 100;
    cap.min(pool.saturating_sub(1))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    const SEC: u64 = 1_000_000_000;
    const P: OutlierParams = OutlierParams {
        consecutive: 3,
        failure_rate: 0.5,
        min_volume: 10,
        interval: Duration::from_secs(10),
        latency_factor: 10.0,
    };

    #[test]
    fn consecutive_failures_make_an_outlier_and_an_answer_resets_them() {
        let mut d = Detector::default();
        d.failure(Failure::Reset, Nanos(1), &P);
        d.failure(Failure::Reset, Nanos(2), &P);
        assert_eq!(d.judge(0, None, Nanos(3), &P), None);
        // A tick with an answer ends the streak, its failures included.
        d.failure(Failure::Reset, Nanos(4), &P);
        assert_eq!(d.judge(1, None, Nanos(5), &P), None);
        d.failure(Failure::Reset, Nanos(6), &P);
        d.failure(Failure::Reset, Nanos(7), &P);
        assert_eq!(d.judge(0, None, Nanos(8), &P), None);
        d.failure(Failure::Reset, Nanos(9), &P);
        assert_eq!(d.judge(0, None, Nanos(10), &P), Some(Finding::Consecutive));
        assert_eq!(d.failures_total, 6);
    }

    /// A busy backend that fails now and then: five failures in one tick,
    /// among hundreds of answers, are no streak (judged per event, they
    /// were five in a row and ejected it).
    #[test]
    fn failures_among_answers_in_one_tick_are_no_streak() {
        let mut d = Detector::default();
        for tick in 1..=100u64 {
            for i in 0..5 {
                d.failure(Failure::Reset, Nanos(tick * 50_000_000 + i), &P);
            }
            let found = d.judge(500, None, Nanos(tick * 50_000_000 + 10), &P);
            assert_eq!(found, None, "tick {tick}");
        }
        // A tick with no judgement due (no new failure) finds nothing.
        assert_eq!(d.judge(0, None, Nanos(6 * SEC), &P), None);
    }

    #[test]
    fn failure_rate_needs_volume_within_one_interval() {
        let p = OutlierParams {
            consecutive: 0,
            ..P
        };
        let mut d = Detector::default();
        // 4 answers, then 6 failures: 6 of 10 fail.
        assert_eq!(d.judge(4, None, Nanos(SEC), &p), None);
        for i in 0..5 {
            d.failure(Failure::Reset, Nanos(SEC + i), &p);
        }
        assert_eq!(d.judge(0, None, Nanos(SEC + 10), &p), None, "5 of 9");
        d.failure(Failure::Reset, Nanos(SEC + 11), &p);
        assert_eq!(
            d.judge(0, None, Nanos(SEC + 12), &p),
            Some(Finding::FailureRate)
        );
        // A new interval starts from zero.
        d.reset(Nanos(SEC));
        d.failure(Failure::Reset, Nanos(20 * SEC), &p);
        assert_eq!(d.judge(0, None, Nanos(20 * SEC), &p), None);
    }

    #[test]
    fn latency_outliers_are_far_above_the_median() {
        assert_eq!(latency_outliers(&[1, 1, 1, 50], 10.0), vec![3]);
        assert!(latency_outliers(&[1, 1, 1, 5], 10.0).is_empty());
        assert!(latency_outliers(&[1, 50], 10.0).is_empty());
        assert!(latency_outliers(&[1, 1, 50], 0.0).is_empty());
    }

    #[test]
    fn the_cap_never_ejects_a_whole_pool() {
        assert_eq!(ejection_cap(10, 50), 5);
        assert_eq!(ejection_cap(3, 50), 1);
        assert_eq!(ejection_cap(2, 100), 1);
        assert_eq!(ejection_cap(1, 100), 0);
        assert_eq!(ejection_cap(4, 10), 0);
    }

    /// A backend that refuses every new connection while its keep-alive
    /// connections answer hundreds of requests a tick: the answers end no
    /// run of refusals; a connection it accepted does.
    #[test]
    fn refusals_with_no_connection_accepted_are_a_run_whatever_the_answers() {
        let mut d = Detector::default();
        let tick = |n: u64| Nanos(n * 50_000_000);
        let refuse = |d: &mut Detector, n: u64| d.failure(Failure::Refused, tick(n), &P);
        refuse(&mut d, 1);
        assert!(d.needs_handshakes());
        // It accepted 40 connections before: nothing to compare with yet.
        assert_eq!(d.judge(500, Some(40), tick(1), &P), None);
        assert!(!d.needs_handshakes(), "judged");
        refuse(&mut d, 2);
        refuse(&mut d, 2);
        assert_eq!(d.judge(500, Some(40), tick(2), &P), None, "2 in a row");
        // One accepted in between ends the run, this tick's refusal too.
        refuse(&mut d, 3);
        assert_eq!(d.judge(500, Some(41), tick(3), &P), None);
        refuse(&mut d, 4);
        refuse(&mut d, 4);
        assert_eq!(d.judge(500, Some(41), tick(4), &P), None, "2 in a row");
        // A tick with no refusal reads no count and changes nothing; a
        // backend's reset is no refusal.
        assert_eq!(d.judge(500, None, tick(5), &P), None);
        d.failure(Failure::Reset, tick(6), &P);
        assert!(!d.needs_handshakes());
        assert_eq!(d.judge(500, None, tick(6), &P), None);
        refuse(&mut d, 7);
        assert_eq!(
            d.judge(500, Some(41), tick(7), &P),
            Some(Finding::RefusedInRow)
        );
        // After an ejection it starts clean.
        d.reset(tick(8));
        refuse(&mut d, 9);
        assert_eq!(d.judge(0, Some(41), tick(9), &P), None);
    }

    /// A count that could not be read judges no refusal run (the other
    /// rules still hold).
    #[test]
    fn an_unread_accept_count_makes_no_run() {
        let mut d = Detector::default();
        for n in 1..=10u64 {
            d.failure(Failure::Refused, Nanos(n), &P);
            assert_eq!(d.judge(500, None, Nanos(n), &P), None, "tick {n}");
        }
    }
}
