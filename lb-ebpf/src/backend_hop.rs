//! Each backend's next hop, shared by its new flows on one CPU
//! ([`BACKEND_HOPS`]): a new flow's forward entry starts with it cached
//! while it is fresh ([`fresh`]), so the flow's first packet needs no FIB
//! lookup; a forward packet that resolved its hop keeps it for the next
//! new flows ([`remember`]), unless the kept one is still fresh (its stamp
//! would otherwise be renewed forever and never resolved again).
use lb_common::{BACKEND_HOP_JIFFIES, BackendHop};

use crate::{helpers::jiffies, maps::BACKEND_HOPS, select::Chosen};

/// This CPU's hop to `backend`, if a flow to it resolved one that leaves
/// by `ingress` within the [`BACKEND_HOP_JIFFIES`] before `now` (jiffies,
/// read by the caller: a new flow reads the clock once).
#[inline(always)]
pub fn fresh(backend: &Chosen, ingress: u32, now: u32) -> Option<&'static BackendHop> {
    let kept = BACKEND_HOPS.get(backend.id)?;
    is_fresh(kept, &backend.addr, ingress, now).then_some(kept)
}

/// Whether `kept` holds a hop to `dst` by `ingress`, resolved at most
/// [`BACKEND_HOP_JIFFIES`] before `now`.
#[inline(always)]
pub fn is_fresh(kept: *const BackendHop, dst: &[u32; 4], ingress: u32, now: u32) -> bool {
    // SAFETY: this CPU's own copy of a per-CPU map value.
    unsafe {
        (*kept).ifindex != 0
            && (*kept).ifindex == ingress
            && (*kept).dst == *dst
            && now.wrapping_sub((*kept).jiffies) < BACKEND_HOP_JIFFIES
    }
}

/// Keeps the hop `mac` by `ingress` to `dst`, just resolved for a flow to
/// backend `backend_id`, as the backend's shared one, unless the kept one
/// is still fresh.
#[inline(always)]
pub fn remember(backend_id: u32, dst: &[u32; 4], mac: [u8; 6], ingress: u32) {
    let Some(kept) = BACKEND_HOPS.get_ptr_mut(backend_id) else {
        return;
    };
    let now = jiffies();
    if is_fresh(kept, dst, ingress, now) {
        return;
    }
    // SAFETY: this CPU's own copy of a per-CPU map value.
    unsafe {
        (*kept).dst = *dst;
        (*kept).mac = mac;
        (*kept).ifindex = ingress;
        (*kept).jiffies = now;
    }
}
