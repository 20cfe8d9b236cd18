//! Selection: admission and the choice of a backend for the first packet of
//! a connection, in a *global* BPF function ([`lb_pick_backend`]:
//! `#[no_mangle]`, so bpf-linker gives it global BTF linkage). The verifier
//! checks a global function once, on its own, instead of once for every
//! distinct state `lb_xdp` reaches the call in; inlined, the parse paths
//! times the algorithms' paths exceeded the one-million-instruction limit.
//!
//! A global function may take and return only scalars (or pointers the
//! verifier then treats as clobbered memory), so the packet's 5-tuple
//! travels as five `u64`s and is unpacked into a [`Packet`] of the
//! function's own, and the result is a [`StageResult`]'s integer. It runs
//! next to `new_flow`, not inside it, so the algorithms' locals stay out of
//! the deepest stack frame.
//!
//! Admission ([`admit`]) caps the new-flow rate; [`select`] dispatches on
//! the VIP's algorithm over a [`slots::Block`]: the VIP's whole slot block,
//! or, for a zone-aware VIP ([`zones`]), the block of the zone drawn for
//! the flow. An algorithm whose table is missing or points at an
//! out-of-service backend falls back to a scan of its block; a zone block
//! without a backend in service falls back to a scan of the whole slot
//! block. So a new flow is never refused while any backend of the VIP can
//! take it.
mod admit;
mod least_conn;
mod load;
mod maglev;
mod p2c;
mod random;
mod slots;
mod wrr;
mod zones;

use core::num::NonZeroU32;

use lb_common::{
    Algorithm, MAX_BACKENDS, MAX_BACKENDS_PER_VIP, MAX_VIPS, Reason, StageResult, Verdict, VipKey,
    VipMeta, reason,
};
use slots::{Block, TablesView};
pub use slots::{Chosen, by_id};
use zones::Zoned;

use crate::{
    helpers::{leave_packet_clock, now, random},
    maps::VIPS,
    packet::Packet,
};

/// The VIP and backend of a new flow: [`pick_backend`]'s payload, 16 bits
/// each (ids index maps of at most 2^16 entries).
#[derive(Clone, Copy)]
pub struct Picked {
    pub vip_id: u32,
    pub backend_id: u32,
}

const _: () = assert!(MAX_VIPS <= 1 << 16 && MAX_BACKENDS <= 1 << 16);

impl Picked {
    #[inline(always)]
    fn into_payload(self) -> Result<u32, Reason> {
        if self.vip_id > 0xffff || self.backend_id > 0xffff {
            // A successful pick looked both up in maps of fewer entries.
            return Err(reason::DROP_BAD_CONFIG);
        }
        Ok((self.vip_id << 16) | self.backend_id)
    }

    /// The payload of a pick that [`Picked::into_payload`] accepted.
    #[inline(always)]
    pub const fn payload(self) -> u32 {
        (self.vip_id << 16) | (self.backend_id & 0xffff)
    }

    #[inline(always)]
    pub const fn from_payload(payload: u32) -> Self {
        Self {
            vip_id: payload >> 16,
            backend_id: payload & 0xffff,
        }
    }
}

/// Admits the new flow `pkt` and selects its backend: continues with a
/// [`Picked`] payload, or the verdict (not a VIP, refused, no backend).
#[inline(always)]
pub fn pick_backend(pkt: &Packet) -> StageResult {
    let (s, d) = (pkt.saddr, pkt.daddr);
    StageResult::from_raw(lb_pick_backend(
        words(s[0], s[1]),
        words(s[2], s[3]),
        words(d[0], d[1]),
        words(d[2], d[3]),
        pack_rest(pkt),
    ))
}

#[inline(always)]
fn words(low: u32, high: u32) -> u64 {
    u64::from(low) | (u64::from(high) << 32)
}

/// Ports, protocol, family and TCP flags in one `u64`.
#[inline(always)]
fn pack_rest(pkt: &Packet) -> u64 {
    u64::from(pkt.sport)
        | (u64::from(pkt.dport) << 16)
        | (u64::from(pkt.proto) << 32)
        | (u64::from(pkt.family) << 40)
        | (u64::from(pkt.tcp_flags) << 48)
}

/// The global function; see the module documentation.
#[unsafe(no_mangle)]
#[inline(never)]
pub fn lb_pick_backend(s01: u64, s23: u64, d01: u64, d23: u64, rest: u64) -> u64 {
    let pkt = Packet {
        l3: 0,
        l4: 0,
        proto: (rest >> 32) as u8,
        family: (rest >> 40) as u8,
        saddr: [
            s01 as u32,
            (s01 >> 32) as u32,
            s23 as u32,
            (s23 >> 32) as u32,
        ],
        daddr: [
            d01 as u32,
            (d01 >> 32) as u32,
            d23 as u32,
            (d23 >> 32) as u32,
        ],
        sport: rest as u16,
        dport: (rest >> 16) as u16,
        tcp_flags: (rest >> 48) as u8,
        frag: crate::packet::FRAG_NONE,
        frag_id: 0,
        payload_len: 0,
        frame_len: 0,
        key_pad: [0; 2],
    };
    pick(&pkt).into_raw()
}

#[inline(always)]
fn pick(pkt: &Packet) -> StageResult {
    let vip_key = VipKey {
        addr: pkt.daddr,
        port: pkt.dport,
        proto: pkt.proto,
        family: pkt.family,
    };
    // SAFETY: read-only use of a hash map value.
    let Some(vip) = (unsafe { VIPS.get(vip_key) }) else {
        return StageResult::verdict(Verdict::pass(reason::PASS_NOT_VIP));
    };
    StageResult::proceed_or_drop(admit_and_select(vip, pkt))
}

#[inline(always)]
fn admit_and_select(vip: &VipMeta, pkt: &Packet) -> Result<u32, Reason> {
    if pkt.is_tcp() && !pkt.is_syn() {
        return Err(reason::DROP_NO_FLOW);
    }
    // One clock read for the admission and the scores (a read costs as
    // much as a flow lookup, see `helpers`).
    let now = now();
    // The flow's creation takes this time instead of reading the clock again.
    leave_packet_clock(now);
    admit::admit(now)?;
    let backend = select(vip, pkt, now)?;
    Picked {
        vip_id: vip.vip_id,
        backend_id: backend.id,
    }
    .into_payload()
}

/// Picks a backend for the new flow `pkt` to the VIP described by `vip`
/// at `now`.
#[inline(always)]
fn select(vip: &VipMeta, pkt: &Packet, now: u64) -> Result<Chosen, Reason> {
    // Both bound the table indexes computed below without a branch
    // (`slots::Block`).
    if vip.backend_count > MAX_BACKENDS_PER_VIP || vip.vip_id >= MAX_VIPS {
        return Err(reason::DROP_BAD_CONFIG);
    }
    let Some(count) = NonZeroU32::new(vip.backend_count) else {
        return Err(reason::DROP_NO_BACKEND);
    };
    let tables = TablesView::read(vip.vip_id);
    let (block, zoned) = match zones::draw(vip, &tables) {
        Zoned::Whole => (Block::whole(vip.vip_id, count, &tables), false),
        Zoned::Block(block) => (block, true),
        Zoned::Unusable => return slots::scan_all(vip.vip_id, count, random()),
    };
    match run(&block, vip, pkt, now) {
        // The zone has no backend in service (or the scan inside it was
        // unlucky): any backend of the VIP rather than a refusal.
        Err(reason::DROP_NO_BACKEND) if zoned => slots::scan_all(vip.vip_id, count, random()),
        result => result,
    }
}

/// The VIP's algorithm over `block`.
#[inline(always)]
fn run(block: &Block, vip: &VipMeta, pkt: &Packet, now: u64) -> Result<Chosen, Reason> {
    // Unknown values fall back to P2C, the default.
    match Algorithm::from_u8(vip.algorithm) {
        Some(Algorithm::RoundRobin) => round_robin(block),
        Some(Algorithm::WeightedRoundRobin) => wrr::select(block),
        Some(Algorithm::Random) => random::select(block),
        Some(Algorithm::LeastConn) => least_conn::select(block, now),
        Some(Algorithm::Maglev) => maglev::select(block, vip, pkt),
        _ => p2c::select(
            block,
            vip.inflight_bias,
            vip.p2c_full_scan,
            vip.p2c_saturation,
            now,
        ),
    }
}

/// Round-robin over the block's slots with the VIP's shared atomic cursor.
#[inline(always)]
fn round_robin(block: &Block) -> Result<Chosen, Reason> {
    let start = slots::next_cursor(block.vip_id)?;
    slots::scan(block, start)
}
