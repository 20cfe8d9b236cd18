//! What the estimators' unit tests share: τ, cold start, and comparisons.
use std::time::Duration;

pub const TAU: Duration = Duration::from_secs(10);
pub const COLD: Duration = Duration::from_millis(1);
/// Nanoseconds per millisecond, for estimates in ns.
pub const MS: f64 = 1e6;

/// τ·ln 2: the time after which a sample's weight is one half.
pub fn half_life() -> Duration {
    TAU.mul_f64(std::f64::consts::LN_2)
}

/// Equal within 0.1% (or 0.001 near zero).
pub fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-3 * b.abs().max(1.0)
}
