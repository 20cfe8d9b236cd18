//! A VIP's slot block, which every algorithm picks from:
//! `VIP_BACKENDS[vip_id * MAX_BACKENDS_PER_VIP ..][..backend_count]`, whose
//! values are backend ids, plus the weight-derived tables the control plane
//! writes next to it (`lb_common::VipTables`). The control plane keeps only
//! selectable backends in the block; the state check here guards the window
//! between a backend leaving service and the slots being rewritten.
use core::num::{NonZeroU32, NonZeroU64};

use lb_common::{BACKEND_ACTIVE, Backend, MAX_BACKENDS_PER_VIP, Reason, VipTables, reason};

use crate::{
    atomic::fetch_add_u64,
    maps::{BACKENDS, VIP_BACKENDS, VIP_STATE, VIP_TABLES},
};

/// Slots a scan visits looking for an in-service backend (round-robin
/// stepping past out-of-service ones, or a fallback after unlucky draws).
const SCAN_LIMIT: u32 = 16;

/// The backend chosen for a new flow.
pub struct Chosen {
    pub id: u32,
    /// `lb_common::AF_INET` or `AF_INET6`; the flow refuses a backend whose
    /// family differs from the VIP's (the control plane never configures one).
    pub family: u8,
    pub addr: [u32; 4],
    /// Network byte order.
    pub port: u16,
}

/// Advances the VIP's shared cursor (round-robin and weighted round-robin;
/// a VIP runs one algorithm, so they never share it), returning the old value.
#[inline(always)]
pub fn next_cursor(vip_id: u32) -> Result<u64, Reason> {
    let state = VIP_STATE
        .get_ptr_mut(vip_id)
        .ok_or(reason::DROP_BAD_CONFIG)?;
    // SAFETY: `state` points at a live, 8-byte aligned array value.
    Ok(unsafe { fetch_add_u64(&raw mut (*state).rr_cursor, 1) })
}

/// The VIP's table descriptor (all zero until the control plane writes one).
#[inline(always)]
pub fn tables(vip_id: u32) -> VipTables {
    VIP_TABLES.get(vip_id).copied().unwrap_or_default()
}

/// The first in-service backend from slot `start % count` on, looking at
/// no more than `SCAN_LIMIT` slots.
#[inline(always)]
pub fn scan(vip_id: u32, start: u64, count: NonZeroU32) -> Result<Chosen, Reason> {
    let count = NonZeroU64::from(count);
    for step in 0..SCAN_LIMIT {
        // The remainder is below count ≤ MAX_BACKENDS_PER_VIP: fits a u32.
        let slot = (start.wrapping_add(u64::from(step)) % count) as u32;
        if let Some(chosen) = candidate(vip_id, slot) {
            return Ok(chosen);
        }
    }
    Err(reason::DROP_NO_BACKEND)
}

/// The backend id in `slot` of the VIP's slot block.
#[inline(always)]
fn slot_backend(vip_id: u32, slot: u32) -> Option<u32> {
    let index = vip_id
        .checked_mul(MAX_BACKENDS_PER_VIP)?
        .checked_add(slot)?;
    VIP_BACKENDS.get(index).copied()
}

/// The backend in `slot` of the VIP, if it may take new flows.
#[inline(always)]
pub fn candidate(vip_id: u32, slot: u32) -> Option<Chosen> {
    by_id(slot_backend(vip_id, slot)?)
}

/// Backend `id`, if it may take new flows.
#[inline(always)]
pub fn by_id(id: u32) -> Option<Chosen> {
    let backend: &Backend = BACKENDS.get(id)?;
    if backend.in_use == 0 || backend.state != BACKEND_ACTIVE {
        return None;
    }
    Some(Chosen {
        id,
        family: backend.family,
        addr: backend.addr,
        port: backend.port,
    })
}
