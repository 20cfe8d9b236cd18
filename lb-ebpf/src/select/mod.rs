//! Backend selection for a new flow.
//!
//! `select` dispatches on the VIP's algorithm; every algorithm sees the VIP's
//! slot block `VIP_BACKENDS[vip_id * MAX_BACKENDS_PER_VIP ..][..backend_count]`,
//! whose values are backend ids, plus the weight-derived tables the control
//! plane writes next to it (`lb_common::VipTables`). The control plane keeps
//! only selectable backends in the block; the state check here guards the
//! window between a backend leaving service and the slots being rewritten.
//! An algorithm whose table is missing or points at an out-of-service
//! backend falls back to a scan, so a new flow is never refused while any
//! backend of the VIP can take it.
mod least_conn;
mod load;
mod maglev;
mod p2c;
mod random;
mod wrr;

use core::num::{NonZeroU32, NonZeroU64};

use lb_common::{
    Algorithm, BACKEND_ACTIVE, Backend, MAX_BACKENDS_PER_VIP, VipMeta, VipTables, reason,
};

use crate::{
    Reason,
    atomic::fetch_add_u64,
    maps::{BACKENDS, VIP_BACKENDS, VIP_STATE, VIP_TABLES},
    parse::Packet,
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

/// Picks a backend for the new flow `pkt` to the VIP described by `vip`.
#[inline(always)]
pub fn select(vip: &VipMeta, pkt: &Packet) -> Result<Chosen, Reason> {
    if vip.backend_count > MAX_BACKENDS_PER_VIP {
        return Err(reason::DROP_BAD_CONFIG);
    }
    let Some(count) = NonZeroU32::new(vip.backend_count) else {
        return Err(reason::DROP_NO_BACKEND);
    };
    // Unknown values fall back to P2C, the default.
    match Algorithm::from_u8(vip.algorithm) {
        Some(Algorithm::RoundRobin) => round_robin(vip.vip_id, count),
        Some(Algorithm::WeightedRoundRobin) => wrr::select(vip.vip_id, count),
        Some(Algorithm::Random) => random::select(vip.vip_id, count),
        Some(Algorithm::LeastConn) => least_conn::select(vip.vip_id, count),
        Some(Algorithm::Maglev) => maglev::select(vip, count, pkt),
        _ => p2c::select(vip, count),
    }
}

/// Round-robin over the slots with a shared atomic cursor.
#[inline(always)]
fn round_robin(vip_id: u32, count: NonZeroU32) -> Result<Chosen, Reason> {
    let start = next_cursor(vip_id)?;
    scan(vip_id, start, count)
}

/// Advances the VIP's shared cursor (round-robin and weighted round-robin;
/// a VIP runs one algorithm, so they never share it), returning the old value.
#[inline(always)]
fn next_cursor(vip_id: u32) -> Result<u64, Reason> {
    let state = VIP_STATE
        .get_ptr_mut(vip_id)
        .ok_or(reason::DROP_BAD_CONFIG)?;
    // SAFETY: `state` points at a live, 8-byte aligned array value.
    Ok(unsafe { fetch_add_u64(&raw mut (*state).rr_cursor, 1) })
}

/// The VIP's table descriptor (all zero until the control plane writes one).
#[inline(always)]
fn tables(vip_id: u32) -> VipTables {
    VIP_TABLES.get(vip_id).copied().unwrap_or_default()
}

/// The first in-service backend from slot `start % count` on, looking at
/// no more than `SCAN_LIMIT` slots.
#[inline(always)]
fn scan(vip_id: u32, start: u64, count: NonZeroU32) -> Result<Chosen, Reason> {
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
fn candidate(vip_id: u32, slot: u32) -> Option<Chosen> {
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
