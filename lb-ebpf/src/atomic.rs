//! Atomic read-modify-writes on map values.
//!
//! `core::sync::atomic` is no help here: the `bpfel-unknown-none` target
//! declares `atomic-cas: false` and a minimum atomic width of 64 bits, so
//! `AtomicU64` has no `fetch_*` methods and `AtomicU32` does not exist. The
//! compiler intrinsics below become single `BPF_ATOMIC` instructions
//! (`lock add`, `fetch_add`, `fetch_or`, `fetch_and`; kernel ≥ 5.12), which
//! is what the `fetch_*` methods would have lowered to anyway.
//!
//! The linker targets BPF CPU v1 (`--cpu generic`), which has 64-bit atomics
//! only: 32-bit fields are updated through the aligned 64-bit word holding
//! them (see `track::Flags`).
use core::arch::asm;
use core::intrinsics::{AtomicOrdering, atomic_and, atomic_or, atomic_xadd};

/// `*ptr += value`, returning the old value.
///
/// # Safety
/// `ptr` must point at a live, 8-byte aligned map value.
#[inline(always)]
pub unsafe fn fetch_add_u64(ptr: *mut u64, value: u64) -> u64 {
    let mut old = value;
    // LLVM selects the legacy `lock xadd` for a 64-bit atomic add on CPU v1
    // and then refuses to use its result ("Invalid usage of the XADD return
    // value"), so the fetching form is written out.
    unsafe {
        asm!(
            "{old} = atomic_fetch_add((u64 *)({ptr} + 0), {old})",
            ptr = in(reg) ptr,
            old = inout(reg) old,
            options(nostack),
        );
    }
    old
}

/// `*ptr += value` without reading the result (`lock xadd`).
///
/// # Safety
/// `ptr` must point at a live, 8-byte aligned map value.
#[inline(always)]
pub unsafe fn add_u64(ptr: *mut u64, value: u64) {
    unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::SeqCst }>(ptr, value) };
}

/// `*ptr |= bits`, returning the old value.
///
/// # Safety
/// `ptr` must point at a live, 8-byte aligned map value.
#[inline(always)]
pub unsafe fn fetch_or_u64(ptr: *mut u64, bits: u64) -> u64 {
    unsafe { atomic_or::<u64, u64, { AtomicOrdering::SeqCst }>(ptr, bits) }
}

/// `*ptr &= mask`, returning the old value.
///
/// # Safety
/// `ptr` must point at a live, 8-byte aligned map value.
#[inline(always)]
pub unsafe fn fetch_and_u64(ptr: *mut u64, mask: u64) -> u64 {
    unsafe { atomic_and::<u64, u64, { AtomicOrdering::SeqCst }>(ptr, mask) }
}
