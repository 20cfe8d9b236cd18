//! Power of two choices over `cost × (inflight + 1)^bias`, with the stall
//! age and bounded re-draws. The decision arithmetic is `lb_common::p2c`
//! (pure, host-tested); this module feeds it the kernel's inputs: random
//! slots, the control plane's scores, the live in-flight counts and the
//! progress timestamps.
use lb_common::{
    Reason,
    p2c::{self, Candidate, Load},
    reason,
};

use super::{
    load::{inflight, score},
    slots::{Block, Chosen, by_id, candidate, scan},
};
use crate::{helpers::random, progress};

/// P2C inside `block` at `now`, the re-draw bound from the block's
/// reference cost; `inflight_bias` is the VIP's (`VipMeta::inflight_bias`).
#[inline(always)]
pub fn select(block: &Block, inflight_bias: u8, now: u64) -> Result<Chosen, Reason> {
    let bias = p2c::inflight_bias(inflight_bias);
    let Some(slots) = p2c::Slots::new(block.count) else {
        return candidate(block.vip_id, block.first_slot).ok_or(reason::DROP_NO_BACKEND);
    };
    let bound = p2c::redraw_bound(block.reference_cost);
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
