//! Power of two choices over `cost × (inflight + 1)^bias`, with the stall
//! age and bounded re-draws. The decision arithmetic is `lb_common::p2c`
//! (pure, host-tested); this module feeds it the kernel's inputs: random
//! slots, the control plane's scores, the live in-flight counts and the
//! progress timestamps.
//!
//! In a block of at most the VIP's `p2c_full_scan` slots
//! (`p2c::scans_all`), every backend is scored under `bpf_loop` (the
//! verifier checks the body once): the winner of a random pair is taken if
//! it is idle and within the bound (`p2c::settles_scan`), else the best
//! `p2c::rank` of the block. Equal ranks are shared out uniformly at random
//! (reservoir sampling over the tied slots): a random start alone gave each
//! tied slot the gap before it, so of two idle backends side by side among
//! eight, the first won seven times in eight.
use core::{ffi::c_void, num::NonZeroU32};

use aya_ebpf::helpers::generated::bpf_loop;
use lb_common::{
    MAX_BACKENDS_PER_VIP, Reason,
    p2c::{self, Candidate, Load},
    reason,
};

use super::{
    load::{inflight, score},
    slots::{Block, Chosen, active_id, by_id, candidate, scan, slot_backend},
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
    saturation: u16,
    now: u64,
) -> Result<Chosen, Reason> {
    let bias = p2c::inflight_bias(inflight_bias);
    let Some(slots) = p2c::Slots::new(block.count) else {
        return candidate(block.vip_id, block.first_slot).ok_or(reason::DROP_NO_BACKEND);
    };
    let scoring = Scoring {
        bias,
        saturation: u32::from(saturation),
        now,
        bound: p2c::redraw_bound(block.reference_cost),
    };
    if p2c::scans_all(block.count, full_scan) {
        return pair_or_best_of_all(block, slots, &scoring);
    }
    // Inlined like the rest of the pick (an outlined closure would be a
    // BPF call taking a pointer to this stack frame).
    let draw_pair = #[inline(always)]
    || pair(block, slots, &scoring);
    let best = p2c::choose(scoring.bound, draw_pair);
    // None: every draw hit an out-of-service backend. Scan from a random
    // slot, so a VIP with few backends in service among many is still served.
    match best.and_then(|best| by_id(best.id)) {
        Some(chosen) => Ok(chosen),
        None => scan(block, u64::from(random())),
    }
}

/// How this pick scores a backend: the VIP's in-flight bias and
/// saturation threshold, the clock, and the re-draw bound of the block.
#[repr(C)]
#[derive(Clone, Copy)]
struct Scoring {
    now: u64,
    bound: u64,
    /// The VIP's `p2c_saturation`.
    saturation: u32,
    bias: u8,
}

impl Scoring {
    /// Backend `id` scored from its map values.
    #[inline(always)]
    fn candidate(&self, id: u32) -> Candidate {
        // Masked, so the verifier knows the in-flight term's loop runs at
        // most 3 times where the value comes back from memory it does not
        // track (a `bpf_loop` callback's state).
        scored(id, self.bias & 3, self.saturation, self.now)
    }
}

// `Scoring::candidate` masks the bias with 3.
const _: () = assert!(lb_common::MAX_INFLIGHT_BIAS <= 3);

/// The state of [`pair_or_best_of_all`], shared with its `bpf_loop`
/// callback. The best so far lives in the per-CPU [`P2C_SCAN_BEST`] entry,
/// not here: the verifier checks a `bpf_loop` body as a loop, iterating
/// until its state repeats, and a best score kept on the stack is a value
/// it tracks (with the ranges each path through the scoring leaves), so
/// the states never repeated and the program passed the 1M-instruction
/// limit. Values loaded from a map are unknown to it, so the body
/// converges at once.
#[repr(C)]
struct FullScan {
    scoring: Scoring,
    best: *mut ScanBest,
    vip_id: u32,
    first_slot: u32,
    count: u32,
    /// The block offset the scan starts at (< count).
    start: u32,
    /// The random pair's block offsets.
    pair: (u32, u32),
}

/// The most slots [`pair_or_best_of_all`] visits (a VIP's whole slot block).
/// No panic path even at compile time: at least one slot.
const MAX_SCAN_SLOTS: NonZeroU32 = NonZeroU32::MIN.saturating_add(MAX_BACKENDS_PER_VIP - 1);
const _: () = assert!(MAX_SCAN_SLOTS.get() == MAX_BACKENDS_PER_VIP);

/// P2C in a block small enough to scan whole (`p2c::scans_all`): the
/// winner of a random pair if it settles the pick (`p2c::settles_scan`:
/// idle and within the bound), else the best [rank](p2c::rank) of every
/// slot (d = n choices). One `bpf_loop` visits every slot and folds both,
/// the pair as two of the slots it visits: a pair drawn before the loop
/// and tested after it took the verifier past 900k instructions (release)
/// and made the debug object copy an undefined register, because every
/// path through the pair's scoring reached the scan as its own state.
#[inline(always)]
fn pair_or_best_of_all(
    block: &Block,
    slots: p2c::Slots,
    scoring: &Scoring,
) -> Result<Chosen, Reason> {
    let Some(best) = P2C_SCAN_BEST.get_ptr_mut(0) else {
        return scan(block, u64::from(random()));
    };
    // SAFETY: a live per-CPU value; XDP runs one program per CPU at a time.
    unsafe { *best = ScanBest::EMPTY };
    // `Block` keeps count within MAX_BACKENDS_PER_VIP; clamped anyway, and
    // the start drawn below the clamped count.
    let count = block.count.min(MAX_SCAN_SLOTS);
    let mut state = FullScan {
        scoring: *scoring,
        best,
        vip_id: block.vip_id,
        first_slot: block.first_slot,
        count: count.get(),
        start: random() % count,
        pair: slots.gen_pair(random(), random()),
    };
    // SAFETY: `visit` has the callback signature bpf_loop expects and only
    // touches `state` and the per-CPU value, which outlive the call.
    unsafe {
        bpf_loop(
            count.get(),
            visit as *mut c_void,
            (&raw mut state).cast::<c_void>(),
            0,
        )
    };
    // SAFETY: as above.
    let found = unsafe { &*best };
    let pair_winner = Candidate {
        id: found.pair_id,
        weight: found.pair_weight,
        cost: found.pair_cost,
        score: found.pair_score,
    };
    // The scan scored slots without their backend's state (the control
    // plane keeps only backends in service in the block; one that left
    // service stays until the block is rewritten), so the one chosen is
    // checked here: an out-of-service pair winner yields to the best rank,
    // and an out-of-service best to a scan from a random slot.
    let settled = found.pair_id != u32::MAX && p2c::settles_scan(&pair_winner, scoring.bound);
    if settled && let Some(chosen) = by_id(found.pair_id) {
        return Ok(chosen);
    }
    match by_id(found.id) {
        Some(chosen) => Ok(chosen),
        None => scan(block, u64::from(random())),
    }
}

/// One slot of [`pair_or_best_of_all`]; returns 0 to go on.
extern "C" fn visit(step: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: bpf_loop passes back the pointer `pair_or_best_of_all` gave it.
    let s = unsafe { &mut *ctx.cast::<FullScan>() };
    // start < count and step < count: one subtraction wraps the offset.
    let mut offset = s.start.wrapping_add(step as u32);
    if offset >= s.count {
        offset = offset.wrapping_sub(s.count);
    }
    let Some(id) = slot_backend(s.vip_id, s.first_slot.wrapping_add(offset)) else {
        return 0;
    };
    let c = s.scoring.candidate(id);
    let rank = p2c::rank(&c, s.scoring.bound);
    // SAFETY: the per-CPU value `pair_or_best_of_all` looked up.
    let best = unsafe { &mut *s.best };
    // A tie goes to the backend whose pending requests are further along
    // (it frees a worker first, see `progress`); a tie there too to one of
    // the tied slots chosen uniformly: the k-th replaces the best with
    // probability 1/k.
    let served = progress::served_ns(id, s.scoring.now);
    if rank < best.rank || (rank == best.rank && served > best.served) {
        best.rank = rank;
        best.id = id;
        best.served = served;
        best.ties = 1;
    } else if rank == best.rank && served == best.served {
        best.ties = best.ties.saturating_add(1);
        if let Some(ties) = NonZeroU32::new(best.ties)
            && random() % ties == 0
        {
            best.id = id;
        }
    }
    if offset == s.pair.0 || offset == s.pair.1 {
        let held = Candidate {
            id: best.pair_id,
            weight: best.pair_weight,
            cost: best.pair_cost,
            score: best.pair_score,
        };
        // The pair's first visited is `p2c::winner`'s first: a tie keeps it.
        if best.pair_id == u32::MAX || c.beats(&held, s.scoring.bound) {
            best.pair_id = id;
            best.pair_weight = c.weight;
            best.pair_cost = c.cost;
            best.pair_score = c.score;
        }
    }
    0
}

/// The winner of two distinct random slots of `block`, `None` if both are
/// out of service.
#[inline(always)]
fn pair(block: &Block, slots: p2c::Slots, scoring: &Scoring) -> Option<Candidate> {
    let (first, second) = slots.gen_pair(random(), random());
    let (first, second) = (
        block.first_slot.wrapping_add(first),
        block.first_slot.wrapping_add(second),
    );
    // Matches, not `Option::map`: the debug build keeps `map` as a call
    // returning `Option<Candidate>` by value, an aggregate return the BPF
    // backend refuses.
    let a = match active_id(block.vip_id, first) {
        Some(id) => Some(scoring.candidate(id)),
        None => None,
    };
    let b = match active_id(block.vip_id, second) {
        Some(id) => Some(scoring.candidate(id)),
        None => None,
    };
    p2c::winner(a, b, scoring.bound)
}

/// Backend `id` scored from its map values.
#[inline(always)]
fn scored(id: u32, bias: u8, saturation: u32, now: u64) -> Candidate {
    let s = score(id);
    let inflight = inflight(id);
    let load = Load {
        cost: s.cost,
        ewma_ns: s.ewma_ns,
        weight: s.weight,
        inflight,
        // Only counts while a request is outstanding, which needs a flow
        // in flight: no lookup otherwise.
        last_progress_ns: if inflight > 0 {
            progress::of(id).stall_clock()
        } else {
            0
        },
        held: s.flags,
        saturation: u64::from(saturation),
    };
    p2c::candidate(id, load, bias, now)
}
