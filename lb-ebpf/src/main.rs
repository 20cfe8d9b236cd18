//! The balancer's XDP data path.
//!
//! First the fast path ([`fast_path`]): a bulk packet of an established flow
//! in the common frame shape is looked up, rewritten and sent by its flow's
//! cached hop in one function. Every other packet takes the general
//! pipeline of its family ([`lb_general_v4`], [`lb_general_v6`]): parse →
//! flow lookup → (new flow: select a backend, allocate a SNAT port, insert
//! both flow entries) → NAT rewrite with incremental checksums → next-hop
//! MACs → XDP_TX / XDP_REDIRECT. Connection state changes become
//! ring-buffer events.
//!
//! Every stage is a BPF function of its own (each one's locals then stay
//! out of the others' stack frames) and returns one integer, a
//! `lb_common::StageResult`: continue (with a payload for the next stage),
//! or the packet's `Verdict`. [`lb_xdp`] counts the verdict under its reason,
//! exactly once, and returns its action.
#![no_std]
#![no_main]
// Atomic RMW intrinsics; see atomic.rs. This crate only builds with nightly.
// `#[inline(always)]` on a closure (select/p2c.rs) needs stmt_expr_attributes.
#![feature(core_intrinsics, asm_experimental_arch, stmt_expr_attributes)]
#![allow(internal_features)]

// The stages, in the order a packet meets them (one per group, so that
// rustfmt keeps this order):
// 1. the wire format's offsets and codes, and bounds-checked packet access
mod wire;

mod packet;

// 2. headers → `Packet` (incl. the packet quoted by an ICMP error; a later
//    fragment gets its first fragment's ports)
mod parse;

mod fragment;

mod handover;

// 2b. the fast path: an established flow's bulk packets, in one call
mod fast_path;

// 3. the flow table: lookup, translations, new connections (and SNAT
//    tuples taken over inside the backend's TIME_WAIT)
mod flow;

mod time_wait;

// 4. admission and the backend choice (a global BPF function)
mod select;

// 5. full-NAT rewrite, incremental checksums, ICMP error translation
mod nat;

// 6. next-hop MACs, then XDP_TX or redirect (a new flow starts with its
//    backend's shared hop)
mod nexthop;

mod backend_hop;

// 7. connection state → in-flight counters and events; progress stamps
//    (written here, read by select)
mod track;

mod progress;

// 7b. the kernel sweep (a program of its own): idle expiry, SNAT
//     quarantine, orphans
mod sweep;

// 8. the ring buffer to the control plane
mod events;

// 9. per-reason and per-backend counters; the verdict counted once
mod stats;

// Benchmark floors of a new flow (never loaded by the control plane).
mod floor;

// Used by every stage: atomic read-modify-writes on map values, the clock
// and the random source, every map of the program.
mod atomic;
mod helpers;
mod maps;

use core::{mem::MaybeUninit, ops::ControlFlow};

use aya_ebpf::{
    bindings::{xdp_action, xdp_md},
    macros::xdp,
    programs::XdpContext,
};
use lb_common::{
    CALIBRATION_CALLS, CONFIG_F_READY, CONFIG_F_TIME_WAIT_REUSE, DIR_TO_CLIENT, EVENT_REFUSED,
    FLOW_F_CLOSED, FLOW_F_SYNACK_SEEN, FLOW_F_TW_UNACKED, FlowEntry, LbConfig, Reason, StageResult,
    Verdict, action, proceed, reason,
};

use crate::{
    flow::{ReturnPath, Syn, Translation, TupleSource},
    fragment::remember_first_fragment,
    helpers::{PacketClock, now},
    maps::CONFIG,
    packet::{FRAG_FIRST, FRAG_LATER, Packet, keep_ctx_pointer},
    parse::Parsed,
    select::Picked,
    stats::Direction,
    wire::{ETH_SRC_OFF, TCP_SYN},
};

// lb-common's action values are the kernel's.
const _: () = assert!(
    action::ABORTED == xdp_action::XDP_ABORTED
        && action::DROP == xdp_action::XDP_DROP
        && action::PASS == xdp_action::XDP_PASS
        && action::TX == xdp_action::XDP_TX
        && action::REDIRECT == xdp_action::XDP_REDIRECT
);

#[xdp]
pub fn lb_xdp(ctx: XdpContext) -> u32 {
    stats::finish(Verdict::of(try_lb(&ctx)))
}

/// The fast path, then the general pipeline of the frame's family.
#[inline(always)]
fn try_lb(ctx: &XdpContext) -> Result<Verdict, Reason> {
    // The bulk packets of established flows first (see `fast_path`).
    let known_no_flow =
        match StageResult::from_raw(fast_path::send_established(XdpContext::new(ctx.ctx))).next() {
            ControlFlow::Break(verdict) => return Ok(verdict),
            ControlFlow::Continue(payload) => u64::from(payload == fast_path::NO_FLOW),
        };
    Ok(Verdict::from_raw(if parse::frame_is_ipv6(ctx) {
        lb_general_v6(ctx.ctx, known_no_flow)
    } else {
        lb_general_v4(ctx.ctx, known_no_flow)
    }))
}

/// The general pipeline for IPv4 frames (and anything not IPv6, which its
/// parser passes): a global BPF function, verified once on its own, in
/// which the family is a constant of the code, not a byte of the parsed
/// packet that the verifier would follow both ways at every test.
/// `known_no_flow`: the fast path looked the frame's key up and found no
/// flow. Returns a [`Verdict`]'s integer.
#[unsafe(no_mangle)]
#[inline(never)]
pub fn lb_general_v4(ctx: *mut xdp_md, known_no_flow: u64) -> u64 {
    Verdict::of(general::<false>(&XdpContext::new(ctx), known_no_flow != 0)).into_raw()
}

/// [`lb_general_v4`] for IPv6 frames.
#[unsafe(no_mangle)]
#[inline(never)]
pub fn lb_general_v6(ctx: *mut xdp_md, known_no_flow: u64) -> u64 {
    Verdict::of(general::<true>(&XdpContext::new(ctx), known_no_flow != 0)).into_raw()
}

/// Parses and dispatches: the pipeline, one stage after the other, for
/// frames of one family (`V6`: IPv6, else IPv4). Inlined into one
/// function, the stages' locals (IPv6 keys, a 96-byte flow entry, FIB
/// parameters) would overflow the 512-byte stack.
#[inline(always)]
fn general<const V6: bool>(ctx: &XdpContext, known_no_flow: bool) -> Result<Verdict, Reason> {
    let mut pkt = MaybeUninit::uninit();
    let parsed = Parsed::from_payload(proceed!(parse::parse_into::<V6>(
        XdpContext::new(ctx.ctx),
        &mut pkt
    )));
    // SAFETY: `parse_into` wrote the packet (it continued).
    let pkt = unsafe { pkt.assume_init_ref() };
    let not_ours = Verdict::pass(match parsed {
        Parsed::IcmpError => reason::PASS_ICMP,
        Parsed::Transport => reason::PASS_NOT_VIP,
    });
    let Some(cfg) = CONFIG.get(0).filter(|c| c.flags & CONFIG_F_READY != 0) else {
        return Ok(not_ours);
    };
    let ctx = || XdpContext::new(ctx.ctx);
    // The packet's flow key, read where the parser wrote it (see
    // `Packet::flow_key`). For an ICMP error this is the key of the quoted
    // packet's flow in the direction the error travels (see parse::icmp).
    let key = pkt.flow_key();
    if parsed == Parsed::IcmpError {
        let Some(entry) = flow::lookup::<V6>(key) else {
            return Ok(not_ours);
        };
        // An error about a closed connection's SNAT tuple, whose client
        // tuple a newer connection took, would land in that connection
        // (a hard error while its connect is pending): dropped, as the
        // old connection's late replies are (see `reply_of_replaced`; the
        // parser wrote the quote's tuple as the reply packet's own).
        // SAFETY: live map value; direction and flags are plain loads.
        let (direction, flags) = unsafe { ((*entry).direction, (*entry).flags) };
        if direction == DIR_TO_CLIENT
            && flags & FLOW_F_CLOSED != 0
            && reply_of_replaced::<V6>(pkt, entry)
        {
            return Err(reason::DROP_SNAT_NO_FLOW);
        }
        return Ok(Verdict::from_raw(nat::icmp::translate(ctx(), pkt, entry)));
    }
    // A frame the fast path found no flow for is not looked up again.
    let found = if known_no_flow {
        None
    } else {
        flow::lookup::<V6>(key)
    };
    if let Some(entry) = found {
        // SAFETY: live map value; direction and flags are plain loads.
        let (direction, flags) = unsafe { ((*entry).direction, (*entry).flags) };
        if direction == DIR_TO_CLIENT {
            if flags & FLOW_F_CLOSED != 0 {
                // A SYN-ACK of a connection given up on (no answer within
                // the SYN timeout, closed by the sweep or by the SYN's
                // retransmission) would make the client's socket
                // established on a flow that no longer forwards its
                // packets: it would wait for its own timeout. Dropped, the
                // client retransmits its SYN, which is balanced again.
                if pkt.is_tcp() && pkt.has(TCP_SYN) || reply_of_replaced::<V6>(pkt, entry) {
                    return Err(reason::DROP_SNAT_NO_FLOW);
                }
                if flags & FLOW_F_TW_UNACKED != 0 {
                    time_wait::note_backend_ack(&ctx(), pkt, entry);
                }
            }
            return Ok(Verdict::from_raw(to_client::<V6>(ctx(), pkt, entry)));
        }
        if pkt.frag == FRAG_LATER {
            return Ok(Verdict::from_raw(to_backend::<V6>(
                ctx(),
                pkt,
                entry,
                false,
            )));
        }
        if !(pkt.is_tcp()
            && pkt.is_syn()
            && (flags & FLOW_F_CLOSED != 0
                || syn_went_unanswered::<V6>(pkt, entry, cfg.syn_timeout_ns)))
        {
            if time_wait::closes(pkt, flags) {
                time_wait::record_client_close(&ctx(), pkt);
            }
            return Ok(Verdict::from_raw(to_backend::<V6>(
                ctx(),
                pkt,
                entry,
                false,
            )));
        }
        // A new SYN on a closed connection's tuple starts a new connection;
        // its forward entry replaces the old one. The old reply entry was
        // stamped at the close and keeps its SNAT tuple in quarantine until
        // it is freed. So does a SYN retransmitted after `syn_timeout`
        // without an answer: that connection is closed as refused here, and
        // the retransmission balanced again (to another backend, most
        // likely), whenever the sweep's next pass would come.
    } else if pkt.frag == FRAG_LATER {
        // Its datagram's flow is gone (or was never ours): the host decides.
        return Ok(Verdict::pass(reason::PASS_FRAGMENT));
    } else if is_snat_tuple(pkt, cfg) {
        return Err(reason::DROP_SNAT_NO_FLOW);
    }
    let picked = Picked::from_payload(proceed!(select::pick_backend(pkt)));
    // Read again from the stack from here on, not kept in registers across
    // the pick: LLVM spilled eight of the packet's fields for the rest of
    // this function, which pushed `lb_general_v4`'s frame, in the call
    // chain `lb_xdp` → it → `lb_new_flow`, past the 512-byte stack.
    let pkt = core::hint::black_box(pkt);
    match new_flow(&ctx(), pkt, cfg, picked).next() {
        ControlFlow::Continue(_) => {}
        // No free tuple: a SYN may take over one whose backend's TIME_WAIT
        // accepts it (a global function of its own, like `new_flow`'s).
        ControlFlow::Break(refused)
            if refused.reason == reason::DROP_SNAT_EXHAUSTED
                && pkt.is_tcp()
                && pkt.is_syn()
                && cfg.flags & CONFIG_F_TIME_WAIT_REUSE != 0 =>
        {
            proceed!(time_wait::take_over(&ctx()));
        }
        ControlFlow::Break(verdict) => return Ok(verdict),
    }
    // Looked up again rather than returned: a BPF function returns one
    // register, and the verifier must see a map value pointer come from a
    // lookup. (Sent on here, not inside the global functions: there the
    // packet's header offsets, read back from the handover slot, would be
    // unknown to the verifier.)
    let fwd = flow::lookup::<V6>(key).ok_or(reason::DROP_FLOW_INSERT)?;
    Ok(Verdict::from_raw(to_backend::<V6>(ctx(), pkt, fwd, true)))
}

/// Whether the client SYN `pkt` retransmits the SYN of the open forward
/// entry `fwd`, which got no SYN-ACK within `syn_timeout_ns` of its
/// creation; if so, closes that connection as refused, as the sweep would:
/// counted closed, its reply entry stamped (the SNAT tuple's quarantine
/// starts), one `Refused` event. A BPF function of its own, so its reply
/// key is not in `lb_xdp`'s frame.
#[inline(never)]
fn syn_went_unanswered<const V6: bool>(
    pkt: &Packet,
    fwd: *mut FlowEntry,
    syn_timeout_ns: u64,
) -> bool {
    let now = now();
    // SAFETY: live map value; `created_ns` is written only at creation.
    let (flags, created) = unsafe { ((*fwd).flags, (*fwd).created_ns) };
    if flags & FLOW_F_SYNACK_SEEN != 0 || now.saturating_sub(created) <= syn_timeout_ns {
        return false;
    }
    if track::close_counted(fwd, now) {
        let reply = flow::lookup::<V6>(&Translation::of(fwd).opposite_key(pkt));
        flow::stamp_closed(reply, now);
        // SAFETY: live map value; written only at creation.
        let (backend_id, vip_id) = unsafe { ((*fwd).backend_id, (*fwd).vip_id) };
        events::emit(EVENT_REFUSED, 0, backend_id, vip_id, now, 0);
    }
    true
}

/// Whether `pkt` (of no flow) is addressed to a SNAT tuple
/// ([`maps::is_snat_tuple`]). Such a packet is a backend's reply after its
/// flow ended (or a stray); the host must never see it, as its sockets
/// would answer with an RST. A BPF function of its own, so its key is not
/// in `lb_xdp`'s stack frame (the 512-byte limit counts the deepest chain).
#[inline(never)]
fn is_snat_tuple(pkt: &Packet, cfg: &LbConfig) -> bool {
    maps::is_snat_tuple(pkt.daddr, pkt.family, pkt.dport, cfg)
}

/// Creates both flow entries of a new connection to the backend the pick
/// chose: continues, or drops under a reason. The work is done by a global
/// BPF function, [`lb_new_flow`], which gets the packet through the
/// handover slot. With time-wait reuse on, a SYN's sequence number and
/// timestamp go there too: its claim may take over the closed tuple at the
/// cursor, and `time_wait::take_over` (after a claim that found nothing)
/// reads them from the same slot.
#[inline(always)]
fn new_flow(ctx: &XdpContext, pkt: &Packet, cfg: &LbConfig, picked: Picked) -> StageResult {
    if !handover::put(pkt, picked.payload()) {
        return StageResult::verdict(Verdict::drop(reason::DROP_BAD_CONFIG));
    }
    if pkt.is_tcp() && pkt.is_syn() && cfg.flags & CONFIG_F_TIME_WAIT_REUSE != 0 {
        // Options it cannot read leave the slot's `TsOption::UNKNOWN`:
        // then no TIME_WAIT is taken to accept the SYN.
        time_wait::read_syn(ctx);
    }
    StageResult::from_raw(lb_new_flow(ctx.ctx))
}

/// [`new_flow`]'s global BPF function: verified once, on its own. As a
/// static one, it was walked again for every state `lb_xdp` reaches the
/// call in (the parse paths of both families and both protocols): about
/// 85k instructions in the release build and 100k in the debug one.
/// Returns a [`StageResult`]'s integer.
#[unsafe(no_mangle)]
#[inline(never)]
pub fn lb_new_flow(ctx: *mut xdp_md) -> u64 {
    let ctx = XdpContext::new(ctx);
    let (Some(slot), Some(cfg)) = (handover::taken(), CONFIG.get(0)) else {
        return StageResult::verdict(Verdict::drop(reason::DROP_BAD_CONFIG)).into_raw();
    };
    let picked = Picked::from_payload(slot.picked);
    let syn = Syn {
        seq: slot.seq,
        ts: slot.ts,
    };
    // The family becomes a constant of the code here, once.
    let pkt = &slot.pkt;
    StageResult::continue_or_drop(if pkt.is_v6() {
        create_flow::<true>(&ctx, pkt, cfg, picked, syn, TupleSource::Claim)
    } else {
        create_flow::<false>(&ctx, pkt, cfg, picked, syn, TupleSource::Claim)
    })
    .into_raw()
}

/// Creates both flow entries of a new connection to `picked`'s backend,
/// whose first packet is `syn`, on a SNAT tuple from `how` (each caller
/// passes a constant).
#[inline(always)]
fn create_flow<const V6: bool>(
    ctx: &XdpContext,
    pkt: &Packet,
    cfg: &LbConfig,
    picked: Picked,
    syn: Syn,
    how: TupleSource,
) -> Result<(), Reason> {
    // Looked up again by id: it left service only if it did so since the pick.
    let backend = select::by_id(picked.backend_id).ok_or(reason::DROP_NO_BACKEND)?;
    let client = ReturnPath {
        mac: packet::load(ctx, ETH_SRC_OFF).ok_or(reason::DROP_TRUNCATED)?,
        ifindex: ctx.ingress_ifindex() as u32,
    };
    // The pick's clock read (see `helpers::packet_clock`).
    let now = helpers::packet_clock();
    flow::create::<V6>(pkt, client, cfg, picked.vip_id, &backend, now, syn, how)?;
    track::opened(backend.id);
    Ok(())
}

/// Client → VIP packet of a known connection; returns its verdict
/// ([`Verdict::into_raw`]). `new_flow`: the packet just created `fwd` at
/// its backend pick's clock read, whose time it keeps (each caller passes
/// a constant).
#[inline(never)]
fn to_backend<const V6: bool>(
    ctx: XdpContext,
    pkt: &Packet,
    fwd: *mut FlowEntry,
    new_flow: bool,
) -> u64 {
    keep_ctx_pointer(&ctx);
    let clock = if new_flow {
        // Read from the entry, not the per-CPU slot: a plain load, where the
        // slot's fallback read would fork the verifier's walk of the rest.
        // SAFETY: live map value, written at creation by this packet.
        PacketClock::read_at(unsafe { (*fwd).created_ns })
    } else {
        PacketClock::new()
    };
    Verdict::of(forward_known::<V6>(
        &ctx,
        pkt,
        fwd,
        Direction::ToBackend,
        clock,
    ))
    .into_raw()
}

/// Backend → SNAT address packet of a known connection; returns its
/// verdict ([`Verdict::into_raw`]).
#[inline(never)]
fn to_client<const V6: bool>(ctx: XdpContext, pkt: &Packet, rev: *mut FlowEntry) -> u64 {
    keep_ctx_pointer(&ctx);
    Verdict::of(forward_known::<V6>(
        &ctx,
        pkt,
        rev,
        Direction::FromBackend,
        PacketClock::new(),
    ))
    .into_raw()
}

/// Translates and sends a packet of a known connection by its entry of the
/// direction it travels, and tracks the connection, with `clock` (read
/// already for a new flow's first packet). Each caller passes a constant
/// `direction`, so each BPF function keeps only its own half.
#[inline(always)]
fn forward_known<const V6: bool>(
    ctx: &XdpContext,
    pkt: &Packet,
    entry: *mut FlowEntry,
    direction: Direction,
    mut clock: PacketClock,
) -> Result<Verdict, Reason> {
    if pkt.frag == FRAG_FIRST {
        remember_first_fragment(pkt);
    }
    let to = Translation::of(entry);
    let deltas = nat::rewrite(ctx, pkt, &to)?;
    nat::learn_deltas(entry, pkt, deltas);
    // At most one clock read per packet, and none for a bulk packet of an
    // established flow (see `helpers::PacketClock`); a new flow's first
    // packet comes with its pick's. The reply direction checks its refresh
    // before the next hop: the refresh that is due once a second also
    // resolves the hop again. A later fragment leaves the refresh to its
    // datagram's tracked packets.
    let refresh = match direction {
        Direction::ToBackend => false,
        Direction::FromBackend => {
            pkt.frag != FRAG_LATER && track::reply_refresh_due(entry, &mut clock)
        }
    };
    let verdict = match direction {
        Direction::ToBackend => nexthop::forward_to_backend(ctx, pkt, &to, entry)?,
        Direction::FromBackend => nexthop::forward_to_client(ctx, pkt, &to, entry, refresh)?,
    };
    // A later fragment has no header to track: its bytes are counted.
    if pkt.frag == FRAG_LATER {
        stats::backend_traffic(to.backend_id, direction, pkt.frame_len);
        return Ok(verdict);
    }
    match direction {
        Direction::ToBackend => track::client_packet::<V6>(pkt, entry, &mut clock),
        // The forward entry holds the state: it is looked up (a second
        // flow lookup) only when the packet needs it or the refresh is due;
        // an established connection's bulk packets skip it. After a new SYN
        // reused the client tuple, it belongs to the new connection: a late
        // packet of the old one (another SNAT tuple) must not touch it.
        Direction::FromBackend => {
            // Evaluated first, always: it takes the reply entry's pending
            // bit for a payload (see `track::reply_needs_state`).
            let needs_state = track::reply_needs_state(pkt, entry);
            if (needs_state || refresh)
                && let Some(fwd) = flow::lookup::<V6>(&to.opposite_key(pkt))
                && flow::translates_to(fwd, pkt)
            {
                track::backend_packet::<V6>(pkt, fwd, clock.now());
            }
        }
    }
    stats::backend_traffic(to.backend_id, direction, pkt.frame_len);
    Ok(verdict)
}

/// Whether `rev`, the reply entry of a closed connection, translates to a
/// client tuple that a newer connection has taken (a new SYN from the same
/// client port, or the retransmission of a SYN given up on): its forward
/// entry now translates to another SNAT tuple. A late packet of the old
/// connection (a SYN-ACK after all, a retransmitted FIN) would land in the
/// new connection, which would answer with an ACK the new backend resets;
/// it is dropped instead, counted with the other late replies
/// (`drop_snat_no_flow`).
///
/// A BPF function of its own, called from `lb_xdp` before `to_client` (and
/// before an ICMP error about the entry is translated):
/// inlined into the reply path, the verifier walked the rest of that path
/// once more for each of its outcomes (about 66k instructions), and under
/// `to_client` its key overflowed the 512-byte stack.
#[inline(never)]
fn reply_of_replaced<const V6: bool>(pkt: &Packet, rev: *mut FlowEntry) -> bool {
    flow::lookup::<V6>(&Translation::of(rev).opposite_key(pkt))
        .is_some_and(|fwd| !flow::translates_to(fwd, pkt))
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
    if packet::swap_macs(&ctx) {
        xdp_action::XDP_TX
    } else {
        xdp_action::XDP_PASS
    }
}

/// Benchmark calibration: [`xdp_macswap_bench`] after
/// `lb_common::CALIBRATION_CALLS` calls of a BPF function that does nothing, so
/// `lb-bench-dataplane` can print what one call and its return cost on the
/// machine at hand. Every stage boundary of `lb_xdp` is such a call, and
/// where the kernel sends each return through a mitigation thunk (SRSO's
/// "Safe RET" on AMD without microcode) that price is not small.
#[xdp]
pub fn xdp_calls_bench(ctx: XdpContext) -> u32 {
    let mut returned = 0;
    for _ in 0..CALIBRATION_CALLS {
        returned += empty_call(XdpContext::new(ctx.ctx));
    }
    if returned == u64::from(CALIBRATION_CALLS) && packet::swap_macs(&ctx) {
        xdp_action::XDP_TX
    } else {
        xdp_action::XDP_PASS
    }
}

/// [`xdp_calls_bench`]'s BPF function: returns 1.
#[inline(never)]
fn empty_call(ctx: XdpContext) -> u64 {
    keep_ctx_pointer(&ctx);
    1
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
