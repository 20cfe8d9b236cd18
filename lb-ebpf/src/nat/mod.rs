//! Full-NAT rewrite of addresses and ports (IPv4 and IPv6), with incremental
//! checksum updates ([`csum`]); ICMP errors about a flow are translated
//! like the flow itself ([`icmp`]).
//!
//! The TTL (IPv4) and hop limit (IPv6) are left alone on purpose, so a
//! packet arriving with 1 is balanced like any other: the balancer terminates the client's
//! path like a host-level proxy (the backend sees the SNAT address as its
//! peer), it does not forward as a router would.
mod csum;
pub mod icmp;

use aya_ebpf::programs::XdpContext;
use lb_common::{IPPROTO_TCP, Reason, reason};

use self::csum::CsumDelta;
use crate::{
    flow::Translation,
    packet::{FRAG_LATER, Packet, ptr_at, word},
    wire::{
        IPV4_CHECK_OFF, IPV4_DADDR_OFF, IPV4_SADDR_OFF, IPV6_DADDR_OFF, IPV6_SADDR_OFF,
        L4_DPORT_OFF, L4_SPORT_OFF, TCP_CHECK_OFF, UDP_CHECK_OFF, UDP_CHECKSUM_ZERO,
        UDP_NO_CHECKSUM,
    },
};

/// Rewrites `pkt` to `to.src:sport -> to.dst:dport`; a later fragment
/// (no TCP/UDP header) gets only its addresses, see [`rewrite_addresses`].
#[inline(always)]
pub fn rewrite(ctx: &XdpContext, pkt: &Packet, to: &Translation) -> Result<(), Reason> {
    if pkt.frag == FRAG_LATER {
        return rewrite_addresses(ctx, pkt, to);
    }
    // The L4 checksum covers the addresses through the pseudo header.
    let addrs = if pkt.is_v6() {
        rewrite_ipv6_addrs(ctx, pkt, to)?
    } else {
        rewrite_ipv4_addrs(ctx, pkt, to)?
    };
    rewrite_ports(ctx, pkt, to, addrs)
}

/// [`rewrite`] for a whole IPv4 datagram: the fast path's, whose
/// translation holds only the IPv4 words (`Translation::of_ipv4`).
#[inline(always)]
pub fn rewrite_ipv4(ctx: &XdpContext, pkt: &Packet, to: &Translation) -> Result<(), Reason> {
    let addrs = rewrite_ipv4_addrs(ctx, pkt, to)?;
    rewrite_ports(ctx, pkt, to, addrs)
}

/// Rewrites the ports and the TCP/UDP checksum, whose change includes
/// `addrs`, the addresses' delta. (A frame too short for the header is
/// dropped, so the addresses already rewritten do not matter.)
#[inline(always)]
fn rewrite_ports(
    ctx: &XdpContext,
    pkt: &Packet,
    to: &Translation,
    addrs: CsumDelta,
) -> Result<(), Reason> {
    // Every field is re-checked against data_end: the verifier does not
    // carry the parser's bounds across to these pointers.
    let sport = ptr_at::<u16>(ctx, pkt.l4 + L4_SPORT_OFF).ok_or(reason::DROP_TRUNCATED)?;
    let dport = ptr_at::<u16>(ctx, pkt.l4 + L4_DPORT_OFF).ok_or(reason::DROP_TRUNCATED)?;
    let check_off = if pkt.proto == IPPROTO_TCP {
        TCP_CHECK_OFF
    } else {
        UDP_CHECK_OFF
    };
    let l4_check = ptr_at::<u16>(ctx, pkt.l4 + check_off).ok_or(reason::DROP_TRUNCATED)?;
    let ports = addrs.u16(pkt.sport, to.sport).u16(pkt.dport, to.dport);

    // SAFETY: all pointers were bounds-checked above; word accesses
    // because headers sit at any even offset (see `packet::word`).
    unsafe {
        word::write16(sport, to.sport);
        word::write16(dport, to.dport);
        let old = word::read16(l4_check);
        let new = if pkt.proto == IPPROTO_TCP {
            ports.apply(old)
        } else if old == UDP_NO_CHECKSUM && !pkt.is_v6() {
            UDP_NO_CHECKSUM
        } else {
            match ports.apply(old) {
                UDP_NO_CHECKSUM => UDP_CHECKSUM_ZERO,
                sum => sum,
            }
        };
        word::write16(l4_check, new);
    }
    Ok(())
}

/// Rewrites a later fragment's addresses (and the IPv4 header checksum).
/// Its payload is left alone: the TCP/UDP checksum, which covers the
/// addresses and ports of the whole datagram, was updated in the first
/// fragment by the same translation's delta, and the sum of the
/// reassembled datagram is therefore right.
#[inline(always)]
fn rewrite_addresses(ctx: &XdpContext, pkt: &Packet, to: &Translation) -> Result<(), Reason> {
    if pkt.is_v6() {
        rewrite_ipv6_addrs(ctx, pkt, to)?;
    } else {
        rewrite_ipv4_addrs(ctx, pkt, to)?;
    }
    Ok(())
}

/// Rewrites the IPv4 addresses and header checksum; returns the address
/// delta for the L4 checksum.
#[inline(always)]
fn rewrite_ipv4_addrs(
    ctx: &XdpContext,
    pkt: &Packet,
    to: &Translation,
) -> Result<CsumDelta, Reason> {
    let ip_check = ptr_at::<u16>(ctx, pkt.l3 + IPV4_CHECK_OFF).ok_or(reason::DROP_TRUNCATED)?;
    let saddr = ptr_at::<u32>(ctx, pkt.l3 + IPV4_SADDR_OFF).ok_or(reason::DROP_TRUNCATED)?;
    let daddr = ptr_at::<u32>(ctx, pkt.l3 + IPV4_DADDR_OFF).ok_or(reason::DROP_TRUNCATED)?;
    let (new_src, new_dst) = (to.src[0], to.dst[0]);
    let addrs = CsumDelta::default()
        .u32(pkt.saddr[0], new_src)
        .u32(pkt.daddr[0], new_dst);
    // SAFETY: bounds-checked above.
    unsafe {
        word::write16(ip_check, addrs.apply(word::read16(ip_check)));
        word::write32(saddr, new_src);
        word::write32(daddr, new_dst);
    }
    Ok(addrs)
}

/// Rewrites the IPv6 addresses (IPv6 has no header checksum); returns the
/// address delta for the L4 checksum.
#[inline(always)]
fn rewrite_ipv6_addrs(
    ctx: &XdpContext,
    pkt: &Packet,
    to: &Translation,
) -> Result<CsumDelta, Reason> {
    let saddr = ptr_at::<[u32; 4]>(ctx, pkt.l3 + IPV6_SADDR_OFF).ok_or(reason::DROP_TRUNCATED)?;
    let daddr = ptr_at::<[u32; 4]>(ctx, pkt.l3 + IPV6_DADDR_OFF).ok_or(reason::DROP_TRUNCATED)?;
    let (saddr, daddr) = (saddr.cast::<u32>(), daddr.cast::<u32>());
    let addrs = CsumDelta::default()
        .addr6(&pkt.saddr, &to.src)
        .addr6(&pkt.daddr, &to.dst);
    // SAFETY: bounds-checked above.
    unsafe {
        for (i, (src, dst)) in to.src.iter().zip(to.dst.iter()).enumerate() {
            word::write32(saddr.add(i), *src);
            word::write32(daddr.add(i), *dst);
        }
    }
    Ok(addrs)
}
