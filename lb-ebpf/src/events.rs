//! The `EVENTS` ring buffer: flow events for the control plane, sent only
//! on state changes (see `track`).
use lb_common::{FlowEvent, reason};

use crate::{maps::EVENTS, stats};

/// Sends one event. A full ring loses the event (counted as `EVENT_LOST`)
/// but never changes what happens to the packet.
#[inline(always)]
pub fn emit(kind: u8, close_reason: u8, backend_id: u32, vip_id: u32, now: u64, value_ns: u64) {
    let Some(mut entry) = EVENTS.reserve::<FlowEvent>(0) else {
        stats::count(reason::EVENT_LOST);
        return;
    };
    entry.write(FlowEvent {
        timestamp_ns: now,
        value_ns,
        backend_id,
        vip_id,
        kind,
        reason: close_reason,
        _pad: [0; 6],
    });
    entry.submit(0);
}
