//! Fault tests: each puts the balancer under steady open-loop load (a new
//! connection per request, `lb-loadgen`), injects one fault, and asserts
//! what was lost. Every test prints a `FAULT <name>: ...` line with its
//! load and losses (the numbers quoted in the operations notes).
//!
//! The setup they share is [`Fault`]: its lab, its balancer, the load and
//! the report; each test is its fault and its assertions.
//!
//! Needs root. Run with
//! `cargo test -p lb-tests --test faults -- --test-threads=1`.

use std::{
    net::{SocketAddr, TcpStream},
    ops::Deref,
    path::Path,
    thread,
    time::{Duration, Instant},
};

use lb_lab::{
    Binaries, Lab,
    host_stall::HostStalls,
    lab::{
        Algorithm, BALANCER_ADDR, BackendSpec, BalancerSpec, FAST_HEALTH_CHECKS,
        Protocol as VipProtocol, VipSpec, metric,
    },
    loadgen::{LoadConfig, Protocol, Summary},
    probe, require_root,
    status::{BackendStatus, Status},
};
use nix::sys::signal::Signal;

/// One fault test: its name (in the `FAULT` line) and its lab, whose
/// methods it offers too.
struct Fault {
    name: &'static str,
    lab: Lab,
}

/// A finished load: what was asked, what came of it, and what the fault
/// injected during it returned.
struct Run<T = ()> {
    config: LoadConfig,
    summary: Summary,
    during: T,
}

impl Fault {
    /// A lab with `backends` servers (2 ms per request, 8 workers each).
    fn new(name: &'static str, backends: usize) -> Self {
        Self::with_backends(name, backends, BackendSpec::new(2, 8))
    }

    /// A lab with `backends` servers of `backend`'s kind.
    fn with_backends(name: &'static str, backends: usize, backend: BackendSpec) -> Self {
        let lab = Lab::builder(Binaries::for_tests())
            .backends(backends, backend)
            .build()
            .unwrap();
        Self { name, lab }
    }

    /// Starts the balancer: P2C over `backends` (indexes) with `extra` flags.
    fn start(&self, backends: &[usize], extra: &[&str]) -> lb_lab::lab::ProcessId {
        self.start_balancer(&spec(self, backends, extra)).unwrap()
    }

    /// `rate` new connections per second to the TCP VIP for `duration_s`
    /// seconds, each request with a timeout of `timeout_ms`.
    fn load(&self, rate: f64, duration_s: f64, timeout_ms: u64) -> LoadConfig {
        LoadConfig::open_loop(self.tcp_vip(), Protocol::Tcp, rate, duration_s)
            .with_timeout_ms(timeout_ms)
    }

    /// Runs `config` and, while it runs, the `fault`; waits for the load to end.
    fn during<T>(&self, config: LoadConfig, fault: impl FnOnce(&Lab) -> T) -> Run<T> {
        let process = self.spawn_loadgen(&config).unwrap();
        let during = fault(&self.lab);
        let summary = self.loadgen_summary(process, &config).unwrap();
        Run {
            config,
            summary,
            during,
        }
    }

    /// Runs `config` to its end (against a fault already in place).
    fn measure(&self, config: LoadConfig) -> Run {
        let summary = self.run_loadgen(&config).unwrap();
        Run {
            config,
            summary,
            during: (),
        }
    }

    /// The `FAULT` line: the load, what it lost, and `extra`.
    fn report<T>(&self, run: &Run<T>, extra: &str) {
        let (config, summary) = (&run.config, &run.summary);
        eprintln!(
            "FAULT {}: load {} req/s × {} s ({} scheduled, new connection each), completed {}, failed {} {:?}; {extra}",
            self.name,
            config.rate,
            config.duration_s,
            summary.scheduled,
            summary.completed,
            summary.error_count(),
            summary.errors
        );
    }
}

impl Deref for Fault {
    type Target = Lab;

    fn deref(&self) -> &Lab {
        &self.lab
    }
}

/// The TCP VIP alone over `backends`, with extra flags.
fn spec(lab: &Lab, backends: &[usize], extra: &[&str]) -> BalancerSpec {
    let backends = backends
        .iter()
        .map(|&i| (lab.backends()[i].addr(), 1))
        .collect();
    BalancerSpec::one_vip(
        VipSpec::new(lab.tcp_vip(), VipProtocol::Tcp, backends),
        Algorithm::P2cEwma,
        extra,
    )
}

fn backend_status(status: &Status, lab: &Lab, index: usize) -> Option<BackendStatus> {
    let addr = lab.backends()[index].addr().to_string();
    status
        .vip(&lab.tcp_vip().to_string())?
        .backends
        .iter()
        .find(|b| b.address == addr)
        .cloned()
}

fn opened(lab: &Lab, index: usize) -> u64 {
    backend_status(&lab.status().unwrap(), lab, index).map_or(0, |b| b.opened)
}

/// `n` keep-alive connections through the TCP VIP, each with one answered
/// request.
fn keep_alive(lab: &Lab, n: usize) -> Vec<TcpStream> {
    let client = lab.client().ns.clone();
    (0..n)
        .map(|_| {
            let mut s = probe::connect(&client, lab.tcp_vip()).unwrap();
            probe::request(&mut s, "/", b"", true).unwrap();
            s
        })
        .collect()
}

/// How many of `streams` still answer a request for `path`.
fn still_answering(streams: &mut [TcpStream], path: &str) -> usize {
    streams
        .iter_mut()
        .map(|s| probe::request(s, path, b"", true).is_ok())
        .filter(|&answered| answered)
        .count()
}

/// A reason counter as `lb-user status` reports it (0 when absent).
fn reason_count(lab: &Lab, name: &str) -> u64 {
    let status = lab.status().unwrap();
    status.reasons.get(name).copied().unwrap_or(0)
}

/// Waits until `check` holds, polling, or panics after `timeout`.
fn wait_for(what: &str, timeout: Duration, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn killed_backend_loses_only_its_in_flight_requests() {
    require_root!();
    let lab = Fault::new("kill-backend", 3);
    let mut extra = FAST_HEALTH_CHECKS.to_vec();
    extra.extend(["--outlier-consecutive", "3"]);
    let _lb = lab.start(&[0, 1, 2], &extra);
    let run = lab.during(lab.load(200.0, 8.0, 2_000), |lab| {
        thread::sleep(Duration::from_secs(2));
        lab.signal(lab.backends()[2].process, Signal::SIGKILL)
            .unwrap();
        // Detection: 3 refused connections (passive) or 2 failed checks (active).
        thread::sleep(Duration::from_millis(1_500));
        let status = lab.status().unwrap();
        let dead = backend_status(&status, lab, 2).unwrap();
        // Out of selection: by its checks (down) or by its refusals (ejected).
        assert!(
            ["down", "ejected"].contains(&dead.state.as_str()),
            "{dead:?}"
        );
        dead.opened
    });
    let (summary, opened_at_detection) = (&run.summary, run.during);
    let opened_after = opened(&lab, 2);
    lab.report(
        &run,
        &format!(
            "new connections to the dead backend after detection: {}",
            opened_after - opened_at_detection
        ),
    );
    assert_eq!(
        opened_after, opened_at_detection,
        "new connections went to the dead backend after it was detected"
    );
    // Only what the dead backend had, or was given before detection, fails:
    // at 200/s a third of ~0.5 s is ~35; allow 2.5x for scheduling noise.
    assert!(summary.error_count() <= 80, "{summary:?}");
    assert!(summary.completed + summary.error_count() == summary.scheduled);
    let metrics = lab.scrape_metrics().unwrap();
    let dead_addr = lab.backends()[2].addr().to_string();
    assert!(
        metric(
            &metrics,
            &format!(
                "lb_health_checks_total{{vip=\"{}/tcp\",backend=\"{dead_addr}\",result=\"fail\"}}",
                lab.tcp_vip()
            )
        ) >= 2.0
    );
}

#[test]
fn a_busy_backend_whose_http_checks_time_out_in_its_queue_stays_in_service() {
    require_root!();
    // Two backends of 2 workers at 100 ms: 40 req/s between them. At
    // 50 req/s their queues grow by 10 requests a second, so after about a
    // second an HTTP check waits longer than its 150 ms timeout behind the
    // users' requests, while the users keep being answered.
    let lab = Fault::with_backends("busy-checks", 2, BackendSpec::new(100, 2));
    let checks = [
        "--health-check",
        "http",
        "--health-interval",
        "300ms",
        "--health-timeout",
        "150ms",
        "--health-fall",
        "2",
    ];
    let mut balancer = spec(&lab, &[0, 1], &checks);
    balancer.algorithm = Algorithm::RoundRobin;
    let _lb = lab.start_balancer(&balancer).unwrap();
    wait_for("both backends in service", Duration::from_secs(5), || {
        let status = lab.status().unwrap();
        (0..2).all(|i| backend_status(&status, &lab, i).is_some_and(|b| b.state == "active"))
    });
    let run = lab.during(lab.load(50.0, 4.0, 10_000), |lab| {
        let mut states = Vec::new();
        for _ in 0..40 {
            thread::sleep(Duration::from_millis(100));
            let status = lab.status().unwrap();
            for i in 0..2 {
                if let Some(b) = backend_status(&status, lab, i)
                    && b.state != "active"
                {
                    states.push((i, b.state));
                }
            }
        }
        states
    });
    lab.report(&run, &format!("backends out of service: {:?}", run.during));
    assert_eq!(run.during, [], "a busy backend left service");
    assert_eq!(run.summary.error_count(), 0, "{:?}", run.summary);
    let metrics = lab.scrape_metrics().unwrap();
    let count = |i: usize, result: &str| {
        metric(
            &metrics,
            &format!(
                "lb_health_checks_total{{vip=\"{}/tcp\",backend=\"{}\",result=\"{result}\"}}",
                lab.tcp_vip(),
                lab.backends()[i].addr()
            ),
        )
    };
    let (busy, failed) = (
        count(0, "busy") + count(1, "busy"),
        count(0, "fail") + count(1, "fail"),
    );
    eprintln!("FAULT busy-checks: checks counted busy {busy}, failed {failed}");
    // The checks did time out in the queues (or this test proves nothing),
    // and none counted as a failure.
    assert!(
        busy >= 2.0,
        "no check timed out behind the users: {metrics}"
    );
    assert_eq!(failed, 0.0, "{metrics}");
}

/// Connections backend `index` reported accepting so far (its `accepts`
/// lines, every 50 ms, in its stdout log).
fn accepted(lab: &Lab, index: usize) -> u64 {
    let suffix = format!("-be{}.out", index + 1);
    let dir = lab.log_dir();
    let log = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(Result::ok)
        .find(|e| e.file_name().to_string_lossy().ends_with(&suffix))
        .unwrap_or_else(|| panic!("no {suffix} in {}", dir.display()));
    std::fs::read_to_string(log.path())
        .unwrap()
        .lines()
        .filter_map(|l| l.strip_prefix("accepts "))
        .filter_map(|rest| rest.split_whitespace().nth(1)?.parse::<u64>().ok())
        .sum()
}

#[test]
fn a_server_behind_two_vips_answers_one_check_per_interval() {
    require_root!();
    // Both backends serve a TCP and a UDP VIP: each has an id in each.
    let lab = Fault::new("shared-checks", 2);
    let mut balancer = spec(
        &lab,
        &[0, 1],
        &["--health-check", "http", "--health-interval", "200ms"],
    );
    let mut udp = balancer.vips[0].clone();
    udp.addr = lab.udp_vip();
    udp.protocol = VipProtocol::Udp;
    balancer.vips.push(udp);
    let _lb = lab.start_balancer(&balancer).unwrap();
    wait_for("both backends in service", Duration::from_secs(5), || {
        let status = lab.status().unwrap();
        (0..2).all(|i| backend_status(&status, &lab, i).is_some_and(|b| b.state == "active"))
    });
    let checks = |vip: String| {
        let metrics = lab.scrape_metrics().unwrap();
        metric(
            &metrics,
            &format!(
                "lb_health_checks_total{{vip=\"{vip}\",backend=\"{}\",result=\"pass\"}}",
                lab.backends()[0].addr()
            ),
        )
    };
    let (tcp_vip, udp_vip) = (
        format!("{}/tcp", lab.tcp_vip()),
        format!("{}/udp", lab.udp_vip()),
    );
    // No user traffic: every connection the server accepts is a check.
    let before = (
        checks(tcp_vip.clone()),
        checks(udp_vip.clone()),
        accepted(&lab, 0),
    );
    thread::sleep(Duration::from_secs(3));
    let after = (checks(tcp_vip), checks(udp_vip), accepted(&lab, 0));
    let (tcp, udp, connections) = (
        after.0 - before.0,
        after.1 - before.1,
        (after.2 - before.2) as f64,
    );
    eprintln!(
        "FAULT shared-checks: in 3 s, checks passed {tcp} (TCP VIP) and {udp} (UDP VIP), \
         connections accepted {connections}"
    );
    // About 15 checks in 3 s at 200 ms (each 150–250 ms after the last).
    assert!(tcp >= 8.0, "too few checks: {tcp}");
    // Each VIP's id counts every check...
    assert!((tcp - udp).abs() <= 1.0, "{tcp} against {udp}");
    // ...of one connection each, not one per VIP (which read about 2x).
    assert!(
        connections <= tcp + 2.0,
        "{connections} connections for {tcp} checks"
    );
    assert!(connections >= tcp - 2.0, "{connections} for {tcp}");
}

/// A backend that takes no new connection (nftables drops its SYNs, as a
/// full accept queue would) while a keep-alive connection asks it hundreds
/// of requests a second: those answers end no run of refusals (they did
/// before, and the failure rate stayed far below its threshold), and it is
/// ejected after `--outlier-consecutive` connections refused with none
/// accepted in between. Its keep-alive connection still answers.
#[test]
fn a_backend_that_takes_no_new_connection_is_ejected_though_its_old_ones_answer() {
    require_root!();
    let lab = Fault::new("refuses-new", 2);
    let flags = ["--syn-timeout", "1s", "--outlier-consecutive", "3"];
    let mut balancer = spec(&lab, &[0, 1], &flags);
    balancer.algorithm = Algorithm::RoundRobin;
    let lb = lab.start_balancer(&balancer).unwrap();
    let name = lab.backends()[0].name.clone();
    let mut kept = (0..4)
        .map(|_| kept_connection(&lab, lab.tcp_vip()))
        .find(|(_, who)| *who == name)
        .map(|(s, _)| s)
        .expect("round robin gives backend 0 one of four connections");
    let backend = lab.backends()[0].host.ns.clone();
    let nft = |args: &[&str]| {
        let mut argv = vec!["nft"];
        argv.extend_from_slice(args);
        let out = lab.exec(&backend, &argv).unwrap();
        assert!(out.status.success(), "{argv:?}: {out:?}");
    };
    nft(&["add", "table", "inet", "lbtest"]);
    let hook = "{ type filter hook input priority 0; policy accept; }";
    nft(&["add", "chain", "inet", "lbtest", "input", hook]);
    let port = lb_lab::lab::BACKEND_PORT.to_string();
    nft(&[
        "add",
        "rule",
        "inet",
        "lbtest",
        "input",
        "tcp",
        "dport",
        &port,
        "tcp",
        "flags",
        "&",
        "(syn|ack)",
        "==",
        "syn",
        "counter",
        "drop",
    ]);

    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let asking = {
        let stop = stop.clone();
        thread::spawn(move || {
            let (mut answered, deadline) = (0u64, Instant::now() + Duration::from_secs(40));
            while !stop.load(std::sync::atomic::Ordering::Relaxed) && Instant::now() < deadline {
                let answer = probe::request(&mut kept, "/", b"", true).unwrap();
                assert_eq!(answer.status, 200);
                answered += 1;
            }
            (answered, kept)
        })
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let state = loop {
        // Every other new connection is round robin's turn of backend 0.
        let _ = try_connect(&lab, lab.tcp_vip(), Duration::from_millis(200));
        let state = backend_status(&lab.status().unwrap(), &lab, 0)
            .unwrap()
            .state;
        if state == "ejected" || Instant::now() > deadline {
            break state;
        }
    };
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (answered, mut kept) = asking.join().unwrap();
    let log = lab.stderr(lb);
    eprintln!(
        "FAULT refuses-new: backend 0 {state}; its keep-alive connection answered {answered}"
    );
    assert_eq!(state, "ejected", "{log}");
    assert!(log.contains("connections refused in a row"), "{log}");
    assert!(
        answered >= 100,
        "{answered} answers: too few to have ended a run"
    );
    let answer = probe::request(&mut kept, "/", b"", true).unwrap();
    assert_eq!(
        answer.status, 200,
        "the ejected backend's old connection goes on"
    );
}

#[test]
fn flapping_backend_is_kept_out_while_down_and_serves_when_up() {
    require_root!();
    let lab = Fault::new("flap-backend", 3);
    let mut extra = FAST_HEALTH_CHECKS.to_vec();
    // A short ejection base so an ejected flapper returns within the test.
    extra.extend(["--slow-start", "0s", "--ejection-base", "2s"]);
    // Round-robin: P2C would rightly keep avoiding a backend whose last
    // answers came after a retransmitted SYN (Peak-EWMA remembers them).
    let mut balancer = spec(&lab, &[0, 1, 2], &extra);
    balancer.algorithm = Algorithm::RoundRobin;
    let _lb = lab.start_balancer(&balancer).unwrap();
    let run = lab.during(lab.load(150.0, 14.0, 1_000), |lab| {
        let port = "p-be3";
        thread::sleep(Duration::from_secs(1));
        // Three flaps: 1 s unreachable (frames dropped: SYNs time out), 1 s back.
        for _ in 0..3 {
            lab.ip(lab.switch_ns(), &["link", "set", port, "down"])
                .unwrap();
            thread::sleep(Duration::from_secs(1));
            lab.ip(lab.switch_ns(), &["link", "set", port, "up"])
                .unwrap();
            thread::sleep(Duration::from_secs(1));
        }
        wait_for(
            "the flapping backend to be back in service",
            Duration::from_secs(6),
            || backend_status(&lab.status().unwrap(), lab, 2).is_some_and(|b| b.state == "active"),
        );
        opened(lab, 2)
    });
    let served_after = opened(&lab, 2) - run.during;
    let addr = lab.backends()[2].addr().to_string();
    let ejections = metric(
        &lab.scrape_metrics().unwrap(),
        &format!(
            "lb_backend_ejections_total{{vip=\"{}/tcp\",backend=\"{addr}\"}}",
            lab.tcp_vip()
        ),
    );
    lab.report(
        &run,
        &format!(
            "outlier ejections of the flapper: {ejections}; connections to it once back: {served_after}"
        ),
    );
    // Lost: requests to it in flight or placed within the ~0.5 s detection
    // of each down period: about 3 × 50/s × 0.6 s ≈ 90; allow 2x.
    assert!(run.summary.error_count() <= 180, "{:?}", run.summary);
    assert!(served_after > 0, "the backend never came back");
}

/// A backend down by its health checks when lb-user is killed and started
/// again (the documented upgrade) starts down: no new connection reaches it
/// until it passes its checks again. Started up, it took its share until
/// its checks failed anew (`fall` × the interval, 2 s here).
#[test]
fn a_backend_down_before_a_restart_stays_down_until_it_passes_its_checks() {
    require_root!();
    let lab = Fault::new("down-restart", 3);
    let extra = [
        "--health-check",
        "tcp",
        "--health-interval",
        "1s",
        "--health-timeout",
        "500ms",
        "--health-fall",
        "2",
        "--health-rise",
        "2",
        "--slow-start",
        "0s",
    ];
    let first = lab.start(&[0, 1, 2], &extra);
    let state = |lab: &Lab| backend_status(&lab.status().unwrap(), lab, 2).map(|b| b.state);
    // The server refuses (RST) while its host stays reachable (its MAC
    // resolves at the restart, as a crashed service's would).
    let backend = lab.backends()[2].host.ns.clone();
    let service_port = lab.backends()[2].addr().port().to_string();
    let nft = |args: &[&str]| {
        let mut argv = vec!["nft"];
        argv.extend_from_slice(args);
        lab.exec_ok(&backend, &argv).unwrap();
    };
    nft(&["add", "table", "inet", "lbdown"]);
    nft(&[
        "add",
        "chain",
        "inet",
        "lbdown",
        "input",
        "{ type filter hook input priority 0; }",
    ]);
    nft(&[
        "add",
        "rule",
        "inet",
        "lbdown",
        "input",
        "tcp",
        "dport",
        &service_port,
        "reject",
        "with",
        "tcp",
        "reset",
    ]);
    wait_for(
        "the refusing backend to go down",
        Duration::from_secs(10),
        || state(&lab).as_deref() == Some("down"),
    );
    assert!(!lab.stop_balancer(first, Signal::SIGKILL).unwrap().success());
    let _second = lab.start(&[0, 1, 2], &extra);
    assert_eq!(
        state(&lab).as_deref(),
        Some("down"),
        "the restart put the down backend back in service"
    );
    let before = opened(&lab, 2);
    let run = lab.measure(lab.load(100.0, 1.5, 2_000));
    lab.report(&run, "right after the restart");
    assert_eq!(run.summary.error_count(), 0, "{:?}", run.summary);
    assert_eq!(
        opened(&lab, 2),
        before,
        "a connection reached the down backend"
    );
    // Serving again: back by its checks.
    nft(&["delete", "table", "inet", "lbdown"]);
    wait_for("the backend to be back", Duration::from_secs(10), || {
        state(&lab).as_deref() == Some("active")
    });
}

#[test]
fn cold_backend_added_at_runtime_ramps_up_under_slow_start() {
    require_root!();
    let lab = Fault::new("slow-start", 3);
    // This test is about the weight ramp. With the default peak memory
    // (10 s), one slow response on the sparsely used cold backend keeps it
    // beyond P2C's re-draw bound for about 8 s whatever its weight (seen
    // once in CI: 0 new connections at full weight); that is the latency
    // estimate's trade-off, measured by the transient-slowness test and
    // the bench, not slow start's.
    let _lb = lab.start(
        &[0, 1],
        &[
            "--slow-start",
            "6s",
            "--slow-start-floor",
            "0.1",
            "--ewma-peak-tau",
            "1s",
        ],
    );
    let run = lab.during(lab.load(200.0, 10.0, 2_000), |lab| {
        thread::sleep(Duration::from_secs(1));
        let cold = lab.backends()[2].addr().to_string();
        let vip = lab.tcp_vip().to_string();
        lab.backend_command(&["add", "--vip", &vip, "--backend", &cold]);
        thread::sleep(Duration::from_millis(500));
        let early_weight = backend_status(&lab.status().unwrap(), lab, 2)
            .unwrap()
            .weight;
        let start = opened(lab, 2);
        let publishes = || {
            metric(
                &lab.scrape_metrics().unwrap(),
                "lb_map_update_seconds_count{kind=\"publish\"}",
            )
        };
        let publishes_early = publishes();
        thread::sleep(Duration::from_secs(2));
        let early = opened(lab, 2) - start;
        thread::sleep(Duration::from_secs(4));
        // The ramp moves the backend's weight every score tick (50 ms),
        // which P2C reads from its score: its slots and tables stay.
        let ramp_publishes = publishes() - publishes_early;
        let late_start = opened(lab, 2);
        thread::sleep(Duration::from_secs(2));
        let late = opened(lab, 2) - late_start;
        let status = lab.status().unwrap();
        let late_weight = backend_status(&status, lab, 2).unwrap().weight;
        // Every backend's view at the end, for the report: why the cold
        // one was or was not picked.
        let scores: Vec<String> = (0..3)
            .filter_map(|i| backend_status(&status, lab, i))
            .map(|b| {
                format!(
                    "{} ewma {:.2} ms, in flight {}, cost {:.0}, opened {}",
                    b.address, b.ewma_ms, b.inflight, b.cost, b.opened
                )
            })
            .collect();
        (
            early_weight,
            early,
            late_weight,
            late,
            scores.join("; "),
            ramp_publishes,
        )
    });
    let (early_weight, early, late_weight, late, scores, ramp_publishes) = run.during.clone();
    lab.report(
        &run,
        &format!(
            "weight {early_weight:.2} → {late_weight:.2}; new connections in its first 2 s {early}, in 6-8 s {late}; VIP rewrites in 6 s of ramp {ramp_publishes}; at the end: {scores}"
        ),
    );
    assert!(
        ramp_publishes <= 3.0,
        "the ramp rewrote the VIP's slots and tables {ramp_publishes} times in 6 s"
    );
    assert_eq!(run.summary.error_count(), 0, "{:?}", run.summary);
    assert!((0.05..=0.5).contains(&early_weight), "{early_weight}");
    assert!(late_weight > 0.99, "{late_weight}");
    assert!(late > 0 && early * 2 < late, "early {early}, late {late}");
}

/// With `--ewma-peak-tau 1s`, a backend slow for half a second (its
/// responses 10× slower: the peaks a GC pause or a noisy neighbour leaves)
/// is back to a fair share of new connections within two seconds, not
/// after the long memory's τ (10 s): the peaks count in the short-memory
/// estimate only, and half a second of slow means moves the long one by a
/// few percent. (With the default, one Peak-EWMA of 10 s, it gets none in
/// that window.)
#[test]
fn a_backend_slow_for_a_moment_gets_its_share_back_within_two_seconds() {
    require_root!();
    slow_for_a_moment_then_its_share("transient-slowness", &["--ewma-peak-tau", "1s"]);
}

/// The same with the default peak memory (10 s) and HTTP health checks:
/// while users avoid the recovered backend, its checks run every
/// `--latency-probe-interval` (250 ms) and their timing replaces the
/// remembered peak, so it is back in the draws within about half a second
/// of recovering, without a shorter memory for everybody. (With the same
/// checks and `--latency-probe-interval off` it got 1 of 412.)
#[test]
fn latency_probes_give_a_backend_slow_for_a_moment_its_share_back_with_the_default_memory() {
    require_root!();
    slow_for_a_moment_then_its_share(
        "transient-slowness-probes",
        &[
            "--health-check",
            "http",
            "--health-path",
            "/health",
            "--latency-probe-interval",
            "250ms",
        ],
    );
}

/// How long `slow_for_a_moment_then_its_share` keeps be1 slow at most
/// while waiting for a measurement of it.
const SLOW_AT_MOST: Duration = Duration::from_millis(2_500);

/// be1 of three turns 10× slower for 0.5 s under 200 req/s; asserts that
/// the estimate saw it and that 2-8 s after it recovered it got more than
/// a tenth of the new connections (fair: a third).
///
/// One confounder is the lab's own: every process shares one host, and a
/// stall of the whole host (a VM descheduled for 50–200 ms, seen on these
/// machines) delays whatever be1 has in flight right after it recovered,
/// which reads exactly as the relapse the estimate is built to remember
/// (see `lb-user/src/estimate/refute.rs`): a 205 ms answer kept it out for
/// the whole window in one local run, and CI failed on a 19 ms one. So a
/// share below a tenth counts as a failure unless the host stalled for
/// [`HOST_STALL`] or more in the window, or be1 relapsed in it (see
/// [`relapse`]); then the attempt is void, said loudly, and run again, at
/// most [`ATTEMPTS`] times.
fn slow_for_a_moment_then_its_share(name: &'static str, extra: &[&str]) {
    let stalls = HostStalls::watch(HOST_STALL);
    for attempt in 1..=ATTEMPTS {
        let Attempt {
            share,
            window,
            recovered,
            ended,
            relapsed,
        } = share_after_slow_moment(name, extra);
        let seen = stalls.between(recovered, ended);
        println!(
            "{name}: host stalls of {HOST_STALL:?} or more in the window: {seen:?}; \
             be1 relapsed: {relapsed:?}"
        );
        if share > 0.1 {
            return;
        }
        assert!(
            !seen.is_empty() || relapsed.is_some(),
            "share of the recovered backend {share:.3} {window:?}, and neither did the host \
             stall nor did be1 answer slowly again"
        );
        eprintln!(
            "{name}: attempt {attempt} of {ATTEMPTS} VOID: share of the recovered backend \
             {share:.3} {window:?}, but the lab host stalled in the window ({seen:?}) or be1 \
             answered slowly again ({relapsed:?}); again"
        );
    }
    panic!("{name}: the lab host stalled or be1 relapsed in the window of all {ATTEMPTS} attempts");
}

/// A measured relapse of be1 in the window (2 to 8 s after it recovered):
/// its estimate rose by half between two polls to above half again its
/// fastest peer's.
/// A rise means a new slow answer of be1's (with no answers an estimate
/// only decays), and the balancer rightly avoids a backend that just
/// answered slowly. It happens in the lab when the host pauses for a few
/// milliseconds, under [`HOST_STALL`] (one failed CI run: be1 and be2 both
/// from 2.5 to 6 ms in one poll, after which be1 got nothing for the last
/// 0.75 s). A backend kept out for good never relapses: with no answers
/// its estimate never rises.
fn relapse(polls: &[Vec<BackendStatus>]) -> Option<String> {
    (WINDOW_FIRST_POLL..polls.len()).find_map(|step| {
        let (before, now) = (polls[step - 1][0].ewma_ms, polls[step][0].ewma_ms);
        let fastest_peer = polls[step][1].ewma_ms.min(polls[step][2].ewma_ms);
        (now > 1.5 * before && now > 1.5 * fastest_peer).then(|| {
            format!(
                "{:.2} s after recovering, its estimate {before:.1} -> {now:.1} ms (fastest peer \
                 {fastest_peer:.1} ms)",
                (step + 1) as f64 * 0.25
            )
        })
    })
}

/// A stall of the lab host this long voids an attempt of
/// `slow_for_a_moment_then_its_share` that failed (4× the 2 ms service
/// time, over the 1 ms watch's own wake-up jitter).
const HOST_STALL: Duration = Duration::from_millis(20);
/// Attempts of `slow_for_a_moment_then_its_share` at most.
const ATTEMPTS: u32 = 3;

/// What one attempt of `slow_for_a_moment_then_its_share` measured.
struct Attempt {
    /// be1's share of the window's new connections.
    share: f64,
    /// The window's new connections per backend.
    window: Vec<u64>,
    /// When be1 recovered, and when the window ended.
    recovered: Instant,
    ended: Instant,
    /// be1's relapse in the window, if any ([`relapse`]).
    relapsed: Option<String>,
}

/// One attempt of `slow_for_a_moment_then_its_share`: asserts everything
/// but the share, which the caller judges.
fn share_after_slow_moment(name: &'static str, extra: &[&str]) -> Attempt {
    let lab = Fault::new(name, 3);
    let _lb = lab.start(&[0, 1, 2], extra);
    // Long enough for the window after a slow phase of up to
    // `SLOW_AT_MOST`: 3 s, the slow phase, then 8 s of polls.
    let run = lab.during(lab.load(200.0, 14.0, 2_400), |lab| {
        thread::sleep(Duration::from_secs(3));
        let slow = lab.backends()[0].process;
        lab.signal(slow, Signal::SIGUSR1).unwrap();
        // Slow for 0.5 s, longer only if nothing measured it by then (P2C
        // had happened to avoid it, and the probes' avoidance delay plus
        // interval is 0.5 s): a slowness nobody saw tests no recovery. The
        // highest estimate it had while slow is polled, with a peer's.
        let slow_since = Instant::now();
        let mut penalised = 0.0f64;
        let mut peers;
        loop {
            let status = lab.status().unwrap();
            penalised = penalised.max(backend_status(&status, lab, 0).unwrap().ewma_ms);
            peers = backend_status(&status, lab, 1).unwrap().ewma_ms;
            let slow_for = slow_since.elapsed();
            let seen = penalised > 1.5 * peers;
            if slow_for >= Duration::from_millis(500) && (seen || slow_for >= SLOW_AT_MOST) {
                break;
            }
            thread::sleep(Duration::from_millis(20));
        }
        let slow_for = slow_since.elapsed();
        lab.signal(slow, Signal::SIGUSR1).unwrap();
        // Every backend's estimate and opened count each 250 ms for 8 s,
        // so a failure shows what kept the recovered one out.
        let recovered = Instant::now();
        let mut polls: Vec<Vec<BackendStatus>> = Vec::new();
        for step in 1..=POLLS {
            let due = recovered + POLL_EVERY * step;
            thread::sleep(due.saturating_duration_since(Instant::now()));
            let status = lab.status().unwrap();
            polls.push(
                (0..3)
                    .map(|i| backend_status(&status, lab, i).unwrap())
                    .collect(),
            );
        }
        let ended = Instant::now();
        // What the latency probes did (applied, busy, barred...): a
        // recovered backend that stays out with probes on had them barred.
        let probes = lab
            .scrape_metrics()
            .map(|text| {
                let outcomes: Vec<&str> = text
                    .lines()
                    .filter(|l| l.starts_with("lb_latency_probes_total{"))
                    .collect();
                outcomes.join(", ")
            })
            .unwrap_or_else(|e| format!("no metrics: {e:#}"));
        (penalised, peers, slow_for, polls, recovered, ended, probes)
    });
    let (penalised, peers, slow_for, polls, recovered, ended, probes) = &run.during;
    // The window: 2 s to 8 s after it recovered (polls 8 and 32). Six
    // seconds, not two: at 200 req/s most picks find both candidates
    // idle, so whichever of three equally fast backends has the lowest
    // estimate at the moment takes them, and that flips every few hundred
    // milliseconds; a longer window averages it. (Three seconds left
    // shares from 8.5 % to 65 % in this stop's runs: be1 measured a tenth
    // slower than its peers for those three seconds in the low one.)
    let window: Vec<u64> = (0..3)
        .map(|i| polls[POLLS as usize - 1][i].opened - polls[WINDOW_FIRST_POLL - 1][i].opened)
        .collect();
    let total: u64 = window.iter().sum();
    let share = window[0] as f64 / total.max(1) as f64;
    lab.report(
        &run,
        &format!(
            "be1 10× slower for {slow_for:.2?}: its estimate up to {penalised:.1} ms (be2 \
             {peers:.1} ms); 2-8 s after it recovered it got {} of {total} new connections \
             ({:.1}%; fair share 33.3%)",
            window[0],
            share * 100.0
        ),
    );
    let timeline: Vec<String> = polls
        .iter()
        .enumerate()
        .map(|(step, backends)| {
            let each: Vec<String> = backends
                .iter()
                .map(|b| format!("{:.1}ms/{}", b.ewma_ms, b.opened))
                .collect();
            format!("{:.2}s {}", (step + 1) as f64 * 0.25, each.join(" "))
        })
        .collect();
    println!(
        "{name}: after recovery, each backend's estimate/opened: {}; latency probes: {probes}",
        timeline.join("; ")
    );
    assert_eq!(run.summary.error_count(), 0, "{:?}", run.summary);
    // The slowness was seen.
    assert!(
        *penalised > 1.5 * peers,
        "estimate while slow {penalised} ms, a peer's {peers} ms"
    );
    assert!(total > 450, "{window:?}");
    // Fair is 1/3; the long memory still holds a little of the slow
    // half-second (about 5% of τ), and the lowest estimate wins ties, so
    // somewhat less. With one Peak-EWMA of τ = 10 s and no probes it gets
    // none here. (Asserted by the caller, above a tenth.)
    Attempt {
        share,
        window,
        recovered: *recovered,
        ended: *ended,
        relapsed: relapse(polls),
    }
}

/// Polls of `slow_for_a_moment_then_its_share` after the recovery.
const POLLS: u32 = 32;
/// Index of the first poll after the window's start (2.25 s after the
/// recovery): the window counts from the poll before it (2 s) to the last.
const WINDOW_FIRST_POLL: usize = 8;
const POLL_EVERY: Duration = Duration::from_millis(250);

#[test]
fn drained_backend_finishes_its_flows_and_gets_no_new_ones() {
    require_root!();
    let lab = Fault::new("drain", 3);
    // Round-robin, so keep-alive connections to be1 are easy to get (P2C
    // would rightly avoid a backend that already holds one).
    let mut balancer = spec(&lab, &[0, 1, 2], &[]);
    balancer.algorithm = Algorithm::RoundRobin;
    let _lb = lab.start_balancer(&balancer).unwrap();
    let client = lab.client().ns.clone();
    let target = lab.backends()[0].name.clone();
    // Two keep-alive connections that landed on be1.
    let mut kept = Vec::new();
    for _ in 0..60 {
        let mut stream = probe::connect(&client, lab.tcp_vip()).unwrap();
        let response = probe::request(&mut stream, "/", b"", true).unwrap();
        if response.backend.as_deref() == Some(target.as_str()) {
            kept.push(stream);
            if kept.len() == 2 {
                break;
            }
        }
    }
    assert_eq!(kept.len(), 2, "no connection landed on {target}");
    let mut slow = kept.pop().unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let in_flight = thread::spawn(move || probe::request(&mut slow, "/sleep/2000", b"", false));
    thread::sleep(Duration::from_millis(200));

    let vip = lab.tcp_vip().to_string();
    let drained = lab.backends()[0].addr().to_string();
    let run = lab.during(lab.load(200.0, 4.0, 2_000), |lab| {
        thread::sleep(Duration::from_millis(500));
        lab.backend_command(&["drain", "--vip", &vip, "--backend", &drained]);
        opened(lab, 0)
    });
    let after = opened(&lab, 0) - run.during;
    let status = backend_status(&lab.status().unwrap(), &lab, 0).unwrap();
    assert_eq!(status.state, "draining");
    let slow_answer = in_flight.join().unwrap().unwrap();
    let kept_answer = probe::request(&mut kept[0], "/after-drain", b"", true).unwrap();
    lab.report(
        &run,
        &format!(
            "new connections to the drained backend after the drain: {after}; its in-flight 2 s request: {}; its keep-alive connection answered by {:?}",
            slow_answer.status, kept_answer.backend
        ),
    );
    assert_eq!(run.summary.error_count(), 0, "{:?}", run.summary);
    assert_eq!(after, 0, "new flows went to a draining backend");
    assert_eq!(slow_answer.status, 200);
    assert_eq!(kept_answer.backend.as_deref(), Some(target.as_str()));

    lab.backend_command(&["undrain", "--vip", &vip, "--backend", &drained]);
    let back = lab.measure(lab.load(200.0, 1.5, 2_000)).summary;
    assert_eq!(back.error_count(), 0);
    assert!(back.per_backend.contains_key(&target), "{back:?}");
}

#[test]
fn sighup_reload_adds_and_removes_backends_without_loss() {
    require_root!();
    let lab = Fault::new("sighup-reload", 3);
    let path = lab.log_dir().join("reload.toml");
    let write = |backends: &[usize]| {
        let list: Vec<String> = backends
            .iter()
            .map(|&i| format!("\"{}\"", lab.backends()[i].addr()))
            .collect();
        let text = format!(
            "[[vip]]\naddress = \"{}\"\nbackends = [{}]\n",
            lab.tcp_vip(),
            list.join(", ")
        );
        std::fs::write(&path, text).unwrap();
    };
    write(&[0, 1]);
    let mut base = spec(&lab, &[], &["--config", path.to_str().unwrap()]);
    base.vips.clear();
    // Round robin: what the reload does is the same for every algorithm,
    // and round robin gives each backend of the new set its half. P2C at
    // this light load does not: the incumbent takes every flow once the
    // added backend's first few responses read slower than its own, and
    // the added one stays idle until its estimate decays (it answered 4
    // requests in the 5 s after the reload in a failed run), which made
    // the "served by both" check below fail in two runs of five.
    base.algorithm = Algorithm::RoundRobin;
    let lb = lab.start_balancer(&base).unwrap();
    let run = lab.during(lab.load(200.0, 6.0, 2_000), |lab| {
        thread::sleep(Duration::from_secs(2));
        write(&[1, 2]);
        lab.signal(lb, Signal::SIGHUP).unwrap();
        thread::sleep(Duration::from_millis(500));
    });
    let after = lab.measure(lab.load(200.0, 1.5, 2_000)).summary;
    lab.report(
        &run,
        &format!("after the reload, served by {:?}", after.per_backend),
    );
    assert_eq!(run.summary.error_count(), 0, "{:?}", run.summary);
    assert_eq!(after.error_count(), 0, "{after:?}");
    let names: Vec<&String> = after.per_backend.keys().collect();
    assert_eq!(
        names,
        [&lab.backends()[1].name, &lab.backends()[2].name],
        "{after:?}"
    );
}

/// A backend drained at runtime whose entry the file then changes: on
/// SIGHUP the file wins, as it does at a restart. The state file drops
/// the drain, and the running pool puts the backend back in service
/// (before, it stayed draining until the next restart silently undid it).
#[test]
fn sighup_puts_back_a_drained_backend_whose_entry_the_file_changed() {
    require_root!();
    let lab = Fault::new("sighup-drain", 2);
    let path = lab.log_dir().join("reload.toml");
    let write = |weight: u32| {
        let text = format!(
            "[[vip]]\naddress = \"{}\"\nbackends = [\"{}\", \"{}@{weight}\"]\n",
            lab.tcp_vip(),
            lab.backends()[0].addr(),
            lab.backends()[1].addr(),
        );
        std::fs::write(&path, text).unwrap();
    };
    write(1);
    let mut base = spec(&lab, &[], &["--config", path.to_str().unwrap()]);
    base.vips.clear();
    // Weighted round robin: each backend in service gets its share at
    // once, whatever its latency.
    base.algorithm = Algorithm::WeightedRoundRobin;
    let lb = lab.start_balancer(&base).unwrap();
    let vip = lab.tcp_vip().to_string();
    let drained = lab.backends()[1].addr().to_string();
    lab.backend_command(&["drain", "--vip", &vip, "--backend", &drained]);
    let while_drained = lab.measure(lab.load(200.0, 1.5, 2_000));
    lab.report(&while_drained, "while drained");
    let names = |run: &Run| run.summary.per_backend.keys().cloned().collect::<Vec<_>>();
    assert_eq!(while_drained.summary.error_count(), 0);
    assert_eq!(names(&while_drained), [lab.backends()[0].name.clone()]);
    // The file now gives the drained backend weight 2, and is reloaded.
    write(2);
    lab.signal(lb, Signal::SIGHUP).unwrap();
    thread::sleep(Duration::from_millis(500));
    let after = lab.measure(lab.load(200.0, 1.5, 2_000));
    lab.report(&after, "after the reload");
    assert_eq!(after.summary.error_count(), 0);
    assert_eq!(
        names(&after),
        [
            lab.backends()[0].name.clone(),
            lab.backends()[1].name.clone()
        ],
        "the file's backend is back in service"
    );
    let log = lab.stderr(lb);
    assert!(log.contains("back in service, as the file says"), "{log}");
}

#[test]
fn kill_9_and_restart_of_lb_user_loses_no_request() {
    require_root!();
    let lab = Fault::new("kill-9-restart", 3);
    let balancer = spec(&lab, &[0, 1, 2], &[]);
    let first = lab.start_balancer(&balancer).unwrap();
    let run = lab.during(lab.load(200.0, 8.0, 3_000), |lab| {
        thread::sleep(Duration::from_secs(2));
        assert!(!lab.stop_balancer(first, Signal::SIGKILL).unwrap().success());
        let down_at = Instant::now();
        // The kernel balances alone on the last scores meanwhile.
        thread::sleep(Duration::from_secs(2));
        lab.start_balancer(&balancer).unwrap();
        down_at.elapsed()
    });
    let (summary, downtime) = (&run.summary, run.during);
    lab.report(
        &run,
        &format!(
            "control plane down {downtime:.1?}; served by {:?}",
            summary.per_backend
        ),
    );
    assert_eq!(summary.error_count(), 0, "{summary:?}");
    assert_eq!(summary.completed, summary.scheduled);
    assert_eq!(summary.per_backend.len(), 3);
}

/// A restart re-adopts the pins of a build that predates a map this one
/// added or first pinned (simulated by removing the maps' pins while the
/// control plane is down): the program is upgraded in place, which creates
/// and pins the maps, and no request is lost.
#[test]
fn a_restart_upgrades_a_program_that_predates_a_new_map() {
    require_root!();
    let lab = Fault::new("added-map", 2);
    let balancer = spec(&lab, &[0, 1], &[]);
    let first = lab.start_balancer(&balancer).unwrap();
    let pins = [
        lb_common::BACKEND_PENDING_MAP,
        lb_common::BACKEND_HOPS_MAP,
        lb_common::BACKEND_HANDSHAKES_MAP,
    ]
    .map(|name| lab.pin_dir().join(name));
    let run = lab.during(lab.load(200.0, 6.0, 3_000), |lab| {
        thread::sleep(Duration::from_secs(2));
        assert!(!lab.stop_balancer(first, Signal::SIGKILL).unwrap().success());
        for pin in &pins {
            std::fs::remove_file(pin).unwrap();
        }
        lab.start_balancer(&balancer).unwrap()
    });
    let summary = &run.summary;
    lab.report(&run, &format!("served by {:?}", summary.per_backend));
    assert_eq!(summary.error_count(), 0, "{summary:?}");
    assert_eq!(summary.completed, summary.scheduled);
    for pin in &pins {
        assert!(pin.exists(), "the upgrade pins {} again", pin.display());
    }
    let log = lab.stderr(run.during);
    assert!(
        log.contains("upgrading it in place") && log.contains("upgraded lb_xdp in place"),
        "{log}"
    );
}

/// The balancer namespace's `net.ipv4.ip_local_reserved_ports`.
fn reserved_ports(lab: &Lab) -> String {
    let ns = lab.balancer().ns.clone();
    lab.exec_ok(&ns, &["sysctl", "-n", "net.ipv4.ip_local_reserved_ports"])
        .unwrap()
        .trim()
        .to_string()
}

#[test]
fn a_clean_stop_gives_back_the_snat_ports_it_reserved_even_after_a_kill_9() {
    require_root!();
    let lab = Fault::new("reserved-ports", 1);
    let ns = lab.balancer().ns.clone();
    // The operator's own reservations: 25000 lies inside the SNAT range.
    lab.exec_ok(
        &ns,
        &[
            "sysctl",
            "-q",
            "-w",
            "net.ipv4.ip_local_reserved_ports=8080,25000",
        ],
    )
    .unwrap();
    let balancer = spec(&lab, &[0], &["--snat-ports", "20000-32767"]);
    let first = lab.start_balancer(&balancer).unwrap();
    wait_until_configured(&lab, first);
    assert_eq!(reserved_ports(&lab), "8080,20000-32767");
    // Killed, it cannot give them back; its successor takes them over.
    assert!(!lab.stop_balancer(first, Signal::SIGKILL).unwrap().success());
    assert_eq!(
        reserved_ports(&lab),
        "8080,20000-32767",
        "kept while the program runs on"
    );
    let second = lab.start_balancer(&balancer).unwrap();
    wait_until_configured(&lab, second);
    assert_eq!(reserved_ports(&lab), "8080,20000-32767");
    assert!(
        lab.stop_balancer(second, Signal::SIGTERM)
            .unwrap()
            .success()
    );
    let after = reserved_ports(&lab);
    eprintln!(
        "reserved ports: before 8080,25000; running 8080,20000-32767; after the clean stop {after}"
    );
    assert_eq!(after, "8080,25000", "only what lb-user added is released");
    assert!(
        lab.stderr(second).contains("released the SNAT ports"),
        "{}",
        lab.stderr(second)
    );
}

/// A SNAT range that would take every ephemeral port of the balancer's
/// namespace (Linux's default 32768-60999 lies inside 1024-65535) is
/// refused at start with an error that says why and what to change, and
/// leaves nothing behind: no program attached, no port reserved. Then the
/// same namespace takes a range that leaves enough.
#[test]
fn a_snat_range_that_takes_the_hosts_ephemeral_ports_is_refused_and_leaves_nothing_behind() {
    require_root!();
    let lab = Fault::new("ephemeral", 1);
    let ns = lab.balancer().ns.clone();
    let range = lab
        .exec_ok(&ns, &["sysctl", "-n", "net.ipv4.ip_local_port_range"])
        .unwrap();
    assert_eq!(
        range.split_whitespace().collect::<Vec<_>>(),
        ["32768", "60999"],
        "a fresh namespace has Linux's default ephemeral range"
    );
    let before = reserved_ports(&lab);
    let err = lab
        .start_balancer(&spec(&lab, &[0], &["--snat-ports", "1024-65535"]))
        .expect_err("lb-user started with every ephemeral port reserved for SNAT");
    let text = format!("{err:#}");
    eprintln!("{text}");
    assert!(
        text.contains("would leave the host 0 of its 28232 ephemeral ports")
            && text.contains("--snat-ports"),
        "{text}"
    );
    assert!(
        !text.contains("panicked") && !text.contains("RUST_BACKTRACE"),
        "{text}"
    );
    assert!(!lab.xdp_attached().unwrap(), "no program left attached");
    assert_eq!(reserved_ports(&lab), before, "no port left reserved");
    let lb = lab
        .start_balancer(&spec(&lab, &[0], &["--snat-ports", "20000-59975"]))
        .expect("a range that leaves the host 1,024 ephemeral ports");
    wait_until_configured(&lab, lb);
    assert!(try_connect(&lab, lab.tcp_vip(), Duration::from_secs(2)).is_some());
}

/// A SNAT address that no interface of the balancer's namespace holds is
/// warned about at start (nothing answers ARP for it, so replies would
/// not come back unless routed there); one the interface holds is not.
/// No connection is made: the pool is only written.
#[test]
fn a_snat_address_no_interface_holds_is_warned_about_at_start() {
    require_root!();
    let lab = Fault::new("snat-unassigned", 1);
    let assigned = lab.balancer().addr.to_string();
    // TEST-NET-3: never on a lab interface.
    let stray = "203.0.113.9";
    let lb = lab
        .start_balancer(&spec(
            &lab,
            &[0],
            &["--snat-ip", &assigned, "--snat-ip", stray],
        ))
        .unwrap();
    wait_until_configured(&lab, lb);
    let stderr = lab.stderr(lb);
    let warned = |ip: &str| {
        stderr.lines().any(|l| {
            l.contains("SNAT address not assigned") && l.contains(&format!("snat_ip={ip}"))
        })
    };
    assert!(warned(stray), "{stderr}");
    assert!(!warned(&assigned), "{stderr}");
}

/// A connection from the client namespace with a short connect timeout.
fn try_connect(lab: &Lab, addr: SocketAddr, timeout: Duration) -> Option<TcpStream> {
    lab.in_ns(&lab.client().ns, || {
        Ok(TcpStream::connect_timeout(&addr, timeout).ok())
    })
    .unwrap()
}

#[test]
fn snat_exhaustion_refuses_new_flows_and_keeps_established_ones() {
    require_root!();
    let lab = Fault::new("snat-exhaustion", 1);
    const PORTS: usize = 8;
    let _lb = lab.start(&[0], &["--snat-ports", "20000-20007"]);
    // Fill the pool with keep-alive connections (random port picks may
    // need a few attempts for the last free ports).
    let mut kept = Vec::new();
    for _ in 0..60 {
        if let Some(mut s) = try_connect(&lab, lab.tcp_vip(), Duration::from_millis(700)) {
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            probe::request(&mut s, "/", b"", true).unwrap();
            kept.push(s);
            if kept.len() == PORTS {
                break;
            }
        }
    }
    assert_eq!(kept.len(), PORTS, "could not use the whole SNAT pool");
    let run = lab.measure(lab.load(20.0, 2.0, 1_000));
    let exhausted = reason_count(&lab, "drop_snat_exhausted");
    let kept_ok = still_answering(&mut kept, "/still-there");
    lab.report(
        &run,
        &format!(
            "pool of {PORTS} ports held by keep-alive connections; drop_snat_exhausted = {exhausted}; established connections still answering: {kept_ok}/{PORTS}"
        ),
    );
    assert_eq!(
        run.summary.completed, 0,
        "a flow got a port from a full pool"
    );
    assert!(exhausted > 0);
    assert_eq!(kept_ok, PORTS, "an established flow was harmed");
    let metrics = lab.scrape_metrics().unwrap();
    assert!(metric(&metrics, "lb_packets_total{reason=\"drop_snat_exhausted\"}") > 0.0);
}

/// The flow table is a plain hash: when it is full a new connection is
/// refused (counted as `drop_flow_insert`), and no live connection is ever
/// evicted to make room for it.
#[test]
fn full_flow_table_refuses_new_flows_and_evicts_no_live_one() {
    require_root!();
    let lab = Fault::new("flow-table-overflow", 2);
    // 64 entries: 32 connections, both directions each. A closed connection
    // keeps its entries for the linger and the SNAT quarantine, so a run of
    // new connections fills the table within a fraction of a second.
    let _lb = lab.start(&[0, 1], &["--flow-table-size", "64"]);
    // Idle keep-alive connections, opened first: an LRU would evict them.
    let mut idle = keep_alive(&lab, 4);
    let run = lab.measure(lab.load(200.0, 3.0, 1_000));
    let mut refused = 0.0;
    wait_for(
        "refused flows to be counted",
        Duration::from_secs(5),
        || {
            refused = metric(
                &lab.scrape_metrics().unwrap(),
                "lb_packets_total{reason=\"drop_flow_insert\"}",
            );
            refused >= 1.0
        },
    );
    let metrics = lab.scrape_metrics().unwrap();
    let entries = metric(&metrics, "lb_flow_table_entries");
    let lone = metric(&metrics, "lb_flows_evicted_total");
    for s in &idle {
        s.set_read_timeout(Some(Duration::from_millis(500)))
            .unwrap();
    }
    let idle_alive = still_answering(&mut idle, "/");
    lab.report(
        &run,
        &format!(
            "table of 64 entries; SYNs refused while full: {refused}; entries {entries}; lone entries {lone}; idle keep-alive connections surviving: {idle_alive}/4"
        ),
    );
    // The table filled: later connections were refused, not let in by
    // evicting others.
    assert!(run.summary.completed > 0, "{:?}", run.summary);
    assert!(run.summary.error_count() > 0, "{:?}", run.summary);
    assert!(entries <= 64.0, "{entries}");
    assert_eq!(idle_alive, 4, "a live connection lost its flow");
    assert_eq!(lone, 0.0, "one direction of a connection vanished");
}

/// A start that fails on a running instance (one whose process died, so
/// the start re-adopts it) leaves it as it was: attached, pinned and
/// balancing. A SNAT range that would leave the host too few ephemeral
/// ports is refused before anything is adopted; a failure after the
/// adoption (here the control socket's path taken by a directory) keeps
/// the instance too, and says so. A good start then adopts it as usual.
#[test]
fn a_failed_start_on_a_running_instance_leaves_it_balancing() {
    require_root!();
    let lab = Fault::new("failed-start", 1);
    let still_balancing = |when: &str| {
        assert!(
            lab.xdp_attached().unwrap(),
            "{when}: the program was detached"
        );
        assert!(lab.status().unwrap().ready, "{when}: not ready");
        let run = lab.measure(lab.load(100.0, 1.0, 1_000));
        lab.report(&run, when);
        assert!(run.summary.completed > 0, "{when}: {:?}", run.summary);
        assert_eq!(run.summary.error_count(), 0, "{when}: {:?}", run.summary);
    };
    let first = lab.start(&[0], &[]);
    wait_until_configured(&lab, first);
    assert!(!lab.stop_balancer(first, Signal::SIGKILL).unwrap().success());
    still_balancing("after kill -9");

    // The balancer namespace's ephemeral range is 32768-60999: this range
    // leaves it 999 ports.
    let (exit, stderr) = lab
        .run_failing_balancer(&spec(&lab, &[0], &["--snat-ports", "20000-60000"]))
        .unwrap();
    eprintln!("{stderr}");
    assert!(!exit.success(), "{stderr}");
    assert!(stderr.contains("ephemeral ports"), "{stderr}");
    assert!(
        !stderr.contains("re-adopted"),
        "refused after the adoption:\n{stderr}"
    );
    still_balancing("after a start refused for its SNAT range");

    // The killed process's socket file is stale; a directory in its place
    // fails the control socket's bind, a step after the adoption.
    let socket = Path::new("/run/lb-user").join(format!("{}.sock", lab.instance()));
    let _ = std::fs::remove_file(&socket);
    std::fs::create_dir_all(&socket).unwrap();
    let failed = lab.run_failing_balancer(&spec(&lab, &[0], &[]));
    std::fs::remove_dir(&socket).unwrap();
    let (exit, stderr) = failed.unwrap();
    eprintln!("{stderr}");
    assert!(!exit.success(), "{stderr}");
    assert!(stderr.contains("re-adopted"), "{stderr}");
    assert!(
        stderr.contains("which is left attached and balancing its flows")
            && stderr.contains("binding"),
        "{stderr}"
    );
    still_balancing("after a start that failed on the adopted instance");

    // The same instance name on another interface (a mistyped --iface
    // after the kill): its pinned program runs elsewhere, so the start is
    // refused, where it removed those pins and cut the flows. (`lo`'s own
    // address, 127.0.0.1, is refused as the SNAT address taken by default,
    // before the pins are looked at: the lab's usual one is given.)
    let state_dir = lab.state_dir().display().to_string();
    let snat_ip = BALANCER_ADDR.to_string();
    let (vip, backend) = (
        lab.tcp_vip().to_string(),
        lab.backends()[0].addr().to_string(),
    );
    let out = lab
        .run_lb_user(&[
            "--iface",
            "lo",
            "--xdp-mode",
            "skb",
            "--instance",
            &lab.instance(),
            "--vip",
            &vip,
            "--backend",
            &backend,
            "--state-dir",
            &state_dir,
            "--metrics-addr",
            "off",
            "--snat-ip",
            &snat_ip,
        ])
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("is attached to another interface"),
        "{stderr}"
    );
    still_balancing("after a start of its instance on another interface");

    let third = lab.start(&[0], &[]);
    wait_until_configured(&lab, third);
    assert!(
        lab.stderr(third).contains("re-adopted"),
        "{}",
        lab.stderr(third)
    );
    still_balancing("after a good start");
}

/// Each family's flow table takes its own size (`--flow-table-size` for
/// IPv4's `FLOWS4`, `--flow-table-size-ipv6` for IPv6's `FLOWS`), the
/// start says what they cost, and a restart that re-adopts the running
/// program keeps the pinned sizes, warns about each, and balances on.
#[test]
fn each_familys_flow_table_has_its_own_size_which_a_restart_keeps() {
    require_root!();
    let lab = Fault::new("table-sizes", 1);
    let pinned = |name: &str| {
        aya::maps::MapInfo::from_pin(lab.pin_dir().join(name))
            .unwrap()
            .max_entries()
    };
    let capacity = |family: &str| {
        metric(
            &lab.scrape_metrics().unwrap(),
            &format!("lb_flow_table_capacity{{family=\"{family}\"}}"),
        )
    };
    let first = lab.start(
        &[0],
        &["--flow-table-size", "8192", "--flow-table-size-ipv6", "64"],
    );
    wait_until_configured(&lab, first);
    assert_eq!((pinned("FLOWS4"), pinned("FLOWS")), (8192, 64));
    assert_eq!((capacity("ipv4"), capacity("ipv6")), (8192.0, 64.0));
    let status = lab.status().unwrap().flow_table_capacity;
    assert_eq!(
        status,
        [("ipv4".to_string(), 8192), ("ipv6".to_string(), 64)].into(),
        "lb-user status --json"
    );
    let log = lab.stderr(first);
    let line = log
        .lines()
        .find(|l| l.contains("flow tables:"))
        .unwrap_or_else(|| panic!("no flow-table line in:\n{log}"));
    eprintln!("{line}");
    assert!(
        line.contains("ipv4_entries=8192") && line.contains("ipv6_entries=64"),
        "{line}"
    );
    // 8192 entries of 160 bytes or more: at least 1 MiB.
    let mib: u64 = line
        .split("flow tables: ")
        .nth(1)
        .and_then(|rest| rest.split(" MiB").next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no size in {line}"));
    assert!((1..64).contains(&mib), "{line}");
    // IPv6's table is the smaller one: no hint to shrink it.
    assert!(!log.contains("--flow-table-size-ipv6 shrinks it"), "{log}");

    assert!(!lab.stop_balancer(first, Signal::SIGKILL).unwrap().success());
    let second = lab.start(&[0], &["--flow-table-size", "4096"]);
    wait_until_configured(&lab, second);
    let log = lab.stderr(second);
    for kept in [
        "keeping the pinned flow table FLOWS4 of 8192 entries; --flow-table-size 4096",
        "keeping the pinned flow table FLOWS of 64 entries; --flow-table-size-ipv6 4096",
    ] {
        assert!(log.contains(kept), "{kept}:\n{log}");
    }
    assert_eq!((pinned("FLOWS4"), pinned("FLOWS")), (8192, 64));
    assert_eq!((capacity("ipv4"), capacity("ipv6")), (8192.0, 64.0));
    let run = lab.measure(lab.load(100.0, 1.0, 1_000));
    lab.report(&run, "after a restart that kept the pinned sizes");
    assert!(run.summary.completed > 0, "{:?}", run.summary);
    assert_eq!(run.summary.error_count(), 0, "{:?}", run.summary);

    // A fresh start with IPv6's table as large as IPv4's and no IPv6 VIP
    // says how to shrink it.
    assert!(
        lab.stop_balancer(second, Signal::SIGTERM)
            .unwrap()
            .success()
    );
    let third = lab.start(&[0], &["--flow-table-size", "4096"]);
    wait_until_configured(&lab, third);
    assert_eq!((pinned("FLOWS4"), pinned("FLOWS")), (4096, 4096));
    let log = lab.stderr(third);
    assert!(
        log.contains(
            "IPv6's flow table of 4096 entries stays empty; --flow-table-size-ipv6 shrinks it"
        ),
        "{log}"
    );
    let status = lab.status().unwrap();
    assert!(!status.flow_tables_shared, "{status:?}");

    // The reconciler's sweep is loaded against the pins first: loaded
    // after the pin is gone, it would create and pin a FLOWS4 of its own
    // (a run of the whole suite once read one of the default 262144 entries).
    wait_for(
        "the first reconciliation pass",
        Duration::from_secs(10),
        || metric(&lab.scrape_metrics().unwrap(), "lb_reconcile_seconds_count") > 0.0,
    );
    // The pins of a running program of a build before IPv4's own table
    // (both families in FLOWS), as this build's `status` meets them when
    // it runs before the daemon is restarted on it: `status` still answers,
    // with the one table's size, and says so.
    std::fs::remove_file(lab.pin_dir().join("FLOWS4")).unwrap();
    let status = lab.status().unwrap();
    assert!(status.flow_tables_shared, "{status:?}");
    assert_eq!(
        status.flow_table_capacity,
        [("ipv4".to_string(), 4096), ("ipv6".to_string(), 4096)].into()
    );
    let text = lab
        .run_lb_user(&["status", "--instance", &lab.instance()])
        .unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("(one table of 4096 for both families: the running program predates"),
        "{text}"
    );
    assert!(lab.stop_balancer(third, Signal::SIGTERM).unwrap().success());
}

/// Ids of the `lb_xdp` programs that use this lab's pinned flow table
/// (netlink's view is not used: after a link update this kernel keeps
/// reporting the replaced program's id).
fn programs_on_pinned_maps(lab: &Lab) -> Vec<u32> {
    let flows = aya::maps::MapInfo::from_pin(lab.pin_dir().join("FLOWS"))
        .unwrap()
        .id();
    aya::programs::loaded_programs()
        .flatten()
        .filter(|p| p.name_as_str() == Some("lb_xdp"))
        .filter(|p| {
            p.map_ids()
                .ok()
                .flatten()
                .is_some_and(|ids| ids.contains(&flows))
        })
        .map(|p| p.id())
        .collect()
}

#[test]
fn program_upgrade_swaps_the_xdp_program_without_loss() {
    require_root!();
    let lab = Fault::new("program-upgrade", 3);
    let balancer = spec(&lab, &[0, 1, 2], &[]);
    let old = lab.start_balancer(&balancer).unwrap();
    let old_programs = programs_on_pinned_maps(&lab);
    assert_eq!(old_programs.len(), 1, "{old_programs:?}");
    let client = lab.client().ns.clone();
    let mut kept = probe::connect(&client, lab.tcp_vip()).unwrap();
    let first = probe::request(&mut kept, "/", b"", true).unwrap();
    let run = lab.during(lab.load(200.0, 8.0, 3_000), |lab| {
        thread::sleep(Duration::from_secs(2));
        // The old control plane goes away without detaching (as in a binary
        // swap), and the new one replaces the program on the pinned link.
        assert!(!lab.stop_balancer(old, Signal::SIGKILL).unwrap().success());
        let mut upgraded = balancer.clone();
        upgraded.extra_args.push("--upgrade".into());
        let new = lab.start_balancer(&upgraded).unwrap();
        // The pinned state still says ready, so wait for the swap itself.
        let mut new_programs = Vec::new();
        wait_for("the program swap", Duration::from_secs(10), || {
            new_programs = programs_on_pinned_maps(lab);
            !new_programs.contains(&old_programs[0])
        });
        let after_upgrade = probe::request(&mut kept, "/after-upgrade", b"", true).unwrap();
        // And the upgraded link is re-adopted by the next restart.
        thread::sleep(Duration::from_secs(1));
        assert!(!lab.stop_balancer(new, Signal::SIGKILL).unwrap().success());
        lab.start_balancer(&balancer).unwrap();
        (new_programs, after_upgrade)
    });
    let (new_programs, after_upgrade) = &run.during;
    let again = probe::request(&mut kept, "/after-restart", b"", true).unwrap();
    lab.report(
        &run,
        &format!(
            "XDP program {old_programs:?} → {new_programs:?} (then one more kill -9 + restart); keep-alive connection served by {:?}, {:?}, {:?}",
            first.backend, after_upgrade.backend, again.backend
        ),
    );
    assert_eq!(new_programs.len(), 1, "{new_programs:?}");
    assert_ne!(&old_programs, new_programs, "the program was not replaced");
    assert_eq!(
        &programs_on_pinned_maps(&lab),
        new_programs,
        "re-adoption replaced the program"
    );
    assert_eq!(run.summary.error_count(), 0, "{:?}", run.summary);
    assert_eq!(
        after_upgrade.backend, first.backend,
        "the established flow moved"
    );
    assert_eq!(again.backend, first.backend, "the established flow moved");
}

#[test]
fn syn_flood_beyond_the_new_flow_cap_is_refused_and_spares_established_flows() {
    require_root!();
    let lab = Fault::new("syn-flood-cap", 2);
    // 100 new flows/s at most; 1024 entries hold what the cap lets in
    // during the flood (closed flows linger), but not the flood itself.
    let _lb = lab.start(
        &[0, 1],
        &["--max-new-flows", "100", "--flow-table-size", "1024"],
    );
    let mut kept = keep_alive(&lab, 4);
    thread::sleep(Duration::from_secs(1));
    let run = lab.measure(lab.load(1_000.0, 3.0, 500));
    let refused = reason_count(&lab, "drop_new_flow_rate");
    let kept_ok = still_answering(&mut kept, "/after-flood");
    lab.report(
        &run,
        &format!(
            "cap 100 new flows/s; refused by the cap: {refused} SYNs; established keep-alive connections still answering: {kept_ok}/4"
        ),
    );
    let summary = &run.summary;
    assert!(refused > 0, "the cap refused nothing");
    // The cap lets about 100/s (plus a second of burst) through.
    assert!(
        summary.completed <= 100 * 3 + 100 + 100,
        "{} flows passed a cap of 100/s",
        summary.completed
    );
    assert!(summary.completed >= 100, "{summary:?}");
    assert_eq!(kept_ok, 4, "the flood evicted established flows");
}

/// lb-user's test-only failure injection (see `lb-user/src/settings/faults.rs`).
const FAULTS_ENV: &str = "LB_USER_FAULTS";

#[test]
fn injected_control_plane_failures_leave_the_data_path_balancing() {
    require_root!();
    let lab = Fault::new("control-plane-errors", 3);
    let balancer = spec(&lab, &[0, 1, 2], FAST_HEALTH_CHECKS);
    let first = lab.start_balancer(&balancer).unwrap();
    // A restart (kill -9, then start again on the pinned program) whose
    // neighbour-table reads fail (start-up and the first refresh), whose
    // first 60 score writes (3 s of ticks) and then 20 selection writes
    // fail, and whose first health check of every backend panics.
    let faults = "score-write=60,table-write=20,neighbours=2,health-panic=3";
    let run = lab.during(lab.load(150.0, 10.0, 2_000), |lab| {
        thread::sleep(Duration::from_secs(1));
        assert!(!lab.stop_balancer(first, Signal::SIGKILL).unwrap().success());
        let lb = lab
            .start_balancer_with_env(&balancer, &[(FAULTS_ENV, faults)])
            .unwrap();
        // Past the first neighbour refresh (5 s after the start).
        thread::sleep(Duration::from_secs(6));
        (
            lb,
            lab.exit_status(lb).unwrap(),
            lab.xdp_attached().unwrap(),
        )
    });
    let (summary, (lb, exited, attached)) = (&run.summary, run.during);
    let metrics = lab.scrape_metrics().unwrap();
    let errors = |stage: &str| {
        metric(
            &metrics,
            &format!("lb_control_errors_total{{stage=\"{stage}\"}}"),
        )
    };
    lab.report(
        &run,
        &format!(
            "injected {faults}; control errors tick {} neighbours {} health_task {}; served by {:?}",
            errors("tick"),
            errors("neighbours"),
            errors("health_task"),
            summary.per_backend
        ),
    );
    assert_eq!(exited, None, "lb-user exited: {}", lab.stderr(lb));
    assert!(attached, "the program was detached");
    assert_eq!(summary.error_count(), 0, "{summary:?}");
    assert_eq!(summary.completed, summary.scheduled);
    assert_eq!(summary.per_backend.len(), 3, "{summary:?}");
    assert!(errors("tick") >= 80.0, "{metrics}");
    assert!(errors("neighbours") >= 2.0, "{metrics}");
    assert!(errors("health_task") >= 3.0, "{metrics}");
    // Scores are written again once the injected failures are used up.
    assert!(metric(&metrics, "lb_map_update_seconds_count{kind=\"scores\"}") > 0.0);
    // Reconciliation passes ran and were timed (this process has run for
    // 6 s: its first pass after 1 s, then one every few seconds, as their
    // cost sets), and the interval is within its bounds.
    assert!(
        metric(&metrics, "lb_reconcile_seconds_count") >= 1.0,
        "{metrics}"
    );
    let interval = metric(&metrics, "lb_reconcile_interval_seconds");
    assert!((1.0..=120.0).contains(&interval), "{metrics}");
    // The process's own metrics.
    assert!(metric(&metrics, "process_cpu_seconds_total") > 0.0);
    assert!(metric(&metrics, "process_resident_memory_bytes") > 1e6);
    assert_eq!(metric(&metrics, "lb_config_generation"), 1.0);
    assert_eq!(metric(&metrics, "lb_build_info{"), 1.0);
    let log = lab.stderr(lb);
    assert!(log.contains("injected fault: health-panic"), "{log}");
    assert!(
        !log.contains("RUST_BACKTRACE"),
        "a panic report in the log: {log}"
    );
    // The panicked health checks were restarted: a dead backend is found
    // by them (no load runs now, so nothing else could find it).
    lab.signal(lab.backends()[2].process, Signal::SIGKILL)
        .unwrap();
    let down = r#"backend=2 from="active" to="down" why="health check""#;
    wait_for(
        "the health checks to take the killed backend down",
        Duration::from_secs(5),
        || lab.stderr(lb).contains(down),
    );
    assert_eq!(lab.exit_status(lb).unwrap(), None);
    assert!(lab.xdp_attached().unwrap());
}

#[test]
fn a_restart_with_a_reordered_config_keeps_every_id_counter_and_flow() {
    require_root!();
    let lab = Fault::new("reordered-restart", 3);
    let first = lab.start_balancer(&spec(&lab, &[0, 1, 2], &[])).unwrap();
    let mut streams = keep_alive(&lab, 6);
    let served_by: Vec<String> = streams
        .iter_mut()
        .map(|s| probe::request(s, "/", b"", true).unwrap().backend.unwrap())
        .collect();
    let warm_up = lab.measure(lab.load(100.0, 2.0, 2_000));
    assert_eq!(warm_up.summary.error_count(), 0, "{:?}", warm_up.summary);
    let before = lab.status().unwrap();
    assert!(!lab.stop_balancer(first, Signal::SIGKILL).unwrap().success());
    // The same backends, in another order: config order would renumber them.
    let second = lab.start_balancer(&spec(&lab, &[2, 0, 1], &[])).unwrap();
    wait_until_configured(&lab, second);
    let after = lab.status().unwrap();
    let mut moved = Vec::new();
    for index in 0..3 {
        let old = backend_status(&before, &lab, index).unwrap();
        let new = backend_status(&after, &lab, index).unwrap();
        if old.id != new.id || new.opened < old.opened {
            moved.push((old.clone(), new.clone()));
        }
        // Each open keep-alive connection is still counted on its server.
        let open = served_by
            .iter()
            .filter(|n| **n == lab.backends()[index].name)
            .count() as u64;
        assert_eq!(new.inflight, open, "{new:?}");
    }
    assert!(moved.is_empty(), "ids or counters moved: {moved:?}");
    // Every flow stays with its server.
    for (stream, who) in streams.iter_mut().zip(&served_by) {
        let answer = probe::request(stream, "/", b"", true).unwrap();
        assert_eq!(answer.backend.as_deref(), Some(who.as_str()));
    }
    // Closed, so P2C's in-flight term spreads the new load over all three.
    drop(streams);
    thread::sleep(Duration::from_millis(500));
    let run = lab.measure(lab.load(100.0, 2.0, 2_000));
    lab.report(
        &run,
        &format!(
            "ids kept across a reordered restart: {:?}",
            after.vips[0]
                .backends
                .iter()
                .map(|b| (b.id, b.address.clone()))
                .collect::<Vec<_>>()
        ),
    );
    assert_eq!(run.summary.error_count(), 0, "{:?}", run.summary);
    // Every backend is in service under its kept id, and new flows reach
    // them by their addresses. Not "each of the three served": at 100
    // req/s P2C may rightly leave one idle whose estimate is above the
    // others' (a clean-clone run saw 2 of 3), which says nothing about ids.
    let now = lab.status().unwrap();
    for index in 0..3 {
        let backend = backend_status(&now, &lab, index).unwrap();
        assert_eq!(backend.state, "active", "{backend:?}");
    }
    assert!(run.summary.per_backend.len() >= 2, "{:?}", run.summary);
    for name in run.summary.per_backend.keys() {
        assert!(
            lab.backends().iter().any(|b| &b.name == name),
            "answered by {name}, not a backend of the lab"
        );
    }
}

/// A restart whose file moved one of eight Maglev VIPs, which a previous
/// instance left reading every Maglev table: the new VIP takes the moved
/// VIP's table, and the moved VIP leaves VIPS (and the grace passes)
/// before that table is rewritten, so no SYN to the old address hashes
/// into the new VIP's backends. The old VIP's kept connection finishes,
/// the old address takes no new one, and all eight serve.
#[test]
fn a_restart_moves_a_maglev_vip_while_every_maglev_table_is_taken() {
    require_root!();
    let lab = Fault::new("restart-maglev", 2);
    let (path, mut vips, base) = eight_maglev_vips(&lab);
    let first = lab.start_balancer(&base).unwrap();
    let old = vips[7];
    let (mut kept, _) = kept_connection(&lab, old);
    assert!(!lab.stop_balancer(first, Signal::SIGKILL).unwrap().success());

    let moved = other_vip(&lab, 8081);
    vips[7] = moved;
    write_vips(&lab, &path, &vips, MAGLEV);
    let second = lab.start_balancer(&base).unwrap();
    wait_until_configured(&lab, second);
    let log = lab.stderr(second);
    assert!(
        log.contains("a previous VIP stopped reading its Maglev table"),
        "{log}"
    );
    assert_maglev_vip_moved(&lab, "a restart", &vips, old, &mut kept);
}

/// A restart that moves a VIP off Maglev, after another Maglev VIP in the
/// file: the moved VIP stops reading its table before any table is
/// written (the other VIP's new table, written aside, would take it as
/// the spare while the moved VIP's SYNs still hashed into it), and both
/// serve under their new settings.
#[test]
fn a_restart_moves_a_vip_off_maglev_beside_another_maglev_vip() {
    require_root!();
    let lab = Fault::new("restart-off-maglev", 2);
    let path = lab.log_dir().join("vips.toml");
    let (stays, moves) = (other_vip(&lab, 81), other_vip(&lab, 82));
    write_vips(&lab, &path, &[stays, moves], MAGLEV);
    let mut base = spec(&lab, &[], &["--config", path.to_str().unwrap()]);
    base.vips.clear();
    let first = lab.start_balancer(&base).unwrap();
    assert!(!lab.stop_balancer(first, Signal::SIGKILL).unwrap().success());

    write_vips(&lab, &path, &[stays], MAGLEV);
    let maglev = std::fs::read_to_string(&path).unwrap();
    write_vips(&lab, &path, &[moves], "algorithm = \"round-robin\"\n");
    let round_robin = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, format!("{maglev}\n{round_robin}")).unwrap();
    let second = lab.start_balancer(&base).unwrap();
    wait_until_configured(&lab, second);
    let log = lab.stderr(second);
    assert!(
        log.contains("a previous VIP stopped reading its Maglev table"),
        "{log}"
    );
    let status = lab.status().unwrap();
    let algorithm = |vip: SocketAddr| status.vip(&vip.to_string()).unwrap().algorithm.clone();
    assert_eq!(
        (algorithm(stays), algorithm(moves)),
        ("maglev".to_string(), "round-robin".to_string())
    );
    for vip in [stays, moves] {
        let run = lab.measure(load_to(vip, 100.0, 1.0));
        assert_eq!(run.summary.error_count(), 0, "{vip}: {:?}", run.summary);
    }
}

/// Waits until a restarted lb-user has written its configuration (a
/// re-adopted instance's status reads as ready before that: the pinned
/// maps already are).
fn wait_until_configured(lab: &Lab, process: lb_lab::lab::ProcessId) {
    wait_for(
        "lb-user to write its configuration",
        Duration::from_secs(10),
        || lab.stderr(process).contains("balancing "),
    );
}

/// The TCP VIP over `backends` (index, weight).
fn weighted_spec(lab: &Lab, backends: &[(usize, u32)]) -> BalancerSpec {
    let mut spec = spec(lab, &[], &[]);
    spec.vips[0].backends = backends
        .iter()
        .map(|&(i, w)| (lab.backends()[i].addr(), w))
        .collect();
    spec
}

#[test]
fn runtime_changes_survive_a_restart_until_the_file_changes_the_backend() {
    require_root!();
    let lab = Fault::new("runtime-state", 3);
    let addr = |i: usize| lab.backends()[i].addr().to_string();
    let vip = format!("{}", lab.tcp_vip());
    let first = lab
        .start_balancer(&weighted_spec(&lab, &[(0, 1), (1, 1)]))
        .unwrap();
    lab.backend_command(&["add", "--vip", &vip, "--backend", &format!("{}@2", addr(2))]);
    lab.backend_command(&["drain", "--vip", &vip, "--backend", &addr(0)]);
    lab.backend_command(&[
        "weight",
        "--vip",
        &vip,
        "--backend",
        &addr(1),
        "--weight",
        "3",
    ]);
    let ids: Vec<u32> = (0..3)
        .map(|i| backend_status(&lab.status().unwrap(), &lab, i).unwrap().id)
        .collect();
    // The new weight reaches the score map by the tick's batch update.
    let weight = |i| {
        backend_status(&lab.status().unwrap(), &lab, i)
            .unwrap()
            .weight
    };
    wait_for(
        "the new weight in the scores",
        Duration::from_secs(2),
        || weight(1) == 3.0,
    );
    assert!(
        !lab.stderr(first).contains("no batch map updates"),
        "scores fell back to one update each"
    );
    // The state file is written just after each change.
    wait_for("the state file", Duration::from_secs(5), || {
        std::fs::read_dir(lab.state_dir())
            .map(|d| {
                d.flatten()
                    .any(|e| e.path().extension().is_some_and(|x| x == "json"))
            })
            .unwrap_or(false)
    });
    thread::sleep(Duration::from_millis(300));
    assert!(!lab.stop_balancer(first, Signal::SIGKILL).unwrap().success());

    // Restarted from the file, reordered, without the added backend. (A
    // re-adopted instance reads as ready at once: wait for its writes.)
    let second = lab
        .start_balancer(&weighted_spec(&lab, &[(1, 1), (0, 1)]))
        .unwrap();
    wait_until_configured(&lab, second);
    let weight = |i| {
        backend_status(&lab.status().unwrap(), &lab, i)
            .unwrap()
            .weight
    };
    wait_for(
        "the restarted instance's weights",
        Duration::from_secs(5),
        || weight(2) == 2.0 && weight(1) == 3.0,
    );
    let status = lab.status().unwrap();
    let b = |i| backend_status(&status, &lab, i).unwrap();
    assert_eq!([b(0).id, b(1).id, b(2).id], ids[..], "ids moved");
    assert_eq!(b(0).state, "draining", "{:?}", b(0));
    let drained_opened = b(0).opened;
    let run = lab.measure(lab.load(100.0, 2.0, 2_000));
    lab.report(
        &run,
        &format!("after the restart: {:?}", run.summary.per_backend),
    );
    assert_eq!(run.summary.error_count(), 0, "{:?}", run.summary);
    assert_eq!(
        opened(&lab, 0),
        drained_opened,
        "the drained backend got new flows"
    );
    assert!(opened(&lab, 2) > 0, "the added backend got no flows");

    // The file now says something else of backend 1: the file wins there,
    // the other changes hold.
    assert!(
        !lab.stop_balancer(second, Signal::SIGKILL)
            .unwrap()
            .success()
    );
    lab.start_balancer(&weighted_spec(&lab, &[(1, 5), (0, 1)]))
        .unwrap();
    wait_for("the file's weight", Duration::from_secs(5), || {
        weight(1) == 5.0
    });
    let status = lab.status().unwrap();
    let b = |i| backend_status(&status, &lab, i).unwrap();
    assert_eq!(b(0).state, "draining");
    assert_eq!(b(2).weight, 2.0);
}

/// The TCP VIP's address on another port.
fn other_vip(lab: &Lab, port: u16) -> SocketAddr {
    SocketAddr::new(lab.tcp_vip().ip(), port)
}

/// `rate` new connections per second to `vip` for `duration_s` seconds.
fn load_to(vip: SocketAddr, rate: f64, duration_s: f64) -> LoadConfig {
    LoadConfig::open_loop(vip, Protocol::Tcp, rate, duration_s).with_timeout_ms(2_000)
}

/// A keep-alive connection to `vip` with one answered request; the backend
/// that answered.
fn kept_connection(lab: &Lab, vip: SocketAddr) -> (TcpStream, String) {
    let mut s = probe::connect(&lab.client().ns, vip).unwrap();
    let answer = probe::request(&mut s, "/", b"", true).unwrap();
    assert_eq!(answer.status, 200);
    (s, answer.backend.expect("the backend names itself"))
}

#[test]
fn a_vip_added_at_runtime_serves_survives_kill_9_and_drains_when_removed() {
    require_root!();
    // The fourth backend serves only the VIP added again at the end. A
    // clean clone's run once read 102 connections opened for 100 answers
    // there, with the VIP on a backend that had served the other VIP
    // seconds before. The likely cause (not confirmed: the run left no
    // logs): the short quarantine below frees SNAT tuples long before a
    // backend's 60 s TIME_WAIT does, so that backend could be handed a
    // tuple it still held in TIME_WAIT; a SYN its TIME_WAIT rejects waits
    // for the client's retransmission, which is balanced again as a new
    // connection (`--syn-timeout`). A backend with no TIME_WAIT keeps that
    // count about the reused id.
    let lab = Fault::new("runtime-vip", 4);
    // Closed flows leave the table quickly and their SNAT tuples leave
    // quarantine (which holds the backend's id) soon after, so the removed
    // VIP's id is freed within the test. The tuples are freed by a sweep
    // pass, spaced by what a pass costs: about 5 ms (5 s apart) for the
    // default 262,144 entries here, more on a loaded machine, where a clean
    // clone's run once waited past 20 s. A small table keeps the passes
    // a second apart.
    let extra = [
        "--tcp-idle-timeout",
        "2s",
        "--snat-quarantine",
        "2s",
        "--flow-table-size",
        "8192",
    ];
    let first = lab.start(&[0, 1], &extra);
    let vip = other_vip(&lab, 81);
    let vip_arg = format!("{vip}/tcp");
    let be = |i: usize| lab.backends()[i].addr().to_string();
    let name = |i: usize| lab.backends()[i].name.clone();
    let added = lab.vip_command(&[
        "add",
        "--vip",
        &vip_arg,
        "--backend",
        &be(0),
        "--backend",
        &be(2),
        "--algorithm",
        "round-robin",
    ]);
    assert!(added.contains("added (VIP id 1)"), "{added}");
    let listed = |lab: &Lab| {
        lab.status()
            .unwrap()
            .vip(&vip.to_string())
            .map(|v| v.backends.len())
    };
    assert_eq!(listed(&lab), Some(2));
    // A bad command changes nothing and says why in one line.
    let instance = lab.instance();
    let out = lab
        .run_lb_user(&[
            "vip",
            "add",
            "--vip",
            &vip_arg,
            "--backend",
            &be(1),
            "--instance",
            &instance,
        ])
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("already exists"), "{err}");
    // A backend added at runtime meets a configured backend's rules.
    let itself = vip.to_string();
    for (bad, why) in [
        ("224.0.0.5:80", "a multicast address"),
        (itself.as_str(), "lists itself as a backend"),
    ] {
        let out = lab
            .run_lb_user(&[
                "backend",
                "add",
                "--vip",
                &vip_arg,
                "--backend",
                bad,
                "--instance",
                &instance,
            ])
            .unwrap();
        assert!(!out.status.success(), "backend add {bad} was applied");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains(why), "{bad}: {err}");
    }
    assert_eq!(listed(&lab), Some(2));

    let run = lab.measure(load_to(vip, 100.0, 1.5));
    lab.report(&run, &format!("runtime VIP: {:?}", run.summary.per_backend));
    assert_eq!(run.summary.error_count(), 0, "{:?}", run.summary);
    let names: Vec<&String> = run.summary.per_backend.keys().collect();
    assert_eq!(names, [&name(0), &name(2)], "{:?}", run.summary);

    // kill -9 and a restart from the same flags: the state file brings it back.
    wait_for("the state file", Duration::from_secs(5), || {
        std::fs::read_dir(lab.state_dir())
            .into_iter()
            .flatten()
            .flatten()
            .any(|e| std::fs::read_to_string(e.path()).is_ok_and(|t| t.contains(&vip_arg)))
    });
    assert!(!lab.stop_balancer(first, Signal::SIGKILL).unwrap().success());
    let second = lab.start(&[0, 1], &extra);
    wait_until_configured(&lab, second);
    let run = lab.measure(load_to(vip, 100.0, 1.5));
    lab.report(
        &run,
        &format!("after kill -9: {:?}", run.summary.per_backend),
    );
    assert_eq!(run.summary.error_count(), 0, "{:?}", run.summary);
    assert_eq!(run.summary.per_backend.len(), 2, "{:?}", run.summary);

    // Removed: new connections find no VIP, the established one finishes.
    let removed_ids: Vec<u32> = lab
        .status()
        .unwrap()
        .vip(&vip.to_string())
        .unwrap()
        .backends
        .iter()
        .map(|b| b.id)
        .collect();
    assert!(
        lab.status()
            .unwrap()
            .vip(&vip.to_string())
            .unwrap()
            .backends
            .iter()
            .all(|b| b.opened > 0),
        "the VIP's backends carried no connections"
    );
    let (mut kept, backend) = kept_connection(&lab, vip);
    let removed = lab.vip_command(&["remove", "--vip", &vip_arg]);
    assert!(removed.contains("removed"), "{removed}");
    assert_eq!(listed(&lab), None, "the removed VIP is still in VIPS");
    thread::sleep(Duration::from_millis(300));
    assert!(
        try_connect(&lab, vip, Duration::from_secs(1)).is_none(),
        "a removed VIP took a new connection"
    );
    let answer = probe::request(&mut kept, "/after-remove", b"", true).unwrap();
    assert_eq!(answer.status, 200);
    assert_eq!(answer.backend.as_deref(), Some(backend.as_str()));
    // The other VIP is untouched.
    let run = lab.measure(lab.load(100.0, 1.0, 2_000));
    assert_eq!(run.summary.error_count(), 0, "{:?}", run.summary);
    // Its id is taken until its last flow is gone; then it is freed and reused.
    let out = lab
        .run_lb_user(&[
            "vip",
            "add",
            "--vip",
            &vip_arg,
            "--backend",
            &be(3),
            "--instance",
            &instance,
        ])
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("still drains"), "{err}");
    drop(kept);
    let (closed, limit) = (Instant::now(), Duration::from_secs(60));
    while !lab
        .stderr(second)
        .contains("removed VIP has no flows left; id freed")
    {
        // What a failure needs to be read where its logs are gone: the
        // sweep's cadence and the balancer's last words.
        if closed.elapsed() > limit {
            let metrics = lab.scrape_metrics().unwrap_or_else(|e| format!("{e:#}"));
            let cadence: Vec<&str> = metrics
                .lines()
                .filter(|l| {
                    ["lb_reconcile", "lb_flow", "lb_backend_connections_active"]
                        .iter()
                        .any(|name| l.starts_with(name))
                })
                .collect();
            let stderr = lab.stderr(second);
            let tail: Vec<&str> = stderr.lines().rev().take(30).collect();
            panic!(
                "the removed VIP's id was not freed within {limit:?} of its last flow's close\n\
                 {cadence:#?}\nlb-user's last lines (newest first):\n{tail:#?}"
            );
        }
        thread::sleep(Duration::from_millis(100));
    }
    eprintln!(
        "FAULT runtime-vip: id freed {:.1} s after the last flow's close",
        closed.elapsed().as_secs_f64()
    );
    let held: Vec<u32> = (0..2).map(|i| removed_ids[i]).collect();
    let again = lab.vip_command(&["add", "--vip", &vip_arg, "--backend", &be(3)]);
    assert!(again.contains("added (VIP id 1)"), "{again}");
    // The new backend takes one of the freed ids, and none of the counters
    // of the backend that held it before.
    let fresh = lab.status().unwrap();
    let fresh = &fresh.vip(&vip.to_string()).unwrap().backends[0];
    assert!(
        held.contains(&fresh.id),
        "id {} not one of {held:?}",
        fresh.id
    );
    assert_eq!(
        (
            fresh.opened,
            fresh.closed,
            fresh.bytes_to_backend,
            fresh.bytes_from_backend
        ),
        (0, 0, 0, 0),
        "a reused id shows its last backend's counters: {fresh:?}"
    );
    let run = lab.measure(load_to(vip, 100.0, 1.0));
    assert_eq!(run.summary.error_count(), 0, "{:?}", run.summary);
    let names: Vec<&String> = run.summary.per_backend.keys().collect();
    assert_eq!(names, [&name(3)], "{:?}", run.summary);
    let served = lab
        .status()
        .unwrap()
        .vip(&vip.to_string())
        .unwrap()
        .backends[0]
        .opened;
    let answered = run.summary.per_backend[&name(3)];
    assert!(
        (1..=answered).contains(&served),
        "{served} connections opened for {answered} answers"
    );
}

/// A SIGHUP that lands while the balancer starts (a supervisor's reload
/// right after it) is answered once it runs. Its default action used to
/// end the process between the attach and the ready mark, which left the
/// program attached and every VIP packet passed to the host.
#[test]
fn a_sighup_during_the_start_is_answered_once_running() {
    require_root!();
    let lab = Fault::new("sighup-start", 1);
    let lb = lab.spawn_balancer(&spec(&lab, &[0], &[])).unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    while !lab.stderr(lb).contains("attached lb_xdp") {
        assert!(
            lab.exit_status(lb).unwrap().is_none(),
            "exited before attaching: {}",
            lab.stderr(lb)
        );
        assert!(
            Instant::now() < deadline,
            "not attached: {}",
            lab.stderr(lb)
        );
        thread::sleep(Duration::from_millis(2));
    }
    lab.signal(lb, Signal::SIGHUP).unwrap();
    wait_for("the reload", Duration::from_secs(10), || {
        assert!(
            lab.exit_status(lb).unwrap().is_none(),
            "a SIGHUP during the start ended lb-user: {}",
            lab.stderr(lb)
        );
        lab.stderr(lb).contains("configuration reloaded")
    });
    wait_until_configured(&lab, lb);
    let run = lab.measure(lab.load(100.0, 1.0, 2_000));
    assert_eq!(run.summary.error_count(), 0, "{:?}", run.summary);
}

/// The config lines that make a VIP of [`write_vips`] a Maglev one.
const MAGLEV: &str = "algorithm = \"maglev\"\n";

/// Eight Maglev VIPs (ports 81 to 88 of the lab's VIP address, every
/// backend), which take every Maglev table, written to a file in the lab's
/// log folder: the file, the VIPs, and a balancer spec that reads it.
fn eight_maglev_vips(lab: &Fault) -> (std::path::PathBuf, Vec<SocketAddr>, BalancerSpec) {
    let path = lab.log_dir().join("vips.toml");
    let vips: Vec<SocketAddr> = (0..8).map(|i| other_vip(lab, 81 + i)).collect();
    write_vips(lab, &path, &vips, MAGLEV);
    let mut base = spec(lab, &[], &["--config", path.to_str().unwrap()]);
    base.vips.clear();
    (path, vips, base)
}

/// After `how` moved the Maglev VIP at `old` to `vips[7]`: the moved VIP
/// serves without an error, the old address takes no new connection, its
/// `kept` connection finishes, and the other seven VIPs serve.
fn assert_maglev_vip_moved(
    lab: &Fault,
    how: &str,
    vips: &[SocketAddr],
    old: SocketAddr,
    kept: &mut TcpStream,
) {
    let run = lab.measure(load_to(vips[7], 100.0, 1.5));
    lab.report(
        &run,
        &format!("Maglev VIP moved by {how}: {:?}", run.summary.per_backend),
    );
    assert_eq!(run.summary.error_count(), 0, "{:?}", run.summary);
    assert!(
        try_connect(lab, old, Duration::from_secs(1)).is_none(),
        "the VIP moved away took a new connection"
    );
    let answer = probe::request(kept, "/", b"", true).unwrap();
    assert_eq!(answer.status, 200, "the old VIP's connection finishes");
    for &vip in &vips[..7] {
        assert_eq!(
            lab.measure(load_to(vip, 50.0, 0.5)).summary.error_count(),
            0
        );
    }
}

/// Writes a configuration file at `path` with one `[[vip]]` per address
/// of `vips`, each with every backend of the lab and the lines `extra`.
fn write_vips(lab: &Fault, path: &std::path::Path, vips: &[SocketAddr], extra: &str) {
    let backends: Vec<String> = lab
        .backends()
        .iter()
        .map(|b| format!("\"{}\"", b.addr()))
        .collect();
    let text: Vec<String> = vips
        .iter()
        .map(|v| {
            format!(
                "[[vip]]\naddress = \"{v}\"\n{extra}backends = [{}]\n",
                backends.join(", ")
            )
        })
        .collect();
    std::fs::write(path, text.join("\n")).unwrap();
}

#[test]
fn sighup_adds_one_vip_and_removes_another_and_says_so() {
    require_root!();
    let lab = Fault::new("sighup-vips", 2);
    let path = lab.log_dir().join("vips.toml");
    let write = |vips: &[SocketAddr]| write_vips(&lab, &path, vips, "");
    let (a, b, c) = (lab.tcp_vip(), other_vip(&lab, 81), other_vip(&lab, 82));
    write(&[a, b]);
    let mut base = spec(&lab, &[], &["--config", path.to_str().unwrap()]);
    base.vips.clear();
    let lb = lab.start_balancer(&base).unwrap();
    assert_eq!(lab.measure(load_to(b, 100.0, 1.0)).summary.error_count(), 0);
    assert!(try_connect(&lab, c, Duration::from_secs(1)).is_none());

    write(&[a, c]);
    lab.signal(lb, Signal::SIGHUP).unwrap();
    wait_for("the reload", Duration::from_secs(10), || {
        lab.stderr(lb).contains("configuration reloaded")
    });
    let log = lab.stderr(lb);
    assert!(
        log.contains(&format!("reload added VIP {c}/tcp (id 2)")),
        "{log}"
    );
    assert!(
        log.contains(&format!("reload removed VIP {b}/tcp: draining")),
        "{log}"
    );
    assert!(!log.contains("needs a restart"), "{log}");
    let run = lab.measure(load_to(c, 100.0, 1.5));
    lab.report(
        &run,
        &format!("VIP added by SIGHUP: {:?}", run.summary.per_backend),
    );
    assert_eq!(run.summary.error_count(), 0, "{:?}", run.summary);
    assert_eq!(run.summary.per_backend.len(), 2, "{:?}", run.summary);
    assert!(
        try_connect(&lab, b, Duration::from_secs(1)).is_none(),
        "the VIP removed by SIGHUP took a new connection"
    );
    assert_eq!(lab.measure(load_to(a, 100.0, 1.0)).summary.error_count(), 0);
}

/// Eight Maglev VIPs take every Maglev table. A SIGHUP moves one to
/// another port while a connection keeps the old one draining: the new
/// VIP serves with the old one's table (no program reads it once the VIP
/// left VIPS), where it was refused for want of a table, and the old VIP
/// was gone all the same. The old VIP's connection still finishes. Its
/// backends were drained before the move.
#[test]
fn sighup_moves_a_maglev_vip_while_every_maglev_table_is_taken() {
    require_root!();
    let lab = Fault::new("sighup-maglev", 2);
    let (path, mut vips, base) = eight_maglev_vips(&lab);
    let lb = lab.start_balancer(&base).unwrap();
    let old = vips[7];
    let (mut kept, _) = kept_connection(&lab, old);
    // Its backends drained first: the removal then changes nothing the
    // publisher compares (no slots, the same entries), and still takes the
    // VIP out of VIPS (it stayed there, and the new VIP waited for its
    // table until the kept connection ended).
    for b in lab.backends() {
        let (vip, backend) = (old.to_string(), b.addr().to_string());
        lab.backend_command(&["drain", "--vip", &vip, "--backend", &backend]);
    }
    let moved = other_vip(&lab, 8081);
    assert!(try_connect(&lab, moved, Duration::from_secs(1)).is_none());

    vips[7] = moved;
    write_vips(&lab, &path, &vips, MAGLEV);
    lab.signal(lb, Signal::SIGHUP).unwrap();
    wait_for("the reload", Duration::from_secs(10), || {
        lab.stderr(lb).contains("configuration reloaded")
    });
    let log = lab.stderr(lb);
    assert!(
        log.contains(&format!("reload added VIP {moved}/tcp")),
        "{log}"
    );
    assert!(!log.contains("no free Maglev table"), "{log}");
    // The table is handed on after its grace, at a score tick.
    wait_for("the moved VIP", Duration::from_secs(5), || {
        try_connect(&lab, moved, Duration::from_secs(1)).is_some()
    });
    assert_maglev_vip_moved(&lab, "SIGHUP", &vips, old, &mut kept);
}
