//! Per-backend progress timestamps (`BACKEND_PROGRESS`,
//! `lb_common::BackendProgress`): when a backend last answered a request
//! and was last sent one. P2C reads them to see a stalled server before
//! its latency samples can, only while a request is outstanding.
//!
//! And the backend's pending requests (`BACKEND_PENDING`,
//! `lb_common::BackendPending`): how many, and how long they have been
//! served in total. Least connections and P2C's full scan break ties
//! between backends with the same count in flight by it: the backend whose
//! requests are further along frees a worker first. (At 85 % load in the
//! `hetero` benchmark, ties broken at random queued a tenth of the
//! requests behind another on a fast backend while a worker elsewhere was
//! about to free; see the README.)
//!
//! Both stamps are plain stores from several CPUs: a race leaves one of
//! two near-equal times, and the stall rule only acts on gaps of at least
//! `lb_common::p2c::STALL_FLOOR_NS`.
use lb_common::{BackendPending, BackendProgress};

use crate::{
    atomic::add_u64,
    maps::{BACKEND_PENDING, BACKEND_PROGRESS},
};

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
    stamp_request(id, now, false);
}

/// A client of backend `id` sent more at `now` while its request waits
/// (at most once a flow's refresh check): one-way traffic caps the
/// backend's stall age (`BackendProgress::clock_while_sending`,
/// `lb_common::p2c::STALL_AGE_CAP_NS`). The read and the write race an
/// answer on another CPU as the stamps do (module documentation): at
/// worst a backend just answered looks stalled 10 s until its next answer.
#[inline(always)]
pub fn still_sending(id: u32, now: u64) {
    stamp_request(id, now, true);
}

#[inline(always)]
fn stamp_request(id: u32, now: u64, sending: bool) {
    let Some(p) = BACKEND_PROGRESS.get_ptr_mut(id) else {
        return;
    };
    // SAFETY: as in `answered`.
    unsafe {
        let seen = (&raw const *p).read_volatile();
        let clock = if sending {
            seen.clock_while_sending(now)
        } else {
            seen.clock_on_request(now)
        };
        if clock != seen.answered_ns {
            (&raw mut (*p).answered_ns).write_volatile(clock);
        }
        (&raw mut (*p).requested_ns).write_volatile(now);
    }
}

/// Backend `id`'s stamps (all zero: never used).
#[inline(always)]
pub fn of(id: u32) -> BackendProgress {
    BACKEND_PROGRESS.get(id).copied().unwrap_or_default()
}

/// A request to backend `id` started at `started_ns`: counted pending.
#[inline(always)]
pub fn request_started(id: u32, started_ns: u64) {
    if let Some(p) = BACKEND_PENDING.get_ptr_mut(id) {
        // SAFETY: live, 8-byte aligned map value; every writer is atomic.
        unsafe {
            add_u64(&raw mut (*p).requests, 1);
            add_u64(&raw mut (*p).started_sum_ns, started_ns);
        }
    }
}

/// The request to backend `id` that started at `started_ns` was answered
/// or its connection closed: no longer pending (wrapping adds of −1 and
/// −start).
#[inline(always)]
pub fn request_ended(id: u32, started_ns: u64) {
    if let Some(p) = BACKEND_PENDING.get_ptr_mut(id) {
        // SAFETY: as in `request_started`.
        unsafe {
            add_u64(&raw mut (*p).requests, u64::MAX);
            add_u64(&raw mut (*p).started_sum_ns, started_ns.wrapping_neg());
        }
    }
}

/// How long backend `id`'s pending requests have been served in total at
/// `now` (`BackendPending::served_ns`).
#[inline(always)]
pub fn served_ns(id: u32, now: u64) -> u64 {
    BACKEND_PENDING
        .get(id)
        .copied()
        .unwrap_or(BackendPending::default())
        .served_ns(now)
}
