//! The kernel's argument-less helpers every stage may call: the clocks and
//! the random source.
//!
//! The clock is not free: on the 2-vCPU VM of the benchmarks one
//! `bpf_ktime_get_ns` costs about 40 ns, as much as a flow-table lookup,
//! while `bpf_jiffies64`, which the verifier inlines into a load on 64-bit
//! JITs, costs nothing measurable (docs/history/dataplane.md, "Where the time goes"). So
//! packets of established flows
//! read the precise clock only when a stage needs a timestamp (a request,
//! a response to time, a close) or jiffies say the once-a-second refresh
//! may be due: see [`PacketClock`] and `track::refresh_check_due`.
use aya_ebpf::helpers::{bpf_get_prandom_u32, bpf_jiffies64, bpf_ktime_get_ns};

use crate::maps::PACKET_CLOCK;

/// Monotonic time in nanoseconds.
#[inline(always)]
pub fn now() -> u64 {
    // SAFETY: helper without arguments.
    unsafe { bpf_ktime_get_ns() }
}

/// Leaves `now` for the stages after the backend pick of this packet
/// ([`packet_clock`]). XDP runs a program to its end on one CPU without
/// preemption, so the per-CPU slot holds this packet's time from its pick
/// to its end.
#[inline(always)]
pub fn leave_packet_clock(now: u64) {
    if let Some(slot) = PACKET_CLOCK.get_ptr_mut(0) {
        // SAFETY: a live per-CPU value, only touched by this CPU.
        unsafe { *slot = now };
    }
}

/// The time the backend pick of this packet read ([`leave_packet_clock`]).
/// Only the stages after a pick call it (the flow's creation, a take-over's
/// second attempt at it, the new flow's first packet sent on), so the slot
/// holds this packet's time, and every one of them gets the same: a new
/// flow reads the clock once. A fresh read only if the slot is empty (no
/// pick on this CPU yet, which those callers never meet).
#[inline(always)]
pub fn packet_clock() -> u64 {
    if let Some(slot) = PACKET_CLOCK.get_ptr(0) {
        // SAFETY: a live per-CPU value, only touched by this CPU.
        let left = unsafe { *slot };
        if left != 0 {
            return left;
        }
    }
    now()
}

/// The low 32 bits of the kernel's `jiffies` (HZ ticks a second, 100 to
/// 1000): one load, no call.
#[inline(always)]
pub fn jiffies() -> u32 {
    // SAFETY: helper without arguments.
    unsafe { bpf_jiffies64() as u32 }
}

/// A pseudo-random `u32`.
#[inline(always)]
pub fn random() -> u32 {
    // SAFETY: helper without arguments.
    unsafe { bpf_get_prandom_u32() }
}

/// The precise clock of one packet: read at the first [`PacketClock::now`]
/// and not before, so a packet that needs no timestamp makes no call, and
/// one that does reads the clock once.
pub struct PacketClock {
    ns: u64,
    /// A separate flag rather than `ns == 0`: the verifier knows a constant
    /// on the stack on each path, so the paths after the first read do not
    /// fork again on an unknown timestamp.
    read: bool,
}

impl PacketClock {
    #[inline(always)]
    pub const fn new() -> Self {
        Self { ns: 0, read: false }
    }

    /// A clock already read at `ns` (by this packet's backend pick).
    #[inline(always)]
    pub const fn read_at(ns: u64) -> Self {
        Self { ns, read: true }
    }

    #[inline(always)]
    pub fn now(&mut self) -> u64 {
        if !self.read {
            self.ns = now();
            self.read = true;
        }
        self.ns
    }
}
