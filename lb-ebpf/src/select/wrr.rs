//! Smooth weighted round-robin (nginx's): the control plane computes the
//! whole smooth sequence of slot indexes into the VIP's schedule block, and
//! the kernel steps a shared atomic cursor over it. No lock, no per-packet
//! weight arithmetic, and no backend is hit in bursts.
use core::num::NonZeroU32;

use lb_common::{Reason, WRR_SCHEDULE_LEN, reason};

use super::slots::{Chosen, candidate, next_cursor, scan, tables};
use crate::maps::VIP_SCHEDULE;

#[inline(always)]
pub fn select(vip_id: u32, count: NonZeroU32) -> Result<Chosen, Reason> {
    let cursor = next_cursor(vip_id)?;
    let len = tables(vip_id).schedule_len.min(WRR_SCHEDULE_LEN);
    if len == 0 {
        // No schedule written (yet): plain round-robin keeps serving.
        return scan(vip_id, cursor, count);
    }
    let step = (cursor % u64::from(len)) as u32;
    let index = vip_id
        .checked_mul(WRR_SCHEDULE_LEN)
        .and_then(|base| base.checked_add(step))
        .ok_or(reason::DROP_BAD_CONFIG)?;
    let slot = VIP_SCHEDULE.get(index).copied().unwrap_or(0);
    if slot < count.get()
        && let Some(chosen) = candidate(vip_id, slot)
    {
        return Ok(chosen);
    }
    scan(vip_id, u64::from(slot), count)
}
