//! The event loop: waits on kernel events, the score timer, reconciliation
//! scans, health checks, operator commands, scrapes and SIGHUP, and routes
//! each to its handler, reading the time from a [`Clock`] so the routing
//! runs under a test clock too.

use anyhow::Context as _;
use tokio::{
    signal::unix::{Signal, SignalKind, signal},
    sync::mpsc,
    time::{Duration, Instant, MissedTickBehavior, interval, sleep_until},
};
use tracing::{debug, info};

use super::errors::{ControlErrors, Stage};
use crate::{
    discover::watch::Update,
    ingest::{
        events::{Event, EventStream},
        reconcile::Scan,
    },
    kernel::clock::{Clock, Nanos},
    pool::health::CheckResult,
    settings::config::Config,
    surface::{
        control::{Pending, Request, Response},
        metrics::{self, Scrape, Snapshot},
    },
};

/// How long the event loop waits before reading the ring buffer again
/// after reading it failed.
const EVENTS_RETRY: Duration = Duration::from_secs(1);

/// The running state, as the event loop sees it: one handler per input.
/// A handler's error never ends the loop: it is counted and logged under
/// its [`Stage`], and the work is redone by the next tick (every handler
/// leaves the state so that the next tick rewrites what did not reach
/// the kernel).
pub trait Handlers {
    /// One ring-buffer event; what it shows is judged at the next tick.
    fn on_event(&mut self, event: Event, now: Nanos);
    fn on_tick(&mut self, now: Nanos) -> anyhow::Result<()>;
    fn on_scan(&mut self, scan: &Scan, now: Nanos) -> anyhow::Result<()>;
    fn on_check(&mut self, result: CheckResult, now: Nanos) -> anyhow::Result<()>;
    fn on_command(&mut self, request: &Request, now: Nanos) -> Response;
    fn on_reload(&mut self, config: &Config, now: Nanos) -> anyhow::Result<()>;
    fn snapshot(&mut self, now: Nanos) -> Snapshot;
    /// A discovered VIP's wanted backends changed (see `discovery.rs`).
    fn on_discovery(&mut self, _update: &Update, _now: Nanos) -> anyhow::Result<()> {
        Ok(())
    }
}

/// Signals that end the daemon cleanly.
pub struct Shutdown {
    interrupt: Signal,
    terminate: Signal,
    /// SIGHUP's handler, installed with the others before anything is
    /// attached (its default action ends the process, which during the
    /// start left the program attached and never marked ready: every VIP
    /// packet passed to the host). The reloader takes it; a SIGHUP that
    /// arrived meanwhile is kept and answered then.
    hangup: Option<Signal>,
}

impl Shutdown {
    pub fn install() -> anyhow::Result<Self> {
        Ok(Self {
            interrupt: signal(SignalKind::interrupt()).context("installing the SIGINT handler")?,
            terminate: signal(SignalKind::terminate()).context("installing the SIGTERM handler")?,
            hangup: Some(signal(SignalKind::hangup()).context("installing the SIGHUP handler")?),
        })
    }

    /// SIGHUP's handler, for the reloader (once).
    pub fn take_hangup(&mut self) -> anyhow::Result<Signal> {
        self.hangup
            .take()
            .ok_or_else(|| anyhow::anyhow!("the SIGHUP handler was already taken"))
    }

    async fn wait(&mut self) -> &'static str {
        tokio::select! {
            _ = self.interrupt.recv() => "SIGINT",
            _ = self.terminate.recv() => "SIGTERM",
        }
    }
}

/// Everything besides kernel events that the event loop waits on.
pub struct Inputs {
    pub scans: mpsc::Receiver<Scan>,
    pub checks: mpsc::Receiver<CheckResult>,
    pub control: mpsc::Receiver<Pending>,
    pub scrapes: mpsc::Receiver<Scrape>,
    /// Configurations re-read on SIGHUP (read and resolved off the loop).
    pub reloads: mpsc::Receiver<Config>,
    /// Updates of the etcd watch, when a VIP is discovered.
    pub discovery: Option<mpsc::Receiver<Update>>,
}

/// The next discovery update, or never without discovery.
async fn next_update(rx: &mut Option<mpsc::Receiver<Update>>) -> Option<Update> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

/// Routes inputs to the handlers `H`, each at the time `C` reads.
pub struct EventLoop<C, H> {
    clock: C,
    pub handlers: H,
    errors: ControlErrors,
}

impl<C: Clock, H: Handlers> EventLoop<C, H> {
    pub fn new(clock: C, handlers: H, errors: ControlErrors) -> Self {
        Self {
            clock,
            handlers,
            errors,
        }
    }

    /// A batch of kernel events, all at one time (outlier detection
    /// judges their failures at the next score tick, which publishes).
    pub fn on_events(&mut self, batch: &mut Vec<Event>) {
        let now = self.clock.now();
        for event in batch.drain(..) {
            self.handlers.on_event(event, now);
        }
    }

    pub fn on_tick(&mut self) {
        let outcome = self.handlers.on_tick(self.clock.now());
        self.errors.check(Stage::Tick, outcome);
    }

    pub fn on_scan(&mut self, scan: &Scan) {
        let outcome = self.handlers.on_scan(scan, self.clock.now());
        self.errors.check(Stage::Scan, outcome);
        debug!(
            entries = scan.entries,
            expired_idle = scan.sweep.expired_idle,
            expired_syn = scan.sweep.expired_syn,
            "kernel sweep"
        );
    }

    pub fn on_check(&mut self, result: CheckResult) {
        let outcome = self.handlers.on_check(result, self.clock.now());
        self.errors.check(Stage::Health, outcome);
    }

    pub fn on_command(&mut self, (request, reply): Pending) {
        let _ = reply.send(self.handlers.on_command(&request, self.clock.now()));
    }

    pub fn on_scrape(&mut self, reply: Scrape) {
        let _ = reply.send(metrics::render(&self.handlers.snapshot(self.clock.now())));
    }

    /// A configuration re-read on SIGHUP, its new backends already probed.
    pub fn on_discovery(&mut self, update: &Update) {
        let outcome = self.handlers.on_discovery(update, self.clock.now());
        self.errors.check(Stage::Discovery, outcome);
    }

    pub fn on_reload(&mut self, config: &Config) {
        let outcome = self.handlers.on_reload(config, self.clock.now());
        self.errors.check(Stage::Reload, outcome);
    }

    /// Drains events, ticks every `score_interval`, and routes the other
    /// inputs, until a shutdown signal. Nothing but a signal ends it.
    pub async fn run(
        &mut self,
        mut events: EventStream,
        mut inputs: Inputs,
        score_interval: Duration,
        shutdown: &mut Shutdown,
    ) -> anyhow::Result<()> {
        let mut score_tick = interval(score_interval);
        score_tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut batch = Vec::new();
        // Set after the ring buffer failed: when to read it again.
        let mut events_paused: Option<Instant> = None;
        loop {
            let resume = events_paused.unwrap_or_else(Instant::now);
            tokio::select! {
                signal = shutdown.wait() => {
                    info!("{signal} received, shutting down");
                    return Ok(());
                }
                drained = events.next_batch(&mut batch), if events_paused.is_none() => {
                    match drained {
                        Ok(()) => self.on_events(&mut batch),
                        Err(e) => {
                            self.errors.record(Stage::Events, &e);
                            events_paused = Some(Instant::now() + EVENTS_RETRY);
                        }
                    }
                }
                () = sleep_until(resume), if events_paused.is_some() => events_paused = None,
                _ = score_tick.tick() => self.on_tick(),
                Some(scan) = inputs.scans.recv() => self.on_scan(&scan),
                Some(result) = inputs.checks.recv() => self.on_check(result),
                Some(pending) = inputs.control.recv() => self.on_command(pending),
                Some(reply) = inputs.scrapes.recv() => self.on_scrape(reply),
                Some(config) = inputs.reloads.recv() => self.on_reload(&config),
                Some(update) = next_update(&mut inputs.discovery) => self.on_discovery(&update),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{collections::HashMap, time::Duration};

    use tokio::sync::oneshot;

    use super::*;
    use crate::{ingest::events::CloseReason, kernel::clock::ManualClock};

    /// Records which handler ran at what time; backend 9's events eject.
    /// With `failing`, every handler that can fail does.
    #[derive(Default)]
    struct Recorder {
        calls: Vec<(&'static str, u64)>,
        failing: bool,
    }

    impl Recorder {
        fn outcome(&self) -> anyhow::Result<()> {
            if self.failing {
                anyhow::bail!("injected")
            }
            Ok(())
        }
    }

    impl Handlers for Recorder {
        fn on_event(&mut self, _: Event, now: Nanos) {
            self.calls.push(("event", now.0));
        }
        fn on_tick(&mut self, now: Nanos) -> anyhow::Result<()> {
            self.calls.push(("tick", now.0));
            self.outcome()
        }
        fn on_scan(&mut self, _: &Scan, now: Nanos) -> anyhow::Result<()> {
            self.calls.push(("scan", now.0));
            self.outcome()
        }
        fn on_check(&mut self, _: CheckResult, now: Nanos) -> anyhow::Result<()> {
            self.calls.push(("check", now.0));
            self.outcome()
        }
        fn on_command(&mut self, _: &Request, now: Nanos) -> Response {
            self.calls.push(("command", now.0));
            Response::done(7)
        }
        fn on_reload(&mut self, _: &Config, now: Nanos) -> anyhow::Result<()> {
            self.calls.push(("reload", now.0));
            self.outcome()
        }
        fn snapshot(&mut self, _: Nanos) -> Snapshot {
            Snapshot {
                events_received: self.calls.len() as u64,
                ..Snapshot::default()
            }
        }
    }

    fn closed(backend: u32) -> Event {
        Event::Closed {
            backend,
            reason: CloseReason::Idle,
        }
    }

    #[test]
    fn a_batch_is_handled_at_one_time_and_the_tick_follows_its_clock() {
        let mut event_loop = EventLoop::new(
            ManualClock::starting_at(1_000),
            Recorder::default(),
            ControlErrors::default(),
        );
        event_loop.on_events(&mut vec![closed(1), closed(2)]);
        event_loop.clock.advance(Duration::from_millis(50));
        event_loop.on_tick();
        event_loop.clock.advance(Duration::from_nanos(5));
        let mut batch = vec![closed(1), Event::Refused { backend: 9 }];
        event_loop.on_events(&mut batch);
        assert!(batch.is_empty());
        let t = 1_000 + 50_000_000;
        assert_eq!(
            event_loop.handlers.calls,
            [
                ("event", 1_000),
                ("event", 1_000),
                ("tick", t),
                ("event", t + 5),
                ("event", t + 5),
            ]
        );
    }

    #[test]
    fn scans_checks_commands_and_scrapes_reach_their_handlers_at_the_clocks_time() {
        let mut event_loop = EventLoop::new(
            ManualClock::starting_at(42),
            Recorder::default(),
            ControlErrors::default(),
        );
        event_loop.on_scan(&Scan::default());
        event_loop.on_check(CheckResult {
            backend: 0,
            server: std::sync::Arc::from([0]),
            addr: "10.0.0.21:80".parse().unwrap(),
            passed: true,
            purpose: crate::pool::health::Purpose::Health,
            latency: None,
        });
        let (tx, mut rx) = oneshot::channel();
        let request = Request {
            command: crate::settings::cli::ControlCommand::Drain,
            vip: "10.0.0.100:80".into(),
            backend: "10.0.0.21:80".into(),
            weight: None,
            backends: Vec::new(),
            algorithm: None,
            peer: None,
        };
        event_loop.on_command((request, tx));
        assert_eq!(rx.try_recv().unwrap(), Response::done(7));
        let (tx, mut rx) = oneshot::channel();
        event_loop.on_scrape(tx);
        assert!(
            rx.try_recv()
                .unwrap()
                .contains("lb_ring_buffer_events_total 3\n")
        );
        let times: HashMap<_, _> = event_loop.handlers.calls.iter().copied().collect();
        assert_eq!(times.len(), 3);
        assert!(times.values().all(|&t| t == 42));
    }

    #[test]
    fn failing_handlers_are_counted_per_stage_and_the_loop_goes_on() {
        let errors = ControlErrors::default();
        let recorder = Recorder {
            failing: true,
            ..Recorder::default()
        };
        let mut event_loop = EventLoop::new(ManualClock::starting_at(7), recorder, errors.clone());
        event_loop.on_tick();
        event_loop.on_tick();
        event_loop.on_events(&mut vec![Event::Refused { backend: 9 }]);
        event_loop.on_scan(&Scan::default());
        event_loop.on_check(CheckResult {
            backend: 0,
            server: std::sync::Arc::from([0]),
            addr: "10.0.0.21:80".parse().unwrap(),
            passed: false,
            purpose: crate::pool::health::Purpose::Health,
            latency: None,
        });
        event_loop.handlers.failing = false;
        event_loop.on_tick();
        let totals = errors.totals();
        assert!(totals.contains(&("tick", 2)), "{totals:?}");
        assert!(totals.contains(&("scan", 1)), "{totals:?}");
        assert!(totals.contains(&("health", 1)), "{totals:?}");
        assert!(totals.contains(&("reload", 0)), "{totals:?}");
        let ticks = event_loop.handlers.calls.iter().filter(|c| c.0 == "tick");
        assert_eq!(ticks.count(), 3);
    }
}
