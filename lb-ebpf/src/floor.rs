//! Benchmark floors of a new connection: what a full-NAT balancer with a
//! hash flow table pays per new flow before it does anything of its own.
//!
//! `lb-bench-dataplane` runs them next to `lb_xdp`'s new-flow cases, on the
//! same `FLOWS` table (its own client addresses, so no key meets another
//! case's). Each parses an IPv4 TCP/UDP frame with no options, looks its
//! 5-tuple up (a miss for every new client), inserts the forward entry, of
//! a flow's size, keeps the reply direction its way ([`Reply`]: not at all,
//! as a second entry under its own key, as `lb_xdp` keeps it, or as a way),
//! swaps the MACs and sends the frame back. No backend choice, no SNAT
//! claim, no rewrite, no counters. The control plane never loads them.
//!
//! A third floor, `xdp_floor_one_entry_way`, measures the layout that
//! would keep one hash entry per connection: the forward entry, and the
//! reply direction as a 16-byte way in an array indexed by the SNAT tuple,
//! claimed with an atomic OR at a per-CPU cursor that walks the array in
//! order (as the SNAT claim's cursor walks a CPU's slice of tuples).
use aya_ebpf::{
    bindings::xdp_action,
    macros::{map, xdp},
    maps::{Array, PerCpuArray},
    programs::XdpContext,
};
use lb_common::{AF_INET, FLOOR_WAY_CLAIMED, FlowEntry, FlowKey};

use crate::{
    atomic::fetch_or_u64,
    maps::FLOWS,
    packet,
    wire::{ETH_LEN, ETH_P_IPV4, ETH_TYPE_OFF, IPV4_MIN_LEN, IPV4_PROTO_OFF, IPV4_SADDR_OFF},
};

/// The one-entry floor's reply ways: `[claim, client]`, the claim word's
/// top bit set by the claim ([`FLOOR_WAY_CLAIMED`]), the client word the client's
/// address and ports. One way unless the loader sizes it (the benchmark
/// does; the control plane never uses it).
#[map(name = "FLOOR_REPLY_WAYS")]
pub static FLOOR_REPLY_WAYS: Array<[u64; 2]> = Array::with_max_entries(1, 0);
/// Per CPU: the next way the one-entry floor claims.
#[map(name = "FLOOR_WAY_CURSOR")]
pub static FLOOR_WAY_CURSOR: PerCpuArray<u32> = PerCpuArray::with_max_entries(1, 0);

/// Ways a claim tries before it gives up (taken ones are stepped over).
const WAY_TRIES: u32 = 4;

/// Version 4, a 20-byte header: the first byte of an IPv4 header without options.
const IPV4_NO_OPTIONS: u8 = 0x45;

/// How a floor keeps a connection's reply direction.
enum Reply {
    /// Not at all: the least a balancer with one hash entry pays.
    Nothing,
    /// As a hash entry of its own, as `lb_xdp` keeps it.
    Entry,
    /// As a claimed way (see the module documentation).
    Way,
}

/// The least a balancer with one hash entry per connection pays per new flow.
#[xdp]
pub fn xdp_floor_one_entry(ctx: XdpContext) -> u32 {
    new_flow_floor(&ctx, Reply::Nothing)
}

/// The same with an entry per direction, as `lb_xdp` keeps a connection.
#[xdp]
pub fn xdp_floor_two_entries(ctx: XdpContext) -> u32 {
    new_flow_floor(&ctx, Reply::Entry)
}

/// One hash entry, and the reply direction as a claimed way.
#[xdp]
pub fn xdp_floor_one_entry_way(ctx: XdpContext) -> u32 {
    new_flow_floor(&ctx, Reply::Way)
}

/// Claims the first free way from this CPU's cursor on (wrapping at the
/// array's end) for `client`, and moves the cursor past it.
#[inline(always)]
fn claim_way(client: u64) -> bool {
    let Some(cursor) = FLOOR_WAY_CURSOR.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: this CPU's own copy of a per-CPU map value.
    let mut at = unsafe { *cursor };
    for _ in 0..WAY_TRIES {
        let way = match FLOOR_REPLY_WAYS.get_ptr_mut(at) {
            Some(way) => way,
            None => {
                at = 0;
                match FLOOR_REPLY_WAYS.get_ptr_mut(0) {
                    Some(way) => way,
                    None => return false,
                }
            }
        };
        at = at.wrapping_add(1);
        // SAFETY: a live, 8-byte aligned array value; the claim is atomic.
        let old = unsafe { fetch_or_u64(&raw mut (*way)[0], FLOOR_WAY_CLAIMED) };
        if old & FLOOR_WAY_CLAIMED == 0 {
            // SAFETY: as above; this CPU owns the way it claimed.
            unsafe {
                (*way)[1] = client;
                *cursor = at;
            }
            return true;
        }
    }
    // SAFETY: as above.
    unsafe { *cursor = at };
    false
}

/// A floor: the forward entry for a new client, the `reply` direction
/// kept its way (each caller passes a constant), the MACs swapped.
#[inline(always)]
fn new_flow_floor(ctx: &XdpContext, reply: Reply) -> u32 {
    let Some(key) = ipv4_key(ctx) else {
        return xdp_action::XDP_PASS;
    };
    if FLOWS.get_ptr(&key).is_none() {
        let entry = FlowEntry::default();
        if FLOWS.insert(&key, &entry, 0).is_err() {
            return xdp_action::XDP_ABORTED;
        }
        let kept = match reply {
            Reply::Nothing => true,
            // The reply direction's key: another bucket, as in `lb_xdp`.
            Reply::Entry => FLOWS
                .insert(
                    FlowKey::new(
                        key.family, key.proto, key.dst, key.src, key.dport, key.sport,
                    ),
                    &entry,
                    0,
                )
                .is_ok(),
            Reply::Way => claim_way(
                (u64::from(key.src[0]) << 32) | (u64::from(key.sport) << 16) | u64::from(key.dport),
            ),
        };
        if !kept {
            return xdp_action::XDP_ABORTED;
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
