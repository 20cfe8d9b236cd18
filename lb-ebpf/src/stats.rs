//! Per-CPU counters: one per verdict reason, and traffic per backend.
//!
//! Per-CPU maps need no atomics: XDP runs with preemption disabled, so a
//! plain read-modify-write on this CPU's copy cannot lose an update.
use lb_common::{BackendStats, Reason, Verdict};

use crate::maps::{BACKEND_STATS, REASON_STATS};

/// Counts the packet's verdict under its reason, and returns its action.
#[inline(always)]
pub fn finish(verdict: Verdict) -> u32 {
    count(verdict.reason);
    verdict.action
}

/// Counts one event under `reason` (a `lb_common::reason` index).
#[inline(always)]
pub fn count(reason: Reason) {
    if let Some(counter) = REASON_STATS.get_ptr_mut(reason) {
        // SAFETY: a valid per-CPU map value, only touched by this CPU.
        unsafe { *counter += 1 };
    }
}

/// Which way a packet of a balanced flow travels.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    ToBackend,
    FromBackend,
}

/// Adds one packet of `bytes` to the backend's traffic counters.
#[inline(always)]
pub fn backend_traffic(backend_id: u32, direction: Direction, bytes: u32) {
    let Some(stats) = BACKEND_STATS.get_ptr_mut(backend_id) else {
        return;
    };
    // SAFETY: a valid per-CPU map value, only touched by this CPU.
    let stats: &mut BackendStats = unsafe { &mut *stats };
    match direction {
        Direction::ToBackend => {
            stats.packets_to_backend += 1;
            stats.bytes_to_backend += u64::from(bytes);
        }
        Direction::FromBackend => {
            stats.packets_from_backend += 1;
            stats.bytes_from_backend += u64::from(bytes);
        }
    }
}
