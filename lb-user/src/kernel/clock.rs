//! Time as the kernel sees it. The XDP program stamps flows and events with
//! `bpf_ktime_get_ns`, which is CLOCK_MONOTONIC, so the control plane reads the
//! same clock; logic takes a [`Clock`] so tests can drive time by hand.

use std::time::Duration;

/// A CLOCK_MONOTONIC timestamp in nanoseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Nanos(pub u64);

impl Nanos {
    /// Time from `earlier` to `self`, zero if `earlier` is later.
    pub fn since(self, earlier: Nanos) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }

    /// `d` after `self` (saturating at the end of time).
    pub fn plus(self, d: Duration) -> Nanos {
        Nanos(
            self.0
                .saturating_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)),
        )
    }
}

pub trait Clock {
    fn now(&self) -> Nanos;
}

/// The real clock (CLOCK_MONOTONIC, like `bpf_ktime_get_ns`).
#[derive(Clone, Copy, Debug, Default)]
pub struct MonotonicClock;

impl Clock for MonotonicClock {
    fn now(&self) -> Nanos {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
        Nanos(ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64)
    }
}

/// A clock that only moves when told to (tests).
#[cfg(test)]
#[derive(Debug, Default)]
pub struct ManualClock(std::cell::Cell<u64>);

#[cfg(test)]
impl ManualClock {
    pub fn starting_at(ns: u64) -> Self {
        Self(std::cell::Cell::new(ns))
    }

    pub fn advance(&self, by: Duration) {
        self.0.set(self.0.get() + by.as_nanos() as u64);
    }
}

#[cfg(test)]
impl Clock for ManualClock {
    fn now(&self) -> Nanos {
        Nanos(self.0.get())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn monotonic_clock_moves_forward() {
        let a = MonotonicClock.now();
        let b = MonotonicClock.now();
        assert!(b >= a && a.0 > 0);
        assert_eq!(a.since(b), Duration::ZERO);
        assert_eq!(Nanos(5).since(Nanos(2)), Duration::from_nanos(3));
    }
}
