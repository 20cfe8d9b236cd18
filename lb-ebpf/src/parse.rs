//! Header parsing: Ethernet, up to two VLAN tags, IPv4 (with options), TCP and UDP.
//!
//! Every read goes through [`ptr_at`], which checks the whole object against
//! `data_end` first; the verifier rejects any packet access it cannot prove
//! in bounds, and a failed check here is also how truncated frames are found.
use core::mem::size_of;

use aya_ebpf::programs::XdpContext;
use lb_common::{IPPROTO_TCP, IPPROTO_UDP, reason};
use network_types::{ip::Ipv4Hdr, udp::UdpHdr};

use crate::Reason;

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

pub type Mac = [u8; 6];

/// TCP flag bits, as in byte 13 of the TCP header ([`Packet::tcp_flags`]).
pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;

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

/// A parsed IPv4 TCP or UDP packet, with its 5-tuple in wire byte order.
#[derive(Clone, Copy)]
pub struct Packet {
    /// Offset of the IPv4 header.
    pub l3: usize,
    /// Offset of the TCP/UDP header.
    pub l4: usize,
    pub proto: u8,
    /// Addresses as the `u32` whose memory bytes are the address bytes.
    pub saddr: u32,
    pub daddr: u32,
    /// Ports in network byte order.
    pub sport: u16,
    pub dport: u16,
    /// `TCP_*` bits; 0 for UDP.
    pub tcp_flags: u8,
    /// L4 payload bytes according to the IPv4 total length.
    pub payload_len: u32,
    /// Whole frame length, for byte counters.
    pub frame_len: u32,
}

impl Packet {
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
    /// IPv4 TCP/UDP, candidate for balancing.
    Ipv4(Packet),
    /// Not ours: pass it to the stack under this reason.
    Pass(Reason),
}

/// Parses the frame. Malformed or truncated IPv4 is an `Err` (dropped); the
/// kernel would drop it too. Anything we cannot tell is IP passes untouched.
#[inline(always)]
pub fn parse(ctx: &XdpContext) -> Result<Frame, Reason> {
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
        ETH_P_IPV6 => Ok(Frame::Pass(reason::PASS_IPV6)),
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
    let (sport, dport, tcp_flags, l4_hdr_len) = match ip.proto {
        IPPROTO_TCP => {
            let tcp: [u8; TCP_MIN_LEN] = load(ctx, l4).ok_or(reason::DROP_TRUNCATED)?;
            let doff = tcp[TCP_DOFF_OFF] >> 4;
            if doff < DOFF_MIN {
                return Err(reason::DROP_BAD_HEADER);
            }
            let tcp_len = usize::from(doff) * 4;
            if l4 + tcp_len > l3 + tot_len {
                return Err(reason::DROP_TRUNCATED);
            }
            (
                u16::from_ne_bytes([tcp[0], tcp[1]]),
                u16::from_ne_bytes([tcp[2], tcp[3]]),
                tcp[TCP_FLAGS_OFF],
                tcp_len,
            )
        }
        IPPROTO_UDP => {
            let udp: UdpHdr = load(ctx, l4).ok_or(reason::DROP_TRUNCATED)?;
            if l4 + UdpHdr::LEN > l3 + tot_len {
                return Err(reason::DROP_TRUNCATED);
            }
            (
                u16::from_ne_bytes(udp.src),
                u16::from_ne_bytes(udp.dst),
                0,
                UdpHdr::LEN,
            )
        }
        _ => return Ok(Frame::Pass(reason::PASS_NOT_L4)),
    };
    Ok(Frame::Ipv4(Packet {
        l3,
        l4,
        proto: ip.proto,
        saddr: u32::from_ne_bytes(ip.src_addr),
        daddr: u32::from_ne_bytes(ip.dst_addr),
        sport,
        dport,
        tcp_flags,
        // Cannot underflow: tot_len >= ip_hdr_len + l4_hdr_len was checked above.
        payload_len: (tot_len - ip_hdr_len - l4_hdr_len) as u32,
        frame_len: frame_len as u32,
    }))
}
