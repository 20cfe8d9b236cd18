//! Scale-out: two balancers serve one VIP from one etcd prefix behind a
//! router's ECMP multipath route (see `lb_lab::lab::ScaleOut`). The load
//! comes from a client behind the router, a new connection per request.
//! Prints a `SCALE-OUT <name>:` line with the load and what was lost.
//!
//! Needs root and etcd. Run with
//! `cargo test -p lb-tests --test scale_out -- --test-threads=1 --nocapture`.

use std::{
    thread,
    time::{Duration, Instant},
};

use lb_lab::{
    Binaries, Lab,
    lab::{
        Algorithm, BALANCER_ADDR, BackendSpec, BalancerSpec, ProcessId, Protocol as VipProtocol,
        ScaleOut, VipSpec,
    },
    loadgen::{LoadConfig, Protocol},
    production::read_vip_maglev_table,
    require_root,
    status::Status,
};
use nix::sys::signal::Signal;

const PREFIX: &str = "/lb/web/";

fn put(lab: &Lab, index: usize, weight: u32) {
    let addr = lab.backends()[index].addr();
    let value = format!(r#"{{"addr":"{addr}","weight":{weight}}}"#);
    lab.etcdctl(&["put", &format!("{PREFIX}{addr}"), &value])
        .unwrap();
}

fn spec(lab: &Lab, state: &str) -> BalancerSpec {
    let state = lab.log_dir().join(state);
    BalancerSpec::one_vip(
        VipSpec::new(lab.tcp_vip(), VipProtocol::Tcp, Vec::new()),
        Algorithm::Maglev,
        &[
            "--etcd-endpoints",
            &lab.etcd_url(),
            "--etcd-prefix",
            PREFIX,
            "--state-dir",
            state.to_str().unwrap(),
            "--slow-start",
            "0s",
        ],
    )
}

fn status_of(lab: &Lab, instance: &str) -> Option<Status> {
    let out = lab
        .run_lb_user(&["status", "--json", "--instance", instance])
        .ok()?;
    serde_json::from_slice(&out.stdout).ok()
}

/// (backend, weight) of the VIP on `instance`, sorted.
fn membership(lab: &Lab, instance: &str) -> Vec<(String, String)> {
    let Some(status) = status_of(lab, instance) else {
        return Vec::new();
    };
    let mut m: Vec<(String, String)> = status
        .vip(&lab.tcp_vip().to_string())
        .map(|v| {
            v.backends
                .iter()
                .filter(|b| b.state == "active")
                .map(|b| (b.address.clone(), format!("{:.2}", b.weight)))
                .collect()
        })
        .unwrap_or_default();
    m.sort();
    m
}

fn opened_total(lab: &Lab, instance: &str) -> u64 {
    status_of(lab, instance)
        .and_then(|s| {
            s.vip(&lab.tcp_vip().to_string())
                .map(|v| v.backends.iter().map(|b| b.opened).sum())
        })
        .unwrap_or(0)
}

/// Starts lb-user on the second balancer and waits until it serves the VIP.
fn start_second(lab: &Lab, scale: &ScaleOut) -> ProcessId {
    let mut argv = vec![lab.binaries().lb_user().unwrap().display().to_string()];
    argv.extend(spec(lab, "state-b").args(&scale.second.iface, None));
    let process = lab.spawn(&scale.second.ns, "lb-user-b", &argv).unwrap();
    let started = Instant::now();
    loop {
        if let Some(status) = lab.exit_status(process).unwrap() {
            panic!("second lb-user exited ({status}): {}", lab.stderr(process));
        }
        let ready = status_of(lab, &scale.second_instance())
            .is_some_and(|s| s.ready && s.vip(&lab.tcp_vip().to_string()).is_some());
        if ready {
            return process;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "second lb-user not ready: {}",
            lab.stderr(process)
        );
        thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn two_balancers_behind_ecmp_converge_spread_and_the_survivor_serves_on() {
    require_root!();
    let mut lab = Lab::builder(Binaries::for_tests())
        .backends(3, BackendSpec::new(2, 8))
        .build()
        .unwrap();
    lab.start_etcd().expect("etcd must start");
    let scale = lab.add_scale_out().unwrap();
    // A sees backend 1 join later than B does: other ids, other slot order.
    put(&lab, 0, 1);
    put(&lab, 2, 1);
    lab.start_balancer(&spec(&lab, "state-a")).unwrap();
    let a_name = lab.instance();
    put(&lab, 1, 1);
    let joined = Instant::now();
    while membership(&lab, &a_name).len() < 3 {
        assert!(
            joined.elapsed() < Duration::from_secs(5),
            "A never saw backend 1"
        );
        thread::sleep(Duration::from_millis(20));
    }
    let b = start_second(&lab, &scale);
    let b_name = scale.second_instance();
    assert_eq!(membership(&lab, &a_name).len(), 3);
    assert_eq!(membership(&lab, &a_name), membership(&lab, &b_name));

    // A change converges on both within 1 s.
    put(&lab, 1, 3);
    let changed = Instant::now();
    let want = membership(&lab, &a_name)
        .into_iter()
        .map(|(addr, w)| {
            let w = if addr == lab.backends()[1].addr().to_string() {
                "3.00".to_string()
            } else {
                w
            };
            (addr, w)
        })
        .collect::<Vec<_>>();
    let mut seen = [None, None];
    while seen.iter().any(Option::is_none) {
        for (slot, name) in seen.iter_mut().zip([&a_name, &b_name]) {
            if slot.is_none() && membership(&lab, name) == want {
                *slot = Some(changed.elapsed());
            }
        }
        assert!(
            changed.elapsed() < Duration::from_secs(5),
            "no convergence: {seen:?}"
        );
        thread::sleep(Duration::from_millis(20));
    }
    let converged = seen.iter().flatten().max().copied().unwrap();
    assert!(
        converged <= Duration::from_secs(1),
        "converged after {converged:?}"
    );
    // Same membership and effective weights: the same Maglev table, position
    // by position the same backend (ids are each instance's own).
    let table = |name: &str, pins: &std::path::Path| -> Vec<String> {
        let status = status_of(&lab, name).unwrap();
        let vip = status.vip(&lab.tcp_vip().to_string()).unwrap();
        read_vip_maglev_table(pins, 0)
            .unwrap()
            .into_iter()
            .map(|id| {
                vip.backends
                    .iter()
                    .find(|b| b.id == id)
                    .map_or_else(|| format!("id {id}?"), |b| b.address.clone())
            })
            .collect()
    };
    // The status shows a weight as soon as the fleet has it; the table
    // built from it is swapped in at the next score tick: compare until
    // both instances have swapped.
    let compared = Instant::now();
    let differ = loop {
        let (ta, tb) = (
            table(&a_name, &lab.pin_dir()),
            table(&b_name, &scale.second_pin_dir()),
        );
        assert_eq!(ta.len(), 65_537);
        assert!(
            ta.iter().all(|b| !b.starts_with("id ")),
            "every entry names a backend"
        );
        let differ = ta.iter().zip(&tb).filter(|(x, y)| x != y).count();
        if differ == 0 || compared.elapsed() > Duration::from_secs(3) {
            break differ;
        }
        thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(
        differ, 0,
        "the two instances' Maglev tables differ in {differ} positions"
    );

    // Open-loop load from behind the router spreads over both.
    let config =
        LoadConfig::open_loop(lab.tcp_vip(), Protocol::Tcp, 100.0, 10.0).with_timeout_ms(2000);
    let mut argv = vec![lab.binaries().lb_loadgen.display().to_string()];
    argv.extend(config.to_args());
    let loadgen = lab
        .spawn(&scale.remote_client_ns, "loadgen", &argv)
        .unwrap();
    thread::sleep(Duration::from_secs(3));
    let (a_before, b_before) = (opened_total(&lab, &a_name), opened_total(&lab, &b_name));
    assert!(
        a_before > 30 && b_before > 30,
        "ECMP spreads connections: A {a_before}, B {b_before}"
    );
    // B dies hard; its link goes, and its route is withdrawn.
    lab.signal(b, Signal::SIGKILL).unwrap();
    lab.wait(b, Duration::from_secs(5)).unwrap();
    lab.ip(&scale.second.ns, &["link", "del", &scale.second.iface])
        .unwrap();
    scale.route_vip_via(&lab, &[BALANCER_ADDR]).unwrap();
    let a_at_kill = opened_total(&lab, &a_name);
    thread::sleep(Duration::from_secs(3));
    let a_after = opened_total(&lab, &a_name) - a_at_kill;
    let summary = lab.loadgen_summary(loadgen, &config).unwrap();
    eprintln!(
        "SCALE-OUT ecmp: load {} req/s × {} s ({} scheduled, new connection each) from behind the router, completed {}, failed {} {:?}; \
         before the kill A opened {a_before}, B {b_before}; both instances converged {converged:?} after a weight change; \
         after B's kill -9, link removal and route withdrawal A opened {a_after} in the next 3 s",
        config.rate,
        config.duration_s,
        summary.scheduled,
        summary.completed,
        summary.error_count(),
        summary.errors,
    );
    assert!(
        a_after >= 250,
        "the survivor takes the new connections: {a_after}"
    );
    // Only B's in-flight requests (and any SYN routed to it before the
    // withdrawal) may be lost: a few, not a share of the run.
    assert!(
        summary.error_count() <= 10,
        "lost {} requests: {:?}",
        summary.error_count(),
        summary.errors
    );
}
