//! The running balancer: attach (or re-adopt), write the configuration,
//! then keep scores, flow accounting and neighbours current until
//! SIGINT/SIGTERM, and clean up.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use anyhow::Context as _;
use lb_common::{CONFIG_F_READY, LbConfig};
use tokio::{
    signal::unix::{Signal, SignalKind, signal},
    sync::mpsc,
    task::JoinHandle,
    time::{MissedTickBehavior, interval, sleep},
};
use tracing::{debug, info, warn};

use crate::{
    backend_load::LoadTable,
    clock::{Clock, MonotonicClock},
    config::Config,
    events::{CloseReason, Event, EventStream},
    loader::Attachment,
    maps,
    neighbours::{NeighbourSync, REFRESH_INTERVAL, STARTUP_RESOLVE_WAIT},
    plan::Plan,
    reconcile::{RECONCILE_INTERVAL, Reconciler, Scan, Timeouts},
    wire,
};

/// Signals that end the daemon cleanly.
struct Shutdown {
    interrupt: Signal,
    terminate: Signal,
}

impl Shutdown {
    fn install() -> anyhow::Result<Self> {
        Ok(Self {
            interrupt: signal(SignalKind::interrupt()).context("installing the SIGINT handler")?,
            terminate: signal(SignalKind::terminate()).context("installing the SIGTERM handler")?,
        })
    }

    async fn wait(&mut self) -> &'static str {
        tokio::select! {
            _ = self.interrupt.recv() => "SIGINT",
            _ = self.terminate.recv() => "SIGTERM",
        }
    }
}

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
            None if has(false) => Some(crate::iface::primary_ipv4(&config.iface)?),
            None => None,
        };
        let v6 = match config.snat_ip6 {
            Some(ip) => Some(ip),
            None if has(true) => Some(crate::iface::global_ipv6(&config.iface)?),
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

/// Runs until a signal; always detaches and removes the pins on the way out.
pub async fn serve(config: &Config, ifindex: u32, snat_ip: Snat) -> anyhow::Result<()> {
    // Installed before attaching, so a signal during startup still cleans up.
    let mut shutdown = Shutdown::install()?;
    let attachment = Attachment::start(config, ifindex)?;
    let result = configure_and_run(config, ifindex, snat_ip, &attachment, &mut shutdown).await;
    let stopped = attachment.stop();
    result?;
    stopped.context("removing the pins")?;
    info!("detached and removed the pins");
    Ok(())
}

async fn configure_and_run(
    config: &Config,
    ifindex: u32,
    snat_ip: Snat,
    attachment: &Attachment,
    shutdown: &mut Shutdown,
) -> anyhow::Result<()> {
    let pin_dir = attachment.pin_dir.clone();
    let plan = Plan::new(config);
    let clock = MonotonicClock;
    let mut loads = LoadTable::new(
        &plan.weights,
        config.ewma_cold_start,
        config.ewma_tau,
        clock.now(),
    );
    let initial: Vec<_> = loads.scores(clock.now()).map(|(_, s)| s).collect();
    maps::write_plan(&pin_dir, &plan, &initial)?;

    let backend_ips: Vec<IpAddr> = config
        .vips
        .iter()
        .flat_map(|v| &v.backends)
        .map(|b| b.addr.ip())
        .collect();
    let mut neighbours = NeighbourSync::new(
        maps::neighbours(&pin_dir)?,
        &config.iface,
        ifindex,
        backend_ips,
    );
    neighbours.probe_backends();
    sleep(STARTUP_RESOLVE_WAIT).await;
    neighbours.sync(true)?;

    let (snat_v4, snat_v6) = snat_ip.words();
    maps::write_config(
        &pin_dir,
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

    let mut tasks = vec![spawn_neighbour_refresh(neighbours)];
    tasks.extend(spawn_ebpf_log_drain(attachment.program_id));
    let (scan_tx, scan_rx) = mpsc::channel(1);
    let reconciler = Reconciler::open(
        &pin_dir,
        plan.backends.len(),
        Timeouts {
            tcp_idle: config.tcp_idle_timeout,
            udp_idle: config.udp_idle_timeout,
            syn: config.syn_timeout,
        },
        clock,
    )?;
    let reconcile_task = spawn_reconciler(reconciler, scan_tx);

    let result = event_loop(config, &pin_dir, &mut loads, scan_rx, shutdown).await;
    reconcile_task.abort();
    for task in tasks {
        task.abort();
    }
    for (id, tally) in loads.tallies() {
        info!(backend = id, ?tally, "events seen by this process");
    }
    result
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

/// Drains events, rewrites scores every score interval, and applies the
/// reconciler's expirations, until a shutdown signal.
async fn event_loop(
    config: &Config,
    pin_dir: &std::path::Path,
    loads: &mut LoadTable,
    mut scans: mpsc::Receiver<Scan>,
    shutdown: &mut Shutdown,
) -> anyhow::Result<()> {
    let clock = MonotonicClock;
    let mut events = EventStream::new(maps::events(pin_dir)?)?;
    let mut scores = maps::scores(pin_dir)?;
    let mut score_tick = interval(config.score_interval);
    score_tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut batch = Vec::new();
    loop {
        tokio::select! {
            signal = shutdown.wait() => {
                info!("{signal} received, shutting down");
                return Ok(());
            }
            drained = events.next_batch(&mut batch) => {
                drained?;
                let now = clock.now();
                for event in batch.drain(..) {
                    loads.apply(event, now);
                }
            }
            _ = score_tick.tick() => {
                let now = clock.now();
                for (id, score) in loads.scores(now) {
                    scores.set(id, score, 0).context("writing BACKEND_SCORES")?;
                }
            }
            Some(scan) = scans.recv() => {
                let now = clock.now();
                for backend in scan.expired_idle.iter().copied() {
                    loads.apply(Event::Closed { backend, reason: CloseReason::Idle }, now);
                }
                for backend in scan.expired_syn.iter().copied() {
                    loads.apply(Event::Refused { backend }, now);
                }
                if !scan.expired_idle.is_empty() || !scan.expired_syn.is_empty() {
                    debug!(idle = scan.expired_idle.len(), syn = scan.expired_syn.len(), "expired flows");
                }
            }
        }
    }
}

/// Runs a reconciliation pass every [`RECONCILE_INTERVAL`] on a blocking
/// thread (a large flow table takes many syscalls to walk).
fn spawn_reconciler(
    reconciler: Reconciler<MonotonicClock>,
    results: mpsc::Sender<Scan>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut reconciler = reconciler;
        loop {
            sleep(RECONCILE_INTERVAL).await;
            let joined = tokio::task::spawn_blocking(move || {
                let outcome = reconciler.pass();
                (reconciler, outcome)
            })
            .await;
            let Ok((back, outcome)) = joined else {
                warn!("reconciliation thread failed; flow accounting stops");
                return;
            };
            reconciler = back;
            match outcome {
                Ok(scan) => {
                    if results.send(scan).await.is_err() {
                        return;
                    }
                }
                Err(e) => warn!("reconciliation pass failed: {e:#}"),
            }
        }
    })
}

fn spawn_neighbour_refresh(mut neighbours: NeighbourSync) -> JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            sleep(REFRESH_INTERVAL).await;
            neighbours.probe_backends();
            sleep(STARTUP_RESOLVE_WAIT).await;
            if let Err(e) = neighbours.sync(false) {
                warn!("refreshing neighbours: {e:#}");
            }
        }
    })
}

/// Forwards the program's aya-log records (if it has any) to tracing.
fn spawn_ebpf_log_drain(program_id: u32) -> Option<JoinHandle<()>> {
    let logger = match aya_log::EbpfLogger::init_from_id(program_id) {
        Ok(logger) => logger,
        Err(e) => {
            debug!("no eBPF log channel: {e}");
            return None;
        }
    };
    // SAFETY: the logger owns its ring-buffer fd for as long as the AsyncFd lives.
    let mut fd = match unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(logger, tokio::io::Interest::READABLE)
    } {
        Ok(fd) => fd,
        Err(e) => {
            warn!("cannot poll eBPF logs: {e}");
            return None;
        }
    };
    Some(tokio::spawn(async move {
        while let Ok(mut guard) = fd.readable_mut().await {
            guard.get_inner_mut().flush();
            guard.clear_ready();
        }
    }))
}
