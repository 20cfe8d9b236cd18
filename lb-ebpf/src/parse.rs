//! Header parsing: Ethernet, up to two VLAN tags, IPv4 (with options) or
//! IPv6 (with up to [`MAX_IPV6_EXT_HEADERS`] extension headers), TCP and UDP.
//!
//! Every read goes through [`ptr_at`], which checks the whole object against
//! `data_end` first; the verifier rejects any packet access it cannot prove
//! in bounds, and a failed check here is also how truncated frames are found.
use core::mem::{MaybeUninit, size_of};

use aya_ebpf::programs::XdpContext;
use lb_common::{AF_INET, AF_INET6, IPPROTO_TCP, IPPROTO_UDP, reason};
use network_types::{ip::Ipv4Hdr, udp::UdpHdr};

use crate::{Reason, icmp};

/// Ethernet header length (no FCS in XDP), and offsets of its MAC addresses.
const ETH_LEN: usize = 14;
pub const ETH_DST_OFF: usize = 0;
pub const ETH_SRC_OFF: usize = 6;
/// Offset of the EtherType in the Ethernet header.
const ETH_TYPE_OFF: usize = 12;
/// One 802.1Q / 802.1ad tag: TCI (2) + inner EtherType (2).
const VLAN_LEN: usize = 4;
/// Stacked tags we look through (802.1ad outer + 802.1Q inner).
const MAX_VLAN_TAGS: usize = 2;

const ETH_P_IPV4: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88a8;

const IPPROTO_ICMP: u8 = 1;
const IPPROTO_ICMPV6: u8 = 58;

/// IHL bounds in 32-bit words: 5 is the bare header, 15 the maximum with options.
const IHL_MIN: u8 = 5;
const IHL_MAX: u8 = 15;
/// TCP header without options, and the offsets of its data-offset and flags bytes.
const TCP_MIN_LEN: usize = 20;
const TCP_DOFF_OFF: usize = 12;
const TCP_FLAGS_OFF: usize = 13;
/// Minimum TCP data offset in 32-bit words.
const DOFF_MIN: u8 = 5;
/// More-fragments flag and fragment offset mask of the (host order) `frags` field.
const IP_MF: u16 = 0x2000;
const IP_OFFSET_MASK: u16 = 0x1fff;

/// IPv6 fixed header length, and offsets of its fields.
const IPV6_LEN: usize = 40;
const IPV6_PLEN_OFF: usize = 4;
const IPV6_NEXT_OFF: usize = 6;
const IPV6_SADDR_OFF: usize = 8;
const IPV6_DADDR_OFF: usize = 24;
/// Extension headers walked before giving up (hop-by-hop, routing,
/// destination options, fragment: one of each is the common worst case).
/// A longer chain is passed to the kernel, counted as `PASS_IPV6_EXT_LIMIT`.
pub const MAX_IPV6_EXT_HEADERS: usize = 4;
const IPV6_HOP_BY_HOP: u8 = 0;
const IPV6_ROUTING: u8 = 43;
const IPV6_FRAGMENT: u8 = 44;
const IPV6_DEST_OPTS: u8 = 60;
/// Generic extension headers are `8 * (1 + len)` bytes; the fragment header is 8.
const IPV6_EXT_UNIT: usize = 8;
/// Fragment header: offset (13 bits) and M flag in the 16-bit word at byte 2.
const IPV6_FRAG_OFFSET_MASK: u16 = 0xfff8;
const IPV6_FRAG_MORE: u16 = 0x0001;

pub type Mac = [u8; 6];

/// TCP flag bits, as in byte 13 of the TCP header ([`Packet::tcp_flags`]).
pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;

/// Call first in every `#[inline(never)]` function that takes the context.
/// A volatile load through the context pointer stops LLVM's argument
/// promotion from passing the loaded `data`/`data_end` fields instead of the
/// pointer: the verifier sees such values as 32-bit scalars after the call
/// and rejects using them as packet pointers.
#[inline(always)]
pub fn keep_ctx_pointer(ctx: &XdpContext) {
    // SAFETY: the context pointer the kernel passed is valid for the whole run.
    let _ = unsafe { core::ptr::read_volatile(&raw const (*ctx.ctx).ingress_ifindex) };
}

/// Returns a pointer to a `T` at `offset` from the start of the frame, or
/// `None` if any byte of it lies beyond `data_end`.
#[inline(always)]
pub fn ptr_at<T>(ctx: &XdpContext, offset: usize) -> Option<*mut T> {
    let start = ctx.data();
    let end = ctx.data_end();
    if start + offset + size_of::<T>() > end {
        return None;
    }
    Some((start + offset) as *mut T)
}

/// Reads a `T` (any alignment) at `offset`, bounds-checked.
#[inline(always)]
pub fn load<T: Copy>(ctx: &XdpContext, offset: usize) -> Option<T> {
    // SAFETY: `ptr_at` proved the `size_of::<T>()` bytes are inside the frame.
    ptr_at::<T>(ctx, offset).map(|p| unsafe { p.read_unaligned() })
}

/// A parsed IPv4 or IPv6 TCP or UDP packet, with its 5-tuple in wire byte order.
#[derive(Clone, Copy)]
pub struct Packet {
    /// Offset of the IP header.
    pub l3: usize,
    /// Offset of the TCP/UDP header.
    pub l4: usize,
    pub proto: u8,
    /// `AF_INET` or `AF_INET6`.
    pub family: u8,
    /// Addresses as the `u32` words whose memory bytes are the address bytes
    /// (IPv4: word 0, the rest zero).
    pub saddr: [u32; 4],
    pub daddr: [u32; 4],
    /// Ports in network byte order.
    pub sport: u16,
    pub dport: u16,
    /// `TCP_*` bits; 0 for UDP.
    pub tcp_flags: u8,
    /// L4 payload bytes according to the IP length field. For an ICMP
    /// error ([`Frame::Icmp`]): the length of the quoted IP header.
    pub payload_len: u32,
    /// Whole frame length, for byte counters.
    pub frame_len: u32,
}

impl Packet {
    pub const fn is_v6(&self) -> bool {
        self.family == AF_INET6
    }

    pub const fn is_tcp(&self) -> bool {
        self.proto == IPPROTO_TCP
    }

    pub const fn has(&self, flag: u8) -> bool {
        self.tcp_flags & flag != 0
    }

    /// A connection opener: SYN without ACK.
    pub const fn is_syn(&self) -> bool {
        self.has(TCP_SYN) && !self.has(TCP_ACK)
    }
}

/// What the parser found.
pub enum Frame {
    /// IPv4 or IPv6 TCP/UDP, candidate for balancing.
    Ip(Packet),
    /// An ICMP error quoting a TCP/UDP packet (see `icmp::parse_error`).
    Icmp(Packet),
    /// Not ours: pass it to the stack under this reason.
    Pass(Reason),
}

/// [`parse_into`]'s result in one register (a BPF function returns one
/// 64-bit value): a packet was parsed, or pass / drop under a reason.
#[repr(transparent)]
pub struct Outcome(u64);

const OUTCOME_PACKET: u64 = 1 << 32;
const OUTCOME_DROP: u64 = 2 << 32;
const OUTCOME_ICMP: u64 = 3 << 32;

/// [`Outcome`] unpacked.
pub enum Parsed {
    /// A TCP/UDP packet was written out.
    Transport,
    /// An ICMP error about a TCP/UDP packet was written out.
    IcmpError,
    /// Pass under the reason.
    Pass(Reason),
}

impl Outcome {
    /// What was parsed; `Err(r)`: drop under `r`.
    #[inline(always)]
    pub fn get(&self) -> Result<Parsed, Reason> {
        let reason = self.0 as u32;
        match self.0 & !u64::from(u32::MAX) {
            OUTCOME_PACKET => Ok(Parsed::Transport),
            OUTCOME_ICMP => Ok(Parsed::IcmpError),
            OUTCOME_DROP => Err(reason),
            _ => Ok(Parsed::Pass(reason)),
        }
    }
}

/// Parses the frame into `out`, as a BPF function of its own: the header
/// temporaries then live in its stack frame, not in the caller's. `out` is
/// fully written exactly when the outcome is a packet.
#[inline(never)]
pub fn parse_into(ctx: XdpContext, out: &mut MaybeUninit<Packet>) -> Outcome {
    keep_ctx_pointer(&ctx);
    Outcome(match parse(&ctx) {
        Ok(Frame::Ip(pkt)) => {
            out.write(pkt);
            OUTCOME_PACKET
        }
        Ok(Frame::Icmp(pkt)) => {
            out.write(pkt);
            OUTCOME_ICMP
        }
        Ok(Frame::Pass(reason)) => u64::from(reason),
        Err(reason) => OUTCOME_DROP | u64::from(reason),
    })
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
        let Some(inner) = load::<[u8; 2]>(ctx, l3 + 2).map(u16::from_be_bytes) else {
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
    let mut next = fixed[IPV6_NEXT_OFF];
    let mut l4 = l3 + IPV6_LEN;
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
                    return Ok(Frame::Pass(reason::PASS_FRAGMENT));
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
        return Ok(Frame::Pass(reason::PASS_IPV6_EXT_LIMIT));
    }
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
                sport: u16::from_ne_bytes([tcp[0], tcp[1]]),
                dport: u16::from_ne_bytes([tcp[2], tcp[3]]),
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
