//! The running balancer: attach (or re-adopt), then start in named steps
//! ([`startup`]), run the [`event_loop`] that routes every input to the
//! [`runtime`]'s handlers until SIGINT/SIGTERM, and clean up.
//!
//! May use: every other folder (it comes last).
//! Order: settings → kernel → ingest → estimate → pool → publish → surface → discover → daemon.

pub mod command;
pub mod discovery;
pub mod errors;
pub mod event_loop;
pub mod neighbours;
pub mod runtime;
pub mod snapshot;
pub mod startup;
pub mod state;
pub mod tasks;
mod zone_opened;
mod zones;

use anyhow::Context as _;
use tokio::{
    sync::{mpsc, watch},
    task::JoinHandle,
};
use tracing::{info, warn};

pub use self::tasks::Reload;
use std::net::SocketAddr;

use self::{
    errors::ControlErrors,
    event_loop::{EventLoop, Handlers, Inputs, Shutdown},
    runtime::Runtime,
    startup::Snat,
    state::StateKeeper,
};
use crate::{
    discover::watch::{Update, Watcher},
    ingest::{
        events::{Event, EventStream},
        reconcile::{Reconciler, Scan},
    },
    kernel::{
        attach::Attachment,
        backend_hops::{BackendIds, PinnedHops},
        clock::{Clock, MonotonicClock, Nanos},
        maps, sysctl,
    },
    pool::health::CheckResult,
    settings::{
        addr::VipAddr,
        config::Config,
        state::{self as settings_state, RuntimeState},
    },
    surface::{
        control::{self, Request, Response},
        metrics::{self, Snapshot},
    },
};

type StateReceiver = tokio::sync::watch::Receiver<RuntimeState>;

/// Queue depth of the channels into the event loop.
const CHANNEL_DEPTH: usize = 64;

/// Runs until a signal; always detaches and removes the pins on the way out.
/// `reload` re-reads the configuration on SIGHUP; `state` (the runtime
/// state file's contents) is laid over `base`, the configuration as read.
pub async fn serve(
    base: &Config,
    state: RuntimeState,
    reload: Reload,
    ifindex: u32,
    snat_ip: Snat,
    discovery: Option<Watcher>,
) -> anyhow::Result<()> {
    // Installed before attaching, so a signal during startup still cleans up.
    let mut shutdown = Shutdown::install()?;
    let (keeper, effective, saves) = StateKeeper::new(base, state);
    let config = &effective.config;
    let attachment = Attachment::start(config, ifindex)?;
    let started = Started {
        config,
        ifindex,
        attachment: &attachment,
    };
    let result = match started
        .configure_and_run(
            MonotonicClock,
            snat_ip,
            reload,
            (keeper, effective.drains, saves),
            &mut shutdown,
            discovery,
        )
        .await
    {
        Ok(ran) => ran,
        // A failed start on a running instance (re-adopted after its
        // process died) leaves it as it was: attached, pinned, balancing
        // its flows on what the kernel has. Detaching would cut every one
        // of them for an error this process made.
        Err(e) if attachment.adopted => {
            return Err(e.context(format!(
                "starting on the running instance {}, which is left attached and \
                 balancing its flows; fix this and start lb-user again",
                config.instance
            )));
        }
        Err(e) => Err(e),
    };
    startup::save_snat_cursors(config, &attachment.pin_dir);
    let stopped = attachment.stop();
    if stopped.is_ok() {
        // Detached: no balanced flow holds a SNAT port any more.
        sysctl::release_snat_ports(&config.instance);
    }
    result?;
    stopped.context("removing the pins")?;
    info!("detached and removed the pins");
    Ok(())
}

/// What every step after the attach works with.
struct Started<'a> {
    config: &'a Config,
    ifindex: u32,
    attachment: &'a Attachment,
}

impl Started<'_> {
    /// The startup steps, the event loop, and the cleanup of what they
    /// started: the outer error is a startup step's (the event loop never
    /// ran), the inner result the event loop's.
    async fn configure_and_run<C: Clock + Clone + Send + 'static>(
        &self,
        clock: C,
        snat_ip: Snat,
        reload: Reload,
        (keeper, drains, saves): (StateKeeper, Vec<(VipAddr, SocketAddr)>, StateReceiver),
        shutdown: &mut Shutdown,
        discovery: Option<Watcher>,
    ) -> anyhow::Result<anyhow::Result<()>> {
        let (config, pin_dir) = (self.config, &self.attachment.pin_dir);
        let errors = ControlErrors::default();
        let (plan, publisher) = startup::write_plan(config, pin_dir, &clock, &drains)?;
        let neighbour_sync =
            startup::resolve_neighbours(config, pin_dir, self.ifindex, &errors).await?;
        // Empty until the runtime publishes the fleet's ids, below, before
        // the neighbour task starts.
        let (backend_addrs, backend_addrs_rx) = watch::channel(BackendIds::default());
        let backend_hops = PinnedHops::open(pin_dir)?;
        let kernel = startup::open_kernel_handles(pin_dir, publisher, backend_addrs)?;
        let (check_tx, check_rx) = mpsc::channel(CHANNEL_DEPTH);
        let mut runtime = Runtime::new(
            config,
            &plan,
            kernel,
            clock.now(),
            check_tx,
            errors.clone(),
            keeper,
        );
        runtime.zone_opened = zone_opened::ZoneOpened::new(self.attachment.adopted);
        // What is added later is held to the SNAT rules against the pools
        // the kernel gets (the interface's address included).
        runtime.snat = snat_ip.clone();
        let reload = snat_ip.checked_reload(reload);
        runtime.drain_kept(&drains, clock.now());
        runtime.publish_backend_addrs();
        startup::mark_ready(config, pin_dir, self.ifindex, snat_ip, self.attachment)?;
        let state_path = settings_state::path(&config.state_dir, &config.instance);
        let (control_tx, control_rx) = mpsc::channel(CHANNEL_DEPTH);
        let (scrape_tx, scrape_rx) = mpsc::channel(CHANNEL_DEPTH);
        let (reload_tx, reload_rx) = mpsc::channel(1);
        let hangup = shutdown.take_hangup()?;
        let mut tasks = vec![
            state::spawn_writer(state_path, saves, runtime.state.saved(), errors.clone()),
            neighbours::spawn_neighbour_watch(
                neighbour_sync,
                backend_hops,
                backend_addrs_rx,
                errors.clone(),
            ),
            tasks::spawn_reloader(reload, hangup, reload_tx, errors.clone()),
            control::serve(
                &config.instance,
                config.ops.control_group.clone(),
                self.ifindex,
                control_tx,
            )?,
        ];
        tasks.extend(self.serve_metrics(scrape_tx).await);
        tasks.extend(tasks::spawn_ebpf_log_drain(self.attachment.program_id));
        let (reconcile_task, scan_rx) = self.start_reconciler(&runtime)?;
        tasks.push(reconcile_task);
        let discovery_rx = discovery.map(|watcher| {
            let (tx, rx) = mpsc::channel(CHANNEL_DEPTH);
            runtime.discovery.status = Some(watcher.status.clone());
            for (vip, prefix, task) in watcher.spawn(tx) {
                runtime
                    .discovery
                    .watches
                    .insert((vip, prefix), task.abort_handle());
                tasks.push(task);
            }
            rx
        });
        let inputs = Inputs {
            scans: scan_rx,
            checks: check_rx,
            control: control_rx,
            scrapes: scrape_rx,
            reloads: reload_rx,
            discovery: discovery_rx,
        };
        let events = EventStream::new(maps::events(pin_dir)?)?;
        let mut event_loop = EventLoop::new(clock, runtime, errors);
        let result = event_loop
            .run(events, inputs, config.score_interval, shutdown)
            .await;
        self.stop(tasks, &event_loop.handlers);
        Ok(result)
    }

    /// The metrics listener, if configured; a taken port must not stop the
    /// balancer (metrics are secondary).
    async fn serve_metrics(
        &self,
        scrapes: mpsc::Sender<metrics::Scrape>,
    ) -> Option<JoinHandle<()>> {
        let addr = self.config.ops.metrics_addr?;
        match metrics::serve(addr, scrapes).await {
            Ok(task) => Some(task),
            Err(e) => {
                let in_use = e
                    .root_cause()
                    .downcast_ref::<std::io::Error>()
                    .is_some_and(|io| io.kind() == std::io::ErrorKind::AddrInUse);
                if in_use {
                    warn!(
                        "metrics disabled: {e:#} (another instance's? each instance on a host \
                         needs its own --metrics-addr, or `off`)"
                    );
                } else {
                    warn!("metrics disabled: {e:#}");
                }
                None
            }
        }
    }

    /// Reconciliation passes on their own task, sharing the id space's
    /// length with the runtime.
    fn start_reconciler(
        &self,
        runtime: &Runtime,
    ) -> anyhow::Result<(JoinHandle<()>, mpsc::Receiver<Scan>)> {
        let (scan_tx, scan_rx) = mpsc::channel(1);
        let reconciler = Reconciler::open(
            &self.attachment.pin_dir,
            runtime.id_limit.clone(),
            runtime.passes_started.clone(),
        )?;
        Ok((
            tasks::spawn_reconciler(reconciler, scan_tx, runtime.errors.clone()),
            scan_rx,
        ))
    }

    fn stop(&self, tasks: Vec<JoinHandle<()>>, runtime: &Runtime) {
        for task in tasks {
            task.abort();
        }
        // The writer's last changes, if it had not saved them.
        let config = self.config;
        runtime
            .state
            .save_unsaved(&settings_state::path(&config.state_dir, &config.instance));
        control::remove_socket(&self.config.instance);
        let _ = std::fs::remove_file(crate::surface::status::discovery_path(
            &self.config.instance,
        ));
        let _ = std::fs::remove_file(crate::surface::status::zones_path(&self.config.instance));
        for (id, tally) in runtime.loads().tallies() {
            info!(backend = id, ?tally, "events seen by this process");
        }
    }
}

impl Handlers for Runtime {
    fn on_event(&mut self, event: Event, now: Nanos) {
        Runtime::on_event(self, event, now)
    }
    fn on_tick(&mut self, now: Nanos) -> anyhow::Result<()> {
        // Discovery work held back is retried here, and this tick publishes it.
        self.reapply_discovery(now);
        Runtime::on_tick(self, now)
    }
    fn on_scan(&mut self, scan: &Scan, now: Nanos) -> anyhow::Result<()> {
        Runtime::on_scan(self, scan, now)
    }
    fn on_check(&mut self, result: CheckResult, now: Nanos) -> anyhow::Result<()> {
        Runtime::on_check(self, result, now)
    }
    fn on_command(&mut self, request: &Request, now: Nanos) -> Response {
        Runtime::on_command(self, request, now)
    }
    fn on_reload(&mut self, config: &Config, now: Nanos) -> anyhow::Result<()> {
        Runtime::on_reload(self, config, now)
    }
    fn snapshot(&mut self, now: Nanos) -> Snapshot {
        Runtime::snapshot(self, now)
    }
    fn on_discovery(&mut self, update: &Update, now: Nanos) -> anyhow::Result<()> {
        Runtime::on_discovery(self, update, now)
    }
}
