//! Each backend's next hop, shared by its new flows on one CPU
//! ([`BACKEND_HOPS`]): `nexthop::lb_backend_hop` resolves it before a new
//! flow is created, at most once per [`BACKEND_HOP_JIFFIES`], and the
//! flow's forward entry starts with it cached ([`fresh`]), so a new flow's
//! first packet needs no FIB lookup.
use lb_common::{BACKEND_HOP_JIFFIES, BackendHop};

use crate::{helpers::jiffies, maps::BACKEND_HOPS, select::Chosen};

/// This CPU's hop to `backend`, if the last new flow to it resolved one
/// within [`BACKEND_HOP_JIFFIES`] that leaves by `ingress`.
#[inline(always)]
pub fn fresh(backend: &Chosen, ingress: u32) -> Option<&'static BackendHop> {
    let kept = BACKEND_HOPS.get(backend.id)?;
    is_fresh(kept, &backend.addr, ingress, jiffies()).then_some(kept)
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
