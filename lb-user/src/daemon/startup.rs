//! Startup in named steps, each leaving the kernel in a state the running
//! program can use: write the plan, learn the backends' MACs, mark the
//! configuration ready; then open what the event loop needs.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use anyhow::Context as _;
use lb_common::{CONFIG_F_READY, LbConfig, MAX_BACKENDS};
use tokio::time::sleep;
use tracing::info;

use super::errors::{ControlErrors, Stage};
use crate::{
    estimate::backend_load::LoadTable,
    kernel::{
        attach::Attachment,
        clock::Clock,
        iface,
        maps::{self, Counters},
        neighbours::{NeighbourSync, STARTUP_RESOLVE_WAIT},
        wire,
    },
    pool::plan::{Plan, Previous},
    publish::publisher::Publisher,
    settings::{addr::VipAddr, config::Config},
};

/// SNAT source addresses per family. A family without a VIP needs none
/// (the data path then never uses it; its word stays zero).
#[derive(Clone, Copy, Debug)]
pub struct Snat {
    pub v4: Option<Ipv4Addr>,
    pub v6: Option<Ipv6Addr>,
}

impl Snat {
    /// The configured addresses, or the interface's for the families of the VIPs.
    pub fn resolve(config: &Config) -> anyhow::Result<Self> {
        let has = |v6: bool| config.vips.iter().any(|v| v.vip.addr.is_ipv6() == v6);
        let v4 = match config.snat_ip {
            Some(ip) => Some(ip),
            None if has(false) => Some(iface::primary_ipv4(&config.iface)?),
            None => None,
        };
        let v6 = match config.snat_ip6 {
            Some(ip) => Some(ip),
            None if has(true) => Some(iface::global_ipv6(&config.iface)?),
            None => None,
        };
        Ok(Self { v4, v6 })
    }

    fn words(self) -> ([u32; 4], [u32; 4]) {
        let w = |ip: Option<IpAddr>| ip.map_or([0; 4], |ip| wire::ip_to_words(ip).0);
        (w(self.v4.map(IpAddr::V4)), w(self.v6.map(IpAddr::V6)))
    }
}

impl std::fmt::Display for Snat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let show = |ip: Option<IpAddr>| ip.map_or("-".to_string(), |ip| ip.to_string());
        write!(
            f,
            "{} {}",
            show(self.v4.map(IpAddr::V4)),
            show(self.v6.map(IpAddr::V6))
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
    /// Mirrors the ARP table into NEIGHBOURS when backends join at runtime.
    pub neighbours: NeighbourSync,
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
    if !previous.vips.is_empty() {
        info!(
            vips = previous.vips.len(),
            backends = previous.backends.len(),
            draining = plan.draining.len(),
            "kept the ids of the pinned VIPs and backends"
        );
    }
    let initial = LoadTable::new(
        &plan.weights,
        config.ewma_cold_start,
        config.ewma_tau,
        clock.now(),
    );
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
    let backend_ips: Vec<IpAddr> = config
        .vips
        .iter()
        .flat_map(|v| &v.backends)
        .map(|b| b.addr.ip())
        .collect();
    let mut neighbours = NeighbourSync::new(
        maps::neighbours(pin_dir)?,
        &config.iface,
        ifindex,
        backend_ips,
    );
    neighbours.probe_backends();
    sleep(STARTUP_RESOLVE_WAIT).await;
    errors.check(Stage::Neighbours, neighbours.sync(true));
    Ok(neighbours)
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
    let (snat_v4, snat_v6) = snat_ip.words();
    maps::write_config(
        pin_dir,
        &LbConfig {
            snat_v4,
            snat_v6,
            snat_port_min: config.snat_ports.min,
            snat_port_max: config.snat_ports.max,
            flags: CONFIG_F_READY,
            ifindex,
            _pad: 0,
        },
    )?;
    log_ready(config, snat_ip, attachment);
    Ok(())
}

/// Step 4: the kernel handles the running state keeps open.
pub fn open_kernel_handles(
    config: &Config,
    pin_dir: &std::path::Path,
    ifindex: u32,
    publisher: Publisher,
) -> anyhow::Result<KernelHandles> {
    Ok(KernelHandles {
        publisher,
        counters: Counters::open(pin_dir)?,
        neighbours: NeighbourSync::new(
            maps::neighbours(pin_dir)?,
            &config.iface,
            ifindex,
            Vec::new(),
        ),
    })
}

fn log_ready(config: &Config, snat_ip: Snat, attachment: &Attachment) {
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
            "backends {}",
            backends.join(", ")
        );
    }
}
