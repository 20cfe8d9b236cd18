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
//! them ([`Flags`]).
use core::intrinsics::{AtomicOrdering, atomic_and, atomic_or, atomic_xadd};
use core::{arch::asm, mem::offset_of};

use lb_common::FlowEntry;

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

// `Flags` updates `flags` through the 64-bit word it shares with
// `checked_jiffies`.
const _: () = {
    assert!(offset_of!(FlowEntry, flags) % 8 == 0);
    assert!(offset_of!(FlowEntry, checked_jiffies) == offset_of!(FlowEntry, flags) + 4);
};

/// Atomic access to the `u32` flags of a live flow entry. BPF CPU v1 has
/// only 64-bit atomics, so the bits are set and cleared in the aligned word
/// made of `flags` and `checked_jiffies`, whose bits the updates leave as
/// they are (`track::refresh_check_due` stores it plainly).
#[derive(Clone, Copy)]
pub struct Flags(*mut u64);

impl Flags {
    #[inline(always)]
    pub fn of(fwd: *mut FlowEntry) -> Self {
        // SAFETY: only computes the field address.
        Self(unsafe { (&raw mut (*fwd).flags).cast::<u64>() })
    }

    /// Position of `flags` inside the word.
    #[inline(always)]
    const fn widen(bits: u32) -> u64 {
        if cfg!(target_endian = "little") {
            bits as u64
        } else {
            (bits as u64) << 32
        }
    }

    #[inline(always)]
    const fn narrow(word: u64) -> u32 {
        if cfg!(target_endian = "little") {
            word as u32
        } else {
            (word >> 32) as u32
        }
    }

    /// A plain load, for cheap checks before an atomic update.
    #[inline(always)]
    pub fn get(self) -> u32 {
        // SAFETY: aligned word inside a live map value (RCU keeps it alive
        // for the whole program run); aligned loads are single instructions.
        Self::narrow(unsafe { self.0.read_volatile() })
    }

    /// Sets `bits`, returning the flags from before.
    #[inline(always)]
    pub fn set(self, bits: u32) -> u32 {
        // SAFETY: as in `get`.
        Self::narrow(unsafe { fetch_or_u64(self.0, Self::widen(bits)) })
    }

    /// Clears `bits`, returning the flags from before.
    #[inline(always)]
    pub fn clear(self, bits: u32) -> u32 {
        // SAFETY: as in `get`.
        Self::narrow(unsafe { fetch_and_u64(self.0, !Self::widen(bits)) })
    }
}
