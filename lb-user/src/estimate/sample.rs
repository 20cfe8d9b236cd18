//! What the kernel measured for a backend in one score tick (or one
//! response): the input of [`crate::estimate::latency`] and
//! [`crate::estimate::refute`].

use std::time::Duration;

/// What one refresh interval measured for a backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LatencySample {
    pub mean: Duration,
    pub peak: Duration,
    /// Responses measured (a tick's count; 1 for a single response). 0: a
    /// peak alone, whose response an earlier tick counted (a sample that
    /// raced the kernel's epoch change, see [`crate::ingest::latency`]);
    /// it feeds the peak memory only.
    pub count: u64,
}

impl LatencySample {
    /// One response's latency.
    pub fn single(latency: Duration) -> Self {
        Self {
            mean: latency,
            peak: latency,
            count: 1,
        }
    }

    /// The same latencies, measured over `count` responses.
    pub fn counted(self, count: u64) -> Self {
        Self { count, ..self }
    }
}
