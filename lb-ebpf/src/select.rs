//! Backend selection for a new flow.
//!
//! `select` dispatches on the VIP's algorithm; every algorithm sees the VIP's
//! slot block `VIP_BACKENDS[vip_id * MAX_BACKENDS_PER_VIP ..][..backend_count]`,
//! whose values are backend ids. The control plane keeps only selectable
//! backends in the block; the state check here guards the window between a
//! backend leaving service and the slots being rewritten.
use core::num::{NonZeroU32, NonZeroU64};

use lb_common::{Algorithm, BACKEND_ACTIVE, Backend, MAX_BACKENDS_PER_VIP, VipMeta, reason};

use crate::{
    Reason,
    atomic::fetch_add_u64,
    maps::{BACKEND_CONNS, BACKEND_CORRECTION, BACKEND_SCORES, BACKENDS, VIP_BACKENDS, VIP_STATE},
    random,
};

/// P2C rounds of two draws before falling back to a scan.
const P2C_ROUNDS: u32 = 4;
/// Slots a scan visits looking for an in-service backend (round-robin
/// stepping past out-of-service ones, or P2C after unlucky draws).
const SCAN_LIMIT: u32 = 16;
/// `inflight_bias` used when the VIP leaves it 0, and its allowed range.
const DEFAULT_INFLIGHT_BIAS: u8 = 2;
const MAX_INFLIGHT_BIAS: u8 = 3;

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

/// Picks a backend for a new flow to the VIP described by `vip`.
#[inline(always)]
pub fn select(vip: &VipMeta) -> Result<Chosen, Reason> {
    if vip.backend_count > MAX_BACKENDS_PER_VIP {
        return Err(reason::DROP_BAD_CONFIG);
    }
    let Some(count) = NonZeroU32::new(vip.backend_count) else {
        return Err(reason::DROP_NO_BACKEND);
    };
    // More algorithms (weighted round-robin, random, least-conn, maglev) get
    // their own arm; unknown values fall back to P2C.
    match Algorithm::from_u8(vip.algorithm) {
        Some(Algorithm::RoundRobin) => round_robin(vip.vip_id, count),
        _ => p2c(vip, count),
    }
}

/// Power of two choices: the cheaper of two distinct random slots.
#[inline(always)]
fn p2c(vip: &VipMeta, count: NonZeroU32) -> Result<Chosen, Reason> {
    let bias = match vip.inflight_bias {
        0 => DEFAULT_INFLIGHT_BIAS,
        b => b.min(MAX_INFLIGHT_BIAS),
    };
    let Some(others) = NonZeroU32::new(count.get() - 1) else {
        return candidate(vip.vip_id, 0).ok_or(reason::DROP_NO_BACKEND);
    };
    for _ in 0..P2C_ROUNDS {
        let first = random() % count;
        // Draw among the other count-1 slots and skip over the first, so the
        // two are distinct without a retry loop.
        let mut second = random() % others;
        if second >= first {
            second += 1;
        }
        let a = candidate(vip.vip_id, first);
        let b = candidate(vip.vip_id, second);
        match (a, b) {
            (Some(a), Some(b)) => {
                return Ok(if score(b.id, bias) < score(a.id, bias) {
                    b
                } else {
                    a
                });
            }
            (Some(only), None) | (None, Some(only)) => return Ok(only),
            (None, None) => {}
        }
    }
    // Every draw hit an out-of-service backend: scan from a random slot, so
    // a VIP with few backends in service among many is still served.
    scan(vip.vip_id, u64::from(random()), count)
}

/// Round-robin over the slots with a shared atomic cursor.
#[inline(always)]
fn round_robin(vip_id: u32, count: NonZeroU32) -> Result<Chosen, Reason> {
    let state = VIP_STATE
        .get_ptr_mut(vip_id)
        .ok_or(reason::DROP_BAD_CONFIG)?;
    // SAFETY: `state` points at a live, 8-byte aligned array value.
    let start = unsafe { fetch_add_u64(&raw mut (*state).rr_cursor, 1) };
    scan(vip_id, start, count)
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

/// The backend in `slot` of the VIP, if it may take new flows.
#[inline(always)]
fn candidate(vip_id: u32, slot: u32) -> Option<Chosen> {
    let index = vip_id
        .checked_mul(MAX_BACKENDS_PER_VIP)?
        .checked_add(slot)?;
    let id = *VIP_BACKENDS.get(index)?;
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

/// `cost × (inflight + 1)^bias`, saturating. A cost of 0 (no score written
/// yet) counts as 1, so the in-flight term still spreads a burst of flows.
#[inline(always)]
fn score(id: u32, bias: u8) -> u64 {
    let cost = BACKEND_SCORES.get(id).map_or(0, |s| s.cost).max(1);
    let opened_closed = BACKEND_CONNS.get(id).copied().unwrap_or_default();
    let correction = BACKEND_CORRECTION.get(id).copied().unwrap_or(0);
    let factor = opened_closed.inflight(correction).saturating_add(1);
    let mut score = cost;
    for _ in 0..bias {
        score = saturating_mul(score, factor);
    }
    score
}

/// `a × b`, or `u64::MAX` on overflow. `u64::saturating_mul` needs a 128-bit
/// multiply (`__multi3`), which BPF cannot call, and LLVM turns the usual
/// `b > u64::MAX / a` test back into one. Testing against `u64::MAX - 1`
/// is exact too (`a × b ≥ MAX` exactly when `b > (MAX - 1) / a`) and stays a
/// plain division.
#[inline(always)]
fn saturating_mul(a: u64, b: u64) -> u64 {
    if a != 0 && b > (u64::MAX - 1) / a {
        u64::MAX
    } else {
        a * b
    }
}
