//! Startup in named steps, each leaving the kernel in a state the running
//! program can use: write the plan, learn the backends' MACs, mark the
//! configuration ready; then open what the event loop needs.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::Arc,
};

use anyhow::Context as _;
use lb_common::{
    CONFIG_F_READY, CONFIG_F_TIME_WAIT_REUSE, DEFAULT_CLOSED_LINGER_NS, LbConfig, MAX_BACKENDS,
};
use tokio::time::sleep;
use tracing::{info, warn};

use super::{
    Reload,
    errors::{ControlErrors, Stage},
    neighbours::BackendAddrs,
};
use crate::{
    estimate::backend_load::LoadTable,
    ingest::latency::LatencyReader,
    kernel::{
        attach::Attachment,
        clock::Clock,
        flow_tables::Capacities,
        iface,
        maps::{self, ControlConnections, Counters},
        neighbours::{NeighbourSync, STARTUP_RESOLVE_WAIT},
        snat_handover::{self, VipBackend},
        sysctl, wire,
    },
    pool::plan::{Plan, Previous},
    publish::publisher::Publisher,
    settings::{
        addr::VipAddr,
        config::{self, Config, VipConfig},
        error::ConfigError,
        ports::PortRange,
        state::RuntimeState,
    },
};

/// SNAT source address pools per family, and their port range. A family
/// without a VIP needs none (the data path then never uses it).
#[derive(Clone, Debug, Default)]
pub struct Snat {
    pub v4: Vec<Ipv4Addr>,
    pub v6: Vec<Ipv6Addr>,
    /// The source ports (`--snat-ports`).
    pub ports: PortRange,
}

impl Snat {
    /// The configured pools, or the interface's address for the families
    /// of the VIPs, which must meet the rules the configuration's VIPs and
    /// backends are held to against a configured pool ([`Self::check`]).
    ///
    /// A family only VIPs added at runtime (kept in `kept`) have gets the
    /// interface's address too, as the run that added them had it: else
    /// the restart would drop them (`drop_refused_state`), though nothing
    /// changed. Where the interface has no usable address of that family,
    /// the pool stays empty and those VIPs are dropped with a warning; the
    /// start does not fail for them.
    pub fn resolve(config: &Config, kept: &RuntimeState) -> anyhow::Result<Self> {
        let has = |v6: bool| config.vips.iter().any(|v| v.vip.addr.is_ipv6() == v6);
        let kept_has = |v6: bool| kept.added_vip_families().any(|f| f == v6);
        let usable = |ip: IpAddr| config::not_a_host(ip).is_none();
        let v4 = match config.snat_ip.as_slice() {
            [] if has(false) => vec![iface::primary_ipv4(&config.iface)?],
            [] if kept_has(false) => iface::primary_ipv4(&config.iface)
                .ok()
                .filter(|ip| usable(IpAddr::V4(*ip)))
                .into_iter()
                .collect(),
            pool => pool.to_vec(),
        };
        let v6 = match config.snat_ip6.as_slice() {
            [] if has(true) => vec![iface::global_ipv6(&config.iface)?],
            [] if kept_has(true) => iface::global_ipv6(&config.iface)
                .ok()
                .filter(|ip| usable(IpAddr::V6(*ip)))
                .into_iter()
                .collect(),
            pool => pool.to_vec(),
        };
        let snat = Self {
            v4,
            v6,
            ports: config.snat_ports,
        };
        snat.check_defaults(config)?;
        Ok(snat)
    }

    /// The address taken from the interface must be a usable host's
    /// ([`config::not_a_host`], as a configured one is held to): on `lo`
    /// it is 127.0.0.1, a source no backend's reply can come back to. Then
    /// [`Self::check`] of `config`'s VIPs against the pools taken from the
    /// interface (`Config::validate` checked the configured ones). Both
    /// said as that address's, which the operator never wrote.
    fn check_defaults(&self, config: &Config) -> anyhow::Result<()> {
        let iface = &config.iface;
        let defaults = Self {
            v4: if config.snat_ip.is_empty() {
                self.v4.clone()
            } else {
                Vec::new()
            },
            v6: if config.snat_ip6.is_empty() {
                self.v6.clone()
            } else {
                Vec::new()
            },
            ports: self.ports,
        };
        for ip in defaults.addrs() {
            if let Some(what) = config::not_a_host(ip) {
                let flag = config::snat_flag(ip);
                anyhow::bail!(
                    "no {flag} given, so SNAT would use {iface}'s address {ip}, {what}: the \
                     backends' replies could not come back (give {flag} with an address of this \
                     host they can reach)"
                );
            }
        }
        for v in &config.vips {
            config::check_snat(v, &defaults.addrs(), defaults.ports).with_context(|| {
                let (flag, ip) = match v.vip.addr {
                    SocketAddr::V4(_) => ("--snat-ip", defaults.v4.first().map(|a| a.to_string())),
                    SocketAddr::V6(_) => ("--snat-ip6", defaults.v6.first().map(|a| a.to_string())),
                };
                format!(
                    "no {flag} given, so SNAT uses {iface}'s address {}",
                    ip.unwrap_or_default()
                )
            })?;
        }
        Ok(())
    }

    /// Both pools' addresses.
    pub fn addrs(&self) -> Vec<IpAddr> {
        config::pool_addrs(&self.v4, &self.v6)
    }

    /// The rules VIP `v` and its backends must meet against these pools
    /// and ports (`config::check_snat`): the configuration's at the start,
    /// and what the running balancer takes in later (a VIP or backend added
    /// on the control socket, a SIGHUP's configuration), since the kernel
    /// keeps these pools and ports until a restart. (A discovered backend
    /// is held to them where its etcd value is read: `discover::view`.)
    pub fn check(&self, v: &VipConfig) -> Result<(), ConfigError> {
        let addrs = self.addrs();
        config::check_snat_family(&v.vip, &addrs)?;
        config::check_snat(v, &addrs, self.ports)
    }

    /// `reload`, refusing a configuration whose VIPs or backends break
    /// [`Self::check`] against these pools and ports, those the kernel has
    /// (a reload changes neither): such a SIGHUP is refused whole, before
    /// any of it applies, like one whose file does not parse.
    pub fn checked_reload(&self, reload: Reload) -> Reload {
        let snat = self.clone();
        Arc::new(move || {
            let config = reload()?;
            for v in &config.vips {
                snat.check(v)?;
            }
            Ok(config)
        })
    }

    /// Drops from `state`, the runtime state file's entries, those that
    /// break [`Self::check`] against these pools and ports
    /// (`RuntimeState::drop_snat_refused`), with a warning each naming the
    /// rule, as a reload's refused entry is: only a change of
    /// `--snat-ip`/`--snat-ip6`/`--snat-ports` (or of the interface's
    /// address taken by default) since they were saved brings them here.
    /// The rest of the state applies.
    pub fn drop_refused_state(&self, state: &mut RuntimeState, path: &std::path::Path) {
        for what in state.drop_snat_refused(&self.addrs(), self.ports) {
            warn!(
                "runtime state {}: entry not applied, the SNAT rules refuse it (the SNAT \
                 addresses or ports differ from those it was made with): {what}",
                path.display()
            );
        }
    }

    /// The pool addresses that are not in `local` (the addresses of this
    /// network namespace's interfaces).
    pub fn unassigned(&self, local: &[IpAddr]) -> Vec<IpAddr> {
        let mut addrs = self.addrs();
        addrs.retain(|a| !local.contains(a));
        addrs
    }

    /// Warns about each pool address no interface here holds: the host
    /// answers no ARP or neighbour solicitation for it, so the backends'
    /// replies reach the balancer only if the network routes that address
    /// to it. Not an error: a routed SNAT prefix is a valid setup.
    pub fn warn_unassigned(&self) {
        match iface::local_addresses() {
            Ok(local) => {
                for ip in self.unassigned(&local) {
                    warn!(
                        snat_ip = %ip,
                        "SNAT address not assigned to any interface here: nothing answers ARP or \
                         neighbour solicitations for it, so backends' replies arrive only if the \
                         network routes it to this host (add it to the interface, e.g. as a /32)"
                    );
                }
            }
            Err(e) => warn!("cannot check the SNAT addresses against the interfaces: {e:#}"),
        }
    }
}

impl std::fmt::Display for Snat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let show = |ips: Vec<String>| {
            if ips.is_empty() {
                "-".to_string()
            } else {
                ips.join(",")
            }
        };
        write!(
            f,
            "{} {}",
            show(self.v4.iter().map(ToString::to_string).collect()),
            show(self.v6.iter().map(ToString::to_string).collect())
        )
    }
}

/// The kernel handles the running state writes and reads, all opened at
/// startup.
pub struct KernelHandles {
    /// Selections, tables and scores.
    pub publisher: Publisher,
    /// Per-backend and per-reason counters (metrics).
    pub counters: Counters,
    /// The backends' addresses, for the neighbour task's filter.
    pub neighbours: BackendAddrs,
    /// Latency aggregated in the kernel, read at every score tick.
    pub latency: LatencyReader,
    /// Connections each backend accepted, read for a backend with
    /// refusals to judge (outlier detection).
    pub handshakes: maps::Handshakes,
    /// The health checks' own connections, added to in-flight counts.
    pub control_conns: ControlConnections,
    /// Each family's flow-table size, as the pinned tables have it (an
    /// adopted table keeps the size it was created with).
    pub flow_tables: Capacities,
}

/// What a previous instance left in the pinned maps: its VIPs (with their
/// ids and Maglev tables) and its backends in use. Empty maps (a fresh
/// start) give an empty [`Previous`].
pub fn read_previous(pin_dir: &std::path::Path) -> anyhow::Result<Previous> {
    let vips = maps::vips(pin_dir)?;
    let tables = maps::vip_tables(pin_dir)?;
    let mut previous = Previous::default();
    for entry in vips.iter() {
        let (key, meta) = entry.context("reading VIPS")?;
        let table = tables
            .get(&meta.vip_id, 0)
            .ok()
            .filter(|t| t.has_maglev != 0)
            .map(|t| t.maglev_table);
        previous.vips.push((key, meta.vip_id, table));
    }
    let backends = maps::backends(pin_dir)?;
    for id in 0..MAX_BACKENDS {
        let entry = backends.get(&id, 0).context("reading BACKENDS")?;
        if entry.in_use != 0 {
            previous.backends.push((id, entry));
        }
    }
    Ok(previous)
}

/// On a cold start: the SNAT cursors a clean stop of this instance saved,
/// if it was within the quarantine (`kernel::snat_handover`). A failure
/// leaves the random start and is logged: it costs at most some SYNs a
/// retransmit, never the start.
fn restore_snat_cursors(config: &Config, pin_dir: &std::path::Path, plan: &Plan) {
    let file = snat_handover::path(&config.state_dir, &config.instance);
    let backends: Vec<VipBackend> = (0u32..)
        .zip(plan.backends.iter().copied())
        .filter(|(_, b)| b.in_use != 0)
        .filter_map(|(id, backend)| {
            let vip = plan
                .vips
                .iter()
                .find(|v| v.meta.vip_id == backend.vip_id)?
                .key;
            Some(VipBackend { id, vip, backend })
        })
        .collect();
    match snat_handover::restore(
        pin_dir,
        &file,
        config.snat_ports,
        config.snat_quarantine,
        &backends,
        std::time::SystemTime::now(),
    ) {
        Ok((0, 0)) => {}
        Ok((n, tuples)) => info!(
            backends = n,
            held_tuples = tuples,
            file = %file.display(),
            "SNAT cursors and held tuples of the last clean stop restored: new flows go on past \
             the tuples it used, none takes a tuple its backend still holds in TIME_WAIT unless \
             that TIME_WAIT accepts it, and none takes the tuple of a connection that was open \
             at the stop before that connection's idle timeout and quarantine"
        ),
        Err(e) => warn!("SNAT cursors of the last stop not restored (random start): {e:#}"),
    }
}

/// On a clean stop, before the pins go: every backend's SNAT cursors, for
/// a cold start within the quarantine (`kernel::snat_handover`). Logged,
/// never an error of the stop.
pub fn save_snat_cursors(config: &Config, pin_dir: &std::path::Path) {
    let file = snat_handover::path(&config.state_dir, &config.instance);
    let saved = read_previous(pin_dir).and_then(|previous| {
        if previous.backends.is_empty() {
            // A start that failed before its backends reached the kernel
            // balanced nothing: the file a clean stop left before it is
            // kept for the next start, not replaced by an empty one (whose
            // start would then hand out tuples the backends still hold in
            // TIME_WAIT).
            return Ok(None);
        }
        let backends: Vec<VipBackend> = previous
            .backends
            .iter()
            .filter_map(|&(id, backend)| {
                let (vip, ..) = previous.vips.iter().find(|v| v.1 == backend.vip_id)?;
                Some(VipBackend {
                    id,
                    vip: *vip,
                    backend,
                })
            })
            .collect();
        let idle = snat_handover::IdleTimeouts {
            tcp: config.tcp_idle_timeout,
            udp: config.udp_idle_timeout,
        };
        snat_handover::save(
            pin_dir,
            &file,
            config.snat_ports,
            (config.snat_quarantine, idle),
            &backends,
            std::time::SystemTime::now(),
        )
        .map(Some)
    });
    match saved {
        Ok(None) => info!(
            file = %file.display(),
            "no backend reached the kernel: the SNAT hand-off file is left as it was"
        ),
        Ok(Some((n, tuples))) => info!(
            backends = n,
            held_tuples = tuples,
            file = %file.display(),
            "saved the SNAT cursors and the tuples held (in quarantine, or by connections still \
             open, for their idle timeout)"
        ),
        Err(e) => warn!(
            "SNAT cursors not saved (a cold start within the quarantine starts at random places): {e:#}"
        ),
    }
}

/// Step 1: writes the configuration's [`Plan`] (backends with their cold
/// scores, slots, tables, VIPs), through the publisher the event loop keeps.
/// VIPs and backends the pinned maps already have keep their ids.
/// Backends in `drains` are written draining (the kernel refuses them
/// from the first packet on).
pub fn write_plan(
    config: &Config,
    pin_dir: &std::path::Path,
    clock: &impl Clock,
    drains: &[(VipAddr, SocketAddr)],
) -> anyhow::Result<(Plan, Publisher)> {
    let previous = read_previous(pin_dir)?;
    let mut plan = Plan::adopting(config, &previous);
    for (vip, addr) in drains {
        if let Some(index) = config.vips.iter().position(|v| v.vip == *vip) {
            plan.set_draining(index, *addr);
        }
    }
    if previous.vips.is_empty() && previous.backends.is_empty() {
        maps::seed_snat_cursors(pin_dir)?;
        restore_snat_cursors(config, pin_dir, &plan);
    }
    if !previous.vips.is_empty() {
        info!(
            vips = previous.vips.len(),
            backends = previous.backends.len(),
            draining = plan.draining.len(),
            "kept the ids of the pinned VIPs and backends"
        );
    }
    let initial = LoadTable::new(&plan.weights, config.estimate_params(), clock.now());
    let initial: Vec<_> = initial.scores(clock.now()).map(|(_, s)| s).collect();
    let mut publisher = Publisher::open(pin_dir)?;
    publisher.write_plan(&plan, &initial)?;
    Ok((plan, publisher))
}

/// Step 2: probes every configured backend and writes the MACs learnt
/// into NEIGHBOURS; the returned sync keeps them fresh. A neighbour table
/// that cannot be read is counted in `errors` and does not stop the start
/// (`bpf_fib_lookup` still works, and the refresh tries again).
pub async fn resolve_neighbours(
    config: &Config,
    pin_dir: &std::path::Path,
    ifindex: u32,
    errors: &ControlErrors,
) -> anyhow::Result<NeighbourSync> {
    let mut neighbours = NeighbourSync::new(
        maps::neighbours(pin_dir)?,
        &config.iface,
        ifindex,
        backend_addrs(config),
    );
    neighbours.probe_backends();
    sleep(STARTUP_RESOLVE_WAIT).await;
    errors.check(Stage::Neighbours, neighbours.sync(true));
    Ok(neighbours)
}

/// The configuration's backend addresses, sorted, each once.
pub fn backend_addrs(config: &Config) -> Vec<IpAddr> {
    let mut addrs: Vec<IpAddr> = config
        .vips
        .iter()
        .flat_map(|v| &v.backends)
        .map(|b| b.addr.ip())
        .collect();
    addrs.sort_unstable();
    addrs.dedup();
    addrs
}

/// Step 3: the new-flow cap, then the global config with
/// [`CONFIG_F_READY`]: from here on the program balances.
pub fn mark_ready(
    config: &Config,
    pin_dir: &std::path::Path,
    ifindex: u32,
    snat_ip: Snat,
    attachment: &Attachment,
) -> anyhow::Result<()> {
    let cpus = aya::util::online_cpus()
        .map(|c| c.len() as u32)
        .unwrap_or(1);
    maps::write_new_flow_limit(pin_dir, config.ops.max_new_flows, cpus)?;
    sysctl::reserve_snat_ports(config.snat_ports, &config.instance)?;
    let (snat_v4_count, snat_v6_count) = maps::write_snat_pools(pin_dir, &snat_ip.v4, &snat_ip.v6)?;
    let first = |ip: Option<IpAddr>| ip.map_or([0; 4], |ip| wire::ip_to_words(ip).0);
    let slices = aya::util::online_cpus()
        .map(|online| snat_slices(&online))
        .unwrap_or(cpus);
    let ns = |d: std::time::Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
    maps::write_config(
        pin_dir,
        &LbConfig {
            snat_v4: first(snat_ip.v4.first().copied().map(IpAddr::V4)),
            snat_v6: first(snat_ip.v6.first().copied().map(IpAddr::V6)),
            snat_port_min: config.snat_ports.min,
            snat_port_max: config.snat_ports.max,
            flags: CONFIG_F_READY
                | if config.snat_time_wait_reuse {
                    CONFIG_F_TIME_WAIT_REUSE
                } else {
                    0
                },
            ifindex,
            snat_v4_count,
            snat_v6_count,
            cpus: slices,
            _pad: 0,
            tcp_idle_ns: ns(config.tcp_idle_timeout),
            udp_idle_ns: ns(config.udp_idle_timeout),
            syn_timeout_ns: ns(config.syn_timeout),
            closed_linger_ns: DEFAULT_CLOSED_LINGER_NS,
            snat_quarantine_ns: ns(config.snat_quarantine),
        },
    )?;
    log_ready(config, &snat_ip, attachment);
    if config.snat_quarantine < LINUX_TIME_WAIT {
        warn!(
            quarantine = ?config.snat_quarantine,
            "--snat-quarantine is shorter than Linux's 60 s TIME_WAIT: a SNAT tuple can go back \
             to a backend that still holds it, and that SYN waits a second for its retransmit \
             (docs/bench/tail.md)"
        );
    }
    Ok(())
}

/// How long a Linux backend keeps a closed connection's tuple in TIME_WAIT
/// (`TCP_TIMEWAIT_LEN`, not tunable).
const LINUX_TIME_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// Step 4: the kernel handles the running state keeps open.
pub fn open_kernel_handles(
    pin_dir: &std::path::Path,
    publisher: Publisher,
    neighbours: BackendAddrs,
) -> anyhow::Result<KernelHandles> {
    Ok(KernelHandles {
        publisher,
        counters: Counters::open(pin_dir)?,
        neighbours,
        latency: LatencyReader::open(pin_dir, MAX_BACKENDS as usize)?,
        handshakes: maps::handshakes(pin_dir)?,
        control_conns: ControlConnections::open(pin_dir)?,
        flow_tables: Capacities::of_pins(pin_dir)?,
    })
}

fn log_ready(config: &Config, snat_ip: &Snat, attachment: &Attachment) {
    info!(
        iface = %config.iface,
        mode = if attachment.adopted { "unchanged" } else { config.xdp_mode.name() },
        snat = %format!("{snat_ip}:{}", config.snat_ports),
        instance = %config.instance,
        readopted = attachment.adopted,
        "balancing {} VIP(s)",
        config.vips.len()
    );
    for v in &config.vips {
        let backends: Vec<String> = v.backends.iter().map(|b| b.to_string()).collect();
        info!(
            vip = %v.vip,
            algorithm = v.algorithm.name(),
            inflight_bias = v.inflight_bias,
            p2c_full_scan = v.p2c_full_scan,
            p2c_saturation = v.p2c_saturation,
            "backends {}",
            backends.join(", ")
        );
    }
}

/// Slices of the SNAT tuple space (`LbConfig::cpus`): one per CPU id up to
/// the highest online one, which the data path indexes by its CPU id. Not
/// one per *possible* CPU: a VM that can hot-plug 64 vCPUs with 2 online
/// would have its 2 cursors walk 2/64 of each backend's tuples, the rest
/// reachable only by the few steal tries. A CPU brought online later above
/// the highest shares a slice (`id % slices`), which its `BPF_NOEXIST`
/// claims make safe.
fn snat_slices(online: &[u32]) -> u32 {
    online
        .iter()
        .max()
        .map_or(1, |&highest| highest.saturating_add(1))
}

#[cfg(test)]
mod tests {

    use super::*;

    #[test]
    fn snat_slices_follow_the_online_cpus_not_the_possible_ones() {
        // 2 online of 64 possible: 2 slices, each half the tuples.
        assert_eq!(snat_slices(&[0, 1]), 2);
        // A gap (CPU 1 offline): one slice per id up to the highest.
        assert_eq!(snat_slices(&[0, 2, 3]), 4);
        assert_eq!(snat_slices(&[]), 1);
    }

    /// The configuration of the flags `argv` (after the program name).
    fn config(argv: &[&str]) -> Config {
        Config::of(argv, "")
    }

    /// VIP `vip` with one backend, `backend`, on `iface`, and the flags `extra`.
    fn one_vip(iface: &str, vip: &str, backend: &str, extra: &[&str]) -> Config {
        let flags = ["--iface", iface, "--vip", vip, "--backend", backend];
        config(&[&flags[..], extra].concat())
    }

    /// The pools the interface gives by default: `v4` and `v6`.
    fn from_iface(config: &Config, v4: &[&str], v6: &[&str]) -> Snat {
        Snat {
            v4: v4.iter().map(|a| a.parse().unwrap()).collect(),
            v6: v6.iter().map(|a| a.parse().unwrap()).collect(),
            ports: config.snat_ports,
        }
    }

    #[test]
    fn the_interfaces_address_taken_by_default_is_held_to_the_snat_rules() {
        // Valid as configured: the SNAT address is not known yet.
        let c = one_vip("eth0", "10.0.0.1:25000", "10.0.0.21:80", &[]);
        let e = from_iface(&c, &["10.0.0.1"], &[])
            .check_defaults(&c)
            .unwrap_err();
        assert_eq!(
            format!("{e:#}"),
            "no --snat-ip given, so SNAT uses eth0's address 10.0.0.1: VIP 10.0.0.1:25000/tcp is \
             on SNAT address 10.0.0.1 with its port in the SNAT port range 20000-32767: the \
             balancer would drop every new connection to it as a reply to a SNAT connection that \
             has ended (move the VIP's port out of --snat-ports, or use another --snat-ip)"
        );
        assert!(
            from_iface(&c, &["10.0.0.2"], &[])
                .check_defaults(&c)
                .is_ok()
        );
        let c = one_vip("eth0", "[2001:db8::1]:30000/udp", "[2001:db8::21]:80", &[]);
        let e = from_iface(&c, &[], &["2001:db8::1"])
            .check_defaults(&c)
            .unwrap_err();
        let e = format!("{e:#}");
        assert!(e.starts_with("no --snat-ip6 given, so SNAT uses eth0's address 2001:db8::1: VIP [2001:db8::1]:30000/udp is on SNAT address 2001:db8::1"), "{e}");
        assert!(e.ends_with("or use another --snat-ip6)"), "{e}");
        // A backend at the interface's address.
        let c = one_vip("eth0", "10.0.0.100:80", "10.0.0.1:80", &[]);
        let e = from_iface(&c, &["10.0.0.1"], &[])
            .check_defaults(&c)
            .unwrap_err();
        assert!(
            format!("{e:#}").contains(
                "backend 10.0.0.1:80 of VIP 10.0.0.100:80/tcp is at SNAT address 10.0.0.1"
            ),
            "{e:#}"
        );
        // A configured pool was checked with the configuration: not again.
        let c = one_vip(
            "eth0",
            "10.0.0.1:80",
            "10.0.0.21:80",
            &["--snat-ip", "10.0.0.1"],
        );
        assert!(
            from_iface(&c, &["10.0.0.1"], &[])
                .check_defaults(&c)
                .is_ok()
        );
    }

    #[test]
    fn a_loopback_address_taken_from_the_interface_is_refused_as_the_snat_address() {
        let c = one_vip("lo", "10.0.0.100:80", "10.0.0.21:80", &[]);
        let e = from_iface(&c, &["127.0.0.1"], &[])
            .check_defaults(&c)
            .unwrap_err();
        assert_eq!(
            format!("{e:#}"),
            "no --snat-ip given, so SNAT would use lo's address 127.0.0.1, a loopback address, \
             which never crosses a wire: the backends' replies could not come back (give \
             --snat-ip with an address of this host they can reach)"
        );
        let e = from_iface(&c, &["10.0.0.1"], &["::1"])
            .check_defaults(&c)
            .unwrap_err();
        assert!(
            format!("{e:#}").starts_with("no --snat-ip6 given, so SNAT would use lo's address ::1"),
            "{e:#}"
        );
        // A configured pool is the configuration's to check: the
        // interface's address is not taken then.
        let c = one_vip(
            "lo",
            "10.0.0.100:80",
            "10.0.0.21:80",
            &["--snat-ip", "10.0.0.1"],
        );
        assert!(
            from_iface(&c, &["10.0.0.1"], &[])
                .check_defaults(&c)
                .is_ok()
        );
    }

    #[test]
    fn a_reload_is_refused_when_it_breaks_the_snat_rules_against_the_running_pools() {
        let running = one_vip("eth0", "10.0.0.100:80", "10.0.0.21:80", &[]);
        let snat = from_iface(&running, &["10.0.0.1"], &[]);
        let reread =
            |argv: &'static [&'static str]| -> Reload { Arc::new(move || Ok(config(argv))) };
        // Valid as a file: its SNAT address is the interface's, known here only.
        let on_snat_port = snat.checked_reload(reread(&[
            "--iface",
            "eth0",
            "--vip",
            "10.0.0.1:20000",
            "--backend",
            "10.0.0.21:80",
        ]));
        let e = on_snat_port().unwrap_err().to_string();
        assert!(
            e.starts_with("VIP 10.0.0.1:20000/tcp is on SNAT address 10.0.0.1"),
            "{e}"
        );
        let backend_on_snat = snat.checked_reload(reread(&[
            "--iface",
            "eth0",
            "--vip",
            "10.0.0.100:80",
            "--backend",
            "10.0.0.1:8080",
        ]));
        let e = backend_on_snat().unwrap_err().to_string();
        assert!(
            e.starts_with(
                "backend 10.0.0.1:8080 of VIP 10.0.0.100:80/tcp is at SNAT address 10.0.0.1"
            ),
            "{e}"
        );
        // The running ports, not the file's (a change of them needs a restart).
        let new_ports = snat.checked_reload(reread(&[
            "--iface",
            "eth0",
            "--vip",
            "10.0.0.1:20000",
            "--backend",
            "10.0.0.21:80",
            "--snat-ports",
            "40000-50000",
        ]));
        assert!(new_ports().is_err());
        let fine = snat.checked_reload(reread(&[
            "--iface",
            "eth0",
            "--vip",
            "10.0.0.1:80",
            "--backend",
            "10.0.0.21:80",
        ]));
        assert_eq!(fine().unwrap().vips[0].vip.to_string(), "10.0.0.1:80/tcp");
        let unreadable: Reload = Arc::new(|| anyhow::bail!("cannot read config file x.toml"));
        let e = snat.checked_reload(unreadable)().unwrap_err().to_string();
        assert_eq!(e, "cannot read config file x.toml");
    }

    #[test]
    fn unassigned_lists_the_pool_addresses_of_both_families_no_interface_holds() {
        let snat = Snat {
            v4: vec![Ipv4Addr::new(10, 0, 0, 5), Ipv4Addr::new(10, 0, 0, 6)],
            v6: vec![
                "2001:db8::5".parse().unwrap(),
                "2001:db8::6".parse().unwrap(),
            ],
            ..Snat::default()
        };
        let local: Vec<IpAddr> = ["127.0.0.1", "10.0.0.5", "2001:db8::6", "fe80::1"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect();
        assert_eq!(
            snat.unassigned(&local),
            ["10.0.0.6", "2001:db8::5"]
                .iter()
                .map(|a| a.parse::<IpAddr>().unwrap())
                .collect::<Vec<_>>()
        );
        assert!(
            Snat {
                v4: vec![Ipv4Addr::new(10, 0, 0, 5)],
                ..Snat::default()
            }
            .unassigned(&local)
            .is_empty()
        );
    }
}
