//! Maglev consistent hashing: the control plane builds each Maglev VIP's
//! lookup table of backend ids; the kernel indexes it with the flow hash (or
//! the client-address hash, for source-IP affinity).
use core::num::NonZeroU32;

use lb_common::{
    MAGLEV_TABLE_SIZE, MAX_MAGLEV_TABLES, Reason, VIP_F_SOURCE_AFFINITY, VipMeta,
    hash::{flow_hash, source_hash},
};

use super::slots::{Chosen, by_id, scan, tables};
use crate::{maps::MAGLEV, packet::Packet};

#[inline(always)]
pub fn select(vip: &VipMeta, count: NonZeroU32, pkt: &Packet) -> Result<Chosen, Reason> {
    let hash = if vip.flags & VIP_F_SOURCE_AFFINITY != 0 {
        source_hash(pkt.saddr)
    } else {
        flow_hash(pkt.saddr, pkt.daddr, pkt.sport, pkt.dport, pkt.proto)
    };
    let t = tables(vip.vip_id);
    if t.has_maglev != 0 && t.maglev_table < MAX_MAGLEV_TABLES {
        let index = t.maglev_table * MAGLEV_TABLE_SIZE + hash % MAGLEV_TABLE_SIZE;
        if let Some(chosen) = MAGLEV.get(index).and_then(|id| by_id(*id)) {
            return Ok(chosen);
        }
    }
    // No table yet, or its entry is out of service until the rebuild: a
    // deterministic fallback keeps the flow's choice stable meanwhile.
    scan(vip.vip_id, u64::from(hash), count)
}
