//! This CPU's handover slot ([`PACKET_HANDOVER`]): how the parsed packet
//! (and the pick) reach a global BPF function, which takes only scalars and
//! the context. A global function is verified once, on its own, instead of
//! once for every state its caller reaches the call in.
use lb_common::time_wait::TsOption;

use crate::{
    maps::{Handover, PACKET_HANDOVER},
    packet::Packet,
};

/// Headers end before this offset (the parser's limits keep them well
/// below); [`taken`] checks it again, as the offsets come from a map value
/// the verifier knows nothing about.
pub const MAX_L4_OFFSET: usize = 1024;

/// Puts `pkt` and `picked` (`select::Picked`'s payload) in this CPU's
/// slot, with no segment read yet (`seq` 0, [`TsOption::UNKNOWN`]: a
/// reading left by an earlier packet must not pass for this one's).
#[inline(always)]
pub fn put(pkt: &Packet, picked: u32) -> bool {
    let Some(slot) = PACKET_HANDOVER.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: this CPU's own copy of a per-CPU map value (XDP runs with
    // preemption off, so nothing else touches it meanwhile).
    unsafe {
        (*slot).pkt = *pkt;
        (*slot).picked = picked;
        (*slot).seq = 0;
        (*slot).ts = TsOption::UNKNOWN;
    }
    true
}

/// This CPU's slot, if its packet's offsets are sane.
#[inline(always)]
pub fn taken() -> Option<&'static Handover> {
    let slot = PACKET_HANDOVER.get(0)?;
    if slot.pkt.l4 >= MAX_L4_OFFSET || slot.pkt.l3 >= slot.pkt.l4 {
        return None;
    }
    Some(slot)
}
