//! The balancer's XDP data path.
//!
//! parse → flow lookup → (new flow: select a backend, allocate a SNAT port,
//! insert both flow entries) → NAT rewrite with incremental checksums →
//! next-hop MACs → XDP_TX / XDP_REDIRECT. Connection state changes become
//! ring-buffer events; every verdict is counted under exactly one reason.
#![no_std]
#![no_main]
// Atomic RMW intrinsics; see atomic.rs. This crate only builds with nightly.
#![feature(core_intrinsics, asm_experimental_arch)]
#![allow(internal_features)]

mod atomic;
mod csum;
mod emit;
mod flow;
mod maps;
mod nat;
mod nexthop;
mod parse;
mod rate;
mod select;
mod stats;
mod track;

use aya_ebpf::{
    bindings::xdp_action,
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns},
    macros::xdp,
    programs::XdpContext,
};
use lb_common::{
    AF_INET, CONFIG_F_READY, DIR_TO_CLIENT, FLOW_F_CLOSED, FlowEntry, LbConfig, VipKey, reason,
};

use crate::{
    flow::{ReturnPath, Translation},
    maps::{CONFIG, FLOWS, VIPS},
    parse::{ETH_SRC_OFF, Frame, Packet},
    stats::Direction,
};

/// A `lb_common::reason` index.
pub type Reason = u32;

/// An XDP action and the reason it is counted under.
pub struct Verdict {
    action: xdp_action::Type,
    reason: Reason,
}

impl Verdict {
    pub const fn new(action: xdp_action::Type, reason: Reason) -> Self {
        Self { action, reason }
    }

    const fn pass(reason: Reason) -> Self {
        Self::new(xdp_action::XDP_PASS, reason)
    }
}

#[xdp]
pub fn lb_xdp(ctx: XdpContext) -> u32 {
    match try_lb(&ctx) {
        Ok(verdict) => {
            stats::count(verdict.reason);
            verdict.action
        }
        Err(reason) => {
            stats::count(reason);
            xdp_action::XDP_DROP
        }
    }
}

#[inline(always)]
fn try_lb(ctx: &XdpContext) -> Result<Verdict, Reason> {
    let pkt = match parse::parse(ctx)? {
        Frame::Ipv4(pkt) => pkt,
        Frame::Pass(reason) => return Ok(Verdict::pass(reason)),
    };
    let Some(cfg) = CONFIG.get(0).filter(|c| c.flags & CONFIG_F_READY != 0) else {
        return Ok(Verdict::pass(reason::PASS_NOT_VIP));
    };
    let key = flow::packet_key(&pkt);
    if let Some(entry) = flow::lookup(&key) {
        // SAFETY: live map value; direction and flags are plain loads.
        let (direction, flags) = unsafe { ((*entry).direction, (*entry).flags) };
        if direction == DIR_TO_CLIENT {
            return to_client(ctx, &pkt, entry);
        }
        if !(pkt.is_tcp() && pkt.is_syn() && flags & FLOW_F_CLOSED != 0) {
            return to_backend(ctx, &pkt, entry);
        }
        // A new SYN on a closed connection's tuple starts a new connection:
        // release the old reply entry (and its SNAT port), then re-select.
        let _ = FLOWS.remove(Translation::of(entry).opposite_key(pkt.proto));
    }
    new_flow(ctx, &pkt, cfg)
}

/// First packet of a connection to a VIP (or not VIP traffic at all).
#[inline(always)]
fn new_flow(ctx: &XdpContext, pkt: &Packet, cfg: &LbConfig) -> Result<Verdict, Reason> {
    let vip_key = VipKey {
        addr: [pkt.daddr, 0, 0, 0],
        port: pkt.dport,
        proto: pkt.proto,
        family: AF_INET,
    };
    // SAFETY: read-only use of a hash map value.
    let Some(vip) = (unsafe { VIPS.get(vip_key) }) else {
        return Ok(Verdict::pass(reason::PASS_NOT_VIP));
    };
    if pkt.is_tcp() && !pkt.is_syn() {
        return Err(reason::DROP_NO_FLOW);
    }
    rate::admit(now())?;
    let backend = select::select(vip)?;
    let client = ReturnPath {
        mac: parse::load(ctx, ETH_SRC_OFF).ok_or(reason::DROP_TRUNCATED)?,
        ifindex: ctx.ingress_ifindex() as u32,
    };
    let now = now();
    let fwd = flow::create(pkt, client, cfg, vip.vip_id, &backend, now)?;
    track::opened(backend.id, vip.vip_id, now);
    to_backend(ctx, pkt, fwd)
}

/// Client → VIP packet of a known connection.
#[inline(always)]
fn to_backend(ctx: &XdpContext, pkt: &Packet, fwd: *mut FlowEntry) -> Result<Verdict, Reason> {
    let to = Translation::of(fwd);
    nat::rewrite(ctx, pkt, &to)?;
    let verdict = nexthop::forward(ctx, pkt, &to, reason::TX_TO_BACKEND, None)?;
    track::client_packet(pkt, fwd, now());
    stats::backend_traffic(to.backend_id, Direction::ToBackend, pkt.frame_len);
    Ok(verdict)
}

/// Backend → SNAT address packet of a known connection.
#[inline(always)]
fn to_client(ctx: &XdpContext, pkt: &Packet, rev: *mut FlowEntry) -> Result<Verdict, Reason> {
    let to = Translation::of(rev);
    nat::rewrite(ctx, pkt, &to)?;
    let client = ReturnPath::of(rev);
    let verdict = nexthop::forward(ctx, pkt, &to, reason::TX_TO_CLIENT, client)?;
    // The forward entry holds the state; it may have been evicted alone.
    if let Some(fwd) = flow::lookup(&to.opposite_key(pkt.proto)) {
        track::backend_packet(pkt, fwd, now());
    }
    stats::backend_traffic(to.backend_id, Direction::FromBackend, pkt.frame_len);
    Ok(verdict)
}

#[inline(always)]
fn now() -> u64 {
    // SAFETY: helper without arguments.
    unsafe { bpf_ktime_get_ns() }
}

#[inline(always)]
fn random() -> u32 {
    // SAFETY: helper without arguments.
    unsafe { bpf_get_prandom_u32() }
}

/// Does nothing but pass. Labs attach it to the peer of a veth that runs
/// `lb_xdp` in native mode: a native XDP_TX on veth is dropped unless the
/// peer has an XDP program of its own (DESIGN.md, "XDP_TX on veth").
#[xdp]
pub fn xdp_pass_stub(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_PASS
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
