//! IPv6 through the lab: TCP and UDP VIPs on an IPv6 address reach every
//! backend over IPv6, byte for byte both ways, next to an IPv4 VIP served by
//! the same balancer. lb-user picks its IPv6 SNAT address itself (the
//! balancer's subnet address, not the /128 VIP).
use std::{collections::BTreeSet, net::SocketAddr};

use lb_lab::{
    Binaries, Lab,
    lab::metric,
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
    spec.vips
        .push(VipSpec::new(tcp6, VipProtocol::Tcp, backends6.clone()));
    spec.vips
        .push(VipSpec::new(udp6, VipProtocol::Udp, backends6));
    let _balancer = lab.start_balancer(&spec).unwrap();
    let client = lab.client().ns.clone();
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
    // The large echoes last: a 200 KB upload is a slow first response for
    // P2C's Peak-EWMA, which then rightly leaves that backend out for
    // seconds (it once left be2 out of the 400 connections above).
    for size in [1, 1_440, 20_000, 200_003] {
        let body = payload_pattern(size);
        let response = probe::http(&client, tcp6, "/echo", &body).unwrap();
        assert_eq!(response.status, 200);
        assert!(
            response.body == body,
            "{size}-byte echo through the IPv6 VIP differs"
        );
    }
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

/// 4 KiB UDP datagrams through an IPv4 and an IPv6 VIP at MTU 1500: the
/// client's kernel sends each in three fragments, the backend's echo comes
/// back in three, and the balancer sends every fragment on itself (none
/// goes to its host, which would drop them), to the backend of the
/// datagram's first fragment.
#[test]
fn udp_datagrams_of_4_kib_are_balanced_in_fragments_over_both_families() {
    lb_lab::require_root!();
    let lab = Lab::builder(Binaries::for_tests())
        .backends(3, BackendSpec::new(2, 8))
        .build()
        .unwrap();
    let names: BTreeSet<String> = lab.backends().iter().map(|b| b.name.clone()).collect();
    let udp6 = SocketAddr::from((VIP_ADDR6, VIP_UDP_PORT));
    let mut spec = lab.balancer_spec(Algorithm::P2cEwma, XdpMode::Native);
    let backends6 = lab.backends().iter().map(|b| (b.addr6(), 1)).collect();
    spec.vips
        .push(VipSpec::new(udp6, VipProtocol::Udp, backends6));
    let _balancer = lab.start_balancer(&spec).unwrap();
    let client = lab.client().ns.clone();
    let mtu = lab
        .exec_ok(
            &client,
            &["cat", &format!("/sys/class/net/{}/mtu", lab.client().iface)],
        )
        .unwrap();
    assert_eq!(mtu.trim(), "1500", "the lab's links must fragment 4 KiB");

    const SIZE: usize = 4_096;
    const DATAGRAMS: u64 = 200;
    let body = payload_pattern(SIZE);
    for vip in [lab.udp_vip(), udp6] {
        let reply = probe::udp(&client, vip, &body).unwrap();
        let colon = reply.iter().position(|&b| b == b':').unwrap();
        assert!(
            reply[colon + 1..] == body[..],
            "4 KiB echo through {vip} differs"
        );
        let udp = lab
            .run_loadgen(&LoadConfig::open_loop(vip, Protocol::Udp, 100.0, 2.0).with_payload(SIZE))
            .unwrap();
        assert_eq!(udp.error_count(), 0, "{vip}: {udp:?}");
        assert_eq!(udp.completed, DATAGRAMS, "{vip}: {udp:?}");
        assert_eq!(answered(&udp), names, "{vip}: {udp:?}");
    }
    let metrics = lab.scrape_metrics().unwrap();
    let packets = |reason: &str| {
        metric(
            &metrics,
            &format!("lb_packets_total{{reason=\"{reason}\"}}"),
        )
    };
    // Both VIPs' datagrams, each 3 fragments one way and 3 the other.
    let datagrams = 2.0 * (DATAGRAMS as f64 + 1.0);
    eprintln!(
        "fragments: {datagrams} datagrams of {SIZE} bytes each way; tx_to_backend {}, \
         tx_to_client {}, pass_fragment {}",
        packets("tx_to_backend"),
        packets("tx_to_client"),
        packets("pass_fragment")
    );
    assert!(packets("tx_to_backend") >= 3.0 * datagrams, "{metrics}");
    assert!(packets("tx_to_client") >= 3.0 * datagrams, "{metrics}");
    assert_eq!(packets("pass_fragment"), 0.0, "{metrics}");
}

/// An IPv6 VIP added at runtime comes back after a restart whose
/// configuration no longer lists an IPv6 VIP: the restart takes the
/// interface's IPv6 address for SNAT again, as the run that added it did
/// (where it dropped the VIP, "no SNAT address of its family", though
/// nothing but the file's other VIP changed).
#[test]
fn an_ipv6_vip_added_at_runtime_survives_a_restart_whose_file_has_no_ipv6_vip() {
    lb_lab::require_root!();
    let lab = Lab::builder(Binaries::for_tests())
        .backends(2, BackendSpec::new(2, 8))
        .build()
        .unwrap();
    let tcp6 = SocketAddr::from((VIP_ADDR6, VIP_TCP_PORT));
    let mut spec = lab.balancer_spec(Algorithm::P2cEwma, XdpMode::Native);
    spec.vips.truncate(1); // the IPv4 TCP VIP
    let v4_only = spec.clone();
    let backends6: Vec<_> = lab.backends().iter().map(|b| (b.addr6(), 1)).collect();
    spec.vips
        .push(VipSpec::new(tcp6, VipProtocol::Tcp, backends6));
    let first = lab.start_balancer(&spec).unwrap();
    let added6 = SocketAddr::from((VIP_ADDR6, 81));
    let added_arg = format!("{added6}/tcp");
    let backend_args: Vec<String> = lab
        .backends()
        .iter()
        .flat_map(|b| ["--backend".to_string(), b.addr6().to_string()])
        .collect();
    let mut args = vec!["add", "--vip", added_arg.as_str()];
    args.extend(backend_args.iter().map(String::as_str));
    let added = lab.vip_command(&args);
    assert!(added.contains("added"), "{added}");
    let client = lab.client().ns.clone();
    let before = probe::http(&client, added6, "/echo", b"added at runtime").unwrap();
    assert_eq!(before.body, b"added at runtime");

    assert!(
        lab.stop_balancer(first, nix::sys::signal::Signal::SIGTERM)
            .unwrap()
            .success()
    );
    // The file's IPv6 VIP is gone; the one added at runtime is kept.
    let _second = lab.start_balancer(&v4_only).unwrap();
    let status = lab.status().unwrap();
    assert!(
        status.vip(&added6.to_string()).is_some(),
        "the IPv6 VIP added at runtime was dropped by the restart"
    );
    assert!(status.vip(&tcp6.to_string()).is_none());
    let after = probe::http(&client, added6, "/echo", b"after the restart").unwrap();
    assert_eq!(after.body, b"after the restart");
    let v4 = probe::http(&client, lab.tcp_vip(), "/echo", b"v4").unwrap();
    assert_eq!(v4.body, b"v4");
}
