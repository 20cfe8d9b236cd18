//! A backend's load as the kernel sees it at packet time: the live
//! in-flight count from the atomic counters, and the score inputs the
//! control plane wrote.
use lb_common::BackendScore;

use crate::maps::{BACKEND_CONNS, BACKEND_CORRECTION, BACKEND_SCORES};

/// Connections open to backend `id`: opened - closed (≥ 0), plus the
/// control plane's own (its health checks, `BACKEND_CORRECTION`).
#[inline(always)]
pub fn inflight(id: u32) -> u64 {
    let counters = BACKEND_CONNS.get(id).copied().unwrap_or_default();
    let correction = BACKEND_CORRECTION.get(id).copied().unwrap_or(0);
    counters.inflight(correction)
}

/// The control plane's score for backend `id` (all zero before the first write).
#[inline(always)]
pub fn score(id: u32) -> BackendScore {
    BACKEND_SCORES.get(id).copied().unwrap_or_default()
}

/// Effective weight of backend `id`, at least 1 (0 means no score was
/// written yet). Reads the one field, without copying the score.
#[inline(always)]
pub fn weight(id: u32) -> u64 {
    u64::from(BACKEND_SCORES.get(id).map_or(0, |s| s.weight).max(1))
}
