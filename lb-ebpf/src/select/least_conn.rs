//! Weighted least connections: the slot with the fewest in-flight
//! connections per unit of effective weight. Ties go to the backend whose
//! pending requests have been served longest in total
//! (`progress::served_ns`), which frees a worker first; ties there too
//! (idle backends: nothing pending) are broken uniformly at random
//! (reservoir sampling over the tied slots).
//!
//! The scan runs under `bpf_loop` (kernel ≥ 5.17): the verifier checks the
//! loop body once instead of once per iteration and path, so the scan can
//! cover all `MAX_BACKENDS_PER_VIP` slots. The cost is linear in the
//! block's backend count (the VIP's, or its zone's): about 6 map lookups
//! per slot, per new flow.
use core::{ffi::c_void, num::NonZeroU32};

use aya_ebpf::helpers::generated::bpf_loop;
use lb_common::{MAX_BACKENDS_PER_VIP, Reason, arith::saturating_mul};

use super::{
    load::{inflight, weight},
    slots::{Block, Chosen, candidate, scan},
};
use crate::{helpers::random, maps::LEAST_CONN_SCAN, progress::served_ns};

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
    /// The best slot's pending requests' summed service so far (this
    /// CPU's `LEAST_CONN_SCAN` value).
    best_served: *mut u64,
    now: u64,
}

#[inline(always)]
pub fn select(block: &Block, now: u64) -> Result<Chosen, Reason> {
    let Some(best_served) = LEAST_CONN_SCAN.get_ptr_mut(0) else {
        return scan(block, u64::from(random()));
    };
    // SAFETY: this CPU's own per-CPU value; XDP runs one program per CPU
    // at a time.
    unsafe { *best_served = 0 };
    let mut state = Scan {
        vip_id: block.vip_id,
        first_slot: block.first_slot,
        best_slot: u32::MAX,
        ties: 0,
        best_inflight: 0,
        best_weight: 1,
        best_served,
        now,
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
    let served = served_ns(c.id, state.now);
    // SAFETY: the per-CPU value `select` looked up.
    let best_served = unsafe { &mut *state.best_served };
    if state.best_slot == u32::MAX || lhs < rhs || (lhs == rhs && served > *best_served) {
        state.best_slot = slot;
        state.best_inflight = n;
        state.best_weight = w;
        *best_served = served;
        state.ties = 1;
    } else if lhs == rhs && served == *best_served {
        state.ties = state.ties.saturating_add(1);
        if let Some(ties) = NonZeroU32::new(state.ties)
            && random() % ties == 0
        {
            state.best_slot = slot;
        }
    }
    0
}
