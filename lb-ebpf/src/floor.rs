//! Benchmark floors of a new connection: what a full-NAT balancer with a
//! hash flow table pays per new flow before it does anything of its own.
//!
//! `lb-bench-dataplane` runs them next to `lb_xdp`'s new-flow cases, on the
//! same `FLOWS` table (its own client addresses, so no key meets another
//! case's). Each parses an IPv4 TCP/UDP frame with no options, looks its
//! 5-tuple up (a miss for every new client), inserts `ENTRIES` entries of a
//! flow's size (the forward key; with two, also the key of the reply
//! direction, as `lb_xdp` keeps it), swaps the MACs and sends the frame
//! back. No backend choice, no SNAT claim, no rewrite, no counters. The
//! control plane never loads them.
use aya_ebpf::{bindings::xdp_action, macros::xdp, programs::XdpContext};
use lb_common::{AF_INET, FlowEntry, FlowKey};

use crate::{
    maps::FLOWS,
    packet,
    wire::{ETH_LEN, ETH_P_IPV4, ETH_TYPE_OFF, IPV4_MIN_LEN, IPV4_PROTO_OFF, IPV4_SADDR_OFF},
};

/// Version 4, a 20-byte header: the first byte of an IPv4 header without options.
const IPV4_NO_OPTIONS: u8 = 0x45;

/// The least a balancer with one hash entry per connection pays per new flow.
#[xdp]
pub fn xdp_floor_one_entry(ctx: XdpContext) -> u32 {
    new_flow_floor::<1>(&ctx)
}

/// The same with an entry per direction, as `lb_xdp` keeps a connection.
#[xdp]
pub fn xdp_floor_two_entries(ctx: XdpContext) -> u32 {
    new_flow_floor::<2>(&ctx)
}

#[inline(always)]
fn new_flow_floor<const ENTRIES: usize>(ctx: &XdpContext) -> u32 {
    let Some(key) = ipv4_key(ctx) else {
        return xdp_action::XDP_PASS;
    };
    if FLOWS.get_ptr(&key).is_none() {
        let entry = FlowEntry::default();
        if FLOWS.insert(&key, &entry, 0).is_err() {
            return xdp_action::XDP_ABORTED;
        }
        if ENTRIES == 2 {
            // The reply direction's key: another bucket, as in `lb_xdp`.
            let reply = FlowKey::new(
                key.family, key.proto, key.dst, key.src, key.dport, key.sport,
            );
            if FLOWS.insert(&reply, &entry, 0).is_err() {
                return xdp_action::XDP_ABORTED;
            }
        }
    }
    if packet::swap_macs(ctx) {
        xdp_action::XDP_TX
    } else {
        xdp_action::XDP_PASS
    }
}

/// The 5-tuple of an IPv4 frame without options, bounds-checked.
#[inline(always)]
fn ipv4_key(ctx: &XdpContext) -> Option<FlowKey> {
    let ether_type: u16 = packet::load(ctx, ETH_TYPE_OFF)?;
    let version_ihl: u8 = packet::load(ctx, ETH_LEN)?;
    if u16::from_be(ether_type) != ETH_P_IPV4 || version_ihl != IPV4_NO_OPTIONS {
        return None;
    }
    let [src, dst] = packet::load_words::<2>(ctx, ETH_LEN + IPV4_SADDR_OFF)?;
    let proto: u8 = packet::load(ctx, ETH_LEN + IPV4_PROTO_OFF)?;
    let [ports] = packet::load_words::<1>(ctx, ETH_LEN + IPV4_MIN_LEN)?;
    // Memory byte order: the source port is the first two bytes.
    let (sport, dport) = (ports as u16, (ports >> 16) as u16);
    Some(FlowKey::new(
        AF_INET,
        proto,
        [src, 0, 0, 0],
        [dst, 0, 0, 0],
        sport,
        dport,
    ))
}
