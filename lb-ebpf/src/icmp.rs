//! ICMP and ICMPv6 errors about balanced flows (fragmentation needed /
//! packet too big, destination unreachable, time exceeded), translated like
//! the flow itself, so path-MTU discovery works through the full NAT.
//!
//! An error quotes the packet that caused it, as its sender sent it. The
//! parser describes the error by that packet's reverse 5-tuple, which is
//! the flow-table key of the direction the error travels. With that entry's
//! translation `src -> dst`:
//! - the outer addresses become `src -> dst`, like the flow's own packets;
//! - the quote becomes `dst -> src` (ports too): the packet as the error's
//!   new receiver sent it, so its stack finds the socket.
//!
//! Checksums are updated incrementally: the outer and the quoted IPv4
//! header, and the ICMP checksum over every changed word (ICMPv6 also over
//! the outer addresses, through its pseudo header). The quoted TCP/UDP
//! checksum is left alone: the quote is usually cut short, so no stack can
//! (or does) verify it.
//!
//! Other ICMP passes to the kernel: echo requests to a VIP are answered by
//! the kernel (the VIP is an address of the interface), and errors about
//! packets of no flow are its business.
use aya_ebpf::programs::XdpContext;
use lb_common::{AF_INET6, DIR_TO_BACKEND, FlowEntry, IPPROTO_TCP, IPPROTO_UDP, reason};

use crate::{
    Reason, Verdict,
    csum::CsumDelta,
    finish,
    flow::{ReturnPath, Translation},
    nexthop,
    parse::{Frame, Packet, keep_ctx_pointer, load, ptr_at},
};

/// ICMPv4 error types: destination unreachable (incl. fragmentation
/// needed) and time exceeded.
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_TIME_EXCEEDED: u8 = 11;
/// ICMPv6 error types: destination unreachable, packet too big, time exceeded.
const ICMPV6_DEST_UNREACH: u8 = 1;
const ICMPV6_PACKET_TOO_BIG: u8 = 2;
const ICMPV6_TIME_EXCEEDED: u8 = 3;
/// The ICMP header (type, code, checksum, 4 more bytes) before the quote.
const ICMP_HDR_LEN: usize = 8;
const ICMP_CHECK_OFF: usize = 2;
/// IPv4 header: minimum length and offsets (outer and quoted alike).
const IPV4_MIN_LEN: usize = 20;
const IPV4_PROTO_OFF: usize = 9;
const IPV4_CHECK_OFF: usize = 10;
const IPV4_SADDR_OFF: usize = 12;
/// IPv6 header: length and offsets.
const IPV6_LEN: usize = 40;
const IPV6_NEXT_OFF: usize = 6;
const IPV6_SADDR_OFF: usize = 8;
const IPV6_DADDR_OFF: usize = 24;
/// Bounds the quoted header length read back from the stack for the
/// verifier (IPv4 20..=60 and IPv6 40 are multiples of 4 below 64).
const QUOTE_LEN_MASK: usize = 0x3c;

/// Parses the ICMP message at `l4` of a packet to `outer_dst`: an error
/// quoting a TCP/UDP packet that `outer_dst` sent (same family) becomes
/// [`Frame::Icmp`], described by the quote's reverse 5-tuple; anything else
/// passes.
#[inline(always)]
pub fn parse_error(
    ctx: &XdpContext,
    l3: usize,
    l4: usize,
    (family, outer_dst): (u8, [u32; 4]),
    frame_len: usize,
) -> Frame {
    let pass = Frame::Pass(reason::PASS_ICMP);
    let Some([kind, _code]) = load::<[u8; 2]>(ctx, l4) else {
        return pass;
    };
    let v6 = family == AF_INET6;
    let is_error = if v6 {
        matches!(
            kind,
            ICMPV6_DEST_UNREACH | ICMPV6_PACKET_TOO_BIG | ICMPV6_TIME_EXCEEDED
        )
    } else {
        matches!(kind, ICMP_DEST_UNREACH | ICMP_TIME_EXCEEDED)
    };
    if !is_error {
        return pass;
    }
    let quote = l4 + ICMP_HDR_LEN;
    let parsed = if v6 {
        quote_v6(ctx, quote)
    } else {
        quote_v4(ctx, quote)
    };
    let Some((proto, saddr, daddr, hdr_len)) = parsed else {
        return pass;
    };
    let Some(ports) = load::<[u16; 2]>(ctx, quote + hdr_len) else {
        return pass;
    };
    // An error goes to the quoted packet's sender; anything else is not
    // about a packet the balancer (or its flow's peer) sent.
    if (proto != IPPROTO_TCP && proto != IPPROTO_UDP) || saddr != outer_dst {
        return pass;
    }
    Frame::Icmp(Packet {
        l3,
        l4,
        proto,
        family,
        saddr: daddr,
        daddr: saddr,
        sport: ports[1],
        dport: ports[0],
        tcp_flags: 0,
        payload_len: hdr_len as u32,
        frame_len: frame_len as u32,
    })
}

/// The quoted IPv4 header: protocol, addresses, header length.
#[inline(always)]
fn quote_v4(ctx: &XdpContext, at: usize) -> Option<(u8, [u32; 4], [u32; 4], usize)> {
    let ip: [u32; 5] = load(ctx, at)?;
    let [vihl, ..] = ip[0].to_ne_bytes();
    let len = usize::from(vihl & 0x0f) * 4;
    if vihl >> 4 != 4 || len < IPV4_MIN_LEN {
        return None;
    }
    let proto = ip[IPV4_PROTO_OFF / 4].to_ne_bytes()[IPV4_PROTO_OFF % 4];
    Some((proto, [ip[3], 0, 0, 0], [ip[4], 0, 0, 0], len))
}

/// The quoted IPv6 header (TCP/UDP must follow it directly).
#[inline(always)]
fn quote_v6(ctx: &XdpContext, at: usize) -> Option<(u8, [u32; 4], [u32; 4], usize)> {
    let fixed: [u8; IPV6_SADDR_OFF] = load(ctx, at)?;
    if fixed[0] >> 4 != 6 {
        return None;
    }
    let saddr = load(ctx, at + IPV6_SADDR_OFF)?;
    let daddr = load(ctx, at + IPV6_DADDR_OFF)?;
    Some((fixed[IPV6_NEXT_OFF], saddr, daddr, IPV6_LEN))
}

/// Translates the ICMP error `pkt` by the flow entry `entry` of the
/// direction it travels. A BPF function of its own (stack budget, see
/// `try_lb`); returns the counted action.
#[inline(never)]
pub fn translate(ctx: XdpContext, pkt: &Packet, entry: *mut FlowEntry) -> u32 {
    keep_ctx_pointer(&ctx);
    finish(try_translate(&ctx, pkt, entry))
}

#[inline(always)]
fn try_translate(ctx: &XdpContext, pkt: &Packet, entry: *mut FlowEntry) -> Result<Verdict, Reason> {
    let to = Translation::of(entry);
    // SAFETY: live map value; the direction is written only at creation.
    let towards_backend = unsafe { (*entry).direction } == DIR_TO_BACKEND;
    match rewrite(XdpContext::new(ctx.ctx), pkt, &to) {
        REWRITTEN => {}
        failed => return Err(failed),
    }
    let (tx_reason, learned) = if towards_backend {
        (reason::TX_TO_BACKEND, None)
    } else {
        (reason::TX_TO_CLIENT, ReturnPath::of(entry))
    };
    nexthop::forward_out_of_line(ctx, pkt, &to, tx_reason, learned)
}

/// [`rewrite`]'s result when it rewrote the packet (not a reason index).
const REWRITTEN: u32 = u32::MAX;

/// Writes the outer addresses `to.src -> to.dst`, the quote as
/// `to.dst -> to.src` with ports, and updates the checksums. One BPF
/// function per family, each with a stack frame of its own (the next-hop
/// lookup's frame is separate). Returns [`REWRITTEN`] or the drop reason.
#[inline(always)]
fn rewrite(ctx: XdpContext, pkt: &Packet, to: &Translation) -> u32 {
    if pkt.is_v6() {
        rewrite6(ctx, pkt, to)
    } else {
        rewrite4(ctx, pkt, to)
    }
}

#[inline(never)]
fn rewrite4(ctx: XdpContext, pkt: &Packet, to: &Translation) -> u32 {
    keep_ctx_pointer(&ctx);
    result(try_rewrite4(&ctx, pkt, to))
}

#[inline(never)]
fn rewrite6(ctx: XdpContext, pkt: &Packet, to: &Translation) -> u32 {
    keep_ctx_pointer(&ctx);
    result(try_rewrite6(&ctx, pkt, to))
}

#[inline(always)]
fn result(r: Result<(), Reason>) -> u32 {
    match r {
        Ok(()) => REWRITTEN,
        Err(reason) => reason,
    }
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
