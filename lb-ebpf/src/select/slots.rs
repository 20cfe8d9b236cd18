//! A VIP's slot block, which every algorithm picks from:
//! `VIP_BACKENDS[vip_id * MAX_BACKENDS_PER_VIP ..][..backend_count]`, whose
//! values are backend ids, plus the weight-derived tables the control plane
//! writes next to it (`lb_common::VipTables`). The control plane keeps only
//! selectable backends in the block; the state check here guards the window
//! between a backend leaving service and the slots being rewritten.
//!
//! An algorithm runs over a [`Block`]: either the whole slot block, or one
//! zone's contiguous run of it (`lb_common::ZoneBlock`), with that run's
//! part of the weight-derived tables. The schedule and prefix tables come
//! in two halves per VIP (`lb_common::TABLE_HALVES`); a block is built
//! from one descriptor read and keeps the absolute indexes of the half
//! that descriptor names, so one new flow reads one half only.
use core::{
    ffi::c_void,
    num::{NonZeroU32, NonZeroU64},
};

use aya_ebpf::helpers::generated::bpf_loop;
use lb_common::{
    BACKEND_ACTIVE, Backend, MAGLEV_TABLE_SIZE, MAX_BACKENDS_PER_VIP, MAX_MAGLEV_TABLES, Reason,
    VipTables, WRR_SCHEDULE_LEN, ZONE_MAGLEV_SIZE, ZoneBlock, reason, table_half, table_run,
};

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

/// The run of a VIP's slots an algorithm picks from, and where its part of
/// the VIP's weight-derived tables lies. Built only by [`Block::whole`] and
/// [`Block::zone`], which check the invariants the algorithms rely on:
/// `first_slot + count <= MAX_BACKENDS_PER_VIP`, a schedule run inside
/// one half of the VIP's schedule block, and a Maglev run inside the VIP's
/// table.
#[derive(Clone, Copy)]
pub struct Block {
    pub vip_id: u32,
    /// Absolute slot index (in the VIP's slot block) of the block's first slot.
    pub first_slot: u32,
    pub count: NonZeroU32,
    /// Smooth WRR: entries `schedule_start .. + schedule_len` of
    /// `VIP_SCHEDULE` (absolute indexes, inside the half being read), each
    /// a slot index relative to `first_slot` (`schedule_len == 0`: no
    /// schedule).
    pub schedule_start: u32,
    pub schedule_len: u32,
    /// Weighted random: the index in `VIP_WEIGHT_PREFIX` of the running
    /// sum of the VIP's slot 0 in the half being read.
    pub prefix_base: u32,
    /// Maglev: entries `maglev_first .. + maglev_size` of `MAGLEV`
    /// (`None`: no table).
    pub maglev_first: u32,
    pub maglev_size: Option<NonZeroU32>,
    /// P2C: the re-draw bound's reference (0 = none).
    pub reference_cost: u64,
}

/// The first `VIP_SCHEDULE` and `VIP_WEIGHT_PREFIX` entries of half `half`
/// of VIP `vip_id`'s blocks (`lb_common::schedule_base`, `prefix_base`).
/// `vip_id < MAX_VIPS` is checked once by `select`, so plain arithmetic
/// cannot wrap: no `Option` here, because every branch at this point would
/// double the states the verifier walks through all the algorithms below
/// it (checked arithmetic here took the program past the 1M limit).
#[inline(always)]
fn half_bases(vip_id: u32, half: u32) -> (u32, u32) {
    let run = table_run(vip_id, half);
    (
        run.wrapping_mul(WRR_SCHEDULE_LEN),
        run.wrapping_mul(MAX_BACKENDS_PER_VIP),
    )
}

/// The fields of the VIP's table descriptor the blocks need (all zero
/// until the control plane writes one), read through the map reference.
#[derive(Clone, Copy, Default)]
pub struct TablesView {
    /// The half of the schedule and prefix blocks the descriptor names.
    pub half: u32,
    /// That half's schedule length (at most `WRR_SCHEDULE_LEN`).
    pub schedule_len: u32,
    /// Whether the VIP has a Maglev table, and its first entry (always a
    /// defined value: an `Option<u32>` here left its payload undefined on
    /// the `None` path, and the debug object spilled that undefined
    /// register, which the verifier refuses: "!read_ok").
    pub has_maglev: bool,
    pub maglev_base: u32,
    pub reference_cost: u64,
}

impl TablesView {
    #[inline(always)]
    pub fn read(vip_id: u32) -> Self {
        let Some(t): Option<&VipTables> = VIP_TABLES.get(vip_id) else {
            return Self::default();
        };
        let has_maglev = t.has_maglev != 0 && t.maglev_table < MAX_MAGLEV_TABLES;
        let maglev_base = t.maglev_table.min(MAX_MAGLEV_TABLES - 1) * MAGLEV_TABLE_SIZE;
        let half = table_half(t.half);
        // One load at a variable (bounded: half < 2) offset into the map
        // value, not a branch per half: a branch here would double the
        // verifier's states below it. `get` never fails (half is masked).
        let schedule_len = t.schedule_len.get(half as usize).copied().unwrap_or(0);
        Self {
            half,
            schedule_len: schedule_len.min(WRR_SCHEDULE_LEN),
            has_maglev,
            maglev_base,
            reference_cost: t.reference_cost,
        }
    }
}

impl Block {
    /// The whole slot block of a VIP with `count` (≤ `MAX_BACKENDS_PER_VIP`,
    /// checked by the caller) slots, with the VIP's own tables.
    #[inline(always)]
    pub fn whole(vip_id: u32, count: NonZeroU32, tables: &TablesView) -> Self {
        let (schedule_start, prefix_base) = half_bases(vip_id, tables.half);
        Self {
            vip_id,
            first_slot: 0,
            count,
            schedule_start,
            schedule_len: tables.schedule_len,
            prefix_base,
            maglev_first: tables.maglev_base,
            maglev_size: if tables.has_maglev {
                NonZeroU32::new(MAGLEV_TABLE_SIZE)
            } else {
                None
            },
            reference_cost: tables.reference_cost,
        }
    }

    /// Zone block `index` (`zone`) of a VIP with `backend_count` slots,
    /// reading half `half` (the zone descriptor's) of the schedule and
    /// prefix blocks. `None` when the block is empty or reaches past the
    /// VIP's slots; a schedule run outside the half's schedule block is
    /// ignored (plain round-robin inside the block, as with no schedule).
    #[inline(always)]
    pub fn zone(
        vip_id: u32,
        backend_count: u32,
        index: u32,
        zone: &ZoneBlock,
        half: u32,
        tables: &TablesView,
    ) -> Option<Self> {
        let count = NonZeroU32::new(zone.slot_count)?;
        let end = zone.first_slot.checked_add(zone.slot_count)?;
        // `index < MAX_ZONES` by construction ([`super::zones::draw`]); a
        // wrong one would only misplace a lookup the map bounds-checks.
        if end > backend_count || end > MAX_BACKENDS_PER_VIP {
            return None;
        }
        let schedule_ok = zone
            .schedule_first
            .checked_add(zone.schedule_len)
            .is_some_and(|end| end <= WRR_SCHEDULE_LEN);
        let (schedule_base, prefix_base) = half_bases(vip_id, half);
        Some(Self {
            vip_id,
            first_slot: zone.first_slot,
            count,
            // Inside the half: schedule_first + schedule_len <= its length.
            schedule_start: schedule_base.wrapping_add(if schedule_ok {
                zone.schedule_first
            } else {
                0
            }),
            schedule_len: if schedule_ok { zone.schedule_len } else { 0 },
            prefix_base,
            maglev_first: tables
                .maglev_base
                .wrapping_add(index.wrapping_mul(ZONE_MAGLEV_SIZE)),
            maglev_size: if tables.has_maglev {
                NonZeroU32::new(ZONE_MAGLEV_SIZE)
            } else {
                None
            },
            reference_cost: zone.reference_cost,
        })
    }

    /// The absolute slot of the block's slot `offset % count`.
    #[inline(always)]
    pub fn slot(&self, offset: u64) -> u32 {
        // The remainder is below count ≤ MAX_BACKENDS_PER_VIP: fits a u32.
        let within = (offset % NonZeroU64::from(self.count)) as u32;
        self.first_slot.wrapping_add(within)
    }

    /// The block's last slot (absolute).
    #[inline(always)]
    pub fn last_slot(&self) -> u32 {
        self.first_slot.wrapping_add(self.count.get() - 1)
    }
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

/// The first in-service backend of `block` from its slot `start % count`
/// on, looking at no more than `SCAN_LIMIT` slots.
#[inline(always)]
pub fn scan(block: &Block, start: u64) -> Result<Chosen, Reason> {
    for step in 0..SCAN_LIMIT {
        let slot = block.slot(start.wrapping_add(u64::from(step)));
        if let Some(chosen) = candidate(block.vip_id, slot) {
            return Ok(chosen);
        }
    }
    Err(reason::DROP_NO_BACKEND)
}

/// The state of [`scan_all`], shared with its `bpf_loop` callback.
#[repr(C)]
struct ScanAll {
    vip_id: u32,
    count: u32,
    start: u32,
    /// The slot found; `u32::MAX` while none.
    found: u32,
}

/// The first in-service backend of the VIP's first `count` slots from slot
/// `start % count` on, wrapping around, looking at every slot if need be
/// (under `bpf_loop`, so the verifier checks the body once). The zone
/// fallback: a new flow is never refused while any backend of the VIP can
/// take it.
#[inline(always)]
pub fn scan_all(vip_id: u32, count: NonZeroU32, start: u32) -> Result<Chosen, Reason> {
    let mut state = ScanAll {
        vip_id,
        count: count.get().min(MAX_BACKENDS_PER_VIP),
        start: start % count,
        found: u32::MAX,
    };
    // SAFETY: `visit_any` has the callback signature bpf_loop expects and
    // only touches `state`, which outlives the call.
    unsafe {
        bpf_loop(
            state.count,
            visit_any as *mut c_void,
            (&raw mut state).cast::<c_void>(),
            0,
        )
    };
    candidate(vip_id, state.found).ok_or(reason::DROP_NO_BACKEND)
}

/// One slot of [`scan_all`]; returns 1 to stop at the first in service.
extern "C" fn visit_any(step: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: bpf_loop passes back the pointer `scan_all` gave it.
    let state = unsafe { &mut *ctx.cast::<ScanAll>() };
    // start < count and step < count: one subtraction wraps it.
    let mut slot = state.start.wrapping_add(step as u32);
    if slot >= state.count {
        slot = slot.wrapping_sub(state.count);
    }
    if candidate(state.vip_id, slot).is_some() {
        state.found = slot;
        return 1;
    }
    0
}

/// The backend id in `slot` of the VIP's slot block, whatever its state
/// ([`active_id`] checks it; P2C's full scan checks only the one it chose).
#[inline(always)]
pub fn slot_backend(vip_id: u32, slot: u32) -> Option<u32> {
    if slot >= MAX_BACKENDS_PER_VIP {
        return None;
    }
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

/// The id of the backend in `slot` of the VIP, if it may take new flows:
/// [`candidate`] without copying the address out (P2C scores candidates
/// by id and looks the winner's address up once).
#[inline(always)]
pub fn active_id(vip_id: u32, slot: u32) -> Option<u32> {
    let id = slot_backend(vip_id, slot)?;
    let backend: &Backend = BACKENDS.get(id)?;
    in_service(backend).then_some(id)
}

/// Whether `backend` may take new flows.
#[inline(always)]
fn in_service(backend: &Backend) -> bool {
    backend.in_use != 0 && backend.state == BACKEND_ACTIVE
}

/// Backend `id`, if it may take new flows.
#[inline(always)]
pub fn by_id(id: u32) -> Option<Chosen> {
    let backend: &Backend = BACKENDS.get(id)?;
    if !in_service(backend) {
        return None;
    }
    Some(Chosen {
        id,
        family: backend.family,
        addr: backend.addr,
        port: backend.port,
    })
}
