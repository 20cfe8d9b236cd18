//! Driving the real `lb-user` binary on the balancer host, per the CLI
//! contract in DESIGN.md.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Command, ExitStatus, Output},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use nix::sys::signal::Signal;

use super::{
    BALANCER_ADDR, COMMAND_TIMEOUT, Lab, VIP_ADDR, VIP_TCP_PORT, VIP_UDP_PORT,
    names::{INSTANCE_PREFIX, PIN_ROOT},
    netns::{POLL_INTERVAL, output_with_timeout, run_ok, setns_command},
    process::ProcessId,
};
use crate::status::Status;

/// How long `lb-user` may take to load, attach and publish its VIPs.
const READY_TIMEOUT: Duration = Duration::from_secs(20);
/// How long `lb-user` may take to detach and exit after SIGINT/SIGTERM.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// Selection algorithm (`--algorithm`): the data path's own enum, whose
/// `name()` is the command-line spelling.
pub use lb_common::Algorithm;

/// XDP attach mode (`--xdp-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XdpMode {
    Native,
    Skb,
}

impl XdpMode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Native => "native",
            Self::Skb => "skb",
        }
    }
}

/// VIP protocol (`--vip IP:PORT/tcp|udp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Tcp,
    Udp,
}

impl Protocol {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::Udp => "udp",
        }
    }
}

/// One VIP and its backends (address, weight).
#[derive(Debug, Clone)]
pub struct VipSpec {
    pub addr: SocketAddr,
    pub protocol: Protocol,
    pub backends: Vec<(SocketAddr, u32)>,
    /// Zone of each backend that has one (`ADDR@WEIGHT,zone=NAME`); backends
    /// not listed are given without a zone.
    pub zones: BTreeMap<SocketAddr, String>,
}

impl VipSpec {
    /// `addr`/`protocol` over `backends` (address, weight), none of them in a
    /// zone.
    pub fn new(addr: SocketAddr, protocol: Protocol, backends: Vec<(SocketAddr, u32)>) -> Self {
        Self {
            addr,
            protocol,
            backends,
            zones: BTreeMap::new(),
        }
    }

    /// `IP:PORT/PROTO`, the syntax of `--vip` and of a config file's `address`.
    fn address_arg(&self) -> String {
        format!("{}/{}", self.addr, self.protocol.as_str())
    }

    fn backend_args(&self) -> impl Iterator<Item = String> + '_ {
        self.backends
            .iter()
            .map(|(addr, weight)| match self.zones.get(addr) {
                Some(zone) => format!("{addr}@{weight},zone={zone}"),
                None => format!("{addr}@{weight}"),
            })
    }
}

/// One `lb-user` run. The first VIP is given with `--vip`/`--backend` flags,
/// any further ones through a `--config` file, so the lab exercises both.
#[derive(Debug, Clone)]
pub struct BalancerSpec {
    pub vips: Vec<VipSpec>,
    pub algorithm: Algorithm,
    pub xdp_mode: XdpMode,
    /// Further flags, passed as they are.
    pub extra_args: Vec<String>,
}

impl BalancerSpec {
    /// `vip` alone, balanced with `algorithm` in native XDP mode, with the
    /// further flags `extra`.
    pub fn one_vip(vip: VipSpec, algorithm: Algorithm, extra: &[&str]) -> Self {
        Self {
            vips: vec![vip],
            algorithm,
            xdp_mode: XdpMode::Native,
            extra_args: extra.iter().map(|s| s.to_string()).collect(),
        }
    }

    /// The `lb-user` command line for interface `iface`; `config` is the file
    /// written from [`BalancerSpec::config_file`] when there is more than one VIP.
    pub fn args(&self, iface: &str, config: Option<&Path>) -> Vec<String> {
        let mut args = vec!["--iface".to_string(), iface.to_string()];
        if let Some(first) = self.vips.first() {
            args.extend(["--vip".to_string(), first.address_arg()]);
            for backend in first.backend_args() {
                args.extend(["--backend".to_string(), backend]);
            }
        }
        if let Some(config) = config {
            args.extend(["--config".to_string(), config.display().to_string()]);
        }
        args.extend(["--algorithm".to_string(), self.algorithm.name().to_string()]);
        args.extend(["--xdp-mode".to_string(), self.xdp_mode.as_str().to_string()]);
        args.extend(self.extra_args.iter().cloned());
        args
    }

    /// TOML declaring every VIP after the first, or `None` if there are none.
    pub fn config_file(&self) -> Option<String> {
        let rest = self.vips.get(1..).filter(|rest| !rest.is_empty())?;
        let sections = rest.iter().map(|vip| {
            let backends = vip
                .backend_args()
                .map(|b| format!("\"{b}\""))
                .collect::<Vec<_>>()
                .join(", ");
            format!(
                "[[vip]]\naddress = \"{}\"\nbackends = [{backends}]\n",
                vip.address_arg()
            )
        });
        Some(sections.collect::<Vec<_>>().join("\n"))
    }
}

impl Lab {
    /// The standard configuration: two VIPs on the VIP address, 80/tcp and
    /// 8053/udp, each balancing over every backend with weight 1.
    pub fn balancer_spec(&self, algorithm: Algorithm, xdp_mode: XdpMode) -> BalancerSpec {
        let backends: Vec<_> = self.backends().iter().map(|b| (b.addr(), 1)).collect();
        BalancerSpec {
            vips: vec![
                VipSpec::new(self.tcp_vip(), Protocol::Tcp, backends.clone()),
                VipSpec::new(self.udp_vip(), Protocol::Udp, backends),
            ],
            algorithm,
            xdp_mode,
            extra_args: Vec::new(),
        }
    }

    /// The TCP VIP of [`Lab::balancer_spec`].
    pub fn tcp_vip(&self) -> SocketAddr {
        SocketAddr::from((VIP_ADDR, VIP_TCP_PORT))
    }

    /// The UDP VIP of [`Lab::balancer_spec`].
    pub fn udp_vip(&self) -> SocketAddr {
        SocketAddr::from((VIP_ADDR, VIP_UDP_PORT))
    }

    /// `lb-user ARGS...` in the balancer namespace. It enters only the network
    /// namespace, so its pins under /sys/fs/bpf are the host's.
    pub fn lb_user_command<S: AsRef<std::ffi::OsStr>>(&self, args: &[S]) -> Result<Command> {
        let mut command = setns_command(&self.balancer().ns, self.binaries().lb_user()?)?;
        command.args(args);
        Ok(command)
    }

    /// Runs `lb-user ARGS...` to completion (for bad-input checks and `status`).
    pub fn run_lb_user<S: AsRef<std::ffi::OsStr>>(&self, args: &[S]) -> Result<Output> {
        output_with_timeout(self.lb_user_command(args)?, COMMAND_TIMEOUT)
    }

    /// lb-user's default instance name for the balancer interface.
    pub fn instance(&self) -> String {
        format!("{INSTANCE_PREFIX}{}", self.balancer().iface)
    }

    /// Where lb-user keeps this lab's runtime state file (`--state-dir`).
    pub fn state_dir(&self) -> PathBuf {
        self.log_dir().join("state")
    }

    /// Where lb-user pins this lab's instance.
    pub fn pin_dir(&self) -> PathBuf {
        PathBuf::from(PIN_ROOT).join(self.instance())
    }

    /// Starts `lb-user` with `spec` and waits until it is attached and its
    /// status is ready and lists every VIP. Fails, with its stderr, if it
    /// exits first.
    pub fn start_balancer(&self, spec: &BalancerSpec) -> Result<ProcessId> {
        self.start_balancer_with_env(spec, &[])
    }

    /// [`Lab::start_balancer`] with environment variables set for lb-user
    /// (e.g. its test-only `LB_USER_FAULTS`).
    pub fn start_balancer_with_env(
        &self,
        spec: &BalancerSpec,
        env: &[(&str, &str)],
    ) -> Result<ProcessId> {
        let command = self.balancer_command(spec, env)?;
        let process = self.processes.spawn("lb-user", command)?;
        let deadline = Instant::now() + READY_TIMEOUT;
        let lists_every_vip = |status: &Status| {
            status.ready
                && spec
                    .vips
                    .iter()
                    .all(|vip| status.vip(&vip.addr.to_string()).is_some())
        };
        loop {
            if let Some(status) = self.exit_status(process)? {
                bail!(
                    "lb-user exited during start-up ({status}): {}",
                    self.stderr(process).trim()
                );
            }
            let ready = self.xdp_attached()? && self.status().is_ok_and(|s| lists_every_vip(&s));
            if ready {
                return Ok(process);
            }
            if Instant::now() >= deadline {
                let status = self
                    .status()
                    .map(|_| "ok".to_string())
                    .unwrap_or_else(|e| format!("{e:#}"));
                bail!(
                    "lb-user not ready after {READY_TIMEOUT:?} (xdp attached: {}, status: {status}); stderr: {}",
                    self.xdp_attached()?,
                    self.stderr(process).trim()
                );
            }
            std::thread::sleep(POLL_INTERVAL * 5);
        }
    }

    /// The `lb-user` command line of `spec` (its config file written to
    /// the lab's folder), with `env` set.
    fn balancer_command(&self, spec: &BalancerSpec, env: &[(&str, &str)]) -> Result<Command> {
        let config = match spec.config_file() {
            Some(toml) => {
                let path = self.log_dir().join("lb-user.toml");
                std::fs::write(&path, toml)
                    .with_context(|| format!("writing {}", path.display()))?;
                Some(path)
            }
            None => None,
        };
        let mut args = spec.args(&self.balancer().iface, config.as_deref());
        // Runtime state stays in the lab's folder, unless the test says where.
        if !args.iter().any(|a| a == "--state-dir") {
            args.extend([
                "--state-dir".to_string(),
                self.state_dir().display().to_string(),
            ]);
        }
        let mut command = self.lb_user_command(&args)?;
        command.envs(env.iter().copied());
        Ok(command)
    }

    /// Starts `lb-user` with `spec` and returns at once, not waiting for
    /// it to be ready (a test that acts during the start).
    pub fn spawn_balancer(&self, spec: &BalancerSpec) -> Result<ProcessId> {
        self.processes
            .spawn("lb-user", self.balancer_command(spec, &[])?)
    }

    /// Runs `lb-user` with `spec` when it is expected to fail its start:
    /// its exit status and stderr once it exits (within the start's timeout).
    /// Readiness is not what it waits for, since a running instance that a
    /// failed start leaves in place is ready all along.
    pub fn run_failing_balancer(&self, spec: &BalancerSpec) -> Result<(ExitStatus, String)> {
        let process = self
            .processes
            .spawn("lb-user", self.balancer_command(spec, &[])?)?;
        let status = self.wait(process, READY_TIMEOUT)?;
        Ok((status, self.stderr(process)))
    }

    /// Sends `signal` to lb-user and waits for it to exit.
    pub fn stop_balancer(&self, process: ProcessId, signal: Signal) -> Result<ExitStatus> {
        self.signal(process, signal)?;
        self.wait(process, STOP_TIMEOUT)
    }

    /// Runs `f`, then puts the balancer namespace's
    /// `net.ipv4.ip_local_reserved_ports` back as it was, whatever `f`
    /// returned. lb-user reserves its SNAT range there and gives back what
    /// it added only on a clean stop (a killed one keeps it for its
    /// successor); a proxy started after it in the same namespace could
    /// otherwise open no connection.
    pub fn restoring_reserved_ports<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        const RESERVED_PORTS: &str = "net.ipv4.ip_local_reserved_ports";
        let ns = self.balancer().ns.clone();
        let reserved = self.exec_ok(&ns, &["sysctl", "-n", RESERVED_PORTS])?;
        let result = f();
        let restored = self.exec_ok(
            &ns,
            &[
                "sysctl",
                "-q",
                "-w",
                &format!("{RESERVED_PORTS}={}", reserved.trim()),
            ],
        );
        let result = result?;
        restored.context("restoring the balancer namespace's reserved ports")?;
        Ok(result)
    }

    /// `lb-user status --json` of this lab's instance.
    pub fn status(&self) -> Result<Status> {
        let instance = self.instance();
        let json = run_ok(
            self.lb_user_command(&["status", "--json", "--instance", &instance])?,
            COMMAND_TIMEOUT,
        )?;
        serde_json::from_str(&json)
            .with_context(|| format!("parsing lb-user status --json: {json}"))
    }

    /// Whether an XDP program is attached to the balancer's interface,
    /// according to `ip -j link show` in the balancer namespace.
    pub fn xdp_attached(&self) -> Result<bool> {
        let host = self.balancer();
        let json = self.exec_ok(&host.ns, &["ip", "-j", "link", "show", "dev", &host.iface])?;
        let links: serde_json::Value =
            serde_json::from_str(&json).context("parsing ip -j link show")?;
        Ok(links
            .as_array()
            .is_some_and(|links| links.iter().any(|link| link.get("xdp").is_some())))
    }

    /// The balancer host's own address (also lb-user's default SNAT address).
    pub fn balancer_addr(&self) -> std::net::Ipv4Addr {
        BALANCER_ADDR
    }
}

/// TCP health checks fast enough for short lab tests (every 200 ms; two
/// results in a row flip a backend).
pub const FAST_HEALTH_CHECKS: &[&str] = &[
    "--health-check",
    "tcp",
    "--health-interval",
    "200ms",
    "--health-timeout",
    "200ms",
    "--health-fall",
    "2",
    "--health-rise",
    "2",
];

impl Lab {
    /// `lb-user backend ARGS... --instance <this lab's>`; panics, with
    /// lb-user's stderr, if it fails.
    pub fn backend_command(&self, args: &[&str]) {
        self.control_command("backend", args);
    }

    /// `lb-user vip ARGS... --instance <this lab's>`: its stdout; panics,
    /// with lb-user's stderr, if it fails.
    pub fn vip_command(&self, args: &[&str]) -> String {
        self.control_command("vip", args)
    }

    /// `lb-user COMMAND ARGS... --instance <this lab's>`: its stdout;
    /// panics, with lb-user's stderr, if it fails.
    fn control_command(&self, command: &str, args: &[&str]) -> String {
        let instance = self.instance();
        let mut argv = vec![command];
        argv.extend_from_slice(args);
        argv.extend_from_slice(&["--instance", &instance]);
        let out = self.run_lb_user(&argv).unwrap();
        assert!(
            out.status.success(),
            "lb-user {argv:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

/// Where lb-user serves metrics by default (inside the balancer namespace).
pub const METRICS_ADDR: &str = "127.0.0.1:9470";

impl Lab {
    /// Sets the balancer namespace's own ephemeral port range ("low high"),
    /// to keep its connections (metrics scrapes) out of a wide SNAT range
    /// that lb-user reserves.
    pub fn set_balancer_ephemeral_ports(&self, range: &str) -> Result<()> {
        self.exec_ok(
            &self.balancer().ns,
            &[
                "sysctl",
                "-qw",
                &format!("net.ipv4.ip_local_port_range={range}"),
            ],
        )
        .map(drop)
    }

    /// Turns on receive packet steering (RPS, every CPU) on the client's,
    /// the backends' and the balancer's interfaces, so the kernel keeps each
    /// flow on one CPU by its hash, as a real NIC's RSS does. Without it a
    /// veth hands each received frame to the backlog of the CPU that sent
    /// it: two segments of one flow sent or forwarded from two CPUs (a
    /// response and its FIN, through the balancer's XDP_TX and the bridge)
    /// can reach the receiver out of order, which a direct path rarely
    /// shows and a receiver answers with duplicate ACKs that make the
    /// sender retransmit (README, "Capacity").
    pub fn steer_flows_by_hash(&self) -> Result<()> {
        let cpus = super::rss_cpus();
        let mask = format!("{:x}", u64::MAX >> (64 - cpus));
        let hosts = [self.client(), self.balancer()]
            .into_iter()
            .chain(self.backends().iter().map(|b| &b.host));
        for host in hosts {
            let script = format!(
                "for q in /sys/class/net/{}/queues/rx-*; do echo {mask} > $q/rps_cpus; done",
                host.iface
            );
            self.exec_ok(&host.ns, &["sh", "-c", &script])
                .with_context(|| format!("turning RPS on for {} in {}", host.iface, host.ns))?;
        }
        Ok(())
    }

    /// `GET /metrics` from lb-user's default metrics address, inside the
    /// balancer namespace.
    pub fn scrape_metrics(&self) -> Result<String> {
        use std::io::{Read as _, Write as _};
        self.in_ns(&self.balancer().ns, || {
            let mut s = std::net::TcpStream::connect(METRICS_ADDR)?;
            s.set_read_timeout(Some(Duration::from_secs(5)))?;
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: lb\r\nConnection: close\r\n\r\n")?;
            let mut text = String::new();
            s.read_to_string(&mut text)?;
            Ok(text)
        })
    }
}

/// The value of the first sample in `text` (a metrics scrape) whose line
/// starts with `prefix`; panics, showing the scrape, if there is none.
pub fn metric(text: &str, prefix: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no metric {prefix} in:\n{text}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zones_are_appended_to_the_backends_that_have_one() {
        let a: SocketAddr = "10.213.0.21:8080".parse().unwrap();
        let b: SocketAddr = "10.213.0.22:8080".parse().unwrap();
        let vip = |port| VipSpec {
            addr: SocketAddr::from((VIP_ADDR, port)),
            protocol: Protocol::Tcp,
            backends: vec![(a, 1), (b, 2)],
            zones: BTreeMap::from([(b, "b".to_string())]),
        };
        let spec = BalancerSpec {
            vips: vec![vip(80), vip(81)],
            algorithm: Algorithm::P2cEwma,
            xdp_mode: XdpMode::Native,
            extra_args: vec!["--zone".into(), "a".into()],
        };
        let args = spec.args("eth0", None).join(" ");
        assert!(
            args.contains("--backend 10.213.0.21:8080@1 --backend 10.213.0.22:8080@2,zone=b "),
            "{args}"
        );
        assert!(args.ends_with("--zone a"), "{args}");
        let toml = spec.config_file().unwrap();
        assert!(
            toml.contains(r#"backends = ["10.213.0.21:8080@1", "10.213.0.22:8080@2,zone=b"]"#),
            "{toml}"
        );
    }
}
