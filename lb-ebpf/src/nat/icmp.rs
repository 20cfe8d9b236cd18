//! ICMP and ICMPv6 errors about balanced flows (fragmentation needed /
//! packet too big, destination unreachable, time exceeded), translated like
//! the flow itself, so path-MTU discovery works through the full NAT.
//!
//! The parser (`parse::icmp`) describes an error by the quoted packet's
//! reverse 5-tuple, the flow-table key of the direction the error travels.
//! With that entry's translation `src -> dst`:
//! - the outer addresses become `src -> dst`, like the flow's own packets;
//! - the quote becomes `dst -> src` (ports too): the packet as the error's
//!   new receiver sent it, so its stack finds the socket.
//!
//! Checksums are updated incrementally: the outer and the quoted IPv4
//! header, and the ICMP checksum over every changed word (ICMPv6 also over
//! the outer addresses, through its pseudo header). The quoted TCP/UDP
//! checksum is left alone: the quote is usually cut short, so no stack can
//! (or does) verify it.
use aya_ebpf::programs::XdpContext;
use lb_common::{DIR_TO_BACKEND, FlowEntry, Reason, StageResult, Verdict, proceed, reason};

use super::csum::CsumDelta;
use crate::{
    flow::{ReturnPath, Translation},
    nexthop,
    packet::{Packet, keep_ctx_pointer, ptr_at},
    wire::{ICMP_CHECK_OFF, ICMP_HDR_LEN, IPV4_CHECK_OFF, IPV4_SADDR_OFF, IPV6_SADDR_OFF},
};

/// Bounds the quoted header length read back from the stack for the
/// verifier (IPv4 20..=60, IPv6 40, and 48 with a first fragment's
/// header, are multiples of 4 below 64).
const QUOTE_LEN_MASK: usize = 0x3c;

/// Translates the ICMP error `pkt` by the flow entry `entry` of the
/// direction it travels. A BPF function of its own (stack budget, see
/// `try_lb`); returns the packet's verdict ([`Verdict::into_raw`]).
#[inline(never)]
pub fn translate(ctx: XdpContext, pkt: &Packet, entry: *mut FlowEntry) -> u64 {
    keep_ctx_pointer(&ctx);
    Verdict::of(try_translate(&ctx, pkt, entry)).into_raw()
}

#[inline(always)]
fn try_translate(ctx: &XdpContext, pkt: &Packet, entry: *mut FlowEntry) -> Result<Verdict, Reason> {
    let to = Translation::of(entry);
    // SAFETY: live map value; the direction is written only at creation.
    let towards_backend = unsafe { (*entry).direction } == DIR_TO_BACKEND;
    proceed!(rewrite(XdpContext::new(ctx.ctx), pkt, &to));
    let (tx_reason, learned) = if towards_backend {
        (reason::TX_TO_BACKEND, ReturnPath::NONE)
    } else {
        (reason::TX_TO_CLIENT, ReturnPath::of(entry))
    };
    Ok(nexthop::forward_out_of_line(
        ctx, pkt, &to, tx_reason, learned,
    ))
}

/// Writes the outer addresses `to.src -> to.dst`, the quote as
/// `to.dst -> to.src` with ports, and updates the checksums. One BPF
/// function per family, each with a stack frame of its own (the next-hop
/// lookup's frame is separate). Continues, or drops under a reason.
#[inline(always)]
fn rewrite(ctx: XdpContext, pkt: &Packet, to: &Translation) -> StageResult {
    if pkt.is_v6() {
        rewrite6(ctx, pkt, to)
    } else {
        rewrite4(ctx, pkt, to)
    }
}

#[inline(never)]
fn rewrite4(ctx: XdpContext, pkt: &Packet, to: &Translation) -> StageResult {
    keep_ctx_pointer(&ctx);
    StageResult::continue_or_drop(try_rewrite4(&ctx, pkt, to))
}

#[inline(never)]
fn rewrite6(ctx: XdpContext, pkt: &Packet, to: &Translation) -> StageResult {
    keep_ctx_pointer(&ctx);
    StageResult::continue_or_drop(try_rewrite6(&ctx, pkt, to))
}

/// The quote's offset and its ports' offset.
#[inline(always)]
fn quote_offsets(pkt: &Packet) -> (usize, usize) {
    let quote = pkt.l4 + ICMP_HDR_LEN;
    (quote, quote + (pkt.payload_len as usize & QUOTE_LEN_MASK))
}

/// The quote was `pkt.daddr:dport -> pkt.saddr:sport` (reversed by the
/// parser); its ports become `to.dport -> to.sport`.
#[inline(always)]
fn write_ports(
    ctx: &XdpContext,
    at: usize,
    pkt: &Packet,
    to: &Translation,
    delta: CsumDelta,
) -> Result<CsumDelta, Reason> {
    let ports = ptr_at::<[u16; 2]>(ctx, at).ok_or(reason::DROP_TRUNCATED)?;
    // SAFETY: bounds-checked.
    unsafe { ports.write_unaligned([to.dport, to.sport]) };
    Ok(delta.u16(pkt.dport, to.dport).u16(pkt.sport, to.sport))
}

/// Applies `delta` to the ICMP checksum.
#[inline(always)]
fn fix_icmp_checksum(ctx: &XdpContext, pkt: &Packet, delta: CsumDelta) -> Result<(), Reason> {
    let check = ptr_at::<u16>(ctx, pkt.l4 + ICMP_CHECK_OFF).ok_or(reason::DROP_TRUNCATED)?;
    // SAFETY: bounds-checked.
    unsafe { check.write_unaligned(delta.apply(check.read_unaligned())) };
    Ok(())
}

#[inline(always)]
fn try_rewrite4(ctx: &XdpContext, pkt: &Packet, to: &Translation) -> Result<(), Reason> {
    let (quote, quote_l4) = quote_offsets(pkt);
    let outer_check = ptr_at::<u16>(ctx, pkt.l3 + IPV4_CHECK_OFF).ok_or(reason::DROP_TRUNCATED)?;
    let outer = ptr_at::<[u32; 2]>(ctx, pkt.l3 + IPV4_SADDR_OFF).ok_or(reason::DROP_TRUNCATED)?;
    let quote_check = ptr_at::<u16>(ctx, quote + IPV4_CHECK_OFF).ok_or(reason::DROP_TRUNCATED)?;
    let quoted = ptr_at::<[u32; 2]>(ctx, quote + IPV4_SADDR_OFF).ok_or(reason::DROP_TRUNCATED)?;
    let inner = CsumDelta::default()
        .u32(pkt.daddr[0], to.dst[0])
        .u32(pkt.saddr[0], to.src[0]);
    // SAFETY: all four were bounds-checked above.
    let icmp = unsafe {
        let [old_src, old_dst] = outer.read_unaligned();
        let outer_delta = CsumDelta::default()
            .u32(old_src, to.src[0])
            .u32(old_dst, to.dst[0]);
        outer_check.write_unaligned(outer_delta.apply(outer_check.read_unaligned()));
        outer.write_unaligned([to.src[0], to.dst[0]]);
        let old = quote_check.read_unaligned();
        let new = inner.apply(old);
        quote_check.write_unaligned(new);
        quoted.write_unaligned([to.dst[0], to.src[0]]);
        inner.u16(old, new)
    };
    let icmp = write_ports(ctx, quote_l4, pkt, to, icmp)?;
    fix_icmp_checksum(ctx, pkt, icmp)
}

#[inline(always)]
fn try_rewrite6(ctx: &XdpContext, pkt: &Packet, to: &Translation) -> Result<(), Reason> {
    let (quote, quote_l4) = quote_offsets(pkt);
    let outer =
        ptr_at::<[[u32; 4]; 2]>(ctx, pkt.l3 + IPV6_SADDR_OFF).ok_or(reason::DROP_TRUNCATED)?;
    let quoted =
        ptr_at::<[[u32; 4]; 2]>(ctx, quote + IPV6_SADDR_OFF).ok_or(reason::DROP_TRUNCATED)?;
    let router = outer.cast::<u32>();
    // The parser checked that the error is addressed to the quote's sender,
    // so the outer destination is `pkt.daddr` and the quote is
    // `pkt.daddr -> pkt.saddr`; only the outer source must be read. ICMPv6
    // covers the outer addresses through its pseudo header.
    // SAFETY: both address pairs were bounds-checked above.
    let icmp = unsafe {
        let delta = CsumDelta::default()
            .u32(router.read_unaligned(), to.src[0])
            .u32(router.add(1).read_unaligned(), to.src[1])
            .u32(router.add(2).read_unaligned(), to.src[2])
            .u32(router.add(3).read_unaligned(), to.src[3])
            .addr6(&pkt.daddr, &to.dst)
            .addr6(&pkt.daddr, &to.dst)
            .addr6(&pkt.saddr, &to.src);
        let outer = outer.cast::<[u32; 4]>();
        outer.write_unaligned(to.src);
        outer.add(1).write_unaligned(to.dst);
        let quoted = quoted.cast::<[u32; 4]>();
        quoted.write_unaligned(to.dst);
        quoted.add(1).write_unaligned(to.src);
        delta
    };
    let icmp = write_ports(ctx, quote_l4, pkt, to, icmp)?;
    fix_icmp_checksum(ctx, pkt, icmp)
}
