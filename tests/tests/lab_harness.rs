//! Tests of the lab itself, without the balancer: the network, the backend
//! server, the load generator and cleanup. Run as root:
//! `cargo test -p lb-tests --test lab_harness -- --test-threads=1`.

use std::{
    io::Read,
    os::unix::{fs::DirBuilderExt as _, process::ExitStatusExt},
    path::PathBuf,
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use lb_lab::{
    Binaries, Lab,
    lab::{BALANCER_ADDR, BackendSpec, CLIENT_ADDR, VIP_ADDR},
    loadgen::{LoadConfig, Protocol, payload_pattern},
    probe, require_root,
};

/// Every namespace on the machine.
fn all_namespaces() -> Vec<String> {
    let output = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("ip netns list");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

/// Namespaces on the machine that belong to lab `id`.
fn namespaces_of(id: &str) -> Vec<String> {
    let prefix = format!("{id}-");
    all_namespaces()
        .into_iter()
        .filter(|name| name.starts_with(&prefix))
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

/// Namespace `host` of lab 1 of a process that has exited, as a killed
/// run leaves it, with whatever the test starts inside it. Dropping it
/// kills those processes and deletes the namespace if the sweep under test
/// did not: a failed assert must not leave a `sleep 600` running in a
/// namespace that only the next lab's sweep would remove.
struct DeadLabsNamespace {
    /// The exited process the namespace's name claims as its owner.
    dead_pid: u32,
    name: String,
    orphans: Vec<Child>,
    /// Files the test put in lb-user's run folder ([`Self::run_file`]).
    run_files: Vec<PathBuf>,
}

impl DeadLabsNamespace {
    fn create(host: &str) -> Self {
        let mut child = Command::new("true").spawn().unwrap();
        let dead_pid = child.id();
        child.wait().unwrap();
        let name = format!("lbl{dead_pid}n1-{host}");
        let status = Command::new("ip")
            .args(["netns", "add", &name])
            .status()
            .unwrap();
        assert!(status.success());
        Self {
            dead_pid,
            name,
            orphans: Vec::new(),
            run_files: Vec::new(),
        }
    }

    /// Puts an empty file called `name` in lb-user's run folder, as an
    /// instance leaves its lock there; returns its path.
    fn run_file(&mut self, name: &str) -> PathBuf {
        // The mode lb-user gives the folder (it sets it again at each start).
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o711)
            .create(lb_lab::lab::RUN_DIR)
            .unwrap();
        let path = std::path::Path::new(lb_lab::lab::RUN_DIR).join(name);
        std::fs::write(&path, "").unwrap();
        self.run_files.push(path.clone());
        path
    }

    /// Starts `argv` inside the namespace, as a killed lab's backends run
    /// on in theirs.
    fn spawn(&mut self, argv: &[&str]) -> &mut Child {
        let child = Command::new("ip")
            .args(["netns", "exec", &self.name])
            .args(argv)
            .spawn()
            .unwrap();
        self.orphans.push(child);
        self.orphans.last_mut().unwrap()
    }
}

impl Drop for DeadLabsNamespace {
    fn drop(&mut self) {
        for path in &self.run_files {
            let _ = std::fs::remove_file(path);
        }
        for orphan in &mut self.orphans {
            // Only one not reaped yet: a reaped one's pid may be another's.
            if let Ok(None) = orphan.try_wait() {
                let _ = orphan.kill();
                let _ = orphan.wait();
            }
        }
        if std::path::Path::new("/run/netns").join(&self.name).exists() {
            for pid in netns_pids(&self.name) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            let _ = Command::new("ip")
                .args(["netns", "delete", &self.name])
                .status();
        }
    }
}

/// The sweep also removes what the dead lab's lb-user left in its run
/// folder (named after the lab's balancer interface, `<id>b`), and nothing
/// there of an instance that is not a lab's.
#[test]
fn a_new_lab_sweeps_namespaces_of_dead_labs() {
    require_root!();
    let mut stale = DeadLabsNamespace::create("sw");
    let dead_pid = stale.dead_pid;
    let lock = stale.run_file(&format!("lb-lbl{dead_pid}n1b.lock"));
    let zones = stale.run_file(&format!("lb-lbl{dead_pid}n1b.zones.json"));
    let not_a_lab = stale.run_file(&format!("lb-notalab{dead_pid}.lock"));
    let _lab = Lab::builder(Binaries::for_tests())
        .backends(1, BackendSpec::default())
        .build()
        .unwrap();
    assert!(
        namespaces_of(&format!("lbl{dead_pid}n1")).is_empty(),
        "{} survived the sweep",
        stale.name
    );
    for left in [lock, zones] {
        assert!(!left.exists(), "{} survived the sweep", left.display());
    }
    assert!(
        not_a_lab.exists(),
        "the sweep removed {}",
        not_a_lab.display()
    );
}

/// A killed lab's processes outlive it inside its namespaces (deleting a
/// namespace's name does not stop them): the sweep kills them first.
#[test]
fn a_new_lab_stops_what_still_runs_in_a_dead_labs_namespace() {
    require_root!();
    let mut stale = DeadLabsNamespace::create("be1");
    let (dead_pid, ns) = (stale.dead_pid, stale.name.clone());
    // Bounded: it ends by itself after 10 minutes if the sweep and the
    // guard both miss it.
    let orphan = stale.spawn(&["sleep", "600"]);
    // Until `ip netns exec` has entered the namespace and run sleep.
    let entered = Instant::now();
    while netns_pids(&ns).is_empty() && entered.elapsed() < Duration::from_secs(10) {
        thread::sleep(Duration::from_millis(20));
    }
    assert!(!netns_pids(&ns).is_empty(), "sleep never ran in {ns}");
    let _lab = Lab::builder(Binaries::for_tests())
        .backends(1, BackendSpec::default())
        .build()
        .unwrap();
    let swept = Instant::now();
    let exit = loop {
        if let Some(exit) = orphan.try_wait().unwrap() {
            break Some(exit);
        }
        if swept.elapsed() > Duration::from_secs(10) {
            break None;
        }
        thread::sleep(Duration::from_millis(20));
    };
    let exit = exit.expect("the sleep in the dead lab's namespace still ran 10 s after the sweep");
    assert_eq!(exit.signal(), Some(9), "{exit:?}");
    assert!(namespaces_of(&format!("lbl{dead_pid}n1")).is_empty());
}

/// Processes in namespace `ns`.
fn netns_pids(ns: &str) -> Vec<u32> {
    let output = Command::new("ip")
        .args(["netns", "pids", ns])
        .output()
        .expect("ip netns pids");
    String::from_utf8_lossy(&output.stdout)
        .split_whitespace()
        .filter_map(|pid| pid.parse().ok())
        .collect()
}

/// How long [`RunningBench`]'s drop lets the benchmark clean up after its
/// SIGTERM before SIGKILL: removing its labs takes seconds. What a SIGKILL
/// cuts short is a dead process's labs, which the next lab's sweep removes.
const BENCH_STOP_GRACE: Duration = Duration::from_secs(10);

/// The benchmark under test, stopped however the test ends: a panic
/// between its spawn and the test's own SIGTERM would otherwise leave it
/// running rows (labs, backends, lb-user) for minutes, and its output
/// folder behind. Dropping it sends SIGTERM (the benchmark then removes
/// its labs), SIGKILL after [`BENCH_STOP_GRACE`], and removes the output
/// folder.
struct RunningBench {
    child: Child,
    out: PathBuf,
}

impl Drop for RunningBench {
    fn drop(&mut self) {
        // Only one not reaped yet: a reaped one's pid may be another's.
        if let Ok(None) = self.child.try_wait() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(self.child.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            let signalled = Instant::now();
            while matches!(self.child.try_wait(), Ok(None))
                && signalled.elapsed() < BENCH_STOP_GRACE
            {
                thread::sleep(Duration::from_millis(50));
            }
            if let Ok(None) = self.child.try_wait() {
                let _ = self.child.kill();
                let _ = self.child.wait();
            }
        }
        let _ = std::fs::remove_dir_all(&self.out);
    }
}

/// A benchmark stopped with SIGTERM mid-run (Ctrl-C in a terminal, a CI
/// timeout) removes its lab: namespaces, every process in them (backends,
/// load generator, lb-user), the balancer's pins and its log folder, and
/// exits 143 as SIGTERM's default action would.
#[test]
fn a_benchmark_stopped_by_sigterm_removes_its_labs() {
    require_root!();
    let bench = lb_lab::binaries::find(
        "lb-bench-balance",
        "LB_BENCH_BALANCE_BIN",
        "cargo build -p lb-tests",
    )
    .unwrap();
    let out = std::env::temp_dir().join(format!("lb-sigterm-bench-{}", std::process::id()));
    // Our rows only: the benchmark installs no peer for them.
    let child = Command::new(bench)
        .args(["--quick", "--scenario", "stall", "--row", "lb p2c", "--out"])
        .arg(&out)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut run = RunningBench { child, out };
    // Its labs are `lbl<pid>n<k>`, their namespaces `lbl<pid>n<k>-<host>`.
    let id = format!("lbl{}n", run.child.id());
    let namespaces_of = |prefix: &str| -> Vec<String> {
        all_namespaces()
            .into_iter()
            .filter(|ns| ns.starts_with(prefix))
            .collect()
    };
    // Until its balancer is attached (its pins exist) and backends serve:
    // the middle of a row.
    let pins = || -> Vec<String> {
        std::fs::read_dir(lb_lab::lab::PIN_ROOT)
            .map(|dir| {
                dir.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|name| name.contains(&id))
                    .collect()
            })
            .unwrap_or_default()
    };
    let started = Instant::now();
    while pins().is_empty() && started.elapsed() < Duration::from_secs(120) {
        if let Some(exit) = run.child.try_wait().unwrap() {
            panic!("the benchmark ended before its balancer started: {exit:?}");
        }
        thread::sleep(Duration::from_millis(50));
    }
    let namespaces = namespaces_of(&id);
    let processes: Vec<u32> = namespaces.iter().flat_map(|ns| netns_pids(ns)).collect();
    assert!(
        !pins().is_empty(),
        "no balancer of the benchmark after 120 s"
    );
    assert!(namespaces.len() > 10, "{namespaces:?}");
    assert!(processes.len() > 10, "{processes:?}");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(run.child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let signalled = Instant::now();
    let exit = loop {
        if let Some(exit) = run.child.try_wait().unwrap() {
            break exit;
        }
        assert!(
            signalled.elapsed() < Duration::from_secs(60),
            "the benchmark still ran 60 s after SIGTERM"
        );
        thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    let _ = run.child.stderr.take().unwrap().read_to_string(&mut stderr);
    assert_eq!(exit.code(), Some(143), "{exit:?}: {stderr}");
    assert!(stderr.contains("removing this run's labs"), "{stderr}");
    assert!(
        namespaces_of(&id).is_empty(),
        "left: {:?}",
        namespaces_of(&id)
    );
    assert!(pins().is_empty(), "pins left: {:?}", pins());
    // Its lb-user instances' lock, socket and records in /run/lb-user.
    let run_files: Vec<String> = std::fs::read_dir(lb_lab::lab::RUN_DIR)
        .map(|dir| {
            dir.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|name| name.contains(&id))
                .collect()
        })
        .unwrap_or_default();
    assert!(run_files.is_empty(), "left in /run/lb-user: {run_files:?}");
    // Reparented to init once the benchmark exited, and reaped by it.
    let reaped = Instant::now();
    let alive = || -> Vec<u32> {
        processes
            .iter()
            .copied()
            .filter(|pid| {
                std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .is_ok_and(|stat| !stat.contains(") Z "))
            })
            .collect()
    };
    while !alive().is_empty() && reaped.elapsed() < Duration::from_secs(10) {
        thread::sleep(Duration::from_millis(50));
    }
    assert!(alive().is_empty(), "still running: {:?}", alive());
    assert!(
        std::fs::read_dir(std::env::temp_dir())
            .unwrap()
            .flatten()
            .all(|e| !e.file_name().to_string_lossy().starts_with(&id)),
        "a log folder of the benchmark's labs is left in {}",
        std::env::temp_dir().display()
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
