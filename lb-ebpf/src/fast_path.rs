//! The fast path: bulk packets of established flows, sent without the
//! general pipeline's BPF function calls.
//!
//! Most packets a balancer sees belong to a flow it already knows and
//! change nothing in it: an ACK, a segment of a request whose start is
//! already stamped, a response after its latency sample was taken. For
//! such a packet `lb_xdp` needs the flow entry, the rewrite, the cached
//! next hop and two counters. The general pipeline parses every shape of
//! frame (VLAN tags, IPv4 options, IPv6 extension headers, fragments, ICMP
//! errors) and reaches them through two BPF function calls (the parser,
//! then `to_backend`/`to_client`), each paying a call and a return (about
//! 10 ns on an AMD VM with a return-thunk mitigation;
//! docs/history/dataplane.md, "Stop 43"). [`send_established`] does it all in one function,
//! for the common frame only (`parse::plain`: no VLAN tag, IPv4 without
//! options or IPv6 without extension headers, no fragment, TCP or UDP),
//! and only when the packet is one the general path would treat exactly
//! so ([`takes_fast_path`]) and its entry has learned its checksum changes
//! (`nat::known_deltas`: the general path stores them from the flow's
//! first packet in each direction, so the rewrite does not compute them).
//! Every other packet goes the general way, from the start: the fast path
//! has written nothing.
use core::mem::MaybeUninit;

use aya_ebpf::programs::XdpContext;
use lb_common::{
    CONFIG_F_READY, DIR_TO_BACKEND, FLOW_F_CLOSED, FLOW_F_REQUEST_PENDING, FlowEntry, Reason,
    StageResult, Verdict, reason,
};

use crate::{
    flow::lookup_on_stack,
    maps::CONFIG,
    nat, nexthop,
    packet::{Mac, Packet, keep_ctx_pointer},
    parse::plain::{ether_type, parse_plain},
    stats::{self, Direction},
    track,
    wire::{ETH_P_IPV4, ETH_P_IPV6, TCP_FIN, TCP_RST, TCP_SYN},
};

/// [`send_established`]'s payload when it continues after a lookup that
/// found no flow: the general parser will find the same key (the frame has
/// the common shape), so the general path need not look it up again.
pub const NO_FLOW: u32 = 1;

/// Sends the frame if it is a bulk packet of an established flow (see the
/// module documentation): the verdict, or continue (the general path takes
/// the packet from the start). A BPF function of its own, with the parsed
/// packet in its own frame: inlined into `lb_xdp`, or writing into
/// `lb_xdp`'s packet, each of its ways into the general path left a
/// different state that the verifier walked that whole path from again
/// (the debug build went past the 1,000,000-instruction limit). An IPv4
/// packet costs one call, where the general path makes two; IPv6 takes
/// one more ([`send_established_ipv6`]). Returns a [`StageResult`]'s
/// integer.
#[inline(never)]
pub fn send_established(ctx: XdpContext) -> u64 {
    keep_ctx_pointer(&ctx);
    match ether_type(&ctx) {
        Some(ETH_P_IPV4) => send_plain::<false>(&ctx),
        Some(ETH_P_IPV6) => send_established_ipv6(XdpContext::new(ctx.ctx)),
        _ => StageResult::CONTINUE.into_raw(),
    }
}

/// [`send_established`] for IPv6, in a function of its own: its eight-word
/// translation and rewrite, in the same function as IPv4's, spilled
/// registers along IPv4's path as well (that one function's frame was 376
/// bytes; apart, IPv4's is 144 and IPv6's 192).
#[inline(never)]
fn send_established_ipv6(ctx: XdpContext) -> u64 {
    keep_ctx_pointer(&ctx);
    send_plain::<true>(&ctx)
}

/// The fast path of a frame of one family (`V6`: IPv6, else IPv4).
#[inline(always)]
fn send_plain<const V6: bool>(ctx: &XdpContext) -> u64 {
    let mut out = MaybeUninit::uninit();
    if parse_plain::<V6>(ctx, &mut out).is_none()
        || !CONFIG.get(0).is_some_and(|c| c.flags & CONFIG_F_READY != 0)
    {
        return StageResult::CONTINUE.into_raw();
    }
    // SAFETY: `parse_plain` wrote the packet (it returned `Some`).
    let pkt = unsafe { out.assume_init_ref() };
    let Some(entry) = lookup_on_stack::<V6>(pkt.flow_key()) else {
        return StageResult::proceed(NO_FLOW).into_raw();
    };
    // SAFETY: live map value; written only at creation.
    let to_backend = unsafe { (*entry).direction } == DIR_TO_BACKEND;
    if !takes_fast_path(pkt, entry, to_backend) {
        return StageResult::CONTINUE.into_raw();
    }
    // Entries that have not learned their checksum changes yet (new ones
    // until their first general packet, ones written by an older program)
    // go the general way, which stores them.
    let Some(deltas) = nat::known_deltas::<V6>(entry) else {
        return StageResult::CONTINUE.into_raw();
    };
    let Some(dmac) = nexthop::cached_on_ingress(entry, to_backend, ctx.ingress_ifindex() as u32)
    else {
        return StageResult::CONTINUE.into_raw();
    };
    StageResult::of(send::<V6>(ctx, pkt, entry, deltas, to_backend, dmac)).into_raw()
}

/// Whether the general path would only translate `pkt` and send it by its
/// entry's cached hop: no SYN, FIN or RST (state changes), a connection
/// not closed (its late packets have rules of their own), no refresh due
/// (the once-a-second `last_seen_ns` check), and no latency work: a client
/// payload while a request is already pending (the start is stamped), a
/// backend payload while none is (no sample to take).
#[inline(always)]
fn takes_fast_path(pkt: &Packet, entry: *mut FlowEntry, to_backend: bool) -> bool {
    if pkt.has(TCP_SYN | TCP_FIN | TCP_RST) {
        return false;
    }
    // SAFETY: live map value; a plain load of the flags word (a racing
    // change of them makes the next packet go the general way).
    let flags = unsafe { (*entry).flags };
    let pending = flags & FLOW_F_REQUEST_PENDING != 0;
    flags & FLOW_F_CLOSED == 0
        && track::refresh_check_waits(entry)
        && (pkt.payload_len == 0 || pending == to_backend)
}

/// Translates `pkt` by `entry` and its checksum changes `deltas`, sends it
/// back out to `dmac` and counts it.
#[inline(always)]
fn send<const V6: bool>(
    ctx: &XdpContext,
    pkt: &Packet,
    entry: *mut FlowEntry,
    deltas: (u16, u16),
    to_backend: bool,
    dmac: *const Mac,
) -> Result<Verdict, Reason> {
    let to = nat::rewrite_by_deltas::<V6>(ctx, pkt, entry, deltas)?;
    let (direction, tx_reason) = if to_backend {
        (Direction::ToBackend, reason::TX_TO_BACKEND)
    } else {
        (Direction::FromBackend, reason::TX_TO_CLIENT)
    };
    let verdict = nexthop::send_back(ctx, dmac, tx_reason)?;
    stats::backend_traffic(to.backend_id, direction, pkt.frame_len);
    Ok(verdict)
}
