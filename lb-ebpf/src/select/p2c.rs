//! Power of two choices over `cost × (inflight + 1)^bias`, where `cost` is
//! the control plane's Peak-EWMA latency per unit of weight and `inflight`
//! the live in-kernel count, with two additions for the tail:
//!
//! - **Stall age.** While a backend has flows in flight, the time since its
//!   last progress (`crate::progress`) is a lower bound on the age of its
//!   oldest unanswered request. When that age exceeds the EWMA (and at least
//!   `STALL_FLOOR_NS`), the cost is scaled by `age / max(ewma, floor)`: a
//!   paused server's cost climbs while it is stuck, instead of waiting for a
//!   latency sample it cannot produce.
//! - **Bounded re-draws** (Finagle's maxEffort). A candidate whose cost is
//!   more than `REDRAW_FACTOR` × the VIP's median cost (written by the
//!   control plane) is "far above the pool": it loses to any candidate
//!   within that bound, whatever their in-flight counts, and if a pair's
//!   winner is still far above, up to `MAX_REDRAWS` more pairs are drawn.
//!   With 2 slow backends of 10, both draws of a pair are slow 2.2 % of the
//!   time; after two re-draws, 0.001 %. The in-flight term still balances
//!   among the backends within the bound.
use core::num::NonZeroU32;

use lb_common::{VipMeta, reason};

use super::{
    Chosen, by_id, candidate,
    load::{inflight, saturating_mul, score},
    scan, tables,
};
use crate::{Reason, now, progress, random};

/// Rounds of two draws before falling back to a scan.
const ROUNDS: u32 = 4;
/// `inflight_bias` used when the VIP leaves it 0, and its allowed range.
const DEFAULT_INFLIGHT_BIAS: u8 = 2;
const MAX_INFLIGHT_BIAS: u8 = 3;
/// A pick costing more than this many times the VIP's median is redrawn.
const REDRAW_FACTOR: u64 = 3;
/// Extra pairs drawn at most for one new flow.
const MAX_REDRAWS: u32 = 2;
/// A gap without progress shorter than this is ordinary queueing, not a
/// stall, whatever the EWMA says.
const STALL_FLOOR_NS: u64 = 10_000_000;

/// A candidate with its cost (latency per weight, stall-adjusted) and
/// score. Only the id: the address is looked up once, for the winner,
/// which keeps these off the program's 512-byte stack.
#[derive(Clone, Copy)]
struct Pick {
    id: u32,
    cost: u64,
    score: u64,
}

#[inline(always)]
pub fn select(vip: &VipMeta, count: NonZeroU32) -> Result<Chosen, Reason> {
    let bias = match vip.inflight_bias {
        0 => DEFAULT_INFLIGHT_BIAS,
        b => b.min(MAX_INFLIGHT_BIAS),
    };
    let Some(others) = NonZeroU32::new(count.get() - 1) else {
        return candidate(vip.vip_id, 0).ok_or(reason::DROP_NO_BACKEND);
    };
    let now = now();
    // 0 (no reference yet) disables re-draws.
    let bound = saturating_mul(tables(vip.vip_id).reference_cost, REDRAW_FACTOR);
    let mut best = None;
    for _ in 0..ROUNDS {
        best = pair(vip.vip_id, count, others, bias, now, bound);
        if best.is_some() {
            break;
        }
    }
    let Some(mut best) = best else {
        // Every draw hit an out-of-service backend: scan from a random slot,
        // so a VIP with few backends in service among many is still served.
        return scan(vip.vip_id, u64::from(random()), count);
    };
    for _ in 0..MAX_REDRAWS {
        if !best.far_above(bound) {
            break;
        }
        if let Some(other) = pair(vip.vip_id, count, others, bias, now, bound)
            && other.beats(&best, bound)
        {
            best = other;
        }
    }
    match by_id(best.id) {
        Some(chosen) => Ok(chosen),
        None => scan(vip.vip_id, u64::from(random()), count),
    }
}

impl Pick {
    /// Whether the cost exceeds the re-draw bound (never when it is 0).
    #[inline(always)]
    fn far_above(&self, bound: u64) -> bool {
        bound != 0 && self.cost > bound
    }

    /// A candidate within the bound beats one far above it whatever their
    /// in-flight counts; otherwise the lower score wins.
    #[inline(always)]
    fn beats(&self, other: &Pick, bound: u64) -> bool {
        match (self.far_above(bound), other.far_above(bound)) {
            (false, true) => true,
            (true, false) => false,
            _ => self.score < other.score,
        }
    }
}

/// The better of two distinct random slots, `None` if both are out of service.
#[inline(always)]
fn pair(
    vip_id: u32,
    count: NonZeroU32,
    others: NonZeroU32,
    bias: u8,
    now: u64,
    bound: u64,
) -> Option<Pick> {
    let first = random() % count;
    // Draw among the other count-1 slots and skip over the first, so the
    // two are distinct without a retry loop.
    let mut second = random() % others;
    if second >= first {
        second += 1;
    }
    let a = candidate(vip_id, first).map(|c| pick(c.id, bias, now));
    let b = candidate(vip_id, second).map(|c| pick(c.id, bias, now));
    match (a, b) {
        (Some(a), Some(b)) => Some(if b.beats(&a, bound) { b } else { a }),
        (Some(only), None) | (None, Some(only)) => Some(only),
        (None, None) => None,
    }
}

/// Scores backend `id`: `cost × (inflight + 1)^bias`, saturating, with the
/// stall age folded into `cost`. A cost of 0 (no score written yet) counts
/// as 1, so the in-flight term still spreads a burst of flows.
#[inline(always)]
fn pick(id: u32, bias: u8, now: u64) -> Pick {
    let s = score(id);
    let mut cost = s.cost.max(1);
    let open = inflight(id);
    if open > 0 {
        let since = progress::last(id);
        let age = now.saturating_sub(since);
        let threshold = s.ewma_ns.max(STALL_FLOOR_NS);
        if since != 0 && age > threshold {
            cost = saturating_mul(cost, age) / threshold;
        }
    }
    let factor = open.saturating_add(1);
    let mut total = cost;
    for _ in 0..bias {
        total = saturating_mul(total, factor);
    }
    Pick {
        id,
        cost,
        score: total,
    }
}
