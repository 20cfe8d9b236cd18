//! Power of two choices over `cost × (inflight + 1)^bias`, where `cost` is
//! the control plane's Peak-EWMA latency per unit of weight and `inflight`
//! the live in-kernel count.
use core::num::NonZeroU32;

use lb_common::VipMeta;

use super::{
    Chosen, candidate,
    load::{inflight, saturating_mul, score},
    scan,
};
use crate::{Reason, random};

/// P2C rounds of two draws before falling back to a scan.
const ROUNDS: u32 = 4;
/// `inflight_bias` used when the VIP leaves it 0, and its allowed range.
const DEFAULT_INFLIGHT_BIAS: u8 = 2;
const MAX_INFLIGHT_BIAS: u8 = 3;

#[inline(always)]
pub fn select(vip: &VipMeta, count: NonZeroU32) -> Result<Chosen, Reason> {
    let bias = match vip.inflight_bias {
        0 => DEFAULT_INFLIGHT_BIAS,
        b => b.min(MAX_INFLIGHT_BIAS),
    };
    let Some(others) = NonZeroU32::new(count.get() - 1) else {
        return candidate(vip.vip_id, 0).ok_or(lb_common::reason::DROP_NO_BACKEND);
    };
    for _ in 0..ROUNDS {
        let first = random() % count;
        // Draw among the other count-1 slots and skip over the first, so the
        // two are distinct without a retry loop.
        let mut second = random() % others;
        if second >= first {
            second += 1;
        }
        let a = candidate(vip.vip_id, first);
        let b = candidate(vip.vip_id, second);
        match (a, b) {
            (Some(a), Some(b)) => {
                return Ok(if cost(b.id, bias) < cost(a.id, bias) {
                    b
                } else {
                    a
                });
            }
            (Some(only), None) | (None, Some(only)) => return Ok(only),
            (None, None) => {}
        }
    }
    // Every draw hit an out-of-service backend: scan from a random slot, so
    // a VIP with few backends in service among many is still served.
    scan(vip.vip_id, u64::from(random()), count)
}

/// `cost × (inflight + 1)^bias`, saturating. A cost of 0 (no score written
/// yet) counts as 1, so the in-flight term still spreads a burst of flows.
#[inline(always)]
fn cost(id: u32, bias: u8) -> u64 {
    let factor = inflight(id).saturating_add(1);
    let mut total = score(id).cost.max(1);
    for _ in 0..bias {
        total = saturating_mul(total, factor);
    }
    total
}
