//! Header parsing: Ethernet, up to two VLAN tags, IPv4 (with options) or
//! IPv6 (with up to [`MAX_IPV6_EXT_HEADERS`] extension headers), TCP and
//! UDP; and ICMP errors, described by the packet they quote ([`icmp`]).
mod icmp;
mod malformed;
pub mod plain;

use core::mem::MaybeUninit;

use aya_ebpf::programs::XdpContext;
use lb_common::{
    AF_INET, AF_INET6, IPPROTO_TCP, IPPROTO_UDP, Reason, StageResult, Verdict, reason,
};
use network_types::{ip::Ipv4Hdr, udp::UdpHdr};

use self::malformed::BadTransport;
use crate::{
    fragment,
    handover::MAX_L4_OFFSET,
    packet::{
        FRAG_FIRST, FRAG_LATER, FRAG_NONE, Packet, keep_ctx_pointer, load, load_words, ptr_at, word,
    },
    wire::*,
};

/// Stacked tags we look through (802.1ad outer + 802.1Q inner).
const MAX_VLAN_TAGS: usize = 2;
/// Extension headers walked before giving up (hop-by-hop, routing,
/// destination options, fragment: one of each is the common worst case).
/// A longer chain is passed to the kernel, counted as `PASS_IPV6_EXT_LIMIT`,
/// and so are headers that end past [`MAX_L4_OFFSET`] and a routing header
/// with segments left (the VIP is not the final destination).
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
/// Parses frames of one family (`V6`: IPv6, else IPv4; see
/// [`frame_is_ipv6`]), one BPF function for each.
#[inline(never)]
pub fn parse_into<const V6: bool>(ctx: XdpContext, out: &mut MaybeUninit<Packet>) -> StageResult {
    keep_ctx_pointer(&ctx);
    let kind = match parse::<V6>(&ctx) {
        Ok(Frame::Ip(pkt)) => {
            let pkt = out.write(pkt);
            // A later fragment has no ports: its datagram's first fragment
            // left them in FRAGMENTS, and they become the packet's (nothing
            // reads a later fragment's L4 header).
            if pkt.frag == FRAG_LATER {
                let ports = fragment::first_fragment_ports(pkt);
                if ports == 0 {
                    return StageResult::verdict(Verdict::pass(reason::PASS_FRAGMENT));
                }
                pkt.sport = (ports >> 16) as u16;
                pkt.dport = ports as u16;
            }
            Parsed::Transport
        }
        Ok(Frame::Icmp(pkt)) => {
            out.write(pkt);
            Parsed::IcmpError
        }
        Ok(Frame::Pass(reason)) => return StageResult::verdict(Verdict::pass(reason)),
        Ok(Frame::BadTransport(bad)) => return malformed::verdict(&bad),
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
    /// A TCP or UDP header cut short or out of range: dropped if the
    /// packet is addressed to the balancer, else passed
    /// ([`malformed::verdict`]).
    BadTransport(BadTransport),
}

/// The frame's EtherType behind at most [`MAX_VLAN_TAGS`] tags and where
/// its L3 header starts; `None` for a frame cut inside a tag (anything we
/// cannot tell is IP passes untouched).
#[inline(always)]
fn inner_ether_type(ctx: &XdpContext) -> Option<(u16, usize)> {
    let mut ether_type = load::<[u8; 2]>(ctx, ETH_TYPE_OFF).map(u16::from_be_bytes)?;
    let mut l3 = ETH_LEN;
    // Unrolled by LLVM: a constant bound keeps the verifier's path count small.
    for _ in 0..MAX_VLAN_TAGS {
        if ether_type != ETH_P_8021Q && ether_type != ETH_P_8021AD {
            break;
        }
        ether_type = load::<[u8; 2]>(ctx, l3 + VLAN_TYPE_OFF).map(u16::from_be_bytes)?;
        l3 += VLAN_LEN;
    }
    Some((ether_type, l3))
}

/// Whether the frame is IPv6 (behind its VLAN tags): which family's
/// pipeline parses it. Everything else goes to IPv4's, whose parser passes
/// what is not IPv4.
#[inline(always)]
pub fn frame_is_ipv6(ctx: &XdpContext) -> bool {
    inner_ether_type(ctx).is_some_and(|(ether_type, _)| ether_type == ETH_P_IPV6)
}

/// Parses the frame, if it is of the family `V6` says. Malformed or
/// truncated IP is an `Err` (dropped); the kernel would drop it too. A
/// malformed transport header is [`Frame::BadTransport`]. Anything we
/// cannot tell is IP of that family passes untouched.
#[inline(always)]
fn parse<const V6: bool>(ctx: &XdpContext) -> Result<Frame, Reason> {
    match inner_ether_type(ctx) {
        Some((ETH_P_IPV4, l3)) if !V6 => parse_ipv4(ctx, l3),
        Some((ETH_P_IPV6, l3)) if V6 => parse_ipv6(ctx, l3),
        _ => Ok(Frame::Pass(reason::PASS_NOT_IP)),
    }
}

#[inline(always)]
fn parse_ipv4(ctx: &XdpContext, l3: usize) -> Result<Frame, Reason> {
    let ip = ptr_at::<Ipv4Hdr>(ctx, l3).ok_or(reason::DROP_TRUNCATED)?;
    // SAFETY: the whole 20-byte header was bounds-checked; word reads at
    // the fields' offsets (see `packet::word`).
    let (fixed, id, src, dst) = unsafe {
        let base = ip.cast::<u8>();
        (
            Ipv4Fixed::read(base),
            word::read16(base.add(IPV4_ID_OFF).cast()),
            word::read32(base.add(IPV4_SADDR_OFF).cast()),
            word::read32(base.add(IPV4_DADDR_OFF).cast()),
        )
    };
    let Ipv4Fixed {
        vihl,
        tot_len,
        frags,
        proto,
    } = fixed;
    let ihl = vihl & 0x0f;
    if vihl >> 4 != 4 || !(IHL_MIN..=IHL_MAX).contains(&ihl) {
        return Err(reason::DROP_BAD_HEADER);
    }
    let ip_hdr_len = usize::from(ihl) * 4;
    if tot_len < ip_hdr_len {
        return Err(reason::DROP_BAD_HEADER);
    }
    let frame_len = ctx.data_end() - ctx.data();
    // Options, and the datagram the total length claims, must be in the frame.
    if l3 + tot_len > frame_len {
        return Err(reason::DROP_TRUNCATED);
    }
    let frag = if frags & IP_OFFSET_MASK != 0 {
        FRAG_LATER
    } else if frags & IP_MF != 0 {
        FRAG_FIRST
    } else {
        FRAG_NONE
    };
    let l4 = l3 + ip_hdr_len;
    if proto == IPPROTO_ICMP {
        if frag != FRAG_NONE {
            return Ok(Frame::Pass(reason::PASS_FRAGMENT));
        }
        let dst = [dst, 0, 0, 0];
        return Ok(icmp::parse_error(ctx, l3, l4, (AF_INET, dst), frame_len));
    }
    let l4hdr = match l4_header(ctx, frag, proto, l4, l3 + tot_len) {
        Ok(Some(l4hdr)) => l4hdr,
        Ok(None) => return Ok(Frame::Pass(reason::PASS_NOT_L4)),
        Err(reason) => {
            let dport = dport_of(ctx, l4, l3 + tot_len);
            return Ok(Frame::BadTransport(BadTransport {
                reason,
                family: AF_INET,
                proto,
                dport,
                daddr: [dst, 0, 0, 0],
            }));
        }
    };
    Ok(Frame::Ip(Packet {
        l3,
        l4,
        proto,
        family: AF_INET,
        saddr: [src, 0, 0, 0],
        daddr: [dst, 0, 0, 0],
        sport: l4hdr.sport,
        dport: l4hdr.dport,
        tcp_flags: l4hdr.tcp_flags,
        frag,
        // The identification as memory bytes in the low half of a u32.
        frag_id: u32::from(id),
        // Cannot underflow: tot_len >= ip_hdr_len + header len was checked.
        payload_len: (tot_len - ip_hdr_len - l4hdr.len) as u32,
        frame_len: frame_len as u32,
        key_pad: [0; 2],
    }))
}

/// IPv6: the fixed header, then a bounded walk over extension headers. A
/// first fragment is parsed like a whole datagram; a later one stops at its
/// fragment header ([`later_fragment`]).
#[inline(always)]
fn parse_ipv6(ctx: &XdpContext, l3: usize) -> Result<Frame, Reason> {
    let ip = ptr_at::<[u8; IPV6_LEN]>(ctx, l3).ok_or(reason::DROP_TRUNCATED)?;
    // SAFETY: the whole 40-byte header was bounds-checked.
    let Ipv6Fixed {
        version,
        payload,
        next,
    } = unsafe { Ipv6Fixed::read(ip.cast()) };
    let saddr = load_words::<4>(ctx, l3 + IPV6_SADDR_OFF).ok_or(reason::DROP_TRUNCATED)?;
    let daddr = load_words::<4>(ctx, l3 + IPV6_DADDR_OFF).ok_or(reason::DROP_TRUNCATED)?;
    if version != 6 {
        return Err(reason::DROP_BAD_HEADER);
    }
    let end = l3 + IPV6_LEN + payload;
    let frame_len = ctx.data_end() - ctx.data();
    if end > frame_len {
        return Err(reason::DROP_TRUNCATED);
    }
    let (next, l4, (frag, frag_id)) = match skip_ipv6_extensions(ctx, next, l3 + IPV6_LEN)? {
        Upper::Header(next, l4, frag) => (next, l4, frag),
        Upper::Pass(reason) => return Ok(Frame::Pass(reason)),
    };
    if l4 > end {
        return Err(reason::DROP_TRUNCATED);
    }
    if next == IPPROTO_ICMPV6 {
        if frag != FRAG_NONE {
            return Ok(Frame::Pass(reason::PASS_FRAGMENT));
        }
        return Ok(icmp::parse_error(ctx, l3, l4, (AF_INET6, daddr), frame_len));
    }
    let l4hdr = match l4_header(ctx, frag, next, l4, end) {
        Ok(Some(l4hdr)) => l4hdr,
        Ok(None) => return Ok(Frame::Pass(reason::PASS_NOT_L4)),
        Err(reason) => {
            return Ok(Frame::BadTransport(BadTransport {
                reason,
                family: AF_INET6,
                proto: next,
                dport: dport_of(ctx, l4, end),
                daddr,
            }));
        }
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
        frag,
        frag_id,
        // Cannot underflow: l4 + header len <= end was checked.
        payload_len: (end - l4 - l4hdr.len) as u32,
        frame_len: frame_len as u32,
        key_pad: [0; 2],
    }))
}

/// The fields of an IPv4 header that both parsers (this one and
/// [`plain`]) test before the addresses.
pub(super) struct Ipv4Fixed {
    /// Version and header length (IHL), the first byte.
    pub vihl: u8,
    pub tot_len: usize,
    /// Flags and fragment offset, in host order.
    pub frags: u16,
    pub proto: u8,
}

impl Ipv4Fixed {
    /// Reads them with word reads at the fields' offsets (see `packet::word`).
    ///
    /// # Safety
    /// `ip` must be bounds-checked packet memory valid for a 20-byte header.
    #[inline(always)]
    pub(super) unsafe fn read(ip: *const u8) -> Self {
        // SAFETY: the caller's guarantee.
        unsafe {
            Self {
                vihl: ip.read(),
                tot_len: usize::from(u16::from_be(word::read16(ip.add(IPV4_TOT_LEN_OFF).cast()))),
                frags: u16::from_be(word::read16(ip.add(IPV4_FRAG_OFF).cast())),
                proto: ip.add(IPV4_PROTO_OFF).read(),
            }
        }
    }
}

/// The fields of an IPv6 header that both parsers test before the addresses.
pub(super) struct Ipv6Fixed {
    pub version: u8,
    /// The payload length (extension headers included).
    pub payload: usize,
    /// The next header's type.
    pub next: u8,
}

impl Ipv6Fixed {
    /// Reads them (see [`Ipv4Fixed::read`]).
    ///
    /// # Safety
    /// `ip` must be bounds-checked packet memory valid for a 40-byte header.
    #[inline(always)]
    pub(super) unsafe fn read(ip: *const u8) -> Self {
        // SAFETY: the caller's guarantee.
        unsafe {
            Self {
                version: ip.read() >> 4,
                payload: usize::from(u16::from_be(word::read16(ip.add(IPV6_PLEN_OFF).cast()))),
                next: ip.add(IPV6_NEXT_OFF).read(),
            }
        }
    }
}

/// [`parse_l4`], except for a later fragment of a TCP or UDP datagram,
/// which has no header: no ports (the first fragment has them; see
/// `lb_common::FragKey`) and its whole payload counted. Other protocols'
/// fragments are `None` (not ours).
#[inline(always)]
fn l4_header(
    ctx: &XdpContext,
    frag: u8,
    proto: u8,
    l4: usize,
    end: usize,
) -> Result<Option<L4Header>, Reason> {
    if frag != FRAG_LATER {
        return parse_l4(ctx, proto, l4, end);
    }
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP {
        return Ok(None);
    }
    Ok(Some(L4Header {
        sport: 0,
        dport: 0,
        tcp_flags: 0,
        len: 0,
    }))
}

/// Where the IPv6 extension headers end.
enum Upper {
    /// The upper-layer protocol, its header's offset (for a later
    /// fragment: where its payload starts), and the fragment kind and
    /// identification.
    Header(u8, usize, (u8, u32)),
    /// Not ours to parse: a fragment, or a longer chain than we walk.
    Pass(Reason),
}

/// Walks the extension headers from `l4`, whose type is `next`, up to
/// [`MAX_IPV6_EXT_HEADERS`] of them.
#[inline(always)]
fn skip_ipv6_extensions(ctx: &XdpContext, mut next: u8, mut l4: usize) -> Result<Upper, Reason> {
    // An atomic fragment (offset 0, no more) is a whole datagram.
    let mut frag = (FRAG_NONE, 0);
    // Unrolled by LLVM: a constant bound keeps the verifier's path count small.
    for _ in 0..MAX_IPV6_EXT_HEADERS {
        match next {
            IPV6_HOP_BY_HOP | IPV6_DEST_OPTS => {
                let h: [u8; 2] = load(ctx, l4).ok_or(reason::DROP_TRUNCATED)?;
                next = h[0];
                l4 += IPV6_EXT_UNIT * (1 + usize::from(h[1]));
            }
            IPV6_ROUTING => {
                let h: [u8; 4] = load(ctx, l4).ok_or(reason::DROP_TRUNCATED)?;
                // Segments left: the VIP is not the final destination, which
                // the transport checksum's pseudo-header names (RFC 8200
                // section 8.1): not ours to translate.
                if h[3] != 0 {
                    return Ok(Upper::Pass(reason::PASS_IPV6_EXT_LIMIT));
                }
                next = h[0];
                l4 += IPV6_EXT_UNIT * (1 + usize::from(h[1]));
            }
            IPV6_FRAGMENT => {
                let h: [u8; IPV6_EXT_UNIT] = load(ctx, l4).ok_or(reason::DROP_TRUNCATED)?;
                let bits = u16::from_be_bytes([h[2], h[3]]);
                next = h[0];
                l4 += IPV6_EXT_UNIT;
                let id = u32::from_ne_bytes([h[4], h[5], h[6], h[7]]);
                if bits & IPV6_FRAG_OFFSET_MASK != 0 {
                    // What follows is payload, not headers.
                    return Ok(Upper::Header(next, l4, (FRAG_LATER, id)));
                }
                if bits & IPV6_FRAG_MORE != 0 {
                    frag = (FRAG_FIRST, id);
                }
            }
            _ => break,
        }
    }
    // Headers that end past what a new flow's handover takes (up to about
    // 1 KiB of options) are passed too: balanced, the flow's creation
    // would refuse their offsets.
    if matches!(
        next,
        IPV6_HOP_BY_HOP | IPV6_ROUTING | IPV6_DEST_OPTS | IPV6_FRAGMENT
    ) || l4 >= MAX_L4_OFFSET
    {
        return Ok(Upper::Pass(reason::PASS_IPV6_EXT_LIMIT));
    }
    Ok(Upper::Header(next, l4, frag))
}

/// The destination port (network byte order) of the TCP or UDP header at
/// `l4` of a datagram ending at `end`, or [`malformed::NO_PORT`] if the
/// datagram does not hold it. (Not an `Option`: LLVM packs one into a
/// register shifted together with whatever the other path left there, a
/// packet pointer here, and the verifier refuses pointer shifts.)
#[inline(always)]
fn dport_of(ctx: &XdpContext, l4: usize, end: usize) -> u32 {
    // Hidden from LLVM: `end` was checked against the frame's length, so
    // LLVM would drop the frame bound's check below as implied, and the
    // verifier, which does not follow that arithmetic, would refuse the read.
    if l4 + L4_DPORT_OFF + 2 > core::hint::black_box(end) {
        return malformed::NO_PORT;
    }
    load::<[u8; 2]>(ctx, l4 + L4_DPORT_OFF).map_or(malformed::NO_PORT, |port| {
        u32::from(u16::from_ne_bytes(port))
    })
}

/// The fields of a TCP or UDP header the data path uses.
pub(super) struct L4Header {
    /// Network byte order.
    pub sport: u16,
    pub dport: u16,
    pub tcp_flags: u8,
    /// Header length in bytes.
    pub len: usize,
}

/// Parses the TCP or UDP header at `l4` of a datagram ending at `end`;
/// `None` for other protocols.
#[inline(always)]
pub(super) fn parse_l4(
    ctx: &XdpContext,
    proto: u8,
    l4: usize,
    end: usize,
) -> Result<Option<L4Header>, Reason> {
    match proto {
        IPPROTO_TCP => {
            let tcp = ptr_at::<[u8; TCP_MIN_LEN]>(ctx, l4).ok_or(reason::DROP_TRUNCATED)?;
            // SAFETY: the 20-byte header was bounds-checked.
            let ((sport, dport), doff_byte, tcp_flags) = unsafe {
                let base = tcp.cast::<u8>();
                (
                    read_ports(base),
                    base.add(TCP_DOFF_OFF).read(),
                    base.add(TCP_FLAGS_OFF).read(),
                )
            };
            let doff = doff_byte >> 4;
            if doff < DOFF_MIN {
                return Err(reason::DROP_BAD_HEADER);
            }
            let len = usize::from(doff) * 4;
            if l4 + len > end {
                return Err(reason::DROP_TRUNCATED);
            }
            Ok(Some(L4Header {
                sport,
                dport,
                tcp_flags,
                len,
            }))
        }
        IPPROTO_UDP => {
            let udp = ptr_at::<UdpHdr>(ctx, l4).ok_or(reason::DROP_TRUNCATED)?;
            if l4 + UdpHdr::LEN > end {
                return Err(reason::DROP_TRUNCATED);
            }
            // SAFETY: the 8-byte header was bounds-checked.
            let (sport, dport) = unsafe { read_ports(udp.cast()) };
            Ok(Some(L4Header {
                sport,
                dport,
                tcp_flags: 0,
                len: UdpHdr::LEN,
            }))
        }
        _ => Ok(None),
    }
}

/// Both ports of the TCP or UDP header at `l4`, in one word read (see
/// `packet::word`).
///
/// # Safety
/// `l4` must be bounds-checked packet memory valid for 4 bytes.
#[inline(always)]
unsafe fn read_ports(l4: *const u8) -> (u16, u16) {
    // SAFETY: the caller's guarantee.
    split_ports(unsafe { word::read32(l4.add(L4_SPORT_OFF).cast()) })
}

/// The source and destination port (network byte order) of the 32-bit
/// word that holds both, read in memory byte order: the source port's
/// bytes come first.
#[inline(always)]
pub(super) const fn split_ports(word: u32) -> (u16, u16) {
    let b = word.to_ne_bytes();
    (
        u16::from_ne_bytes([b[0], b[1]]),
        u16::from_ne_bytes([b[2], b[3]]),
    )
}
