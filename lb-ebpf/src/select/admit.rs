//! The new-flow rate cap: a token bucket per CPU (like Katran's cap on LRU
//! inserts). Flows beyond the cap are refused before they touch the flow
//! table, so a SYN flood cannot evict established flows faster than the
//! configured rate.
use lb_common::{Reason, reason};

use crate::maps::{NEW_FLOW_BUCKETS, NEW_FLOW_LIMIT};

/// One flow's worth of tokens (tokens are kept × 10^9).
const TOKEN: u64 = 1_000_000_000;
/// Refill is computed over at most this long, which keeps
/// `elapsed × rate` inside a u64 for any u32 rate.
const MAX_REFILL_NS: u64 = 1_000_000_000;

/// Takes a token for a new flow, or refuses it.
#[inline(always)]
pub fn admit(now: u64) -> Result<(), Reason> {
    let Some(limit) = NEW_FLOW_LIMIT.get(0) else {
        return Ok(());
    };
    if limit.rate_per_cpu == 0 {
        return Ok(());
    }
    let Some(bucket) = NEW_FLOW_BUCKETS.get_ptr_mut(0) else {
        return Ok(());
    };
    // SAFETY: this CPU's own value; XDP runs with preemption disabled.
    let bucket = unsafe { &mut *bucket };
    let elapsed = now.saturating_sub(bucket.last_ns).min(MAX_REFILL_NS);
    let depth = u64::from(limit.burst.max(1)) * TOKEN;
    let tokens = bucket
        .nano_tokens
        .saturating_add(elapsed * u64::from(limit.rate_per_cpu))
        .min(depth);
    bucket.last_ns = now;
    if tokens < TOKEN {
        bucket.nano_tokens = tokens;
        return Err(reason::DROP_NEW_FLOW_RATE);
    }
    bucket.nano_tokens = tokens - TOKEN;
    Ok(())
}
