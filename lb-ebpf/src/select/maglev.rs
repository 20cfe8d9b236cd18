//! Maglev consistent hashing: the control plane builds each Maglev VIP's
//! lookup table of backend ids; the kernel indexes it with the flow hash (or
//! the client-address hash, for source-IP affinity). A zone block uses its
//! own run of `ZONE_MAGLEV_SIZE` entries of the VIP's table.
use lb_common::{
    Reason, VIP_F_SOURCE_AFFINITY, VipMeta,
    hash::{flow_hash, source_hash},
};

use super::slots::{Block, Chosen, by_id, scan};
use crate::{maps::MAGLEV, packet::Packet};

#[inline(always)]
pub fn select(block: &Block, vip: &VipMeta, pkt: &Packet) -> Result<Chosen, Reason> {
    let hash = if vip.flags & VIP_F_SOURCE_AFFINITY != 0 {
        source_hash(pkt.saddr)
    } else {
        flow_hash(pkt.saddr, pkt.daddr, pkt.sport, pkt.dport, pkt.proto)
    };
    if let Some(size) = block.maglev_size {
        let index = block.maglev_first.wrapping_add(hash % size);
        if let Some(chosen) = MAGLEV.get(index).and_then(|id| by_id(*id)) {
            return Ok(chosen);
        }
    }
    // No table yet, or its entry is out of service until the rebuild: a
    // deterministic fallback keeps the flow's choice stable meanwhile.
    scan(block, u64::from(hash))
}
