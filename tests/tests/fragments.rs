//! Packet-level tests of fragmented datagrams through `lb_xdp`
//! (`BPF_PROG_TEST_RUN`, like `xdp_packets`): a 4 KiB UDP datagram split at
//! MTU 1500, both families and both directions. The first fragment is
//! balanced like a whole datagram and leaves its ports in `FRAGMENTS`; the
//! later ones follow it to the same backend with the same translation, so
//! the fragments the balancer sends reassemble into exactly the datagram
//! it would have sent whole (UDP checksum included).
//!
//! Needs root. Run with `cargo test -p lb-tests --test fragments`.
use std::net::IpAddr;

use lb_common::reason;
use lb_lab::{
    trials::{self, packet_case, slug},
    xdp::{
        harness::*,
        packet::{Pkt, assert_checksums_valid, checksum, fragment, parse, reassemble},
        world::{self, Conn, UDP53, UDP53_6, Vip},
    },
};

/// A 4 KiB datagram: three fragments at MTU 1500.
const PAYLOAD: usize = 4000;
/// Fragment payload bytes at MTU 1500 (IPv4: 1500 − 20; IPv6: 1500 − 40 −
/// 8, rounded down to a multiple of 8).
const fn chunk(vip: Vip) -> usize {
    match vip.addr {
        IpAddr::V4(_) => 1480,
        IpAddr::V6(_) => 1448,
    }
}

/// A datagram that may be fragmented (no DF), with a recognisable payload.
fn datagram(pkt: Pkt) -> Pkt {
    let mut pkt = pkt.payload(&(0..PAYLOAD).map(|i| (i % 251) as u8).collect::<Vec<_>>());
    pkt.ipv4_frag = 0;
    pkt
}

/// The UDP source port of a frame (after the balancer: its SNAT port).
fn sport(frame: &[u8]) -> u16 {
    let p = parse(frame).expect("IP frame");
    u16::from_be_bytes([frame[p.l4], frame[p.l4 + 1]])
}

/// Runs every fragment of `pkt` (split as a router at MTU 1500 would) in
/// `order` and returns what the balancer sent, asserting each was sent on.
fn run_fragments(lb: &Lb, pkt: &Pkt, vip: Vip, id: u32, order: &[usize]) -> Vec<Vec<u8>> {
    let pieces = fragment(&pkt.build(), chunk(vip), id);
    assert_eq!(pieces.len(), 3);
    order
        .iter()
        .map(|&i| {
            let (action, out) = lb.run(&pieces[i]);
            assert_eq!(action, XDP_TX, "fragment {i}: {:?}", lb.reasons());
            out
        })
        .collect()
}

/// Asserts `sent` reassembles into exactly `expected` (built whole), and
/// that each fragment on its own is addressed like it.
fn assert_reassembles_to(sent: &[Vec<u8>], expected: &Pkt) {
    let whole = expected.build();
    let expected_ip = parse(&whole).expect("IP");
    for (i, f) in sent.iter().enumerate() {
        let p = parse(f).expect("IP fragment");
        assert_eq!(
            (p.src, p.dst),
            (expected_ip.src, expected_ip.dst),
            "fragment {i}"
        );
        assert_eq!(f[..12], whole[..12], "fragment {i}: MAC addresses");
        if p.src.is_ipv4() {
            // The IPv4 header checksum of each fragment.
            assert_eq!(
                checksum(&[&f[p.l3..p.l4]]),
                0,
                "fragment {i}: IPv4 header checksum"
            );
        }
    }
    let got = reassemble(sent).expect("the fragments make one datagram");
    assert_checksums_valid(&got, "reassembled datagram");
    // Not assert_eq: a mismatch would print 4 KiB twice.
    assert!(
        got == whole,
        "the reassembled datagram differs from the whole one at byte {:?}",
        got.iter().zip(&whole).position(|(a, b)| a != b)
    );
}

fn lb_world() -> Lb {
    let mut lb = Lb::new();
    world::world(&mut lb);
    lb
}

/// Client → VIP in fragments, then the backend's answer in fragments,
/// each fragment order once.
fn both_ways(vip: Vip) {
    let lb = lb_world();
    let client_port = 40_000;
    let conn0 = Conn {
        vip,
        client_port,
        backend: if vip.addr.is_ipv4() { 0 } else { 100 },
        snat_port: 0,
    };
    let query = datagram(conn0.client_packet(0));
    let sent = run_fragments(&lb, &query, vip, 0x1234, &[0, 1, 2]);
    let conn = Conn {
        snat_port: sport(&sent[0]),
        ..conn0
    };
    assert_reassembles_to(&sent, &conn.sent_to_backend(&query));
    assert_eq!(lb.flow_count(), 2, "one connection, both directions");

    // The answer, its fragments out of order after the first (the same
    // identification, which `Pkt` writes into whole IPv4 datagrams: the
    // backend numbers its datagrams on its own).
    let answer = datagram(conn.backend_packet(0));
    let back = run_fragments(&lb, &answer, vip, 0x1234, &[0, 2, 1]);
    assert_reassembles_to(&back, &conn.sent_to_client(&answer));

    // A second datagram of the same flow whose first fragment comes last:
    // the later ones arrive before it and go to the host (reordered
    // fragments are the host's, which drops an incomplete datagram).
    let pieces = fragment(&query.build(), chunk(vip), 0x9abc);
    let passed_before = lb.reason(reason::PASS_FRAGMENT);
    lb.expect_pass(&pieces[1]);
    assert_eq!(lb.reason(reason::PASS_FRAGMENT), passed_before + 1);
    let (action, _) = lb.run(&pieces[0]);
    assert_eq!(action, XDP_TX);
    let (action, out) = lb.run(&pieces[2]);
    assert_eq!(action, XDP_TX, "a later fragment after its first one");
    let p = parse(&out).expect("IP fragment");
    assert_eq!((p.src, p.dst), (conn.snat().0, conn.backend().0));
    assert_eq!(lb.flow_count(), 2, "no flow was created for a fragment");
}

fn case_ipv4_fragments_both_ways(_: &mut ()) {
    both_ways(UDP53);
}

fn case_ipv6_fragments_both_ways(_: &mut ()) {
    both_ways(UDP53_6);
}

/// A later fragment nobody saw the first fragment of, to the VIP or to a
/// SNAT address, goes to the host untouched and creates nothing; ICMP
/// fragments are not ours either.
fn case_unknown_later_fragments_pass(_: &mut ()) {
    let lb = lb_world();
    for vip in [UDP53, UDP53_6] {
        let conn = Conn {
            vip,
            client_port: 40_001,
            backend: 0,
            snat_port: SNAT_PORT_MIN,
        };
        let query = fragment(&datagram(conn.client_packet(0)).build(), chunk(vip), 7);
        lb.expect_pass(&query[1]);
        lb.expect_pass(&query[2]);
    }
    assert_eq!(lb.reason(reason::PASS_FRAGMENT), 4);
    assert_eq!(lb.flow_count(), 0);
    assert!(
        lb.reasons().keys().all(|r| !r.starts_with("drop")),
        "{:?}",
        lb.reasons()
    );
}

/// The first fragment of a UDP datagram to a VIP port nobody serves is not
/// ours: it passes and leaves nothing behind for its later fragments.
fn case_first_fragment_not_to_a_vip(_: &mut ()) {
    let lb = lb_world();
    let pkt = datagram(Pkt::udp((CLIENT, 40_002), (VIP, 5353)));
    let pieces = fragment(&pkt.build(), 1480, 11);
    lb.expect_pass(&pieces[0]);
    lb.expect_pass(&pieces[1]);
    assert_eq!(lb.reason(reason::PASS_NOT_VIP), 1);
    assert_eq!(lb.reason(reason::PASS_FRAGMENT), 1);
    assert_eq!(lb.flow_count(), 0);
}

type Case = (&'static str, fn(&mut ()));

const CASES: &[Case] = &[
    ("ipv4 fragments both ways", case_ipv4_fragments_both_ways),
    ("ipv6 fragments both ways", case_ipv6_fragments_both_ways),
    (
        "unknown later fragments pass",
        case_unknown_later_fragments_pass,
    ),
    (
        "first fragment not to a vip",
        case_first_fragment_not_to_a_vip,
    ),
];

fn main() {
    let trials = CASES
        .iter()
        .map(|&(name, case)| packet_case(slug(name), move || case(&mut ())))
        .collect();
    trials::run("fragments", trials)
}
