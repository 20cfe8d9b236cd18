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
mod icmp;
mod maps;
mod nat;
mod nexthop;
mod parse;
mod pick;
mod progress;
mod rate;
mod select;
mod stats;
mod track;

use core::mem::MaybeUninit;

use aya_ebpf::{
    bindings::xdp_action,
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns},
    macros::xdp,
    programs::XdpContext,
};
use lb_common::{CONFIG_F_READY, DIR_TO_CLIENT, FLOW_F_CLOSED, FlowEntry, LbConfig, reason};

use crate::{
    flow::{ReturnPath, Translation},
    maps::{CONFIG, FLOWS},
    parse::{ETH_SRC_OFF, Packet, Parsed},
    stats::Direction,
};

/// A `lb_common::reason` index.
pub type Reason = u32;

/// An XDP action and the reason it is counted under.
pub struct Verdict {
    pub action: xdp_action::Type,
    pub reason: Reason,
}

impl Verdict {
    pub const fn new(action: xdp_action::Type, reason: Reason) -> Self {
        Self { action, reason }
    }

    pub const fn pass(reason: Reason) -> Self {
        Self::new(xdp_action::XDP_PASS, reason)
    }
}

#[xdp]
pub fn lb_xdp(ctx: XdpContext) -> u32 {
    match try_lb(&ctx) {
        Ok(action) => action,
        Err(reason) => finish(Err(reason)),
    }
}

/// Counts the verdict's reason and returns its action (errors drop).
#[inline(always)]
pub fn finish(result: Result<Verdict, Reason>) -> u32 {
    match result {
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

/// Parses and dispatches. Parsing, flow creation and each direction's
/// rewrite are separate BPF functions called one after the other (each
/// counts its own verdict): inlined into one, their locals (IPv6 keys, a
/// 96-byte flow entry, FIB parameters) overflow the 512-byte stack.
#[inline(always)]
fn try_lb(ctx: &XdpContext) -> Result<u32, Reason> {
    let mut pkt = MaybeUninit::uninit();
    let icmp_error = match parse::parse_into(XdpContext::new(ctx.ctx), &mut pkt).get()? {
        Parsed::Pass(reason) => return Ok(finish(Ok(Verdict::pass(reason)))),
        Parsed::Transport => false,
        Parsed::IcmpError => true,
    };
    // SAFETY: `parse_into` wrote the packet (its outcome was not pass or drop).
    let pkt = unsafe { pkt.assume_init_ref() };
    let not_ours = if icmp_error {
        reason::PASS_ICMP
    } else {
        reason::PASS_NOT_VIP
    };
    let Some(cfg) = CONFIG.get(0).filter(|c| c.flags & CONFIG_F_READY != 0) else {
        return Ok(finish(Ok(Verdict::pass(not_ours))));
    };
    // For an ICMP error this is the key of the quoted packet's flow in the
    // direction the error travels (see icmp.rs).
    let key = flow::packet_key(pkt);
    let ctx = || XdpContext::new(ctx.ctx);
    if icmp_error {
        return Ok(match flow::lookup(&key) {
            Some(entry) => icmp::translate(ctx(), pkt, entry),
            None => finish(Ok(Verdict::pass(not_ours))),
        });
    }
    if let Some(entry) = flow::lookup(&key) {
        // SAFETY: live map value; direction and flags are plain loads.
        let (direction, flags) = unsafe { ((*entry).direction, (*entry).flags) };
        if direction == DIR_TO_CLIENT {
            return Ok(to_client(ctx(), pkt, entry));
        }
        if !(pkt.is_tcp() && pkt.is_syn() && flags & FLOW_F_CLOSED != 0) {
            return Ok(to_backend(ctx(), pkt, entry));
        }
        // A new SYN on a closed connection's tuple starts a new connection:
        // release the old reply entry (and its SNAT port), then re-select.
        release_reply(pkt, entry);
    }
    let picked = pick::pick_backend(pkt);
    if picked & pick::PICK_DONE != 0 {
        // The pick's own (counted) verdict: not a VIP, refused, no backend.
        return Ok(picked as u32);
    }
    let (vip_id, backend_id) = ((picked >> 32) as u32, picked as u32);
    let action = new_flow(ctx(), pkt, cfg, vip_id, backend_id);
    if action != FLOW_CREATED {
        return Ok(action);
    }
    // Looked up again rather than returned: a BPF function returns one
    // register, and the verifier must see a map value pointer come from a lookup.
    let fwd = flow::lookup(&key).ok_or(reason::DROP_FLOW_INSERT)?;
    Ok(to_backend(ctx(), pkt, fwd))
}

/// Removes the reply entry of the connection whose forward entry is `fwd`.
/// A BPF function of its own, so its key is not in `lb_xdp`'s stack frame
/// while `new_flow` runs.
#[inline(never)]
fn release_reply(pkt: &Packet, fwd: *mut FlowEntry) {
    let _ = FLOWS.remove(Translation::of(fwd).opposite_key(pkt));
}

/// [`new_flow`]'s return value when it created the connection's entries
/// (not an XDP action; the packet still has to be sent).
const FLOW_CREATED: u32 = u32::MAX;

/// Creates both flow entries of a new connection to backend `backend_id`
/// of VIP `vip_id` (as [`pick::pick_backend`] chose), or returns the (counted)
/// action for the packet.
#[inline(never)]
fn new_flow(ctx: XdpContext, pkt: &Packet, cfg: &LbConfig, vip_id: u32, backend_id: u32) -> u32 {
    parse::keep_ctx_pointer(&ctx);
    match try_new_flow(&ctx, pkt, cfg, vip_id, backend_id) {
        Ok(()) => FLOW_CREATED,
        Err(reason) => finish(Err(reason)),
    }
}

#[inline(always)]
fn try_new_flow(
    ctx: &XdpContext,
    pkt: &Packet,
    cfg: &LbConfig,
    vip_id: u32,
    backend_id: u32,
) -> Result<(), Reason> {
    // Looked up again by id: it left service only if it did so since the pick.
    let backend = select::by_id(backend_id).ok_or(reason::DROP_NO_BACKEND)?;
    let client = ReturnPath {
        mac: parse::load(ctx, ETH_SRC_OFF).ok_or(reason::DROP_TRUNCATED)?,
        ifindex: ctx.ingress_ifindex() as u32,
    };
    let now = now();
    flow::create(pkt, client, cfg, vip_id, &backend, now)?;
    track::opened(backend.id, vip_id, now);
    Ok(())
}

/// Client → VIP packet of a known connection.
#[inline(never)]
fn to_backend(ctx: XdpContext, pkt: &Packet, fwd: *mut FlowEntry) -> u32 {
    parse::keep_ctx_pointer(&ctx);
    finish(forward_to_backend(&ctx, pkt, fwd))
}

#[inline(always)]
fn forward_to_backend(
    ctx: &XdpContext,
    pkt: &Packet,
    fwd: *mut FlowEntry,
) -> Result<Verdict, Reason> {
    let to = Translation::of(fwd);
    nat::rewrite(ctx, pkt, &to)?;
    let verdict = nexthop::forward(ctx, pkt, &to, reason::TX_TO_BACKEND, None)?;
    track::client_packet(pkt, fwd, now());
    stats::backend_traffic(to.backend_id, Direction::ToBackend, pkt.frame_len);
    Ok(verdict)
}

/// Backend → SNAT address packet of a known connection.
#[inline(never)]
fn to_client(ctx: XdpContext, pkt: &Packet, rev: *mut FlowEntry) -> u32 {
    parse::keep_ctx_pointer(&ctx);
    finish(forward_to_client(&ctx, pkt, rev))
}

#[inline(always)]
fn forward_to_client(
    ctx: &XdpContext,
    pkt: &Packet,
    rev: *mut FlowEntry,
) -> Result<Verdict, Reason> {
    let to = Translation::of(rev);
    nat::rewrite(ctx, pkt, &to)?;
    let client = ReturnPath::of(rev);
    let verdict = nexthop::forward(ctx, pkt, &to, reason::TX_TO_CLIENT, client)?;
    // The forward entry holds the state; it may have been evicted alone.
    if let Some(fwd) = flow::lookup(&to.opposite_key(pkt)) {
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

/// Benchmark baseline: swaps the Ethernet addresses and sends the frame
/// back (the cheapest useful XDP_TX). `lb-bench-dataplane` measures `lb_xdp`
/// against it and against `xdp_pass_stub`.
#[xdp]
pub fn xdp_macswap_bench(ctx: XdpContext) -> u32 {
    let (Some(dst), Some(src)) = (
        parse::ptr_at::<parse::Mac>(&ctx, parse::ETH_DST_OFF),
        parse::ptr_at::<parse::Mac>(&ctx, parse::ETH_SRC_OFF),
    ) else {
        return xdp_action::XDP_PASS;
    };
    // SAFETY: both 6-byte fields were bounds-checked; [u8; 6] has alignment 1.
    unsafe { core::ptr::swap(dst, src) };
    xdp_action::XDP_TX
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
