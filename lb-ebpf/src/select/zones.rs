//! Zone-aware routing: a VIP with an entry in `VIP_ZONES` has its slot
//! block ordered into contiguous zone blocks (`lb_common::VipZones`), each
//! taking a share of the new connections. One draw of 16 random bits picks
//! the block (the first whose cumulative share exceeds it, the last block
//! in use otherwise); the VIP's algorithm then runs inside that block only.
//!
//! Bad descriptors never refuse a flow that the VIP could serve:
//! - `count == 0` (the zone panic) or `count > MAX_ZONES` (corrupt):
//!   selection over the whole slot block, as for a zone-unaware VIP;
//! - the drawn block is empty or reaches past the VIP's `backend_count`:
//!   [`Zoned::Unusable`], and the caller scans the whole slot block.
use lb_common::{MAX_ZONES, VipMeta, ZONE_SHARE_SCALE, ZoneBlock};

use super::slots::{Block, TablesView};
use crate::{helpers::random, maps::VIP_ZONES};

/// The outcome of the zone draw for one new flow.
pub enum Zoned {
    /// Not zone-aware (no descriptor, or none in use): the whole slot block.
    Whole,
    /// The drawn zone's block.
    Block(Block),
    /// The drawn block is unusable (see the module documentation).
    Unusable,
}

const _: () = assert!(ZONE_SHARE_SCALE == 1 << 16);

/// Draws the block of the new flow to the zone-aware VIP `vip`. One hash
/// lookup; the descriptor is read through the map reference, never copied.
#[inline(always)]
pub fn draw(vip: &VipMeta, tables: &TablesView) -> Zoned {
    // SAFETY: read-only use of a hash map value.
    let Some(zones) = (unsafe { VIP_ZONES.get(vip.vip_id) }) else {
        return Zoned::Whole;
    };
    let in_use = zones.count;
    if in_use == 0 || in_use > MAX_ZONES {
        return Zoned::Whole;
    }
    let r = random() & (ZONE_SHARE_SCALE - 1);
    // The drawn block, copied field by field as the loop goes (so every
    // exit of the loop leaves the same kind of state for the verifier to
    // prune, and no pointer into the descriptor outlives it). The last
    // block in use takes what the cumulative shares leave.
    let mut index = 0;
    let mut zone = ZoneBlock::default();
    for i in 0..MAX_ZONES {
        if i >= in_use {
            break;
        }
        let Some(z) = zones.zones.get(i as usize) else {
            break;
        };
        zone = *z;
        index = i;
        if r < zone.cum_share {
            break;
        }
    }
    // The zone descriptor names the half its schedule runs were written
    // into: both change in one hash update.
    let half = zones.half;
    match Block::zone(vip.vip_id, vip.backend_count, index, &zone, half, tables) {
        Some(block) => Zoned::Block(block),
        None => Zoned::Unusable,
    }
}
