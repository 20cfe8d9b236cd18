//! The common frame, parsed by the fast path without the general parser:
//! Ethernet with no VLAN tag; IPv4 without options and not fragmented, or
//! IPv6 with no extension header; a TCP or UDP header.
//! For such a frame the result is exactly what `parse_into` writes, since
//! every check the general parser makes on this shape is made here too.
//! Anything else, and anything the general parser would drop, is `None`:
//! the caller then runs the general parser, which decides.
use core::mem::MaybeUninit;

use aya_ebpf::programs::XdpContext;
use lb_common::{AF_INET, AF_INET6, IPPROTO_TCP, IPPROTO_UDP};
use network_types::udp::UdpHdr;

use super::{Ipv4Fixed, Ipv6Fixed, parse_l4};
use crate::{
    packet::{FRAG_NONE, Packet, load_words, ptr_at, word},
    wire::{
        ETH_LEN, ETH_TYPE_OFF, IP_MF, IP_OFFSET_MASK, IPV4_DADDR_OFF, IPV4_MIN_LEN, IPV4_SADDR_OFF,
        IPV6_DADDR_OFF, IPV6_LEN, IPV6_SADDR_OFF, TCP_MIN_LEN,
    },
};

/// Version 4 and a 20-byte header: the first byte of an IPv4 header
/// without options.
const IPV4_NO_OPTIONS: u8 = 0x45;

/// The frame's EtherType if it has no VLAN tag (a tag's type, 802.1Q or
/// 802.1ad, is not the fast path's).
#[inline(always)]
pub fn ether_type(ctx: &XdpContext) -> Option<u16> {
    let at = ptr_at::<u16>(ctx, ETH_TYPE_OFF)?;
    // SAFETY: bounds-checked above.
    Some(u16::from_be(unsafe { word::read16(at) }))
}

/// Writes the frame, whose EtherType is IPv6 if `V6` and IPv4 otherwise
/// ([`ether_type`]), into `out` as a [`Packet`], if it has the common
/// shape (see the module documentation); `None` leaves `out` partly
/// written. Each field is stored as soon as it is read: a `Packet` built
/// from values held until the end kept registers spilled to the stack
/// (about 170 bytes of them when this was inlined into `lb_xdp`).
#[inline(always)]
pub fn parse_plain<const V6: bool>(ctx: &XdpContext, out: &mut MaybeUninit<Packet>) -> Option<()> {
    let out = out.as_mut_ptr();
    let l3 = ETH_LEN;
    let (proto, l4, end) = if V6 {
        plain_ipv6(ctx, l3, out)?
    } else {
        plain_ipv4(ctx, l3, out)?
    };
    let Ok(Some(l4hdr)) = parse_l4(ctx, proto, l4, end) else {
        return None;
    };
    let frame_len = ctx.data_end() - ctx.data();
    // SAFETY: `out` is valid for writes of a `Packet`.
    unsafe {
        (&raw mut (*out).sport).write(l4hdr.sport);
        (&raw mut (*out).dport).write(l4hdr.dport);
        (&raw mut (*out).proto).write(proto);
        (&raw mut (*out).key_pad).write([0; 2]);
        (&raw mut (*out).l3).write(l3);
        (&raw mut (*out).l4).write(l4);
        (&raw mut (*out).tcp_flags).write(l4hdr.tcp_flags);
        (&raw mut (*out).frag).write(FRAG_NONE);
        (&raw mut (*out).frag_id).write(0);
        // Cannot underflow: `parse_l4` checked l4 + header len <= end.
        (&raw mut (*out).payload_len).write((end - l4 - l4hdr.len) as u32);
        (&raw mut (*out).frame_len).write(frame_len as u32);
    }
    Some(())
}

/// The fixed TCP or UDP header's bounds at `l4`, for protocol `proto`
/// (false for another protocol). Checked before the datagram's length:
/// checked after it, LLVM found them implied by it and dropped the pointer
/// comparison, and the verifier (which learns a packet range from nothing
/// else) rejected the header's read.
#[inline(always)]
fn l4_header_fits(ctx: &XdpContext, proto: u8, l4: usize) -> bool {
    match proto {
        IPPROTO_TCP => ptr_at::<[u8; TCP_MIN_LEN]>(ctx, l4).is_some(),
        IPPROTO_UDP => ptr_at::<UdpHdr>(ctx, l4).is_some(),
        _ => false,
    }
}

/// An IPv4 header without options, not a fragment, of TCP or UDP: its
/// addresses and family written to `out`; the protocol, where its
/// payload starts and where the datagram ends.
#[inline(always)]
fn plain_ipv4(ctx: &XdpContext, l3: usize, out: *mut Packet) -> Option<(u8, usize, usize)> {
    let ip = ptr_at::<[u8; IPV4_MIN_LEN]>(ctx, l3)?.cast::<u8>();
    // SAFETY: the 20-byte header was bounds-checked.
    let Ipv4Fixed {
        vihl,
        tot_len,
        frags,
        proto,
    } = unsafe { Ipv4Fixed::read(ip) };
    let l4 = l3 + IPV4_MIN_LEN;
    if !l4_header_fits(ctx, proto, l4)
        || vihl != IPV4_NO_OPTIONS
        || frags & (IP_MF | IP_OFFSET_MASK) != 0
        || tot_len < IPV4_MIN_LEN
        || ctx.data() + l3 + tot_len > ctx.data_end()
    {
        return None;
    }
    // SAFETY: as above; `out` is valid for writes of a `Packet`.
    unsafe {
        (&raw mut (*out).saddr).write([word::read32(ip.add(IPV4_SADDR_OFF).cast()), 0, 0, 0]);
        (&raw mut (*out).daddr).write([word::read32(ip.add(IPV4_DADDR_OFF).cast()), 0, 0, 0]);
        (&raw mut (*out).family).write(AF_INET);
    }
    Some((proto, l4, l3 + tot_len))
}

/// An IPv6 header followed by TCP or UDP (no extension header): as
/// [`plain_ipv4`].
#[inline(always)]
fn plain_ipv6(ctx: &XdpContext, l3: usize, out: *mut Packet) -> Option<(u8, usize, usize)> {
    let ip = ptr_at::<[u8; IPV6_LEN]>(ctx, l3)?.cast::<u8>();
    // SAFETY: the 40-byte header was bounds-checked.
    let Ipv6Fixed {
        version,
        payload,
        next,
    } = unsafe { Ipv6Fixed::read(ip) };
    let l4 = l3 + IPV6_LEN;
    if !l4_header_fits(ctx, next, l4) || version != 6 || ctx.data() + l4 + payload > ctx.data_end()
    {
        return None;
    }
    let saddr = load_words::<4>(ctx, l3 + IPV6_SADDR_OFF)?;
    let daddr = load_words::<4>(ctx, l3 + IPV6_DADDR_OFF)?;
    // SAFETY: `out` is valid for writes of a `Packet`.
    unsafe {
        (&raw mut (*out).saddr).write(saddr);
        (&raw mut (*out).daddr).write(daddr);
        (&raw mut (*out).family).write(AF_INET6);
    }
    Some((next, l4, l4 + payload))
}
