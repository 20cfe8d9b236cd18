//! IPv6 through the lab: TCP and UDP VIPs on an IPv6 address reach every
//! backend over IPv6, byte for byte both ways, next to an IPv4 VIP served by
//! the same balancer. lb-user picks its IPv6 SNAT address itself (the
//! balancer's subnet address, not the /128 VIP).
use std::{collections::BTreeSet, net::SocketAddr};

use lb_lab::{
    Binaries, Lab,
    lab::{
        Algorithm, BackendSpec, Protocol as VipProtocol, VIP_ADDR6, VIP_TCP_PORT, VIP_UDP_PORT,
        VipSpec, XdpMode,
    },
    loadgen::{LoadConfig, Protocol, Summary, payload_pattern},
    probe,
};

fn answered(summary: &Summary) -> BTreeSet<String> {
    summary.per_backend.keys().cloned().collect()
}

fn reach_every_backend_over_ipv6(mode: XdpMode) {
    let lab = Lab::builder(Binaries::for_tests())
        .backends(3, BackendSpec::new(2, 8))
        .build()
        .unwrap();
    let names: BTreeSet<String> = lab.backends().iter().map(|b| b.name.clone()).collect();
    let backends6: Vec<_> = lab.backends().iter().map(|b| (b.addr6(), 1)).collect();
    let tcp6 = SocketAddr::from((VIP_ADDR6, VIP_TCP_PORT));
    let udp6 = SocketAddr::from((VIP_ADDR6, VIP_UDP_PORT));
    let mut spec = lab.balancer_spec(Algorithm::P2cEwma, mode);
    spec.vips.truncate(1); // keep the IPv4 TCP VIP
    spec.vips.push(VipSpec {
        addr: tcp6,
        protocol: VipProtocol::Tcp,
        backends: backends6.clone(),
        zones: Default::default(),
    });
    spec.vips.push(VipSpec {
        addr: udp6,
        protocol: VipProtocol::Udp,
        backends: backends6,
        zones: Default::default(),
    });
    let _balancer = lab.start_balancer(&spec).unwrap();
    let client = lab.client().ns.clone();

    for size in [1, 1_440, 20_000, 200_003] {
        let body = payload_pattern(size);
        let response = probe::http(&client, tcp6, "/echo", &body).unwrap();
        assert_eq!(response.status, 200);
        assert!(
            response.body == body,
            "{size}-byte echo through the IPv6 VIP differs"
        );
    }
    let v4 = probe::http(&client, lab.tcp_vip(), "/echo", b"v4 too").unwrap();
    assert_eq!(
        v4.body, b"v4 too",
        "the IPv4 VIP keeps working next to IPv6"
    );
    let reply = probe::udp(&client, udp6, b"ping over ipv6").unwrap();
    assert!(reply.ends_with(b":ping over ipv6"), "{reply:?}");

    let tcp = lab
        .run_loadgen(&LoadConfig::open_loop(tcp6, Protocol::Tcp, 200.0, 2.0).with_payload(3_000))
        .unwrap();
    assert_eq!(tcp.error_count(), 0, "{tcp:?}");
    assert_eq!(tcp.completed, 400);
    assert_eq!(answered(&tcp), names, "{tcp:?}");
    let udp = lab
        .run_loadgen(&LoadConfig::open_loop(udp6, Protocol::Udp, 200.0, 2.0).with_payload(500))
        .unwrap();
    assert_eq!(udp.error_count(), 0, "{udp:?}");
    assert_eq!(udp.completed, 400);
    assert_eq!(answered(&udp), names, "{udp:?}");
}

#[test]
fn tcp_and_udp_reach_every_backend_over_ipv6_in_native_mode() {
    lb_lab::require_root!();
    reach_every_backend_over_ipv6(XdpMode::Native);
}

#[test]
fn tcp_and_udp_reach_every_backend_over_ipv6_in_skb_mode() {
    lb_lab::require_root!();
    reach_every_backend_over_ipv6(XdpMode::Skb);
}
