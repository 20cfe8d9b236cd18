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
/// ([`take_packet_clock`]). XDP runs a program to its end on one CPU
/// without preemption, so the per-CPU slot holds this packet's time until
/// it is taken.
#[inline(always)]
pub fn leave_packet_clock(now: u64) {
    if let Some(slot) = PACKET_CLOCK.get_ptr_mut(0) {
        // SAFETY: a live per-CPU value, only touched by this CPU.
        unsafe { *slot = now };
    }
}

/// The time the backend pick of this packet read ([`leave_packet_clock`]),
/// and the slot emptied; a fresh read if it is empty (a path that did not
/// pick, or a second taker).
#[inline(always)]
pub fn take_packet_clock() -> u64 {
    if let Some(slot) = PACKET_CLOCK.get_ptr_mut(0) {
        // SAFETY: a live per-CPU value, only touched by this CPU.
        let left = unsafe { core::mem::replace(&mut *slot, 0) };
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

    #[inline(always)]
    pub fn now(&mut self) -> u64 {
        if !self.read {
            self.ns = now();
            self.read = true;
        }
        self.ns
    }
}
