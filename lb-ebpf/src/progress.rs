//! Per-backend progress timestamps (`BACKEND_PROGRESS`,
//! `lb_common::BackendProgress`): when a backend last answered a request
//! and was last sent one. P2C reads them to see a stalled server before
//! its latency samples can, only while a request is outstanding.
//!
//! Both stamps are plain stores from several CPUs: a race leaves one of
//! two near-equal times, and the stall rule only acts on gaps of at least
//! `lb_common::p2c::STALL_FLOOR_NS`.
use lb_common::BackendProgress;

use crate::maps::BACKEND_PROGRESS;

/// Backend `id` answered a request at `now`.
#[inline(always)]
pub fn answered(id: u32, now: u64) {
    if let Some(p) = BACKEND_PROGRESS.get_ptr_mut(id) {
        // SAFETY: live, aligned map value; an aligned 8-byte store is not
        // torn (see the module documentation for races).
        unsafe { (&raw mut (*p).answered_ns).write_volatile(now) };
    }
}

/// Backend `id` was sent a request at `now`. If none was outstanding, the
/// clock of the oldest unanswered request starts now: an answer stamped
/// long ago (before a quiet spell) is not a stall.
#[inline(always)]
pub fn requested(id: u32, now: u64) {
    let Some(p) = BACKEND_PROGRESS.get_ptr_mut(id) else {
        return;
    };
    // SAFETY: as in `answered`.
    unsafe {
        let seen = (&raw const *p).read_volatile();
        if !seen.awaiting() {
            (&raw mut (*p).answered_ns).write_volatile(now);
        }
        (&raw mut (*p).requested_ns).write_volatile(now);
    }
}

/// Backend `id`'s stamps (all zero: never used).
#[inline(always)]
pub fn of(id: u32) -> BackendProgress {
    BACKEND_PROGRESS.get(id).copied().unwrap_or_default()
}
