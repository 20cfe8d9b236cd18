//! The flow table: two entries per connection, keyed by the 5-tuple seen on
//! the wire in each direction (see `lb_common::FlowEntry`).
use aya_ebpf::bindings::{BPF_ANY, BPF_NOEXIST};
use lb_common::{
    AF_INET6, DIR_TO_BACKEND, DIR_TO_CLIENT, FLOW_ESTABLISHED, FLOW_SYN_SENT, FlowEntry, FlowKey,
    LbConfig, Reason, SNAT_PORT_TRIES, reason,
};

use crate::{
    helpers::random,
    maps::FLOWS,
    packet::{Mac, Packet},
    select::Chosen,
};

/// `-EEXIST` from a `BPF_NOEXIST` insert: the SNAT port is taken.
const EEXIST: i32 = -17;

/// Where the client's frames came from: the next hop back to the client.
#[derive(Clone, Copy)]
pub struct ReturnPath {
    pub mac: Mac,
    pub ifindex: u32,
}

impl ReturnPath {
    /// The return path stored in a reply entry, if it has one.
    #[inline(always)]
    pub fn of(entry: *const FlowEntry) -> Option<Self> {
        // SAFETY: live map value; written only when the entry is created.
        let (mac, ifindex) = unsafe { ((*entry).client_mac, (*entry).client_ifindex) };
        (ifindex != 0).then_some(Self { mac, ifindex })
    }
}

/// A 5-tuple key (IPv4 addresses in word 0, the rest zero).
#[inline(always)]
pub fn key(family: u8, proto: u8, src: [u32; 4], dst: [u32; 4], sport: u16, dport: u16) -> FlowKey {
    FlowKey {
        src,
        dst,
        sport,
        dport,
        proto,
        family,
        _pad: [0; 2],
    }
}

/// The key of the packet as received.
#[inline(always)]
pub fn packet_key(pkt: &Packet) -> FlowKey {
    key(
        pkt.family, pkt.proto, pkt.saddr, pkt.daddr, pkt.sport, pkt.dport,
    )
}

/// What an entry says to do with a packet, copied out of the map value so
/// no reference to it is held while other CPUs update its flags.
#[derive(Clone, Copy)]
pub struct Translation {
    pub src: [u32; 4],
    pub dst: [u32; 4],
    /// Network byte order.
    pub sport: u16,
    pub dport: u16,
    pub backend_id: u32,
}

impl Translation {
    #[inline(always)]
    pub fn of(entry: *const FlowEntry) -> Self {
        // SAFETY: `entry` is a live map value; these fields are written only
        // when the entry is created.
        unsafe {
            Self {
                src: (*entry).new_src,
                dst: (*entry).new_dst,
                sport: (*entry).new_sport,
                dport: (*entry).new_dport,
                backend_id: (*entry).backend_id,
            }
        }
    }

    /// The key of the rewritten packets seen coming back: the other
    /// direction's entry of the same connection (same family and protocol:
    /// the balancer never translates between IPv4 and IPv6).
    #[inline(always)]
    pub fn opposite_key(&self, pkt: &Packet) -> FlowKey {
        key(
            pkt.family, pkt.proto, self.dst, self.src, self.dport, self.sport,
        )
    }
}

#[inline(always)]
pub fn lookup(key: &FlowKey) -> Option<*mut FlowEntry> {
    FLOWS.get_ptr_mut(key)
}

/// Creates both entries of a new connection from the client packet `pkt`
/// (which arrived by `client`) to `backend`, picking a free SNAT port: the
/// reply entry claims the port, then the forward entry is written.
#[inline(always)]
pub fn create(
    pkt: &Packet,
    client: ReturnPath,
    cfg: &LbConfig,
    vip_id: u32,
    backend: &Chosen,
    now: u64,
) -> Result<(), Reason> {
    let snat = Snat::of(cfg, pkt, backend)?;
    // One 96-byte entry, filled as the reply entry and then turned into
    // the forward one: two would not fit the 512-byte stack next to the rest.
    let mut entry = reply_entry(pkt, client, vip_id, backend.id, now);
    let port = claim_snat_port(pkt, backend, &snat, &entry)?;
    into_forward_entry(&mut entry, &snat, port, backend);
    insert_forward(pkt, &entry)
}

/// Where new flows' source addresses come from: the SNAT address of the
/// packet's family and the port range.
struct Snat {
    addr: [u32; 4],
    port_min: u16,
    /// Ports in the range, 1..=65536.
    span: u32,
}

impl Snat {
    /// The configured SNAT address and range, if they can serve `pkt`'s
    /// family towards `backend`.
    #[inline(always)]
    fn of(cfg: &LbConfig, pkt: &Packet, backend: &Chosen) -> Result<Self, Reason> {
        let (min, max) = (cfg.snat_port_min, cfg.snat_port_max);
        if min > max {
            return Err(reason::DROP_BAD_CONFIG);
        }
        let addr = if pkt.family == AF_INET6 {
            cfg.snat_v6
        } else {
            cfg.snat_v4
        };
        if addr == [0; 4] || backend.family != pkt.family {
            return Err(reason::DROP_BAD_CONFIG);
        }
        Ok(Self {
            addr,
            port_min: min,
            span: u32::from(max - min) + 1,
        })
    }

    /// A random port of the range, in network byte order.
    #[inline(always)]
    fn random_port(&self) -> u16 {
        // span is in 1..=65536, so the remainder fits a u16 offset from min.
        let port = (u32::from(self.port_min) + random() % self.span) as u16;
        port.to_be()
    }
}

/// The reply (backend → client) entry of a new connection: it translates
/// the backend's packets back to `VIP → client` and holds the client's
/// return path.
#[inline(always)]
fn reply_entry(
    pkt: &Packet,
    client: ReturnPath,
    vip_id: u32,
    backend_id: u32,
    now: u64,
) -> FlowEntry {
    FlowEntry {
        new_src: pkt.daddr,
        new_dst: pkt.saddr,
        new_sport: pkt.dport,
        new_dport: pkt.sport,
        backend_id,
        vip_id,
        direction: DIR_TO_CLIENT,
        state: if pkt.is_tcp() {
            FLOW_SYN_SENT
        } else {
            FLOW_ESTABLISHED
        },
        created_ns: now,
        last_seen_ns: now,
        client_mac: client.mac,
        client_ifindex: client.ifindex,
        ..FlowEntry::default()
    }
}

/// Inserts `reply` under a free SNAT port's key (`backend → SNAT:port`),
/// trying up to `SNAT_PORT_TRIES` random ports; returns the port (network
/// byte order).
#[allow(
    clippy::needless_borrows_for_generic_args,
    reason = "the 96-byte entry is passed by reference; by value it would be copied on the 512-byte stack"
)]
#[inline(always)]
fn claim_snat_port(
    pkt: &Packet,
    backend: &Chosen,
    snat: &Snat,
    reply: &FlowEntry,
) -> Result<u16, Reason> {
    for _ in 0..SNAT_PORT_TRIES {
        let port = snat.random_port();
        let reverse = key(
            pkt.family,
            pkt.proto,
            backend.addr,
            snat.addr,
            backend.port,
            port,
        );
        // NOEXIST makes the check and the claim one step: two CPUs racing
        // for the same port cannot both win it.
        match FLOWS.insert(reverse, reply, u64::from(BPF_NOEXIST)) {
            Ok(()) => return Ok(port),
            Err(EEXIST) => {}
            Err(_) => return Err(reason::DROP_FLOW_INSERT),
        }
    }
    Err(reason::DROP_SNAT_EXHAUSTED)
}

/// Turns the reply entry into the forward (client → backend) one: it
/// translates the client's packets to `SNAT:port → backend`.
#[inline(always)]
fn into_forward_entry(entry: &mut FlowEntry, snat: &Snat, port: u16, backend: &Chosen) {
    entry.new_src = snat.addr;
    entry.new_dst = backend.addr;
    entry.new_sport = port;
    entry.new_dport = backend.port;
    entry.direction = DIR_TO_BACKEND;
    entry.client_mac = [0; 6];
    entry.client_ifindex = 0;
}

/// Inserts the forward entry under the packet's own key; on failure, the
/// reply entry (and its SNAT port) is released again, so no half of the
/// connection survives alone.
#[allow(
    clippy::needless_borrows_for_generic_args,
    reason = "the 96-byte entry is passed by reference; by value it would be copied on the 512-byte stack"
)]
#[inline(always)]
fn insert_forward(pkt: &Packet, forward: &FlowEntry) -> Result<(), Reason> {
    // ANY: a closed connection's entry for the same client tuple is replaced.
    if FLOWS
        .insert(&packet_key(pkt), forward, u64::from(BPF_ANY))
        .is_err()
    {
        let _ = FLOWS.remove(Translation::of(forward).opposite_key(pkt));
        return Err(reason::DROP_FLOW_INSERT);
    }
    Ok(())
}
