//! A full flow table without traffic: established TCP connections written
//! straight into the running instance's pinned flow table (`FLOWS4` for
//! IPv4), both entries of
//! each connection, laid out exactly as the data path writes them (see
//! lb-ebpf's `flow.rs`: the reply entry's key is the forward entry's
//! rewrite reversed, and it rewrites back to the client). The kernel sweep
//! therefore treats them as live connections: neither orphans nor idle
//! (for the TCP idle timeout, 300 s by default) nor unanswered SYNs.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::Path,
};

use anyhow::{Context as _, Result, bail};
use lb_common::{
    DIR_TO_BACKEND, DIR_TO_CLIENT, FLOW_ESTABLISHED, FLOW_F_SYNACK_SEEN, FlowEntry, FlowKey,
    IPPROTO_TCP,
};
use lb_user::kernel::{
    clock::{Clock as _, MonotonicClock},
    wire::{ip_to_words, port_to_wire},
};

/// Client ports used per client address.
const PORTS_PER_CLIENT: u32 = 50_000;
const FIRST_CLIENT_PORT: u32 = 10_000;
/// Clients come from 10.200.0.0 upwards (never configured anywhere).
const FIRST_CLIENT: u32 = u32::from_be_bytes([10, 200, 0, 0]);

/// Where the synthetic connections go.
#[derive(Clone, Debug)]
pub struct FlowPlan {
    pub vip: SocketAddr,
    pub vip_id: u32,
    /// Backends as `(address, id)`; connection `i` goes to `i % len`.
    pub backends: Vec<(SocketAddr, u32)>,
    /// The SNAT address and the first SNAT port; each backend's
    /// connections use consecutive ports from it.
    pub snat: IpAddr,
    pub snat_first_port: u16,
}

impl FlowPlan {
    /// Most connections the plan can hold with distinct SNAT tuples.
    pub fn capacity(&self) -> u64 {
        (65_536 - u64::from(self.snat_first_port)) * self.backends.len() as u64
    }

    /// Both entries of connection `i`: `[(forward key, entry), (reply key, entry)]`.
    pub fn connection(&self, i: u64, now_ns: u64) -> [(FlowKey, FlowEntry); 2] {
        let n = self.backends.len() as u64;
        let (backend, backend_id) = self.backends[(i % n) as usize];
        let snat_port = u64::from(self.snat_first_port) + i / n;
        let client_ip = IpAddr::V4(Ipv4Addr::from(
            FIRST_CLIENT + (i / u64::from(PORTS_PER_CLIENT)) as u32,
        ));
        let client_port = (FIRST_CLIENT_PORT + (i % u64::from(PORTS_PER_CLIENT)) as u32) as u16;
        let (client, family) = ip_to_words(client_ip);
        let (vip, _) = ip_to_words(self.vip.ip());
        let (snat, _) = ip_to_words(self.snat);
        let (backend_addr, _) = ip_to_words(backend.ip());
        let key = |src, dst, sport: u16, dport: u16| FlowKey {
            src,
            dst,
            sport: port_to_wire(sport),
            dport: port_to_wire(dport),
            proto: IPPROTO_TCP,
            family,
            _pad: [0; 2],
        };
        let entry = |new_src, new_dst, new_sport: u16, new_dport: u16, direction| FlowEntry {
            new_src,
            new_dst,
            new_sport: port_to_wire(new_sport),
            new_dport: port_to_wire(new_dport),
            backend_id,
            vip_id: self.vip_id,
            direction,
            state: FLOW_ESTABLISHED,
            flags: FLOW_F_SYNACK_SEEN,
            created_ns: now_ns,
            last_seen_ns: now_ns,
            ..FlowEntry::default()
        };
        let snat_port = snat_port as u16;
        [
            (
                key(client, vip, client_port, self.vip.port()),
                entry(
                    snat,
                    backend_addr,
                    snat_port,
                    backend.port(),
                    DIR_TO_BACKEND,
                ),
            ),
            (
                key(backend_addr, snat, backend.port(), snat_port),
                entry(vip, client, self.vip.port(), client_port, DIR_TO_CLIENT),
            ),
        ]
    }
}

/// Rounds of check-and-rewrite after the fill (see [`fill`]).
const REPAIR_ROUNDS: usize = 5;

/// Writes `connections` connections (twice as many entries) into the flow
/// table pinned in `pin_dir`; returns the entries written.
///
/// The running instance's sweep walks the table meanwhile. Like the data
/// path, each reply entry is written before its forward entry (a forward
/// entry without its reply is an orphan the sweep removes), but a sweep
/// that passes a reply entry between the two writes stamps it closed as an
/// orphan. So the fill is checked afterwards and the few connections hit
/// are written again, until every one is whole and open.
pub fn fill(pin_dir: &Path, plan: &FlowPlan, connections: u64) -> Result<u64> {
    if connections > plan.capacity() {
        bail!(
            "{connections} connections need more SNAT tuples than {} backends have",
            plan.backends.len()
        );
    }
    // IPv4's table or IPv6's, by the VIP's family.
    let tables = lb_user::kernel::flow_tables::Capacities::of_pins(pin_dir)?;
    let capacity = u64::from(if plan.vip.is_ipv4() {
        tables.ipv4
    } else {
        tables.ipv6
    });
    if capacity < 2 * connections {
        bail!(
            "the flow table holds {capacity} entries, fewer than {}",
            2 * connections
        );
    }
    let mut flows = lb_user::kernel::flow_tables::FlowTables::open(pin_dir)?;
    let now = MonotonicClock.now().0;
    let mut write = |i: u64| -> Result<()> {
        let [forward, reply] = plan.connection(i, now);
        for (key, entry) in [reply, forward] {
            flows
                .insert(&key, entry, 0)
                .with_context(|| format!("writing connection {i}"))?;
        }
        Ok(())
    };
    for i in 0..connections {
        write(i)?;
    }
    for _ in 0..REPAIR_ROUNDS {
        let broken = broken(pin_dir, plan, connections)?;
        if broken.is_empty() {
            return Ok(2 * connections);
        }
        for (i, _) in broken {
            write(i)?;
        }
    }
    let broken = broken(pin_dir, plan, connections)?;
    if !broken.is_empty() {
        bail!(
            "{} connections still lack an open entry after {REPAIR_ROUNDS} rewrites (first: {:?})",
            broken.len(),
            broken[0]
        );
    }
    Ok(2 * connections)
}

/// Connections (of the first `connections` of `plan`) whose forward or
/// reply entry is missing or closed now: `(i, [forward ok, reply ok])`.
pub fn broken(pin_dir: &Path, plan: &FlowPlan, connections: u64) -> Result<Vec<(u64, [bool; 2])>> {
    let flows = lb_user::kernel::flow_tables::FlowTables::open(pin_dir)?;
    let open = |key: &FlowKey| {
        flows
            .get(key)
            .is_some_and(|e| e.flags & lb_common::FLOW_F_CLOSED == 0)
    };
    let mut found = Vec::new();
    for i in 0..connections {
        let [(fk, _), (rk, _)] = plan.connection(i, 0);
        let ok = [open(&fk), open(&rk)];
        if ok != [true, true] {
            found.push((i, ok));
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> FlowPlan {
        FlowPlan {
            vip: "10.213.0.100:80".parse().unwrap(),
            vip_id: 3,
            backends: vec![
                ("10.213.0.21:8080".parse().unwrap(), 7),
                ("10.213.0.22:8080".parse().unwrap(), 9),
            ],
            snat: "10.213.0.10".parse().unwrap(),
            snat_first_port: 1024,
        }
    }

    /// The data path's `Translation::opposite_key_of`: the key of the
    /// packets that come back after `entry`'s rewrite.
    fn opposite(own: &FlowKey, entry: &FlowEntry) -> FlowKey {
        FlowKey {
            src: entry.new_dst,
            dst: entry.new_src,
            sport: entry.new_dport,
            dport: entry.new_sport,
            ..*own
        }
    }

    #[test]
    fn each_entry_of_a_connection_points_at_the_other() {
        let [(fk, fe), (rk, re)] = plan().connection(5, 42);
        // The sweep finds the reply from the forward entry and back.
        assert_eq!(opposite(&fk, &fe), rk);
        assert_eq!(opposite(&rk, &re), fk);
        assert_eq!(
            (fe.direction, re.direction),
            (DIR_TO_BACKEND, DIR_TO_CLIENT)
        );
        // Connection 5 of 2 backends: the second backend, its third SNAT port.
        assert_eq!((fe.backend_id, re.backend_id, fe.vip_id), (9, 9, 3));
        assert_eq!(u16::from_be(fe.new_sport), 1026);
        assert_eq!(u16::from_be(fk.dport), 80);
        assert_eq!(u16::from_be(re.new_dport), 10_005);
        assert_eq!(fe.flags, FLOW_F_SYNACK_SEEN);
        assert_eq!(fe.last_seen_ns, 42);
    }

    #[test]
    fn a_million_entries_have_distinct_keys() {
        let plan = FlowPlan {
            backends: (0..16)
                .map(|i| {
                    (
                        SocketAddr::from(([10, 213, 0, 21 + i / 4], 8080 + u16::from(i % 4))),
                        u32::from(i),
                    )
                })
                .collect(),
            ..plan()
        };
        assert!(plan.capacity() >= 500_000);
        let mut keys = std::collections::HashSet::new();
        for i in 0..500_000 {
            for (k, _) in plan.connection(i, 0) {
                assert!(keys.insert(k), "connection {i} repeats a key");
            }
        }
        assert_eq!(keys.len(), 1_000_000);
    }
}
