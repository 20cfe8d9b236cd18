//! Tests of the lab itself, without the balancer: the network, the backend
//! server, the load generator and cleanup. Run as root:
//! `cargo test -p lb-tests --test lab_harness -- --test-threads=1`.

use std::process::Command;

use lb_lab::{
    Binaries, Lab,
    lab::{BALANCER_ADDR, BackendSpec, CLIENT_ADDR, VIP_ADDR},
    loadgen::{LoadConfig, Protocol, payload_pattern},
    probe, require_root,
};

/// Namespaces on the machine that belong to lab `id`.
fn namespaces_of(id: &str) -> Vec<String> {
    let output = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("ip netns list");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .filter(|name| name.starts_with(&format!("{id}-")))
        .map(str::to_string)
        .collect()
}

#[test]
fn hosts_reach_each_other_directly_and_cleanup_removes_everything() {
    require_root!();
    let lab = Lab::builder(Binaries::for_tests())
        .backends(2, BackendSpec::new(1, 4))
        .build()
        .unwrap();
    let id = lab.id.clone();
    assert_eq!(
        namespaces_of(&id).len(),
        5,
        "switch, client, balancer and two backends"
    );

    // The veth traps are handled: the stub sits on the balancer's bridge
    // port, and the senders' tx checksum offload is off.
    let port = lab
        .exec_ok(
            lab.switch_ns(),
            &[
                "ip",
                "-j",
                "link",
                "show",
                "dev",
                &lab.balancer().switch_port,
            ],
        )
        .unwrap();
    assert!(
        port.contains("\"xdp\""),
        "no XDP stub on the balancer's bridge port: {port}"
    );
    let offload = lab
        .exec_ok(&lab.client().ns, &["ethtool", "-k", &lab.client().iface])
        .unwrap();
    assert!(offload.contains("tx-checksumming: off"), "{offload}");

    let body = payload_pattern(100_000);
    for backend in lab.backends() {
        let response = probe::http(&lab.client().ns, backend.addr(), "/echo", &body).unwrap();
        assert_eq!(response.status, 200);
        assert_eq!(response.backend.as_deref(), Some(backend.name.as_str()));
        assert!(response.body == body, "echo of {} differs", backend.name);
        let reply = probe::udp(&lab.client().ns, backend.addr(), b"hello").unwrap();
        assert_eq!(reply, format!("{}:hello", backend.name).into_bytes());
    }

    // The balancer host answers on its own address and on the VIP.
    probe::ping(&lab.client().ns, BALANCER_ADDR).unwrap();
    probe::ping(&lab.client().ns, VIP_ADDR).unwrap();
    probe::ping(&lab.balancer().ns, CLIENT_ADDR).unwrap();

    drop(lab);
    assert!(
        namespaces_of(&id).is_empty(),
        "left behind: {:?}",
        namespaces_of(&id)
    );
}

#[test]
fn cleanup_happens_when_a_test_panics() {
    require_root!();
    let mut id = String::new();
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let lab = Lab::builder(Binaries::for_tests())
            .backends(1, BackendSpec::default())
            .build()
            .unwrap();
        id = lab.id.clone();
        panic!("a failing test");
    }));
    assert!(outcome.is_err());
    assert!(!id.is_empty());
    assert!(
        namespaces_of(&id).is_empty(),
        "left behind: {:?}",
        namespaces_of(&id)
    );
}

#[test]
fn a_new_lab_sweeps_namespaces_of_dead_labs() {
    require_root!();
    let mut child = Command::new("true").spawn().unwrap();
    let dead_pid = child.id();
    child.wait().unwrap();
    let stale = format!("lbl{dead_pid}n1-sw");
    let status = Command::new("ip")
        .args(["netns", "add", &stale])
        .status()
        .unwrap();
    assert!(status.success());
    let _lab = Lab::builder(Binaries::for_tests())
        .backends(1, BackendSpec::default())
        .build()
        .unwrap();
    assert!(
        namespaces_of(&format!("lbl{dead_pid}n1")).is_empty(),
        "{stale} survived the sweep"
    );
}

#[test]
fn loadgen_measures_a_backend_open_loop() {
    require_root!();
    // 20 ms service time and 2 workers: capacity 100 requests/s.
    let lab = Lab::builder(Binaries::for_tests())
        .backends(1, BackendSpec::new(20, 2))
        .build()
        .unwrap();
    let backend = lab.backends()[0].clone();

    let light = lab
        .run_loadgen(
            &LoadConfig::open_loop(backend.addr(), Protocol::Tcp, 50.0, 2.0)
                .with_payload(64)
                .with_timeout_ms(10_000),
        )
        .unwrap();
    assert_eq!(light.scheduled, 100);
    assert_eq!(light.completed, 100, "{light:?}");
    assert_eq!(light.per_backend.get("be1"), Some(&100));
    assert!(
        light.latency_ms.p50 >= 20.0,
        "faster than the service time: {light:?}"
    );
    assert!(light.latency_ms.p50 < 200.0, "{light:?}");

    let udp = lab
        .run_loadgen(
            &LoadConfig::open_loop(backend.addr(), Protocol::Udp, 50.0, 1.0)
                .with_payload(64)
                .with_timeout_ms(10_000),
        )
        .unwrap();
    assert_eq!(udp.completed, 50, "{udp:?}");
    assert_eq!(udp.per_backend.get("be1"), Some(&50));

    // Twice the capacity for 2 s: the queue grows by ~100 requests a second,
    // so late requests wait about a second. Open-loop timing from the
    // scheduled send shows that wait; a closed loop would hide it.
    let overload = lab
        .run_loadgen(
            &LoadConfig::open_loop(backend.addr(), Protocol::Tcp, 200.0, 2.0)
                .with_payload(64)
                .with_timeout_ms(10_000),
        )
        .unwrap();
    assert_eq!(overload.completed, 400, "{overload:?}");
    assert!(
        overload.latency_ms.p99 > 500.0,
        "queueing not visible: {overload:?}"
    );
}

#[test]
fn stalls_pause_every_worker() {
    require_root!();
    let mut spec = BackendSpec::new(1, 4);
    spec.stall_every_ms = 300;
    spec.stall_for_ms = 200;
    let lab = Lab::builder(Binaries::for_tests())
        .backend(spec)
        .build()
        .unwrap();
    let summary = lab
        .run_loadgen(
            &LoadConfig::open_loop(lab.backends()[0].addr(), Protocol::Tcp, 100.0, 2.0)
                .with_payload(64)
                .with_timeout_ms(10_000),
        )
        .unwrap();
    assert_eq!(summary.completed, 200, "{summary:?}");
    // About 40% of the time the server is stalled, so P90 sits inside a stall.
    assert!(summary.latency_ms.p90 > 50.0, "{summary:?}");
    assert!(summary.latency_ms.max >= 150.0, "{summary:?}");
}
