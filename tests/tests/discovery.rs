//! Discovery from a real etcd: the lab starts etcd in its client namespace
//! (on the lab subnet only), backends are put under a prefix (by etcdctl or
//! by `lb-user register` sidecars in their own namespaces), and the
//! balancer follows them. Every test runs under open-loop load (a new
//! connection per request) and prints a `DISCOVERY <name>:` line with the
//! load and what was lost.
//!
//! Needs root and etcd (`cargo xtask test` installs it). Run with
//! `cargo test -p lb-tests --test discovery -- --test-threads=1 --nocapture`.

use std::{
    net::SocketAddr,
    os::unix::process::CommandExt as _,
    process::{Command, Output},
    thread,
    time::{Duration, Instant},
};

use lb_lab::{
    Binaries, Lab,
    lab::{
        Algorithm, BackendSpec, BalancerSpec, ProcessId, Protocol as VipProtocol, VipSpec, metric,
    },
    loadgen::{LoadConfig, Protocol, Summary},
    require_root,
    status::Status,
};
use nix::sys::signal::Signal;

const PREFIX: &str = "/lb/web/";

// The lab and its etcd.

/// A lab with `backends` servers and no etcd.
fn bare_lab(backends: usize) -> Lab {
    Lab::builder(Binaries::for_tests())
        .backends(backends, BackendSpec::new(2, 8))
        .build()
        .unwrap()
}

/// A lab with `backends` servers and a running etcd (its process id).
fn lab(backends: usize) -> (Lab, ProcessId) {
    let lab = bare_lab(backends);
    let etcd = lab
        .start_etcd()
        .expect("etcd must start (it is part of the lab)");
    (lab, etcd)
}

/// Kills etcd with SIGKILL and waits (up to 5 s) until it has exited.
fn kill_etcd(lab: &Lab, etcd: ProcessId) {
    lab.signal(etcd, Signal::SIGKILL).unwrap();
    lab.wait(etcd, Duration::from_secs(5)).unwrap();
}

// Keys under `PREFIX`.

/// The address of backend `index`, as keys and the status spell it.
fn addr(lab: &Lab, index: usize) -> String {
    lab.backends()[index].addr().to_string()
}

/// The etcd key of backend `index`.
fn key(lab: &Lab, index: usize) -> String {
    format!("{PREFIX}{}", addr(lab, index))
}

fn value(addr: &str, weight: u32) -> String {
    format!(r#"{{"addr":"{addr}","weight":{weight},"zone":"z1","note":"ignored"}}"#)
}

/// Puts backend `index` with `weight` through etcdctl with `flags` (a
/// user, TLS files) against the etcd at `url`.
fn put_with(lab: &Lab, url: &str, flags: &[&str], index: usize, weight: u32) {
    let args = ["put", &key(lab, index), &value(&addr(lab, index), weight)];
    lab.etcdctl_with(url, flags, &args).unwrap();
}

/// Puts backend `index` with `weight` in the lab's etcd.
fn put(lab: &Lab, index: usize, weight: u32) {
    put_with(lab, &lab.etcd_url(), &[], index, weight);
}

/// Puts backends 0, 1, … in order, backend `i` with `weights[i]`.
fn put_weights(lab: &Lab, weights: &[u32]) {
    for (index, &weight) in weights.iter().enumerate() {
        put(lab, index, weight);
    }
}

/// Whether the lab's etcd holds backend `index`'s key.
fn registered(lab: &Lab, index: usize) -> bool {
    lab.etcdctl(&["get", "--keys-only", &key(lab, index)])
        .is_ok_and(|out| out.contains(&addr(lab, index)))
}

/// How many keys are under `PREFIX` (0 while etcd does not answer).
fn key_count(lab: &Lab) -> usize {
    lab.etcdctl(&["get", "--prefix", "--keys-only", PREFIX])
        .map(|out| out.lines().filter(|l| !l.is_empty()).count())
        .unwrap_or(0)
}

// The balancer.

/// The TCP VIP fed from `PREFIX`, with `extra` flags.
fn start(lab: &Lab, algorithm: Algorithm, extra: &[&str]) -> ProcessId {
    lab.start_balancer(&spec(lab, &lab.etcd_url(), algorithm, extra))
        .unwrap()
}

/// The balancer of [`start`], reaching etcd at `url`.
fn spec(lab: &Lab, url: &str, algorithm: Algorithm, extra: &[&str]) -> BalancerSpec {
    let state = lab.log_dir().join("state");
    let mut args = vec![
        "--etcd-endpoints",
        url,
        "--etcd-prefix",
        PREFIX,
        "--state-dir",
        state.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    BalancerSpec::one_vip(
        VipSpec::new(lab.tcp_vip(), VipProtocol::Tcp, Vec::new()),
        algorithm,
        &args,
    )
}

/// The error (in full, `{:#}`) of a P2C-EWMA balancer start against `url`
/// with `flags` that must fail; a panic naming `case` if it starts.
fn refused_start(lab: &Lab, url: &str, flags: &[&str], case: &str) -> String {
    let error = lab
        .start_balancer(&spec(lab, url, Algorithm::P2cEwma, flags))
        .map(|_| ())
        .expect_err(case);
    format!("{error:#}")
}

/// `lb-user backend COMMAND --vip <TCP VIP> --backend <backend index>
/// EXTRA...`: an operator's weight, drain or undrain.
fn operator(lab: &Lab, command: &str, index: usize, extra: &[&str]) {
    let vip = lab.tcp_vip().to_string();
    let backend = addr(lab, index);
    let mut args = vec![command, "--vip", &vip, "--backend", &backend];
    args.extend_from_slice(extra);
    lab.backend_command(&args);
}

/// `lb_discovery_updates_total` for `result` in a metrics scrape.
fn updates(metrics: &str, result: &str) -> f64 {
    metric(
        metrics,
        &format!("lb_discovery_updates_total{{result=\"{result}\"}}"),
    )
}

// The balancer's status.

/// (address, weight, opened, state) of the TCP VIP's backends.
fn members(lab: &Lab) -> Vec<(String, f64, u64, String)> {
    let status: Status = lab.status().unwrap();
    status
        .vip(&lab.tcp_vip().to_string())
        .map(|v| {
            v.backends
                .iter()
                .map(|b| (b.address.clone(), b.weight, b.opened, b.state.clone()))
                .collect()
        })
        .unwrap_or_default()
}

/// The [`members`] row of backend `index`, if the VIP has it.
fn member(lab: &Lab, index: usize) -> Option<(String, f64, u64, String)> {
    let addr = addr(lab, index);
    members(lab).into_iter().find(|m| m.0 == addr)
}

/// The sorted addresses of the TCP VIP's active backends.
fn active(lab: &Lab) -> Vec<String> {
    let mut a: Vec<String> = members(lab)
        .into_iter()
        .filter(|m| m.3 == "active")
        .map(|m| m.0)
        .collect();
    a.sort();
    a
}

/// The sorted addresses of the backends `indexes`.
fn addrs(lab: &Lab, indexes: &[usize]) -> Vec<String> {
    let mut a: Vec<String> = indexes.iter().map(|&i| addr(lab, i)).collect();
    a.sort();
    a
}

/// Whether the active backends are exactly the backends `indexes`.
fn active_are(lab: &Lab, indexes: &[usize]) -> bool {
    active(lab) == addrs(lab, indexes)
}

/// Asserts that the active backends are exactly the backends `indexes`;
/// `why` says what that shows.
#[track_caller]
fn assert_active(lab: &Lab, indexes: &[usize], why: &str) {
    assert_eq!(active(lab), addrs(lab, indexes), "{why}");
}

/// Connections backend `index` has taken (0 when the VIP lacks it).
fn opened(lab: &Lab, index: usize) -> u64 {
    member(lab, index).map_or(0, |m| m.2)
}

/// The weight the balancer has for backend `index` (0 when the VIP lacks it).
fn configured_weight(lab: &Lab, index: usize) -> f64 {
    member(lab, index).map_or(0.0, |m| m.1)
}

/// Whether backend `index`'s configured weight is `weight` (within 0.01).
fn has_weight(lab: &Lab, index: usize, weight: f64) -> bool {
    (configured_weight(lab, index) - weight).abs() < 0.01
}

/// Polls `check` every 50 ms until it holds; the time it took, or a panic
/// naming `what` after `limit`.
fn wait_for(what: &str, limit: Duration, mut check: impl FnMut() -> bool) -> Duration {
    let started = Instant::now();
    while !check() {
        assert!(started.elapsed() < limit, "{what}: not within {limit:?}");
        thread::sleep(Duration::from_millis(50));
    }
    started.elapsed()
}

/// [`wait_for`] the active backends to be exactly the backends `indexes`.
fn wait_active(lab: &Lab, what: &str, limit: Duration, indexes: &[usize]) -> Duration {
    wait_for(what, limit, || active_are(lab, indexes))
}

// The load.

/// Open-loop TCP load on the VIP: `rate` req/s for `seconds` s.
fn load(lab: &Lab, rate: f64, seconds: f64) -> LoadConfig {
    LoadConfig::open_loop(lab.tcp_vip(), Protocol::Tcp, rate, seconds).with_timeout_ms(2000)
}

fn report(name: &str, config: &LoadConfig, summary: &Summary, extra: &str) {
    eprintln!(
        "DISCOVERY {name}: load {} req/s × {} s ({} scheduled, new connection each), completed {}, failed {} {:?}; {extra}",
        config.rate,
        config.duration_s,
        summary.scheduled,
        summary.completed,
        summary.error_count(),
        summary.errors
    );
}

/// A [`load`] running in the background.
struct Load {
    config: LoadConfig,
    process: ProcessId,
}

impl Load {
    /// Starts a [`load`] of `rate` req/s for `seconds` s in the background.
    fn start(lab: &Lab, rate: f64, seconds: f64) -> Self {
        let config = load(lab, rate, seconds);
        let process = lab.spawn_loadgen(&config).unwrap();
        Self { config, process }
    }

    /// [`Load::start`], then lets the load run for a second.
    fn start_and_wait_1s(lab: &Lab, rate: f64, seconds: f64) -> Self {
        let load = Self::start(lab, rate, seconds);
        thread::sleep(Duration::from_secs(1));
        load
    }

    /// Waits for the end of the run, prints its `DISCOVERY name:` line
    /// (ending in `extra`) and returns its summary.
    fn finish(&self, lab: &Lab, name: &str, extra: &str) -> Summary {
        let summary = lab.loadgen_summary(self.process, &self.config).unwrap();
        report(name, &self.config, &summary, extra);
        summary
    }
}

/// Runs a [`load`] of `rate` req/s for `seconds` s to its end, prints its
/// `DISCOVERY name:` line (ending in `extra`) and returns its summary.
fn run_load(lab: &Lab, rate: f64, seconds: f64, name: &str, extra: &str) -> Summary {
    let config = load(lab, rate, seconds);
    let summary = lab.run_loadgen(&config).unwrap();
    report(name, &config, &summary, extra);
    summary
}

/// Asserts that no request of the run failed.
#[track_caller]
fn assert_nothing_lost(summary: &Summary) {
    assert_eq!(summary.error_count(), 0, "{:?}", summary.errors);
}

#[test]
fn etcd_killed_and_restarted_loses_nothing_and_the_watch_resumes() {
    require_root!();
    let (lab, etcd) = lab(3);
    put_weights(&lab, &[1, 1]);
    start(&lab, Algorithm::P2cEwma, &[]);
    assert_active(&lab, &[0, 1], "the backends put before the start");
    let load = Load::start_and_wait_1s(&lab, 100.0, 10.0);
    kill_etcd(&lab, etcd);
    thread::sleep(Duration::from_secs(3));
    assert_active(&lab, &[0, 1], "losing etcd removes nothing (fail static)");
    lab.start_etcd().unwrap();
    put(&lab, 2, 1);
    let took = wait_active(
        &lab,
        "the restarted watch sees a new backend",
        Duration::from_secs(5),
        &[0, 1, 2],
    );
    let summary = load.finish(
        &lab,
        "etcd_restart",
        &format!("etcd down 3 s; a backend put after the restart was active {took:?} later"),
    );
    assert_nothing_lost(&summary);
    assert!(opened(&lab, 2) > 0, "the new backend took connections");
}

#[test]
fn a_compacted_revision_is_read_again_and_the_difference_applied() {
    require_root!();
    let (lab, etcd) = lab(3);
    put_weights(&lab, &[1, 1]);
    start(&lab, Algorithm::P2cEwma, &["--slow-start", "0s"]);
    let load = Load::start_and_wait_1s(&lab, 100.0, 10.0);
    // etcd comes back where the balancer cannot reach it; meanwhile one
    // backend joins, one changes weight, one leaves, and the history is
    // compacted past the balancer's revision.
    kill_etcd(&lab, etcd);
    let hidden = lab.start_etcd_hidden().unwrap();
    let local = format!("http://127.0.0.1:{}", lb_lab::lab::ETCD_CLIENT_PORT);
    put_with(&lab, &local, &[], 2, 1);
    put_with(&lab, &local, &[], 0, 4);
    lab.etcdctl_at(&local, &["del", &key(&lab, 1)]).unwrap();
    let revision = lab
        .etcdctl_at(&local, &["get", PREFIX, "--prefix", "-w", "json"])
        .ok()
        .and_then(|j| serde_json::from_str::<serde_json::Value>(&j).ok())
        .and_then(|v| v["header"]["revision"].as_i64())
        .unwrap();
    lab.etcdctl_at(&local, &["compact", &revision.to_string()])
        .unwrap();
    assert_active(&lab, &[0, 1], "cut off, the balancer keeps what it knew");
    lab.signal(hidden, Signal::SIGTERM).unwrap();
    lab.wait(hidden, Duration::from_secs(10)).unwrap();
    lab.start_etcd().unwrap();
    let healed = wait_for("the difference is applied", Duration::from_secs(6), || {
        active_are(&lab, &[0, 2]) && has_weight(&lab, 0, 4.0)
    });
    let metrics = lab.scrape_metrics().unwrap();
    assert!(updates(&metrics, "resync") >= 1.0);
    let summary = load.finish(
        &lab,
        "compaction",
        &format!(
            "3 changes made and compacted (revision {revision}) while etcd was out of reach; applied {healed:?} after it came back"
        ),
    );
    assert_nothing_lost(&summary);
}

#[test]
fn a_restart_while_etcd_is_down_serves_the_cached_backends() {
    require_root!();
    let (lab, etcd) = lab(2);
    // Weights 1 and 2: the test asks whether both cached backends serve.
    // With 1 and 3 the first one's cost (latency ÷ weight) sat at the
    // re-draw bound (3× the pool's median), and a run where the control
    // plane held it far above sent it none of 300 light-load flows.
    put_weights(&lab, &[1, 2]);
    let first = start(&lab, Algorithm::P2cEwma, &[]);
    lab.stop_balancer(first, Signal::SIGTERM).unwrap();
    kill_etcd(&lab, etcd);
    start(&lab, Algorithm::P2cEwma, &[]);
    assert_active(&lab, &[0, 1], "the backends of the cache");
    let summary = run_load(
        &lab,
        100.0,
        3.0,
        "cache",
        "etcd down during the whole run; backends from the cache",
    );
    assert_nothing_lost(&summary);
    assert!(opened(&lab, 0) > 0 && opened(&lab, 1) > 0);
}

/// A lab of two backends in etcd (weights 1 and 2) whose balancer ran,
/// cached both, and stopped cleanly; etcd still runs.
fn cached_after_a_clean_stop() -> Lab {
    let (lab, _etcd) = lab(2);
    put_weights(&lab, &[1, 2]);
    let first = start(&lab, Algorithm::P2cEwma, &[]);
    assert_active(&lab, &[0, 1], "both keys' backends");
    lab.stop_balancer(first, Signal::SIGTERM).unwrap();
    lab
}

/// Fail static at the start too: etcd answers, but holds no backend
/// under the prefix (its keys deleted while no balancer ran, as an outage
/// that outlived their leases leaves it). A restart with the backends
/// cached starts from them, and says so, rather than refusing to start;
/// its watch then applies the empty prefix as a running balancer would
/// (one update removes at most `--max-removal-percent`, 50 %, and never
/// the last backend).
#[test]
fn a_restart_when_etcd_holds_no_backend_serves_the_cached_ones() {
    require_root!();
    let lab = cached_after_a_clean_stop();
    lab.etcdctl(&["del", "--prefix", PREFIX]).unwrap();
    assert_eq!(key_count(&lab), 0);
    let second = start(&lab, Algorithm::P2cEwma, &[]);
    let log = lab.stderr(second);
    assert!(
        log.contains("serving the cached backends (fail static)"),
        "{log}"
    );
    wait_for(
        "the watch applies the empty prefix under the removal cap",
        Duration::from_secs(5),
        || active(&lab).len() == 1,
    );
    thread::sleep(Duration::from_millis(800));
    assert_eq!(active(&lab).len(), 1, "never the last backend");
    let summary = run_load(
        &lab,
        100.0,
        2.0,
        "empty_prefix",
        "etcd up with nothing under the prefix; backends from the cache",
    );
    assert_nothing_lost(&summary);
    // A backend registered again is taken in as usual.
    put(&lab, 0, 1);
    thread::sleep(Duration::from_millis(800));
    assert!(member(&lab, 0).is_some());
}

/// An operator's drain and weight on discovered backends hold across a
/// restart even when etcd's membership changed meanwhile (the runtime
/// state's entries name the VIP's prefix, not the members as they were).
#[test]
fn operator_overrides_on_discovered_backends_survive_a_restart_with_another_membership() {
    require_root!();
    let (lab, _etcd) = lab(3);
    put_weights(&lab, &[1, 1]);
    let first = start(&lab, Algorithm::P2cEwma, &["--slow-start", "0s"]);
    // Backend 2 joins after the start; the operator drains it, and weights 1.
    put(&lab, 2, 1);
    wait_for("backend 2 joins", Duration::from_secs(2), || {
        member(&lab, 2).is_some()
    });
    operator(&lab, "drain", 2, &[]);
    operator(&lab, "weight", 1, &["--weight", "3"]);
    lab.stop_balancer(first, Signal::SIGTERM).unwrap();
    // While it is down etcd's view moves: backend 1's weight changes.
    put(&lab, 1, 2);
    start(&lab, Algorithm::P2cEwma, &["--slow-start", "0s"]);
    assert_active(&lab, &[0, 1], "backend 2 stays drained");
    assert!(has_weight(&lab, 1, 3.0), "{:?}", member(&lab, 1));
    // The next etcd update does not put etcd's weight back either.
    put(&lab, 0, 2);
    thread::sleep(Duration::from_millis(800));
    assert!(has_weight(&lab, 0, 2.0), "{:?}", member(&lab, 0));
    assert!(
        has_weight(&lab, 1, 3.0),
        "the operator's weight holds: {:?}",
        member(&lab, 1)
    );
    assert_active(&lab, &[0, 1], "backend 2 stays drained");
    // Backends 2 and 1 leave etcd and come back: the kept drain and weight
    // are laid over them again, as at a restart.
    // (A removed member drains its flows: `status` shows it draining.)
    lab.etcdctl(&["del", &key(&lab, 2)]).unwrap();
    lab.etcdctl(&["del", &key(&lab, 1)]).unwrap();
    wait_for("both leave", Duration::from_secs(3), || {
        active_are(&lab, &[0])
    });
    put(&lab, 2, 1);
    put(&lab, 1, 2);
    wait_for("backend 1 comes back", Duration::from_secs(3), || {
        active(&lab).contains(&addr(&lab, 1))
    });
    thread::sleep(Duration::from_millis(800));
    assert_active(&lab, &[0, 1], "backend 2 comes back drained");
    assert!(has_weight(&lab, 1, 3.0), "{:?}", member(&lab, 1));
}

#[test]
fn a_restart_while_etcd_holds_a_bad_value_keeps_the_keys_cached_value() {
    require_root!();
    let lab = cached_after_a_clean_stop();
    // While no balancer runs, backend 1's key gets a value that breaks the
    // rules. A balancer that watched the write would keep the last good
    // value; one that starts now has it only from its cache.
    let b1 = addr(&lab, 1);
    let bad = format!(r#"{{"addr":"{b1}","weight":70000}}"#);
    lab.etcdctl(&["put", &key(&lab, 1), &bad]).unwrap();
    start(&lab, Algorithm::P2cEwma, &[]);
    assert_active(&lab, &[0, 1], "backend 1 keeps its cached value");
    let weight1 = configured_weight(&lab, 1);
    assert!(
        (weight1 - 2.0).abs() < 0.01,
        "backend 1 keeps its cached weight: {weight1}"
    );
    let metrics = lab.scrape_metrics().unwrap();
    assert!(
        updates(&metrics, "invalid") >= 1.0,
        "the bad value is counted"
    );
}

/// Starts `lb-user register` for backend `index` in its namespace, with
/// lease `ttl` and, if `check`, an HTTP check of the backend itself.
fn spawn_sidecar(lab: &Lab, index: usize, ttl: &str, check: bool) -> ProcessId {
    let lb_user = lab.binaries().lb_user().unwrap().display().to_string();
    let url = lab.etcd_url();
    let addr = addr(lab, index);
    let check_url = format!("http://{addr}/");
    let mut argv = vec![
        lb_user.as_str(),
        "register",
        "--etcd-endpoints",
        &url,
        "--prefix",
        PREFIX,
        "--addr",
        &addr,
        "--ttl",
        ttl,
    ];
    if check {
        argv.extend(["--check-http", &check_url]);
    }
    lab.spawn(&lab.backends()[index].host.ns, "register", &argv)
        .unwrap()
}

#[test]
fn a_lease_expiry_drains_the_backend_and_sigterm_revokes_at_once() {
    require_root!();
    let (lab, _etcd) = lab(3);
    let sidecars: Vec<ProcessId> = (0..3).map(|i| spawn_sidecar(&lab, i, "2s", true)).collect();
    wait_for("three sidecars registered", Duration::from_secs(10), || {
        key_count(&lab) == 3
    });
    start(&lab, Algorithm::P2cEwma, &[]);
    assert_active(&lab, &[0, 1, 2], "the three registered backends");
    let load = Load::start_and_wait_1s(&lab, 100.0, 9.0);
    // A dead sidecar: its lease expires within the ttl.
    lab.signal(sidecars[2], Signal::SIGKILL).unwrap();
    let expiry = wait_for("the lease expired", Duration::from_secs(6), || {
        key_count(&lab) == 2
    });
    thread::sleep(Duration::from_secs(1));
    let after_expiry = opened(&lab, 2);
    // A stopped sidecar revokes its lease at once.
    let stopped = Instant::now();
    lab.signal(sidecars[1], Signal::SIGTERM).unwrap();
    let revoked = wait_for("the lease revoked", Duration::from_secs(2), || {
        key_count(&lab) == 1
    });
    lab.wait(sidecars[1], Duration::from_secs(5)).unwrap();
    wait_active(&lab, "backend 2 drained", Duration::from_secs(2), &[0]);
    let drained_in = stopped.elapsed();
    thread::sleep(Duration::from_secs(1));
    let after_revoke = opened(&lab, 1);
    let summary = load.finish(
        &lab,
        "lease",
        &format!(
            "killed sidecar's key gone {expiry:?} after the kill (ttl 2 s); SIGTERM'd sidecar's key gone in {revoked:?}, drained in {drained_in:?}"
        ),
    );
    assert_eq!(
        opened(&lab, 2),
        after_expiry,
        "no new connection 1 s after the expiry"
    );
    assert_eq!(
        opened(&lab, 1),
        after_revoke,
        "no new connection 1 s after the revoke"
    );
    // The backends stay up, so their in-flight requests finish: nothing lost.
    assert_nothing_lost(&summary);
}

#[test]
fn a_failing_http_check_deregisters_and_a_passing_one_registers_again() {
    require_root!();
    let (lab, _etcd) = lab(2);
    put(&lab, 0, 1);
    spawn_sidecar(&lab, 1, "3s", true);
    wait_for(
        "registered while the check passes",
        Duration::from_secs(10),
        || registered(&lab, 1),
    );
    start(&lab, Algorithm::P2cEwma, &["--slow-start", "0s"]);
    assert_active(&lab, &[0, 1], "the backend put and the one registered");
    let load = Load::start_and_wait_1s(&lab, 50.0, 12.0);
    // A frozen server fails its check (no answer within the check timeout).
    let server = lab.backends()[1].process;
    lab.signal(server, Signal::SIGSTOP).unwrap();
    let gone = wait_for(
        "deregistered while the check fails",
        Duration::from_secs(5),
        || !registered(&lab, 1),
    );
    wait_active(&lab, "drained", Duration::from_secs(2), &[0]);
    thread::sleep(Duration::from_secs(2));
    lab.signal(server, Signal::SIGCONT).unwrap();
    let back = wait_for(
        "registered again once it passes",
        Duration::from_secs(5),
        || registered(&lab, 1),
    );
    wait_active(&lab, "active again", Duration::from_secs(2), &[0, 1]);
    let summary = load.finish(
        &lab,
        "check_http",
        &format!(
            "backend frozen (SIGSTOP): deregistered {gone:?} later; thawed: registered again {back:?} later; \
             the requests it held while frozen are the ones lost"
        ),
    );
    // Only what went to the frozen server before its key was deleted may
    // be lost: at most the load of the detection window.
    assert!(
        (summary.error_count() as f64) <= load.config.rate * (gone.as_secs_f64() + 1.0),
        "{:?}",
        summary.errors
    );
}

#[test]
fn a_sidecar_outlives_an_etcd_outage_longer_than_its_ttl() {
    require_root!();
    let (lab, etcd) = lab(2);
    put(&lab, 0, 1);
    spawn_sidecar(&lab, 1, "2s", false);
    wait_for("registered", Duration::from_secs(10), || {
        registered(&lab, 1)
    });
    start(&lab, Algorithm::P2cEwma, &[]);
    let load = Load::start_and_wait_1s(&lab, 100.0, 14.0);
    kill_etcd(&lab, etcd);
    thread::sleep(Duration::from_secs(5));
    assert_active(&lab, &[0, 1], "fail static meanwhile");
    lab.start_etcd().unwrap();
    let back = wait_for("registered again", Duration::from_secs(6), || {
        registered(&lab, 1)
    });
    // Well past the ttl of any lease from before the outage, the key stays:
    // the sidecar keeps its (new) lease alive.
    thread::sleep(Duration::from_secs(5));
    assert!(registered(&lab, 1), "the key outlives the old lease");
    assert_active(&lab, &[0, 1], "both serve after the outage");
    let summary = load.finish(
        &lab,
        "sidecar_outage",
        &format!(
            "etcd down 5 s (ttl 2 s); the key was there {back:?} after etcd came back and 5 s later"
        ),
    );
    assert_nothing_lost(&summary);
}

#[test]
fn weight_changes_reach_the_kernel_shares_within_the_smoothing_window() {
    require_root!();
    let (lab, _etcd) = lab(2);
    put_weights(&lab, &[1, 1]);
    start(
        &lab,
        Algorithm::WeightedRoundRobin,
        &["--weight-smoothing", "1s", "--slow-start", "0s"],
    );
    let load = Load::start_and_wait_1s(&lab, 200.0, 6.0);
    put(&lab, 1, 4);
    let changed = Instant::now();
    let reached = wait_for(
        "the new weight is in the kernel",
        Duration::from_secs(3),
        || has_weight(&lab, 1, 4.0),
    );
    assert!(
        changed.elapsed() >= Duration::from_millis(900),
        "the weight ramps over the smoothing window, not at once"
    );
    let (a0, a1) = (opened(&lab, 0), opened(&lab, 1));
    thread::sleep(Duration::from_secs(2));
    let (d0, d1) = (opened(&lab, 0) - a0, opened(&lab, 1) - a1);
    let share = d1 as f64 / (d0 + d1).max(1) as f64;
    let summary = load.finish(
        &lab,
        "weights",
        &format!(
            "weight 1→4 with 1 s smoothing reached after {reached:?}; share after it {share:.3} (want 0.8)"
        ),
    );
    assert!((share - 0.8).abs() < 0.08, "share {share}");
    assert_nothing_lost(&summary);
}

#[test]
fn an_operator_override_wins_over_etcd_until_it_is_cleared() {
    require_root!();
    let (lab, _etcd) = lab(2);
    put_weights(&lab, &[1, 1]);
    start(&lab, Algorithm::P2cEwma, &["--slow-start", "0s"]);
    let load = Load::start(&lab, 100.0, 6.0);
    operator(&lab, "weight", 1, &["--weight", "3"]);
    put(&lab, 1, 9);
    thread::sleep(Duration::from_millis(800));
    assert!(
        has_weight(&lab, 1, 3.0),
        "the operator's weight holds against etcd's"
    );
    operator(&lab, "drain", 0, &[]);
    put(&lab, 0, 2);
    thread::sleep(Duration::from_millis(800));
    assert_active(&lab, &[1], "an etcd write never undrains");
    // undrain clears the overrides: etcd's weights apply from its next update.
    operator(&lab, "undrain", 0, &[]);
    operator(&lab, "undrain", 1, &[]);
    put(&lab, 1, 5);
    wait_for(
        "etcd's weight applies again",
        Duration::from_secs(2),
        || has_weight(&lab, 1, 5.0),
    );
    assert_active(&lab, &[0, 1], "both active once undrained");
    let summary = load.finish(
        &lab,
        "override",
        "operator weight and drain held against etcd writes; cleared by undrain",
    );
    assert_nothing_lost(&summary);
}

#[test]
fn bad_values_are_skipped_and_a_deleted_prefix_never_empties_the_pool() {
    require_root!();
    let (lab, _etcd) = lab(3);
    put_weights(&lab, &[1, 2, 1]);
    start(&lab, Algorithm::P2cEwma, &["--max-removal-percent", "50"]);
    let load = Load::start(&lab, 100.0, 6.0);
    let b1 = addr(&lab, 1);
    for (bad_key, bad) in [
        (format!("{PREFIX}junk"), "not json".to_string()),
        (
            format!("{PREFIX}w0"),
            r#"{"addr":"10.213.0.50:80","weight":0}"#.to_string(),
        ),
        (
            format!("{PREFIX}noport"),
            r#"{"addr":"10.213.0.50"}"#.to_string(),
        ),
        (key(&lab, 1), format!(r#"{{"addr":"{b1}","weight":70000}}"#)),
    ] {
        lab.etcdctl(&["put", &bad_key, &bad]).unwrap();
    }
    thread::sleep(Duration::from_millis(800));
    assert_active(&lab, &[0, 1, 2], "bad values change nothing");
    let weight1 = configured_weight(&lab, 1);
    assert!(
        (weight1 - 2.0).abs() < 0.01,
        "b1 keeps its last good weight: {weight1}"
    );
    lab.etcdctl(&["del", "--prefix", PREFIX]).unwrap();
    thread::sleep(Duration::from_millis(800));
    let left = active(&lab);
    assert_eq!(
        left.len(),
        2,
        "one update removes at most 50% of 3 (1): {left:?}"
    );
    let metrics = lab.scrape_metrics().unwrap();
    assert!(updates(&metrics, "invalid") >= 4.0);
    assert!(updates(&metrics, "applied") >= 1.0);
    assert_eq!(metric(&metrics, "lb_discovery_connected "), 1.0);
    assert!(metric(&metrics, "lb_discovery_revision ") >= 8.0);
    let age = metric(&metrics, "lb_discovery_last_update_age_seconds ");
    assert!((0.0..5.0).contains(&age), "{age}");
    let summary = load.finish(
        &lab,
        "bad_values",
        &format!(
            "4 bad values skipped; prefix deleted, {} of 3 still serving",
            left.len()
        ),
    );
    assert_nothing_lost(&summary);
}

#[test]
fn a_thousand_backends_registered_at_once_converge_within_two_seconds() {
    require_root!();
    let (lab, _etcd) = lab(2);
    put_weights(&lab, &[1, 1]);
    // A second VIP gets the thousand (addresses off the lab subnet, never
    // sent traffic); the first one carries the load meanwhile.
    let big_vip: SocketAddr = "10.213.0.100:81".parse().unwrap();
    let config_file = lab.log_dir().join("big.toml");
    std::fs::write(
        &config_file,
        format!("[[vip]]\naddress = \"{big_vip}\"\netcd_prefix = \"/lb/big/\"\n"),
    )
    .unwrap();
    put_many(&lab, "/lb/big/", 0..1);
    start(
        &lab,
        Algorithm::P2cEwma,
        &["--config", config_file.to_str().unwrap()],
    );
    let load = Load::start_and_wait_1s(&lab, 100.0, 6.0);
    let big = |lab: &Lab| {
        lab.status()
            .ok()
            .and_then(|s| s.vip(&big_vip.to_string()).map(|v| v.backends.len()))
            .unwrap_or(0)
    };
    put_many(&lab, "/lb/big/", 1..1000);
    let last_put = Instant::now();
    // The time counts to the start of the status read that saw all of them
    // (reading 1,000 backends' maps takes a while itself).
    let took = loop {
        let asked = last_put.elapsed();
        if big(&lab) == 1000 {
            break asked;
        }
        assert!(
            last_put.elapsed() < Duration::from_secs(10),
            "1,000 backends never converged"
        );
        thread::sleep(Duration::from_millis(50));
    };
    assert!(
        took <= Duration::from_secs(2),
        "converged only {took:?} after the last put"
    );
    let summary = load.finish(
        &lab,
        "thousand",
        &format!(
            "999 keys put at once (1 before); all 1,000 in the kernel {took:?} after the last put"
        ),
    );
    assert_nothing_lost(&summary);
}

/// Puts keys for backends 10.214.x.y:80 (`range` numbers them) at once,
/// 100 at a time, from inside the client namespace.
fn put_many(lab: &Lab, prefix: &str, range: std::ops::Range<u32>) {
    let url = lab.etcd_url();
    let prefix = prefix.to_string();
    lab.in_ns(&lab.client().ns, move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(async move {
            let client = etcd_client::Client::connect([url.as_str()], None).await?;
            let numbers: Vec<u32> = range.collect();
            for chunk in numbers.chunks(100) {
                let mut puts = Vec::new();
                for &n in chunk {
                    let mut c = client.clone();
                    let addr = format!("10.214.{}.{}:80", n / 250, n % 250 + 1);
                    let key = format!("{prefix}{addr}");
                    let v = format!(r#"{{"addr":"{addr}"}}"#);
                    puts.push(tokio::spawn(async move { c.put(key, v, None).await }));
                }
                for p in puts {
                    p.await??;
                }
            }
            Ok::<(), anyhow::Error>(())
        })
    })
    .unwrap();
}

/// `lb-user register --etcd-endpoints ENDPOINT --prefix /p/ --addr
/// 10.0.0.1:80 EXTRA...`.
fn register_args(endpoint: &'static str, extra: &[&'static str]) -> Vec<&'static str> {
    let mut args = vec![
        "register",
        "--etcd-endpoints",
        endpoint,
        "--prefix",
        "/p/",
        "--addr",
        "10.0.0.1:80",
    ];
    args.extend_from_slice(extra);
    args
}

/// How long one bad-input case may run: lb-user refuses it before it
/// touches the network or the kernel, well within a second.
const BAD_INPUT_DEADLINE: Duration = Duration::from_secs(15);

/// `lb-user ARGS...`, killed at [`BAD_INPUT_DEADLINE`]. As root, it runs in
/// a fresh network namespace of its own (empty: no eth0, no route): should
/// lb-user ever act on input it ought to refuse, it finds nothing of the
/// host's to attach to or connect from. Without root it stays in the
/// host's namespace, where it may change nothing anyway.
fn run_bad_input(lb_user: &std::path::Path, args: &[&str]) -> anyhow::Result<Output> {
    let mut command = Command::new(lb_user);
    command.args(args);
    if lb_lab::root::is_root() {
        // SAFETY: the closure only makes the async-signal-safe unshare(2)
        // call, as pre_exec requires.
        unsafe {
            command.pre_exec(|| {
                if libc::unshare(libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    lb_lab::lab::output_with_timeout(command, BAD_INPUT_DEADLINE)
}

/// Bad discovery input: one `lb-user: error:` line and a failure exit,
/// before anything is touched (no root needed).
#[test]
fn bad_discovery_input_is_one_clear_error_line() {
    let lb_user = Binaries::for_tests().lb_user().unwrap().to_path_buf();
    // A literal address on the lab's subnet that nothing serves: no name to
    // resolve, nothing to reach.
    let endpoint = "http://10.213.255.1:2379";
    let cases: Vec<(&str, Vec<&str>, &str)> = vec![
        (
            "register without endpoints",
            vec!["register", "--prefix", "/p/", "--addr", "10.0.0.1:80"],
            "--etcd-endpoints",
        ),
        (
            "register with a zero ttl",
            register_args(endpoint, &["--ttl", "0s"]),
            "ttl",
        ),
        (
            "register with weight 0",
            register_args(endpoint, &["--weight", "0"]),
            "weight",
        ),
        (
            "register with an https check",
            register_args(endpoint, &["--check-http", "https://10.0.0.1:80/"]),
            "http://",
        ),
        (
            "register with a bad endpoint",
            register_args("nope", &[]),
            "invalid etcd endpoint",
        ),
        (
            "etcd prefix and static backends",
            vec![
                "--iface",
                "eth0",
                "--etcd-endpoints",
                endpoint,
                "--vip",
                "10.0.0.100:80",
                "--etcd-prefix",
                "/p/",
                "--backend",
                "10.0.0.1:80",
            ],
            "static backends as well are not allowed",
        ),
        (
            "etcd prefix without endpoints",
            vec![
                "--iface",
                "eth0",
                "--vip",
                "10.0.0.100:80",
                "--etcd-prefix",
                "/p/",
            ],
            "no --etcd-endpoints",
        ),
    ];
    for (case, args, expect) in &cases {
        let out = run_bad_input(&lb_user, args).unwrap_or_else(|e| panic!("{case}: {e:#}"));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{case}: {args:?} succeeded");
        assert_eq!(stderr.lines().count(), 1, "{case}: {args:?}: {stderr}");
        assert!(
            stderr.starts_with("lb-user: error: ") && stderr.contains(expect),
            "{case}: {args:?}: {stderr}"
        );
    }
}

/// SIGHUP re-reads a file with no backends for the discovered VIP; the
/// pool etcd gave must stay as it is (not be read as "remove them all").
#[test]
fn sighup_keeps_the_backends_etcd_gave() {
    require_root!();
    let (lab, _etcd) = lab(2);
    put_weights(&lab, &[1, 2]);
    let lb = start(&lab, Algorithm::P2cEwma, &[]);
    assert_active(&lab, &[0, 1], "the backends put before the start");
    lab.signal(lb, Signal::SIGHUP).unwrap();
    let summary = run_load(&lab, 100.0, 3.0, "sighup", "SIGHUP before the run");
    assert_nothing_lost(&summary);
    assert_active(&lab, &[0, 1], "SIGHUP keeps the backends etcd gave");
    assert_eq!(configured_weight(&lab, 1), 2.0);
    assert!(opened(&lab, 0) > 0 && opened(&lab, 1) > 0);
}

/// etcd's updates reach their VIP by its address, wherever the running
/// fleet holds it: a static VIP before the discovered one is removed at
/// runtime and freed, another is added, and a backend put in etcd then
/// joins the discovered VIP, not the one that took its place in the list.
#[test]
fn updates_follow_their_vip_when_the_vips_before_it_change() {
    require_root!();
    let (lab, _etcd) = lab(3);
    put(&lab, 0, 1);
    let vip_at = |port: u16| SocketAddr::new(lab.tcp_vip().ip(), port);
    let (before, added) = (vip_at(81), vip_at(82));
    // The discovered VIP comes from the flags, so the config file's static
    // one stands before it in the configuration.
    let mut spec = spec(&lab, &lab.etcd_url(), Algorithm::P2cEwma, &[]);
    spec.vips.push(VipSpec::new(
        before,
        VipProtocol::Tcp,
        vec![(lab.backends()[1].addr(), 1)],
    ));
    let lb = lab.start_balancer(&spec).unwrap();
    assert_active(&lab, &[0], "the backend put before the start");
    lab.vip_command(&["remove", "--vip", &before.to_string()]);
    let backend2 = addr(&lab, 2);
    lab.vip_command(&["add", "--vip", &added.to_string(), "--backend", &backend2]);
    wait_for("the removed VIP freed", Duration::from_secs(10), || {
        lab.stderr(lb)
            .contains("removed VIP has no flows left; id freed")
    });
    put(&lab, 1, 1);
    wait_active(
        &lab,
        "backend 1 put in etcd joins the discovered VIP",
        Duration::from_secs(5),
        &[0, 1],
    );
    let status = lab.status().unwrap();
    let other: Vec<String> = status
        .vip(&format!("{added}"))
        .map(|v| v.backends.iter().map(|b| b.address.clone()).collect())
        .unwrap_or_default();
    assert_eq!(other, [backend2], "the VIP added at runtime keeps its own");
    let summary = run_load(
        &lab,
        100.0,
        2.0,
        "vip-moves",
        "after the VIPs before it changed",
    );
    assert_nothing_lost(&summary);
}

/// A discovered VIP that a SIGHUP drops from the file has its watch
/// ended, and a later SIGHUP that puts it back at the same address as a
/// static VIP makes it the file's: etcd's changes under the prefix do not
/// add to or remove from the static VIP's backends.
#[test]
fn a_dropped_discovered_vips_watch_ends_and_a_static_vip_at_its_address_ignores_etcd() {
    require_root!();
    let (lab, _etcd) = lab(3);
    put(&lab, 0, 1);
    // The discovered VIP in the file, so that a SIGHUP can drop it; the
    // flags' static VIP keeps the instance serving throughout.
    let web = lab.tcp_vip();
    let flags_vip = SocketAddr::new(web.ip(), 81);
    let file = lab.log_dir().join("discovered.toml");
    let write = |text: String| std::fs::write(&file, text).unwrap();
    write(format!(
        "[[vip]]\naddress = \"{web}/tcp\"\netcd_prefix = \"{PREFIX}\"\n"
    ));
    let url = lab.etcd_url();
    let spec = BalancerSpec::one_vip(
        VipSpec::new(
            flags_vip,
            VipProtocol::Tcp,
            vec![(lab.backends()[2].addr(), 1)],
        ),
        Algorithm::P2cEwma,
        &["--etcd-endpoints", &url, "--config", file.to_str().unwrap()],
    );
    let lb = lab.start_balancer(&spec).unwrap();
    wait_active(&lab, "discovered", Duration::from_secs(5), &[0]);
    write(String::new());
    lab.signal(lb, Signal::SIGHUP).unwrap();
    wait_for("the dropped VIP freed", Duration::from_secs(15), || {
        lab.stderr(lb)
            .contains("removed VIP has no flows left; id freed")
    });
    let log = lab.stderr(lb);
    assert!(
        log.contains(&format!(
            "VIP {web}/tcp is no longer configured: its etcd watch of {PREFIX} ended"
        )),
        "{log}"
    );
    let backend1 = addr(&lab, 1);
    write(format!(
        "[[vip]]\naddress = \"{web}/tcp\"\nbackends = [\"{backend1}\"]\n"
    ));
    lab.signal(lb, Signal::SIGHUP).unwrap();
    wait_active(&lab, "the static VIP", Duration::from_secs(10), &[1]);
    let sent = updates(&lab.scrape_metrics().unwrap(), "applied");
    // The prefix's new set ({0, 2}) reaches no one: the watch ended with
    // its VIP (and an update it had sent would be ignored).
    put(&lab, 2, 1);
    thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        updates(&lab.scrape_metrics().unwrap(), "applied"),
        sent,
        "the dropped VIP's watch still reports"
    );
    assert_eq!(
        members(&lab)
            .into_iter()
            .map(|m| (m.0, m.3))
            .collect::<Vec<_>>(),
        [(backend1, "active".to_string())],
        "the static VIP has the file's backends only"
    );
}

/// Serves two backends put before the start under load, and follows a
/// third put while the load runs: 0 errors. `put3` puts backend `i`.
fn serves_and_follows(lab: &Lab, name: &str, what: &str, put3: impl Fn(usize)) {
    assert_active(lab, &[0, 1], "the backends put before the start");
    let load = Load::start_and_wait_1s(lab, 100.0, 5.0);
    put3(2);
    let took = wait_active(
        lab,
        "a backend put under load becomes active",
        Duration::from_secs(5),
        &[0, 1, 2],
    );
    let summary = load.finish(
        lab,
        name,
        &format!("{what}; a backend put under load was active {took:?} later"),
    );
    assert_nothing_lost(&summary);
    assert!(opened(lab, 2) > 0, "the new backend took connections");
}

const ROOT_PASSWORD: &str = "lab-Pw-1";

/// etcd with authentication on (user root), the balancer with
/// `--etcd-user/--etcd-password-file`. A wrong password (as a flag, which
/// is warned about, or in a file) is a configuration error, not an outage:
/// the start fails with one `lb-user: error:` line, also when a cache of
/// the last known backends exists (see the README).
#[test]
fn etcd_with_authentication_serves_and_a_wrong_password_fails_the_start() {
    require_root!();
    let (lab, _etcd) = lab(3);
    let url = lab.etcd_url();
    let root = format!("root:{ROOT_PASSWORD}");
    lab.etcdctl(&["user", "add", &root]).unwrap();
    lab.etcdctl(&["auth", "enable"]).unwrap();
    assert!(
        lab.etcdctl(&["get", PREFIX, "--prefix"]).is_err(),
        "authentication is on: no user, no read"
    );
    let user = format!("--user={root}");
    put_with(&lab, &url, &[&user], 0, 1);
    put_with(&lab, &url, &[&user], 1, 1);
    // The password files (the right one as `echo` writes it: a line end),
    // in the lab's log folder: they go with the lab however the test ends
    // (the folder kept by a failing test goes with the next lab's sweep).
    let secrets = lab.log_dir().join("etcd-secrets");
    std::fs::create_dir_all(&secrets).unwrap();
    let (right, wrong) = (secrets.join("right"), secrets.join("wrong"));
    std::fs::write(&right, format!("{ROOT_PASSWORD}\n")).unwrap();
    std::fs::write(&wrong, "wrong\n").unwrap();
    let (right, wrong) = (right.to_str().unwrap(), wrong.to_str().unwrap());
    let auth = ["--etcd-user", "root", "--etcd-password-file", right];
    let lb = start(&lab, Algorithm::P2cEwma, &auth);
    serves_and_follows(
        &lab,
        "auth",
        "etcd with authentication, balancer as user root",
        |i| put_with(&lab, &url, &[&user], i, 1),
    );
    // The cache now holds three backends; a wrong password still refuses.
    lab.stop_balancer(lb, Signal::SIGTERM).unwrap();
    for (case, flags) in [
        (
            "wrong password",
            &["--etcd-user", "root", "--etcd-password", "wrong"][..],
        ),
        (
            "wrong password file",
            &["--etcd-user", "root", "--etcd-password-file", wrong][..],
        ),
        ("no user", &[][..]),
    ] {
        let text = refused_start(&lab, &url, flags, case);
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("lb-user: error:"))
            .collect();
        eprintln!("DISCOVERY auth ({case}): {lines:?}");
        assert_eq!(lines.len(), 1, "{case}: {text}");
        assert!(
            lines[0].contains("etcd rejected the balancer") && !text.contains("serving the cached"),
            "{case}: {text}"
        );
        // Only the password given as text is in the process list.
        assert_eq!(
            text.contains("visible to every local user in the process list"),
            flags.contains(&"--etcd-password"),
            "{case}: {text}"
        );
    }
}

/// etcd over https with a throwaway CA; the balancer trusts it with
/// `--etcd-ca`. Without the CA it cannot connect (and, with no cache yet,
/// does not start).
#[test]
fn etcd_over_tls_serves_and_follows_a_change() {
    tls_case(false);
}

/// etcd over https requiring client certificates (`--client-cert-auth`):
/// the balancer presents one with `--etcd-cert/--etcd-key`; without it, it
/// cannot connect.
#[test]
fn etcd_requiring_client_certificates_serves_with_etcd_cert_and_key() {
    tls_case(true);
}

fn tls_case(client_cert_auth: bool) {
    require_root!();
    let lab = bare_lab(3);
    let tls = lab.make_etcd_tls().unwrap();
    lab.start_etcd_tls(&tls, client_cert_auth).unwrap();
    let url = lab.etcd_tls_url();
    let ctl = tls.etcdctl_flags();
    let ctl: Vec<&str> = ctl.iter().map(String::as_str).collect();
    let ca = tls.ca.display().to_string();
    let cert = tls.client_cert.display().to_string();
    let key = tls.client_key.display().to_string();
    let mut flags = vec!["--etcd-ca", ca.as_str()];
    // Each refused start: what is missing, and the flags it had.
    let refused: Vec<(&str, Vec<&str>)> = if client_cert_auth {
        flags.extend(["--etcd-cert", cert.as_str(), "--etcd-key", key.as_str()]);
        vec![("no client certificate", vec!["--etcd-ca", ca.as_str()])]
    } else {
        vec![("no --etcd-ca", vec![])]
    };
    for (case, refused_flags) in &refused {
        let text = refused_start(&lab, &url, refused_flags, case);
        let line = text
            .lines()
            .find(|l| l.contains("lb-user: error:"))
            .unwrap_or_else(|| panic!("{case}: {text}"));
        eprintln!("DISCOVERY tls ({case}): {line}");
        assert!(
            line.contains("etcd unreachable at startup"),
            "{case}: {text}"
        );
    }
    put_with(&lab, &url, &ctl, 0, 1);
    put_with(&lab, &url, &ctl, 1, 1);
    lab.start_balancer(&spec(&lab, &url, Algorithm::P2cEwma, &flags))
        .unwrap();
    let (name, what) = if client_cert_auth {
        (
            "tls_client_cert",
            "etcd over https requiring client certificates; --etcd-ca, --etcd-cert, --etcd-key",
        )
    } else {
        ("tls", "etcd over https; --etcd-ca")
    };
    serves_and_follows(&lab, name, what, |i| put_with(&lab, &url, &ctl, i, 1));
}
