//! Per-backend progress timestamps (`BACKEND_PROGRESS`, see lb-common):
//! refreshed when a backend answers a request, or takes a connection while
//! it has none open. P2C reads them to see a stalled server before its
//! latency samples can.
use crate::maps::{BACKEND_CONNS, BACKEND_CORRECTION, BACKEND_PROGRESS};

/// Backend `id` answered a request at `now`.
#[inline(always)]
pub fn answered(id: u32, now: u64) {
    store(id, now);
}

/// Backend `id` got a connection at `now`; `opened_before` is its `opened`
/// counter before this one. From idle, the clock of its oldest unanswered
/// request starts now.
#[inline(always)]
pub fn connected(id: u32, opened_before: u64, now: u64) {
    let closed = BACKEND_CONNS.get(id).map_or(0, |c| c.closed);
    let correction = BACKEND_CORRECTION.get(id).copied().unwrap_or(0);
    if opened_before <= closed.saturating_add(correction) {
        store(id, now);
    }
}

/// Time of the backend's last progress (0 = none recorded).
#[inline(always)]
pub fn last(id: u32) -> u64 {
    BACKEND_PROGRESS.get(id).copied().unwrap_or(0)
}

#[inline(always)]
fn store(id: u32, now: u64) {
    if let Some(slot) = BACKEND_PROGRESS.get_ptr_mut(id) {
        // SAFETY: live, aligned map value; racing writers store similar
        // timestamps, and an aligned 8-byte store is not torn.
        unsafe { slot.write_volatile(now) };
    }
}
