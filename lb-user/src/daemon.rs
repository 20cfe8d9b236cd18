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
    control,
    events::EventStream,
    health::CheckResult,
    loader::Attachment,
    maps, metrics,
    neighbours::{NeighbourSync, REFRESH_INTERVAL, STARTUP_RESOLVE_WAIT},
    plan::Plan,
    reconcile::{RECONCILE_INTERVAL, Reconciler, Scan, Timeouts},
    runtime::Runtime,
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
/// `reload` re-reads the configuration on SIGHUP.
pub async fn serve(
    config: &Config,
    reload: &dyn Fn() -> anyhow::Result<Config>,
    ifindex: u32,
    snat_ip: Snat,
) -> anyhow::Result<()> {
    // Installed before attaching, so a signal during startup still cleans up.
    let mut shutdown = Shutdown::install()?;
    let attachment = Attachment::start(config, ifindex)?;
    let result =
        configure_and_run(config, reload, ifindex, snat_ip, &attachment, &mut shutdown).await;
    let stopped = attachment.stop();
    result?;
    stopped.context("removing the pins")?;
    info!("detached and removed the pins");
    Ok(())
}

async fn configure_and_run(
    config: &Config,
    reload: &dyn Fn() -> anyhow::Result<Config>,
    ifindex: u32,
    snat_ip: Snat,
    attachment: &Attachment,
    shutdown: &mut Shutdown,
) -> anyhow::Result<()> {
    let pin_dir = attachment.pin_dir.clone();
    let plan = Plan::new(config);
    let clock = MonotonicClock;
    let initial = LoadTable::new(
        &plan.weights,
        config.ewma_cold_start,
        config.ewma_tau,
        clock.now(),
    );
    let initial: Vec<_> = initial.scores(clock.now()).map(|(_, s)| s).collect();
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

    let cpus = aya::util::online_cpus()
        .map(|c| c.len() as u32)
        .unwrap_or(1);
    maps::write_new_flow_limit(&pin_dir, config.ops.max_new_flows, cpus)?;
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

    let (check_tx, check_rx) = mpsc::channel(CHANNEL_DEPTH);
    let mut runtime = Runtime::new(config, &plan, &pin_dir, ifindex, clock.now(), check_tx)?;
    let (control_tx, control_rx) = mpsc::channel(CHANNEL_DEPTH);
    let (scrape_tx, scrape_rx) = mpsc::channel(CHANNEL_DEPTH);
    let mut tasks = vec![
        spawn_neighbour_refresh(neighbours),
        control::serve(&config.instance, control_tx)?,
    ];
    if let Some(addr) = config.ops.metrics_addr {
        // A taken port must not stop the balancer: metrics are secondary.
        match metrics::serve(addr, scrape_tx).await {
            Ok(task) => tasks.push(task),
            Err(e) => warn!("metrics disabled: {e:#}"),
        }
    }
    tasks.extend(spawn_ebpf_log_drain(attachment.program_id));
    let (scan_tx, scan_rx) = mpsc::channel(1);
    let reconciler = Reconciler::open(
        &pin_dir,
        runtime.id_limit.clone(),
        Timeouts {
            tcp_idle: config.tcp_idle_timeout,
            udp_idle: config.udp_idle_timeout,
            syn: config.syn_timeout,
        },
        clock,
    )?;
    let reconcile_task = spawn_reconciler(reconciler, scan_tx);

    let inputs = Inputs {
        scans: scan_rx,
        checks: check_rx,
        control: control_rx,
        scrapes: scrape_rx,
        hangup: signal(SignalKind::hangup()).context("installing the SIGHUP handler")?,
    };
    let result = event_loop(config, &pin_dir, &mut runtime, inputs, reload, shutdown).await;
    reconcile_task.abort();
    for task in tasks {
        task.abort();
    }
    control::remove_socket(&config.instance);
    for (id, tally) in runtime.loads().tallies() {
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

/// Queue depth of the channels into the event loop.
const CHANNEL_DEPTH: usize = 64;

/// Everything besides kernel events that the event loop waits on.
struct Inputs {
    scans: mpsc::Receiver<Scan>,
    checks: mpsc::Receiver<CheckResult>,
    control: mpsc::Receiver<control::Pending>,
    scrapes: mpsc::Receiver<metrics::Scrape>,
    hangup: Signal,
}

/// Drains events, ticks the runtime every score interval, and routes
/// reconciliation results, health checks, operator commands, reloads and
/// scrapes to it, until a shutdown signal.
async fn event_loop(
    config: &Config,
    pin_dir: &std::path::Path,
    runtime: &mut Runtime,
    mut inputs: Inputs,
    reload: &dyn Fn() -> anyhow::Result<Config>,
    shutdown: &mut Shutdown,
) -> anyhow::Result<()> {
    let clock = MonotonicClock;
    let mut events = EventStream::new(maps::events(pin_dir)?)?;
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
                let mut ejected = false;
                for event in batch.drain(..) {
                    ejected |= runtime.apply_event(event, now);
                }
                if ejected {
                    runtime.tick(now)?;
                }
            }
            _ = score_tick.tick() => runtime.tick(clock.now())?,
            Some(scan) = inputs.scans.recv() => {
                runtime.after_scan(&scan, clock.now())?;
                if !scan.expired_idle.is_empty() || !scan.expired_syn.is_empty() {
                    debug!(idle = scan.expired_idle.len(), syn = scan.expired_syn.len(), "expired flows");
                }
            }
            Some(result) = inputs.checks.recv() => runtime.health(result, clock.now())?,
            Some((request, reply)) = inputs.control.recv() => {
                let _ = reply.send(runtime.control(&request, clock.now()));
            }
            Some(reply) = inputs.scrapes.recv() => {
                let _ = reply.send(metrics::render(&runtime.snapshot(clock.now())));
            }
            _ = inputs.hangup.recv() => match reload() {
                Ok(new) => {
                    // New backends' MACs first, so their first flows have a next hop.
                    for v in &new.vips {
                        for b in &v.backends {
                            crate::neighbours::probe(b.addr.ip());
                        }
                    }
                    sleep(STARTUP_RESOLVE_WAIT).await;
                    runtime.reload(&new, clock.now())?;
                }
                Err(e) => warn!("SIGHUP: keeping the running configuration: {e:#}"),
            },
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
