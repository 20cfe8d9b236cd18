//! ICMP and ICMPv6 errors (fragmentation needed / packet too big,
//! destination unreachable, time exceeded) quote the packet that caused
//! them, as its sender sent it. The parser describes such an error by the
//! quote's *reverse* 5-tuple: the flow-table key of the direction the error
//! travels, so it is looked up and translated like the flow's own packets
//! (see `nat::icmp`). Other ICMP passes to the kernel: echo requests to a
//! VIP are answered by the kernel (the VIP is an address of the interface),
//! and errors about packets of no flow are its business.
use aya_ebpf::programs::XdpContext;
use lb_common::{AF_INET6, IPPROTO_TCP, IPPROTO_UDP, reason};

use super::Frame;
use crate::{
    packet::{FRAG_NONE, Packet, load, load_words},
    wire::*,
};

/// Parses the ICMP message at `l4` of a packet to `outer_dst`: an error
/// quoting a TCP/UDP packet that `outer_dst` sent (same family) becomes
/// [`Frame::Icmp`], described by the quote's reverse 5-tuple; anything else
/// passes.
#[inline(always)]
pub(super) fn parse_error(
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
    let Some([ports]) = load_words::<1>(ctx, quote + hdr_len) else {
        return pass;
    };
    let (quoted_sport, quoted_dport) = super::split_ports(ports);
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
        sport: quoted_dport,
        dport: quoted_sport,
        tcp_flags: 0,
        frag: FRAG_NONE,
        frag_id: 0,
        payload_len: hdr_len as u32,
        frame_len: frame_len as u32,
        key_pad: [0; 2],
    })
}

/// The quoted IPv4 header: protocol, addresses, header length.
#[inline(always)]
fn quote_v4(ctx: &XdpContext, at: usize) -> Option<(u8, [u32; 4], [u32; 4], usize)> {
    let ip = load_words::<5>(ctx, at)?;
    let [vihl, ..] = ip[0].to_ne_bytes();
    let len = usize::from(vihl & 0x0f) * 4;
    if vihl >> 4 != 4 || len < IPV4_MIN_LEN {
        return None;
    }
    let proto = ip[IPV4_PROTO_OFF / 4].to_ne_bytes()[IPV4_PROTO_OFF % 4];
    let (saddr, daddr) = (ip[IPV4_SADDR_OFF / 4], ip[IPV4_DADDR_OFF / 4]);
    Some((proto, [saddr, 0, 0, 0], [daddr, 0, 0, 0], len))
}

/// The quoted IPv6 header: TCP/UDP must follow it directly, or after the
/// fragment header of a datagram's first fragment. A large datagram the
/// balancer sent in fragments (a backend's 4 KiB UDP answer) meets a path
/// of a smaller MTU: its packet-too-big quotes the first fragment, and
/// passed to the host its sender would never learn the path's MTU. (A
/// later fragment's quote has no ports: it passes.)
#[inline(always)]
fn quote_v6(ctx: &XdpContext, at: usize) -> Option<(u8, [u32; 4], [u32; 4], usize)> {
    let fixed: [u8; IPV6_SADDR_OFF] = load(ctx, at)?;
    if fixed[0] >> 4 != 6 {
        return None;
    }
    let saddr = load_words::<4>(ctx, at + IPV6_SADDR_OFF)?;
    let daddr = load_words::<4>(ctx, at + IPV6_DADDR_OFF)?;
    let next = fixed[IPV6_NEXT_OFF];
    if next != IPV6_FRAGMENT {
        return Some((next, saddr, daddr, IPV6_LEN));
    }
    let [after, _, off_hi, off_lo] = load::<[u8; 4]>(ctx, at + IPV6_LEN)?;
    if u16::from_be_bytes([off_hi, off_lo]) & IPV6_FRAG_OFFSET_MASK != 0 {
        return None;
    }
    Some((after, saddr, daddr, IPV6_LEN + IPV6_EXT_UNIT))
}
