//! The `lb-user` binary as users meet it. Bad-input cases need root to be
//! meaningful (as non-root the root check would answer first), and the
//! attach test builds its own network namespace; without root every test
//! prints a loud SKIP and passes.

use std::{
    os::unix::process::CommandExt as _,
    path::Path,
    process::{Child, Command, Output, Stdio},
    sync::atomic::{AtomicU32, Ordering},
    thread::sleep,
    time::{Duration, Instant},
};

use lb_user::kernel::instance::{LOCK_DIR, run_file_instance};

const BIN: &str = env!("CARGO_BIN_EXE_lb-user");
const STARTUP_BUDGET: Duration = Duration::from_secs(15);

/// Whether this process runs as root.
fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Skips loudly without root, unless `cargo xtask test` (which CI runs as
/// root) forbids skipping by setting LB_TESTS_REQUIRE_ROOT.
fn skip(test: &str) -> bool {
    if is_root() {
        return false;
    }
    // Set at all forbids skipping, as for the lab's tests (`lb_tests::root`).
    if std::env::var_os("LB_TESTS_REQUIRE_ROOT").is_some() {
        panic!("{test} needs root, and LB_TESTS_REQUIRE_ROOT forbids skipping");
    }
    // Straight to the stderr handle: libtest captures `eprintln!` and shows
    // it only for a failing test, and a skip passes.
    use std::io::Write as _;
    let _ = writeln!(
        std::io::stderr().lock(),
        "\n!!!!!!!! SKIPPED {test}: needs root (run the tests as root) !!!!!!!!\n"
    );
    true
}

/// A name no other test or run uses.
fn unique(prefix: &str) -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    format!(
        "{prefix}{}x{}",
        std::process::id() % 100_000,
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// Removes what an instance named by a test leaves in `/run/lb-user` (its
/// lock file, which lb-user keeps on purpose, and the socket, reserved
/// ports and state files a killed one leaves) when the test ends, passed
/// or not: the names are unique per run, so they would pile up. Only the
/// files lb-user names after exactly these instances
/// ([`run_file_instance`]), not those of an instance whose name merely
/// starts the same.
struct RunFiles(Vec<String>);

impl Drop for RunFiles {
    fn drop(&mut self) {
        let Ok(entries) = std::fs::read_dir(LOCK_DIR) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            let ours = run_file_instance(&name)
                .is_some_and(|owner| self.0.iter().any(|instance| instance == owner));
            if ours {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
}

/// Where `instance` pins its maps and link.
fn pin_dir(instance: &str) -> std::path::PathBuf {
    Path::new("/sys/fs/bpf/lb-user").join(instance)
}

/// Removes `instance`'s pins when dropped (a clean stop removes them
/// itself; a test that kills one, or fails, leaves them).
struct RemovePins(String);

impl Drop for RemovePins {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(pin_dir(&self.0));
    }
}

/// Whether an XDP program is attached to any link (in `netns`, if given).
fn has_xdp(netns: Option<&str>) -> bool {
    let mut cmd = Command::new("ip");
    if let Some(ns) = netns {
        cmd.args(["-n", ns]);
    }
    let out = cmd.args(["-j", "link", "show"]).output().expect("ip link");
    String::from_utf8_lossy(&out.stdout).contains("\"xdp\"")
}

/// One VIP with one backend on `lo`: a start that passes validation.
const LO_VIP: [&str; 6] = [
    "--iface",
    "lo",
    "--vip",
    "10.0.0.100:80",
    "--backend",
    "10.0.0.21:80",
];

/// [`LO_VIP`] followed by `extra`.
fn lo_vip_with<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    [&LO_VIP[..], extra].concat()
}

/// Runs `lb-user` with `args` as `instance`, to completion.
fn run_as(instance: &str, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .args(["--instance", instance])
        .output()
        .expect("run lb-user")
}

/// Asserts that `out` is a failure with exactly one stderr line, which
/// contains `expected`; returns that line.
fn assert_one_line_failure(out: &Output, expected: &str) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "should fail: {stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "exactly one stderr line, got: {stderr}");
    assert!(
        lines[0].contains(expected),
        "expected {expected:?} in {stderr}"
    );
    lines[0].to_string()
}

/// Runs a start that must fail and checks the failure contract.
fn assert_rejected(args: &[&str], expected: &str) {
    let instance = unique("bad");
    let _run_files = RunFiles(vec![instance.clone()]);
    assert_failed_cleanly(&run_as(&instance, args), expected, &instance);
}

/// Asserts the failure contract of a start: one `lb-user: error:` line
/// with `expected` in it, and no pins nor XDP program left behind.
fn assert_failed_cleanly(out: &Output, expected: &str, instance: &str) {
    let line = assert_one_line_failure(out, expected);
    assert!(line.starts_with("lb-user: error: "), "{line}");
    assert!(!pin_dir(instance).exists(), "pin dir left behind");
    assert!(
        !has_xdp(None),
        "an XDP program is attached after a failed start"
    );
}

#[test]
fn bad_input_fails_with_one_line_and_leaves_nothing() {
    if skip("bad_input_fails_with_one_line_and_leaves_nothing") {
        return;
    }
    let cases = [
        (
            vec![
                "--iface",
                "nosuchif0",
                "--vip",
                "10.0.0.100:80",
                "--backend",
                "10.0.0.21:80",
            ],
            "unknown interface 'nosuchif0'",
        ),
        (
            vec![
                "--iface",
                "lo",
                "--vip",
                "10.0.0.300:80",
                "--backend",
                "10.0.0.21:80",
            ],
            "invalid address '10.0.0.300:80'",
        ),
        (
            lo_vip_with(&["--backend", "10.0.0.21:80"]),
            "duplicate backend 10.0.0.21:80",
        ),
        (LO_VIP[..4].to_vec(), "has no backends"),
        (
            vec!["--config", "/nonexistent/lb.toml"],
            "cannot read config file /nonexistent/lb.toml",
        ),
        (
            lo_vip_with(&["--backend", "10.0.0.22:80@0"]),
            "invalid weight '0'",
        ),
        (
            lo_vip_with(&["--score-interval", "1s"]),
            "out of range (1ms..=100ms)",
        ),
        (
            lo_vip_with(&["--score-interval", "1ns"]),
            "out of range (1ms..=100ms)",
        ),
        (
            lo_vip_with(&["--backend", "10.0.0.100:80"]),
            "VIP 10.0.0.100:80/tcp lists itself as a backend",
        ),
        (
            lo_vip_with(&["--algorithm", "consistent"]),
            "unknown algorithm 'consistent'",
        ),
        (lo_vip_with(&["--bogus"]), "unexpected argument '--bogus'"),
        // Addresses that can never work.
        (
            vec![
                "--iface",
                "lo",
                "--vip",
                "10.0.0.100:25000/udp",
                "--backend",
                "10.0.0.21:80",
                "--snat-ip",
                "10.0.0.100",
            ],
            "VIP 10.0.0.100:25000/udp is on SNAT address 10.0.0.100 with its port in the SNAT \
             port range 20000-32767: the balancer would drop every new connection to it as a \
             reply to a SNAT connection that has ended (move the VIP's port out of \
             --snat-ports, or use another --snat-ip)",
        ),
        (
            lo_vip_with(&["--snat-ip", "10.0.0.21"]),
            "backend 10.0.0.21:80 of VIP 10.0.0.100:80/tcp is at SNAT address 10.0.0.21",
        ),
        (
            lo_vip_with(&["--backend", "127.0.0.1:80"]),
            "backend 127.0.0.1:80 is a loopback address, which never crosses a wire",
        ),
        (
            lo_vip_with(&["--snat-ip6", "::1"]),
            "SNAT address ::1 is a loopback address, which never crosses a wire",
        ),
        (
            vec![
                "--iface",
                "lo",
                "--vip",
                "[::ffff:10.0.0.100]:80",
                "--backend",
                "[2001:db8::21]:80",
            ],
            "VIP [::ffff:10.0.0.100]:80/tcp is an IPv4-mapped IPv6 address, which no IPv6 \
             packet carries (write the IPv4 address itself)",
        ),
    ];
    for (args, expected) in cases {
        assert_rejected(&args, expected);
    }

    let config = std::env::temp_dir().join(format!("{}.toml", unique("lbcfg")));
    for (text, expected) in [
        (
            "iface = \"lo\"\n[[vip]]\naddress = \"10.0.0.100:80\"\nbackends = []\n",
            "has no backends",
        ),
        ("iface = \"lo\"\nvips = 3\n", "unknown field `vips`"),
    ] {
        std::fs::write(&config, text).unwrap();
        assert_rejected(&["--config", config.to_str().unwrap()], expected);
    }
    std::fs::remove_file(&config).ok();
}

#[test]
fn non_root_is_refused_after_input_validation() {
    if skip("non_root_is_refused_after_input_validation") {
        return;
    }
    let instance = unique("nonroot");
    let _run_files = RunFiles(vec![instance.clone()]);
    let nobody = |extra: &[&str]| {
        Command::new(BIN)
            .args(LO_VIP)
            .args(["--instance", &instance])
            .args(extra)
            .uid(65534)
            .gid(65534)
            .output()
            .expect("run lb-user as nobody")
    };
    assert_failed_cleanly(&nobody(&[]), "must run as root", &instance);
    // Bad flags are reported as such even without privileges.
    assert_failed_cleanly(
        &nobody(&["--inflight-bias", "9"]),
        "--inflight-bias",
        &instance,
    );
}

/// A network namespace with a veth pair, deleted on drop (even on panic).
struct Netns(String);

impl Netns {
    fn new() -> Self {
        let name = unique("lbcli");
        let ip = |args: &[&str]| {
            let st = Command::new("ip").args(args).status().expect("ip");
            assert!(st.success(), "ip {args:?}");
        };
        ip(&["netns", "add", &name]);
        let ns = Self(name);
        ip(&[
            "-n", &ns.0, "link", "add", "lb0", "type", "veth", "peer", "name", "lb1",
        ]);
        ip(&["-n", &ns.0, "addr", "add", "10.77.0.1/24", "dev", "lb0"]);
        ip(&["-n", &ns.0, "link", "set", "lb0", "up"]);
        ip(&["-n", &ns.0, "link", "set", "lb1", "up"]);
        ns
    }

    /// `lb-user` with `args`, to run inside the namespace.
    fn exec(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.0, BIN]).args(args);
        cmd
    }

    /// Starts `lb-user` with `args` inside the namespace, its stdout
    /// discarded and its stderr sent to `stderr`.
    fn spawn(&self, args: &[&str], stderr: Stdio) -> Child {
        self.exec(args)
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("start lb-user")
    }

    /// [`Self::spawn`] as a [`Daemon`] (stopped even if the wait fails),
    /// then waits until `instance` (named in `args`) reports ready.
    fn start_ready(&self, instance: &str, args: &[&str], stderr: Stdio) -> Daemon {
        let daemon = Daemon(self.spawn(args, stderr));
        wait_for_status(self, instance);
        daemon
    }

    /// Asserts that `instance` left neither an XDP program in the namespace
    /// nor its pins; `context` leads the failure messages.
    fn assert_cleaned_up(&self, instance: &str, context: &str) {
        assert!(
            !has_xdp(Some(&self.0)),
            "{context}: the program stayed attached"
        );
        assert!(!pin_dir(instance).exists(), "{context}: the pins stayed");
    }
}

/// One VIP with one backend on the namespace's `lb0`, attached in
/// `xdp_mode`, as `instance`.
fn lb0_args<'a>(xdp_mode: &'a str, instance: &'a str) -> Vec<&'a str> {
    vec![
        "--iface",
        "lb0",
        "--vip",
        "10.77.0.100:80",
        "--backend",
        "10.77.0.21:8080",
        "--xdp-mode",
        xdp_mode,
        "--instance",
        instance,
    ]
}

/// Sends SIGTERM to `child`.
fn sigterm(child: &Child) {
    // SAFETY: plain kill(2) on our own child's pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// Stops the daemon (SIGTERM, so it removes its pins) if a test ends or
/// fails before stopping it; SIGKILL only if it does not exit in time.
struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        sigterm(&self.0);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Collects the child's stderr until a line contains `needle`.
fn wait_for_log(child: &mut Child, needle: &str) -> String {
    use std::io::BufRead as _;
    let stderr = child.stderr.take().expect("stderr piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let deadline = Instant::now() + STARTUP_BUDGET;
    let mut log = String::new();
    while let Ok(line) = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        log += &line;
        log.push('\n');
        if line.contains(needle) {
            return log;
        }
    }
    panic!("no {needle:?} in the log: {log}");
}

/// Polls `status --json` of `instance` until it reports ready; that status.
fn wait_for_status(ns: &Netns, instance: &str) -> serde_json::Value {
    let deadline = Instant::now() + STARTUP_BUDGET;
    loop {
        let out = ns
            .exec(&["status", "--json", "--instance", instance])
            .output()
            .unwrap();
        if out.status.success() {
            let status: serde_json::Value =
                serde_json::from_slice(&out.stdout).expect("status JSON");
            if status["ready"] == true {
                return status;
            }
        }
        assert!(
            Instant::now() < deadline,
            "no ready status: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        sleep(Duration::from_millis(100));
    }
}

#[test]
fn attaches_reports_status_and_cleans_up_on_sigterm() {
    if skip("attaches_reports_status_and_cleans_up_on_sigterm") {
        return;
    }
    let ns = Netns::new();
    for mode in ["native", "skb"] {
        let instance = unique("attach");
        let _run_files = RunFiles(vec![instance.clone()]);
        let mut args = lb0_args(mode, &instance);
        args.extend(["--backend", "10.77.0.22:8080@3"]);
        let mut daemon = Daemon(ns.spawn(&args, Stdio::piped()));
        let status = wait_for_status(&ns, &instance);
        assert!(has_xdp(Some(&ns.0)), "{mode}: program not attached");
        assert!(pin_dir(&instance).join("link").exists());
        let vip = &status["vips"][0];
        assert_eq!(vip["address"], "10.77.0.100:80");
        assert_eq!(vip["protocol"], "tcp");
        assert_eq!(vip["algorithm"], "p2c-ewma");
        let backends = vip["backends"].as_array().unwrap();
        assert_eq!(backends.len(), 2);
        assert_eq!(backends[1]["address"], "10.77.0.22:8080");
        // The effective weight, a decimal (slow start can make it 0.5).
        assert_eq!(backends[1]["weight"].as_f64(), Some(3.0));
        assert_eq!(backends[1]["state"], "active");
        assert_eq!(status["snat_ip"], "10.77.0.1");
        assert!(status["reasons"]["tx_to_backend"].is_u64());
        // A reader that went away (`status | head -1` once head has its
        // line) is no error and no panic, in both forms.
        for json in [true, false] {
            let (reader, writer) = std::io::pipe().unwrap();
            drop(reader);
            let mut argv = vec!["status", "--instance", instance.as_str()];
            if json {
                argv.push("--json");
            }
            let out = ns
                .exec(&argv)
                .stdout(writer)
                .stderr(Stdio::piped())
                .output()
                .unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(
                out.status.success() && stderr.is_empty(),
                "{mode}: status (json: {json}) into a closed pipe: {:?}: {stderr}",
                out.status
            );
        }

        sigterm(&daemon.0);
        let out = std::mem::replace(&mut daemon.0, Command::new("true").spawn().unwrap())
            .wait_with_output()
            .unwrap();
        assert!(
            out.status.success(),
            "{mode}: exit {:?}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        ns.assert_cleaned_up(&instance, &format!("{mode}: after SIGTERM"));
    }
}

#[test]
fn a_second_instance_with_the_same_name_fails_cleanly() {
    if skip("a_second_instance_with_the_same_name_fails_cleanly") {
        return;
    }
    let ns = Netns::new();
    let instance = unique("dup");
    let _run_files = RunFiles(vec![instance.clone()]);
    let args = lb0_args("skb", &instance);
    let _first = ns.start_ready(&instance, &args, Stdio::null());
    let out = ns.exec(&args).output().unwrap();
    assert_one_line_failure(&out, "is already running");
    // The first instance is untouched.
    assert!(pin_dir(&instance).join("link").exists());
}

#[test]
fn a_restart_after_sigkill_readopts_the_pinned_program() {
    if skip("a_restart_after_sigkill_readopts_the_pinned_program") {
        return;
    }
    let ns = Netns::new();
    let instance = unique("restart");
    let _run_files = RunFiles(vec![instance.clone()]);
    // The pins a SIGKILLed instance leaves go with the test, passed or not.
    let _pins = RemovePins(instance.clone());
    let args = lb0_args("skb", &instance);
    let mut first = Daemon(ns.spawn(&args, Stdio::null()));
    wait_for_status(&ns, &instance);
    first.0.kill().unwrap();
    first.0.wait().unwrap();
    assert!(
        has_xdp(Some(&ns.0)),
        "the pinned link must keep the program attached"
    );
    assert!(pin_dir(&instance).join("FLOWS").exists());

    // The old pins already answer `status`, so wait for the new process's
    // own word that it is up before signalling it.
    let mut second = Daemon(ns.spawn(&args, Stdio::piped()));
    let log = wait_for_log(&mut second.0, "balancing");
    assert!(log.contains("re-adopted the running lb_xdp"), "{log}");
    assert!(has_xdp(Some(&ns.0)));
    wait_for_status(&ns, &instance);
    drop(second);
    ns.assert_cleaned_up(&instance, "after the second stopped");
}

#[test]
fn a_closed_log_pipe_does_not_stop_a_clean_shutdown() {
    if skip("a_closed_log_pipe_does_not_stop_a_clean_shutdown") {
        return;
    }
    let ns = Netns::new();
    let instance = unique("pipe");
    let _run_files = RunFiles(vec![instance.clone()]);
    let args = lb0_args("skb", &instance);
    let mut daemon = ns.start_ready(&instance, &args, Stdio::piped());
    // The supervisor reading the logs goes away; the shutdown still logs.
    drop(daemon.0.stderr.take());
    sigterm(&daemon.0);
    let status = daemon.0.wait().unwrap();
    assert!(status.success(), "exit {status:?}");
    ns.assert_cleaned_up(&instance, "after a clean shutdown");
}

/// Names the socket [`control_socket_client`] connects to.
const PEER_SOCKET_ENV: &str = "LB_CLI_TEST_PEER_SOCKET";
/// Makes [`control_socket_client`] keep root's file-system identity.
const PEER_ROOT_FILES_ENV: &str = "LB_CLI_TEST_PEER_ROOT_FILES";
const NOBODY: u32 = 65534;

#[test]
fn bad_vip_commands_fail_with_one_line_before_reaching_a_daemon() {
    let instance = unique("novip");
    let _run_files = RunFiles(vec![instance.clone()]);
    // A well-formed `vip add`.
    let add = [
        "vip",
        "add",
        "--vip",
        "10.0.0.100:81",
        "--backend",
        "10.0.0.21:80",
    ];
    let run = |args: &[&str], expected: &str| {
        assert_one_line_failure(&run_as(&instance, args), expected);
    };
    run(
        &["vip", "add", "--vip", "10.0.0.100:81"],
        "vip add needs at least one --backend",
    );
    run(
        &[
            "vip",
            "remove",
            "--vip",
            "10.0.0.100:81",
            "--backend",
            "10.0.0.21:80",
        ],
        "vip remove takes only --vip",
    );
    run(
        &[&add[..], &["--algorithm", "nope"]].concat(),
        "unknown algorithm 'nope'",
    );
    run(
        &["vip", "rename", "--vip", "10.0.0.100:81"],
        "invalid value 'rename'",
    );
    // An instance name is a path component: checked before it is used.
    for command in [&add[..], &["status"]] {
        assert_one_line_failure(
            &run_as("../../tmp", command),
            "invalid instance name '../../tmp'",
        );
    }
    let backend = ["backend", "add", "--vip", "10.0.0.100:81", "--backend"];
    run(
        &[&backend[..], &["10.0.0.21:80", "--weight", "5"]].concat(),
        "--weight goes with backend weight only",
    );
    run(
        &[
            "backend",
            "drain",
            "--vip",
            "10.0.0.100:81",
            "--backend",
            "10.0.0.21:80@7",
        ],
        "backend drain: --backend takes IP:PORT only",
    );
    run(
        &[
            "backend",
            "remove",
            "--vip",
            "10.0.0.100:81",
            "--backend",
            "10.0.0.21:80,zone=a",
        ],
        "backend remove: --backend takes IP:PORT only",
    );
    run(
        &[
            "backend",
            "weight",
            "--vip",
            "10.0.0.100:81",
            "--backend",
            "10.0.0.21:80",
        ],
        "backend weight needs --weight N",
    );
    // clap's errors are one line, without its "For more information" tip.
    let line = assert_one_line_failure(
        &run_as(&instance, &lo_vip_with(&["--inflight-bias", "-1"])),
        "invalid value '-1' for '--inflight-bias <B>'",
    );
    assert!(!line.contains("For more information"), "{line}");
    assert_one_line_failure(
        &run_as(
            &instance,
            &lo_vip_with(&["--snat-quarantine", "4294967295h"]),
        ),
        "duration '4294967295h' is too long (at most 720h)",
    );
    if is_root() {
        // Well-formed, but no such instance runs: nothing to change.
        run(&add, &instance);
    }
}

/// Not a test of its own: the control-socket client that
/// [`the_control_socket_refuses_peers_that_are_not_root_nor_in_its_group`]
/// runs as another user (this test binary again, with
/// `LB_CLI_TEST_PEER_SOCKET` set, and `--ignored`, so that a test run
/// does not count it as a test that passed). It prints `ANSWER <line>` or
/// `CONNECT <error>`.
#[test]
#[ignore = "the client another test runs as another user, not a test of its own"]
fn control_socket_client() {
    use std::io::{BufRead as _, Write as _};
    let Some(path) = std::env::var_os(PEER_SOCKET_ENV) else {
        return;
    };
    if std::env::var_os(PEER_ROOT_FILES_ENV).is_some() {
        // Effective uid nobody, file-system uid root (execve resets the
        // file-system uid, so this happens here, after it).
        // SAFETY: plain credential syscalls; setfsuid is per thread, and
        // this thread connects.
        let fsuid = unsafe {
            assert_eq!(libc::setresuid(0, NOBODY, 0), 0);
            libc::setfsuid(0);
            libc::setfsuid(u32::MAX)
        };
        assert_eq!(fsuid, 0);
    }
    match std::os::unix::net::UnixStream::connect(&path) {
        Ok(mut stream) => {
            let request =
                r#"{"command":"drain","vip":"10.77.0.100:80","backend":"10.77.0.99:8080"}"#;
            // A refused peer may find the socket closed before it writes.
            let _ = stream.write_all(format!("{request}\n").as_bytes());
            let mut answer = String::new();
            let _ = std::io::BufReader::new(stream).read_line(&mut answer);
            println!("ANSWER {}", answer.trim());
        }
        Err(e) => println!("CONNECT {e}"),
    }
}

/// How the client process is made someone else.
#[derive(Clone, Copy)]
enum Identity {
    /// uid and gid nobody, no supplementary groups.
    Nobody,
    /// nobody, but with its file-system uid still root: the file modes let
    /// it through, only `SO_PEERCRED` (which reports the effective uid) can
    /// refuse it.
    NobodyWithRootFiles,
    /// nobody, with supplementary group `gid`.
    NobodyInGroup(u32),
}

/// Runs [`control_socket_client`] against `socket` as `who`; its output.
fn connect_as(who: Identity, socket: &Path) -> String {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new(exe);
    cmd.args([
        "--exact",
        "control_socket_client",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(PEER_SOCKET_ENV, socket);
    if matches!(who, Identity::NobodyWithRootFiles) {
        cmd.env(PEER_ROOT_FILES_ENV, "1");
    }
    become_(&mut cmd, who);
    let out = cmd.output().expect("run the client");
    let stdout = String::from_utf8_lossy(&out.stdout);
    stdout
        .lines()
        .find_map(|l| {
            let at = l.find("ANSWER ").or_else(|| l.find("CONNECT "))?;
            Some(&l[at..])
        })
        .unwrap_or_else(|| {
            panic!(
                "no answer from the client: {stdout} {}",
                String::from_utf8_lossy(&out.stderr)
            )
        })
        .to_string()
}

/// The real `lb-user ARGS...` run as `who`.
fn lb_user_as(who: Identity, args: &[&str]) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.args(args);
    become_(&mut cmd, who);
    cmd.output().expect("run lb-user")
}

/// Makes `cmd` run as `who` (its credentials set between fork and exec).
fn become_(cmd: &mut Command, who: Identity) {
    // SAFETY: only async-signal-safe syscalls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            let groups: &[libc::gid_t] = match who {
                Identity::NobodyInGroup(gid) => &[gid],
                _ => &[],
            };
            let ok = libc::setgroups(groups.len(), groups.as_ptr()) == 0
                && libc::setresgid(NOBODY, NOBODY, NOBODY) == 0
                && match who {
                    // The client drops its effective uid itself.
                    Identity::NobodyWithRootFiles => true,
                    _ => libc::setresuid(NOBODY, NOBODY, NOBODY) == 0,
                };
            if ok {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
}

/// The permission bits, owner and group of `path`.
fn mode_of(path: &Path) -> (u32, u32, u32) {
    use std::os::unix::fs::MetadataExt as _;
    let meta = std::fs::metadata(path).unwrap();
    (meta.mode() & 0o7777, meta.uid(), meta.gid())
}

#[test]
fn the_control_socket_refuses_peers_that_are_not_root_nor_in_its_group() {
    if skip("the_control_socket_refuses_peers_that_are_not_root_nor_in_its_group") {
        return;
    }
    let ns = Netns::new();
    let socket_dir = Path::new("/run/lb-user");
    for group in [None, Some(("daemon", 1))] {
        let instance = unique("sock");
        let _run_files = RunFiles(vec![instance.clone()]);
        let mut args = lb0_args("skb", &instance);
        args.extend(["--metrics-addr", "off"]);
        if let Some((name, _)) = group {
            args.extend(["--control-group", name]);
        }
        let mut daemon = ns.start_ready(&instance, &args, Stdio::piped());
        let socket = socket_dir.join(format!("{instance}.sock"));
        let gid = group.map_or(0, |(_, gid)| gid);
        let sock_mode = if group.is_some() { 0o660 } else { 0o600 };
        // Shared by every instance: root's, searchable by all.
        assert_eq!(mode_of(socket_dir), (0o711, 0, 0));
        assert_eq!(mode_of(&socket), (sock_mode, 0, gid));

        let denied = "ANSWER {\"ok\":false,\"error\":\"permission denied";
        let plain = connect_as(Identity::Nobody, &socket);
        assert!(plain.contains("Permission denied"), "{plain}");
        let sneaky = connect_as(Identity::NobodyWithRootFiles, &socket);
        assert!(sneaky.starts_with(denied), "{group:?}: {sneaky}");
        let member = connect_as(Identity::NobodyInGroup(1), &socket);
        if group.is_some() {
            // Let in, and answered: this VIP has no such backend.
            assert!(
                member.contains("has no backend 10.77.0.99:8080"),
                "{member}"
            );
        } else {
            assert!(member.contains("Permission denied"), "{member}");
        }
        // The same member through lb-user itself, which leaves the
        // decision to the daemon: answered when in the group, refused by
        // the socket's permissions otherwise; told to name the instance
        // when it does not (listing instances needs root).
        let drain = [
            "backend",
            "drain",
            "--vip",
            "10.77.0.100:80",
            "--backend",
            "10.77.0.99:8080",
        ];
        let named = [&drain[..], &["--instance", &instance]].concat();
        let out = lb_user_as(Identity::NobodyInGroup(1), &named);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{stderr}");
        let expected = if group.is_some() {
            "has no backend 10.77.0.99:8080"
        } else {
            "Permission denied"
        };
        assert!(stderr.contains(expected), "{group:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
        let out = lb_user_as(Identity::NobodyInGroup(1), &drain);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("not root: name the instance with --instance NAME"),
            "{stderr}"
        );
        // Refused peers, and a member's change, are logged with their
        // credentials.
        let last = if group.is_some() {
            "operator command refused"
        } else {
            "refused a peer"
        };
        let log = wait_for_log(&mut daemon.0, last);
        let refused = log
            .lines()
            .find(|l| l.contains("refused a peer"))
            .unwrap_or_default();
        assert!(refused.contains(&format!("uid={NOBODY}")), "{log}");
        if group.is_some() {
            let member = log
                .lines()
                .find(|l| l.contains("operator command refused"))
                .unwrap();
            assert!(member.contains(&format!("uid={NOBODY}")), "{log}");
        }
    }
}

/// Two instances share `/run/lb-user`: one with `--control-group`, then
/// one without. The second start must not lock the first one's group out
/// of its socket (the directory stays searchable), and neither lets the
/// group into the other; the files beside the sockets are root's alone.
#[test]
fn instances_with_and_without_a_control_group_share_the_socket_directory() {
    if skip("instances_with_and_without_a_control_group_share_the_socket_directory") {
        return;
    }
    let (grouped_ns, private_ns) = (Netns::new(), Netns::new());
    let (grouped, private) = (unique("sockg"), unique("sockp"));
    let _run_files = RunFiles(vec![grouped.clone(), private.clone()]);
    let mut args = lb0_args("skb", &grouped);
    args.extend(["--metrics-addr", "off", "--control-group", "daemon"]);
    let _grouped = grouped_ns.start_ready(&grouped, &args, Stdio::null());
    let mut args = lb0_args("skb", &private);
    args.extend(["--metrics-addr", "off"]);
    let _private = private_ns.start_ready(&private, &args, Stdio::null());
    let socket_dir = Path::new("/run/lb-user");
    assert_eq!(mode_of(socket_dir), (0o711, 0, 0));
    let socket = |instance: &str| socket_dir.join(format!("{instance}.sock"));
    // The group's member reaches the grouped instance (answered: this VIP
    // has no such backend), not the private one.
    let member = connect_as(Identity::NobodyInGroup(1), &socket(&grouped));
    assert!(
        member.contains("has no backend 10.77.0.99:8080"),
        "{member}"
    );
    let member = connect_as(Identity::NobodyInGroup(1), &socket(&private));
    assert!(member.contains("Permission denied"), "{member}");
    let stranger = connect_as(Identity::Nobody, &socket(&grouped));
    assert!(stranger.contains("Permission denied"), "{stranger}");
    // Each instance's lock and reserved-port record, and the records'
    // host-wide lock: root's alone.
    let mut files = vec![".reserved-ports.lock".to_string()];
    for instance in [&grouped, &private] {
        files.extend([
            format!("{instance}.lock"),
            format!("{instance}.reserved-ports"),
        ]);
    }
    for file in files {
        let (mode, uid, _) = mode_of(&socket_dir.join(&file));
        assert_eq!((mode, uid), (0o600, 0), "{file}");
    }
}

/// Two instances in one network namespace (one per interface), both with
/// the default SNAT ports: the first to stop cleanly keeps them reserved
/// for the other, which gives them back at its own stop.
/// Whether a TCP socket of namespace `ns` listens on `port`.
fn ns_listens_on(ns: &Netns, port: u16) -> bool {
    let out = Command::new("ip")
        .args(["netns", "exec", &ns.0, "ss", "-Htln"])
        .arg(format!("sport = :{port}"))
        .output()
        .unwrap();
    out.status.success() && !out.stdout.is_empty()
}

#[test]
fn two_instances_of_one_namespace_keep_shared_snat_ports_until_the_last_stops() {
    if skip("two_instances_of_one_namespace_keep_shared_snat_ports_until_the_last_stops") {
        return;
    }
    let ns = Netns::new();
    let ip = Command::new("ip")
        .args(["-n", &ns.0, "addr", "add", "10.78.0.1/24", "dev", "lb1"])
        .status()
        .unwrap();
    assert!(ip.success());
    let reserved = || {
        let out = Command::new("ip")
            .args(["netns", "exec", &ns.0, "sysctl", "-n"])
            .arg("net.ipv4.ip_local_reserved_ports")
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    assert_eq!(reserved(), "", "a new namespace reserves nothing");
    // Loopback up: the first instance serves metrics on the default address.
    let lo = Command::new("ip")
        .args(["-n", &ns.0, "link", "set", "lo", "up"])
        .status()
        .unwrap();
    assert!(lo.success());
    let (first, second) = (unique("share0"), unique("share1"));
    let _run_files = RunFiles(vec![first.clone(), second.clone()]);
    let first_daemon = ns.start_ready(&first, &lb0_args("skb", &first), Stdio::null());
    // The first binds the default metrics address after it reports ready:
    // wait for its listener, so the second is the one that finds it taken.
    let deadline = Instant::now() + STARTUP_BUDGET;
    while !ns_listens_on(&ns, 9470) {
        assert!(
            Instant::now() < deadline,
            "the first instance serves no metrics"
        );
        sleep(Duration::from_millis(50));
    }
    let second_args = [
        "--iface",
        "lb1",
        "--vip",
        "10.78.0.100:80",
        "--backend",
        "10.78.0.21:8080",
        "--xdp-mode",
        "skb",
        "--instance",
        &second,
    ];
    let mut second_daemon = ns.start_ready(&second, &second_args, Stdio::piped());
    // Both on the default metrics address: the second runs without metrics,
    // and its warning names the fix.
    let log = wait_for_log(&mut second_daemon.0, "metrics disabled");
    assert!(
        log.contains("Address already in use") && log.contains("needs its own --metrics-addr"),
        "{log}"
    );
    assert_eq!(reserved(), "20000-32767");
    drop(first_daemon);
    assert_eq!(
        reserved(),
        "20000-32767",
        "the second instance still uses the ports the first reserved"
    );
    drop(second_daemon);
    assert_eq!(reserved(), "", "the last instance gave them back");
}

#[test]
fn a_corrupt_state_file_stops_the_start_with_one_line_and_leaves_nothing() {
    if skip("a_corrupt_state_file_stops_the_start_with_one_line_and_leaves_nothing") {
        return;
    }
    let instance = unique("state");
    let _run_files = RunFiles(vec![instance.clone()]);
    let dir = std::env::temp_dir().join(unique("lb-state-dir"));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join(format!("{instance}.state.json"));
    std::fs::write(&file, "{\"version\":1,\"backends\":[{\"vip\":").unwrap();
    let out = run_as(
        &instance,
        &lo_vip_with(&["--state-dir", dir.to_str().unwrap()]),
    );
    assert_failed_cleanly(
        &out,
        &format!("cannot use the state file {}", file.display()),
        &instance,
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("move it away"), "{stderr}");
    // The file is left as it was, for the operator to look at.
    assert!(
        std::fs::read_to_string(&file)
            .unwrap()
            .starts_with("{\"version\"")
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Removes a directory tree when dropped (a test's, or where a failing
/// build put a file the test names).
struct RemoveDir(std::path::PathBuf);

impl Drop for RemoveDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Started through `ip netns exec`, lb-user joins the host's mount
/// namespace to reach its bpffs, which moves its working directory to `/`.
/// Relative paths still name the files they named at the start: the
/// config file a SIGHUP re-reads, and the state directory, read at the
/// start and written by a runtime change; and the state file's warnings
/// reach the log.
#[test]
fn relative_config_and_state_paths_keep_their_meaning_after_the_start() {
    if skip("relative_config_and_state_paths_keep_their_meaning_after_the_start") {
        return;
    }
    let ns = Netns::new();
    let instance = unique("relpath");
    let _run_files = RunFiles(vec![instance.clone()]);
    let dir = std::env::temp_dir().join(unique("lb-relpath"));
    let _dir = RemoveDir(dir.clone());
    let state_dir = unique("lb-relstate");
    // Where the state went when the paths were taken from `/`.
    let _stray = RemoveDir(Path::new("/").join(&state_dir));
    std::fs::create_dir_all(dir.join(&state_dir)).unwrap();
    std::fs::write(
        dir.join("lb.toml"),
        format!(
            "iface = \"lb0\"\ninstance = \"{instance}\"\nstate_dir = \"{state_dir}\"\n\
             [[vip]]\naddress = \"10.77.0.100:80\"\nbackends = [\"10.77.0.21:8080\"]\n"
        ),
    )
    .unwrap();
    // A runtime change an older build accepted and this one refuses (a
    // multicast backend): dropped with a warning at the start.
    let state_file = dir.join(&state_dir).join(format!("{instance}.state.json"));
    std::fs::write(
        &state_file,
        "{\"version\":1,\"backends\":[{\"vip\":\"10.77.0.100:80/tcp\",\
         \"backend\":\"224.0.0.5:80\",\"admin\":\"active\",\"weight\":1,\"config\":null}]}",
    )
    .unwrap();
    let child = ns
        .exec(&["--config", "lb.toml"])
        .current_dir(&dir)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start lb-user");
    let mut daemon = Daemon(child);
    wait_for_status(&ns, &instance);
    // What this test is about: `ip netns exec` gave lb-user a mount
    // namespace of its own, and lb-user joined this one (ours) from it.
    let mount_ns = |pid: &str| std::fs::read_link(format!("/proc/{pid}/ns/mnt")).unwrap();
    let netns_mount_ns = Command::new("ip")
        .args(["netns", "exec", &ns.0, "readlink", "/proc/self/ns/mnt"])
        .output()
        .unwrap();
    assert_ne!(
        String::from_utf8_lossy(&netns_mount_ns.stdout).trim(),
        mount_ns("self").to_string_lossy(),
        "ip netns exec gives a mount namespace of its own"
    );
    assert_eq!(
        mount_ns(&daemon.0.id().to_string()),
        mount_ns("self"),
        "lb-user did not join the host's mount namespace"
    );
    let out = ns
        .exec(&[
            "backend",
            "weight",
            "--vip",
            "10.77.0.100:80",
            "--backend",
            "10.77.0.21:8080",
            "--weight",
            "3",
            "--instance",
            &instance,
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Saved by a writer task, soon after the command's answer.
    let deadline = Instant::now() + STARTUP_BUDGET;
    let saved = loop {
        let saved = std::fs::read_to_string(&state_file).unwrap_or_default();
        if saved.contains("10.77.0.21:8080") || Instant::now() > deadline {
            break saved;
        }
        sleep(Duration::from_millis(50));
    };
    assert!(
        saved.contains("10.77.0.21:8080") && !saved.contains("224.0.0.5"),
        "the runtime change is saved in the state directory the start named: {saved}"
    );
    // SAFETY: plain kill(2) on our own child's pid.
    unsafe { libc::kill(daemon.0.id() as i32, libc::SIGHUP) };
    let log = wait_for_log(&mut daemon.0, "configuration reloaded");
    assert!(
        log.contains("dropped an entry the configuration's rules refuse")
            && log.contains("224.0.0.5:80"),
        "the state file's dropped entry is in the log: {log}"
    );
    assert!(!log.contains("keeping the running configuration"), "{log}");
}
