//! The running control plane's state, and what each input does to it:
//! kernel events, timer ticks (publish selections and scores),
//! reconciliation scans, health-check results and config reloads here;
//! operator commands in `command.rs` and metric snapshots in `snapshot.rs`.
//! The event loop only routes inputs to these handlers (see
//! [`super::event_loop::Handlers`]).

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Instant,
};

use lb_common::{BackendScore, SCORE_FAR_ABOVE};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use super::{
    errors::{ControlErrors, Stage},
    startup::{KernelHandles, Snat},
    state::StateKeeper,
};
use crate::{
    estimate::{
        backend_load::LoadTable,
        latency::{LatencySample, ProbeOutcome},
    },
    ingest::{events::Event, reconcile::Scan},
    kernel::{backend_hops::BackendIds, clock::Nanos},
    pool::lifecycle::Admin,
    pool::zones::ZonePlan,
    pool::{
        fleet::{Fleet, Selection},
        health::{CheckCounts, CheckResult, Counted, HealthChecker, OnConnection, Purpose},
        plan::Plan,
    },
    publish::{
        relief::{HeldShare, Tick, pool_queue},
        tables::{ScoreIndex, hold_far_above, median_cost},
        writers::UpdateTimes,
    },
    settings::{
        addr::VipAddr,
        config::{self, Config},
    },
};

pub struct Runtime {
    pub(super) fleet: Fleet,
    /// Each zone's connections as a counter that only grows (metrics).
    pub(super) zone_opened: super::zone_opened::ZoneOpened,
    pub(super) loads: LoadTable,
    pub(super) kernel: KernelHandles,
    pub(super) checker: HealthChecker,
    /// Regular health checks per backend id, by how they counted.
    pub(super) checks: HashMap<u32, CheckCounts>,
    /// Latency probes (timed checks) by what they did to the estimate.
    pub(super) probes: ProbeCounts,
    /// Shared with the reconciler: the length of the id space.
    pub id_limit: Arc<AtomicUsize>,
    /// Shared with the reconciler: the passes it has started.
    pub passes_started: Arc<std::sync::atomic::AtomicU64>,
    /// Records taken off the ring buffer (failures: refused, backend reset).
    pub(super) events_received: u64,
    /// Per-backend latency aggregates read at the score ticks (one per
    /// backend with answers per tick), the kernel's replacement for one
    /// ring event per response.
    pub(super) latency_reads: u64,
    /// Of those, the ones not taken as latency: their answers waited on a
    /// health outage (`Lifecycle::measures_service`).
    pub(super) latency_outage_skips: u64,
    /// Lone flow entries the kernel sweep found (and cleaned up).
    pub(super) flows_evicted: u64,
    /// Entries in the flow table at the last reconciliation pass.
    pub(super) flow_entries: u64,
    /// The pass interval the last reconciliation pass's cost set.
    pub(super) reconcile_interval: std::time::Duration,
    /// Overrides, zones and revisions of etcd discovery (`discovery.rs`).
    pub discovery: crate::discover::state::DiscoveryState,
    /// Errors the control plane survived, by stage.
    pub errors: ControlErrors,
    /// The runtime changes kept across restarts.
    pub(super) state: StateKeeper,
    /// The SNAT pools the kernel has (the configured ones, or the
    /// interface's address; set after [`Self::new`], which knows the
    /// configured ones only): a VIP or backend added while running is
    /// checked against them (`Snat::check`).
    pub(super) snat: Snat,
    /// Configurations applied: 1 at start, one more per SIGHUP.
    pub(super) config_generation: u64,
    /// How long each score tick (scores and selections) takes.
    pub(super) tick_times: UpdateTimes,
    /// Reconciliation passes (kernel sweep and counter reads).
    pub(super) reconcile_times: UpdateTimes,
    /// The zones file `status` reads, and what was last written to it.
    pub(super) zones_path: std::path::PathBuf,
    pub(super) zones_written: Option<crate::surface::status::ZonesFile>,
    /// A backend's latency counts in zone comparisons while its last sample
    /// is at most this old (τ: older ones have mostly drifted to cold start).
    pub(super) latency_sample_age: std::time::Duration,
    /// Answers per backend id in the tick being computed (from the kernel's
    /// latency aggregates).
    pub(super) tick_answers: Vec<u64>,
    /// Per P2C VIP id: the share of its answers from held backends, which
    /// decides its least-connections relief (`publish::relief`).
    pub(super) held_shares: HashMap<u32, HeldShare>,
}

impl Runtime {
    pub fn new(
        config: &Config,
        plan: &Plan,
        kernel: KernelHandles,
        now: Nanos,
        check_results: mpsc::Sender<CheckResult>,
        errors: ControlErrors,
        state: StateKeeper,
    ) -> Self {
        let fleet = Fleet::new(config, plan, now);
        let panics = errors.clone();
        let on_panic = Arc::new(move |backend: u32, message: &str| {
            let e = anyhow::anyhow!("health check of backend {backend} panicked: {message}");
            panics.record(Stage::HealthTask, &e);
        });
        let marks = kernel.control_conns.clone();
        let mark_errors = errors.clone();
        let on_connection: OnConnection = Arc::new(move |backend: u32, open: bool| {
            if let Err(e) = marks.set(backend, u64::from(open)) {
                mark_errors.record(Stage::Health, &e);
            }
        });
        let mut runtime = Self {
            loads: LoadTable::new(&plan.weights, config.estimate_params(), now),
            kernel,
            checker: HealthChecker::new(check_results, on_panic, on_connection),
            checks: HashMap::new(),
            probes: ProbeCounts::default(),
            id_limit: Arc::new(AtomicUsize::new(fleet.id_limit())),
            passes_started: Arc::default(),
            events_received: 0,
            latency_reads: 0,
            latency_outage_skips: 0,
            flows_evicted: 0,
            zone_opened: super::zone_opened::ZoneOpened::new(false),
            flow_entries: 0,
            reconcile_interval: crate::ingest::reconcile::MIN_PASS_INTERVAL,
            discovery: crate::discover::state::DiscoveryState::new(
                config.discovery.max_removal_percent,
            ),
            errors,
            state,
            snat: Snat {
                v4: config.snat_ip.clone(),
                v6: config.snat_ip6.clone(),
                ports: config.snat_ports,
            },
            config_generation: 1,
            tick_times: UpdateTimes::default(),
            reconcile_times: UpdateTimes::default(),
            zones_path: crate::surface::status::zones_path(&config.instance),
            zones_written: None,
            latency_sample_age: config.ewma_tau,
            tick_answers: Vec::new(),
            held_shares: HashMap::new(),
            fleet,
        };
        runtime.checker.sync(runtime.fleet.checks());
        for v in config.vips.iter().filter(|v| v.etcd_prefix.is_some()) {
            runtime.discovery.seed_zones(v.vip, &v.backends);
        }
        let kept = runtime.state.discovered_weight_overrides();
        runtime.discovery.weight_overrides.extend(kept);
        runtime
    }

    pub fn loads(&self) -> &LoadTable {
        &self.loads
    }

    /// Takes in one ring-buffer event: its outcome is judged at the next
    /// score tick (`Fleet::judge_outliers`), which publishes.
    pub fn on_event(&mut self, event: Event, now: Nanos) {
        self.events_received += 1;
        self.loads.apply(event, now);
        self.fleet.on_event(event, now);
    }

    /// Feeds the latency the kernel aggregated since the last tick: each
    /// backend's peak to the short-memory Peak-EWMA (a peak above it
    /// replaces it, as each sample above it would have) and its mean to the
    /// long-memory EWMA (see [`crate::estimate::latency`]), and the
    /// tick's answers to outlier detection, which judges the failures
    /// recorded since the last tick with them.
    fn take_latency(&mut self, now: Nanos) -> anyhow::Result<()> {
        let limit = self.fleet.id_limit();
        self.tick_answers.clear();
        self.tick_answers.resize(limit, 0);
        for a in self.kernel.latency.read(limit)? {
            if let Some(n) = self.tick_answers.get_mut(a.backend as usize) {
                *n += a.count;
            }
            let sample = LatencySample {
                mean: a.mean,
                peak: a.peak,
                count: a.count,
            };
            self.latency_reads += 1;
            // Answers that waited on a health outage are still answers
            // (above, and for the checks' busy rule), but not latency
            // (`Lifecycle::measures_service`).
            if !self.fleet.measures_latency(a.backend, a.peak, now) {
                self.latency_outage_skips += 1;
                self.loads.answered(a.backend, a.count, now);
                debug!(
                    backend = a.backend,
                    peak = ?a.peak,
                    count = a.count,
                    "latency of answers that waited on a health outage: not taken"
                );
                continue;
            }
            self.loads.observe(a.backend, sample, now);
        }
        let handshakes = &self.kernel.handshakes;
        let accepted = |id: u32| match handshakes.get(&id, 0) {
            Ok(per_cpu) => Some(per_cpu.iter().fold(0u64, |sum, n| sum.wrapping_add(*n))),
            Err(e) => {
                debug!(backend = id, "BACKEND_HANDSHAKES unread: {e}");
                None
            }
        };
        self.fleet.judge_outliers(&self.tick_answers, accepted, now);
        Ok(())
    }

    /// Applies a check result: its timing to the latency estimate of an
    /// avoided backend, then (a regular check, not an extra latency probe)
    /// its outcome to rise and fall; a backend whose health flips leaves
    /// (or rejoins) the kernel's slots at once.
    pub fn on_check(&mut self, result: CheckResult, now: Nanos) -> anyhow::Result<()> {
        if self.fleet.member(result.backend).map(|m| m.addr) != Some(result.addr) {
            return Ok(());
        }
        self.take_probe(&result, now);
        if result.purpose == Purpose::LatencyProbe {
            return Ok(());
        }
        let counted =
            result.counted(|wait| server_answered_within(&self.loads, &result.server, now, wait));
        self.checks.entry(result.backend).or_default().add(counted);
        if counted == Counted::Busy {
            debug!(
                backend = result.backend,
                "health check timed out while the backend answered users: counted busy, not failed"
            );
            return Ok(());
        }
        if self
            .fleet
            .health_result(result.backend, counted == Counted::Passed, now)
        {
            self.on_tick(now)?;
        }
        Ok(())
    }

    /// A check's timing, for the estimate of a backend users have not
    /// sampled within its VIP's latency probe interval (the rule is in
    /// [`crate::estimate::latency`]); nothing when probes are off.
    fn take_probe(&mut self, result: &CheckResult, now: Nanos) {
        let (Some(sample), Some(idle)) = (result.latency, self.fleet.latency_probe(result.backend))
        else {
            return;
        };
        let Some(outcome) = self.loads.observe_probe(result.backend, sample, now, idle) else {
            return;
        };
        match outcome {
            ProbeOutcome::Applied => {
                self.probes.applied += 1;
                debug!(backend = result.backend, ?sample, "latency probe applied");
            }
            ProbeOutcome::Busy => self.probes.busy += 1,
            ProbeOutcome::Unchanged => self.probes.unchanged += 1,
            ProbeOutcome::Barred => self.probes.barred += 1,
        }
    }

    /// Tells the health checker which backends users avoid (see
    /// [`LoadTable::avoided`]): their HTTP checks run every latency probe
    /// interval.
    fn mark_avoided(&self, now: Nanos) {
        let probed: Vec<_> = self
            .fleet
            .members
            .iter()
            .enumerate()
            .filter_map(|(id, m)| {
                let idle = self.fleet.latency_probe(id as u32)?;
                Some((id as u32, m.as_ref()?.vip, idle))
            })
            .collect();
        let avoided = self.loads.avoided(&probed, now);
        self.checker.set_avoided(|id| avoided.contains(&id));
    }

    /// Advances lifecycles, writes scores with effective weights, then
    /// publishes every VIP's selection (scores first, so a backend that
    /// becomes selectable already has one).
    pub fn on_tick(&mut self, now: Nanos) -> anyhow::Result<()> {
        let tick = Instant::now();
        let result = self.tick(now);
        self.tick_times.record(tick);
        result
    }

    fn tick(&mut self, now: Nanos) -> anyhow::Result<()> {
        self.take_latency(now)?;
        self.mark_avoided(now);
        let loads = &self.loads;
        let sample_age = self.latency_sample_age;
        self.fleet
            .tick(now, |id| loads.sampled_ewma_ns(id, now, sample_age));
        let mut selections: Vec<_> = (0..self.fleet.vips.len())
            .map(|i| self.fleet.selection(i, now))
            .collect();
        for (index, selection) in selections.iter_mut().enumerate() {
            let plan = self.fleet.zone_plan(index, selection, now, |id| {
                loads.zone_latency_ns(id, now, self.latency_sample_age)
            });
            if let Some(p) = &plan {
                // Not covered: logged, and the VIP routes over all.
                let _ = selection.group_by_zone(p);
            }
            self.fleet.note_zone_plan(index, plan);
        }
        for s in &selections {
            for (id, w) in s.slots.iter().zip(&s.weights) {
                self.loads.set_weight(*id, *w, now);
            }
        }
        let started = Instant::now();
        let mut fresh: Vec<_> = self
            .loads
            .scores(now)
            .filter(|(id, _)| self.fleet.member(*id).is_some())
            .collect();
        let scores_index = ScoreIndex::of(&fresh);
        // Each P2C bound's group: a zone block's slots, or the VIP's.
        for (vip, selection) in self.fleet.vips.iter().zip(&selections) {
            if lb_common::Algorithm::from_u8(vip.meta.algorithm)
                != Some(lb_common::Algorithm::P2cEwma)
            {
                continue;
            }
            let held = |id| self.loads.held_score(id, now);
            match &vip.zone_plan {
                Some(plan) => {
                    for block in &plan.blocks {
                        hold_far_above(&block.slots, &mut fresh, &scores_index, held);
                    }
                }
                None => {
                    hold_far_above(&selection.slots, &mut fresh, &scores_index, held);
                }
            }
        }
        let reliefs = self.reliefs(&selections, &fresh, &scores_index, now);
        let vips = self.fleet.vips.iter().zip(&selections);
        self.kernel.publisher.scores.write(
            started,
            &fresh,
            &scores_index,
            vips.map(|(vip, selection)| (vip.meta.vip_id, selection.slots.as_slice())),
        )?;
        for (index, selection) in selections.iter().enumerate() {
            let zone_shares = zone_shares(
                self.fleet.vips[index].zone_plan.as_ref(),
                &fresh,
                &scores_index,
            );
            let entries: Vec<_> = selection
                .states
                .iter()
                .filter_map(|&(id, state)| Some((id, self.fleet.backend_entry(id, state)?)))
                .collect();
            self.kernel.publisher.publish_vip(
                index,
                &self.fleet.vips[index],
                selection,
                &entries,
                &zone_shares,
                reliefs[index],
            )?;
        }
        self.write_zones_file();
        Ok(())
    }

    /// Whether each VIP is relieved with least connections: a P2C VIP
    /// small enough for P2C's full scan whose held backends answer a real
    /// share of its requests, or whose whole pool queues (`publish::relief`),
    /// after adding this tick's answers and in-flight counts (`fresh`: the
    /// scores as published, held ones flagged).
    fn reliefs(
        &mut self,
        selections: &[Selection],
        fresh: &[(u32, BackendScore)],
        index: &ScoreIndex,
        now: Nanos,
    ) -> Vec<bool> {
        let answers = &self.tick_answers;
        self.fleet
            .vips
            .iter()
            .zip(selections)
            .map(|(vip, selection)| {
                // Only where P2C compares every backend anyway: least
                // connections scans every slot for each new flow.
                if lb_common::Algorithm::from_u8(vip.meta.algorithm)
                    != Some(lb_common::Algorithm::P2cEwma)
                    || selection.slots.len() > usize::from(vip.meta.p2c_full_scan)
                {
                    return false;
                }
                let (held, total) = held_answers(&selection.slots, answers, fresh, index);
                let counters = &self.kernel.counters;
                let queue = pool_queue(
                    &selection.slots,
                    vip.meta.p2c_saturation,
                    |id| flagged_held(id, fresh, index),
                    |id| counters.inflight(id),
                );
                let tick = Tick {
                    held,
                    total,
                    queue,
                };
                let share = self.held_shares.entry(vip.meta.vip_id).or_default();
                let before = share.relieved();
                share.observe(tick, now);
                let after = share.relieved();
                if after != before {
                    info!(
                        vip = %vip.addr,
                        held_share = format!("{:.1}%", share.share() * 100.0),
                        "{}",
                        if after {
                            "P2C relieved with least connections: held backends answer a share of the VIP's requests, or its whole pool queues"
                        } else {
                            "P2C back from least-connections relief"
                        },
                    );
                }
                after
            })
            .collect()
    }

    /// Takes in what a kernel sweep pass counted, and frees the ids of
    /// removed backends whose last flow and SNAT tuple are gone (the
    /// sweep's expiries arrive as ring events).
    pub fn on_scan(&mut self, scan: &Scan, _now: Nanos) -> anyhow::Result<()> {
        self.reconcile_times.record_duration(scan.took);
        if scan.orphans > 0 {
            self.flows_evicted += scan.orphans;
            debug!(
                orphans = scan.orphans,
                "the kernel sweep found lone flow entries"
            );
        }
        self.flow_entries = scan.entries;
        self.reconcile_interval = crate::ingest::reconcile::pass_interval(scan.cpu);
        let freed = self.fleet.free_drained(
            &scan.live,
            scan.pass,
            self.passes_started.load(Ordering::SeqCst),
        );
        for &id in &freed {
            self.kernel.publisher.clear_backend(id)?;
            self.checks.remove(&id);
        }
        if !freed.is_empty() {
            self.publish_backend_addrs();
        }
        for (index, vip_id) in self.fleet.free_drained_vips() {
            // A VIP that reuses the id starts without this one's held share.
            self.held_shares.remove(&vip_id);
            if let Err(e) = self.kernel.publisher.forget_vip(index, vip_id) {
                warn!("freed VIP id {vip_id}: {e:#}");
            }
        }
        self.checker.sync(self.fleet.checks());
        Ok(())
    }

    /// Hands the neighbour task the addresses of every backend the fleet
    /// has (draining ones too: they still have flows), with their ids, if
    /// they changed; it then dumps the neighbour table off the event loop.
    pub fn publish_backend_addrs(&self) {
        let ids: BackendIds = self
            .fleet
            .members
            .iter()
            .zip(0u32..)
            .filter_map(|(member, id)| Some((id, member.as_ref()?.addr.ip())))
            .collect();
        self.kernel.neighbours.send_if_modified(|current| {
            let changed = *current != ids;
            if changed {
                *current = ids;
            }
            changed
        });
    }

    pub(super) fn after_membership_change(&mut self) {
        // New backends were probed before they got here (control socket,
        // SIGHUP): their MACs are in the ARP table now, and the neighbour
        // task writes them once it has the new addresses.
        self.publish_backend_addrs();
        self.id_limit
            .store(self.fleet.id_limit(), Ordering::Relaxed);
        self.checker.sync(self.fleet.checks());
    }

    /// Drains the backends the runtime state keeps drained.
    pub fn drain_kept(&mut self, drains: &[(VipAddr, SocketAddr)], now: Nanos) {
        for (vip, addr) in drains {
            if let Err(e) = self.fleet.set_admin(vip, *addr, Admin::Draining, now) {
                warn!("runtime state: cannot drain {addr} of {vip}: {e}");
            }
        }
    }

    /// Puts back in service the backends of `drained_before` (drained at
    /// runtime, as the state kept them before a reload) whose drain the
    /// reload's file overtook (it changed their entry since: the entry is
    /// dropped, "the configuration wins") and that the file still lists,
    /// as a restart would: the state file and the running pool then agree.
    /// A backend the file removed or whose VIP it dropped is the reload's.
    fn release_drains(
        &mut self,
        drained_before: &[(VipAddr, SocketAddr)],
        effective: &super::state::Effective,
        now: Nanos,
    ) {
        for (vip, addr) in drained_before {
            if effective.drains.contains(&(*vip, *addr)) {
                continue;
            }
            let listed = effective
                .config
                .vips
                .iter()
                .any(|v| v.vip == *vip && v.backends.iter().any(|b| b.addr == *addr));
            let draining = self
                .fleet
                .find(vip, *addr)
                .ok()
                .and_then(|id| self.fleet.member(id))
                .is_some_and(|m| m.life.admin() == Admin::Draining);
            if listed && draining {
                match self.fleet.set_admin(vip, *addr, Admin::Active, now) {
                    Ok(_) => info!(
                        "reload: backend {addr} of VIP {vip} was drained at runtime, and the \
                         configuration changed it since: back in service, as the file says"
                    ),
                    Err(e) => warn!("reload: cannot put {addr} of {vip} back in service: {e}"),
                }
            }
        }
    }

    /// Applies a reloaded configuration, with the runtime changes that
    /// still hold laid over it (see [`Fleet::reload`]).
    /// The log says what was applied and what needs a restart.
    pub fn on_reload(&mut self, base: &Config, now: Nanos) -> anyhow::Result<()> {
        let running = self.state.base().clone();
        // What needs a restart is not applied, so not kept as the running
        // configuration either; a file that does not hold with it is
        // refused whole, as one that does not validate is (`reread`).
        let (base, restart) = match config::held_reload(&running, base) {
            Ok(held) => held,
            Err(e) => {
                warn!("SIGHUP: keeping the running configuration: {e}");
                self.errors.count(Stage::Reload);
                return Ok(());
            }
        };
        let base = &self.with_discovered(&base);
        for change in config::backend_changes(&running, base) {
            info!("reload applies: {change}");
        }
        for setting in restart {
            warn!("reload: {setting} changed: needs a restart (not applied)");
        }
        let drained_before = self.state.kept_drains();
        let discovered = |vip: &VipAddr, prefix: &str| {
            base.vips
                .iter()
                .any(|v| v.vip == *vip && v.etcd_prefix.as_deref() == Some(prefix))
        };
        for (vip, prefix) in self.discovery.end_watches(discovered) {
            info!("reload: VIP {vip} is no longer configured: its etcd watch of {prefix} ended");
        }
        let effective = self.state.reload(base);
        self.config_generation += 1;
        let config = &effective.config;
        let (notes, added) = self.fleet.reload(config, now);
        for note in notes {
            warn!("reload: {note}");
        }
        self.release_drains(&drained_before, &effective, now);
        self.drain_kept(&effective.drains, now);
        for id in added {
            self.loads.reset(id, now);
        }
        self.after_membership_change();
        info!(
            generation = self.config_generation,
            "configuration reloaded"
        );
        self.on_tick(now)
    }
}

/// Latency probes by outcome (see [`ProbeOutcome`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProbeCounts {
    /// Taken into an avoided backend's peak memory.
    pub applied: u64,
    /// Ignored: users had sampled the backend within the probe interval.
    pub busy: u64,
    /// A lower bound (connect time, timeout) at or below the estimate.
    pub unchanged: u64,
    /// A lower latency ignored: the backend relapsed after its estimate
    /// was last lowered (see [`crate::estimate::refute`]).
    pub barred: u64,
}

/// Each zone block's share and reference cost (the median unweighted cost of its
/// backends), for the blocks that have a selectable backend: what the
/// kernel's zone descriptor holds besides the slot layout.
fn zone_shares(
    plan: Option<&ZonePlan>,
    scores: &[(u32, lb_common::BackendScore)],
    index: &ScoreIndex,
) -> Vec<(u32, u64)> {
    plan.map(|p| {
        p.blocks
            .iter()
            .filter(|b| !b.slots.is_empty())
            .map(|b| (b.share, median_cost(&b.slots, scores, index)))
            .collect()
    })
    .unwrap_or_default()
}

/// Of the answers in `answers` (by backend id), how many came from `slots`
/// backends flagged held in `fresh` ([`SCORE_FAR_ABOVE`]), and how many
/// from all of `slots`.
fn held_answers(
    slots: &[u32],
    answers: &[u64],
    fresh: &[(u32, BackendScore)],
    index: &ScoreIndex,
) -> (u64, u64) {
    let (mut held, mut total) = (0, 0);
    for &id in slots {
        let n = answers.get(id as usize).copied().unwrap_or(0);
        total += n;
        if flagged_held(id, fresh, index) {
            held += n;
        }
    }
    (held, total)
}

/// Whether backend `id` is flagged held in `fresh` ([`SCORE_FAR_ABOVE`]).
fn flagged_held(id: u32, fresh: &[(u32, BackendScore)], index: &ScoreIndex) -> bool {
    index
        .position(id)
        .and_then(|i| fresh.get(i))
        .is_some_and(|(_, score)| score.flags & SCORE_FAR_ABOVE != 0)
}

/// Whether the server whose ids share one check (`server`, one per VIP it
/// is behind: `CheckResult::server`) answered users within `wait` before
/// `now`, under any of them: the check's timeout is judged against all its
/// users (busy if any got answers, `CheckResult::counted`), so that it is
/// not down in one VIP and up in another for one and the same check.
fn server_answered_within(
    loads: &LoadTable,
    server: &[u32],
    now: Nanos,
    wait: std::time::Duration,
) -> bool {
    server
        .iter()
        .any(|&id| loads.answered_within(id, now, wait))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One server behind two VIPs (ids 0 and 1), and another (id 2): a
    /// check that timed out counts as busy for both of the first's ids
    /// when users of either VIP got answers during its wait. Before, each
    /// id was judged by its own users only, so a server busy with one
    /// VIP's users went down in the other VIP and stayed up in the first.
    #[test]
    fn a_shared_servers_check_is_busy_when_users_of_any_of_its_vips_were_answered() {
        let config = crate::settings::config::Config::of(
            &["--iface", "eth0", "--health-check", "http"],
            "[[vip]]\naddress = \"10.0.0.100:80\"\nbackends = [\"10.0.0.21:80\", \"10.0.0.22:80\"]\n\
             [[vip]]\naddress = \"10.0.0.101:80\"\nbackends = [\"10.0.0.21:80\"]\n",
        );
        let plan = Plan::new(&config);
        let start = Nanos(1_000_000_000);
        let fleet = Fleet::new(&config, &plan, start);
        let id_of = |vip: &str, addr: &str| {
            fleet
                .find(&vip.parse().unwrap(), addr.parse().unwrap())
                .unwrap()
        };
        // What the checker groups into one check (`CheckResult::server`).
        let shared = [
            id_of("10.0.0.100:80", "10.0.0.21:80"),
            id_of("10.0.0.101:80", "10.0.0.21:80"),
        ];
        assert_ne!(shared[0], shared[1], "one id per VIP");
        let other = [id_of("10.0.0.100:80", "10.0.0.22:80")];
        let mut loads = LoadTable::new(&plan.weights, config.estimate_params(), start);
        let now = Nanos(3_000_000_000);
        let wait = std::time::Duration::from_millis(500);
        // Users of the second VIP were answered 100 ms ago.
        loads.answered(shared[1], 1, Nanos(2_900_000_000));
        let busy = |server: &[u32]| server_answered_within(&loads, server, now, wait);
        assert!(busy(&shared));
        assert!(!busy(&other), "its users got no answer");
        // Answers older than the check's wait do not count.
        assert!(!server_answered_within(
            &loads,
            &shared,
            now,
            std::time::Duration::from_millis(50)
        ));
    }

    #[test]
    fn held_answers_count_the_slots_flagged_held() {
        let score = |flags| BackendScore {
            flags,
            ..BackendScore::default()
        };
        // Ids 0..4 scored, 1 and 3 held; id 5 answers but is not a slot;
        // id 7 is a slot without a score (counts, not as held).
        let fresh = vec![
            (0, score(0)),
            (1, score(SCORE_FAR_ABOVE)),
            (2, score(0)),
            (3, score(SCORE_FAR_ABOVE)),
        ];
        let index = ScoreIndex::of(&fresh);
        let answers = [10, 3, 20, 2, 0, 99, 0, 5];
        assert_eq!(
            held_answers(&[0, 1, 2, 3, 7], &answers, &fresh, &index),
            (5, 40)
        );
        // A slot id beyond the answers read counts nothing.
        assert_eq!(held_answers(&[3, 40], &answers, &fresh, &index), (2, 2));
        assert_eq!(held_answers(&[], &answers, &fresh, &index), (0, 0));
    }
}
