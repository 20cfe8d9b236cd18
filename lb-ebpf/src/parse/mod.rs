//! Header parsing: Ethernet, up to two VLAN tags, IPv4 (with options) or
//! IPv6 (with up to [`MAX_IPV6_EXT_HEADERS`] extension headers), TCP and
//! UDP; and ICMP errors, described by the packet they quote ([`icmp`]).
mod icmp;

use core::mem::MaybeUninit;

use aya_ebpf::programs::XdpContext;
use lb_common::{
    AF_INET, AF_INET6, IPPROTO_TCP, IPPROTO_UDP, Reason, StageResult, Verdict, reason,
};
use network_types::{ip::Ipv4Hdr, udp::UdpHdr};

use crate::{
    packet::{Packet, keep_ctx_pointer, load},
    wire::*,
};

/// Stacked tags we look through (802.1ad outer + 802.1Q inner).
const MAX_VLAN_TAGS: usize = 2;
/// Extension headers walked before giving up (hop-by-hop, routing,
/// destination options, fragment: one of each is the common worst case).
/// A longer chain is passed to the kernel, counted as `PASS_IPV6_EXT_LIMIT`.
pub const MAX_IPV6_EXT_HEADERS: usize = 4;

/// What the parser wrote out: [`parse_into`]'s payload when it continues.
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Parsed {
    /// A TCP/UDP packet, candidate for balancing.
    Transport = 0,
    /// An ICMP error quoting a TCP/UDP packet, described by the quote's
    /// reverse 5-tuple.
    IcmpError = 1,
}

impl Parsed {
    #[inline(always)]
    pub const fn from_payload(payload: u32) -> Self {
        if payload == Self::IcmpError as u32 {
            Self::IcmpError
        } else {
            Self::Transport
        }
    }
}

/// Parses the frame into `out`, as a BPF function of its own: the header
/// temporaries then live in its stack frame, not in the caller's. Continues
/// with a [`Parsed`] payload exactly when `out` was written; otherwise the
/// verdict is pass (not ours) or drop (malformed).
#[inline(never)]
pub fn parse_into(ctx: XdpContext, out: &mut MaybeUninit<Packet>) -> StageResult {
    keep_ctx_pointer(&ctx);
    let kind = match parse(&ctx) {
        Ok(Frame::Ip(pkt)) => {
            out.write(pkt);
            Parsed::Transport
        }
        Ok(Frame::Icmp(pkt)) => {
            out.write(pkt);
            Parsed::IcmpError
        }
        Ok(Frame::Pass(reason)) => return StageResult::verdict(Verdict::pass(reason)),
        Err(reason) => return StageResult::verdict(Verdict::drop(reason)),
    };
    StageResult::proceed(kind as u32)
}

/// What the parser found.
enum Frame {
    /// IPv4 or IPv6 TCP/UDP, candidate for balancing.
    Ip(Packet),
    /// An ICMP error quoting a TCP/UDP packet (see [`icmp::parse_error`]).
    Icmp(Packet),
    /// Not ours: pass it to the stack under this reason.
    Pass(Reason),
}

/// Parses the frame. Malformed or truncated IP is an `Err` (dropped); the
/// kernel would drop it too. Anything we cannot tell is IP passes untouched.
#[inline(always)]
fn parse(ctx: &XdpContext) -> Result<Frame, Reason> {
    let Some(mut ether_type) = load::<[u8; 2]>(ctx, ETH_TYPE_OFF).map(u16::from_be_bytes) else {
        return Ok(Frame::Pass(reason::PASS_NOT_IP));
    };
    let mut l3 = ETH_LEN;
    // Unrolled by LLVM: a constant bound keeps the verifier's path count small.
    for _ in 0..MAX_VLAN_TAGS {
        if ether_type != ETH_P_8021Q && ether_type != ETH_P_8021AD {
            break;
        }
        // A frame cut inside a tag cannot be shown to be IP: leave it to the stack.
        let Some(inner) = load::<[u8; 2]>(ctx, l3 + VLAN_TYPE_OFF).map(u16::from_be_bytes) else {
            return Ok(Frame::Pass(reason::PASS_NOT_IP));
        };
        ether_type = inner;
        l3 += VLAN_LEN;
    }
    match ether_type {
        ETH_P_IPV4 => parse_ipv4(ctx, l3),
        ETH_P_IPV6 => parse_ipv6(ctx, l3),
        _ => Ok(Frame::Pass(reason::PASS_NOT_IP)),
    }
}

#[inline(always)]
fn parse_ipv4(ctx: &XdpContext, l3: usize) -> Result<Frame, Reason> {
    let ip: Ipv4Hdr = load(ctx, l3).ok_or(reason::DROP_TRUNCATED)?;
    let ihl = ip.vihl & 0x0f;
    if ip.vihl >> 4 != 4 || !(IHL_MIN..=IHL_MAX).contains(&ihl) {
        return Err(reason::DROP_BAD_HEADER);
    }
    let ip_hdr_len = usize::from(ihl) * 4;
    let tot_len = usize::from(u16::from_be_bytes(ip.tot_len));
    if tot_len < ip_hdr_len {
        return Err(reason::DROP_BAD_HEADER);
    }
    let frame_len = ctx.data_end() - ctx.data();
    // Options, and the datagram the total length claims, must be in the frame.
    if l3 + tot_len > frame_len {
        return Err(reason::DROP_TRUNCATED);
    }
    let frags = u16::from_be_bytes(ip.frags);
    if frags & (IP_MF | IP_OFFSET_MASK) != 0 {
        return Ok(Frame::Pass(reason::PASS_FRAGMENT));
    }
    let l4 = l3 + ip_hdr_len;
    if ip.proto == IPPROTO_ICMP {
        let dst = [u32::from_ne_bytes(ip.dst_addr), 0, 0, 0];
        return Ok(icmp::parse_error(ctx, l3, l4, (AF_INET, dst), frame_len));
    }
    let Some(l4hdr) = parse_l4(ctx, ip.proto, l4, l3 + tot_len)? else {
        return Ok(Frame::Pass(reason::PASS_NOT_L4));
    };
    Ok(Frame::Ip(Packet {
        l3,
        l4,
        proto: ip.proto,
        family: AF_INET,
        saddr: [u32::from_ne_bytes(ip.src_addr), 0, 0, 0],
        daddr: [u32::from_ne_bytes(ip.dst_addr), 0, 0, 0],
        sport: l4hdr.sport,
        dport: l4hdr.dport,
        tcp_flags: l4hdr.tcp_flags,
        // Cannot underflow: tot_len >= ip_hdr_len + header len was checked.
        payload_len: (tot_len - ip_hdr_len - l4hdr.len) as u32,
        frame_len: frame_len as u32,
    }))
}

/// IPv6: the fixed header, then a bounded walk over extension headers.
/// Fragments (other than atomic ones) pass, like IPv4 fragments: only the
/// first one carries the ports, so the kernel reassembles them.
#[inline(always)]
fn parse_ipv6(ctx: &XdpContext, l3: usize) -> Result<Frame, Reason> {
    let fixed: [u8; IPV6_SADDR_OFF] = load(ctx, l3).ok_or(reason::DROP_TRUNCATED)?;
    if fixed[0] >> 4 != 6 {
        return Err(reason::DROP_BAD_HEADER);
    }
    let saddr: [u32; 4] = load(ctx, l3 + IPV6_SADDR_OFF).ok_or(reason::DROP_TRUNCATED)?;
    let daddr: [u32; 4] = load(ctx, l3 + IPV6_DADDR_OFF).ok_or(reason::DROP_TRUNCATED)?;
    let payload = usize::from(u16::from_be_bytes([
        fixed[IPV6_PLEN_OFF],
        fixed[IPV6_PLEN_OFF + 1],
    ]));
    let end = l3 + IPV6_LEN + payload;
    let frame_len = ctx.data_end() - ctx.data();
    if end > frame_len {
        return Err(reason::DROP_TRUNCATED);
    }
    let (next, l4) = match skip_ipv6_extensions(ctx, fixed[IPV6_NEXT_OFF], l3 + IPV6_LEN)? {
        Upper::Header(next, l4) => (next, l4),
        Upper::Pass(reason) => return Ok(Frame::Pass(reason)),
    };
    if l4 > end {
        return Err(reason::DROP_TRUNCATED);
    }
    if next == IPPROTO_ICMPV6 {
        return Ok(icmp::parse_error(ctx, l3, l4, (AF_INET6, daddr), frame_len));
    }
    let Some(l4hdr) = parse_l4(ctx, next, l4, end)? else {
        return Ok(Frame::Pass(reason::PASS_NOT_L4));
    };
    Ok(Frame::Ip(Packet {
        l3,
        l4,
        proto: next,
        family: AF_INET6,
        saddr,
        daddr,
        sport: l4hdr.sport,
        dport: l4hdr.dport,
        tcp_flags: l4hdr.tcp_flags,
        // Cannot underflow: l4 + header len <= end was checked.
        payload_len: (end - l4 - l4hdr.len) as u32,
        frame_len: frame_len as u32,
    }))
}

/// Where the IPv6 extension headers end.
enum Upper {
    /// The upper-layer protocol and its header's offset.
    Header(u8, usize),
    /// Not ours to parse: a fragment, or a longer chain than we walk.
    Pass(Reason),
}

/// Walks the extension headers from `l4`, whose type is `next`, up to
/// [`MAX_IPV6_EXT_HEADERS`] of them.
#[inline(always)]
fn skip_ipv6_extensions(ctx: &XdpContext, mut next: u8, mut l4: usize) -> Result<Upper, Reason> {
    // Unrolled by LLVM: a constant bound keeps the verifier's path count small.
    for _ in 0..MAX_IPV6_EXT_HEADERS {
        match next {
            IPV6_HOP_BY_HOP | IPV6_ROUTING | IPV6_DEST_OPTS => {
                let h: [u8; 2] = load(ctx, l4).ok_or(reason::DROP_TRUNCATED)?;
                next = h[0];
                l4 += IPV6_EXT_UNIT * (1 + usize::from(h[1]));
            }
            IPV6_FRAGMENT => {
                let h: [u8; IPV6_EXT_UNIT] = load(ctx, l4).ok_or(reason::DROP_TRUNCATED)?;
                if u16::from_be_bytes([h[2], h[3]]) & (IPV6_FRAG_OFFSET_MASK | IPV6_FRAG_MORE) != 0
                {
                    return Ok(Upper::Pass(reason::PASS_FRAGMENT));
                }
                next = h[0];
                l4 += IPV6_EXT_UNIT;
            }
            _ => break,
        }
    }
    if matches!(
        next,
        IPV6_HOP_BY_HOP | IPV6_ROUTING | IPV6_DEST_OPTS | IPV6_FRAGMENT
    ) {
        return Ok(Upper::Pass(reason::PASS_IPV6_EXT_LIMIT));
    }
    Ok(Upper::Header(next, l4))
}

/// The fields of a TCP or UDP header the data path uses.
struct L4Header {
    /// Network byte order.
    sport: u16,
    dport: u16,
    tcp_flags: u8,
    /// Header length in bytes.
    len: usize,
}

/// Parses the TCP or UDP header at `l4` of a datagram ending at `end`;
/// `None` for other protocols.
#[inline(always)]
fn parse_l4(
    ctx: &XdpContext,
    proto: u8,
    l4: usize,
    end: usize,
) -> Result<Option<L4Header>, Reason> {
    match proto {
        IPPROTO_TCP => {
            let tcp: [u8; TCP_MIN_LEN] = load(ctx, l4).ok_or(reason::DROP_TRUNCATED)?;
            let doff = tcp[TCP_DOFF_OFF] >> 4;
            if doff < DOFF_MIN {
                return Err(reason::DROP_BAD_HEADER);
            }
            let len = usize::from(doff) * 4;
            if l4 + len > end {
                return Err(reason::DROP_TRUNCATED);
            }
            Ok(Some(L4Header {
                sport: u16::from_ne_bytes([tcp[L4_SPORT_OFF], tcp[L4_SPORT_OFF + 1]]),
                dport: u16::from_ne_bytes([tcp[L4_DPORT_OFF], tcp[L4_DPORT_OFF + 1]]),
                tcp_flags: tcp[TCP_FLAGS_OFF],
                len,
            }))
        }
        IPPROTO_UDP => {
            let udp: UdpHdr = load(ctx, l4).ok_or(reason::DROP_TRUNCATED)?;
            if l4 + UdpHdr::LEN > end {
                return Err(reason::DROP_TRUNCATED);
            }
            Ok(Some(L4Header {
                sport: u16::from_ne_bytes(udp.src),
                dport: u16::from_ne_bytes(udp.dst),
                tcp_flags: 0,
                len: UdpHdr::LEN,
            }))
        }
        _ => Ok(None),
    }
}
