//! Packet-level tests of the XDP data path (`lb_xdp`), run with
//! `BPF_PROG_TEST_RUN`: each case feeds hand-built frames to the verified
//! program and checks the verdict, the exact output bytes (with checksums
//! computed here from scratch), the flow table, the counters and the events.
//!
//! Each case is its own test (`cargo test --test xdp_packets -- --list`).
//! Needs root (CAP_BPF, CAP_NET_ADMIN). Each case runs on a thread pinned
//! to CPU 0 (per-CPU counters are read back from the CPU that ran the
//! program) inside a fresh network namespace, where `bpf_fib_lookup` finds no
//! routes, so next hops come from the `NEIGHBOURS` map deterministically.
use lb_common::{
    AF_INET, AF_INET6, Algorithm, BACKEND_ACTIVE, BACKEND_DOWN, BACKEND_DRAINING, BACKEND_EJECTED,
    BACKEND_HOP_JIFFIES, BackendConns, BackendHop, BackendPending, CLOSE_BACKEND_RST,
    DIR_TO_BACKEND, DIR_TO_CLIENT, EVENT_CLOSED, EVENT_REFUSED, FLOOR_FLOW_WAYS,
    FLOOR_FLOW_WAYS_MAP, FLOOR_REPLY_WAYS_MAP, FLOOR_WAY_CLAIMED, FLOW_ESTABLISHED, FLOW_F_CLOSED,
    FLOW_F_PENDING_COUNTED, FLOW_F_REQUEST_PENDING, FLOW_F_SYNACK_SEEN, FLOW_F_TAKEN,
    FLOW_F_TW_SEEN, FLOW_F_TW_TS, FLOW_F_TW_TS_UNKNOWN, FLOW_F_TW_UNACKED, FlowEntry, IPPROTO_TCP,
    IPPROTO_UDP, reason,
};
use lb_lab::{
    trials::{self, packet_case, slug},
    xdp::{
        harness::*,
        packet::{
            L4, Pkt, TCP_ACK, TCP_FIN, TCP_PSH, TCP_RST, TCP_SYN, assert_checksums_valid,
            linux_syn_options, segment_options,
        },
    },
};
use lb_user::kernel::flow_tables::move_ipv4_entries;

// ---------------------------------------------------------------------------
// Cases.

/// SYN to the VIP: full NAT to backend 0, both entries, opened + event.
/// Returns the SNAT port for follow-up cases.
fn open_tcp(lb: &mut Lb) -> u16 {
    let syn = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_SYN);
    let (action, out) = lb.run(&syn.build());
    assert_eq!(action, XDP_TX, "{:?}", lb.reasons());
    let fwd = lb.forward_entry(IPPROTO_TCP, HTTP, CLIENT_PORT);
    let snat_port = u16::from_be(fwd.new_sport);
    assert!((SNAT_PORT_MIN..=SNAT_PORT_MAX).contains(&snat_port));
    assert_eq!(addr_of(fwd.new_src, AF_INET), SNAT);
    let expected = syn.rewritten(
        (SNAT, snat_port),
        (backend_addr(0), BACKEND_PORT),
        backend_mac(0),
    );
    assert_eq!(out, expected.build());
    assert_checksums_valid(&out, "rewritten frame");
    assert_eq!(fwd.direction, DIR_TO_BACKEND);
    assert_eq!((fwd.backend_id, fwd.vip_id), (0, 0));
    assert!(fwd.created_ns > 0 && fwd.last_seen_ns == fwd.created_ns);

    let rev = lb
        .flow(&key(
            IPPROTO_TCP,
            (backend_addr(0), BACKEND_PORT),
            (SNAT, snat_port),
        ))
        .expect("reverse flow entry");
    assert_eq!(rev.direction, DIR_TO_CLIENT);
    assert_eq!(
        (addr_of(rev.new_src, AF_INET), u16::from_be(rev.new_sport)),
        (VIP.into(), HTTP)
    );
    assert_eq!(
        (addr_of(rev.new_dst, AF_INET), u16::from_be(rev.new_dport)),
        (CLIENT.into(), CLIENT_PORT)
    );
    assert_eq!(rev.backend_id, 0);
    // The way back to the client, learned from its frame (lo in the test namespace).
    assert_eq!((rev.client_mac, rev.client_ifindex), (CLIENT_MAC, 1));
    // The forward entry caches the next hop towards the backend.
    assert_eq!((fwd.client_mac, fwd.client_ifindex), (backend_mac(0), 1));
    assert_eq!(lb.flow_count(), 2);

    assert!(lb.events().is_empty(), "an open is a counter, not an event");
    assert_eq!(
        lb.conns(0),
        BackendConns {
            opened: 1,
            closed: 0
        }
    );
    assert_eq!(lb.reason(reason::TX_TO_BACKEND), 1);
    snat_port
}

fn case_tcp_syn_to_vip(lb: &mut Lb) {
    open_tcp(lb);
    assert_eq!(
        lb.reasons().len(),
        1,
        "only tx_to_backend counted: {:?}",
        lb.reasons()
    );
}

fn case_syn_ack_translated_back(lb: &mut Lb) {
    let snat_port = open_tcp(lb);
    assert_eq!(lb.handshakes(0), 0, "a SYN is no accepted connection");
    let syn_ack = from_backend(0, snat_port, TCP_SYN | TCP_ACK);
    let expected = syn_ack.rewritten((VIP, HTTP), (CLIENT, CLIENT_PORT), CLIENT_MAC);
    lb.expect(&syn_ack, XDP_TX, &expected);
    assert_checksums_valid(&expected.build(), "expected frame");
    let fwd = lb.forward_entry(IPPROTO_TCP, HTTP, CLIENT_PORT);
    assert_ne!(fwd.flags & FLOW_F_SYNACK_SEEN, 0);
    assert_eq!(fwd.state, FLOW_ESTABLISHED);
    assert_eq!(lb.reason(reason::TX_TO_CLIENT), 1);
    assert!(lb.events().is_empty(), "no event for a SYN-ACK");
    // Counted once per connection (outlier detection's accepted count),
    // a retransmitted SYN-ACK not again.
    assert_eq!(lb.handshakes(0), 1);
    lb.expect(&syn_ack, XDP_TX, &expected);
    assert_eq!((lb.handshakes(0), lb.handshakes(1)), (1, 0));
}

fn case_retransmitted_syn_same_backend(lb: &mut Lb) {
    let snat_port = open_tcp(lb);
    let syn = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_SYN);
    let expected = syn.rewritten(
        (SNAT, snat_port),
        (backend_addr(0), BACKEND_PORT),
        backend_mac(0),
    );
    lb.expect(&syn, XDP_TX, &expected);
    assert!(lb.events().is_empty());
    assert_eq!(lb.conns(0).opened, 1);
    assert_eq!(lb.flow_count(), 2);
}

fn case_request_response_latency(lb: &mut Lb) {
    let snat_port = open_tcp(lb);
    let to_backend = |p: Pkt| {
        p.rewritten(
            (SNAT, snat_port),
            (backend_addr(0), BACKEND_PORT),
            backend_mac(0),
        )
    };
    let to_client = |p: Pkt| p.rewritten((VIP, HTTP), (CLIENT, CLIENT_PORT), CLIENT_MAC);
    let syn_ack = from_backend(0, snat_port, TCP_SYN | TCP_ACK);
    lb.expect(&syn_ack, XDP_TX, &to_client(syn_ack.clone()));
    let ack = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_ACK);
    lb.expect(&ack, XDP_TX, &to_backend(ack.clone()));
    let request = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_ACK | TCP_PSH)
        .payload(b"GET / HTTP/1.1\r\n\r\n");
    lb.expect(&request, XDP_TX, &to_backend(request.clone()));
    // A pure ACK from the backend carries no payload: not a response.
    let backend_ack = from_backend(0, snat_port, TCP_ACK);
    lb.expect(&backend_ack, XDP_TX, &to_client(backend_ack.clone()));
    assert!(lb.events().is_empty());
    assert_eq!(lb.latency(0).count, 0);
    // The request is outstanding: its stall clock started when it was sent
    // (the handshake alone asked nothing of the backend).
    let asked = lb.progress(0);
    assert!(asked.awaiting(), "{asked:?}");
    assert_eq!(asked.stall_clock(), asked.requested_ns);
    let response = from_backend(0, snat_port, TCP_ACK | TCP_PSH).payload(&[b'x'; 301]);
    lb.expect(&response, XDP_TX, &to_client(response.clone()));
    // Answered: an open connection with nothing asked is no stall.
    let answered = lb.progress(0);
    assert!(!answered.awaiting(), "{answered:?}");
    assert!(answered.answered_ns > asked.requested_ns);
    assert_eq!(answered.stall_clock(), 0);
    // The sample is aggregated in the kernel, not sent on the ring.
    assert!(lb.events().is_empty(), "no event per response");
    let first = lb.latency(0);
    assert_eq!(first.count, 1);
    assert!(first.sum_ns > 0, "latency sample {}", first.sum_ns);
    assert_eq!(first.peak_ns, first.sum_ns, "one sample is its own peak");
    // More response data for the same request: no second sample.
    lb.expect(&response, XDP_TX, &to_client(response.clone()));
    assert_eq!(lb.latency(0).count, 1);
    // A second request/response: sum and count grow; in a new epoch (the
    // control plane's tick) the peak starts again from this sample.
    lb.next_latency_epoch();
    lb.expect(&request, XDP_TX, &to_backend(request.clone()));
    lb.expect(&response, XDP_TX, &to_client(response.clone()));
    let second = lb.latency(0);
    assert_eq!(second.count, 2);
    assert!(second.sum_ns > first.sum_ns);
    assert_eq!(
        second.peak_ns,
        second.sum_ns - first.sum_ns,
        "the new epoch's peak"
    );
    assert!(lb.events().is_empty());
}

/// A request counts in its backend's pending requests (with its start)
/// from the client's payload to the backend's first answer; a connection
/// that closes with a request unanswered takes it out as well, once.
fn case_pending_requests(lb: &mut Lb) {
    let snat_port = open_tcp(lb);
    let syn_ack = from_backend(0, snat_port, TCP_SYN | TCP_ACK);
    lb.run(&syn_ack.build());
    assert_eq!(
        lb.pending(0),
        BackendPending::default(),
        "a handshake asks nothing"
    );
    let request = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_ACK | TCP_PSH)
        .payload(b"GET / HTTP/1.1\r\n\r\n");
    lb.run(&request.build());
    let asked = lb.pending(0);
    assert_eq!(asked.requests, 1, "{asked:?}");
    let fwd = lb.forward_entry(IPPROTO_TCP, HTTP, CLIENT_PORT);
    assert_eq!(
        asked.started_sum_ns, fwd.request_ns,
        "counted with its start"
    );
    assert!(fwd.flags & FLOW_F_PENDING_COUNTED != 0);
    // More of the same request: still one.
    lb.run(&request.build());
    assert_eq!(lb.pending(0), asked);
    let response = from_backend(0, snat_port, TCP_ACK | TCP_PSH).payload(&[b'x'; 100]);
    lb.run(&response.build());
    assert_eq!(lb.pending(0), BackendPending::default(), "answered");
    // The next request, and a reset before any answer: out again, and a
    // late answer does not take it out twice.
    lb.run(&request.build());
    assert_eq!(lb.pending(0).requests, 1);
    lb.run(&Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_RST).build());
    assert_eq!(lb.pending(0), BackendPending::default(), "closed");
    lb.run(&response.build());
    assert_eq!(lb.pending(0), BackendPending::default(), "no second end");
    // Late client data of the closed connection (still translated while
    // it lingers) is never left pending: no close would take it out.
    lb.run(&request.build());
    assert_eq!(
        lb.pending(0),
        BackendPending::default(),
        "closed, not pending"
    );
}

/// Late client data of a connection the backend reset waits for no
/// answer: it must not start the backend's stall clock (`progress`),
/// which P2C reads while the backend has other flows in flight.
fn case_late_data_of_a_closed_connection_starts_no_stall_clock(lb: &mut Lb) {
    let snat_port = open_tcp(lb);
    lb.run(&from_backend(0, snat_port, TCP_SYN | TCP_ACK).build());
    // Another client's connection keeps the backend in flight.
    lb.syn(CLIENT_PORT + 1);
    lb.run(&from_backend(0, snat_port, TCP_RST | TCP_ACK).build());
    assert!(!lb.progress(0).awaiting(), "nothing asked yet");
    // The client's request, already on its way when the reset came.
    let request = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_ACK | TCP_PSH)
        .payload(b"GET / HTTP/1.1\r\n\r\n");
    lb.run(&request.build());
    assert_eq!(lb.pending(0), BackendPending::default());
    assert!(
        !lb.progress(0).awaiting(),
        "no answer can come: {:?}",
        lb.progress(0)
    );
}

/// The reply entry of the IPv4 client's TCP connection on `snat_port`.
fn reply_entry(lb: &Lb, snat_port: u16) -> Option<lb_common::FlowEntry> {
    lb.flow(&key(
        IPPROTO_TCP,
        (backend_addr(0), BACKEND_PORT),
        (SNAT, snat_port),
    ))
}

fn case_fin_from_both_sides_closes_once(lb: &mut Lb) {
    let snat_port = open_tcp(lb);
    let fin = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_FIN | TCP_ACK);
    let fin_out = fin.rewritten(
        (SNAT, snat_port),
        (backend_addr(0), BACKEND_PORT),
        backend_mac(0),
    );
    lb.expect(&fin, XDP_TX, &fin_out);
    // Half closed: the backend may still be sending, so still in flight.
    assert!(lb.events().is_empty(), "one FIN does not close");
    assert_eq!(lb.conns(0).closed, 0);
    let fwd = lb.forward_entry(IPPROTO_TCP, HTTP, CLIENT_PORT);
    assert_eq!(fwd.flags & FLOW_F_CLOSED, 0);
    // The backend's data and then its FIN: that closes it, once.
    let data = from_backend(0, snat_port, TCP_ACK | TCP_PSH).payload(b"tail");
    lb.expect(&data, XDP_TX, &to_client_of(&data));
    let fin_back = from_backend(0, snat_port, TCP_FIN | TCP_ACK);
    lb.expect(&fin_back, XDP_TX, &to_client_of(&fin_back));
    // Closed (a counter); an orderly close needs no event.
    assert!(lb.events().is_empty());
    assert_eq!(lb.conns(0).closed, 1);
    // Both entries carry the close time (the reply's starts the SNAT
    // tuple's quarantine).
    let fwd = lb.forward_entry(IPPROTO_TCP, HTTP, CLIENT_PORT);
    let rev = reply_entry(lb, snat_port).expect("reply entry stays");
    assert_ne!(fwd.flags & FLOW_F_CLOSED, 0);
    assert_ne!(rev.flags & FLOW_F_CLOSED, 0);
    assert_eq!(rev.last_seen_ns, fwd.last_seen_ns, "one close time");
    // Retransmitted FINs and the last ACK are still translated; nothing
    // counted twice.
    lb.expect(&fin_back, XDP_TX, &to_client_of(&fin_back));
    lb.expect(&fin, XDP_TX, &fin_out);
    assert!(lb.events().is_empty());
    assert_eq!(
        lb.conns(0),
        BackendConns {
            opened: 1,
            closed: 1
        }
    );
    assert_eq!(lb.flow_count(), 2, "entries stay until the sweep");
}

fn to_client_of(p: &Pkt) -> Pkt {
    p.rewritten((VIP, HTTP), (CLIENT, CLIENT_PORT), CLIENT_MAC)
}

/// A closed connection's forward entry is replaced by a new SYN of its
/// client tuple, or removed by the sweep, by whichever claims it first
/// (`FLOW_F_TAKEN`; the sweep removes by key, and would otherwise take the
/// new connection's entry with it). Each side staged as having lost the
/// claim to the other.
fn case_a_closed_forward_entry_is_replaced_or_removed_by_one_claimant(lb: &mut Lb) {
    open_tcp(lb);
    let rst = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_RST);
    assert_eq!(lb.run(&rst.build()).0, XDP_TX);
    let forward = key(IPPROTO_TCP, (CLIENT, CLIENT_PORT), (VIP, HTTP));
    let closed = lb.flow(&forward).unwrap();
    assert_ne!(closed.flags & FLOW_F_CLOSED, 0);
    let claimed = lb_common::FlowEntry {
        flags: closed.flags | FLOW_F_TAKEN,
        ..closed
    };
    // The sweep claimed it: a SYN of the tuple is refused (its client
    // sends it again), nothing counted, its new SNAT tuple released.
    lb.set_flow(&forward, claimed);
    let used = lb.snat_used(0);
    let syn = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_SYN);
    assert_eq!(lb.run(&syn.build()).0, XDP_DROP);
    assert_eq!(lb.reason(reason::DROP_FLOW_INSERT), 1);
    assert_eq!(
        lb.conns(0),
        BackendConns {
            opened: 1,
            closed: 1
        }
    );
    assert_eq!(lb.snat_used(0), used);
    assert_eq!(lb.flow(&forward).unwrap().new_sport, closed.new_sport);
    // A SYN claimed it: the sweep leaves it, past its linger too.
    lb.timeouts(Timeouts::ZERO);
    lb.sweep();
    assert!(lb.flow(&forward).is_some(), "removed under a SYN's claim");
    // Unclaimed, the sweep removes it; then a SYN creates the flow anew.
    lb.set_flow(&forward, closed);
    lb.sweep();
    assert!(lb.flow(&forward).is_none());
    lb.timeouts(Timeouts::default());
    assert_eq!(lb.run(&syn.build()).0, XDP_TX);
    assert_eq!(
        lb.conns(0),
        BackendConns {
            opened: 2,
            closed: 1
        }
    );
}

fn case_syn_after_close_reselects(lb: &mut Lb) {
    let old_port = open_tcp(lb);
    let rst = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_RST);
    assert_eq!(lb.run(&rst.build()).0, XDP_TX);
    assert!(
        lb.events().is_empty(),
        "a client's RST is counted, not sent"
    );
    let syn = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_SYN);
    assert_eq!(lb.run(&syn.build()).0, XDP_TX);
    assert!(lb.events().is_empty());
    assert_eq!(
        lb.conns(0),
        BackendConns {
            opened: 2,
            closed: 1
        }
    );
    let fwd = lb.forward_entry(IPPROTO_TCP, HTTP, CLIENT_PORT);
    assert_eq!(fwd.flags, 0, "a fresh connection state");
    // The old tuple is in quarantine (the backend may hold it in
    // TIME_WAIT): the new connection gets another one.
    let new_port = u16::from_be(fwd.new_sport);
    assert_ne!(new_port, old_port, "a quarantined tuple is not reused");
    let old = reply_entry(lb, old_port).expect("old reply entry quarantined");
    assert_ne!(old.flags & FLOW_F_CLOSED, 0);
    assert_eq!(lb.flow_count(), 3);
    assert_eq!(lb.snat_used(0), 2);
    // A late packet of the old connection would land in the new one that
    // took the client tuple: dropped (a late reply), and it does not touch
    // the new connection's state.
    let late = from_backend(0, old_port, TCP_FIN | TCP_ACK);
    assert_eq!(lb.run(&late.build()).0, XDP_DROP);
    assert_eq!(lb.reason(reason::DROP_SNAT_NO_FLOW), 1);
    let fwd = lb.forward_entry(IPPROTO_TCP, HTTP, CLIENT_PORT);
    assert_eq!(
        fwd.flags, 0,
        "the old connection's FIN left the new one alone"
    );
    // Default quarantine: a sweep keeps the tuple; past it, frees it.
    lb.sweep();
    assert!(reply_entry(lb, old_port).is_some());
    lb.timeouts(Timeouts {
        snat_quarantine_ns: 0,
        ..Timeouts::default()
    });
    let stats = lb.sweep();
    assert!(
        reply_entry(lb, old_port).is_none(),
        "freed after quarantine"
    );
    assert_eq!((stats.snat_freed, stats.orphans), (1, 0));
    assert_eq!(lb.snat_used(0), 1);
    assert_eq!(lb.flow_count(), 2);
}

fn case_syn_retransmitted_past_the_timeout_is_refused_and_balanced_again(lb: &mut Lb) {
    let syn = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_SYN);
    assert_eq!(lb.run(&syn.build()).0, XDP_TX);
    let first = lb.forward_entry(IPPROTO_TCP, HTTP, CLIENT_PORT);
    let first_port = u16::from_be(first.new_sport);
    // Within the SYN timeout a retransmission follows its connection.
    assert_eq!(lb.run(&syn.build()).0, XDP_TX);
    assert!(lb.events().is_empty());
    assert_eq!(lb.conns(0).opened, 1);
    // Past it, still unanswered: the data path closes the connection as
    // refused (no sweep ran) and balances the retransmission as a new one.
    lb.timeouts(Timeouts {
        syn_timeout_ns: 0,
        ..Timeouts::default()
    });
    assert_eq!(lb.run(&syn.build()).0, XDP_TX);
    assert_eq!(kinds(&lb.events()), [EVENT_REFUSED]);
    assert_eq!(
        lb.conns(0),
        BackendConns {
            opened: 2,
            closed: 1
        }
    );
    let second = lb.forward_entry(IPPROTO_TCP, HTTP, CLIENT_PORT);
    assert_eq!(second.flags, 0, "a fresh connection state");
    let second_port = u16::from_be(second.new_sport);
    assert_ne!(
        second_port, first_port,
        "the refused tuple is in quarantine"
    );
    let old = reply_entry(lb, first_port).expect("the refused connection's reply entry");
    assert_ne!(old.flags & FLOW_F_CLOSED, 0, "stamped closed");
    // The new connection is answered and translated; a later sweep counts
    // nothing twice.
    let answer = from_backend(0, second_port, TCP_SYN | TCP_ACK);
    lb.expect(&answer, XDP_TX, &to_client_of(&answer));
    lb.timeouts(Timeouts::default());
    let stats = lb.sweep();
    assert_eq!((stats.expired_syn, stats.orphans), (0, 0));
    assert!(lb.events().is_empty());
    assert_eq!(lb.conns(0).closed, 1);
}

/// A UDP flow whose backend went down by its health checks is closed by
/// the next sweep, so the sender's next datagram from the same port is
/// balanced again (a fixed-port sender never idles out). A draining or
/// ejected backend keeps its UDP flows, and a down one its TCP flows.
fn case_a_udp_flow_leaves_a_backend_that_went_down(lb: &mut Lb) {
    let snat_port = open_tcp(lb);
    let datagram = Pkt::udp((CLIENT, CLIENT_PORT), (VIP, DNS)).payload(b"log line");
    assert_eq!(lb.run(&datagram.build()).0, XDP_TX);
    assert_eq!(
        lb.forward_entry(IPPROTO_UDP, DNS, CLIENT_PORT).backend_id,
        0
    );
    lb.backend(1, BACKEND_ACTIVE);
    lb.vip(1, DNS, IPPROTO_UDP, Algorithm::P2cEwma, 0, &[0, 1]);
    for kept in [BACKEND_DRAINING, BACKEND_EJECTED] {
        lb.backend(0, kept);
        let stats = lb.sweep();
        assert_eq!((stats.expired_idle, stats.removed), (0, 0), "state {kept}");
        assert_eq!(
            lb.forward_entry(IPPROTO_UDP, DNS, CLIENT_PORT).backend_id,
            0
        );
    }
    lb.backend(0, BACKEND_DOWN);
    let stats = lb.sweep();
    assert_eq!(stats.expired_idle, 1, "{stats:?}");
    assert!(
        lb.flow(&key(IPPROTO_UDP, (CLIENT, CLIENT_PORT), (VIP, DNS)))
            .is_none(),
        "the UDP flow stayed on the down backend"
    );
    assert!(
        reply_entry(lb, snat_port).is_some_and(|r| r.flags & FLOW_F_CLOSED == 0),
        "the TCP connection to the down backend is kept"
    );
    assert!(lb.events().is_empty(), "an expiry is counted, no event");
    let (action, out) = lb.run(&datagram.build());
    assert_eq!(action, XDP_TX);
    assert_eq!(
        lb.forward_entry(IPPROTO_UDP, DNS, CLIENT_PORT).backend_id,
        1
    );
    assert_eq!(&out[0..6], &backend_mac(1), "sent to backend 1");
}

fn case_sweep_leaves_live_flows(lb: &mut Lb) {
    let snat_port = open_tcp(lb);
    let udp = Pkt::udp((CLIENT, CLIENT_PORT), (VIP, DNS)).payload(b"q");
    assert_eq!(lb.run(&udp.build()).0, XDP_TX);
    lb.events();
    let stats = lb.sweep();
    assert_eq!(stats.runs, 1);
    assert_eq!(stats.entries, 4, "the sweep counts every entry");
    assert_eq!(
        (stats.removed, stats.expired_idle, stats.expired_syn),
        (0, 0, 0)
    );
    assert!(lb.events().is_empty());
    assert!(reply_entry(lb, snat_port).is_some());
    assert_eq!(lb.conns(0).closed, 0);
}

fn case_sweep_expires_idle_and_unanswered(lb: &mut Lb) {
    // An unanswered SYN and an idle UDP flow.
    let syn = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_SYN);
    assert_eq!(lb.run(&syn.build()).0, XDP_TX);
    let udp = Pkt::udp((CLIENT, CLIENT_PORT), (VIP, DNS)).payload(b"q");
    assert_eq!(lb.run(&udp.build()).0, XDP_TX);
    lb.events();
    assert_eq!(lb.snat_used(0), 2);
    lb.timeouts(Timeouts::ZERO);
    // A light pass (no pair checks) expires flows like a full one.
    let stats = lb.sweep_light();
    assert_eq!((stats.expired_syn, stats.expired_idle), (1, 1));
    // The unanswered SYN is a failure the control plane reacts to; the
    // idle flow is only counted.
    let events = lb.events();
    assert_eq!(kinds(&events), [EVENT_REFUSED]);
    assert_eq!(lb.conns(0).closed, 2, "both counted closed in the kernel");
    // The forward entries are gone; the reply entries hold their tuples
    // from the close, and the next sweep past the quarantine frees them.
    assert_eq!(lb.flow_count(), 2);
    assert_eq!(lb.snat_used(0), 2);
    let stats = lb.sweep();
    assert_eq!(lb.flow_count(), 0);
    assert_eq!(lb.snat_used(0), 0);
    assert_eq!((stats.removed, stats.snat_freed), (4, 2));
    assert!(lb.events().is_empty(), "nothing counted twice");
    assert_eq!(lb.conns(0).closed, 2);
}

/// The sweep runs from user space, where a NIC interrupt on its CPU can
/// run `lb_xdp` in the middle of it: it must not use the per-CPU slot the
/// data path packs IPv4 keys in (`FLOW_KEY4`), which the packet would
/// overwrite between the sweep's write and the helper's read (removing
/// another connection's entry). So its IPv4 lookups and removals leave
/// the slot as it was.
fn case_sweep_leaves_the_packet_key_slot_alone(lb: &mut Lb) {
    // An unanswered SYN: a pass past its timeout looks its reply entry up
    // and removes the forward entry, both by IPv4 key.
    let syn = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_SYN);
    assert_eq!(lb.run(&syn.build()).0, XDP_TX);
    lb.events();
    lb.timeouts(Timeouts::ZERO);
    let sentinel = lb_common::FlowKeyV4 {
        src: 0x0a0b_0c0d,
        dst: 0x0102_0304,
        sport: 7,
        dport: 9,
        proto: IPPROTO_UDP,
        ..Default::default()
    };
    lb.set_per_cpu_value("FLOW_KEY4", 0, sentinel);
    let stats = lb.sweep();
    assert_eq!(stats.expired_syn, 1);
    assert!(stats.removed >= 1, "{stats:?}");
    assert_eq!(
        lb.per_cpu_value::<lb_common::FlowKeyV4>("FLOW_KEY4", 0),
        sentinel,
        "the sweep wrote the packet key slot"
    );
    lb.events();
}

fn case_sweep_frees_orphans(lb: &mut Lb) {
    // A reply entry whose forward entry vanished.
    let port_a = open_tcp(lb);
    lb.remove_flow(&key(IPPROTO_TCP, (CLIENT, CLIENT_PORT), (VIP, HTTP)));
    // A forward entry whose reply entry vanished.
    let b = Pkt::tcp((CLIENT, CLIENT_PORT + 1), (VIP, HTTP), TCP_SYN);
    assert_eq!(lb.run(&b.build()).0, XDP_TX);
    let port_b = u16::from_be(
        lb.forward_entry(IPPROTO_TCP, HTTP, CLIENT_PORT + 1)
            .new_sport,
    );
    lb.remove_flow(&key(
        IPPROTO_TCP,
        (backend_addr(0), BACKEND_PORT),
        (SNAT, port_b),
    ));
    lb.events();
    // A light pass does not look for lone entries: both stay.
    let stats = lb.sweep_light();
    assert_eq!(stats.orphans, 0);
    assert_eq!(lb.flow_count(), 2);
    assert_eq!(lb.conns(0).closed, 0);
    // A reply entry younger than a second may be a connection another CPU
    // is creating (the forward entry is inserted second): a full pass
    // judges only the lone forward entry now.
    let stats = lb.sweep();
    assert_eq!(stats.orphans, 1);
    let young = reply_entry(lb, port_a).expect("still there");
    assert_eq!(young.flags & FLOW_F_CLOSED, 0, "not judged while young");
    let reply_a = key(IPPROTO_TCP, (backend_addr(0), BACKEND_PORT), (SNAT, port_a));
    lb.set_flow(
        &reply_a,
        lb_common::FlowEntry {
            created_ns: young.created_ns.saturating_sub(2_000_000_000),
            ..young
        },
    );
    let stats = lb.sweep();
    assert_eq!(stats.orphans, 2, "the pass's counts add up: the reply now");
    let lone = reply_entry(lb, port_a).expect("the lone reply holds its tuple in quarantine");
    assert_ne!(lone.flags & FLOW_F_CLOSED, 0);
    assert!(
        lb.flow(&key(IPPROTO_TCP, (CLIENT, CLIENT_PORT + 1), (VIP, HTTP)))
            .is_none(),
        "the lone forward entry is removed"
    );
    // Both connections counted closed: the lone forward entry's, and the
    // lone reply entry's (its forward entry vanished uncounted), so the
    // backend's in-flight count is back to 0.
    assert_eq!((lb.conns(0).opened, lb.conns(0).closed), (2, 2));
    lb.sweep();
    assert_eq!(lb.conns(0).closed, 2, "counted once");
    lb.timeouts(Timeouts::ZERO);
    lb.sweep();
    assert!(reply_entry(lb, port_a).is_none(), "freed with its tuple");
    assert_eq!(lb.flow_count(), 0);
}

/// An in-place upgrade from a build that kept IPv4's flows in `FLOWS`
/// under 40-byte keys (lb-user's `flow_tables::move_ipv4_entries`): the
/// first pass, before the swap, copies them into `FLOWS4`, where the
/// program finds them; the second, after it, moves what the old program
/// opened meanwhile, leaves what `FLOWS4` has, and empties `FLOWS` of IPv4.
fn case_older_ipv4_flows_move_to_their_own_table(lb: &mut Lb) {
    let port = open_tcp(lb);
    let fwd_key = key(IPPROTO_TCP, (CLIENT, CLIENT_PORT), (VIP, HTTP));
    let rev_key = key(IPPROTO_TCP, (backend_addr(0), BACKEND_PORT), (SNAT, port));
    let fwd = lb.flow(&fwd_key).expect("forward entry");
    let rev = lb.flow(&rev_key).expect("reply entry");
    // As an older program kept them.
    for (k, e) in [(&fwd_key, fwd), (&rev_key, rev)] {
        lb.remove_flow(k);
        lb.set_legacy_flow(k, e);
    }
    assert_eq!(lb.flow_count(), 2);
    assert!(lb.flow(&fwd_key).is_none(), "not in IPv4's table");
    let pins = lb.pin_flow_tables();
    assert_eq!(move_ipv4_entries(pins.path(), false).unwrap(), 2);
    assert_eq!(lb.flow(&fwd_key), Some(fwd));
    assert_eq!(lb.flow(&rev_key), Some(rev));
    assert_eq!(
        lb.legacy_ipv4_flow_count(),
        2,
        "the first pass leaves them where the old program looks"
    );
    // The program finds the connection: its packets keep their SNAT tuple,
    // both ways.
    let ack = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_ACK);
    lb.expect(
        &ack,
        XDP_TX,
        &ack.rewritten(
            (SNAT, port),
            (backend_addr(0), BACKEND_PORT),
            backend_mac(0),
        ),
    );
    let back = from_backend(0, port, TCP_ACK);
    assert_eq!(lb.run(&back.build()).0, XDP_TX, "{:?}", lb.reasons());
    // The second pass: an entry the new program changed stays as it is,
    // one only the old program wrote (after the first pass) moves over.
    let changed = FlowEntry {
        last_seen_ns: 12_345,
        ..lb.flow(&fwd_key).unwrap()
    };
    lb.set_flow(&fwd_key, changed);
    let late_key = key(IPPROTO_TCP, (CLIENT, CLIENT_PORT + 9), (VIP, HTTP));
    lb.set_legacy_flow(&late_key, fwd);
    assert_eq!(move_ipv4_entries(pins.path(), true).unwrap(), 1);
    assert_eq!(lb.flow(&fwd_key), Some(changed));
    assert_eq!(lb.flow(&late_key), Some(fwd));
    assert_eq!(lb.legacy_ipv4_flow_count(), 0);
    assert_eq!(lb.flow_count(), 3);
}

fn case_reply_to_unknown_snat_tuple_dropped(lb: &mut Lb) {
    // In the SNAT range, to the SNAT address, no flow: dropped, counted.
    let stray = from_backend(0, SNAT_PORT_MIN + 7, TCP_ACK);
    assert_eq!(lb.run(&stray.build()).0, XDP_DROP);
    assert_eq!(lb.reason(reason::DROP_SNAT_NO_FLOW), 1);
    let stray_udp = Pkt::udp((backend_addr(0), BACKEND_PORT), (SNAT, SNAT_PORT_MAX));
    assert_eq!(lb.run(&stray_udp.build()).0, XDP_DROP);
    assert_eq!(lb.reason(reason::DROP_SNAT_NO_FLOW), 2);
    // Outside the range, or to another address of the host: the host's.
    lb.expect_pass(&from_backend(0, SNAT_PORT_MAX + 1, TCP_ACK).build());
    let other = Pkt::tcp(
        (backend_addr(0), BACKEND_PORT),
        (CLIENT, SNAT_PORT_MIN),
        TCP_ACK,
    );
    lb.expect_pass(&other.build());
    assert_eq!(lb.reason(reason::DROP_SNAT_NO_FLOW), 2);
}

fn case_rst_to_syn_refused(lb: &mut Lb) {
    let snat_port = open_tcp(lb);
    let rst = from_backend(0, snat_port, TCP_RST | TCP_ACK);
    lb.expect(
        &rst,
        XDP_TX,
        &rst.rewritten((VIP, HTTP), (CLIENT, CLIENT_PORT), CLIENT_MAC),
    );
    assert_eq!(lb.handshakes(0), 0, "refused, not accepted");
    let events = lb.events();
    assert_eq!(
        kinds(&events),
        [EVENT_REFUSED],
        "REFUSED is the only terminal event"
    );
    assert_eq!(
        lb.conns(0),
        BackendConns {
            opened: 1,
            closed: 1
        }
    );
}

/// A SYN-ACK that comes after the SYN was given up on (no answer within
/// the SYN timeout: the sweep closed the connection as refused and removed
/// its forward entry) is dropped: sent on, it would make the client's
/// socket established on a flow that forwards nothing, and the client
/// would wait for its own timeout. Dropped, the client's next SYN is
/// balanced again.
fn case_a_syn_ack_after_the_syn_was_given_up_on_is_dropped(lb: &mut Lb) {
    let snat_port = open_tcp(lb);
    lb.events();
    lb.timeouts(Timeouts::ZERO);
    assert_eq!(lb.sweep_light().expired_syn, 1);
    assert_eq!(kinds(&lb.events()), [EVENT_REFUSED]);
    let late = from_backend(0, snat_port, TCP_SYN | TCP_ACK).build();
    assert_eq!(lb.run(&late).0, XDP_DROP);
    assert_eq!(lb.reason(reason::DROP_SNAT_NO_FLOW), 1);
    assert_eq!(lb.handshakes(0), 0, "not a connection accepted");
    lb.timeouts(Timeouts::default());
    let syn = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_SYN);
    assert_eq!(lb.run(&syn.build()).0, XDP_TX);
    assert_eq!(lb.conns(0).opened, 2);
}

fn case_backend_reset_reported(lb: &mut Lb) {
    let snat_port = open_tcp(lb);
    let syn_ack = from_backend(0, snat_port, TCP_SYN | TCP_ACK);
    lb.expect(&syn_ack, XDP_TX, &to_client_of(&syn_ack));
    let rst = from_backend(0, snat_port, TCP_RST | TCP_ACK);
    lb.expect(&rst, XDP_TX, &to_client_of(&rst));
    let events = lb.events();
    assert_eq!(
        kinds(&events),
        [EVENT_CLOSED],
        "a backend's reset is a failure event"
    );
    assert_eq!(events[0].reason, CLOSE_BACKEND_RST);
    assert_eq!(lb.conns(0).closed, 1);
}

fn case_next_hop_cached_per_flow(lb: &mut Lb) {
    let snat_port = open_tcp(lb);
    let data = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_ACK);
    let via = |mac| data.rewritten((SNAT, snat_port), (backend_addr(0), BACKEND_PORT), mac);
    // The backend's MAC changes: the flow keeps the hop it resolved...
    let moved = [0x02, 0, 0, 9, 9, 9];
    lb.neighbour(backend_addr(0), moved, 0);
    lb.expect(&data, XDP_TX, &via(backend_mac(0)));
    // ...until its once-a-second refresh (here: the entry made a second
    // older) drops the cache; the next packet resolves the new MAC.
    let fwd_key = key(IPPROTO_TCP, (CLIENT, CLIENT_PORT), (VIP, HTTP));
    age(lb, &fwd_key, 2);
    lb.expect(&data, XDP_TX, &via(backend_mac(0)));
    lb.expect(&data, XDP_TX, &via(moved));
    let fwd = lb.flow(&fwd_key).expect("forward entry");
    assert_eq!((fwd.client_mac, fwd.client_ifindex), (moved, 1));
}

/// A new flow starts with the hop the last new flow to its backend
/// resolved on this CPU while that is fresh (no FIB or neighbour lookup:
/// a marker MAC written into the kept hop comes out on the frame). A hop
/// older than `BACKEND_HOP_JIFFIES`, one kept for another address (a
/// reused backend id), or one leaving by another interface is resolved
/// again.
fn case_next_hop_shared_per_backend(lb: &mut Lb) {
    const MARKER: [u8; 6] = [0x02, 0, 0, 0x0b, 0x0b, 0x0b];
    // The frame's destination MAC and the forward entry's cached hop.
    let open = |lb: &mut Lb, port: u16| {
        let (action, out) = lb.run(&Pkt::tcp((CLIENT, port), (VIP, HTTP), TCP_SYN).build());
        assert_eq!(action, XDP_TX, "{:?}", lb.reasons());
        let fwd = lb.forward_entry(IPPROTO_TCP, HTTP, port);
        (<[u8; 6]>::try_from(&out[..6]).expect("frame"), fwd)
    };
    // The freshness checks run within 90 ms (under 100 jiffies at any HZ);
    // a run that took longer (a loaded host) is tried again.
    let mut port = 41_000;
    let mut timely = false;
    for _ in 0..5 {
        let started = std::time::Instant::now();
        let (mac, fwd) = open(lb, port);
        assert_eq!(mac, backend_mac(0), "resolved through the neighbour map");
        let kept = lb.backend_hop(0);
        assert_eq!(
            (kept.dst, kept.mac, kept.ifindex),
            (fwd.new_dst, backend_mac(0), 1),
            "the hop is kept for the backend"
        );
        lb.set_backend_hop(
            0,
            BackendHop {
                mac: MARKER,
                ..kept
            },
        );
        let shared = open(lb, port + 1);
        // Another address under the same id (a reused id), still fresh.
        lb.set_backend_hop(
            0,
            BackendHop {
                dst: [0x0a00_00fe, 0, 0, 0],
                mac: MARKER,
                ..kept
            },
        );
        let other_address = open(lb, port + 2);
        port += 3;
        if started.elapsed() > std::time::Duration::from_millis(90) {
            continue;
        }
        assert_eq!(shared.0, MARKER, "the second flow took the kept hop");
        assert_eq!((shared.1.client_mac, shared.1.client_ifindex), (MARKER, 1));
        assert_eq!(other_address.0, backend_mac(0), "not kept for this address");
        timely = true;
        break;
    }
    assert!(timely, "no run of the case took under 90 ms");
    // An old hop is resolved again, and kept anew.
    let kept = lb.backend_hop(0);
    lb.set_backend_hop(
        0,
        BackendHop {
            mac: MARKER,
            jiffies: kept.jiffies.wrapping_sub(BACKEND_HOP_JIFFIES),
            ..kept
        },
    );
    assert_eq!(
        open(lb, port).0,
        backend_mac(0),
        "an old hop is resolved again"
    );
    let renewed = lb.backend_hop(0);
    assert_eq!(renewed.mac, backend_mac(0));
    assert!(
        renewed.jiffies.wrapping_sub(kept.jiffies) < 1 << 31,
        "stamped anew"
    );
    // A hop through another interface (a redirect) is not kept.
    lb.set_neighbour_keeping_hops(backend_addr(0), backend_mac(0), 7);
    let old = BackendHop {
        jiffies: renewed.jiffies.wrapping_sub(BACKEND_HOP_JIFFIES),
        ..renewed
    };
    lb.set_backend_hop(0, old);
    let (action, _) = lb.run(&Pkt::tcp((CLIENT, port + 1), (VIP, HTTP), TCP_SYN).build());
    assert_eq!(action, XDP_REDIRECT);
    assert_eq!(lb.backend_hop(0), old, "a redirected hop is not kept");
}

/// Makes the entry at `key` `secs` seconds older (its once-a-second
/// refresh is then due): its `last_seen_ns`, and the jiffies of its last
/// refresh check by as many seconds at HZ=1000 (the most a kernel ticks).
fn age(lb: &mut Lb, key: &lb_common::FlowKey, secs: u64) {
    let mut entry = lb.flow(key).expect("flow entry");
    entry.last_seen_ns -= secs * 1_000_000_000;
    entry.checked_jiffies = entry.checked_jiffies.wrapping_sub(secs as u32 * 1000);
    lb.set_flow(key, entry);
}

/// Bulk packets read no clock: with the refresh not due by jiffies, an
/// entry whose `last_seen_ns` alone is made old is not refreshed (the
/// precise clock was not read); once jiffies say a check is due, it is.
fn case_bulk_packets_check_the_clock_only_when_jiffies_say_so(lb: &mut Lb) {
    let snat_port = open_tcp(lb);
    let fwd_key = key(IPPROTO_TCP, (CLIENT, CLIENT_PORT), (VIP, HTTP));
    let data = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_ACK);
    let via = data.rewritten(
        (SNAT, snat_port),
        (backend_addr(0), BACKEND_PORT),
        backend_mac(0),
    );
    // A new entry counts as just checked.
    let checked = lb.flow(&fwd_key).expect("forward entry");
    assert_ne!(checked.checked_jiffies, 0, "stamped at creation");
    lb.expect(&data, XDP_TX, &via);
    let mut stale = checked;
    stale.last_seen_ns -= 2_000_000_000;
    lb.set_flow(&fwd_key, stale);
    for _ in 0..3 {
        lb.expect(&data, XDP_TX, &via);
    }
    assert_eq!(
        lb.flow(&fwd_key).expect("forward entry").last_seen_ns,
        stale.last_seen_ns,
        "no clock read before the jiffies say so"
    );
    age(lb, &fwd_key, 1);
    lb.expect(&data, XDP_TX, &via);
    let refreshed = lb.flow(&fwd_key).expect("forward entry");
    assert!(
        refreshed.last_seen_ns > stale.last_seen_ns + 1_500_000_000,
        "refreshed once jiffies said the check was due: {refreshed:?}"
    );
}

fn case_bulk_reply_skips_the_forward_entry(lb: &mut Lb) {
    let snat_port = open_tcp(lb);
    let syn_ack = from_backend(0, snat_port, TCP_SYN | TCP_ACK);
    lb.expect(&syn_ack, XDP_TX, &to_client_of(&syn_ack));
    let fwd_key = key(IPPROTO_TCP, (CLIENT, CLIENT_PORT), (VIP, HTTP));
    let rev_key = key(
        IPPROTO_TCP,
        (backend_addr(0), BACKEND_PORT),
        (SNAT, snat_port),
    );
    // Bait, written behind the data path's back: the forward entry says a
    // request is pending and was last seen two seconds ago; the reply
    // entry knows of no request and was refreshed just now. A reply path
    // that read the forward entry would take a sample and refresh it.
    let mut bait = lb.flow(&fwd_key).expect("forward entry");
    bait.flags |= FLOW_F_REQUEST_PENDING;
    bait.request_ns = bait.last_seen_ns;
    bait.last_seen_ns -= 2_000_000_000;
    lb.set_flow(&fwd_key, bait);
    let data = from_backend(0, snat_port, TCP_ACK | TCP_PSH).payload(&[b'x'; 100]);
    for _ in 0..3 {
        lb.expect(&data, XDP_TX, &to_client_of(&data));
    }
    assert_eq!(lb.latency(0).count, 0, "no second lookup for bulk packets");
    assert_eq!(lb.flow(&fwd_key), Some(bait), "the forward entry untouched");
    assert_eq!(lb.reason(reason::TX_TO_CLIENT), 4);
    // Once the reply entry's own refresh is due (a second later; here: its
    // stamp made older), the packet refreshes both entries' last_seen_ns
    // (the sweep's idle expiry reads the forward entry's), and with it
    // sees the forward entry's state.
    age(lb, &rev_key, 2);
    let stale_rev = lb.flow(&rev_key).expect("reply entry");
    lb.expect(&data, XDP_TX, &to_client_of(&data));
    let fwd = lb.flow(&fwd_key).expect("forward entry");
    let rev = lb.flow(&rev_key).expect("reply entry");
    assert!(fwd.last_seen_ns > bait.last_seen_ns + 1_000_000_000);
    assert!(rev.last_seen_ns > stale_rev.last_seen_ns + 1_000_000_000);
    assert_eq!(fwd.flags & FLOW_F_REQUEST_PENDING, 0);
    assert_eq!(lb.latency(0).count, 1);
    // Within the next second, skipped again.
    let mut bait = fwd;
    bait.last_seen_ns -= 2_000_000_000;
    lb.set_flow(&fwd_key, bait);
    lb.expect(&data, XDP_TX, &to_client_of(&data));
    assert_eq!(lb.flow(&fwd_key), Some(bait));
    // FIN and RST always reach the connection state: both FINs close it,
    // once; both entries carry the one close time, which later packets
    // (a retransmitted FIN, an RST) do not move.
    let fin = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_FIN | TCP_ACK);
    assert_eq!(lb.run(&fin.build()).0, XDP_TX);
    let fin_back = from_backend(0, snat_port, TCP_FIN | TCP_ACK);
    lb.expect(&fin_back, XDP_TX, &to_client_of(&fin_back));
    assert_eq!(lb.conns(0).closed, 1);
    let fwd = lb.flow(&fwd_key).expect("forward entry");
    let rev = lb.flow(&rev_key).expect("reply entry");
    assert_ne!(fwd.flags & FLOW_F_CLOSED, 0);
    assert_ne!(rev.flags & FLOW_F_CLOSED, 0);
    assert_eq!(rev.last_seen_ns, fwd.last_seen_ns, "one close time");
    for late in [
        fin_back.clone(),
        from_backend(0, snat_port, TCP_ACK).payload(b"late"),
        from_backend(0, snat_port, TCP_RST),
    ] {
        lb.expect(&late, XDP_TX, &to_client_of(&late));
    }
    assert_eq!(
        lb.flow(&rev_key).expect("reply entry").last_seen_ns,
        rev.last_seen_ns
    );
    assert_eq!(lb.conns(0).closed, 1);
    assert!(lb.events().is_empty(), "an orderly close, counted once");
}

fn case_keep_alive_one_sample_per_request(lb: &mut Lb) {
    let snat_port = open_tcp(lb);
    let fwd_key = key(IPPROTO_TCP, (CLIENT, CLIENT_PORT), (VIP, HTTP));
    let rev_key = key(
        IPPROTO_TCP,
        (backend_addr(0), BACKEND_PORT),
        (SNAT, snat_port),
    );
    let pending = |lb: &Lb| {
        let fwd = lb.flow(&fwd_key).expect("forward entry").flags & FLOW_F_REQUEST_PENDING;
        let rev = lb.flow(&rev_key).expect("reply entry").flags & FLOW_F_REQUEST_PENDING;
        (fwd != 0, rev != 0)
    };
    let syn_ack = from_backend(0, snat_port, TCP_SYN | TCP_ACK);
    lb.expect(&syn_ack, XDP_TX, &to_client_of(&syn_ack));
    let request = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_ACK | TCP_PSH)
        .payload(b"GET / HTTP/1.1\r\n\r\n");
    let response = from_backend(0, snat_port, TCP_ACK | TCP_PSH).payload(&[b'x'; 1000]);
    let backend_ack = from_backend(0, snat_port, TCP_ACK);
    for n in 1..=3 {
        assert_eq!(lb.run(&request.build()).0, XDP_TX);
        // The forward path mirrors the pending request into the reply entry.
        assert_eq!(pending(lb), (true, true), "request {n}");
        // A pure ACK is not a response: the request stays pending.
        lb.expect(&backend_ack, XDP_TX, &to_client_of(&backend_ack));
        assert_eq!(pending(lb), (true, true), "request {n}");
        assert_eq!(lb.latency(0).count, n - 1);
        // The response's first segment is the sample and clears both bits;
        // the rest of the response is bulk.
        for _ in 0..4 {
            lb.expect(&response, XDP_TX, &to_client_of(&response));
            assert_eq!(pending(lb), (false, false), "request {n}");
            assert_eq!(lb.latency(0).count, n, "one sample per request");
        }
    }
    // Server push without a request: no sample.
    lb.expect(&response, XDP_TX, &to_client_of(&response));
    assert_eq!(lb.latency(0).count, 3);
    // A backend's reset of the live connection still closes it, with its
    // failure event.
    let rst = from_backend(0, snat_port, TCP_RST | TCP_ACK);
    lb.expect(&rst, XDP_TX, &to_client_of(&rst));
    let events = lb.events();
    assert_eq!(kinds(&events), [EVENT_CLOSED]);
    assert_eq!(events[0].reason, CLOSE_BACKEND_RST);
    assert_eq!(lb.conns(0).closed, 1);
}

fn case_udp_reply_one_sample_per_query(lb: &mut Lb) {
    let query = Pkt::udp((CLIENT, CLIENT_PORT), (VIP, DNS)).payload(b"query");
    assert_eq!(lb.run(&query.build()).0, XDP_TX);
    let fwd = lb.forward_entry(IPPROTO_UDP, DNS, CLIENT_PORT);
    let snat_port = u16::from_be(fwd.new_sport);
    let rev_key = key(
        IPPROTO_UDP,
        (backend_addr(0), BACKEND_PORT),
        (SNAT, snat_port),
    );
    let rev = lb.flow(&rev_key).expect("reply entry");
    assert_ne!(
        rev.flags & FLOW_F_REQUEST_PENDING,
        0,
        "mirrored at creation"
    );
    assert!(lb.progress(0).awaiting(), "the query is outstanding");
    let answer = Pkt::udp((backend_addr(0), BACKEND_PORT), (SNAT, snat_port))
        .macs(LB_MAC, backend_mac(0))
        .payload(b"answer");
    let back = answer.rewritten((VIP, DNS), (CLIENT, CLIENT_PORT), CLIENT_MAC);
    for n in 1..=2 {
        if n > 1 {
            assert_eq!(lb.run(&query.build()).0, XDP_TX);
        }
        for _ in 0..3 {
            lb.expect(&answer, XDP_TX, &back);
            assert_eq!(lb.latency(0).count, n, "one sample per query");
        }
        let rev = lb.flow(&rev_key).expect("reply entry");
        assert_eq!(rev.flags & FLOW_F_REQUEST_PENDING, 0);
        // The answered flow stays open until it idles out, waiting for
        // nothing: no stall clock runs for the backend.
        assert!(!lb.progress(0).awaiting(), "query {n} answered");
    }
    // The reply's next hop is cached per flow (the learned return path here).
    let rev = lb.flow(&rev_key).expect("reply entry");
    assert_eq!(rev.reply_hop(), (CLIENT_MAC, 1));
}

fn case_reply_after_tuple_reuse_leaves_the_new_connection_alone(lb: &mut Lb) {
    let old_port = open_tcp(lb);
    let request = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_ACK | TCP_PSH).payload(b"req");
    // The old connection has a request pending (in both entries) when the
    // client resets it and reuses its tuple for a new connection.
    assert_eq!(lb.run(&request.build()).0, XDP_TX);
    let old_rev = reply_entry(lb, old_port).expect("old reply entry");
    assert_ne!(old_rev.flags & FLOW_F_REQUEST_PENDING, 0);
    let rst = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_RST);
    assert_eq!(lb.run(&rst.build()).0, XDP_TX);
    let syn = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_SYN);
    assert_eq!(lb.run(&syn.build()).0, XDP_TX);
    let new_port = u16::from_be(lb.forward_entry(IPPROTO_TCP, HTTP, CLIENT_PORT).new_sport);
    assert_ne!(new_port, old_port);
    let syn_ack = from_backend(0, new_port, TCP_SYN | TCP_ACK);
    lb.expect(&syn_ack, XDP_TX, &to_client_of(&syn_ack));
    assert_eq!(lb.run(&request.build()).0, XDP_TX);
    let new_fwd = lb.forward_entry(IPPROTO_TCP, HTTP, CLIENT_PORT);
    assert_ne!(new_fwd.flags & FLOW_F_REQUEST_PENDING, 0);
    // The old connection's late response, SYN-ACK, FIN and RST would land
    // in the new connection that took the client tuple: each is dropped
    // (counted as a late reply) and leaves its state alone (no sample, no
    // FIN, no close).
    let late_before = lb.reason(reason::DROP_SNAT_NO_FLOW);
    for late in [
        from_backend(0, old_port, TCP_ACK | TCP_PSH).payload(b"late answer"),
        from_backend(0, old_port, TCP_SYN | TCP_ACK),
        from_backend(0, old_port, TCP_FIN | TCP_ACK),
        from_backend(0, old_port, TCP_RST),
    ] {
        assert_eq!(lb.run(&late.build()).0, XDP_DROP);
    }
    assert_eq!(lb.reason(reason::DROP_SNAT_NO_FLOW), late_before + 4);
    assert_eq!(lb.forward_entry(IPPROTO_TCP, HTTP, CLIENT_PORT), new_fwd);
    assert_eq!(lb.latency(0).count, 0);
    assert_eq!(lb.conns(0).closed, 1, "only the old connection closed");
    assert!(lb.events().is_empty());
    // The new connection's response is its sample.
    let response = from_backend(0, new_port, TCP_ACK | TCP_PSH).payload(b"answer");
    lb.expect(&response, XDP_TX, &to_client_of(&response));
    assert_eq!(lb.latency(0).count, 1);
    let new_fwd = lb.forward_entry(IPPROTO_TCP, HTTP, CLIENT_PORT);
    assert_eq!(new_fwd.flags & FLOW_F_REQUEST_PENDING, 0);
}

/// An ICMP error about the SNAT tuple of a connection whose client tuple a
/// newer connection took (here: the backend's port unreachable for the old
/// connection's last segment) names the old reply entry, which translates
/// to the client tuple the new connection now holds. Sent on, it would be
/// an error about the new connection (a hard error while its connect is
/// pending): it is dropped, counted with the other late replies. An error
/// about the new connection's tuple still reaches the client.
fn case_icmp_error_about_a_replaced_connection_dropped(lb: &mut Lb) {
    use lb_lab::xdp::packet::{IPPROTO_ICMP, checksum};
    const DEST_UNREACH: u8 = 3;
    const PORT_UNREACH: u8 = 3;
    /// The backend's port unreachable about `sent`, a packet the balancer
    /// sent it: the IP header and 8 bytes of the segment quoted.
    fn unreachable_about(sent: &Pkt) -> Pkt {
        let frame = sent.build();
        let mut body = vec![DEST_UNREACH, PORT_UNREACH, 0, 0, 0, 0, 0, 0];
        body.extend_from_slice(&frame[sent.l3_offset()..sent.l4_offset() + 8]);
        let sum = checksum(&[&body]);
        body[2..4].copy_from_slice(&sum.to_be_bytes());
        Pkt::raw(backend_addr(0), SNAT, IPPROTO_ICMP, &body).macs(LB_MAC, backend_mac(0))
    }
    let sent_to_backend =
        |snat_port: u16| Pkt::tcp((SNAT, snat_port), (backend_addr(0), BACKEND_PORT), TCP_ACK);
    let old_port = open_tcp(lb);
    let rst = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_RST);
    assert_eq!(lb.run(&rst.build()).0, XDP_TX);
    let syn = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_SYN);
    assert_eq!(lb.run(&syn.build()).0, XDP_TX);
    let new_fwd = lb.forward_entry(IPPROTO_TCP, HTTP, CLIENT_PORT);
    let new_port = u16::from_be(new_fwd.new_sport);
    assert_ne!(new_port, old_port);
    let late_before = lb.reason(reason::DROP_SNAT_NO_FLOW);
    let about_old = unreachable_about(&sent_to_backend(old_port));
    assert_eq!(
        lb.run(&about_old.build()).0,
        XDP_DROP,
        "an error about the old connection reached the new one: {:?}",
        lb.reasons()
    );
    assert_eq!(lb.reason(reason::DROP_SNAT_NO_FLOW), late_before + 1);
    assert_eq!(lb.forward_entry(IPPROTO_TCP, HTTP, CLIENT_PORT), new_fwd);
    let tx_before = lb.reason(reason::TX_TO_CLIENT);
    let about_new = unreachable_about(&sent_to_backend(new_port));
    assert_eq!(lb.run(&about_new.build()).0, XDP_TX);
    assert_eq!(lb.reason(reason::TX_TO_CLIENT), tx_before + 1);
}

/// SNAT tuples are handed out per backend, so the client's new connection
/// on a reused client tuple can hold the old connection's SNAT address and
/// port towards another backend. The old backend's late packets answer
/// that same SNAT tuple: they must still not land in the new connection
/// (which the new backend would reset) nor close it.
fn case_late_reply_of_another_backend_on_the_same_snat_tuple_dropped(lb: &mut Lb) {
    let cursor = lb.snat_cursor(0);
    let old_port = open_tcp(lb);
    let rst = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_RST);
    assert_eq!(lb.run(&rst.build()).0, XDP_TX);
    // The VIP now has backend 1 only, whose cursor stands where backend
    // 0's stood for the old connection: the same tuple, towards backend 1.
    lb.backend(1, BACKEND_ACTIVE);
    lb.vip(0, HTTP, IPPROTO_TCP, Algorithm::P2cEwma, 0, &[1]);
    lb.set_per_cpu_value(lb_common::SNAT_CURSORS_MAP, 1, cursor);
    let syn = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_SYN);
    assert_eq!(lb.run(&syn.build()).0, XDP_TX);
    let new_fwd = lb.forward_entry(IPPROTO_TCP, HTTP, CLIENT_PORT);
    assert_eq!(new_fwd.backend_id, 1);
    assert_eq!(
        u16::from_be(new_fwd.new_sport),
        old_port,
        "the same SNAT tuple"
    );
    let syn_ack = from_backend(1, old_port, TCP_SYN | TCP_ACK);
    lb.expect(&syn_ack, XDP_TX, &to_client_of(&syn_ack));
    let new_fwd = lb.forward_entry(IPPROTO_TCP, HTTP, CLIENT_PORT);
    let late_before = lb.reason(reason::DROP_SNAT_NO_FLOW);
    for late in [
        from_backend(0, old_port, TCP_SYN | TCP_ACK),
        from_backend(0, old_port, TCP_ACK | TCP_PSH).payload(b"late answer"),
        from_backend(0, old_port, TCP_FIN | TCP_ACK),
        from_backend(0, old_port, TCP_RST),
    ] {
        assert_eq!(lb.run(&late.build()).0, XDP_DROP, "{:?}", lb.reasons());
    }
    assert_eq!(lb.reason(reason::DROP_SNAT_NO_FLOW), late_before + 4);
    assert_eq!(lb.forward_entry(IPPROTO_TCP, HTTP, CLIENT_PORT), new_fwd);
    assert_eq!(lb.conns(1).closed, 0, "the new connection is open");
    assert!(lb.events().is_empty(), "no backend reset reported");
    // The new backend's own packets still go through.
    let data = from_backend(1, old_port, TCP_ACK | TCP_PSH).payload(b"answer");
    lb.expect(&data, XDP_TX, &to_client_of(&data));
}

fn case_reply_next_hop_cached_per_flow(lb: &mut Lb) {
    let snat_port = open_tcp(lb);
    let rev_key = key(
        IPPROTO_TCP,
        (backend_addr(0), BACKEND_PORT),
        (SNAT, snat_port),
    );
    let hop = |lb: &Lb| lb.flow(&rev_key).expect("reply entry").reply_hop();
    let data = from_backend(0, snat_port, TCP_ACK);
    let via = |mac| data.rewritten((VIP, HTTP), (CLIENT, CLIENT_PORT), mac);
    // A neighbour entry for the client beats the learned return path; the
    // first reply resolves it and the flow keeps it.
    let near = [0x02, 0, 0, 7, 7, 7];
    lb.neighbour(CLIENT, near, 0);
    assert_eq!(
        hop(lb),
        ([0; 6], 0),
        "nothing cached before the first reply"
    );
    lb.expect(&data, XDP_TX, &via(near));
    assert_eq!(hop(lb), (near, 1));
    // The neighbour changes: the flow keeps its hop...
    let moved = [0x02, 0, 0, 8, 8, 8];
    lb.neighbour(CLIENT, moved, 0);
    lb.expect(&data, XDP_TX, &via(near));
    lb.expect(&data, XDP_TX, &via(near));
    // ...until its once-a-second refresh (here: the reply entry made two
    // seconds older), which resolves it again.
    age(lb, &rev_key, 2);
    lb.expect(&data, XDP_TX, &via(moved));
    assert_eq!(hop(lb), (moved, 1));
    lb.expect(&data, XDP_TX, &via(moved));
    // The neighbour entry goes: after the next refresh the learned return
    // path is the last resort, and is cached in turn.
    lb.remove_neighbour(CLIENT);
    lb.expect(&data, XDP_TX, &via(moved));
    age(lb, &rev_key, 2);
    lb.expect(&data, XDP_TX, &via(CLIENT_MAC));
    assert_eq!(hop(lb), (CLIENT_MAC, 1));
    // The client moves behind another interface: a redirect, never
    // cached; the stale hop is dropped at the refresh.
    lb.neighbour(CLIENT, near, 7);
    lb.expect(&data, XDP_TX, &via(CLIENT_MAC));
    age(lb, &rev_key, 2);
    assert_eq!(lb.run(&data.build()).0, XDP_REDIRECT);
    assert_eq!(hop(lb).1, 0);
    assert_eq!(lb.run(&data.build()).0, XDP_REDIRECT);
    assert_eq!(lb.reason(reason::REDIRECT), 2);
    // The learned path itself never changes.
    let rev = lb.flow(&rev_key).expect("reply entry");
    assert_eq!((rev.client_mac, rev.client_ifindex), (CLIENT_MAC, 1));
}

fn case_udp_both_ways(lb: &mut Lb) {
    let query = Pkt::udp((CLIENT, CLIENT_PORT), (VIP, DNS)).payload(b"query");
    let (action, out) = lb.run(&query.build());
    assert_eq!(action, XDP_TX, "{:?}", lb.reasons());
    let fwd = lb.forward_entry(IPPROTO_UDP, DNS, CLIENT_PORT);
    let snat_port = u16::from_be(fwd.new_sport);
    assert_eq!(
        out,
        query
            .rewritten(
                (SNAT, snat_port),
                (backend_addr(0), BACKEND_PORT),
                backend_mac(0)
            )
            .build()
    );
    assert_checksums_valid(&out, "rewritten frame");
    assert_eq!(fwd.vip_id, 1);
    assert!(lb.events().is_empty());

    let answer = Pkt::udp((backend_addr(0), BACKEND_PORT), (SNAT, snat_port))
        .macs(LB_MAC, backend_mac(0))
        .payload(b"answer!");
    let (action, out) = lb.run(&answer.build());
    assert_eq!(action, XDP_TX);
    assert_eq!(
        out,
        answer
            .rewritten((VIP, DNS), (CLIENT, CLIENT_PORT), CLIENT_MAC)
            .build()
    );
    assert_checksums_valid(&out, "rewritten frame");
    assert!(lb.events().is_empty());
    assert_eq!(lb.latency(0).count, 1, "the answer is a latency sample");

    // A datagram without checksum keeps having none, both ways.
    let mut bare = query.clone();
    bare.l4 = L4::Udp {
        zero_checksum: true,
    };
    let mut expected = bare.rewritten(
        (SNAT, snat_port),
        (backend_addr(0), BACKEND_PORT),
        backend_mac(0),
    );
    expected.l4 = L4::Udp {
        zero_checksum: true,
    };
    lb.expect(&bare, XDP_TX, &expected);
    let mut bare_answer = answer.clone();
    bare_answer.l4 = L4::Udp {
        zero_checksum: true,
    };
    lb.expect(
        &bare_answer,
        XDP_TX,
        &bare_answer.rewritten((VIP, DNS), (CLIENT, CLIENT_PORT), CLIENT_MAC),
    );
    assert_eq!(lb.conns(0).opened, 1);
}

fn case_non_vip_passes(lb: &mut Lb) {
    // TCP and UDP to the balancer's own address, and to the VIP on another port.
    lb.expect_pass(&Pkt::tcp((CLIENT, CLIENT_PORT), (SNAT, 22), TCP_SYN).build());
    lb.expect_pass(&Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, 443), TCP_SYN).build());
    lb.expect_pass(
        &Pkt::udp((CLIENT, CLIENT_PORT), (SNAT, DNS))
            .payload(b"q")
            .build(),
    );
    lb.expect_pass(
        &Pkt::udp((CLIENT, CLIENT_PORT), (VIP, HTTP))
            .payload(b"q")
            .build(),
    );
    assert_eq!(lb.reason(reason::PASS_NOT_VIP), 4);

    let mut arp = Vec::new();
    arp.extend_from_slice(&[0xff; 6]);
    arp.extend_from_slice(&CLIENT_MAC);
    arp.extend_from_slice(&0x0806u16.to_be_bytes());
    arp.extend_from_slice(&[0, 1, 8, 0, 6, 4, 0, 1]);
    arp.extend_from_slice(&CLIENT_MAC);
    arp.extend_from_slice(&CLIENT.octets());
    arp.extend_from_slice(&[0; 6]);
    arp.extend_from_slice(&VIP.octets());
    lb.expect_pass(&arp);
    assert_eq!(lb.reason(reason::PASS_NOT_IP), 1);

    let mut v6 = Vec::new();
    v6.extend_from_slice(&LB_MAC);
    v6.extend_from_slice(&CLIENT_MAC);
    v6.extend_from_slice(&0x86ddu16.to_be_bytes());
    v6.extend_from_slice(&[0x60, 0, 0, 0, 0, 8, IPPROTO_UDP, 64]);
    v6.extend_from_slice(&[0x20, 0x01, 0x0d, 0xb8].repeat(8)); // src + dst
    v6.extend_from_slice(&[0x9c, 0x40, 0, 53, 0, 8, 0, 0]);
    lb.expect_pass(&v6);
    assert_eq!(lb.reason(reason::PASS_NOT_VIP), 5, "IPv6 UDP to a non-VIP");

    // ICMP to the VIP, and a later fragment (offset 8) to the VIP whose
    // first fragment was never seen (tests/fragments.rs has the rest).
    let mut icmp = Pkt::udp((CLIENT, 0), (VIP, 0)).build();
    icmp[14 + 9] = 1;
    lb.expect_pass(&icmp);
    assert_eq!(lb.reason(reason::PASS_ICMP), 1);
    let mut frag = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_SYN).build();
    frag[14 + 6..14 + 8].copy_from_slice(&0x0001u16.to_be_bytes());
    frag[14 + 10..14 + 12].copy_from_slice(&[0, 0]);
    let sum = lb_lab::xdp::packet::checksum(&[&frag[14..34]]);
    frag[14 + 10..14 + 12].copy_from_slice(&sum.to_be_bytes());
    lb.expect_pass(&frag);
    assert_eq!(lb.reason(reason::PASS_FRAGMENT), 1);
    assert_eq!(lb.flow_count(), 0);
    assert!(lb.events().is_empty());
}

fn case_vlan_tag_kept(lb: &mut Lb) {
    let mut syn = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_SYN);
    syn.vlans = vec![0x0064];
    let (action, out) = lb.run(&syn.build());
    assert_eq!(action, XDP_TX, "{:?}", lb.reasons());
    let snat_port = u16::from_be(lb.forward_entry(IPPROTO_TCP, HTTP, CLIENT_PORT).new_sport);
    let expected = syn.rewritten(
        (SNAT, snat_port),
        (backend_addr(0), BACKEND_PORT),
        backend_mac(0),
    );
    assert_eq!(out, expected.build());
    // Two stacked tags (802.1ad outside 802.1Q) are looked through as well.
    let mut qinq = Pkt::tcp((CLIENT, CLIENT_PORT + 1), (VIP, HTTP), TCP_SYN).build();
    qinq.splice(12..12, [0x88, 0xa8, 0x00, 0x0a, 0x81, 0x00, 0x00, 0x64]);
    assert_eq!(lb.run(&qinq).0, XDP_TX);
    assert_eq!(lb.reason(reason::TX_TO_BACKEND), 2);
}

fn case_ip_options(lb: &mut Lb) {
    let mut syn = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_SYN).payload(b"fast open");
    syn.ip_options = vec![0x01, 0x01, 0x01, 0x00]; // NOP, NOP, NOP, end of options
    let (action, out) = lb.run(&syn.build());
    assert_eq!(action, XDP_TX, "{:?}", lb.reasons());
    let snat_port = u16::from_be(lb.forward_entry(IPPROTO_TCP, HTTP, CLIENT_PORT).new_sport);
    let expected = syn.rewritten(
        (SNAT, snat_port),
        (backend_addr(0), BACKEND_PORT),
        backend_mac(0),
    );
    assert_eq!(out, expected.build());
    let mut max_options = Pkt::udp((CLIENT, CLIENT_PORT), (VIP, DNS)).payload(b"q");
    max_options.ip_options = vec![0x01; 40]; // IHL 15
    assert_eq!(lb.run(&max_options.build()).0, XDP_TX);
}

fn case_malformed_and_truncated(lb: &mut Lb) {
    let syn = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_SYN).build();
    let udp = Pkt::udp((CLIENT, CLIENT_PORT), (VIP, DNS)).build();
    let set_tot_len = |f: &mut Vec<u8>| {
        let len = (f.len() - 14) as u16;
        f[16..18].copy_from_slice(&len.to_be_bytes());
    };
    let cases: Vec<(&str, Vec<u8>, u32, u32)> = vec![
        (
            "IPv4 EtherType, no IPv4 header",
            syn[..14].to_vec(),
            XDP_DROP,
            reason::DROP_TRUNCATED,
        ),
        (
            "cut inside a VLAN tag",
            [&syn[..12], &[0x81, 0x00, 0x00]].concat(),
            XDP_PASS,
            reason::PASS_NOT_IP,
        ),
        (
            "cut inside the IPv4 header",
            syn[..14 + 19].to_vec(),
            XDP_DROP,
            reason::DROP_TRUNCATED,
        ),
        (
            "IPv4 total length beyond the frame",
            syn[..syn.len() - 1].to_vec(),
            XDP_DROP,
            reason::DROP_TRUNCATED,
        ),
        (
            "options beyond the frame",
            {
                let mut f = syn[..14 + 20].to_vec();
                f[14] = 0x46;
                f
            },
            XDP_DROP,
            reason::DROP_TRUNCATED,
        ),
        (
            "cut inside the TCP header",
            {
                let mut f = syn[..14 + 20 + 19].to_vec();
                set_tot_len(&mut f);
                f
            },
            XDP_DROP,
            reason::DROP_TRUNCATED,
        ),
        (
            "TCP options beyond the segment",
            {
                let mut f = syn.clone();
                f[14 + 20 + 12] = 6 << 4;
                f
            },
            XDP_DROP,
            reason::DROP_TRUNCATED,
        ),
        (
            "cut inside the UDP header",
            {
                let mut f = udp[..14 + 20 + 7].to_vec();
                set_tot_len(&mut f);
                f
            },
            XDP_DROP,
            reason::DROP_TRUNCATED,
        ),
        (
            "IHL 4",
            {
                let mut f = syn.clone();
                f[14] = 0x44;
                f
            },
            XDP_DROP,
            reason::DROP_BAD_HEADER,
        ),
        (
            "IP version 6 in an IPv4 frame",
            {
                let mut f = syn.clone();
                f[14] = 0x65;
                f
            },
            XDP_DROP,
            reason::DROP_BAD_HEADER,
        ),
        (
            "TCP data offset 4",
            {
                let mut f = syn.clone();
                f[14 + 20 + 12] = 4 << 4;
                f
            },
            XDP_DROP,
            reason::DROP_BAD_HEADER,
        ),
        (
            "total length below the header length",
            {
                let mut f = syn.clone();
                f[16..18].copy_from_slice(&19u16.to_be_bytes());
                f
            },
            XDP_DROP,
            reason::DROP_BAD_HEADER,
        ),
    ];
    for (name, frame, action, why) in cases {
        let before = lb.reason(why);
        let (got, out) = lb.run(&frame);
        assert_eq!(got, action, "{name}: {:?}", lb.reasons());
        assert_eq!(
            lb.reason(why),
            before + 1,
            "{name}: counted as {}",
            reason::NAMES[why as usize]
        );
        if action == XDP_PASS {
            assert_eq!(out, frame, "{name}: passed unchanged");
        }
    }
    assert_eq!(lb.flow_count(), 0);
}

fn case_tcp_without_flow_dropped(lb: &mut Lb) {
    for flags in [
        TCP_ACK,
        TCP_ACK | TCP_PSH,
        TCP_SYN | TCP_ACK,
        TCP_FIN | TCP_ACK,
        TCP_RST,
    ] {
        let (action, _) = lb.run(&Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), flags).build());
        assert_eq!(action, XDP_DROP);
    }
    assert_eq!(lb.reason(reason::DROP_NO_FLOW), 5);
    assert_eq!(lb.flow_count(), 0);
    assert_eq!(lb.conns(0).opened, 0);
}

fn case_p2c_prefers_cheaper(lb: &mut Lb) {
    lb.backend(1, BACKEND_ACTIVE);
    lb.set_cost(0, 1);
    lb.set_cost(1, 1000);
    // Bias 1: backend 0 scores 1 × (in-flight + 1) ≤ 100 for all 100 flows, still below 1000.
    lb.vip(0, HTTP, IPPROTO_TCP, Algorithm::P2cEwma, 1, &[1, 0]);
    for i in 0..100 {
        assert_eq!(
            lb.syn(CLIENT_PORT + i),
            0,
            "flow {i} went to the expensive backend"
        );
    }
    assert_eq!(lb.conns(0).opened, 100);
    assert_eq!(lb.conns(1).opened, 0);
}

fn case_p2c_inflight_term(lb: &mut Lb) {
    lb.backend(1, BACKEND_ACTIVE);
    lb.set_cost(0, 100);
    lb.set_cost(1, 100);
    lb.set_opened(0, 1000);
    lb.vip(0, HTTP, IPPROTO_TCP, Algorithm::P2cEwma, 0, &[0, 1]);
    // 100 × 1001² against 100 × (n + 1)²: backend 1 wins for all of these.
    for i in 0..50 {
        assert_eq!(
            lb.syn(CLIENT_PORT + i),
            1,
            "flow {i} went to the loaded backend"
        );
    }
    // The control plane's own connections (health checks) count as in
    // flight too: 1000 of them on backend 1 make it the busier one
    // (1050 against 1000, then up to 1030 as backend 0 takes these).
    lb.set_correction(1, 1000);
    for i in 50..80 {
        assert_eq!(
            lb.syn(CLIENT_PORT + i),
            0,
            "flow {i} ignored the control plane's connections"
        );
    }
}

fn case_no_backend(lb: &mut Lb) {
    lb.vip(0, HTTP, IPPROTO_TCP, Algorithm::P2cEwma, 0, &[]);
    lb.vip(1, DNS, IPPROTO_UDP, Algorithm::RoundRobin, 0, &[]);
    assert_eq!(
        lb.run(&Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_SYN).build())
            .0,
        XDP_DROP
    );
    assert_eq!(
        lb.run(&Pkt::udp((CLIENT, CLIENT_PORT), (VIP, DNS)).build())
            .0,
        XDP_DROP
    );
    assert_eq!(lb.reason(reason::DROP_NO_BACKEND), 2);
    assert_eq!(lb.flow_count(), 0);
}

fn case_out_of_service_never_chosen(lb: &mut Lb) {
    lb.backend(1, BACKEND_DRAINING);
    lb.backend(2, BACKEND_EJECTED);
    lb.backend(3, BACKEND_ACTIVE);
    lb.vip(0, HTTP, IPPROTO_TCP, Algorithm::P2cEwma, 0, &[0, 1, 2, 3]);
    lb.vip(1, DNS, IPPROTO_UDP, Algorithm::RoundRobin, 0, &[1, 2, 0, 3]);
    // Backend 0 goes out of service after the slots were written.
    lb.backend(0, BACKEND_DRAINING);
    for i in 0..60 {
        assert_eq!(lb.syn(CLIENT_PORT + i), 3);
        let datagram = Pkt::udp((CLIENT, CLIENT_PORT + i), (VIP, DNS)).payload(b"q");
        assert_eq!(lb.run(&datagram.build()).0, XDP_TX);
        assert_eq!(
            lb.forward_entry(IPPROTO_UDP, DNS, CLIENT_PORT + i)
                .backend_id,
            3
        );
    }
    // Nothing selectable at all.
    lb.backend(3, BACKEND_EJECTED);
    assert_eq!(
        lb.run(&Pkt::tcp((CLIENT, 1), (VIP, HTTP), TCP_SYN).build())
            .0,
        XDP_DROP
    );
    assert_eq!(
        lb.run(&Pkt::udp((CLIENT, 1), (VIP, DNS)).build()).0,
        XDP_DROP
    );
    assert_eq!(lb.reason(reason::DROP_NO_BACKEND), 2);
}

fn case_round_robin_even(lb: &mut Lb) {
    lb.backend(1, BACKEND_ACTIVE);
    lb.backend(2, BACKEND_ACTIVE);
    lb.set_cost(0, 1); // would win every time under P2C
    lb.vip(0, HTTP, IPPROTO_TCP, Algorithm::RoundRobin, 0, &[2, 0, 1]);
    let order: Vec<u32> = (0..30).map(|i| lb.syn(CLIENT_PORT + i)).collect();
    assert_eq!(order[..6], [2, 0, 1, 2, 0, 1]);
    for id in 0..3 {
        assert_eq!(order.iter().filter(|&&b| b == id).count(), 10);
        assert_eq!(lb.conns(id).opened, 10);
    }
}

fn case_snat_exhausted(lb: &mut Lb) {
    lb.config(true, SNAT_PORT_MIN, SNAT_PORT_MIN);
    assert_eq!(lb.syn(CLIENT_PORT), 0);
    assert_eq!(
        u16::from_be(lb.forward_entry(IPPROTO_TCP, HTTP, CLIENT_PORT).new_sport),
        SNAT_PORT_MIN
    );
    let (action, _) = lb.run(&Pkt::tcp((CLIENT, CLIENT_PORT + 1), (VIP, HTTP), TCP_SYN).build());
    assert_eq!(action, XDP_DROP);
    assert_eq!(lb.reason(reason::DROP_SNAT_EXHAUSTED), 1);
    assert_eq!(lb.flow_count(), 2);
    assert_eq!(lb.conns(0).opened, 1);
}

fn case_snat_tuple_past_quarantine_is_taken_without_a_sweep(lb: &mut Lb) {
    // One tuple. A closed connection holds it in quarantine: a new SYN is
    // refused while the quarantine lasts, and takes the tuple once it is
    // over, without waiting for a sweep (passes can be a minute apart).
    lb.config(true, SNAT_PORT_MIN, SNAT_PORT_MIN);
    lb.syn(CLIENT_PORT);
    let rst = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_RST);
    assert_eq!(lb.run(&rst.build()).0, XDP_TX);
    let next = Pkt::tcp((CLIENT, CLIENT_PORT + 1), (VIP, HTTP), TCP_SYN);
    assert_eq!(lb.run(&next.build()).0, XDP_DROP);
    assert_eq!(lb.reason(reason::DROP_SNAT_EXHAUSTED), 1);
    assert_eq!(lb.snat_used(0), 1);
    // A quarantine of 200 ms, over: in the second one the sweep leaves the
    // tuple to the data path, which takes it for the next SYN.
    lb.timeouts(Timeouts {
        snat_quarantine_ns: 200_000_000,
        ..Timeouts::default()
    });
    std::thread::sleep(std::time::Duration::from_millis(250));
    let stats = lb.sweep();
    assert_eq!(
        stats.snat_freed, 0,
        "the sweep frees only after two quarantines"
    );
    assert!(reply_entry(lb, SNAT_PORT_MIN).is_some());
    lb.syn(CLIENT_PORT + 1);
    assert_eq!(snat_tuple_of(lb, CLIENT_PORT + 1).1, SNAT_PORT_MIN);
    let reply = reply_entry(lb, SNAT_PORT_MIN).expect("the new connection's reply entry");
    assert_eq!(
        reply.flags & FLOW_F_CLOSED,
        0,
        "the new connection holds the tuple"
    );
    assert_eq!(
        lb.snat_used(0),
        1,
        "the old hold freed, the new one counted"
    );
    assert_eq!(
        lb.conns(0),
        BackendConns {
            opened: 2,
            closed: 1
        }
    );
    // The sweep finds nothing of the old connection's tuple left to free,
    // and the new connection intact.
    let stats = lb.sweep();
    assert_eq!((stats.snat_freed, stats.orphans), (0, 0));
    assert_eq!(lb.snat_used(0), 1);
    let answer = from_backend(0, SNAT_PORT_MIN, TCP_SYN | TCP_ACK);
    let to_new_client = answer.rewritten((VIP, HTTP), (CLIENT, CLIENT_PORT + 1), CLIENT_MAC);
    lb.expect(&answer, XDP_TX, &to_new_client);
}

fn case_snat_tuple_past_quarantine_moves_to_another_id_of_its_backend(lb: &mut Lb) {
    // Backend 0's address and port behind a second VIP, as backend id 1:
    // both ids draw on the same tuples (the reply key holds the address).
    // One tuple, held in quarantine by a closed connection through id 0;
    // once the quarantine is over, a SYN to the second VIP takes the tuple
    // over at the claim's cursor, and the count of tuples held moves from
    // id 0 to id 1.
    const SECOND_VIP_PORT: u16 = HTTP + 1;
    lb.config(true, SNAT_PORT_MIN, SNAT_PORT_MIN);
    lb.backend_at(1, backend_addr(0).into(), BACKEND_ACTIVE);
    lb.vip(2, SECOND_VIP_PORT, IPPROTO_TCP, Algorithm::P2cEwma, 0, &[1]);
    assert_eq!(lb.syn(CLIENT_PORT), 0);
    let rst = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_RST);
    assert_eq!(lb.run(&rst.build()).0, XDP_TX);
    assert_eq!((lb.snat_used(0), lb.snat_used(1)), (1, 0));
    lb.timeouts(Timeouts {
        snat_quarantine_ns: 200_000_000,
        ..Timeouts::default()
    });
    let syn = Pkt::tcp((CLIENT, CLIENT_PORT + 1), (VIP, SECOND_VIP_PORT), TCP_SYN);
    assert_eq!(lb.run(&syn.build()).0, XDP_DROP, "in quarantine");
    assert_eq!(lb.reason(reason::DROP_SNAT_EXHAUSTED), 1);
    std::thread::sleep(std::time::Duration::from_millis(250));
    assert_eq!(lb.run(&syn.build()).0, XDP_TX, "{:?}", lb.reasons());
    let fwd = lb.forward_entry(IPPROTO_TCP, SECOND_VIP_PORT, CLIENT_PORT + 1);
    assert_eq!(
        (fwd.backend_id, u16::from_be(fwd.new_sport)),
        (1, SNAT_PORT_MIN)
    );
    let reply = reply_entry(lb, SNAT_PORT_MIN).expect("the new connection's reply entry");
    assert_eq!((reply.backend_id, reply.flags & FLOW_F_CLOSED), (1, 0));
    assert_eq!(
        (lb.snat_used(0), lb.snat_used(1)),
        (0, 1),
        "the tuple's hold moved to the id that took it"
    );
    assert_eq!(lb.conns(1).opened, 1);
    let stats = lb.sweep();
    assert_eq!((stats.snat_freed, stats.orphans), (0, 0));
    assert_eq!((lb.snat_used(0), lb.snat_used(1)), (0, 1));
}

/// One SNAT tuple, time-wait reuse on: a connection from `CLIENT_PORT`
/// whose backend closes first and whose client's FIN (sequence number
/// `fin_seq`, `fin_options`) ends it, and the backend's ACK of that FIN,
/// so the backend holds the tuple in TIME_WAIT. Returns the reply entry
/// then.
fn closed_by_the_backend_first(
    lb: &mut Lb,
    syn_options: &[u8],
    fin_seq: u32,
    fin_options: &[u8],
) -> lb_common::FlowEntry {
    let rev = client_fin_after_the_backends(lb, syn_options, fin_seq, fin_options);
    assert_ne!(
        rev.flags & FLOW_F_TW_UNACKED,
        0,
        "the FIN is not acknowledged yet"
    );
    let last_ack = from_backend(0, SNAT_PORT_MIN, TCP_ACK).ack(fin_seq.wrapping_add(1));
    assert_eq!(lb.run(&last_ack.build()).0, XDP_TX);
    let rev = reply_entry(lb, SNAT_PORT_MIN).expect("the closed connection's reply entry");
    assert_eq!(
        rev.flags & FLOW_F_TW_UNACKED,
        0,
        "the backend acknowledged the FIN"
    );
    rev
}

/// [`closed_by_the_backend_first`] up to the client's FIN: the backend's
/// answer to it has not come.
fn client_fin_after_the_backends(
    lb: &mut Lb,
    syn_options: &[u8],
    fin_seq: u32,
    fin_options: &[u8],
) -> lb_common::FlowEntry {
    lb.config(true, SNAT_PORT_MIN, SNAT_PORT_MIN);
    lb.time_wait_reuse(true);
    let syn = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_SYN).tcp_options(syn_options);
    assert_eq!(lb.run(&syn.build()).0, XDP_TX, "{:?}", lb.reasons());
    let fin_back = from_backend(0, SNAT_PORT_MIN, TCP_FIN | TCP_ACK);
    lb.expect(&fin_back, XDP_TX, &to_client_of(&fin_back));
    let fin = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_FIN | TCP_ACK)
        .seq(fin_seq)
        .tcp_options(fin_options);
    assert_eq!(lb.run(&fin.build()).0, XDP_TX);
    assert_eq!(lb.conns(0).closed, 1);
    let rev = reply_entry(lb, SNAT_PORT_MIN).expect("the closed connection's reply entry");
    assert_ne!(rev.flags & FLOW_F_CLOSED, 0);
    rev
}

/// A SYN from `client_port` with sequence number `seq` and `options`:
/// its action and whether it got the one tuple.
fn syn_for_the_tuple(lb: &mut Lb, client_port: u16, seq: u32, options: &[u8]) -> u32 {
    let syn = Pkt::tcp((CLIENT, client_port), (VIP, HTTP), TCP_SYN)
        .seq(seq)
        .tcp_options(options);
    lb.run(&syn.build()).0
}

/// A SYN from `client_port` (sequence number 10, Linux's options with
/// `tsval`) that must go out unchanged but for its translation to the
/// first SNAT tuple.
fn syn_takes_the_first_tuple(lb: &mut Lb, client_port: u16, tsval: u32) {
    let syn = Pkt::tcp((CLIENT, client_port), (VIP, HTTP), TCP_SYN)
        .seq(10)
        .tcp_options(&linux_syn_options(tsval));
    let out = syn.rewritten(
        (SNAT, SNAT_PORT_MIN),
        (backend_addr(0), BACKEND_PORT),
        backend_mac(0),
    );
    lb.expect(&syn, XDP_TX, &out);
}

fn case_snat_tuple_in_time_wait_taken_by_a_syn_the_backend_accepts(lb: &mut Lb) {
    let rev =
        closed_by_the_backend_first(lb, &linux_syn_options(900), 5_000, &segment_options(2_000));
    // What the backend's TIME_WAIT holds: rcv_nxt = FIN + 1, the FIN's TSval.
    assert_eq!(
        rev.flags & (FLOW_F_TW_SEEN | FLOW_F_TW_TS | FLOW_F_TW_TS_UNKNOWN),
        FLOW_F_TW_SEEN | FLOW_F_TW_TS
    );
    assert_eq!(rev.created_ns, (5_001u64 << 32) | 2_000);
    // An older timestamp: the backend's PAWS check would reject it (the
    // old ACK, the client's RST, a SYN retransmit a second later), so the
    // tuple stays in quarantine, whatever the sequence number.
    assert_eq!(
        syn_for_the_tuple(lb, CLIENT_PORT + 1, 9_000, &linux_syn_options(1_990)),
        XDP_DROP
    );
    assert_eq!(lb.reason(reason::DROP_SNAT_EXHAUSTED), 1);
    // A newer one is accepted: the SYN takes the tuple over, unchanged.
    syn_takes_the_first_tuple(lb, CLIENT_PORT + 2, 2_001);
    assert_eq!(snat_tuple_of(lb, CLIENT_PORT + 2).1, SNAT_PORT_MIN);
    let new_rev = reply_entry(lb, SNAT_PORT_MIN).expect("the new connection's reply entry");
    assert_eq!(u16::from_be(new_rev.new_dport), CLIENT_PORT + 2);
    assert_eq!(new_rev.flags, 0, "a fresh entry: open, nothing recorded");
    assert_eq!(lb.snat_used(0), 1, "one tuple held, by the new connection");
    assert_eq!(
        lb.conns(0),
        BackendConns {
            opened: 2,
            closed: 1
        }
    );
    // The backend's answer reaches the new client.
    let answer = from_backend(0, SNAT_PORT_MIN, TCP_SYN | TCP_ACK);
    let to_new = answer.rewritten((VIP, HTTP), (CLIENT, CLIENT_PORT + 2), CLIENT_MAC);
    lb.expect(&answer, XDP_TX, &to_new);
    // A late FIN of the old connection (its forward entry lingers) does not
    // write the old connection's view into the new one's entry.
    let late_fin = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_FIN | TCP_ACK)
        .seq(5_000)
        .tcp_options(&segment_options(2_005));
    assert_eq!(lb.run(&late_fin.build()).0, XDP_TX);
    let new_rev = reply_entry(lb, SNAT_PORT_MIN).expect("the new connection's reply entry");
    assert_eq!(new_rev.flags & FLOW_F_TW_SEEN, 0);
    // The sweep finds nothing to free or repair.
    let stats = lb.sweep();
    assert_eq!((stats.snat_freed, stats.orphans), (0, 0));
    assert_eq!(lb.snat_used(0), 1);
}

fn case_a_fin_the_backend_has_not_acknowledged_keeps_its_tuple(lb: &mut Lb) {
    // Linux can lose a FIN that arrives while the socket that sent its own
    // FIN turns into a FIN_WAIT2 timewait socket: the backend then holds
    // the tuple in FIN_WAIT2 with rcv_nxt at the FIN, and answers a SYN on
    // it with an ACK of the old connection. (Seen in the lab: the new
    // client reset, its SYN went out again, the old client's FIN
    // retransmissions met an RST.) Until the backend acknowledges the FIN,
    // a SYN the view would accept does not take the tuple.
    let rev =
        client_fin_after_the_backends(lb, &linux_syn_options(900), 5_000, &segment_options(2_000));
    assert_eq!(
        rev.flags & (FLOW_F_TW_SEEN | FLOW_F_TW_TS | FLOW_F_TW_UNACKED),
        FLOW_F_TW_SEEN | FLOW_F_TW_TS | FLOW_F_TW_UNACKED
    );
    let newer = linux_syn_options(2_001);
    assert_eq!(
        syn_for_the_tuple(lb, CLIENT_PORT + 1, 9_000, &newer),
        XDP_DROP
    );
    assert_eq!(lb.reason(reason::DROP_SNAT_EXHAUSTED), 1);
    // A backend segment that acknowledges the data only (ack = the FIN's
    // sequence number), or an RST, proves nothing; both still reach the
    // client.
    for flags in [TCP_ACK, TCP_RST | TCP_ACK] {
        let not_the_fin = from_backend(0, SNAT_PORT_MIN, flags).ack(if flags & TCP_RST != 0 {
            5_001
        } else {
            5_000
        });
        assert_eq!(lb.run(&not_the_fin.build()).0, XDP_TX);
    }
    let rev = reply_entry(lb, SNAT_PORT_MIN).expect("reply entry");
    assert_ne!(rev.flags & FLOW_F_TW_UNACKED, 0);
    assert_eq!(
        syn_for_the_tuple(lb, CLIENT_PORT + 2, 9_000, &newer),
        XDP_DROP
    );
    // A retransmission of the FIN records again and still waits.
    let fin = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_FIN | TCP_ACK)
        .seq(5_000)
        .tcp_options(&segment_options(2_200));
    assert_eq!(lb.run(&fin.build()).0, XDP_TX);
    let rev = reply_entry(lb, SNAT_PORT_MIN).expect("reply entry");
    assert_eq!(rev.created_ns, (5_001u64 << 32) | 2_200);
    assert_ne!(rev.flags & FLOW_F_TW_UNACKED, 0);
    // The backend's ACK of the FIN (its TIME_WAIT's answer): the tuple
    // is judged by the view from then on.
    let ack = from_backend(0, SNAT_PORT_MIN, TCP_ACK).ack(5_001);
    assert_eq!(lb.run(&ack.build()).0, XDP_TX);
    assert_eq!(
        reply_entry(lb, SNAT_PORT_MIN).expect("reply entry").flags & FLOW_F_TW_UNACKED,
        0
    );
    assert_eq!(
        syn_for_the_tuple(lb, CLIENT_PORT + 3, 9_000, &linux_syn_options(2_100)),
        XDP_DROP,
        "older than the retransmitted FIN"
    );
    assert_eq!(
        syn_for_the_tuple(lb, CLIENT_PORT + 4, 9_000, &linux_syn_options(2_201)),
        XDP_TX
    );
    assert_eq!(snat_tuple_of(lb, CLIENT_PORT + 4).1, SNAT_PORT_MIN);
}

/// The key of the reply entry on `snat_port` (backend 0, the IPv4 SNAT
/// address).
fn reply_key(snat_port: u16) -> lb_common::FlowKey {
    key(
        IPPROTO_TCP,
        (backend_addr(0), BACKEND_PORT),
        (SNAT, snat_port),
    )
}

/// Two quarantines (the default 65 s) and a second.
const PAST_TWO_QUARANTINES_S: u64 = 131;

fn case_the_cursors_tuple_in_time_wait_is_taken_before_stepping_on(lb: &mut Lb) {
    // Two tuples, one CPU slice. The cursor's (handed out one turn ago) is
    // held by a closed connection whose backend's TIME_WAIT accepts the
    // next SYN; the other is free. The SYN takes the cursor's over at the
    // claim's first try: under churn a turned-over slice costs one failed
    // insert and a lookup, not every try and then the take-over pass. (The
    // claim stepped past it to the free one before.)
    lb.config(true, SNAT_PORT_MIN, SNAT_PORT_MIN + 1);
    lb.time_wait_reuse(true);
    let first =
        Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_SYN).tcp_options(&linux_syn_options(900));
    assert_eq!(lb.run(&first.build()).0, XDP_TX, "{:?}", lb.reasons());
    assert_eq!(snat_tuple_of(lb, CLIENT_PORT).1, SNAT_PORT_MIN);
    lb.syn(CLIENT_PORT + 1);
    assert_eq!(snat_tuple_of(lb, CLIENT_PORT + 1).1, SNAT_PORT_MIN + 1);
    // The first closes with the backend first, and the backend acknowledges
    // the client's FIN: it holds the tuple in TIME_WAIT.
    let fin_back = from_backend(0, SNAT_PORT_MIN, TCP_FIN | TCP_ACK);
    assert_eq!(lb.run(&fin_back.build()).0, XDP_TX);
    let fin = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_FIN | TCP_ACK)
        .seq(5_000)
        .tcp_options(&segment_options(2_000));
    assert_eq!(lb.run(&fin.build()).0, XDP_TX);
    let ack = from_backend(0, SNAT_PORT_MIN, TCP_ACK).ack(5_001);
    assert_eq!(lb.run(&ack.build()).0, XDP_TX);
    // The second ends by an RST and is aged past two quarantines, so the
    // sweep frees its tuple.
    let rst = Pkt::tcp((CLIENT, CLIENT_PORT + 1), (VIP, HTTP), TCP_RST);
    assert_eq!(lb.run(&rst.build()).0, XDP_TX);
    age(lb, &reply_key(SNAT_PORT_MIN + 1), PAST_TWO_QUARANTINES_S);
    assert_eq!(lb.sweep().snat_freed, 1);
    assert!(reply_entry(lb, SNAT_PORT_MIN + 1).is_none());
    assert_eq!(lb.snat_used(0), 1);
    syn_takes_the_first_tuple(lb, CLIENT_PORT + 2, 2_001);
    assert_eq!(lb.reason(reason::DROP_SNAT_EXHAUSTED), 0);
    let new_rev = reply_entry(lb, SNAT_PORT_MIN).expect("the new connection's reply entry");
    assert_eq!(
        (u16::from_be(new_rev.new_dport), new_rev.flags),
        (CLIENT_PORT + 2, 0),
        "the cursor's tuple, taken over by the new connection"
    );
    assert!(
        reply_entry(lb, SNAT_PORT_MIN + 1).is_none(),
        "the free tuple is still free"
    );
    assert_eq!(lb.snat_used(0), 1, "the hold moved, none added");
    // The next SYN (the cursor stepped past the one taken over) gets the
    // free tuple.
    lb.syn(CLIENT_PORT + 3);
    assert_eq!(snat_tuple_of(lb, CLIENT_PORT + 3).1, SNAT_PORT_MIN + 1);
    assert_eq!(lb.snat_used(0), 2);
    // (The counts are totals: the one tuple freed above, nothing more.)
    let stats = lb.sweep();
    assert_eq!((stats.snat_freed, stats.orphans), (1, 0));
}

/// A SYN that takes a tuple over from a closed connection in TIME_WAIT
/// replaces that connection's reply entry before it writes its own forward
/// entry. When the forward insert then fails (a full table: the replacing
/// write succeeds there, since a preallocated map keeps spare elements for
/// updates), the tuple must not come out of it free: a free tuple goes to
/// the next SYN with no TIME_WAIT check, while the backend may still hold
/// it. It stays closed, its quarantine started again.
fn case_a_tuple_taken_over_stays_quarantined_when_the_forward_insert_fails(lb: &mut Lb) {
    closed_by_the_backend_first(lb, &linux_syn_options(900), 5_000, &segment_options(2_000));
    let conns = lb.conns(0);
    // Fill the flow table: entries nobody's packets meet (UDP to port 9).
    let fillers: Vec<lb_common::FlowKey> = (0..FLOW_TABLE_SIZE as usize - lb.flow_count())
        .map(|i| {
            key(
                IPPROTO_UDP,
                (
                    std::net::Ipv4Addr::new(10, 99, (i >> 8) as u8, i as u8),
                    40_000,
                ),
                (VIP, 9),
            )
        })
        .collect();
    for filler in &fillers {
        lb.set_flow(filler, lb_common::FlowEntry::default());
    }
    // A SYN the backend's TIME_WAIT accepts: the take-over is allowed,
    // and its forward entry finds no room.
    assert_eq!(
        syn_for_the_tuple(lb, CLIENT_PORT + 1, 9_000, &linux_syn_options(2_001)),
        XDP_DROP
    );
    assert_eq!(lb.reason(reason::DROP_FLOW_INSERT), 1, "{:?}", lb.reasons());
    let rev = reply_entry(lb, SNAT_PORT_MIN).expect("the tuple is still held");
    assert_ne!(rev.flags & FLOW_F_CLOSED, 0, "held closed");
    assert_eq!(
        rev.flags & FLOW_F_TW_SEEN,
        0,
        "no TIME_WAIT view: only the quarantine frees it"
    );
    assert_eq!(lb.snat_used(0), 1, "still counted held");
    assert_eq!(lb.conns(0), conns, "no connection opened or closed");
    // With room again, even a SYN the old view would accept does not get
    // the tuple inside the new quarantine; nor does the sweep free it.
    lb.remove_flow(&fillers[0]);
    assert_eq!(
        syn_for_the_tuple(lb, CLIENT_PORT + 2, 9_000, &linux_syn_options(2_002)),
        XDP_DROP
    );
    assert_eq!(
        lb.reason(reason::DROP_SNAT_EXHAUSTED),
        1,
        "{:?}",
        lb.reasons()
    );
    assert_eq!(lb.sweep().snat_freed, 0);
    assert!(reply_entry(lb, SNAT_PORT_MIN).is_some());
    // Past its quarantine (its second is the data path's) the next SYN takes it.
    age(lb, &reply_key(SNAT_PORT_MIN), 66);
    assert_eq!(
        syn_for_the_tuple(lb, CLIENT_PORT + 3, 9_000, &linux_syn_options(2_003)),
        XDP_TX
    );
    assert_eq!(snat_tuple_of(lb, CLIENT_PORT + 3).1, SNAT_PORT_MIN);
}

/// A client segment of a closed connection that reaches the backend
/// restarts the TIME_WAIT it holds the tuple in (Linux reschedules the
/// timer for every segment with an ACK there), so it restarts the tuple's
/// quarantine too: past the quarantine a tuple goes by age alone, and
/// counted from the close it could go while the backend still holds it.
fn case_a_late_client_segment_restarts_the_quarantine(lb: &mut Lb) {
    closed_by_the_backend_first(lb, &linux_syn_options(900), 5_000, &segment_options(2_000));
    // The close was 61 s ago; the client's last ACK comes again now.
    age(lb, &reply_key(SNAT_PORT_MIN), 61);
    let closed_at = reply_entry(lb, SNAT_PORT_MIN)
        .expect("reply entry")
        .last_seen_ns;
    let ack = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_ACK)
        .seq(5_001)
        .tcp_options(&segment_options(2_100));
    assert_eq!(lb.run(&ack.build()).0, XDP_TX);
    let rev = reply_entry(lb, SNAT_PORT_MIN).expect("reply entry");
    assert!(
        rev.last_seen_ns >= closed_at + 61_000_000_000,
        "the quarantine starts again from the segment"
    );
    // 66 s after the close, 5 s after the segment: a SYN the backend's
    // TIME_WAIT would refuse (an older timestamp) does not take the tuple.
    age(lb, &reply_key(SNAT_PORT_MIN), 5);
    let older = linux_syn_options(2_050);
    assert_eq!(
        syn_for_the_tuple(lb, CLIENT_PORT + 1, 9_000, &older),
        XDP_DROP
    );
    assert_eq!(lb.reason(reason::DROP_SNAT_EXHAUSTED), 1);
    // A quarantine after the segment, it goes by age.
    age(lb, &reply_key(SNAT_PORT_MIN), 61);
    assert_eq!(
        syn_for_the_tuple(lb, CLIENT_PORT + 2, 9_000, &older),
        XDP_TX
    );
    assert_eq!(snat_tuple_of(lb, CLIENT_PORT + 2).1, SNAT_PORT_MIN);
}

/// The same for a late segment with data (a retransmission the backend's
/// TIME_WAIT also answers and restarts its timer for): the quarantine
/// starts again, and the TIME_WAIT view the close recorded stays, since
/// the segment is not the client's last.
fn case_a_late_client_segment_with_data_restarts_the_quarantine(lb: &mut Lb) {
    closed_by_the_backend_first(lb, &linux_syn_options(900), 5_000, &segment_options(2_000));
    age(lb, &reply_key(SNAT_PORT_MIN), 61);
    let before = reply_entry(lb, SNAT_PORT_MIN).expect("reply entry");
    let data = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_ACK | TCP_PSH)
        .seq(4_000)
        .tcp_options(&segment_options(2_100))
        .payload(b"late request bytes");
    assert_eq!(lb.run(&data.build()).0, XDP_TX);
    let rev = reply_entry(lb, SNAT_PORT_MIN).expect("reply entry");
    assert!(
        rev.last_seen_ns >= before.last_seen_ns + 61_000_000_000,
        "the quarantine starts again from the segment"
    );
    assert_eq!(rev.created_ns, before.created_ns, "the recorded view stays");
    assert_eq!(
        rev.flags & (FLOW_F_TW_SEEN | FLOW_F_TW_TS | FLOW_F_TW_TS_UNKNOWN),
        before.flags & (FLOW_F_TW_SEEN | FLOW_F_TW_TS | FLOW_F_TW_TS_UNKNOWN)
    );
    // 5 s after the segment (66 s after the close) a SYN the recorded
    // TIME_WAIT refuses (older than the close's timestamp, which a late
    // out-of-window segment does not move, in Linux either) does not take
    // the tuple; past the quarantine from the segment, it does.
    age(lb, &reply_key(SNAT_PORT_MIN), 5);
    let older = linux_syn_options(1_990);
    assert_eq!(
        syn_for_the_tuple(lb, CLIENT_PORT + 1, 9_000, &older),
        XDP_DROP
    );
    age(lb, &reply_key(SNAT_PORT_MIN), 61);
    assert_eq!(
        syn_for_the_tuple(lb, CLIENT_PORT + 2, 9_000, &older),
        XDP_TX
    );
}

fn case_a_tuple_past_its_second_quarantine_is_left_to_the_sweep(lb: &mut Lb) {
    // Past two quarantines after its close a tuple is the sweep's: the
    // sweep frees it by key, and a SYN taking it over at the same moment
    // could have its new entry removed. So no SYN takes it, even one the
    // recorded TIME_WAIT would accept; once the sweep has freed it, the
    // next SYN claims it.
    closed_by_the_backend_first(lb, &linux_syn_options(900), 5_000, &segment_options(2_000));
    age(lb, &reply_key(SNAT_PORT_MIN), PAST_TWO_QUARANTINES_S);
    let newer = linux_syn_options(2_001);
    assert_eq!(
        syn_for_the_tuple(lb, CLIENT_PORT + 1, 9_000, &newer),
        XDP_DROP
    );
    assert_eq!(lb.reason(reason::DROP_SNAT_EXHAUSTED), 1);
    assert_ne!(
        reply_entry(lb, SNAT_PORT_MIN)
            .expect("the old reply entry")
            .flags
            & FLOW_F_CLOSED,
        0
    );
    let stats = lb.sweep();
    assert_eq!(stats.snat_freed, 1);
    assert_eq!(lb.snat_used(0), 0);
    assert_eq!(
        syn_for_the_tuple(lb, CLIENT_PORT + 2, 9_000, &newer),
        XDP_TX
    );
    assert_eq!(snat_tuple_of(lb, CLIENT_PORT + 2).1, SNAT_PORT_MIN);
    assert_eq!(lb.snat_used(0), 1);
}

fn case_without_timestamps_the_sequence_number_decides(lb: &mut Lb) {
    // Neither side used timestamps: the FIN had no options.
    closed_by_the_backend_first(lb, &[2, 4, 5, 180, 1, 3, 3, 7], 70_000, &[]);
    let rev = reply_entry(lb, SNAT_PORT_MIN).expect("reply entry");
    assert_eq!(
        rev.flags & (FLOW_F_TW_SEEN | FLOW_F_TW_TS | FLOW_F_TW_TS_UNKNOWN),
        FLOW_F_TW_SEEN
    );
    // At or before rcv_nxt (70,001): an old duplicate to the backend.
    assert_eq!(
        syn_for_the_tuple(lb, CLIENT_PORT + 1, 70_001, &[]),
        XDP_DROP
    );
    assert_eq!(syn_for_the_tuple(lb, CLIENT_PORT + 2, 12, &[]), XDP_DROP);
    assert_eq!(lb.reason(reason::DROP_SNAT_EXHAUSTED), 2);
    // Beyond it: accepted, also with a timestamp the old connection never
    // negotiated (Linux then checks the sequence number only).
    assert_eq!(
        syn_for_the_tuple(lb, CLIENT_PORT + 3, 70_002, &linux_syn_options(1)),
        XDP_TX
    );
    assert_eq!(snat_tuple_of(lb, CLIENT_PORT + 3).1, SNAT_PORT_MIN);
}

fn case_unknown_fin_options_keep_a_timestamped_syn_out(lb: &mut Lb) {
    // The FIN's options are in no layout the data path knows (a bare TS
    // option first): whether it carried a timestamp is unknown.
    let odd = [8, 10, 0, 0, 7, 208, 0, 0, 0, 9, 1, 1];
    closed_by_the_backend_first(lb, &linux_syn_options(900), 5_000, &odd);
    let rev = reply_entry(lb, SNAT_PORT_MIN).expect("reply entry");
    assert_ne!(rev.flags & FLOW_F_TW_TS_UNKNOWN, 0);
    // A timestamped SYN: unknown against unknown, the quarantine holds.
    assert_eq!(
        syn_for_the_tuple(lb, CLIENT_PORT + 1, 900_000, &linux_syn_options(1 << 30)),
        XDP_DROP
    );
    // A SYN without timestamps skips PAWS: its sequence number decides.
    assert_eq!(syn_for_the_tuple(lb, CLIENT_PORT + 2, 900_000, &[]), XDP_TX);
}

fn case_time_wait_reuse_off_keeps_the_quarantine(lb: &mut Lb) {
    closed_by_the_backend_first(lb, &linux_syn_options(900), 5_000, &segment_options(2_000));
    lb.time_wait_reuse(false);
    assert_eq!(
        syn_for_the_tuple(lb, CLIENT_PORT + 1, 9_000, &linux_syn_options(3_000)),
        XDP_DROP
    );
    assert_eq!(lb.reason(reason::DROP_SNAT_EXHAUSTED), 1);
    lb.time_wait_reuse(true);
    assert_eq!(
        syn_for_the_tuple(lb, CLIENT_PORT + 2, 9_000, &linux_syn_options(3_000)),
        XDP_TX
    );
}

fn case_a_tuple_the_client_closed_first_is_judged_by_its_last_ack(lb: &mut Lb) {
    // The client's FIN first: the connection is still open (the backend
    // may be sending), its tuple not free; once the backend's FIN closes
    // it, the backend waits in LAST_ACK (where a SYN on the tuple would
    // draw a challenge ACK), so nothing is recorded from the FIN and the
    // tuple stays in quarantine. The client's last ACK ends LAST_ACK, or,
    // if the FINs crossed, is the last segment the backend's TIME_WAIT
    // saw: the tuple is judged by it from then on.
    lb.config(true, SNAT_PORT_MIN, SNAT_PORT_MIN);
    lb.time_wait_reuse(true);
    let syn =
        Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_SYN).tcp_options(&linux_syn_options(900));
    assert_eq!(lb.run(&syn.build()).0, XDP_TX);
    let fin = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_FIN | TCP_ACK)
        .seq(5_000)
        .tcp_options(&segment_options(2_000));
    assert_eq!(lb.run(&fin.build()).0, XDP_TX);
    let rev = reply_entry(lb, SNAT_PORT_MIN).expect("reply entry");
    assert_eq!(rev.flags & (FLOW_F_CLOSED | FLOW_F_TW_SEEN), 0);
    assert_eq!(
        syn_for_the_tuple(lb, CLIENT_PORT + 1, 9_000, &linux_syn_options(3_000)),
        XDP_DROP,
        "an open connection's tuple"
    );
    let fin_back = from_backend(0, SNAT_PORT_MIN, TCP_FIN | TCP_ACK);
    lb.expect(&fin_back, XDP_TX, &to_client_of(&fin_back));
    // A retransmitted client FIN, after the backend's: still nothing.
    assert_eq!(lb.run(&fin.build()).0, XDP_TX);
    let rev = reply_entry(lb, SNAT_PORT_MIN).expect("reply entry");
    assert_eq!(rev.flags & (FLOW_F_CLOSED | FLOW_F_TW_SEEN), FLOW_F_CLOSED);
    assert_eq!(
        syn_for_the_tuple(lb, CLIENT_PORT + 2, 9_000, &linux_syn_options(3_000)),
        XDP_DROP,
        "a tuple whose backend is in LAST_ACK"
    );
    assert_eq!(lb.reason(reason::DROP_SNAT_EXHAUSTED), 2);
    assert_eq!(lb.conns(0).opened, 1);
    // The client's last ACK (of the backend's FIN).
    let last_ack = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_ACK)
        .seq(5_001)
        .tcp_options(&segment_options(2_010));
    assert_eq!(lb.run(&last_ack.build()).0, XDP_TX);
    let rev = reply_entry(lb, SNAT_PORT_MIN).expect("reply entry");
    assert_eq!(
        rev.flags & (FLOW_F_TW_SEEN | FLOW_F_TW_TS),
        FLOW_F_TW_SEEN | FLOW_F_TW_TS
    );
    assert_eq!(rev.created_ns, (5_001u64 << 32) | 2_010);
    // Older than that ACK: refused; newer: taken.
    assert_eq!(
        syn_for_the_tuple(lb, CLIENT_PORT + 3, 9_000, &linux_syn_options(2_005)),
        XDP_DROP
    );
    assert_eq!(
        syn_for_the_tuple(lb, CLIENT_PORT + 4, 1, &linux_syn_options(2_011)),
        XDP_TX
    );
    assert_eq!(snat_tuple_of(lb, CLIENT_PORT + 4).1, SNAT_PORT_MIN);
}

/// The SNAT address of the forward entry of the connection from `client_port`.
fn snat_tuple_of(lb: &Lb, client_port: u16) -> (std::net::IpAddr, u16) {
    let fwd = lb.forward_entry(IPPROTO_TCP, HTTP, client_port);
    (addr_of(fwd.new_src, AF_INET), u16::from_be(fwd.new_sport))
}

fn case_snat_pool_addresses(lb: &mut Lb) {
    // Two addresses × one port: two connections to one backend, then none.
    let second = std::net::Ipv4Addr::new(10, 0, 0, 6);
    lb.config(true, SNAT_PORT_MIN, SNAT_PORT_MIN);
    lb.snat_pools(&[SNAT.into(), second.into()], &[SNAT6.into()]);
    lb.syn(CLIENT_PORT);
    lb.syn(CLIENT_PORT + 1);
    let mut got = [
        snat_tuple_of(lb, CLIENT_PORT),
        snat_tuple_of(lb, CLIENT_PORT + 1),
    ];
    got.sort();
    assert_eq!(
        got,
        [(SNAT.into(), SNAT_PORT_MIN), (second.into(), SNAT_PORT_MIN)]
    );
    let (action, _) = lb.run(&Pkt::tcp((CLIENT, CLIENT_PORT + 2), (VIP, HTTP), TCP_SYN).build());
    assert_eq!(action, XDP_DROP);
    assert_eq!(lb.reason(reason::DROP_SNAT_EXHAUSTED), 1);
    assert_eq!(lb.snat_used(0), 2);
    // Replies to the second address are translated back.
    let (addr, port) = snat_tuple_of(lb, CLIENT_PORT + 1);
    let std::net::IpAddr::V4(addr) = addr else {
        panic!("an IPv4 flow has an IPv4 SNAT address")
    };
    let reply = Pkt::tcp(
        (backend_addr(0), BACKEND_PORT),
        (addr, port),
        TCP_SYN | TCP_ACK,
    )
    .macs(LB_MAC, backend_mac(0));
    let expected = reply.rewritten((VIP, HTTP), (CLIENT, CLIENT_PORT + 1), CLIENT_MAC);
    lb.expect(&reply, XDP_TX, &expected);
}

/// The SNAT address and port of the IPv6 connection from `client_port`.
fn snat6_tuple_of(lb: &Lb, client_port: u16) -> (std::net::IpAddr, u16) {
    let fwd = lb
        .flow(&key(IPPROTO_TCP, (CLIENT6, client_port), (VIP6, HTTP)))
        .expect("forward flow entry");
    (addr_of(fwd.new_src, AF_INET6), u16::from_be(fwd.new_sport))
}

fn case_snat_pool_addresses_ipv6(lb: &mut Lb) {
    // Three IPv6 addresses × one port: two connections to one IPv6
    // backend take two addresses, the third stays free.
    let pool = [
        SNAT6,
        std::net::Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x6),
        std::net::Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x7),
    ];
    lb.config(true, SNAT_PORT_MIN, SNAT_PORT_MIN);
    lb.snat_pools(&[SNAT.into()], &pool.map(std::net::IpAddr::from));
    lb.backend_at(1, backend_addr6(1).into(), BACKEND_ACTIVE);
    lb.vip_at(
        VIP6.into(),
        2,
        HTTP,
        IPPROTO_TCP,
        Algorithm::P2cEwma,
        0,
        &[1],
    );
    for port in [CLIENT_PORT, CLIENT_PORT + 1] {
        let syn = Pkt::tcp((CLIENT6, port), (VIP6, HTTP), TCP_SYN);
        assert_eq!(lb.run(&syn.build()).0, XDP_TX, "{:?}", lb.reasons());
    }
    let mut got = [
        snat6_tuple_of(lb, CLIENT_PORT),
        snat6_tuple_of(lb, CLIENT_PORT + 1),
    ];
    got.sort();
    assert_eq!(
        got,
        [
            (pool[0].into(), SNAT_PORT_MIN),
            (pool[1].into(), SNAT_PORT_MIN)
        ]
    );
    assert_eq!(lb.snat_used(1), 2);
    // Replies to each address are translated back to their client.
    for client_port in [CLIENT_PORT, CLIENT_PORT + 1] {
        let (addr, port) = snat6_tuple_of(lb, client_port);
        let reply = Pkt::tcp(
            (backend_addr6(1).into(), BACKEND_PORT),
            (addr, port),
            TCP_SYN | TCP_ACK,
        )
        .macs(LB_MAC, backend_mac(1));
        let expected = reply.rewritten((VIP6, HTTP), (CLIENT6, client_port), CLIENT_MAC);
        lb.expect(&reply, XDP_TX, &expected);
    }
    assert_eq!(lb.reason(reason::TX_TO_CLIENT), 2);
    // The third address is the pool's, but no flow holds it: dropped.
    let stray = Pkt::tcp(
        (backend_addr6(1), BACKEND_PORT),
        (pool[2], SNAT_PORT_MIN),
        TCP_ACK,
    )
    .macs(LB_MAC, backend_mac(1));
    assert_eq!(lb.run(&stray.build()).0, XDP_DROP, "not passed to the host");
    assert_eq!(lb.reason(reason::DROP_SNAT_NO_FLOW), 1);
}

fn case_snat_cpu_slices(lb: &mut Lb) {
    // Four ports in two CPU slices: this CPU owns two of them, every
    // other one, and walks them in order.
    lb.config(true, SNAT_PORT_MIN, SNAT_PORT_MIN + 3);
    lb.cpus(2);
    lb.syn(CLIENT_PORT);
    lb.syn(CLIENT_PORT + 1);
    let (_, a) = snat_tuple_of(lb, CLIENT_PORT);
    let (_, b) = snat_tuple_of(lb, CLIENT_PORT + 1);
    assert_eq!(b, a + 2, "the next tuple of this CPU's slice");
    // Its slice full, it takes the other CPU's tuples (SYNs that all land
    // on one CPU still reach every tuple), and only then refuses.
    lb.syn(CLIENT_PORT + 2);
    lb.syn(CLIENT_PORT + 3);
    let mut stolen = [
        snat_tuple_of(lb, CLIENT_PORT + 2).1,
        snat_tuple_of(lb, CLIENT_PORT + 3).1,
    ];
    stolen.sort_unstable();
    let mut others: Vec<u16> = (SNAT_PORT_MIN..=SNAT_PORT_MIN + 3)
        .filter(|p| *p != a && *p != b)
        .collect();
    others.sort_unstable();
    assert_eq!(stolen.to_vec(), others, "the other slice's two tuples");
    assert_eq!(lb.snat_used(0), 4);
    let (action, _) = lb.run(&Pkt::tcp((CLIENT, CLIENT_PORT + 4), (VIP, HTTP), TCP_SYN).build());
    assert_eq!(action, XDP_DROP, "every tuple of both slices is taken");
    assert_eq!(lb.reason(reason::DROP_SNAT_EXHAUSTED), 1);
    // Freed (closed, past quarantine): this CPU's cursor comes round to it again.
    let rst = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_RST);
    assert_eq!(lb.run(&rst.build()).0, XDP_TX);
    lb.timeouts(Timeouts::ZERO);
    lb.sweep();
    lb.sweep();
    lb.timeouts(Timeouts::default());
    lb.syn(CLIENT_PORT + 5);
    assert_eq!(snat_tuple_of(lb, CLIENT_PORT + 5).1, a);
}

fn case_config_not_ready(lb: &mut Lb) {
    lb.config(false, SNAT_PORT_MIN, SNAT_PORT_MAX);
    lb.expect_pass(&Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_SYN).build());
    lb.expect_pass(&Pkt::udp((CLIENT, CLIENT_PORT), (VIP, DNS)).build());
    assert_eq!(lb.reason(reason::PASS_NOT_VIP), 2);
    assert_eq!(lb.flow_count(), 0);
}

fn case_next_hop(lb: &mut Lb) {
    // A neighbour on another interface: redirect.
    lb.neighbour(backend_addr(0), backend_mac(0), 7);
    assert_eq!(
        lb.run(&Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_SYN).build())
            .0,
        XDP_REDIRECT
    );
    assert_eq!(lb.reason(reason::REDIRECT), 1);
    // No neighbour at all: drop.
    lb.backend(1, BACKEND_ACTIVE);
    lb.vip(1, DNS, IPPROTO_UDP, Algorithm::P2cEwma, 0, &[1]);
    lb.remove_neighbour(backend_addr(1));
    assert_eq!(
        lb.run(&Pkt::udp((CLIENT, CLIENT_PORT), (VIP, DNS)).build())
            .0,
        XDP_DROP
    );
    assert_eq!(lb.reason(reason::DROP_NO_NEIGHBOUR), 1);
}

/// A full sweep pass on another CPU may visit a new connection's reply
/// entry before its forward entry is inserted (`flow::create` inserts the
/// reply entry first). Staged by taking the forward entry out around the
/// pass: the connection must stay open, and a quarantine later another
/// client's SYN must not take over its tuple (its backend's packets would
/// then go to that client).
fn case_a_sweep_between_a_new_flows_two_inserts_leaves_it_open(lb: &mut Lb) {
    lb.config(true, SNAT_PORT_MIN, SNAT_PORT_MIN);
    lb.timeouts(Timeouts {
        snat_quarantine_ns: 200_000_000,
        ..Timeouts::default()
    });
    lb.syn(CLIENT_PORT);
    let forward = key(IPPROTO_TCP, (CLIENT, CLIENT_PORT), (VIP, HTTP));
    let entry = lb.flow(&forward).unwrap();
    lb.remove_flow(&forward);
    let stats = lb.sweep();
    lb.set_flow(&forward, entry);
    assert_eq!(stats.orphans, 0, "a reply entry being created is not lone");
    let reply = reply_entry(lb, SNAT_PORT_MIN).unwrap();
    assert_eq!(reply.flags & FLOW_F_CLOSED, 0);
    let synack = from_backend(0, SNAT_PORT_MIN, TCP_SYN | TCP_ACK);
    lb.expect(&synack, XDP_TX, &to_client_of(&synack));
    let ack = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_ACK);
    assert_eq!(lb.run(&ack.build()).0, XDP_TX);
    // Past a quarantine, another client's SYN finds the only tuple taken.
    std::thread::sleep(std::time::Duration::from_millis(250));
    let other = Pkt::tcp((CLIENT, CLIENT_PORT + 1), (VIP, HTTP), TCP_SYN);
    lb.run(&other.build());
    let data = from_backend(0, SNAT_PORT_MIN, TCP_ACK | TCP_PSH).payload(b"for the first");
    lb.expect(&data, XDP_TX, &to_client_of(&data));
}

/// A case by name; it runs on a fresh [`Lb::standard`].
type Case = (&'static str, fn(&mut Lb));

const CASES: &[Case] = &[
    (
        "a closed forward entry is replaced or removed by one claimant",
        case_a_closed_forward_entry_is_replaced_or_removed_by_one_claimant,
    ),
    (
        "late data of a closed connection starts no stall clock",
        case_late_data_of_a_closed_connection_starts_no_stall_clock,
    ),
    (
        "a sweep between a new flow's two inserts leaves it open",
        case_a_sweep_between_a_new_flows_two_inserts_leaves_it_open,
    ),
    ("tcp syn to vip", case_tcp_syn_to_vip),
    ("syn-ack translated back", case_syn_ack_translated_back),
    (
        "retransmitted syn, same backend",
        case_retransmitted_syn_same_backend,
    ),
    ("request/response latency", case_request_response_latency),
    ("pending requests", case_pending_requests),
    (
        "fin from both sides closes once",
        case_fin_from_both_sides_closes_once,
    ),
    ("syn after close re-selects", case_syn_after_close_reselects),
    ("sweep leaves live flows", case_sweep_leaves_live_flows),
    (
        "sweep expires idle and unanswered",
        case_sweep_expires_idle_and_unanswered,
    ),
    ("sweep frees orphans", case_sweep_frees_orphans),
    (
        "sweep leaves the packet key slot alone",
        case_sweep_leaves_the_packet_key_slot_alone,
    ),
    (
        "older ipv4 flows move to their own table",
        case_older_ipv4_flows_move_to_their_own_table,
    ),
    (
        "reply to unknown snat tuple dropped",
        case_reply_to_unknown_snat_tuple_dropped,
    ),
    ("rst to syn refused", case_rst_to_syn_refused),
    (
        "a syn-ack after the syn was given up on is dropped",
        case_a_syn_ack_after_the_syn_was_given_up_on_is_dropped,
    ),
    ("backend reset reported", case_backend_reset_reported),
    ("next hop cached per flow", case_next_hop_cached_per_flow),
    (
        "next hop shared per backend",
        case_next_hop_shared_per_backend,
    ),
    (
        "bulk reply skips the forward entry",
        case_bulk_reply_skips_the_forward_entry,
    ),
    (
        "bulk packets check the clock only when jiffies say so",
        case_bulk_packets_check_the_clock_only_when_jiffies_say_so,
    ),
    (
        "keep-alive: one sample per request",
        case_keep_alive_one_sample_per_request,
    ),
    (
        "udp reply: one sample per query",
        case_udp_reply_one_sample_per_query,
    ),
    (
        "reply after tuple reuse leaves the new connection alone",
        case_reply_after_tuple_reuse_leaves_the_new_connection_alone,
    ),
    (
        "late reply of another backend on the same snat tuple dropped",
        case_late_reply_of_another_backend_on_the_same_snat_tuple_dropped,
    ),
    (
        "icmp error about a replaced connection dropped",
        case_icmp_error_about_a_replaced_connection_dropped,
    ),
    (
        "reply next hop cached per flow",
        case_reply_next_hop_cached_per_flow,
    ),
    ("udp both ways", case_udp_both_ways),
    (
        "a udp flow leaves a backend that went down",
        case_a_udp_flow_leaves_a_backend_that_went_down,
    ),
    ("non-vip traffic passes", case_non_vip_passes),
    ("vlan tag kept", case_vlan_tag_kept),
    ("ipv4 options", case_ip_options),
    ("malformed and truncated", case_malformed_and_truncated),
    ("tcp without flow dropped", case_tcp_without_flow_dropped),
    ("p2c prefers cheaper", case_p2c_prefers_cheaper),
    ("p2c in-flight term", case_p2c_inflight_term),
    ("no backend", case_no_backend),
    (
        "out-of-service never chosen",
        case_out_of_service_never_chosen,
    ),
    ("round-robin even", case_round_robin_even),
    ("snat exhausted", case_snat_exhausted),
    (
        "syn retransmitted past the timeout is refused and balanced again",
        case_syn_retransmitted_past_the_timeout_is_refused_and_balanced_again,
    ),
    (
        "snat tuple past quarantine is taken without a sweep",
        case_snat_tuple_past_quarantine_is_taken_without_a_sweep,
    ),
    (
        "snat tuple past quarantine moves to another id of its backend",
        case_snat_tuple_past_quarantine_moves_to_another_id_of_its_backend,
    ),
    (
        "snat tuple in time wait taken by a syn the backend accepts",
        case_snat_tuple_in_time_wait_taken_by_a_syn_the_backend_accepts,
    ),
    (
        "a fin the backend has not acknowledged keeps its tuple",
        case_a_fin_the_backend_has_not_acknowledged_keeps_its_tuple,
    ),
    (
        "the cursor's tuple in time wait is taken before stepping on",
        case_the_cursors_tuple_in_time_wait_is_taken_before_stepping_on,
    ),
    (
        "a tuple past its second quarantine is left to the sweep",
        case_a_tuple_past_its_second_quarantine_is_left_to_the_sweep,
    ),
    (
        "a late client segment restarts the quarantine",
        case_a_late_client_segment_restarts_the_quarantine,
    ),
    (
        "a late client segment with data restarts the quarantine",
        case_a_late_client_segment_with_data_restarts_the_quarantine,
    ),
    (
        "a tuple taken over stays quarantined when the forward insert fails",
        case_a_tuple_taken_over_stays_quarantined_when_the_forward_insert_fails,
    ),
    (
        "without timestamps the sequence number decides",
        case_without_timestamps_the_sequence_number_decides,
    ),
    (
        "unknown fin options keep a timestamped syn out",
        case_unknown_fin_options_keep_a_timestamped_syn_out,
    ),
    (
        "time wait reuse off keeps the quarantine",
        case_time_wait_reuse_off_keeps_the_quarantine,
    ),
    (
        "a tuple the client closed first is judged by its last ack",
        case_a_tuple_the_client_closed_first_is_judged_by_its_last_ack,
    ),
    ("snat pool addresses", case_snat_pool_addresses),
    ("snat pool addresses ipv6", case_snat_pool_addresses_ipv6),
    ("snat cpu slices", case_snat_cpu_slices),
    ("config not ready", case_config_not_ready),
    ("next hop: redirect, none", case_next_hop),
    ("new-flow floors of the benchmark", case_new_flow_floors),
    (
        "established floors and the no-entry floor of the benchmark",
        case_array_way_floors,
    ),
];

/// The benchmark's new-flow floors (lb-ebpf/src/floor.rs) do what their
/// rows say: a new client's SYN inserts one entry (the forward key) or two
/// (also the reverse key), is sent back with its MACs swapped, and a second
/// SYN of the same client finds its entry and inserts nothing more.
fn case_new_flow_floors(lb: &mut Lb) {
    for (program, entries) in [("xdp_floor_one_entry", 1), ("xdp_floor_two_entries", 2)] {
        lb.load_program(program);
        // A client port of its own per program: no key meets the other's.
        let port = CLIENT_PORT + entries as u16;
        let syn = Pkt::tcp((CLIENT, port), (VIP, HTTP), TCP_SYN).build();
        let before = lb.flow_count();
        let (action, out, _) = lb.run_program(program, &syn, 1);
        assert_eq!(action, XDP_TX, "{program}");
        assert_eq!(
            out[..6],
            syn[6..12],
            "{program}: destination MAC is the source's"
        );
        assert_eq!(
            out[6..12],
            syn[..6],
            "{program}: source MAC is the destination's"
        );
        assert_eq!(out[12..], syn[12..], "{program}: nothing else rewritten");
        assert_eq!(lb.flow_count(), before + entries, "{program}");
        let forward = key(IPPROTO_TCP, (CLIENT, port), (VIP, HTTP));
        assert!(lb.flow(&forward).is_some(), "{program}: forward key");
        let reverse = key(IPPROTO_TCP, (VIP, HTTP), (CLIENT, port));
        assert_eq!(
            lb.flow(&reverse).is_some(),
            entries == 2,
            "{program}: reverse key"
        );
        assert_eq!(lb.run_program(program, &syn, 1).0, XDP_TX, "{program}");
        assert_eq!(
            lb.flow_count(),
            before + entries,
            "{program}: found, not inserted"
        );
        // Not an IPv4 frame without options: passed, nothing inserted.
        let v6 = Pkt::tcp((CLIENT6, CLIENT_PORT), (VIP6, HTTP), TCP_SYN).build();
        assert_eq!(lb.run_program(program, &v6, 1).0, XDP_PASS, "{program}");
        assert_eq!(lb.flow_count(), before + entries, "{program}");
    }
    case_new_flow_floor_with_a_way(lb);
}

/// The one-entry floor (`xdp_floor_one_entry_way`): a new client's SYN
/// inserts the forward entry only and claims a reply way for its address
/// and ports; its second SYN claims nothing more; with every way taken (the
/// harness keeps one), a new client's SYN finds none and is aborted.
fn case_new_flow_floor_with_a_way(lb: &mut Lb) {
    const PROGRAM: &str = "xdp_floor_one_entry_way";
    lb.load_program(PROGRAM);
    let port = CLIENT_PORT + 3;
    let syn = Pkt::tcp((CLIENT, port), (VIP, HTTP), TCP_SYN).build();
    let before = lb.flow_count();
    let (action, out, _) = lb.run_program(PROGRAM, &syn, 1);
    assert_eq!(action, XDP_TX);
    assert_eq!(
        (&out[..6], &out[6..12]),
        (&syn[6..12], &syn[..6]),
        "MACs swapped"
    );
    assert_eq!(lb.flow_count(), before + 1, "one hash entry");
    assert!(
        lb.flow(&key(IPPROTO_TCP, (CLIENT, port), (VIP, HTTP)))
            .is_some()
    );
    let way = |lb: &mut Lb| {
        lb.array::<[u64; 2]>(FLOOR_REPLY_WAYS_MAP)
            .get(&0, 0)
            .expect("way 0")
    };
    let client = floor_client_word(port);
    assert_eq!(
        way(lb),
        [FLOOR_WAY_CLAIMED, client],
        "the way holds the client"
    );
    assert_eq!(lb.run_program(PROGRAM, &syn, 1).0, XDP_TX);
    assert_eq!(lb.flow_count(), before + 1, "found, not inserted");
    assert_eq!(way(lb), [FLOOR_WAY_CLAIMED, client], "not claimed again");
    let other = Pkt::tcp((CLIENT, port + 1), (VIP, HTTP), TCP_SYN).build();
    assert_eq!(
        lb.run_program(PROGRAM, &other, 1).0,
        XDP_ABORTED,
        "no free way"
    );
    assert_eq!(way(lb), [FLOOR_WAY_CLAIMED, client], "the taken way kept");
}

/// The benchmark's floors over `FLOOR_FLOW_WAYS` (sized as the benchmark
/// sizes it; the given `Lb` keeps one way, so each case loads its own):
/// - `xdp_floor_established_hash` sends a frame whose flow is in `FLOWS`
///   and passes one whose flow is not;
/// - `xdp_floor_established_way` fills its key's way at the first frame and
///   sends every frame, the way keeping the key;
/// - `xdp_floor_two_ways` claims a forward way for a new client (no hash
///   entry) and a reply way, and finds the forward way at its second SYN
///   without claiming another reply way.
fn case_array_way_floors(_: &mut Lb) {
    let mut lb = Lb::standard_sized(&[(FLOOR_FLOW_WAYS_MAP, FLOOR_FLOW_WAYS)]);
    let lb = &mut lb;
    for program in [
        "xdp_floor_established_hash",
        "xdp_floor_established_way",
        "xdp_floor_two_ways",
    ] {
        lb.load_program(program);
    }
    let syn = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_SYN).build();
    assert_eq!(lb.run(&syn).0, XDP_TX, "lb_xdp opens the flow");
    let request = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_ACK).build();
    let (action, out, _) = lb.run_program("xdp_floor_established_hash", &request, 1);
    assert_eq!(action, XDP_TX, "a flow of the table is sent");
    assert_eq!(
        (&out[..6], &out[6..12]),
        (&request[6..12], &request[..6]),
        "MACs swapped"
    );
    let stranger = Pkt::tcp((CLIENT, CLIENT_PORT + 1), (VIP, HTTP), TCP_ACK).build();
    assert_eq!(
        lb.run_program("xdp_floor_established_hash", &stranger, 1).0,
        XDP_PASS,
        "a frame of no flow is not sent"
    );

    let ways = |lb: &mut Lb| {
        let array = lb.array::<[u64; 16]>(FLOOR_FLOW_WAYS_MAP);
        (0..FLOOR_FLOW_WAYS)
            .map(|i| array.get(&i, 0).expect("way"))
            .filter(|way| way[5] != 0)
            .collect::<Vec<_>>()
    };
    let key_words = |port: u16| {
        let key = key(IPPROTO_TCP, (CLIENT, port), (VIP, HTTP));
        // SAFETY: `FlowKey` is 40 bytes of plain integers.
        unsafe { std::mem::transmute::<lb_common::FlowKey, [u64; 5]>(key) }
    };
    for _ in 0..2 {
        let (action, out, _) = lb.run_program("xdp_floor_established_way", &request, 1);
        assert_eq!(action, XDP_TX, "the way floor sends");
        assert_eq!(&out[..6], &request[6..12], "MACs swapped");
    }
    let taken = ways(lb);
    assert_eq!(taken.len(), 1, "one way filled");
    assert_eq!(
        taken[0][..5],
        key_words(CLIENT_PORT),
        "the way holds the key"
    );
    assert_eq!(taken[0][5], FLOOR_WAY_CLAIMED, "and is taken");

    let port = CLIENT_PORT + 2;
    let new_client = Pkt::tcp((CLIENT, port), (VIP, HTTP), TCP_SYN).build();
    let flows = lb.flow_count();
    let reply_way = |lb: &mut Lb| {
        lb.array::<[u64; 2]>(FLOOR_REPLY_WAYS_MAP)
            .get(&0, 0)
            .expect("way 0")
    };
    for _ in 0..2 {
        assert_eq!(
            lb.run_program("xdp_floor_two_ways", &new_client, 1).0,
            XDP_TX,
            "the no-entry floor sends"
        );
    }
    assert_eq!(lb.flow_count(), flows, "no hash entry");
    let taken = ways(lb);
    assert_eq!(taken.len(), 2, "a forward way claimed, found again");
    assert!(
        taken.iter().any(|way| way[..5] == key_words(port)),
        "the forward way holds the new client's key"
    );
    let client = floor_client_word(port);
    assert_eq!(
        reply_way(lb),
        [FLOOR_WAY_CLAIMED, client],
        "the reply way holds the client"
    );
}

/// What a floor's reply way keeps of a client at `CLIENT`:`port` to the
/// VIP's HTTP port (its address and both ports, as the frame carries them).
fn floor_client_word(port: u16) -> u64 {
    (u64::from(u32::from_ne_bytes(CLIENT.octets())) << 32)
        | (u64::from(port.to_be()) << 16)
        | u64::from(HTTP.to_be())
}

fn main() {
    let trials = CASES
        .iter()
        .map(|&(name, case)| {
            packet_case(slug(name), move || {
                let mut lb = Lb::standard();
                case(&mut lb);
            })
        })
        .collect();
    trials::run("xdp_packets", trials)
}
