//! Stalls of the whole lab host: moments when no thread of this machine ran
//! for tens of milliseconds (a VM descheduled by its hypervisor, a noisy
//! neighbour). In a lab every backend, the balancer and the client share the
//! host, so such a stall delays every response in flight at once, and a
//! backend that happened to hold one reads as if it had turned slow. A test
//! whose assertion depends on one backend's few latency samples can ask
//! whether the host stalled in its window ([`HostStalls::between`]).
//!
//! The watch is a thread that sleeps 1 ms at a time and records each wake-up
//! later than its threshold: it sees what every other process sees, since
//! it runs on the same scheduler.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

/// How long the watch sleeps between looks.
const TICK: Duration = Duration::from_millis(1);

/// One stall: when the watch woke up after it, and how long it lasted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostStall {
    pub ended: Instant,
    pub length: Duration,
}

/// Records host stalls longer than a threshold until dropped.
pub struct HostStalls {
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Vec<HostStall>>>,
    thread: Option<JoinHandle<()>>,
}

impl HostStalls {
    /// Starts watching for stalls longer than `threshold`.
    pub fn watch(threshold: Duration) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let thread = {
            let (stop, seen) = (Arc::clone(&stop), Arc::clone(&seen));
            thread::spawn(move || {
                let mut last = Instant::now();
                while !stop.load(Ordering::Relaxed) {
                    thread::sleep(TICK);
                    let now = Instant::now();
                    let length = now.duration_since(last);
                    if length > threshold {
                        seen.lock()
                            .unwrap_or_else(|poisoned| poisoned.into_inner())
                            .push(HostStall { ended: now, length });
                    }
                    last = now;
                }
            })
        };
        Self {
            stop,
            seen,
            thread: Some(thread),
        }
    }

    /// The stalls that overlapped `from..=to`.
    pub fn between(&self, from: Instant, to: Instant) -> Vec<HostStall> {
        self.seen
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .iter()
            .filter(|s| {
                s.ended >= from
                    && s.ended
                        .checked_sub(s.length)
                        .is_none_or(|start| start <= to)
            })
            .copied()
            .collect()
    }
}

impl Drop for HostStalls {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Which recorded stalls a window sees (a real stall of the host cannot
    /// be made on demand; the faults test prints what the watch saw).
    #[test]
    fn the_window_keeps_only_overlapping_stalls() {
        let watch = HostStalls::watch(Duration::from_secs(3600));
        let t0 = Instant::now();
        {
            let mut seen = watch.seen.lock().unwrap();
            seen.push(HostStall {
                ended: t0 + Duration::from_millis(100),
                length: Duration::from_millis(50),
            });
            seen.push(HostStall {
                ended: t0 + Duration::from_millis(500),
                length: Duration::from_millis(50),
            });
        }
        let window = |a: u64, b: u64| {
            watch
                .between(t0 + Duration::from_millis(a), t0 + Duration::from_millis(b))
                .len()
        };
        assert_eq!(window(0, 1000), 2);
        // Ends inside the window, or started before its end.
        assert_eq!(window(60, 70), 1);
        assert_eq!(window(101, 449), 0);
        assert_eq!(window(460, 470), 1);
        assert_eq!(window(501, 900), 0);
    }
}
