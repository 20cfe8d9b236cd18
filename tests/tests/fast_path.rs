//! Packet-level tests of `lb_xdp`'s fast path (`lb-ebpf/src/fast_path.rs`)
//! through `BPF_PROG_TEST_RUN`, like `xdp_packets`.
//!
//! The fast path sends the bulk packets of established flows in the
//! common frame shape (no VLAN tag, IPv4 without options or IPv6 without
//! extension headers, TCP or UDP); every other shape, and every packet that
//! changes a flow's state, goes the general way. Here each bulk packet of a
//! connection is sent in the common shape and in two others (an 802.1Q tag;
//! IPv4 options or an IPv6 hop-by-hop header), in both directions, for TCP
//! and UDP over both families: every one must come out translated exactly
//! as its shape asks, while the connection's state (its one latency sample,
//! its open/closed counts, the verdict and traffic counters) is what the
//! general path alone would have made of it.
//!
//! Needs root. Run with `cargo test -p lb-tests --test fast_path`.
use lb_common::{BackendConns, FlowEntry, IPPROTO_TCP, reason};
use lb_lab::{
    trials::{self, packet_case, slug},
    xdp::{
        harness::*,
        packet::{ExtHdr, IPV6_HOP_BY_HOP, Pkt, TCP_ACK, TCP_FIN, TCP_PSH, TCP_SYN, parse},
        world::{self, Conn, TCP80, TCP80_6, UDP53, UDP53_6, Vip},
    },
};

fn lb_world() -> Lb {
    let mut lb = Lb::new();
    world::world(&mut lb);
    lb
}

/// The source port of a frame (after the balancer: its SNAT port).
fn sport(frame: &[u8]) -> u16 {
    let p = parse(frame).expect("IP frame");
    u16::from_be_bytes([frame[p.l4], frame[p.l4 + 1]])
}

/// `pkt` in the common shape (the fast path's), with an 802.1Q tag, and
/// with IPv4 options or an IPv6 hop-by-hop header (the general path's).
fn shapes(pkt: &Pkt) -> [(&'static str, Pkt); 3] {
    let tagged = pkt.clone().vlans(&[100]);
    let (label, with_options) = if pkt.is_v6() {
        let hbh = ExtHdr::Options {
            kind: IPV6_HOP_BY_HOP,
            len8: 0,
        };
        ("hop-by-hop header", pkt.clone().ext(&[hbh]))
    } else {
        // NOP, NOP, NOP, end of options.
        ("ip options", pkt.clone().ip_options(&[1, 1, 1, 0]))
    };
    [
        ("common shape", pkt.clone()),
        ("vlan tag", tagged),
        (label, with_options),
    ]
}

/// Runs every packet of `bulk` (from `side`) in every shape, each of which
/// must be sent translated as `sent` says; returns how many were sent.
fn send_in_every_shape(lb: &Lb, side: &str, bulk: &[Pkt], sent: impl Fn(&Pkt) -> Pkt) -> u64 {
    let mut count = 0;
    for pkt in bulk {
        for (shape, p) in shapes(pkt) {
            let (action, out) = lb.run(&p.build());
            assert_eq!(action, XDP_TX, "{side} {shape}: {:?}", lb.reasons());
            assert_eq!(out, sent(&p).build(), "{side} {shape}");
            count += 1;
        }
    }
    count
}

/// Opens a connection through `vip` from `client_port`: its first packet
/// (a TCP SYN, or a UDP datagram, which is its request) must be sent to
/// the VIP's backend. Returns the connection, with its SNAT port, and that
/// packet.
fn open(lb: &Lb, vip: Vip, client_port: u16) -> (Conn, Pkt) {
    let conn0 = Conn {
        vip,
        client_port,
        backend: if vip.addr.is_ipv4() { 0 } else { 100 },
        snat_port: 0,
    };
    let opener = if vip.proto == IPPROTO_TCP {
        conn0.client_packet(TCP_SYN)
    } else {
        conn0.client_packet(0).payload(b"query")
    };
    let (action, out) = lb.run(&opener.build());
    assert_eq!(action, XDP_TX, "{:?}", lb.reasons());
    let conn = Conn {
        snat_port: sport(&out),
        ..conn0
    };
    assert_eq!(out, conn.sent_to_backend(&opener).build(), "the opener");
    (conn, opener)
}

/// One connection through `vip`: opened, then a request and a response of
/// several segments each, every bulk segment in every shape; for TCP then
/// closed by both FINs.
fn bulk_in_every_shape(vip: Vip) {
    let lb = lb_world();
    let tcp = vip.proto == IPPROTO_TCP;
    let (data, ack) = (TCP_ACK | TCP_PSH, TCP_ACK);
    let (conn, _) = open(&lb, vip, 41_000);
    let backend = conn.backend;
    if !tcp {
        // One clock read for the whole new flow: the pick's. The datagram's
        // request is stamped with the time the entry was created with (a
        // second read, some 40 ns later, would differ).
        let fwd = lb
            .flow(&key(vip.proto, conn.client(), conn.vip()))
            .expect("forward entry");
        assert_eq!(
            fwd.request_ns, fwd.created_ns,
            "a new flow's request time is its creation's clock read"
        );
    }
    let (mut to_backend, mut to_client) = (1, 0);
    if tcp {
        let syn_ack = conn.backend_packet(TCP_SYN | TCP_ACK);
        lb.expect(&syn_ack, XDP_TX, &conn.sent_to_client(&syn_ack));
        let request = conn.client_packet(data).payload(b"GET / HTTP/1.1\r\n");
        lb.expect(&request, XDP_TX, &conn.sent_to_backend(&request));
        (to_backend, to_client) = (2, 1);
    }

    // The rest of the request: bulk, the request already stamped.
    let mut client_bulk = vec![conn.client_packet(data).payload(b"Host: lb\r\n\r\n")];
    if tcp {
        client_bulk.push(conn.client_packet(ack));
    }
    to_backend += send_in_every_shape(&lb, "client", &client_bulk, |p| conn.sent_to_backend(p));
    assert_eq!(lb.latency(backend).count, 0, "no response yet");

    // The response's first segment is the latency sample; the rest is bulk.
    let response = conn.backend_packet(data).payload(&[b'x'; 500]);
    lb.expect(&response, XDP_TX, &conn.sent_to_client(&response));
    to_client += 1;
    assert_eq!(lb.latency(backend).count, 1, "the response is the sample");
    let mut backend_bulk = vec![response.clone()];
    if tcp {
        backend_bulk.push(conn.backend_packet(ack));
    }
    to_client += send_in_every_shape(&lb, "backend", &backend_bulk, |p| conn.sent_to_client(p));
    assert_eq!(lb.latency(backend).count, 1, "one sample per request");
    assert_eq!(lb.reason(reason::TX_TO_BACKEND), to_backend);
    assert_eq!(lb.reason(reason::TX_TO_CLIENT), to_client);
    assert_eq!(
        lb.conns(backend),
        BackendConns {
            opened: 1,
            closed: 0
        }
    );
    assert_eq!(lb.flow_count(), 2, "one connection, both directions");
    if tcp {
        // FINs change the state: the general path closes the connection once.
        let fin = conn.client_packet(TCP_FIN | TCP_ACK);
        lb.expect(&fin, XDP_TX, &conn.sent_to_backend(&fin));
        let fin_back = conn.backend_packet(TCP_FIN | TCP_ACK);
        lb.expect(&fin_back, XDP_TX, &conn.sent_to_client(&fin_back));
        assert_eq!(lb.conns(backend).closed, 1);
    }
}

/// The IPv4 header checksum (0 for IPv6) and the TCP/UDP checksum of a
/// built frame, as 16-bit words in memory order (as the program loads them).
fn checksums(frame: &[u8]) -> (u16, u16) {
    let p = parse(frame).expect("IP frame");
    let word = |at: usize| u16::from_ne_bytes([frame[at], frame[at + 1]]);
    let l4_check = p.l4 + if p.proto == IPPROTO_TCP { 16 } else { 6 };
    let ip_check = if p.src.is_ipv4() { word(p.l3 + 10) } else { 0 };
    (ip_check, word(l4_check))
}

/// RFC 1624 eqn. 3: the checksum `check` after a change whose folded
/// `~m + m'` sum is `delta` (what a flow entry's `csum_ip`/`csum_l4` hold).
fn updated(check: u16, delta: u16) -> u16 {
    let mut sum = u32::from(!check) + u32::from(delta);
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    !(sum as u16)
}

/// Asserts that `entry`'s learned checksum changes turn the checksums of
/// `before` (a frame as it arrives) into those of `after` (as the balancer
/// must send it, built with checksums computed from scratch).
fn assert_learned(what: &str, entry: &FlowEntry, before: &Pkt, after: &Pkt) {
    let (ip0, l4_0) = checksums(&before.build());
    let (ip1, l4_1) = checksums(&after.build());
    assert_ne!(entry.csum_l4, 0, "{what}: TCP/UDP change not learned");
    assert_eq!(updated(l4_0, entry.csum_l4), l4_1, "{what}: TCP/UDP change");
    if before.is_v6() {
        assert_eq!(entry.csum_ip, 0, "{what}: IPv6 has no header checksum");
    } else {
        assert_ne!(entry.csum_ip, 0, "{what}: IPv4 header change not learned");
        assert_eq!(
            updated(ip0, entry.csum_ip),
            ip1,
            "{what}: IPv4 header change"
        );
    }
}

/// A connection's entries learn their checksum changes from the general
/// path's first packet in each direction, the fast path applies the stored
/// change (a wrong one shows in the common shape's checksum only), and an
/// entry without them (as an older program wrote it) is sent right by the
/// general path, which stores them.
fn checksum_changes_learned_and_applied(vip: Vip) {
    let mut lb = lb_world();
    let tcp = vip.proto == IPPROTO_TCP;
    let (conn, opener) = open(&lb, vip, 41_500);
    let fwd_key = key(vip.proto, conn.client(), conn.vip());
    let rev_key = key(vip.proto, conn.backend(), conn.snat());
    let fwd = lb.flow(&fwd_key).expect("forward entry");
    assert_learned("forward", &fwd, &opener, &conn.sent_to_backend(&opener));
    let reply = if tcp {
        conn.backend_packet(TCP_SYN | TCP_ACK)
    } else {
        conn.backend_packet(0).payload(b"answer")
    };
    assert_eq!(
        lb.flow(&rev_key).expect("reply entry").csum_l4,
        0,
        "nothing learned before the backend's first packet"
    );
    lb.expect(&reply, XDP_TX, &conn.sent_to_client(&reply));
    let rev = lb.flow(&rev_key).expect("reply entry");
    assert_learned("reply", &rev, &reply, &conn.sent_to_client(&reply));
    if tcp {
        // A request pending: the client's bulk packets take the fast path.
        let request = conn.client_packet(TCP_ACK | TCP_PSH).payload(b"GET /");
        lb.expect(&request, XDP_TX, &conn.sent_to_backend(&request));
    }
    let bulk = if tcp {
        conn.client_packet(TCP_ACK)
    } else {
        conn.client_packet(0).payload(b"more")
    };
    let [(_, common), (_, tagged), _] = shapes(&bulk);
    lb.expect(&common, XDP_TX, &conn.sent_to_backend(&common));

    // A wrong stored change: the fast path applies it as it is (the common
    // shape's checksum is off by it), the general path computes its own.
    let fwd = lb.flow(&fwd_key).expect("forward entry");
    let wrong = if fwd.csum_l4 == 1 { 2 } else { fwd.csum_l4 - 1 };
    lb.set_flow(
        &fwd_key,
        FlowEntry {
            csum_l4: wrong,
            ..fwd
        },
    );
    let (action, out) = lb.run(&common.build());
    assert_eq!(action, XDP_TX, "{:?}", lb.reasons());
    let (_, l4_in) = checksums(&common.build());
    assert_eq!(
        checksums(&out).1,
        updated(l4_in, wrong),
        "the fast path applies the stored change"
    );
    assert_ne!(out, conn.sent_to_backend(&common).build());
    lb.expect(&tagged, XDP_TX, &conn.sent_to_backend(&tagged));

    // An entry without the changes (written by an older program): sent
    // right, and the changes are learned again.
    lb.set_flow(
        &fwd_key,
        FlowEntry {
            csum_ip: 0,
            csum_l4: 0,
            ..fwd
        },
    );
    lb.expect(&common, XDP_TX, &conn.sent_to_backend(&common));
    let relearned = lb.flow(&fwd_key).expect("forward entry");
    assert_eq!(
        (relearned.csum_ip, relearned.csum_l4),
        (fwd.csum_ip, fwd.csum_l4),
        "learned again by the general path"
    );
    lb.expect(&common, XDP_TX, &conn.sent_to_backend(&common));
}

type Case = (&'static str, fn(&mut ()));

const CASES: &[Case] = &[
    ("ipv4 tcp bulk in every shape", |_| {
        bulk_in_every_shape(TCP80)
    }),
    ("ipv4 udp bulk in every shape", |_| {
        bulk_in_every_shape(UDP53)
    }),
    ("ipv6 tcp bulk in every shape", |_| {
        bulk_in_every_shape(TCP80_6)
    }),
    ("ipv6 udp bulk in every shape", |_| {
        bulk_in_every_shape(UDP53_6)
    }),
    ("ipv4 tcp checksum changes learned and applied", |_| {
        checksum_changes_learned_and_applied(TCP80)
    }),
    ("ipv4 udp checksum changes learned and applied", |_| {
        checksum_changes_learned_and_applied(UDP53)
    }),
    ("ipv6 tcp checksum changes learned and applied", |_| {
        checksum_changes_learned_and_applied(TCP80_6)
    }),
    ("ipv6 udp checksum changes learned and applied", |_| {
        checksum_changes_learned_and_applied(UDP53_6)
    }),
];

fn main() {
    let trials = CASES
        .iter()
        .map(|&(name, case)| packet_case(slug(name), move || case(&mut ())))
        .collect();
    trials::run("fast_path", trials)
}
