//! Power of two choices over `cost × (inflight + 1)^bias`, with the stall
//! age and bounded re-draws. The decision arithmetic is `lb_common::p2c`
//! (pure, host-tested); this module feeds it the kernel's inputs: random
//! slots, the control plane's scores, the live in-flight counts and the
//! progress timestamps.
//!
//! A block of at most the VIP's `p2c_full_scan` slots is scanned whole
//! instead (`p2c::scans_all`): every backend is a candidate, folded with the
//! same [`p2c::winner`] rule, under `bpf_loop` so the verifier checks the
//! body once. The scan starts at a random slot, so equal scores are shared
//! out at random rather than always won by the first slot.
use core::ffi::c_void;

use aya_ebpf::helpers::generated::bpf_loop;
use lb_common::{
    MAX_BACKENDS_PER_VIP, Reason,
    p2c::{self, Candidate, Load},
    reason,
};

use super::{
    load::{inflight, score},
    slots::{Block, Chosen, by_id, candidate, scan},
};
use crate::{
    helpers::random,
    maps::{P2C_SCAN_BEST, ScanBest},
    progress,
};

/// P2C inside `block` at `now`, the re-draw bound from the block's
/// reference cost; `inflight_bias` is the VIP's (`VipMeta::inflight_bias`).
#[inline(always)]
pub fn select(
    block: &Block,
    inflight_bias: u8,
    full_scan: u16,
    now: u64,
) -> Result<Chosen, Reason> {
    let bias = p2c::inflight_bias(inflight_bias);
    let Some(slots) = p2c::Slots::new(block.count) else {
        return candidate(block.vip_id, block.first_slot).ok_or(reason::DROP_NO_BACKEND);
    };
    let bound = p2c::redraw_bound(block.reference_cost);
    if p2c::scans_all(block.count, full_scan) {
        return best_of_all(block, bias, now, bound);
    }
    // Inlined like the rest of the pick (an outlined closure would be a
    // BPF call taking a pointer to this stack frame).
    let draw_pair = #[inline(always)]
    || pair(block, slots, bias, now, bound);
    let best = p2c::choose(bound, draw_pair);
    // None: every draw hit an out-of-service backend. Scan from a random
    // slot, so a VIP with few backends in service among many is still served.
    match best.and_then(|best| by_id(best.id)) {
        Some(chosen) => Ok(chosen),
        None => scan(block, u64::from(random())),
    }
}

// `visit` masks the bias with 3.
const _: () = assert!(lb_common::MAX_INFLIGHT_BIAS <= 3);

/// The state of [`best_of_all`], shared with its `bpf_loop` callback. The
/// best so far lives in the per-CPU [`P2C_SCAN_BEST`] entry, not here: the
/// verifier checks a `bpf_loop` body as a loop, iterating until its state
/// repeats, and a best score kept on the stack is a value it tracks (with
/// the ranges each path through the scoring leaves), so the states never
/// repeated and the program passed the 1M-instruction limit. Values loaded
/// from a map are unknown to it, so the body converges at once.
#[repr(C)]
struct FullScan {
    now: u64,
    bound: u64,
    best: *mut ScanBest,
    vip_id: u32,
    first_slot: u32,
    count: u32,
    /// The block offset the scan starts at (< count).
    start: u32,
    bias: u32,
}

/// The best candidate of every slot of `block` (d = n choices).
#[inline(always)]
fn best_of_all(block: &Block, bias: u8, now: u64, bound: u64) -> Result<Chosen, Reason> {
    let Some(best) = P2C_SCAN_BEST.get_ptr_mut(0) else {
        return scan(block, u64::from(random()));
    };
    // SAFETY: a live per-CPU value; XDP runs one program per CPU at a time.
    unsafe {
        (*best).id = u32::MAX;
        (*best).rank = u64::MAX;
    }
    let count = block.count.get().min(MAX_BACKENDS_PER_VIP);
    let mut state = FullScan {
        now,
        bound,
        best,
        vip_id: block.vip_id,
        first_slot: block.first_slot,
        count,
        start: random() % block.count,
        bias: u32::from(bias),
    };
    // SAFETY: `visit` has the callback signature bpf_loop expects and only
    // touches `state` and the per-CPU value, which outlive the call.
    unsafe {
        bpf_loop(
            count,
            visit as *mut c_void,
            (&raw mut state).cast::<c_void>(),
            0,
        )
    };
    // SAFETY: as above.
    let id = unsafe { (*best).id };
    match by_id(id) {
        Some(chosen) => Ok(chosen),
        None => scan(block, u64::from(random())),
    }
}

/// One slot of [`best_of_all`]; returns 0 to go on.
extern "C" fn visit(step: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: bpf_loop passes back the pointer `best_of_all` gave it.
    let s = unsafe { &mut *ctx.cast::<FullScan>() };
    // start < count and step < count: one subtraction wraps the offset.
    let mut offset = s.start.wrapping_add(step as u32);
    if offset >= s.count {
        offset = offset.wrapping_sub(s.count);
    }
    let Some(c) = candidate(s.vip_id, s.first_slot.wrapping_add(offset)) else {
        return 0;
    };
    // Masked, so the verifier knows the in-flight term's loop runs at most
    // 3 times (the field alone could hold any u32).
    let bias = (s.bias & 3) as u8;
    let rank = p2c::rank(&scored(c.id, bias, s.now), s.bound);
    // SAFETY: the per-CPU value `best_of_all` looked up.
    unsafe {
        // Strictly lower: a tie keeps the earlier slot of this scan, whose
        // start was random.
        if rank < (*s.best).rank {
            (*s.best).rank = rank;
            (*s.best).id = c.id;
        }
    }
    0
}

/// The winner of two distinct random slots of `block`, `None` if both are
/// out of service.
#[inline(always)]
fn pair(block: &Block, slots: p2c::Slots, bias: u8, now: u64, bound: u64) -> Option<Candidate> {
    let (first, second) = slots.gen_pair(random(), random());
    let (first, second) = (
        block.first_slot.wrapping_add(first),
        block.first_slot.wrapping_add(second),
    );
    let a = candidate(block.vip_id, first).map(|c| scored(c.id, bias, now));
    let b = candidate(block.vip_id, second).map(|c| scored(c.id, bias, now));
    p2c::winner(a, b, bound)
}

/// Backend `id` scored from its map values.
#[inline(always)]
fn scored(id: u32, bias: u8, now: u64) -> Candidate {
    let s = score(id);
    let inflight = inflight(id);
    let load = Load {
        cost: s.cost,
        ewma_ns: s.ewma_ns,
        inflight,
        // Only counts while flows are in flight: no lookup otherwise.
        last_progress_ns: if inflight > 0 { progress::last(id) } else { 0 },
    };
    p2c::candidate(id, load, bias, now)
}
