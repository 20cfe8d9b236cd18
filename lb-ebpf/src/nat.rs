//! Full-NAT rewrite of addresses and ports (IPv4 and IPv6), with incremental
//! checksum updates.
//!
//! The TTL (IPv4) and hop limit (IPv6) are left alone on purpose, so a
//! packet arriving with 1 is balanced like any other: the balancer terminates the client's
//! path like a host-level proxy (the backend sees the SNAT address as its
//! peer), it does not forward as a router would.
use aya_ebpf::programs::XdpContext;
use lb_common::{IPPROTO_TCP, reason};

use crate::{
    Reason,
    csum::CsumDelta,
    flow::Translation,
    parse::{Packet, ptr_at},
};

/// Offsets inside the IPv4 header.
const IP_CHECK_OFF: usize = 10;
const IP_SADDR_OFF: usize = 12;
const IP_DADDR_OFF: usize = 16;
/// Offsets inside the IPv6 header.
const IP6_SADDR_OFF: usize = 8;
const IP6_DADDR_OFF: usize = 24;
/// Offsets inside the TCP/UDP header (ports at 0 and 2 for both).
const L4_SPORT_OFF: usize = 0;
const L4_DPORT_OFF: usize = 2;
const TCP_CHECK_OFF: usize = 16;
const UDP_CHECK_OFF: usize = 6;
/// UDP: 0 means "no checksum" (IPv4 only), so a computed 0 is sent as 0xffff.
const UDP_NO_CHECKSUM: u16 = 0;
const UDP_CHECKSUM_ZERO: u16 = 0xffff;

/// Rewrites `pkt` to `to.src:sport -> to.dst:dport`.
#[inline(always)]
pub fn rewrite(ctx: &XdpContext, pkt: &Packet, to: &Translation) -> Result<(), Reason> {
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
    // The L4 checksum covers the addresses through the pseudo header.
    let addrs = if pkt.is_v6() {
        rewrite_ipv6_addrs(ctx, pkt, to)?
    } else {
        rewrite_ipv4_addrs(ctx, pkt, to)?
    };
    let ports = addrs.u16(pkt.sport, to.sport).u16(pkt.dport, to.dport);

    // SAFETY: all pointers were bounds-checked above; unaligned accesses
    // because headers sit at any even offset.
    unsafe {
        sport.write_unaligned(to.sport);
        dport.write_unaligned(to.dport);
        let old = l4_check.read_unaligned();
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
        l4_check.write_unaligned(new);
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
    let ip_check = ptr_at::<u16>(ctx, pkt.l3 + IP_CHECK_OFF).ok_or(reason::DROP_TRUNCATED)?;
    let saddr = ptr_at::<u32>(ctx, pkt.l3 + IP_SADDR_OFF).ok_or(reason::DROP_TRUNCATED)?;
    let daddr = ptr_at::<u32>(ctx, pkt.l3 + IP_DADDR_OFF).ok_or(reason::DROP_TRUNCATED)?;
    let (new_src, new_dst) = (to.src[0], to.dst[0]);
    let addrs = CsumDelta::default()
        .u32(pkt.saddr[0], new_src)
        .u32(pkt.daddr[0], new_dst);
    // SAFETY: bounds-checked above.
    unsafe {
        ip_check.write_unaligned(addrs.apply(ip_check.read_unaligned()));
        saddr.write_unaligned(new_src);
        daddr.write_unaligned(new_dst);
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
    let saddr = ptr_at::<[u32; 4]>(ctx, pkt.l3 + IP6_SADDR_OFF).ok_or(reason::DROP_TRUNCATED)?;
    let daddr = ptr_at::<[u32; 4]>(ctx, pkt.l3 + IP6_DADDR_OFF).ok_or(reason::DROP_TRUNCATED)?;
    let addrs = CsumDelta::default()
        .addr6(&pkt.saddr, &to.src)
        .addr6(&pkt.daddr, &to.dst);
    // SAFETY: bounds-checked above.
    unsafe {
        saddr.write_unaligned(to.src);
        daddr.write_unaligned(to.dst);
    }
    Ok(addrs)
}
