//! The flow table split by family (`FLOWS4` for IPv4, `FLOWS` for IPv6) and
//! the move an in-place upgrade makes from a build before the split, whose
//! one `FLOWS` held both families: `lb_user::kernel::upgrade`'s
//! `copy_v4_flows` (before the program swap) and `move_v4_flows` (after it),
//! run on the maps of the loaded object.
//!
//! Needs root (CAP_BPF); runs on a thread isolated like the packet tests.
use lb_common::{AF_INET6, DIR_TO_BACKEND, FlowEntry, FlowKey, IPPROTO_TCP, IPPROTO_UDP};
use lb_lab::xdp::{
    harness::*,
    isolate::run_isolated,
    packet::{Pkt, TCP_ACK, TCP_SYN},
};
use lb_user::kernel::upgrade::{V4Move, copy_v4_flows, move_v4_flows};

/// A distinct entry per `i`, to tell entries apart after the move.
fn entry(i: u32) -> FlowEntry {
    FlowEntry {
        backend_id: i,
        vip_id: 100 + i,
        created_ns: 1_000 + u64::from(i),
        last_seen_ns: 2_000 + u64::from(i),
        ..FlowEntry::default()
    }
}

/// Moves every IPv4 entry to `FLOWS`, as a build before the split kept
/// them; returns them.
fn as_before_the_split(lb: &mut Lb) -> Vec<(FlowKey, FlowEntry)> {
    let mut tables = lb.flows_mut();
    let in_flows4: Vec<(FlowKey, FlowEntry)> = tables
        .v4
        .iter()
        .map(|r| r.expect("FLOWS4 entry"))
        .map(|(k, e)| (k.widen(), e))
        .collect();
    for (key, entry) in &in_flows4 {
        tables
            .v4
            .remove(&key.compact())
            .expect("remove from FLOWS4");
        tables.v6.insert(key, entry, 0).expect("insert into FLOWS");
    }
    tables
        .v6
        .iter()
        .map(|r| r.expect("FLOWS entry"))
        .filter(|(k, _)| k.is_v4())
        .collect()
}

/// An old build's `FLOWS`, IPv4 and IPv6 entries mixed, meets the moves of
/// an upgrade: the IPv4 ones end in `FLOWS4` as they were, the IPv6 ones
/// stay in `FLOWS` untouched, and an entry the new program made in
/// `FLOWS4` meanwhile wins over the old copy.
#[test]
fn the_upgrade_moves_ipv4_entries_from_flows_to_flows4() {
    lb_lab::require_root!();
    run_isolated(|| {
        let mut lb = Lb::new();
        let v4 = [
            key(IPPROTO_TCP, (CLIENT, 40_000), (VIP, HTTP)),
            key(IPPROTO_TCP, (backend_addr(0), BACKEND_PORT), (SNAT, 20_000)),
            key(IPPROTO_UDP, (CLIENT, 41_000), (VIP, DNS)),
        ];
        let v6 = [
            key(IPPROTO_TCP, (CLIENT6, 42_000), (VIP6, HTTP)),
            key(
                IPPROTO_TCP,
                (backend_addr6(0), BACKEND_PORT),
                (SNAT6, 20_001),
            ),
        ];
        // An IPv4 tuple the new program already has an entry for in FLOWS4:
        // the old build's copy must not replace it.
        let taken = key(IPPROTO_UDP, (CLIENT, 41_001), (VIP, DNS));
        // One the old program makes between the first copy and the swap.
        let late = key(IPPROTO_UDP, (CLIENT, 41_002), (VIP, DNS));
        let mut tables = lb.flows_mut();
        for (i, k) in v4.iter().chain(&v6).enumerate() {
            tables.v6.insert(k, entry(i as u32), 0).unwrap();
        }
        tables.v6.insert(taken, entry(20), 0).unwrap();
        tables.v4.insert(taken.compact(), entry(21), 0).unwrap();

        // Before the swap: copied, FLOWS untouched.
        let before = copy_v4_flows(&tables.v6, &mut tables.v4);
        let expected = V4Move {
            copied: 3,
            removed: 0,
            failed: 0,
        };
        assert_eq!(before, expected);
        assert_eq!(tables.v6.keys().count(), 3 + 2 + 1);

        tables.v6.insert(late, entry(22), 0).unwrap();
        let after = move_v4_flows(&mut tables.v6, &mut tables.v4);
        let expected = V4Move {
            copied: 1,
            removed: 3 + 1 + 1,
            failed: 0,
        };
        assert_eq!(after, expected);
        // Once more: nothing left to move.
        assert_eq!(
            move_v4_flows(&mut tables.v6, &mut tables.v4),
            V4Move::default()
        );

        // FLOWS is left to IPv6, its entries as they were.
        let flows = lb.flows();
        let left: Vec<FlowKey> = flows.v6.keys().map(Result::unwrap).collect();
        assert_eq!(left.len(), 2, "{left:?}");
        for (i, k) in v6.iter().enumerate() {
            assert_eq!(k.family, AF_INET6);
            assert_eq!(flows.v6.get(k, 0).unwrap(), entry((v4.len() + i) as u32));
        }
        // Every IPv4 entry is in FLOWS4 under its 16-byte key, as it was.
        assert_eq!(flows.v4.keys().count(), 3 + 1 + 1);
        for (i, k) in v4.iter().enumerate() {
            assert_eq!(flows.v4.get(&k.compact(), 0).unwrap(), entry(i as u32));
            assert_eq!(lb.flow(k), Some(entry(i as u32)), "the dispatch finds it");
        }
        assert_eq!(lb.flow(&taken), Some(entry(21)), "FLOWS4's own entry kept");
        assert_eq!(lb.flow(&late), Some(entry(22)));
        assert_eq!(lb.flow_count(), 5 + 2);
    });
}

/// A live IPv4 connection whose entries an old build kept in `FLOWS` is
/// still translated both ways by the new program once they have moved.
#[test]
fn a_moved_connection_is_found_by_the_new_program() {
    lb_lab::require_root!();
    run_isolated(|| {
        let mut lb = Lb::standard();
        let syn = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_SYN);
        assert_eq!(lb.run(&syn.build()).0, XDP_TX, "{:?}", lb.reasons());
        let live = as_before_the_split(&mut lb);
        assert_eq!(live.len(), 2, "both entries of the connection");
        let snat_port = live
            .iter()
            .find(|(_, e)| e.direction == DIR_TO_BACKEND)
            .map(|(_, e)| u16::from_be(e.new_sport))
            .expect("the forward entry");

        let mut tables = lb.flows_mut();
        copy_v4_flows(&tables.v6, &mut tables.v4);
        let moved = move_v4_flows(&mut tables.v6, &mut tables.v4);
        assert_eq!(moved.removed, 2);
        assert_eq!(lb.flows().v6.keys().count(), 0);

        let syn_ack = from_backend(0, snat_port, TCP_SYN | TCP_ACK);
        let to_client = syn_ack.rewritten((VIP, HTTP), (CLIENT, CLIENT_PORT), CLIENT_MAC);
        lb.expect(&syn_ack, XDP_TX, &to_client);
        let ack = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_ACK);
        let to_backend = ack.rewritten(
            (SNAT, snat_port),
            (backend_addr(0), BACKEND_PORT),
            backend_mac(0),
        );
        lb.expect(&ack, XDP_TX, &to_backend);
        assert_eq!(lb.conns(0).opened, 1, "the same connection, not a new one");
        assert_eq!(lb.flow_count(), 2);
    });
}
