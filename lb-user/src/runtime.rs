//! The running control plane's state and what happens to it: kernel
//! events, health-check results, timer ticks (publish selections and
//! scores), reconciliation results, operator commands, config reloads and
//! metric scrapes. The daemon's event loop only routes to these methods.

use std::{
    collections::HashMap,
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Instant,
};

use anyhow::Context as _;
use lb_common::{BackendStats, reason};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use crate::{
    addr::{BackendAddr, VipAddr, Weight},
    backend_load::{BackendLoad, LoadTable},
    clock::Nanos,
    config::Config,
    control::{Command, Request, Response},
    events::{CloseReason, Event},
    fleet::Fleet,
    health::{CheckResult, HealthChecker},
    lifecycle::{Admin, WEIGHT_UNITS},
    maps::{self, Conns, Corrections, Reasons, Scores, Stats},
    metrics::{BackendMetrics, Snapshot},
    neighbours::NeighbourSync,
    plan::Plan,
    publish::{Publisher, UpdateTimes},
    reconcile::Scan,
    tables::ReferenceWriter,
};

pub struct Runtime {
    fleet: Fleet,
    loads: LoadTable,
    /// What a backend that joins at runtime starts with.
    fresh_load: BackendLoad,
    publisher: Publisher,
    scores: Scores,
    /// P2C's per-VIP yardstick, refreshed with the scores.
    references: ReferenceWriter,
    score_times: UpdateTimes,
    conns: Conns,
    corrections: Corrections,
    stats: Stats,
    reasons: Reasons,
    checker: HealthChecker,
    /// Mirrors the ARP table into NEIGHBOURS when backends join at runtime.
    neighbours: NeighbourSync,
    /// Passed and failed health checks per backend id.
    checks: HashMap<u32, (u64, u64)>,
    /// Shared with the reconciler: the length of the id space.
    pub id_limit: Arc<AtomicUsize>,
    events_received: u64,
    /// Flows the LRU evicted, as the reconciler saw them vanish.
    flows_evicted: u64,
    /// Entries in the flow table at the last reconciliation pass.
    flow_entries: u64,
    flow_table_size: u32,
}

impl Runtime {
    pub fn new(
        config: &Config,
        plan: &Plan,
        pin_dir: &Path,
        ifindex: u32,
        now: Nanos,
        check_results: mpsc::Sender<CheckResult>,
    ) -> anyhow::Result<Self> {
        let fleet = Fleet::new(config, plan, now);
        let mut runtime = Self {
            loads: LoadTable::new(&plan.weights, config.ewma_cold_start, config.ewma_tau, now),
            fresh_load: BackendLoad::new(
                Weight::DEFAULT,
                config.ewma_cold_start,
                config.ewma_tau,
                now,
            ),
            publisher: Publisher::open(pin_dir)?,
            scores: maps::scores(pin_dir)?,
            references: ReferenceWriter::open(pin_dir)?,
            score_times: UpdateTimes::default(),
            conns: maps::conns(pin_dir)?,
            corrections: maps::corrections(pin_dir)?,
            stats: maps::stats(pin_dir)?,
            reasons: maps::reasons(pin_dir)?,
            checker: HealthChecker::new(check_results),
            neighbours: NeighbourSync::new(
                maps::neighbours(pin_dir)?,
                &config.iface,
                ifindex,
                Vec::new(),
            ),
            checks: HashMap::new(),
            id_limit: Arc::new(AtomicUsize::new(fleet.id_limit())),
            events_received: 0,
            flows_evicted: 0,
            flow_entries: 0,
            flow_table_size: config.flow_table_size,
            fleet,
        };
        runtime.checker.sync(runtime.fleet.checks());
        Ok(runtime)
    }

    pub fn loads(&self) -> &LoadTable {
        &self.loads
    }

    /// Returns true if the event ejected a backend (publish at once).
    pub fn apply_event(&mut self, event: Event, now: Nanos) -> bool {
        self.events_received += 1;
        self.loads.apply(event, now);
        self.fleet.on_event(event, now)
    }

    /// Applies a check result; a backend whose health flips leaves (or
    /// rejoins) the kernel's slots at once.
    pub fn health(&mut self, result: CheckResult, now: Nanos) -> anyhow::Result<()> {
        if self.fleet.member(result.backend).map(|m| m.addr) != Some(result.addr) {
            return Ok(());
        }
        let counts = self.checks.entry(result.backend).or_default();
        if result.passed {
            counts.0 += 1;
        } else {
            counts.1 += 1;
        }
        if self.fleet.health_result(result.backend, result.passed, now) {
            self.tick(now)?;
        }
        Ok(())
    }

    /// Advances lifecycles, writes scores with effective weights, then
    /// publishes every VIP's selection (scores first, so a backend that
    /// becomes selectable already has one).
    pub fn tick(&mut self, now: Nanos) -> anyhow::Result<()> {
        let loads = &self.loads;
        self.fleet.tick(now, |id| loads.ewma_ns(id, now));
        let selections: Vec<_> = (0..self.fleet.vips.len())
            .map(|i| self.fleet.selection(i, now))
            .collect();
        for s in &selections {
            for (id, w) in s.slots.iter().zip(&s.weights) {
                self.loads.set_weight(*id, *w, &self.fresh_load);
            }
        }
        let started = Instant::now();
        let fresh: Vec<_> = self
            .loads
            .scores(now)
            .filter(|(id, _)| self.fleet.member(*id).is_some())
            .collect();
        for (id, score) in &fresh {
            self.scores
                .set(*id, score, 0)
                .context("writing BACKEND_SCORES")?;
        }
        for (vip, selection) in self.fleet.vips.iter().zip(&selections) {
            self.references
                .write(vip.meta.vip_id, &selection.slots, &fresh)?;
        }
        self.score_times.record(started);
        for (index, selection) in selections.iter().enumerate() {
            let entries: Vec<_> = selection
                .states
                .iter()
                .filter_map(|&(id, state)| Some((id, self.fleet.backend_entry(id, state)?)))
                .collect();
            self.publisher
                .publish_vip(index, &self.fleet.vips[index], selection, &entries)?;
        }
        Ok(())
    }

    /// Accounts for what a reconciliation pass expired, and frees the ids
    /// of removed backends whose last flow is gone.
    pub fn after_scan(&mut self, scan: &Scan, now: Nanos) -> anyhow::Result<()> {
        if scan.vanished > 0 {
            self.flows_evicted += scan.vanished;
            debug!(evicted = scan.vanished, "flows left the full flow table");
        }
        self.flow_entries = scan.entries;
        for backend in scan.expired_idle.iter().copied() {
            self.apply_event(
                Event::Closed {
                    backend,
                    reason: CloseReason::Idle,
                },
                now,
            );
        }
        for backend in scan.expired_syn.iter().copied() {
            self.apply_event(Event::Refused { backend }, now);
        }
        for id in self.fleet.free_drained(&scan.live) {
            self.publisher.clear_backend(id)?;
            self.checks.remove(&id);
        }
        self.checker.sync(self.fleet.checks());
        Ok(())
    }

    /// Runs one operator command; the kernel has the change when this returns.
    pub fn control(&mut self, request: &Request, now: Nanos) -> Response {
        let applied = self.try_control(request, now).and_then(|id| {
            self.after_membership_change();
            self.tick(now)?;
            Ok(id)
        });
        match applied {
            Ok(id) => {
                info!(command = ?request.command, vip = %request.vip, backend = %request.backend, "operator command applied");
                Response::done(id)
            }
            Err(e) => Response::failed(format!("{e:#}")),
        }
    }

    fn try_control(&mut self, request: &Request, now: Nanos) -> anyhow::Result<u32> {
        let vip: VipAddr = request.vip.parse().context("vip")?;
        let backend: BackendAddr = request.backend.parse().context("backend")?;
        let fleet = &mut self.fleet;
        let id = match request.command {
            Command::Add => {
                // The control socket resolved its MAC already.
                let id = fleet.add(&vip, backend, now)?;
                self.loads.reset(id, self.fresh_load.clone());
                id
            }
            Command::Remove => fleet.set_admin(&vip, backend.addr, Admin::Removed, now)?,
            Command::Drain => fleet.set_admin(&vip, backend.addr, Admin::Draining, now)?,
            Command::Undrain => fleet.set_admin(&vip, backend.addr, Admin::Active, now)?,
            Command::Weight => {
                let weight = request
                    .weight
                    .ok_or_else(|| anyhow::anyhow!("weight needs a weight"))?;
                let weight = Weight::new(u64::from(weight))?;
                fleet.set_weight(&vip, backend.addr, weight.get(), now)?
            }
        };
        Ok(id)
    }

    fn after_membership_change(&mut self) {
        // New backends were probed before they got here (control socket,
        // SIGHUP): their MACs are in the ARP table now.
        if let Err(e) = self.neighbours.sync(false) {
            warn!("updating neighbours: {e:#}");
        }
        self.id_limit
            .store(self.fleet.id_limit(), Ordering::Relaxed);
        self.checker.sync(self.fleet.checks());
    }

    /// Applies a reloaded configuration (see [`Fleet::reload`]).
    pub fn reload(&mut self, config: &Config, now: Nanos) -> anyhow::Result<()> {
        let before = self.fleet.id_limit();
        for note in self.fleet.reload(config, now) {
            warn!("reload: {note}");
        }
        for id in before..self.fleet.id_limit() {
            self.loads.reset(id as u32, self.fresh_load.clone());
        }
        self.after_membership_change();
        info!("configuration reloaded");
        self.tick(now)
    }

    /// The metrics of this moment.
    pub fn snapshot(&self, now: Nanos) -> Snapshot {
        let mut backends = Vec::new();
        let tallies: HashMap<u32, _> = self.loads.tallies().collect();
        let scores: HashMap<u32, _> = self.loads.scores(now).collect();
        for vip in &self.fleet.vips {
            for &id in &vip.members {
                let Some(m) = self.fleet.member(id) else {
                    continue;
                };
                let conns = self.conns.get(&id, 0).unwrap_or_default();
                let correction = self.corrections.get(&id, 0).unwrap_or_default();
                let per_cpu = self
                    .stats
                    .get(&id, 0)
                    .map(|v| v.iter().copied().collect::<Vec<_>>())
                    .unwrap_or_default();
                let sum = |f: fn(&BackendStats) -> u64| per_cpu.iter().map(f).sum::<u64>();
                let score = scores.get(&id).copied().unwrap_or_default();
                let (passed, failed) = self.checks.get(&id).copied().unwrap_or_default();
                backends.push(BackendMetrics {
                    vip: vip.addr.to_string(),
                    backend: m.addr.to_string(),
                    opened: conns.opened,
                    closed: conns.closed,
                    active: conns.inflight(correction),
                    refused: tallies.get(&id).map_or(0, |t| t.refused),
                    bytes_to_backend: sum(|s| s.bytes_to_backend),
                    bytes_from_backend: sum(|s| s.bytes_from_backend),
                    ewma_seconds: score.ewma_ns as f64 / 1e9,
                    score: score.cost,
                    effective_weight: f64::from(score.weight) / f64::from(WEIGHT_UNITS),
                    state: Some(m.life.state(now)),
                    ejections: m.life.ejections_total,
                    outlier_failures: m.outlier.failures_total,
                    health_passed: passed,
                    health_failed: failed,
                });
            }
        }
        let reasons: Vec<(&'static str, u64)> = (0..reason::COUNT)
            .map(|r| {
                let total = self.reasons.get(&r, 0).map(|v| v.iter().sum()).unwrap_or(0);
                (reason::NAMES[r as usize], total)
            })
            .collect();
        let events_lost = reasons[reason::EVENT_LOST as usize].1;
        Snapshot {
            backends,
            reasons,
            events_lost,
            events_received: self.events_received,
            publish_times: self.publisher.times,
            score_times: self.score_times,
            vips_in_panic: self.fleet.vips.iter().filter(|v| v.panic).count() as u64,
            flows_evicted: self.flows_evicted,
            flow_entries: self.flow_entries,
            flow_table_size: u64::from(self.flow_table_size),
        }
    }
}
