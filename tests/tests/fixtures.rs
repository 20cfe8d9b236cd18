//! The fixture suite: well over 150 packet cases through the verified XDP
//! program with `BPF_PROG_TEST_RUN`, in the manner of Katran's fixtures.
//! Each case gives an input frame, the map state it runs against (the world
//! in `fixtures/suite.rs`, plus what earlier cases of its group created or
//! changed), the expected XDP action and reason counter, and for rewritten
//! frames the exact output bytes, whose IP, TCP and UDP checksums are
//! computed by the test from scratch.
//!
//! Decisions the fixtures pin down:
//! - TTL and hop limit are not decremented: the balancer terminates the
//!   client's path like a proxy host, so a TTL of 1 (or 0) is balanced.
//! - Fragments (IPv4, and IPv6 with a fragment header other than an atomic
//!   one) pass to the kernel: only the first carries the ports.
//! - ICMP/ICMPv6 errors about a balanced flow are translated by their quote
//!   in both directions (PMTU discovery works through the NAT); echo to the
//!   VIP passes to the kernel, which answers it because the VIP is an
//!   address of the interface.
//! - More than `MAX_IPV6_EXT_HEADERS` (4) IPv6 extension headers pass,
//!   counted as `pass_ipv6_ext_limit`.
//!
//! Root only; runs pinned to one CPU in a fresh network namespace.
#[path = "fixtures/flows.rs"]
mod flows;
#[path = "fixtures/frames.rs"]
mod frames;
#[path = "fixtures/icmp.rs"]
mod icmp;
#[path = "fixtures/suite.rs"]
mod suite;

use lb_lab::xdp::{
    harness::{CLIENT_PORT, Lb},
    isolate::run_isolated,
};

use crate::suite::{Suite, TCP80, TCP80_6, UDP53, UDP53_6, world};

/// The issue asks for at least this many cases.
const MIN_CASES: usize = 150;
/// Flow-table size of the LRU-eviction cases.
const SMALL_FLOW_TABLE: u32 = 64;

#[test]
fn fixtures() {
    lb_lab::require_root!();
    let cases = run_isolated(|| {
        let mut s = Suite::new(Lb::new());
        world(&mut s.lb);
        s.group("TCP flows");
        flows::tcp_lifecycle(&mut s, TCP80, 0, CLIENT_PORT);
        flows::tcp_lifecycle(&mut s, TCP80_6, 100, CLIENT_PORT);
        s.group("UDP flows");
        flows::udp(&mut s, UDP53, 0, CLIENT_PORT);
        flows::udp(&mut s, UDP53_6, 100, CLIENT_PORT);
        flows::algorithms(&mut s);
        flows::backends(&mut s);
        flows::tcp_flags(&mut s, TCP80);
        flows::tcp_flags(&mut s, TCP80_6);
        flows::snat_ports(&mut s);
        flows::next_hops(&mut s);
        frames::not_vip(&mut s);
        frames::ether_types(&mut s);
        frames::vlans(&mut s);
        frames::options_and_ext_headers(&mut s);
        frames::fragments(&mut s);
        frames::ttl(&mut s);
        frames::padding(&mut s);
        frames::truncation(&mut s);
        frames::bad_headers(&mut s);
        icmp::icmp(&mut s);

        let mut small = Suite::new(Lb::load(lb_user::EBPF_OBJECT, SMALL_FLOW_TABLE));
        world(&mut small.lb);
        flows::lru(&mut small, SMALL_FLOW_TABLE);
        s.cases + small.cases
    });
    println!("{cases} fixture cases passed");
    assert!(cases >= MIN_CASES, "only {cases} fixture cases");
}
