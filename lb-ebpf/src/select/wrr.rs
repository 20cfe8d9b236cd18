//! Smooth weighted round-robin (nginx's): the control plane computes the
//! whole smooth sequence of slot indexes into the block's run of the VIP's
//! schedule block, and the kernel steps a shared atomic cursor over it. No
//! lock, no per-packet weight arithmetic, and no backend is hit in bursts.
//! Schedule entries are slot indexes relative to the block's first slot
//! (for the whole VIP, slot indexes of its slot block), read from the half
//! of the schedule block the VIP's descriptor names.
use core::num::NonZeroU64;

use lb_common::Reason;

use super::slots::{Block, Chosen, candidate, next_cursor, scan};
use crate::maps::VIP_SCHEDULE;

#[inline(always)]
pub fn select(block: &Block) -> Result<Chosen, Reason> {
    let cursor = next_cursor(block.vip_id)?;
    let Some(len) = NonZeroU64::new(u64::from(block.schedule_len)) else {
        // No schedule written (yet): plain round-robin keeps serving.
        return scan(block, cursor);
    };
    // Below schedule_len ≤ WRR_SCHEDULE_LEN: fits a u32.
    let step = (cursor % len) as u32;
    // The block's run lies inside the half its descriptor named when the
    // block was built (`Block::whole`, `Block::zone`), which bounds it:
    // nothing wraps.
    let index = block.schedule_start.wrapping_add(step);
    let slot = VIP_SCHEDULE.get(index).copied().unwrap_or(0);
    if slot < block.count.get()
        && let Some(chosen) = candidate(block.vip_id, block.first_slot.wrapping_add(slot))
    {
        return Ok(chosen);
    }
    scan(block, u64::from(slot))
}
