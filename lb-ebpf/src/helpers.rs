//! The kernel's argument-less helpers every stage may call: the clock and
//! the random source.
use aya_ebpf::helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns};

/// Monotonic time in nanoseconds.
#[inline(always)]
pub fn now() -> u64 {
    // SAFETY: helper without arguments.
    unsafe { bpf_ktime_get_ns() }
}

/// A pseudo-random `u32`.
#[inline(always)]
pub fn random() -> u32 {
    // SAFETY: helper without arguments.
    unsafe { bpf_get_prandom_u32() }
}
