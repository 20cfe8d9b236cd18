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
use lb_common::{FlowEntry, IPPROTO_TCP, Reason, reason};

use self::csum::CsumDelta;
use crate::{
    flow::Translation,
    packet::{FRAG_LATER, FRAG_NONE, Packet, ptr_at, word},
    wire::{
        IPV4_CHECK_OFF, IPV4_DADDR_OFF, IPV4_SADDR_OFF, IPV6_DADDR_OFF, IPV6_SADDR_OFF,
        L4_DPORT_OFF, L4_SPORT_OFF, TCP_CHECK_OFF, UDP_CHECK_OFF, UDP_CHECKSUM_ZERO,
        UDP_NO_CHECKSUM,
    },
};

/// The checksum changes a whole datagram's rewrite applied: of the IPv4
/// header (the addresses; nothing for IPv6) and of the TCP/UDP header
/// (addresses and ports). The same for every packet of a flow, so a flow
/// entry keeps them ([`learn_deltas`]) and the fast path applies them
/// ([`rewrite_by_deltas`]).
#[derive(Clone, Copy, Default)]
pub struct Deltas {
    ip: CsumDelta,
    l4: CsumDelta,
}

/// Rewrites `pkt` to `to.src:sport -> to.dst:dport`; a later fragment
/// (no TCP/UDP header) gets only its addresses, see [`rewrite_addresses`].
/// Returns the checksum changes (of a later fragment: none).
#[inline(always)]
pub fn rewrite(ctx: &XdpContext, pkt: &Packet, to: &Translation) -> Result<Deltas, Reason> {
    if pkt.frag == FRAG_LATER {
        rewrite_addresses(ctx, pkt, to)?;
        return Ok(Deltas::default());
    }
    // The L4 checksum covers the addresses through the pseudo header.
    let ip = if pkt.is_v6() {
        rewrite_ipv6_addrs(ctx, pkt, to)?
    } else {
        rewrite_ipv4_addrs(ctx, pkt, to)?
    };
    let l4 = ip.u16(pkt.sport, to.sport).u16(pkt.dport, to.dport);
    rewrite_ports(ctx, pkt, to, l4)?;
    Ok(Deltas { ip, l4 })
}

/// Keeps `deltas`, the changes of a whole datagram that `entry` translated
/// (not a fragment: its fields are then exactly the entry's key), in the
/// entry, if it has none yet (`FlowEntry::csum_ip`/`csum_l4`): from then
/// on its packets may take the fast path. Each field is a 16-bit store of
/// the one value every packet of the flow computes, so racing packets
/// store the same, and a reader sees 0 or that value.
#[inline(always)]
pub fn learn_deltas(entry: *mut FlowEntry, pkt: &Packet, deltas: Deltas) {
    if pkt.frag != FRAG_NONE {
        return;
    }
    // SAFETY: live map value; only these two fields are written, with
    // the values described above.
    unsafe {
        if (*entry).csum_l4 != 0 {
            return;
        }
        if !pkt.is_v6() {
            (*entry).csum_ip = deltas.ip.folded();
        }
        (*entry).csum_l4 = deltas.l4.folded();
    }
}

/// The fast path's rewrite of a whole datagram of family `V6` (else IPv4)
/// by `entry`, whose checksum changes are known ([`known_deltas`]): the
/// same result as [`rewrite`], without computing them from the packet's
/// and the translation's words again. Reads only the words of the family.
#[inline(always)]
pub fn rewrite_by_deltas<const V6: bool>(
    ctx: &XdpContext,
    pkt: &Packet,
    entry: *const FlowEntry,
    (ip, l4): (u16, u16),
) -> Result<Translation, Reason> {
    let to = if V6 {
        let to = Translation::of(entry);
        write_ipv6_addrs(ctx, pkt, &to)?;
        to
    } else {
        let to = Translation::of_ipv4(entry);
        write_ipv4_addrs(ctx, pkt, &to, CsumDelta::from_folded(ip))?;
        to
    };
    rewrite_ports(ctx, pkt, &to, CsumDelta::from_folded(l4))?;
    Ok(to)
}

/// `entry`'s checksum changes (IPv4 header, TCP/UDP) if it has learned
/// them ([`learn_deltas`]); IPv6 (`V6`) needs only the second.
#[inline(always)]
pub fn known_deltas<const V6: bool>(entry: *const FlowEntry) -> Option<(u16, u16)> {
    // SAFETY: live map value; 16-bit loads of fields that hold 0 or their
    // one value.
    let (ip, l4) = unsafe { ((*entry).csum_ip, (*entry).csum_l4) };
    (l4 != 0 && (V6 || ip != 0)).then_some((ip, l4))
}

/// Rewrites the ports and the TCP/UDP checksum by `l4`, the change of the
/// addresses and ports. (A frame too short for the header is dropped, so
/// the addresses already rewritten do not matter.)
#[inline(always)]
fn rewrite_ports(
    ctx: &XdpContext,
    pkt: &Packet,
    to: &Translation,
    l4: CsumDelta,
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

    // SAFETY: all pointers were bounds-checked above; word accesses
    // because headers sit at any even offset (see `packet::word`).
    unsafe {
        word::write16(sport, to.sport);
        word::write16(dport, to.dport);
        let old = word::read16(l4_check);
        let new = if pkt.proto == IPPROTO_TCP {
            l4.apply(old)
        } else if old == UDP_NO_CHECKSUM && !pkt.is_v6() {
            UDP_NO_CHECKSUM
        } else {
            match l4.apply(old) {
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
    let addrs = CsumDelta::default()
        .u32(pkt.saddr[0], to.src[0])
        .u32(pkt.daddr[0], to.dst[0]);
    write_ipv4_addrs(ctx, pkt, to, addrs)?;
    Ok(addrs)
}

/// Writes `to`'s IPv4 addresses and updates the header checksum by
/// `addrs`, their change.
#[inline(always)]
fn write_ipv4_addrs(
    ctx: &XdpContext,
    pkt: &Packet,
    to: &Translation,
    addrs: CsumDelta,
) -> Result<(), Reason> {
    let ip_check = ptr_at::<u16>(ctx, pkt.l3 + IPV4_CHECK_OFF).ok_or(reason::DROP_TRUNCATED)?;
    let saddr = ptr_at::<u32>(ctx, pkt.l3 + IPV4_SADDR_OFF).ok_or(reason::DROP_TRUNCATED)?;
    let daddr = ptr_at::<u32>(ctx, pkt.l3 + IPV4_DADDR_OFF).ok_or(reason::DROP_TRUNCATED)?;
    // SAFETY: bounds-checked above.
    unsafe {
        word::write16(ip_check, addrs.apply(word::read16(ip_check)));
        word::write32(saddr, to.src[0]);
        word::write32(daddr, to.dst[0]);
    }
    Ok(())
}

/// Rewrites the IPv6 addresses (IPv6 has no header checksum); returns the
/// address delta for the L4 checksum.
#[inline(always)]
fn rewrite_ipv6_addrs(
    ctx: &XdpContext,
    pkt: &Packet,
    to: &Translation,
) -> Result<CsumDelta, Reason> {
    write_ipv6_addrs(ctx, pkt, to)?;
    Ok(CsumDelta::default()
        .addr6(&pkt.saddr, &to.src)
        .addr6(&pkt.daddr, &to.dst))
}

/// Writes `to`'s IPv6 addresses.
#[inline(always)]
fn write_ipv6_addrs(ctx: &XdpContext, pkt: &Packet, to: &Translation) -> Result<(), Reason> {
    let saddr = ptr_at::<[u32; 4]>(ctx, pkt.l3 + IPV6_SADDR_OFF).ok_or(reason::DROP_TRUNCATED)?;
    let daddr = ptr_at::<[u32; 4]>(ctx, pkt.l3 + IPV6_DADDR_OFF).ok_or(reason::DROP_TRUNCATED)?;
    let (saddr, daddr) = (saddr.cast::<u32>(), daddr.cast::<u32>());
    // SAFETY: bounds-checked above.
    unsafe {
        for (i, (src, dst)) in to.src.iter().zip(to.dst.iter()).enumerate() {
            word::write32(saddr.add(i), *src);
            word::write32(daddr.add(i), *dst);
        }
    }
    Ok(())
}
