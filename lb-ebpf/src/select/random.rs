//! Weighted random: a uniform draw below the total weight, then a binary
//! search over the running weight sums the control plane wrote for the
//! block's slots. O(log n) per flow, no copy of a backend per unit of weight.
//! The sums restart at each block's first slot (a zone's sums count only
//! its own backends; the whole VIP's block starts at slot 0). They are read
//! from the half of the prefix block the VIP's descriptor names.
use lb_common::{MAX_BACKENDS_PER_VIP, Reason};

use super::slots::{Block, Chosen, candidate, scan};
use crate::{helpers::random, maps::VIP_WEIGHT_PREFIX};

/// Halvings that narrow `MAX_BACKENDS_PER_VIP` (1024) slots down to one.
const SEARCH_STEPS: u32 = 11;
const _: () = assert!(1 << (SEARCH_STEPS - 1) >= MAX_BACKENDS_PER_VIP);

#[inline(always)]
pub fn select(block: &Block) -> Result<Chosen, Reason> {
    let vip_id = block.vip_id;
    let base = block.prefix_base;
    let total = prefix(base, block.last_slot());
    if total == 0 {
        // No sums written (yet): uniform over the slots.
        return scan(block, u64::from(random()));
    }
    let target = random() % total;
    // The first slot whose running sum exceeds the target.
    let (mut lo, mut hi) = (block.first_slot, block.last_slot());
    for _ in 0..SEARCH_STEPS {
        if lo >= hi {
            break;
        }
        let mid = lo + (hi - lo) / 2;
        if prefix(base, mid) > target {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    match candidate(vip_id, lo) {
        Some(chosen) => Ok(chosen),
        None => scan(block, u64::from(lo.wrapping_sub(block.first_slot))),
    }
}

/// The running weight sum through `slot` in the half starting at `base`
/// (`Block::prefix_base`), 0 when unwritten.
#[inline(always)]
fn prefix(base: u32, slot: u32) -> u32 {
    // base < MAX_VIPS * TABLE_HALVES * MAX_BACKENDS_PER_VIP and slot <
    // MAX_BACKENDS_PER_VIP (the block's bounds): nothing wraps.
    VIP_WEIGHT_PREFIX
        .get(base.wrapping_add(slot))
        .copied()
        .unwrap_or(0)
}
