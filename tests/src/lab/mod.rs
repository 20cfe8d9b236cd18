//! The lab network: a switch namespace holding a Linux bridge, and one
//! namespace per host (client, balancer, backends), each joined to the bridge
//! by a veth pair whose peer is a bridge port.
//!
//! ```text
//!   client ns          balancer ns            backend ns (×N)
//!   eth0 .2            <id>b .10 + VIP/32     eth0 .21, .22, ...
//!     |                  |                      |
//!   p-client           p-lb (XDP_PASS stub)   p-be<i>
//!     +------------------+----------------------+--- br0 (switch ns)
//! ```
//!
//! Addresses exist only inside these namespaces (10.213.0.0/24, and the
//! unique local fd00:213::/64 for IPv6, added with `nodad` so they are usable
//! at once). The VIPs are a /32 and a /128 on the balancer's interface so its
//! kernel answers ARP and neighbour solicitations for them.

mod balancer;
mod etcd;
mod interrupt;
mod names;
mod netns;
mod process;
mod scale_out;
mod xdp_stub;

use std::{
    ffi::OsStr,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::PathBuf,
    process::{Command, Output},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use nix::sys::signal::Signal;

pub use balancer::{
    Algorithm, BalancerSpec, FAST_HEALTH_CHECKS, METRICS_ADDR, Protocol, VipSpec, XdpMode, metric,
};
pub use etcd::{ETCD_CLIENT_PORT, EtcdTls};
pub use interrupt::{clean_up_on_signals, exit_with};
pub use names::{PIN_ROOT, RUN_DIR, owner_pid, sweep_stale};
pub use netns::{in_netns, output_with_timeout};
pub use process::ProcessId;
pub use scale_out::{REMOTE_CLIENT_ADDR, SECOND_BALANCER_ADDR, ScaleOut};

use self::{
    netns::{netns_exec, run_ok},
    process::Processes,
    xdp_stub::{XdpStub, attach_pass_stub},
};
use crate::{
    Binaries,
    loadgen::{LoadConfig, Summary},
};

/// Prefix length of the lab subnet.
pub const PREFIX_LEN: u8 = 24;
pub const CLIENT_ADDR: Ipv4Addr = Ipv4Addr::new(10, 213, 0, 2);
pub const BALANCER_ADDR: Ipv4Addr = Ipv4Addr::new(10, 213, 0, 10);
pub const VIP_ADDR: Ipv4Addr = Ipv4Addr::new(10, 213, 0, 100);
/// IPv6 prefix length of the lab subnet, and the IPv6 addresses.
pub const PREFIX_LEN6: u8 = 64;
pub const CLIENT_ADDR6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x213, 0, 0, 0, 0, 0, 0x2);
pub const BALANCER_ADDR6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x213, 0, 0, 0, 0, 0, 0x10);
pub const VIP_ADDR6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x213, 0, 0, 0, 0, 0, 0x100);
/// Backend `i` (0-based) gets `.21 + i` (IPv6: `::21 + i`).
pub const FIRST_BACKEND_OCTET: u8 = 21;
/// Backends serve HTTP on this TCP port and the echo on the same UDP port.
pub const BACKEND_PORT: u16 = 8080;
/// The VIP port for TCP in the standard balancer configuration.
pub const VIP_TCP_PORT: u16 = 80;
/// The VIP port for UDP in the standard balancer configuration.
pub const VIP_UDP_PORT: u16 = 8053;
/// Most backends one lab builds (addresses .21 to .99 stay below the VIP).
pub const MAX_BACKENDS: usize = 60;
/// Most queues [`LabBuilder::balancer_queues`] gives the balancer's veth
/// pair, and most CPUs [`Lab::steer_flows_by_hash`] steers over (its mask
/// is one 64-bit word).
pub const MAX_BALANCER_QUEUES: u32 = 64;

/// This machine's CPUs, at most [`MAX_BALANCER_QUEUES`]: one queue each for
/// a balancer interface that emulates RSS, and the RPS mask's width.
pub fn rss_cpus() -> u32 {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get() as u32)
        .min(MAX_BALANCER_QUEUES)
}
/// Name of every host's interface except the balancer's (per-namespace names).
pub const HOST_IFACE: &str = "eth0";
const BRIDGE: &str = "br0";
/// Deadline for setup and inspection commands.
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a backend may take to report it is listening.
const BACKEND_READY_TIMEOUT: Duration = Duration::from_secs(10);
/// Extra time a load run gets beyond its duration and request timeout.
const LOADGEN_SLACK: Duration = Duration::from_secs(15);

/// One host of the lab.
#[derive(Debug, Clone)]
pub struct Host {
    /// Network namespace name.
    pub ns: String,
    /// The host's interface, inside `ns`.
    pub iface: String,
    /// The bridge port of the veth pair, inside the switch namespace.
    pub switch_port: String,
    pub addr: Ipv4Addr,
    pub addr6: Ipv6Addr,
}

/// How a backend server behaves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendSpec {
    pub service_time_ms: u64,
    pub workers: u32,
    pub stall_every_ms: u64,
    pub stall_for_ms: u64,
    /// Delay added to every response outside the worker slots (network
    /// distance, e.g. a client in another zone); 0 = none.
    pub added_latency_ms: u64,
}

impl BackendSpec {
    /// A server holding one of `workers` slots for `service_time_ms` per request.
    pub fn new(service_time_ms: u64, workers: u32) -> Self {
        Self {
            service_time_ms,
            workers,
            stall_every_ms: 0,
            stall_for_ms: 0,
            added_latency_ms: 0,
        }
    }
}

impl Default for BackendSpec {
    fn default() -> Self {
        Self::new(5, 8)
    }
}

/// A backend host and its server.
#[derive(Debug, Clone)]
pub struct Backend {
    pub host: Host,
    /// Name the server reports (`X-Backend`, UDP prefix): `be1`, `be2`, ...
    pub name: String,
    pub spec: BackendSpec,
    pub process: ProcessId,
}

impl Backend {
    /// The server's address (TCP and UDP).
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from((self.host.addr, BACKEND_PORT))
    }

    /// The server's IPv6 address (the same sockets, bound to `::`).
    pub fn addr6(&self) -> SocketAddr {
        SocketAddr::from((self.host.addr6, BACKEND_PORT))
    }
}

/// Builds a [`Lab`].
pub struct LabBuilder {
    binaries: Binaries,
    backends: Vec<BackendSpec>,
    balancer_queues: u32,
}

impl LabBuilder {
    pub fn new(binaries: Binaries) -> Self {
        Self {
            binaries,
            backends: Vec::new(),
            balancer_queues: 1,
        }
    }

    /// Gives the balancer's veth pair `queues` receive and transmit queues
    /// on both ends (1, a single-queue interface, by default), as a
    /// multi-queue NIC has: the bridge spreads the frames it sends to the
    /// balancer over the queues by flow hash (as RSS does), and each queue
    /// has its own ring and NAPI poll for the XDP program. A single-queue
    /// veth under native XDP holds at most 256 frames in flight and drops
    /// the rest (`tx_dropped` on the bridge port), which caps what one
    /// balancer can be shown to take well below what it can process.
    pub fn balancer_queues(mut self, queues: u32) -> Self {
        self.balancer_queues = queues.clamp(1, MAX_BALANCER_QUEUES);
        self
    }

    /// Adds one backend.
    pub fn backend(mut self, spec: BackendSpec) -> Self {
        self.backends.push(spec);
        self
    }

    /// Adds `count` identical backends.
    pub fn backends(mut self, count: usize, spec: BackendSpec) -> Self {
        self.backends.extend(std::iter::repeat_n(spec, count));
        self
    }

    /// Creates the namespaces, wires them, starts the backend servers.
    /// Anything created before a failure is removed again.
    pub fn build(self) -> Result<Lab> {
        if self.backends.is_empty() || self.backends.len() > MAX_BACKENDS {
            bail!(
                "a lab needs 1 to {MAX_BACKENDS} backends, not {}",
                self.backends.len()
            );
        }
        let removed = sweep_stale().context("sweeping leftovers of dead labs")?;
        if !removed.is_empty() {
            eprintln!(
                "lab: removed leftovers of dead labs: {}",
                removed.join(", ")
            );
        }
        let id = names::next_lab_id();
        let log_dir = std::env::temp_dir().join(&id);
        std::fs::create_dir_all(&log_dir)
            .with_context(|| format!("creating {}", log_dir.display()))?;
        let balancer_iface = format!("{id}b");
        names::check_ifname(&balancer_iface)?;
        let host = |suffix: &str, iface: &str, port: &str, (addr, addr6)| Host {
            ns: format!("{id}-{suffix}"),
            iface: iface.to_string(),
            switch_port: port.to_string(),
            addr,
            addr6,
        };
        let client = host("cl", HOST_IFACE, "p-client", (CLIENT_ADDR, CLIENT_ADDR6));
        let balancer = host(
            "lb",
            &balancer_iface,
            "p-lb",
            (BALANCER_ADDR, BALANCER_ADDR6),
        );
        let backend_hosts: Vec<Host> = (0..self.backends.len())
            .map(|i| {
                let n = i + 1;
                host(
                    &format!("be{n}"),
                    HOST_IFACE,
                    &format!("p-be{n}"),
                    (backend_addr(i), backend_addr6(i)),
                )
            })
            .collect();
        let mut lab = Lab {
            switch_ns: format!("{id}-sw"),
            id,
            binaries: self.binaries,
            client,
            balancer,
            backends: Vec::new(),
            namespaces: Vec::new(),
            processes: Processes::new(log_dir),
            xdp_stub: None,
            instances: Vec::new(),
        };
        lab.instances.push(lab.instance());
        lab.create_switch()?;
        lab.connect_host(&lab.client.clone())?;
        lab.connect_host_with_queues(&lab.balancer.clone(), self.balancer_queues)?;
        for host in &backend_hosts {
            lab.connect_host(host)?;
        }
        lab.ip(
            &lab.balancer.ns,
            &[
                "addr",
                "add",
                &format!("{VIP_ADDR}/32"),
                "dev",
                &lab.balancer.iface,
            ],
        )?;
        lab.ip(
            &lab.balancer.ns,
            &[
                "-6",
                "addr",
                "add",
                &format!("{VIP_ADDR6}/128"),
                "dev",
                &lab.balancer.iface,
                "nodad",
            ],
        )?;
        lab.xdp_stub = Some(attach_pass_stub(&lab.switch_ns, &lab.balancer.switch_port)?);
        for (i, (host, spec)) in backend_hosts.into_iter().zip(self.backends).enumerate() {
            let backend = lab.start_backend(format!("be{}", i + 1), host, spec)?;
            lab.backends.push(backend);
        }
        for backend in &lab.backends {
            lab.wait_backend_ready(backend)?;
        }
        Ok(lab)
    }
}

/// Address of backend `index` (0-based).
pub fn backend_addr(index: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 213, 0, FIRST_BACKEND_OCTET + index as u8)
}

/// IPv6 address of backend `index` (0-based).
pub fn backend_addr6(index: usize) -> Ipv6Addr {
    let last = u16::from(FIRST_BACKEND_OCTET) + index as u16;
    Ipv6Addr::new(0xfd00, 0x213, 0, 0, 0, 0, 0, last)
}

/// A running lab. Dropping it stops every process it started and deletes its
/// namespaces (which removes the bridge and every veth with them), its
/// balancer's pins and its lb-user instances' files in [`RUN_DIR`].
pub struct Lab {
    pub id: String,
    binaries: Binaries,
    switch_ns: String,
    client: Host,
    balancer: Host,
    backends: Vec<Backend>,
    /// Namespaces created so far, deleted on drop.
    namespaces: Vec<String>,
    processes: Processes,
    xdp_stub: Option<XdpStub>,
    /// lb-user instance names of this lab's balancers ([`Lab::instance`],
    /// and the scale-out's second one once added), whose files in
    /// [`RUN_DIR`] go on drop.
    instances: Vec<String>,
}

impl Lab {
    pub fn builder(binaries: Binaries) -> LabBuilder {
        LabBuilder::new(binaries)
    }

    pub fn client(&self) -> &Host {
        &self.client
    }

    pub fn balancer(&self) -> &Host {
        &self.balancer
    }

    pub fn backends(&self) -> &[Backend] {
        &self.backends
    }

    /// The switch namespace (bridge and every host's bridge port).
    pub fn switch_ns(&self) -> &str {
        &self.switch_ns
    }

    /// Every namespace of this lab.
    pub fn namespaces(&self) -> &[String] {
        &self.namespaces
    }

    pub fn binaries(&self) -> &Binaries {
        &self.binaries
    }

    /// Folder holding the stdout/stderr of every process the lab started.
    pub fn log_dir(&self) -> PathBuf {
        self.processes.log_dir().to_path_buf()
    }

    fn add_namespace(&mut self, ns: &str) -> Result<()> {
        let mut command = Command::new("ip");
        command.args(["netns", "add", ns]);
        run_ok(command, COMMAND_TIMEOUT)?;
        self.namespaces.push(ns.to_string());
        self.ip(ns, &["link", "set", "lo", "up"])
    }

    /// `ip -n NS ARGS...`, failing on a non-zero exit.
    pub fn ip(&self, ns: &str, args: &[&str]) -> Result<()> {
        let mut command = Command::new("ip");
        command.args(["-n", ns]).args(args);
        run_ok(command, COMMAND_TIMEOUT).map(drop)
    }

    fn create_switch(&mut self) -> Result<()> {
        let ns = self.switch_ns.clone();
        self.add_namespace(&ns)?;
        // STP off (the default) and no forwarding delay: ports forward at once.
        self.ip(
            &ns,
            &[
                "link",
                "add",
                BRIDGE,
                "type",
                "bridge",
                "forward_delay",
                "0",
            ],
        )?;
        self.ip(&ns, &["link", "set", BRIDGE, "up"])
    }

    /// Creates the host's namespace and its veth pair, plugs the peer into the
    /// bridge, addresses the host and turns its tx checksum offload off.
    fn connect_host(&mut self, host: &Host) -> Result<()> {
        self.connect_host_with_queues(host, 1)
    }

    /// [`Lab::connect_host`] with `queues` receive and transmit queues on
    /// both ends of the veth pair.
    fn connect_host_with_queues(&mut self, host: &Host, queues: u32) -> Result<()> {
        self.add_namespace(&host.ns)?;
        let queues = queues.to_string();
        self.ip(
            &host.ns,
            &[
                "link",
                "add",
                &host.iface,
                "numtxqueues",
                &queues,
                "numrxqueues",
                &queues,
                "type",
                "veth",
                "peer",
                "name",
                &host.switch_port,
                "numtxqueues",
                &queues,
                "numrxqueues",
                &queues,
                "netns",
                &self.switch_ns,
            ],
        )?;
        self.ip(
            &self.switch_ns,
            &["link", "set", &host.switch_port, "master", BRIDGE, "up"],
        )?;
        let cidr = format!("{}/{PREFIX_LEN}", host.addr);
        self.ip(&host.ns, &["addr", "add", &cidr, "dev", &host.iface])?;
        let cidr6 = format!("{}/{PREFIX_LEN6}", host.addr6);
        self.ip(
            &host.ns,
            &["-6", "addr", "add", &cidr6, "dev", &host.iface, "nodad"],
        )?;
        self.ip(&host.ns, &["link", "set", &host.iface, "up"])?;
        // Frames from local sockets over veth carry a partial checksum that
        // native XDP on the receiving side turns into corrupt raw frames
        // (DESIGN.md, "veth checksum offload"). Client and backends are the
        // senders whose frames the balancer's XDP sees; the balancer's own
        // replies cross the stub on its bridge port, so it gets the same.
        self.exec_ok(&host.ns, &["ethtool", "-K", &host.iface, "tx", "off"])
            .map(drop)
    }

    fn start_backend(&self, name: String, host: Host, spec: BackendSpec) -> Result<Backend> {
        let bin = self.binaries.lb_backend.as_os_str();
        // `::` takes IPv4 and IPv6 on the same sockets (dual stack).
        let args: Vec<String> = vec![
            "--name".into(),
            name.clone(),
            "--listen".into(),
            IpAddr::from(Ipv6Addr::UNSPECIFIED).to_string(),
            "--http-port".into(),
            BACKEND_PORT.to_string(),
            "--udp-port".into(),
            BACKEND_PORT.to_string(),
            "--service-time-ms".into(),
            spec.service_time_ms.to_string(),
            "--workers".into(),
            spec.workers.to_string(),
            "--stall-every-ms".into(),
            spec.stall_every_ms.to_string(),
            "--stall-for-ms".into(),
            spec.stall_for_ms.to_string(),
            "--added-latency-ms".into(),
            spec.added_latency_ms.to_string(),
        ];
        let mut argv = vec![bin];
        argv.extend(args.iter().map(OsStr::new));
        let process = self.spawn(&host.ns, &name, &argv)?;
        Ok(Backend {
            host,
            name,
            spec,
            process,
        })
    }

    /// Waits until the backend prints its ready line (it is then listening).
    fn wait_backend_ready(&self, backend: &Backend) -> Result<()> {
        let deadline = Instant::now() + BACKEND_READY_TIMEOUT;
        while !self.stdout(backend.process).contains(" ready ") {
            if let Some(status) = self.processes.exit_status(backend.process)? {
                bail!(
                    "backend {} exited ({status}): {}",
                    backend.name,
                    self.stderr(backend.process).trim()
                );
            }
            if Instant::now() >= deadline {
                bail!(
                    "backend {} not ready after {BACKEND_READY_TIMEOUT:?}",
                    backend.name
                );
            }
            std::thread::sleep(netns::POLL_INTERVAL);
        }
        Ok(())
    }

    /// Runs `argv` in namespace `ns` (`ip netns exec`) to completion.
    pub fn exec<S: AsRef<OsStr>>(&self, ns: &str, argv: &[S]) -> Result<Output> {
        output_with_timeout(netns_exec(ns, argv), COMMAND_TIMEOUT)
    }

    /// [`Lab::exec`] with its own time limit, for a long client run; a
    /// non-zero exit is an error; returns stdout.
    pub fn exec_ok_within<S: AsRef<OsStr>>(
        &self,
        ns: &str,
        argv: &[S],
        timeout: Duration,
    ) -> Result<String> {
        run_ok(netns_exec(ns, argv), timeout)
    }

    /// Like [`Lab::exec`], but a non-zero exit is an error; returns stdout.
    pub fn exec_ok<S: AsRef<OsStr>>(&self, ns: &str, argv: &[S]) -> Result<String> {
        run_ok(netns_exec(ns, argv), COMMAND_TIMEOUT)
    }

    /// Starts `argv` in namespace `ns` in the background, tracked by the lab.
    pub fn spawn<S: AsRef<OsStr>>(&self, ns: &str, label: &str, argv: &[S]) -> Result<ProcessId> {
        self.processes.spawn(label, netns_exec(ns, argv))
    }

    /// Runs `f` on a thread inside namespace `ns` (sockets stay in `ns`).
    pub fn in_ns<T: Send>(&self, ns: &str, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
        in_netns(ns, f)
    }

    pub fn signal(&self, process: ProcessId, signal: Signal) -> Result<()> {
        self.processes.signal(process, signal)
    }

    pub fn wait(&self, process: ProcessId, timeout: Duration) -> Result<std::process::ExitStatus> {
        self.processes.wait(process, timeout)
    }

    /// The exit status if the process has exited, else `None`.
    pub fn exit_status(&self, process: ProcessId) -> Result<Option<std::process::ExitStatus>> {
        self.processes.exit_status(process)
    }

    pub fn stdout(&self, process: ProcessId) -> String {
        self.processes.stdout(process)
    }

    pub fn stderr(&self, process: ProcessId) -> String {
        self.processes.stderr(process)
    }

    /// Starts `lb-loadgen` in the client namespace.
    pub fn spawn_loadgen(&self, config: &LoadConfig) -> Result<ProcessId> {
        let mut argv = vec![self.binaries.lb_loadgen.as_os_str().to_os_string()];
        argv.extend(config.to_args().into_iter().map(Into::into));
        self.spawn(&self.client.ns, "loadgen", &argv)
    }

    /// Waits for a load run started by [`Lab::spawn_loadgen`] and parses its summary.
    pub fn loadgen_summary(&self, process: ProcessId, config: &LoadConfig) -> Result<Summary> {
        let budget = Duration::from_secs_f64(config.duration_s)
            + Duration::from_millis(config.timeout_ms)
            + LOADGEN_SLACK;
        let status = self.wait(process, budget)?;
        if !status.success() {
            bail!(
                "lb-loadgen failed ({status}): {}",
                self.stderr(process).trim()
            );
        }
        serde_json::from_str(self.stdout(process).trim()).context("parsing the lb-loadgen summary")
    }

    /// Runs `lb-loadgen` in the client namespace to completion.
    pub fn run_loadgen(&self, config: &LoadConfig) -> Result<Summary> {
        let process = self.spawn_loadgen(config)?;
        self.loadgen_summary(process, config)
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        if interrupt::interrupted() {
            // The signal thread is sweeping every lab of this process.
            return;
        }
        self.processes.stop_all();
        // Detach the stub before its interface disappears with the namespaces.
        self.xdp_stub = None;
        for ns in self.namespaces.iter().rev() {
            let mut command = Command::new("ip");
            command.args(["netns", "delete", ns]);
            if let Err(error) = run_ok(command, COMMAND_TIMEOUT) {
                eprintln!("lab {}: cleanup: {error:#}", self.id);
            }
        }
        let pins = self.pin_dir();
        if pins.exists()
            && let Err(error) = std::fs::remove_dir_all(&pins)
        {
            eprintln!("lab {}: cleanup of {}: {error}", self.id, pins.display());
        }
        // Its balancers are stopped: their locks, sockets and records
        // (left in place by lb-user) are nobody's now.
        for instance in &self.instances {
            if let Err(error) = names::remove_run_files(instance) {
                eprintln!("lab {}: cleanup of {instance}'s files: {error:#}", self.id);
            }
        }
        let logs = self.processes.log_dir();
        if std::thread::panicking() {
            eprintln!(
                "lab {}: logs of its processes kept in {}",
                self.id,
                logs.display()
            );
        } else {
            let _ = std::fs::remove_dir_all(logs);
        }
    }
}
