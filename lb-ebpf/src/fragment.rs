//! `FRAGMENTS`: the ports of each datagram's first fragment, so that its
//! later fragments, which carry no TCP/UDP header, find the same flow (see
//! `parse::parse_into`) and get the same translation.
use lb_common::{FragKey, FragPorts};

use crate::{maps::FRAGMENTS, packet::Packet};

/// The ports of the first fragment of `pkt`'s datagram (a later
/// fragment), packed as `1 << 32 | sport << 16 | dport`, or 0 if none was
/// seen. A BPF function of its own, so its key is not in `parse_into`'s
/// frame.
#[inline(never)]
pub fn first_fragment_ports(pkt: &Packet) -> u64 {
    // SAFETY: read-only lookup; the value is copied out at once.
    match unsafe { FRAGMENTS.get(&fragment_key(pkt)) } {
        Some(p) => (1 << 32) | (u64::from(p.sport) << 16) | u64::from(p.dport),
        None => 0,
    }
}

/// The `FRAGMENTS` key of a fragment of `pkt`'s datagram.
#[inline(always)]
fn fragment_key(pkt: &Packet) -> FragKey {
    FragKey {
        src: pkt.saddr,
        dst: pkt.daddr,
        id: pkt.frag_id,
        proto: pkt.proto,
        family: pkt.family,
        _pad: [0; 2],
    }
}

/// Remembers a first fragment's ports for its datagram's later fragments.
/// A failed insert (it cannot fail for lack of room: an LRU) leaves them
/// to the host.
#[inline(always)]
pub fn remember_first_fragment(pkt: &Packet) {
    let ports = FragPorts {
        sport: pkt.sport,
        dport: pkt.dport,
    };
    let _ = FRAGMENTS.insert(&fragment_key(pkt), &ports, 0);
}
