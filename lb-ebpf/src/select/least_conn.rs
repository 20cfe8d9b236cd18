//! Weighted least connections: the slot with the fewest in-flight
//! connections per unit of effective weight, ties broken uniformly at
//! random (reservoir sampling over the tied slots).
//!
//! The scan runs under `bpf_loop` (kernel ≥ 5.17): the verifier checks the
//! loop body once instead of once per iteration and path, so the scan can
//! cover all `MAX_BACKENDS_PER_VIP` slots. The cost is linear in the
//! block's backend count (the VIP's, or its zone's): about 5 map lookups
//! per slot, per new flow.
use core::{ffi::c_void, num::NonZeroU32};

use aya_ebpf::helpers::generated::bpf_loop;
use lb_common::{MAX_BACKENDS_PER_VIP, Reason, arith::saturating_mul};

use super::{
    load::{inflight, weight},
    slots::{Block, Chosen, candidate, scan},
};
use crate::helpers::random;

/// The scan's state, shared with the `bpf_loop` callback.
#[repr(C)]
struct Scan {
    vip_id: u32,
    /// The block's first slot (absolute); the loop visits offsets from it.
    first_slot: u32,
    /// Best slot so far (absolute); `u32::MAX` while none is in service.
    best_slot: u32,
    /// How many slots share the best ratio (the reservoir size).
    ties: u32,
    /// The best ratio as the fraction `best_inflight / best_weight`.
    best_inflight: u64,
    best_weight: u64,
}

#[inline(always)]
pub fn select(block: &Block) -> Result<Chosen, Reason> {
    let mut state = Scan {
        vip_id: block.vip_id,
        first_slot: block.first_slot,
        best_slot: u32::MAX,
        ties: 0,
        best_inflight: 0,
        best_weight: 1,
    };
    let count = block.count.get().min(MAX_BACKENDS_PER_VIP);
    // SAFETY: `visit` has the callback signature bpf_loop expects and only
    // touches `state`, which outlives the call.
    unsafe {
        bpf_loop(
            count,
            visit as *mut c_void,
            (&raw mut state).cast::<c_void>(),
            0,
        )
    };
    match candidate(block.vip_id, state.best_slot) {
        Some(chosen) => Ok(chosen),
        None => scan(block, u64::from(random())),
    }
}

/// One slot of the scan; returns 0 to go on.
extern "C" fn visit(slot: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: bpf_loop passes back the pointer `select` gave it.
    let state = unsafe { &mut *ctx.cast::<Scan>() };
    let slot = state.first_slot.wrapping_add(slot as u32);
    let Some(c) = candidate(state.vip_id, slot) else {
        return 0;
    };
    let (n, w) = (inflight(c.id), weight(c.id));
    // Compare n / w with best_inflight / best_weight without dividing.
    let lhs = saturating_mul(n, state.best_weight);
    let rhs = saturating_mul(state.best_inflight, w);
    if state.best_slot == u32::MAX || lhs < rhs {
        state.best_slot = slot;
        state.best_inflight = n;
        state.best_weight = w;
        state.ties = 1;
    } else if lhs == rhs {
        state.ties = state.ties.saturating_add(1);
        if let Some(ties) = NonZeroU32::new(state.ties)
            && random() % ties == 0
        {
            state.best_slot = slot;
        }
    }
    0
}
