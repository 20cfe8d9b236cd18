use std::path::Path;

use clap::Parser;

use super::*;
use crate::settings::{
    cli::Cli,
    zone::{ZoneName, ZoneSettings},
};

/// Parses `argv` as the flags of a start (after the program name).
fn parse(argv: &[&str]) -> Result<RunArgs, clap::Error> {
    let mut full = vec!["lb-user"];
    full.extend_from_slice(argv);
    Cli::try_parse_from(full).map(|cli| cli.run)
}

/// The flags of a start, which must parse.
fn args(argv: &[&str]) -> RunArgs {
    parse(argv).expect("flags parse")
}

/// The configuration from flags alone.
fn from_flags(argv: &[&str]) -> Result<Config, ConfigError> {
    Config::merge(args(argv), FileConfig::default())
}

/// The configuration from a file (named `test.toml`) and flags.
fn from_file(text: &str, argv: &[&str]) -> Result<Config, ConfigError> {
    let file = FileConfig::parse(text, Path::new("test.toml"))?;
    Config::merge(args(argv), file)
}

/// One VIP with one backend on eth0: the least a start needs.
const MINIMAL: &[&str] = &[
    "--iface",
    "eth0",
    "--vip",
    "10.0.0.100:80",
    "--backend",
    "10.0.0.21:8080",
];

/// [`MINIMAL`] followed by `extra`.
fn minimal_with<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    [MINIMAL, extra].concat()
}

/// `--iface eth0 --vip 10.0.0.100:80` followed by `rest` (its backends).
fn eth0_vip<'a>(rest: &[&'a str]) -> Vec<&'a str> {
    [&["--iface", "eth0", "--vip", "10.0.0.100:80"][..], rest].concat()
}

/// A config file with `iface = "eth0"` and VIP 10.0.0.100:80 whose
/// `backends` value is the TOML text `backends`.
fn eth0_vip_file(backends: &str) -> String {
    format!("iface = \"eth0\"\n[[vip]]\naddress = \"10.0.0.100:80\"\nbackends = {backends}\n")
}

/// One value per VIP of `c`, in config order.
fn per_vip<T>(c: &Config, get: impl Fn(&VipConfig) -> T) -> Vec<T> {
    c.vips.iter().map(get).collect()
}

#[test]
fn minimal_flags_get_the_documented_defaults() {
    let c = from_flags(MINIMAL).unwrap();
    assert_eq!(c.iface, "eth0");
    assert_eq!(c.instance, "lb-eth0");
    assert_eq!(c.xdp_mode, XdpMode::Native);
    assert!(c.snat_ip.is_empty());
    assert_eq!(c.snat_ports, PortRange::default());
    assert_eq!(c.flow_table_size, DEFAULT_FLOW_TABLE_SIZE);
    assert_eq!(c.flow_table_size_ipv6, DEFAULT_FLOW_TABLE_SIZE);
    assert_eq!(c.ewma_tau, Duration::from_secs(10));
    // The peaks' memory follows --ewma-tau unless given.
    assert_eq!(c.ewma_peak_tau, Duration::from_secs(10));
    let short = from_flags(&minimal_with(&["--ewma-tau", "2s"])).unwrap();
    assert_eq!(short.ewma_peak_tau, Duration::from_secs(2));
    assert_eq!(c.ewma_refute_after, 16);
    assert_eq!(c.ewma_cold_start, Duration::from_millis(1));
    assert_eq!(c.score_interval, Duration::from_millis(50));
    assert_eq!(c.udp_idle_timeout, Duration::from_secs(30));
    assert_eq!(c.tcp_idle_timeout, Duration::from_secs(300));
    assert_eq!(c.syn_timeout, Duration::from_secs(3));
    assert_eq!(c.log_level, "info");
    assert_eq!(c.vips.len(), 1);
    let v = &c.vips[0];
    assert_eq!(v.vip.protocol, Protocol::Tcp);
    assert_eq!(v.algorithm, Algorithm::P2cEwma);
    assert_eq!(v.inflight_bias, 2);
    assert_eq!(v.backends[0].weight.get(), 1);
}

#[test]
fn flags_and_file_mean_the_same() {
    let flags = from_flags(&[
        "--iface",
        "veth1",
        "--vip",
        "10.0.0.100:53/udp",
        "--backend",
        "10.0.0.21:5353",
        "--backend",
        "10.0.0.22:5353@2",
        "--algorithm",
        "round-robin",
        "--inflight-bias",
        "3",
        "--xdp-mode",
        "skb",
        "--snat-ip",
        "10.0.0.1",
        "--snat-ports",
        "1000-2000",
        "--flow-table-size",
        "1024",
        "--flow-table-size-ipv6",
        "64",
        "--ewma-tau",
        "5s",
        "--ewma-peak-tau",
        "500ms",
        "--ewma-refute-after",
        "0",
        "--ewma-cold-start",
        "2ms",
        "--score-interval",
        "20ms",
        "--udp-idle-timeout",
        "10s",
        "--tcp-idle-timeout",
        "60s",
        "--syn-timeout",
        "1s",
        "--instance",
        "lab-1",
        "--log-level",
        "debug",
    ])
    .unwrap();
    let file = from_file(
        r#"
        iface = "veth1"
        algorithm = "round-robin"
        inflight_bias = 3
        xdp_mode = "skb"
        snat_ip = "10.0.0.1"
        snat_ports = "1000-2000"
        flow_table_size = 1024
        flow_table_size_ipv6 = 64
        ewma_tau = "5s"
        ewma_peak_tau = "500ms"
        ewma_refute_after = 0
        ewma_cold_start = "2ms"
        score_interval = "20ms"
        udp_idle_timeout = "10s"
        tcp_idle_timeout = "60s"
        syn_timeout = "1s"
        instance = "lab-1"
        log_level = "debug"
        [[vip]]
        address = "10.0.0.100:53"
        protocol = "udp"
        backends = ["10.0.0.21:5353", "10.0.0.22:5353@2"]
        "#,
        &[],
    )
    .unwrap();
    assert_eq!(flags, file);
}

#[test]
fn flags_override_file_globals_and_add_a_vip_last() {
    let c = from_file(
        r#"
        iface = "eth0"
        algorithm = "round-robin"
        instance = "from-file"
        [[vip]]
        address = "10.0.0.100:80"
        backends = ["10.0.0.21:8080"]
        [[vip]]
        address = "10.0.0.101:80"
        algorithm = "p2c-ewma"
        inflight_bias = 1
        backends = ["10.0.0.21:8080"]
        "#,
        &[
            "--iface",
            "eth1",
            "--algorithm",
            "p2c-ewma",
            "--vip",
            "10.0.0.102:80/udp",
            "--backend",
            "10.0.0.23:80",
        ],
    )
    .unwrap();
    assert_eq!(c.iface, "eth1");
    assert_eq!(c.instance, "from-file");
    assert_eq!(
        per_vip(&c, |v| v.vip.to_string()),
        [
            "10.0.0.100:80/tcp",
            "10.0.0.101:80/tcp",
            "10.0.0.102:80/udp"
        ]
    );
    // The flag replaced the file's global algorithm; a VIP's own setting wins.
    assert_eq!(c.vips[0].algorithm, Algorithm::P2cEwma);
    assert_eq!(c.vips[1].inflight_bias, 1);
    assert_eq!(c.vips[2].inflight_bias, DEFAULT_INFLIGHT_BIAS);
}

/// The error of flags alone that must not make a configuration, as text.
fn err_flags(argv: &[&str]) -> String {
    from_flags(argv).unwrap_err().to_string()
}

/// The error of a file and flags that must not make a configuration, as
/// text.
fn err_file_with_flags(text: &str, argv: &[&str]) -> String {
    without_position(&from_file(text, argv).unwrap_err().to_string())
}

/// The error of a file alone that must not make a configuration, as text
/// (without the position of a parse error: see [`err_file_at`]).
fn err_file(text: &str) -> String {
    err_file_with_flags(text, &[])
}

/// [`err_file`] with the position toml gives a parse error.
fn err_file_at(text: &str) -> String {
    from_file(text, &[]).unwrap_err().to_string()
}

/// `message` without the `line L, column C: ` after its file name.
fn without_position(message: &str) -> String {
    const FILE: &str = "test.toml: ";
    let Some((head, rest)) = message.split_once(FILE) else {
        return message.to_string();
    };
    let rest = match rest.strip_prefix("line ").and_then(|r| r.split_once(": ")) {
        Some((position, gist)) if position.contains(", column ") => gist,
        _ => rest,
    };
    format!("{head}{FILE}{rest}")
}

#[test]
fn each_bad_input_has_its_message() {
    let exact = [
        (
            vec!["--vip", "10.0.0.100:80", "--backend", "10.0.0.21:80"],
            "no interface given (use --iface or iface in the config file)",
        ),
        (
            vec!["--iface", "eth0"],
            "no VIP configured (use --vip with --backend, or [[vip]] in the config file)",
        ),
        (eth0_vip(&[]), "VIP 10.0.0.100:80/tcp has no backends"),
        (
            vec!["--iface", "eth0", "--backend", "10.0.0.21:80"],
            "--backend given without --vip",
        ),
        (
            eth0_vip(&["--backend", "10.0.0.21:80", "--backend", "10.0.0.21:80@2"]),
            "duplicate backend 10.0.0.21:80 in VIP 10.0.0.100:80/tcp",
        ),
        (
            minimal_with(&["--score-interval", "101ms"]),
            "score interval 101ms is out of range (1ms..=100ms)",
        ),
        (
            minimal_with(&["--score-interval", "500us"]),
            "score interval 500us is out of range (1ms..=100ms)",
        ),
        (
            vec![
                "--iface",
                "eth0",
                "--vip",
                "0.0.0.0:80",
                "--backend",
                "10.0.0.21:80",
            ],
            "VIP 0.0.0.0:80/tcp is the unspecified address, no host's address",
        ),
        (
            eth0_vip(&["--backend", "224.0.0.1:80"]),
            "backend 224.0.0.1:80 is a multicast address, no host's address",
        ),
        (
            eth0_vip(&["--backend", "255.255.255.255:80"]),
            "backend 255.255.255.255:80 is the broadcast address, no host's address",
        ),
        (
            eth0_vip(&["--backend", "10.0.0.100:80"]),
            "VIP 10.0.0.100:80/tcp lists itself as a backend",
        ),
        (
            minimal_with(&["--snat-ip", "0.0.0.0"]),
            "SNAT address 0.0.0.0 is the unspecified address, no host's address",
        ),
        (
            minimal_with(&["--snat-ip6", "::"]),
            "SNAT address :: is the unspecified address, no host's address",
        ),
        (
            vec![
                "--iface",
                "ä",
                "--vip",
                "10.0.0.100:80",
                "--backend",
                "10.0.0.21:80",
            ],
            "the interface name 'ä' cannot name the instance (lb-ä): give --instance NAME (1-64 letters, digits, '-', '_' or '.')",
        ),
        (
            minimal_with(&["--ewma-tau", "0s"]),
            "ewma tau must be greater than zero",
        ),
        (
            minimal_with(&["--flow-table-size", "1"]),
            "flow table size 1 is out of range (2..=268435456)",
        ),
        (
            minimal_with(&["--flow-table-size", "268435457"]),
            "flow table size 268435457 is out of range (2..=268435456)",
        ),
        (
            minimal_with(&["--snat-quarantine", "61m"]),
            "snat quarantine 61m is too long (at most 1h: TIME_WAIT is 60s on Linux, at most 4m elsewhere)",
        ),
        (
            minimal_with(&["--flow-table-size-ipv6", "0"]),
            "ipv6 flow table size 0 is out of range (2..=268435456)",
        ),
        (
            // IPv6's follows IPv4's when not given, and is checked as such.
            minimal_with(&["--flow-table-size", "1"]),
            "flow table size 1 is out of range (2..=268435456)",
        ),
        (
            vec![
                "--iface",
                "eth0",
                "--vip",
                "[2001:db8::1]:80",
                "--backend",
                "10.0.0.21:80",
            ],
            "backend 10.0.0.21:80 of VIP [2001:db8::1]:80/tcp: a VIP and its backends must be of one address family",
        ),
        (
            vec![
                "--iface",
                "a-very-long-interface-name",
                "--vip",
                "10.0.0.100:80",
                "--backend",
                "10.0.0.21:80",
            ],
            "invalid interface name 'a-very-long-interface-name'",
        ),
    ];
    for (argv, expected) in exact {
        assert_eq!(err_flags(&argv), expected, "{argv:?}");
    }
    for (argv, start) in [
        (
            minimal_with(&["--instance", "../x"]),
            "invalid instance name '../x'",
        ),
        // The shared SNAT ports' lock, `/run/lb-user/.reserved-ports.lock`,
        // would be its lock file.
        (
            minimal_with(&["--instance", ".reserved-ports"]),
            "invalid instance name '.reserved-ports'",
        ),
        (
            minimal_with(&["--instance", "."]),
            "invalid instance name '.'",
        ),
        (
            minimal_with(&["--log-level", "loud"]),
            "invalid log level 'loud'",
        ),
    ] {
        let err = err_flags(&argv);
        assert!(err.starts_with(start), "{argv:?}: {err}");
    }
}

#[test]
fn bad_files_have_their_messages() {
    assert_eq!(
        err_file(
            r#"iface = "eth0"
            [[vip]]
            address = "10.0.0.100:80"
            backends = ["10.0.0.21:80"]
            [[vip]]
            address = "10.0.0.100:80/tcp"
            backends = ["10.0.0.22:80"]"#
        ),
        "duplicate VIP 10.0.0.100:80/tcp"
    );
    assert_eq!(
        err_file("iface = \"eth0\"\n[[vip]]\naddress = \"10.0.0.100:80\"\n"),
        "VIP 10.0.0.100:80/tcp has no backends"
    );
    assert_eq!(
        err_file(
            "iface = \"eth0\"\n[[vip]]\naddress = \"10.0.0.100:80/udp\"\nprotocol = \"tcp\"\nbackends = [\"10.0.0.21:80\"]\n"
        ),
        "VIP 10.0.0.100:80/udp says protocol tcp but its address says otherwise"
    );
    assert_eq!(
        err_file(
            "iface = \"eth0\"\n[[vip]]\naddress = \"10.0.0.100\"\nbackends = [\"10.0.0.21:80\"]\n"
        ),
        "in config file: invalid address '10.0.0.100' (expected IP:PORT)"
    );
    // The position of the bad key, then toml's gist.
    let unknown = err_file_at("iface = \"eth0\"\nifaces = \"x\"\n");
    assert!(
        unknown
            .starts_with("invalid config file test.toml: line 2, column 1: unknown field `ifaces`"),
        "{unknown}"
    );
    let weight =
        err_file("[[vip]]\naddress = \"10.0.0.100:80\"\nbackends = [\"10.0.0.21:80@0\"]\n");
    assert!(weight.contains("invalid weight '0'"), "{weight}");
    let peak = err_flags(&minimal_with(&[
        "--ewma-tau",
        "2s",
        "--ewma-peak-tau",
        "3s",
    ]));
    assert_eq!(
        peak,
        "ewma peak tau 3s is longer than ewma tau 2s (the peaks' memory is the short one)"
    );
    let duration = err_file("ewma_tau = \"10\"\n");
    assert!(duration.contains("invalid duration '10'"), "{duration}");
    assert!(!duration.contains('\n'));
    // A duration past 30 days, which the kernel's nanoseconds would
    // otherwise take saturated, is refused where it is written.
    let long = err_file("tcp_idle_timeout = \"721h\"\n");
    assert!(
        long.contains("duration '721h' is too long (at most 720h)"),
        "{long}"
    );
}

#[test]
fn unreadable_file_names_the_path() {
    let e = FileConfig::read(Path::new("/nonexistent/lb.toml")).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("cannot read config file /nonexistent/lb.toml: "),
        "{e}"
    );
}

#[test]
fn a_reload_says_what_it_applies_and_what_needs_a_restart() {
    let running = from_flags(&eth0_vip(&[
        "--backend",
        "10.0.0.21:8080",
        "--backend",
        "10.0.0.22:8080",
    ]))
    .unwrap();
    let reloaded = from_flags(&eth0_vip(&[
        "--backend",
        "10.0.0.22:8080@3",
        "--backend",
        "10.0.0.23:8080",
        "--algorithm",
        "maglev",
        "--ewma-tau",
        "5s",
        "--slow-start",
        "2s",
    ]))
    .unwrap();
    assert_eq!(
        backend_changes(&running, &reloaded),
        [
            "VIP 10.0.0.100:80/tcp: added [10.0.0.23:8080@1], removed [10.0.0.21:8080], re-weighted [10.0.0.22:8080@3]"
        ]
    );
    let restart = needs_restart(&running, &reloaded);
    assert_eq!(restart.len(), 4, "{restart:?}");
    assert!(restart[0].starts_with("ewma_tau (10s → 5s)"), "{restart:?}");
    // The peaks' memory follows ewma_tau.
    assert!(
        restart[1].starts_with("ewma_peak_tau (10s → 5s)"),
        "{restart:?}"
    );
    assert_eq!(restart[2], "ops.slow_start (10s → 2s)");
    assert_eq!(
        restart[3],
        "VIP 10.0.0.100:80/tcp algorithm (p2c-ewma → maglev)"
    );
    assert!(needs_restart(&running, &running).is_empty());
    assert!(backend_changes(&running, &running).is_empty());
    // What the instance runs with after the reload: the backends change,
    // the settings that need a restart keep their running values, so the
    // same file read again is warned of again.
    let mut held = reloaded.clone();
    assert_eq!(hold_restart_settings(&running, &mut held), restart);
    assert!(needs_restart(&running, &held).is_empty(), "all held");
    assert_eq!(needs_restart(&held, &reloaded), restart, "warned again");
    assert_eq!(held.ops.lifecycle, running.ops.lifecycle);
    assert_eq!(held.vips[0].algorithm, running.vips[0].algorithm);
    assert_eq!(held.vips[0].backends, reloaded.vips[0].backends);
}

/// The report of what needs a restart gives each value as the flags and
/// the file write it, and a setting made of several keys one line per key
/// that changed.
#[test]
fn a_reload_reports_values_as_written() {
    let running = from_flags(&minimal_with(&["--snat-ip", "10.0.0.1"])).unwrap();
    let reloaded = from_flags(&minimal_with(&[
        "--xdp-mode",
        "skb",
        "--snat-ip",
        "10.0.0.1",
        "--snat-ip",
        "10.0.0.2",
        "--snat-ports",
        "30000-39999",
        "--tcp-idle-timeout",
        "600s",
        "--log-level",
        "debug",
        "--state-dir",
        "/run/lb",
        "--slow-start",
        "30s",
        "--slow-start-floor",
        "0.25",
        "--outlier-consecutive",
        "3",
        "--outlier-latency-factor",
        "2.5",
        "--metrics-addr",
        "off",
        "--control-group",
        "root",
    ]))
    .unwrap();
    assert_eq!(
        needs_restart(&running, &reloaded),
        [
            "xdp_mode (native → skb)",
            "snat_ip (10.0.0.1 → 10.0.0.1,10.0.0.2)",
            "snat_ports (20000-32767 → 30000-39999)",
            "tcp_idle_timeout (5m → 10m)",
            "log_level (info → debug)",
            "state_dir (/var/lib/lb-user → /run/lb)",
            "ops.slow_start (10s → 30s)",
            "ops.slow_start_floor (0.5 → 0.25)",
            "ops.outlier_consecutive (5 → 3)",
            "ops.outlier_latency_factor (0 → 2.5)",
            "ops.metrics_addr (127.0.0.1:9470 → off)",
            "ops.control_group (root only → root)",
        ]
    );
    // And back: no pool is the interface's address; off to a listener.
    let plain = from_flags(&minimal_with(&["--metrics-addr", "127.0.0.1:9100"])).unwrap();
    let back = needs_restart(&reloaded, &plain);
    assert_eq!(
        back[1],
        "snat_ip (10.0.0.1,10.0.0.2 → the interface's address)"
    );
    assert!(
        back.contains(&"ops.metrics_addr (off → 127.0.0.1:9100)".to_string()),
        "{back:?}"
    );
    // Held like before: the whole of each, not only the keys named.
    let mut held = reloaded.clone();
    hold_restart_settings(&running, &mut held);
    assert_eq!(held.ops, running.ops);
    assert_eq!(held.snat_ports, running.snat_ports);
}

#[test]
fn snat_pools_from_flags_and_file() {
    let argv = minimal_with(&["--snat-ip", "10.0.0.1", "--snat-ip", "10.0.0.2"]);
    let c = from_flags(&argv).unwrap();
    assert_eq!(
        c.snat_ip,
        [
            "10.0.0.1".parse::<std::net::Ipv4Addr>().unwrap(),
            "10.0.0.2".parse().unwrap()
        ]
    );
    // The old single value still works; a list makes a pool.
    let one = from_file(r#"snat_ip = "10.0.0.9""#, MINIMAL).unwrap();
    assert_eq!(
        one.snat_ip,
        ["10.0.0.9".parse::<std::net::Ipv4Addr>().unwrap()]
    );
    let pool = from_file(r#"snat_ip6 = ["2001:db8::5", "2001:db8::6"]"#, MINIMAL).unwrap();
    assert_eq!(pool.snat_ip6.len(), 2);
    // Flags replace the file's pool.
    let flags_win = from_file(r#"snat_ip = ["10.0.0.7", "10.0.0.8"]"#, &argv).unwrap();
    assert_eq!(flags_win.snat_ip, c.snat_ip);
}

#[test]
fn bad_snat_pools_are_refused() {
    assert_eq!(
        err_flags(&minimal_with(&[
            "--snat-ip",
            "10.0.0.1",
            "--snat-ip",
            "10.0.0.1"
        ])),
        "SNAT address 10.0.0.1 given twice"
    );
    let many: Vec<String> = (0..=lb_common::MAX_SNAT_ADDRS)
        .map(|i| format!("\"10.9.{}.{}\"", i / 200, i % 200 + 1))
        .collect();
    let text = format!("snat_ip = [{}]", many.join(", "));
    let err = err_file_with_flags(&text, MINIMAL);
    assert!(err.contains("IPv4 SNAT addresses"), "{err}");
    let err = err_file_with_flags(r#"snat_ip = ["10.0.0.1", "nope"]"#, MINIMAL);
    assert!(err.contains("test.toml"), "{err}");
}

/// A start with VIP `vip` (its backend of its family) and `extra` flags.
fn vip_start<'a>(vip: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let backend = if vip.starts_with('[') {
        "[2001:db8::21]:8080"
    } else {
        "10.0.0.21:8080"
    };
    [
        &["--iface", "eth0", "--vip", vip, "--backend", backend][..],
        extra,
    ]
    .concat()
}

#[test]
fn a_vip_on_a_snat_address_keeps_its_port_out_of_the_snat_range() {
    // The data path drops a packet of no flow to a SNAT address and port
    // before it looks for a VIP: such a VIP would take no connection.
    assert_eq!(
        err_flags(&vip_start("10.0.0.1:25000", &["--snat-ip", "10.0.0.1"])),
        "VIP 10.0.0.1:25000/tcp is on SNAT address 10.0.0.1 with its port in the SNAT port range \
         20000-32767: the balancer would drop every new connection to it as a reply to a SNAT \
         connection that has ended (move the VIP's port out of --snat-ports, or use another \
         --snat-ip)"
    );
    assert_eq!(
        err_flags(&vip_start(
            "[2001:db8::1]:20000/udp",
            &["--snat-ip6", "2001:db8::9", "--snat-ip6", "2001:db8::1"]
        )),
        "VIP [2001:db8::1]:20000/udp is on SNAT address 2001:db8::1 with its port in the SNAT \
         port range 20000-32767: the balancer would drop every new connection to it as a reply \
         to a SNAT connection that has ended (move the VIP's port out of --snat-ports, or use \
         another --snat-ip6)"
    );
    // The range's ends are in it.
    let ends = ["--snat-ip", "10.0.0.1", "--snat-ports", "1000-2000"];
    for port in ["1000", "2000"] {
        let vip = format!("10.0.0.1:{port}");
        let err = err_flags(&vip_start(&vip, &ends));
        assert!(err.contains("SNAT port range 1000-2000"), "{err}");
    }
    // From the file's pool too.
    let text = "snat_ip = [\"10.0.0.2\", \"10.0.0.1\"]\n[[vip]]\naddress = \"10.0.0.1:30000\"\n\
                backends = [\"10.0.0.21:80\"]\n";
    let err = err_file_with_flags(text, &["--iface", "eth0"]);
    assert!(
        err.starts_with("VIP 10.0.0.1:30000/tcp is on SNAT address 10.0.0.1"),
        "{err}"
    );
    // A port out of the range, another address, or the other family is fine.
    for (vip, extra) in [
        ("10.0.0.1:80", &["--snat-ip", "10.0.0.1"][..]),
        ("10.0.0.1:999", &ends[..]),
        ("10.0.0.1:2001", &ends[..]),
        ("10.0.0.2:25000", &["--snat-ip", "10.0.0.1"][..]),
        ("[2001:db8::1]:25000", &["--snat-ip", "10.0.0.1"][..]),
    ] {
        assert!(
            from_flags(&vip_start(vip, extra)).is_ok(),
            "{vip} {extra:?}"
        );
    }
}

#[test]
fn addresses_that_never_work_are_refused() {
    let cases = [
        (
            vip_start("127.0.0.1:80", &[]),
            "VIP 127.0.0.1:80/tcp is a loopback address, which never crosses a wire",
        ),
        (
            eth0_vip(&["--backend", "127.1.2.3:80"]),
            "backend 127.1.2.3:80 is a loopback address, which never crosses a wire",
        ),
        (
            vec![
                "--iface",
                "eth0",
                "--vip",
                "[2001:db8::1]:80",
                "--backend",
                "[::1]:80",
            ],
            "backend [::1]:80 is a loopback address, which never crosses a wire",
        ),
        (
            vip_start("[::ffff:10.0.0.100]:80", &[]),
            "VIP [::ffff:10.0.0.100]:80/tcp is an IPv4-mapped IPv6 address, which no IPv6 packet \
             carries (write the IPv4 address itself)",
        ),
        (
            vec![
                "--iface",
                "eth0",
                "--vip",
                "[2001:db8::1]:80",
                "--backend",
                "[::ffff:10.0.0.21]:80",
            ],
            "backend [::ffff:10.0.0.21]:80 is an IPv4-mapped IPv6 address, which no IPv6 packet \
             carries (write the IPv4 address itself)",
        ),
        (
            minimal_with(&["--snat-ip", "127.0.0.1"]),
            "SNAT address 127.0.0.1 is a loopback address, which never crosses a wire",
        ),
        (
            minimal_with(&["--snat-ip6", "::1"]),
            "SNAT address ::1 is a loopback address, which never crosses a wire",
        ),
        (
            minimal_with(&["--snat-ip6", "::ffff:10.0.0.1"]),
            "SNAT address ::ffff:10.0.0.1 is an IPv4-mapped IPv6 address, which no IPv6 packet \
             carries (write the IPv4 address itself)",
        ),
        (
            minimal_with(&["--snat-ip", "10.0.0.9", "--snat-ip", "10.0.0.21"]),
            "backend 10.0.0.21:8080 of VIP 10.0.0.100:80/tcp is at SNAT address 10.0.0.21: the \
             balancer would send it its connections from its own address (use another \
             --snat-ip, or another backend)",
        ),
        (
            vip_start("[2001:db8::1]:80", &["--snat-ip6", "2001:db8::21"]),
            "backend [2001:db8::21]:8080 of VIP [2001:db8::1]:80/tcp is at SNAT address \
             2001:db8::21: the balancer would send it its connections from its own address (use \
             another --snat-ip6, or another backend)",
        ),
    ];
    for (argv, message) in cases {
        assert_eq!(err_flags(&argv), message, "{argv:?}");
    }
    // A SNAT address on the VIP's address (its port out of the range),
    // an address next to 127/8, and an IPv6 one with ffff not in the
    // mapped place are fine.
    for argv in [
        minimal_with(&["--snat-ip", "10.0.0.100"]),
        eth0_vip(&["--backend", "128.0.0.1:80"]),
        vec![
            "--iface",
            "eth0",
            "--vip",
            "[2001:db8::1]:80",
            "--backend",
            "[2001:db8::ffff:a00:15]:80",
        ],
    ] {
        assert!(from_flags(&argv).is_ok(), "{argv:?}");
    }
}

#[test]
fn snat_quarantine_from_flag_file_or_default() {
    assert_eq!(
        from_flags(MINIMAL).unwrap().snat_quarantine,
        Duration::from_secs(65)
    );
    assert_eq!(
        from_flags(&minimal_with(&["--snat-quarantine", "30s"]))
            .unwrap()
            .snat_quarantine,
        Duration::from_secs(30)
    );
    let file = from_file(r#"snat_quarantine = "2m""#, MINIMAL).unwrap();
    assert_eq!(file.snat_quarantine, Duration::from_secs(120));
    assert_eq!(
        err_flags(&minimal_with(&["--snat-quarantine", "0s"])),
        "snat quarantine must be greater than zero"
    );
}

/// Asserts that going from `running` to `reloaded` needs a restart for the
/// setting named `key`.
fn assert_needs_restart(running: &Config, reloaded: &Config, key: &str) {
    let restart = needs_restart(running, reloaded);
    assert!(restart.iter().any(|r| r.starts_with(key)), "{restart:?}");
}

#[test]
fn snat_time_wait_reuse_is_on_unless_turned_off_and_needs_a_restart() {
    assert!(from_flags(MINIMAL).unwrap().snat_time_wait_reuse);
    let off = from_flags(&minimal_with(&["--snat-time-wait-reuse", "off"])).unwrap();
    assert!(!off.snat_time_wait_reuse);
    let file = from_file("snat_time_wait_reuse = false", MINIMAL).unwrap();
    assert!(!file.snat_time_wait_reuse);
    // The flag wins over the file.
    let both = from_file(
        "snat_time_wait_reuse = false",
        &minimal_with(&["--snat-time-wait-reuse", "on"]),
    )
    .unwrap();
    assert!(both.snat_time_wait_reuse);
    let yes = flag_err(&["--snat-time-wait-reuse", "yes"]);
    assert!(yes.contains("expected on or off"), "{yes}");
    // Both SNAT settings are written once, at start.
    let running = from_flags(MINIMAL).unwrap();
    assert_needs_restart(&running, &off, "snat_time_wait_reuse");
    let shorter = from_flags(&minimal_with(&["--snat-quarantine", "30s"])).unwrap();
    assert_needs_restart(&running, &shorter, "snat_quarantine");
}

/// The zone named `name`, which must be a valid name.
fn zone(name: &str) -> ZoneName {
    name.parse().unwrap()
}

#[test]
fn zone_settings_default_to_no_zone_and_no_zone_aware_vip() {
    let c = from_flags(MINIMAL).unwrap();
    assert_eq!(c.zones, ZoneSettings::default());
    assert_eq!(c.zones.local, None);
    assert_eq!(c.zones.min_healthy, 0.70);
    assert_eq!(c.zones.avoid_factor, 3.0);
    assert!(c.zones.failover.is_empty());
    assert!(!c.vips[0].zone_aware);
    assert_eq!(c.vips[0].backends[0].zone, None);
    // With a zone, every VIP is zone-aware unless it says otherwise.
    let c = from_file(
        r#"
        zone = "a"
        [[vip]]
        address = "10.0.0.101:80"
        backends = ["10.0.0.21:8080"]
        [[vip]]
        address = "10.0.0.102:80"
        zone_aware = false
        backends = ["10.0.0.21:8080"]
        "#,
        MINIMAL,
    )
    .unwrap();
    assert_eq!(c.zones.local, Some(zone("a")));
    assert_eq!(per_vip(&c, |v| v.zone_aware), [true, false, true]);
}

#[test]
fn zone_flags_and_keys_mean_the_same_and_flags_win() {
    let argv = minimal_with(&[
        "--zone",
        "a",
        "--zone-min-healthy",
        "50%",
        "--zone-avoid-factor",
        "2.5",
        "--zone-failover",
        "c,b",
        "--zone-aware",
        "off",
    ]);
    let flags = from_flags(&argv).unwrap();
    let file = from_file(
        r#"
        zone = "a"
        zone_min_healthy = 50
        zone_avoid_factor = 2.5
        zone_failover = ["c", "b"]
        zone_aware = false
        "#,
        MINIMAL,
    )
    .unwrap();
    assert_eq!(flags, file);
    assert_eq!(
        flags.zones,
        ZoneSettings {
            local: Some(zone("a")),
            min_healthy: 0.5,
            avoid_factor: 2.5,
            failover: vec![zone("c"), zone("b")],
        }
    );
    assert!(!flags.vips[0].zone_aware);

    // Flags over the file's keys; the file's global zone_aware over the
    // default, a VIP's own over both.
    let text = r#"
        zone = "a"
        zone_min_healthy = "90%"
        zone_avoid_factor = 5
        zone_failover = ["b"]
        zone_aware = false
        [[vip]]
        address = "10.0.0.101:80"
        zone_aware = true
        backends = ["10.0.0.21:8080"]
        [[vip]]
        address = "10.0.0.102:80"
        backends = ["10.0.0.21:8080"]
    "#;
    let file_only = from_file(text, MINIMAL).unwrap();
    assert_eq!(file_only.zones.min_healthy, 0.9);
    assert_eq!(file_only.zones.avoid_factor, 5.0);
    assert_eq!(per_vip(&file_only, |v| v.zone_aware), [true, false, false]);
    let argv = minimal_with(&[
        "--zone",
        "b",
        "--zone-min-healthy",
        "75",
        "--zone-avoid-factor",
        "1",
        "--zone-failover",
        "a",
        "--zone-failover",
        "c",
        "--zone-aware",
        "on",
    ]);
    let both = from_file(text, &argv).unwrap();
    assert_eq!(both.zones.local, Some(zone("b")));
    assert_eq!(both.zones.min_healthy, 0.75);
    assert_eq!(both.zones.avoid_factor, 1.0);
    assert_eq!(both.zones.failover, [zone("a"), zone("c")]);
    assert_eq!(per_vip(&both, |v| v.zone_aware), [true, true, true]);
}

/// The one-line error of [`MINIMAL`] with `extra`, from the flag parser or
/// from the merge.
fn flag_err(extra: &[&str]) -> String {
    match parse(&minimal_with(extra)) {
        Ok(run) => Config::merge(run, FileConfig::default())
            .unwrap_err()
            .to_string(),
        Err(e) => one_line(&e.to_string()),
    }
}

#[test]
fn zone_min_healthy_is_a_percentage() {
    for (text, fraction) in [("70", 0.70), ("70%", 0.70), ("1", 0.01), ("100%", 1.0)] {
        let c = from_flags(&minimal_with(&["--zone-min-healthy", text])).unwrap();
        assert_eq!(c.zones.min_healthy, fraction);
    }
    for bad in ["0", "101", "-5", "x", "70%%"] {
        let err = flag_err(&["--zone-min-healthy", bad]);
        assert!(
            err.contains(&format!(
                "invalid zone min healthy '{bad}' (expected a percentage in 1..=100, e.g. 70 or 70%)"
            )),
            "{bad}: {err}"
        );
    }
    for (key, bad) in [
        ("0", "0"),
        ("101", "101"),
        ("-5", "-5"),
        ("\"x\"", "x"),
        ("\"0%\"", "0%"),
        ("100.5", "100.5"),
    ] {
        let err = err_file_at(&format!("zone_min_healthy = {key}"));
        assert_eq!(
            err,
            format!(
                "invalid config file test.toml: line 1, column 20: invalid zone min healthy '{bad}' (expected a percentage in 1..=100, e.g. 70 or 70%)"
            ),
            "{key}"
        );
    }
    assert_eq!(
        from_file("zone_min_healthy = 62.5", MINIMAL)
            .unwrap()
            .zones
            .min_healthy,
        0.625
    );
}

#[test]
fn zone_avoid_factor_is_finite_and_at_least_one() {
    for bad in ["0.5", "0", "-1", "NaN", "inf"] {
        assert_eq!(
            flag_err(&["--zone-avoid-factor", bad]),
            format!(
                "zone avoid factor {} is invalid (expected a finite number of at least 1)",
                bad.parse::<f64>().unwrap()
            ),
            "{bad}"
        );
    }
    assert!(flag_err(&["--zone-avoid-factor", "x"]).contains("invalid float"));
    for key in ["0.99", "nan", "inf"] {
        let err = err_file_with_flags(&format!("zone_avoid_factor = {key}"), MINIMAL);
        assert!(err.starts_with("zone avoid factor "), "{key}: {err}");
    }
}

#[test]
fn zone_failover_lists_other_zones_once_and_needs_a_zone() {
    assert_eq!(
        flag_err(&["--zone", "a", "--zone-failover", "b,c,b"]),
        "zone failover lists zone b twice"
    );
    assert_eq!(
        flag_err(&["--zone", "a", "--zone-failover", "b,a"]),
        "zone failover lists the balancer's own zone a"
    );
    assert_eq!(
        flag_err(&["--zone-failover", "b"]),
        "zone failover needs the balancer's own zone (use --zone or zone in the config file)"
    );
    assert_eq!(
        err_file_with_flags(r#"zone_failover = ["b"]"#, MINIMAL),
        "zone failover needs the balancer's own zone (use --zone or zone in the config file)"
    );
    // The file's zone is enough for the flag's list, and the reverse.
    assert!(from_file(r#"zone = "a""#, &minimal_with(&["--zone-failover", "b"])).is_ok());
    assert_eq!(
        err_file_with_flags(
            r#"zone_failover = ["b", "b"]"#,
            &minimal_with(&["--zone", "a"])
        ),
        "zone failover lists zone b twice"
    );
    assert!(
        err_file(r#"zone_failover = ["b c"]"#).contains("may only use"),
        "a bad name in the list"
    );
    assert!(flag_err(&["--zone", "a b"]).contains("may only use"));
}

#[test]
fn zone_aware_needs_the_balancers_zone() {
    assert_eq!(
        flag_err(&["--zone-aware", "on"]),
        "VIP 10.0.0.100:80/tcp is zone-aware but the balancer has no zone (use --zone or zone in the config file)"
    );
    assert!(flag_err(&["--zone-aware", "yes"]).contains("expected on or off"));
    assert!(from_flags(&minimal_with(&["--zone-aware", "off"])).is_ok());
    let err = err_file(
        r#"
        iface = "eth0"
        [[vip]]
        address = "10.0.0.101:80"
        zone_aware = true
        backends = ["10.0.0.21:8080"]
        "#,
    );
    assert_eq!(
        err,
        "VIP 10.0.0.101:80/tcp is zone-aware but the balancer has no zone (use --zone or zone in the config file)"
    );
    let err = err_file_with_flags("zone_aware = true", MINIMAL);
    assert!(
        err.contains("is zone-aware but the balancer has no zone"),
        "{err}"
    );
}

#[test]
fn backends_are_strings_or_tables_with_zones() {
    let c = from_file(
        r#"
        iface = "eth0"
        zone = "a"
        [[vip]]
        address = "10.0.0.100:80"
        backends = [
            "10.0.0.21:8080",
            "10.0.0.22:8080@2,zone=a",
            { addr = "10.0.0.23:8080", weight = 3, zone = "b" },
            { addr = "10.0.0.24:8080" },
            { addr = "10.0.0.25:8080", zone = "b" },
        ]
        "#,
        &[
            "--vip",
            "10.0.0.101:80",
            "--backend",
            "10.0.0.31:80@4,zone=b",
        ],
    )
    .unwrap();
    let got: Vec<String> = c.vips[0].backends.iter().map(|b| b.to_string()).collect();
    assert_eq!(
        got,
        [
            "10.0.0.21:8080@1",
            "10.0.0.22:8080@2,zone=a",
            "10.0.0.23:8080@3,zone=b",
            "10.0.0.24:8080@1",
            "10.0.0.25:8080@1,zone=b"
        ]
    );
    assert_eq!(c.vips[1].backends[0].zone, Some(zone("b")));
    assert_eq!(c.vips[1].backends[0].weight.get(), 4);

    let vip = |backends: &str| err_file(&eth0_vip_file(backends));
    let unknown = vip(r#"[{ addr = "10.0.0.21:80", region = "a" }]"#);
    assert!(
        unknown.starts_with("invalid config file test.toml: unknown field `region`"),
        "{unknown}"
    );
    assert_eq!(
        vip(r#"[{ addr = "10.0.0.21:80", zone = "a b" }]"#),
        "invalid config file test.toml: invalid zone in backend '10.0.0.21:80': zone name \"a b\" may only use A-Z, a-z, 0-9, '.', '_' and '-'"
    );
    assert_eq!(
        vip(r#"["10.0.0.21:80,zone=a/b"]"#),
        "invalid config file test.toml: invalid zone in backend '10.0.0.21:80,zone=a/b': zone name \"a/b\" may only use A-Z, a-z, 0-9, '.', '_' and '-'"
    );
    assert_eq!(
        vip(r#"["10.0.0.21:80,color=red"]"#),
        "invalid config file test.toml: unknown option 'color=red' in backend '10.0.0.21:80,color=red' (expected ,zone=NAME)"
    );
    for (weight, text) in [("0", "0"), ("65536", "65536"), ("-5", "-5")] {
        assert_eq!(
            vip(&format!(
                r#"[{{ addr = "10.0.0.21:80", weight = {weight} }}]"#
            )),
            format!(
                "invalid config file test.toml: invalid weight '{text}' (expected an integer in 1..=65535)"
            )
        );
    }
    let missing = vip(r#"[{ weight = 2 }]"#);
    assert!(missing.contains("missing field `addr`"), "{missing}");
    let bad_addr = vip(r#"[{ addr = "10.0.0.21" }]"#);
    assert!(
        bad_addr.ends_with("invalid address '10.0.0.21' (expected IP:PORT)"),
        "{bad_addr}"
    );
    let wrong_type = vip("[7]");
    assert!(
        wrong_type.contains("IP:PORT[@WEIGHT][,zone=NAME]"),
        "{wrong_type}"
    );
    // Identity is the address: the same address twice is a duplicate
    // whatever its zone.
    assert_eq!(
        vip(r#"["10.0.0.21:80,zone=a", { addr = "10.0.0.21:80", zone = "b" }]"#),
        "duplicate backend 10.0.0.21:80 in VIP 10.0.0.100:80/tcp"
    );
}

#[test]
fn a_reload_reports_a_backend_moved_to_another_zone() {
    let running = from_flags(&eth0_vip(&[
        "--backend",
        "10.0.0.21:8080,zone=a",
        "--backend",
        "10.0.0.22:8080",
    ]))
    .unwrap();
    let reloaded = from_flags(&eth0_vip(&[
        "--backend",
        "10.0.0.21:8080,zone=b",
        "--backend",
        "10.0.0.22:8080@2,zone=a",
        "--zone",
        "a",
    ]))
    .unwrap();
    assert_eq!(
        backend_changes(&running, &reloaded),
        [
            "VIP 10.0.0.100:80/tcp: added [], removed [], re-weighted [10.0.0.22:8080@2,zone=a], re-zoned [10.0.0.21:8080@1,zone=b, 10.0.0.22:8080@2,zone=a]"
        ]
    );
    // The zone settings and zone_aware are the reload's to apply.
    assert!(needs_restart(&running, &reloaded).is_empty());
}

/// A config file that sets `key = global` file-wide and has two VIPs: the
/// first takes the global, the second sets `key = 0` itself.
fn global_and_vip_override(key: &str, global: u16) -> String {
    format!(
        r#"
        iface = "eth0"
        {key} = {global}
        [[vip]]
        address = "10.0.0.100:80"
        backends = ["10.0.0.21:8080"]
        [[vip]]
        address = "10.0.0.101:80"
        {key} = 0
        backends = ["10.0.0.21:8080"]
        "#
    )
}

/// The only VIP of a file that sets nothing else.
fn unset_in_file() -> VipConfig {
    let c = from_file(&eth0_vip_file(r#"["10.0.0.21:8080"]"#), &[]).unwrap();
    c.vips[0].clone()
}

#[test]
fn the_full_scan_limit_comes_from_the_vip_the_file_the_flag_or_the_default() {
    let file = global_and_vip_override("p2c_full_scan", 4);
    let limits = |argv: &[&str]| per_vip(&from_file(&file, argv).unwrap(), |v| v.p2c_full_scan);
    assert_eq!(limits(&[]), [4, 0]);
    assert_eq!(
        limits(&["--p2c-full-scan", "32"]),
        [32, 0],
        "the flag replaces the file's global only"
    );
    assert_eq!(
        unset_in_file().p2c_full_scan,
        lb_common::DEFAULT_P2C_FULL_SCAN
    );
    let e = err_file("iface = \"eth0\"\np2c_full_scan = -1\n");
    assert!(e.contains("expected u16"), "{e}");
}

#[test]
fn the_saturation_threshold_comes_from_the_vip_the_file_the_flag_or_the_default() {
    let file = global_and_vip_override("p2c_saturation", 8);
    let limits = |argv: &[&str]| per_vip(&from_file(&file, argv).unwrap(), |v| v.p2c_saturation);
    assert_eq!(limits(&[]), [8, 0]);
    assert_eq!(
        limits(&["--p2c-saturation", "64"]),
        [64, 0],
        "the flag replaces the file's global only"
    );
    assert_eq!(
        unset_in_file().p2c_saturation,
        lb_common::DEFAULT_P2C_SATURATION
    );
    let e = err_file("iface = \"eth0\"\np2c_saturation = 70000\n");
    assert!(e.contains("u16"), "{e}");
}

#[test]
fn ipv6_flow_table_follows_the_flow_table_size_unless_given() {
    let both = from_flags(&minimal_with(&["--flow-table-size", "4096"])).unwrap();
    assert_eq!(
        (both.flow_table_size, both.flow_table_size_ipv6),
        (4096, 4096)
    );
    let apart = from_flags(&minimal_with(&[
        "--flow-table-size",
        "4096",
        "--flow-table-size-ipv6",
        "128",
    ]))
    .unwrap();
    assert_eq!(
        (apart.flow_table_size, apart.flow_table_size_ipv6),
        (4096, 128)
    );
    // From the file, and a flag over the file's value of the other key.
    const VIP: &str = "[[vip]]\naddress = \"10.0.0.100:80\"\nbackends = [\"10.0.0.21:8080\"]\n";
    let file = from_file(
        &format!("iface = \"eth0\"\nflow_table_size = 2048\n{VIP}"),
        &[],
    )
    .unwrap();
    assert_eq!(
        (file.flow_table_size, file.flow_table_size_ipv6),
        (2048, 2048)
    );
    let mixed = from_file(
        &format!("iface = \"eth0\"\nflow_table_size = 2048\nflow_table_size_ipv6 = 256\n{VIP}"),
        &["--flow-table-size", "8192"],
    )
    .unwrap();
    assert_eq!(
        (mixed.flow_table_size, mixed.flow_table_size_ipv6),
        (8192, 256)
    );
    // Each is fixed at attach: a reload that changes one needs a restart.
    assert_needs_restart(&both, &apart, "flow_table_size_ipv6");
}

/// Discovery is set up at the start: a reload keeps each running VIP's
/// etcd prefix (and a VIP that gains one its backends), adds no new VIP
/// with a prefix, and says so for each.
#[test]
fn a_reload_leaves_discovery_as_it_started() {
    let file = |vips: &str| {
        from_file(
            &format!("iface = \"eth0\"\netcd_endpoints = [\"http://127.0.0.1:2379\"]\n{vips}"),
            &[],
        )
        .unwrap()
    };
    let etcd = |address: &str, prefix: &str| {
        format!("[[vip]]\naddress = \"{address}\"\netcd_prefix = \"{prefix}\"\n")
    };
    let fixed = |address: &str, backend: &str| {
        format!("[[vip]]\naddress = \"{address}\"\nbackends = [\"{backend}\"]\n")
    };
    let running = file(&format!(
        "{}{}",
        etcd("10.0.0.100:80", "/lb/a/"),
        fixed("10.0.0.101:80", "10.0.0.31:80")
    ));
    let reloaded = file(&format!(
        "{}{}{}",
        fixed("10.0.0.100:80", "10.0.0.21:80"),
        etcd("10.0.0.101:80", "/lb/b/"),
        etcd("10.0.0.102:80", "/lb/c/")
    ));
    let restart = needs_restart(&running, &reloaded);
    for expected in [
        "VIP 10.0.0.100:80/tcp etcd_prefix (/lb/a/ → none)",
        "VIP 10.0.0.101:80/tcp etcd_prefix (none → /lb/b/)",
        "VIP 10.0.0.102:80/tcp with etcd prefix /lb/c/ (new)",
    ] {
        assert!(
            restart.iter().any(|r| r == expected),
            "{expected}: {restart:?}"
        );
    }
    let mut kept = reloaded.clone();
    keep_discovery(&running, &mut kept);
    let summary: Vec<(String, Option<String>, Vec<String>)> = kept
        .vips
        .iter()
        .map(|v| {
            (
                v.vip.to_string(),
                v.etcd_prefix.clone(),
                v.backends.iter().map(ToString::to_string).collect(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        [
            (
                "10.0.0.100:80/tcp".to_string(),
                Some("/lb/a/".to_string()),
                vec!["10.0.0.21:80@1".to_string()]
            ),
            (
                "10.0.0.101:80/tcp".to_string(),
                None,
                vec!["10.0.0.31:80@1".to_string()]
            ),
        ]
    );
    // Other etcd settings are reported without their values.
    let elsewhere = from_file(
        &format!(
            "iface = \"eth0\"\netcd_endpoints = [\"http://127.0.0.2:2379\"]\n{}",
            etcd("10.0.0.100:80", "/lb/a/")
        ),
        &[],
    )
    .unwrap();
    let restart = needs_restart(&running, &elsewhere);
    assert!(
        restart.contains(&"etcd settings (endpoints, TLS files or user)".to_string()),
        "{restart:?}"
    );
    assert!(
        !restart.iter().any(|r| r.contains("127.0.0.2")),
        "{restart:?}"
    );
}

/// A reload whose file passes but that holding breaks is refused whole,
/// naming what is held: VIP A going from Maglev to P2C keeps Maglev until
/// a restart, so the file's new Maglev VIP B does not fit the table limit
/// the file was measured against.
#[test]
fn a_reload_that_holding_breaks_is_refused_naming_what_is_held() {
    let vip = |n: u32, algorithm: &str| {
        format!(
            "[[vip]]\naddress = \"10.0.1.{n}:80\"\nalgorithm = \"{algorithm}\"\nbackends = [\"10.0.0.21:80\"]\n"
        )
    };
    let file = |vips: &[String]| from_file(&format!("iface = \"eth0\"\n{}", vips.concat()), &[]);
    let limit = MAX_MAGLEV_TABLES;
    // VIP A (10.0.1.1) and the others on Maglev: the limit, all in use.
    let running = file(&(1..=limit).map(|n| vip(n, "maglev")).collect::<Vec<_>>()).unwrap();
    // A to P2C, B (10.0.1.100) added on Maglev: the file is within the limit.
    let mut vips: Vec<String> = (2..=limit).map(|n| vip(n, "maglev")).collect();
    vips.push(vip(1, "p2c-ewma"));
    vips.push(vip(100, "maglev"));
    let reloaded = file(&vips).expect("the file alone is valid");
    let err = held_reload(&running, &reloaded).unwrap_err();
    assert_eq!(
        err,
        ConfigError::HeldUntilRestart {
            held: "VIP 10.0.1.1:80/tcp algorithm (maglev → p2c-ewma)".into(),
            error: Box::new(ConfigError::TooMany {
                what: "VIPs using maglev",
                count: limit as usize + 1,
                max: limit,
            }),
        }
    );
    assert_eq!(
        err.to_string(),
        format!(
            "too many VIPs using maglev: {} (at most {limit}) once what needs a restart is \
             kept as it runs (VIP 10.0.1.1:80/tcp algorithm (maglev → p2c-ewma)); a restart \
             applies the file",
            limit + 1
        )
    );
    // Without B, A keeps Maglev and the rest applies.
    vips.pop();
    let (held, restart) = held_reload(&running, &file(&vips).unwrap()).unwrap();
    assert_eq!(
        restart,
        ["VIP 10.0.1.1:80/tcp algorithm (maglev → p2c-ewma)"]
    );
    assert!(held.vips.iter().all(|v| v.algorithm == Algorithm::Maglev));
}

/// A VIP that keeps following etcd keeps it whatever backends the file
/// gives it (discovery's are used): not a reason to refuse the reload.
#[test]
fn a_reload_that_keeps_a_vip_on_etcd_is_not_refused_for_its_file_backends() {
    let running = from_file(
        "iface = \"eth0\"\netcd_endpoints = [\"http://127.0.0.1:2379\"]\n\
         [[vip]]\naddress = \"10.0.0.100:80\"\netcd_prefix = \"/lb/a/\"\n",
        &[],
    )
    .unwrap();
    let reloaded = from_file(
        "iface = \"eth0\"\netcd_endpoints = [\"http://127.0.0.1:2379\"]\n\
         [[vip]]\naddress = \"10.0.0.100:80\"\nbackends = [\"10.0.0.21:80\"]\n",
        &[],
    )
    .unwrap();
    let (held, restart) = held_reload(&running, &reloaded).unwrap();
    assert_eq!(
        restart,
        ["VIP 10.0.0.100:80/tcp etcd_prefix (/lb/a/ → none)"]
    );
    assert_eq!(held.vips[0].etcd_prefix.as_deref(), Some("/lb/a/"));
}

/// Settings that are valid but cannot do what they say are named.
#[test]
fn settings_that_do_nothing_are_warned_about() {
    let quiet = from_flags(&minimal_with(&[])).unwrap();
    assert!(quiet.warnings().is_empty(), "{:?}", quiet.warnings());
    let noisy = from_flags(&minimal_with(&[
        "--maglev-source-affinity",
        "--ejection-base",
        "10m",
        "--ejection-max",
        "1m",
        "--health-check",
        "tcp",
        "--health-interval",
        "1s",
        "--health-timeout",
        "2s",
    ]))
    .unwrap();
    assert_eq!(
        noisy.warnings(),
        [
            "ejection_base 10m is longer than ejection_max 1m: every ejection lasts 1m",
            "VIP 10.0.0.100:80/tcp: maglev_source_affinity does nothing with algorithm p2c-ewma",
            "VIP 10.0.0.100:80/tcp: health timeout 2s is longer than its interval 1s: a check that times out delays the next",
        ]
    );
    let round_robin = |extra: &[&'static str]| {
        let mut argv = minimal_with(&["--algorithm", "round-robin"]);
        argv.extend_from_slice(extra);
        from_flags(&argv).unwrap().warnings()
    };
    assert_eq!(
        round_robin(&["--slow-start", "30s"]),
        [
            "VIP 10.0.0.100:80/tcp: round-robin reads no weights, so slow start does nothing for \
             it: a backend back in service takes its full share at once (weighted-round-robin \
             ramps it)"
        ]
    );
    // Not for the default slow start (every round-robin VIP would warn at
    // every start), nor with none.
    assert!(round_robin(&[]).is_empty());
    assert!(round_robin(&["--slow-start", "0s"]).is_empty());
}
