use std::path::Path;

use clap::Parser;

use super::*;
use crate::settings::cli::Cli;

fn args(argv: &[&str]) -> RunArgs {
    let mut full = vec!["lb-user"];
    full.extend_from_slice(argv);
    Cli::try_parse_from(full).expect("flags parse").run
}

fn from_flags(argv: &[&str]) -> Result<Config, ConfigError> {
    Config::merge(args(argv), FileConfig::default())
}

fn from_file(text: &str, argv: &[&str]) -> Result<Config, ConfigError> {
    let file = FileConfig::parse(text, Path::new("test.toml"))?;
    Config::merge(args(argv), file)
}

const MINIMAL: &[&str] = &[
    "--iface",
    "eth0",
    "--vip",
    "10.0.0.100:80",
    "--backend",
    "10.0.0.21:8080",
];

#[test]
fn minimal_flags_get_the_documented_defaults() {
    let c = from_flags(MINIMAL).unwrap();
    assert_eq!(c.iface, "eth0");
    assert_eq!(c.instance, "lb-eth0");
    assert_eq!(c.xdp_mode, XdpMode::Native);
    assert!(c.snat_ip.is_empty());
    assert_eq!(c.snat_ports, PortRange::default());
    assert_eq!(c.flow_table_size, DEFAULT_FLOW_TABLE_SIZE);
    assert_eq!(c.ewma_tau, Duration::from_secs(10));
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
        "--ewma-tau",
        "5s",
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
        ewma_tau = "5s"
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
    let addrs: Vec<String> = c.vips.iter().map(|v| v.vip.to_string()).collect();
    assert_eq!(
        addrs,
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

fn err_flags(argv: &[&str]) -> String {
    from_flags(argv).unwrap_err().to_string()
}

fn err_file(text: &str) -> String {
    from_file(text, &[]).unwrap_err().to_string()
}

#[test]
fn each_bad_input_has_its_message() {
    assert_eq!(
        err_flags(&["--vip", "10.0.0.100:80", "--backend", "10.0.0.21:80"]),
        "no interface given (use --iface or iface in the config file)"
    );
    assert_eq!(
        err_flags(&["--iface", "eth0"]),
        "no VIP configured (use --vip with --backend, or [[vip]] in the config file)"
    );
    assert_eq!(
        err_flags(&["--iface", "eth0", "--vip", "10.0.0.100:80"]),
        "VIP 10.0.0.100:80/tcp has no backends"
    );
    assert_eq!(
        err_flags(&["--iface", "eth0", "--backend", "10.0.0.21:80"]),
        "--backend given without --vip"
    );
    assert_eq!(
        err_flags(&[
            "--iface",
            "eth0",
            "--vip",
            "10.0.0.100:80",
            "--backend",
            "10.0.0.21:80",
            "--backend",
            "10.0.0.21:80@2"
        ]),
        "duplicate backend 10.0.0.21:80 in VIP 10.0.0.100:80/tcp"
    );
    let mut slow = MINIMAL.to_vec();
    slow.extend(["--score-interval", "101ms"]);
    assert_eq!(
        err_flags(&slow),
        "score interval 101ms is too long (at most 100ms)"
    );
    let mut zero = MINIMAL.to_vec();
    zero.extend(["--ewma-tau", "0s"]);
    assert_eq!(err_flags(&zero), "ewma tau must be greater than zero");
    let mut tiny = MINIMAL.to_vec();
    tiny.extend(["--flow-table-size", "1"]);
    assert_eq!(
        err_flags(&tiny),
        "flow table size 1 is too small (at least 2)"
    );
    let mut inst = MINIMAL.to_vec();
    inst.extend(["--instance", "../x"]);
    assert!(err_flags(&inst).starts_with("invalid instance name '../x'"));
    let mut level = MINIMAL.to_vec();
    level.extend(["--log-level", "loud"]);
    assert!(err_flags(&level).starts_with("invalid log level 'loud'"));
    assert_eq!(
        err_flags(&[
            "--iface",
            "eth0",
            "--vip",
            "[::1]:80",
            "--backend",
            "10.0.0.21:80"
        ]),
        "backend 10.0.0.21:80 of VIP [::1]:80/tcp: a VIP and its backends must be of one address family"
    );
    assert_eq!(
        err_flags(&[
            "--iface",
            "a-very-long-interface-name",
            "--vip",
            "10.0.0.100:80",
            "--backend",
            "10.0.0.21:80"
        ]),
        "invalid interface name 'a-very-long-interface-name'"
    );
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
    let unknown = err_file("iface = \"eth0\"\nifaces = \"x\"\n");
    assert!(
        unknown.starts_with("invalid config file test.toml: unknown field `ifaces`"),
        "{unknown}"
    );
    let weight =
        err_file("[[vip]]\naddress = \"10.0.0.100:80\"\nbackends = [\"10.0.0.21:80@0\"]\n");
    assert!(weight.contains("invalid weight '0'"), "{weight}");
    let duration = err_file("ewma_tau = \"10\"\n");
    assert!(duration.contains("invalid duration '10'"), "{duration}");
    assert!(!duration.contains('\n'));
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
    let running = from_flags(&[
        "--iface",
        "eth0",
        "--vip",
        "10.0.0.100:80",
        "--backend",
        "10.0.0.21:8080",
        "--backend",
        "10.0.0.22:8080",
    ])
    .unwrap();
    let reloaded = from_flags(&[
        "--iface",
        "eth0",
        "--vip",
        "10.0.0.100:80",
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
    ])
    .unwrap();
    assert_eq!(
        backend_changes(&running, &reloaded),
        [
            "VIP 10.0.0.100:80/tcp: added [10.0.0.23:8080@1], removed [10.0.0.21:8080], re-weighted [10.0.0.22:8080@3]"
        ]
    );
    let restart = needs_restart(&running, &reloaded);
    assert_eq!(restart.len(), 3, "{restart:?}");
    assert!(restart[0].starts_with("ewma_tau (10s → 5s)"), "{restart:?}");
    assert!(restart[1].starts_with("ops.lifecycle"), "{restart:?}");
    assert_eq!(
        restart[2],
        "VIP 10.0.0.100:80/tcp algorithm (p2c-ewma → maglev)"
    );
    assert!(needs_restart(&running, &running).is_empty());
    assert!(backend_changes(&running, &running).is_empty());
}

#[test]
fn snat_pools_from_flags_and_file() {
    let mut argv = MINIMAL.to_vec();
    argv.extend(["--snat-ip", "10.0.0.1", "--snat-ip", "10.0.0.2"]);
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
    let mut argv = MINIMAL.to_vec();
    argv.extend(["--snat-ip", "10.0.0.1", "--snat-ip", "10.0.0.1"]);
    assert_eq!(
        from_flags(&argv).unwrap_err().to_string(),
        "SNAT address 10.0.0.1 given twice"
    );
    let many: Vec<String> = (0..=lb_common::MAX_SNAT_ADDRS)
        .map(|i| format!("\"10.9.{}.{}\"", i / 200, i % 200 + 1))
        .collect();
    let text = format!("snat_ip = [{}]", many.join(", "));
    let err = from_file(&text, MINIMAL).unwrap_err().to_string();
    assert!(err.contains("IPv4 SNAT addresses"), "{err}");
    let err = from_file(r#"snat_ip = ["10.0.0.1", "nope"]"#, MINIMAL)
        .unwrap_err()
        .to_string();
    assert!(err.contains("test.toml"), "{err}");
}

#[test]
fn snat_quarantine_from_flag_file_or_default() {
    assert_eq!(
        from_flags(MINIMAL).unwrap().snat_quarantine,
        Duration::from_secs(65)
    );
    let mut argv = MINIMAL.to_vec();
    argv.extend(["--snat-quarantine", "30s"]);
    assert_eq!(
        from_flags(&argv).unwrap().snat_quarantine,
        Duration::from_secs(30)
    );
    let file = from_file(r#"snat_quarantine = "2m""#, MINIMAL).unwrap();
    assert_eq!(file.snat_quarantine, Duration::from_secs(120));
    argv.truncate(MINIMAL.len());
    argv.extend(["--snat-quarantine", "0s"]);
    assert_eq!(
        from_flags(&argv).unwrap_err().to_string(),
        "snat quarantine must be greater than zero"
    );
}
