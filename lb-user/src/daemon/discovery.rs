//! Discovery updates applied to the running pool: the one handler
//! ([`Runtime::on_discovery`]) turns a VIP's wanted set into the same
//! fleet changes the operator's `backend add|remove|weight` commands make
//! (new backends under slow start, removed ones drained until their flows
//! end, weights ramped over `--weight-smoothing`), within the removal cap,
//! and never over an operator's override.

use std::{net::SocketAddr, sync::atomic::Ordering};

use tracing::{debug, info, warn};

use super::runtime::Runtime;
use crate::{
    discover::{
        plan::{self, Member},
        watch::Update,
    },
    kernel::clock::Nanos,
    pool::lifecycle::Admin,
    settings::{
        addr::{BackendAddr, VipAddr, Weight},
        cli::ControlCommand,
        config::Config,
    },
    surface::{control::Request, metrics::DiscoveryMetrics},
};

impl Runtime {
    /// What metrics show of discovery (`None` without it).
    pub(super) fn discovery_metrics(&self) -> Option<DiscoveryMetrics> {
        let status = self.discovery.status.as_ref()?;
        Some(DiscoveryMetrics {
            connected: status.connected(),
            revision: status.revision(),
            applied: status.updates_applied.load(Ordering::Relaxed),
            invalid: status.updates_invalid.load(Ordering::Relaxed),
            resyncs: status.resyncs.load(Ordering::Relaxed),
            seconds_since_update: status.seconds_since_update(),
        })
    }

    /// Notes an operator command that overrides discovery (weight) or
    /// clears the overrides (undrain).
    pub(super) fn note_override(&mut self, request: &Request) {
        let (Ok(vip), Ok(addr)) = (
            request.vip.parse(),
            request
                .backend
                .parse::<crate::settings::addr::BackendAddr>(),
        ) else {
            return;
        };
        let key = (vip, addr.addr);
        match request.command {
            ControlCommand::Weight => {
                self.discovery.weight_overrides.insert(key);
            }
            ControlCommand::Undrain | ControlCommand::Remove => {
                self.discovery.weight_overrides.remove(&key);
            }
            _ => {}
        }
    }

    /// Lays what the runtime state keeps for a member discovery just added
    /// over it: an operator's drain and weight hold whatever etcd says,
    /// also for a member that left etcd and came back, as they do across
    /// a restart (`settings::state`). Published with the rest of the
    /// update, so the member is never in service in between.
    fn apply_kept(&mut self, vip: &VipAddr, addr: SocketAddr, now: Nanos) {
        let Some((drained, weight)) = self.state.kept_for(vip, addr) else {
            return;
        };
        if let Some(weight) = weight {
            match self.fleet.set_weight(vip, addr, weight, now) {
                Ok(_) => {
                    self.discovery.weight_overrides.insert((*vip, addr));
                }
                Err(err) => {
                    warn!(%vip, %addr, "runtime state: cannot keep the weight set at runtime: {err}")
                }
            }
        }
        if drained && let Err(err) = self.fleet.set_admin(vip, addr, Admin::Draining, now) {
            warn!(%vip, %addr, "runtime state: cannot keep the drain: {err}");
        }
    }

    /// `base` with each discovered VIP's backends as the pool has them now:
    /// a re-read configuration has no backends for such a VIP (they come
    /// from etcd), and reloading it as it is would remove them all.
    pub(super) fn with_discovered(&self, base: &Config) -> Config {
        let mut config = base.clone();
        for vip in config.vips.iter_mut().filter(|v| v.etcd_prefix.is_some()) {
            let Ok(index) = self.fleet.vip_index(&vip.vip) else {
                continue;
            };
            vip.backends = self.fleet.vips[index]
                .members
                .iter()
                .filter_map(|&id| self.fleet.member(id))
                .filter(|m| m.life.admin() != Admin::Removed)
                .map(|m| BackendAddr {
                    addr: m.addr,
                    weight: Weight::new(u64::from(m.life.weight())).unwrap_or(Weight::DEFAULT),
                    zone: self.discovery.zones.get(&(vip.vip, m.addr)).copied(),
                })
                .collect();
        }
        config
    }

    /// Applies one VIP's wanted set; the kernel has it when this returns.
    pub fn on_discovery(&mut self, update: &Update, now: Nanos) -> anyhow::Result<()> {
        if !self.apply_wanted(update, now, Attempt::First) {
            return Ok(());
        }
        self.after_membership_change();
        self.on_tick(now)
    }

    /// Plans again, every [`crate::discover::state::REAPPLY_EVERY`], each
    /// VIP's last wanted set
    /// whose application failed in part (an add a full VIP refused, and
    /// the old member kept for it): that work would otherwise wait for the
    /// next etcd event, which may never come. Removals the cap deferred
    /// are not retried: a retry a second would make the cap a pace, and a
    /// deleted prefix would still empty the pool in seconds. Called on the
    /// score tick, before it publishes; true if the pool changed.
    pub fn reapply_discovery(&mut self, now: Nanos) -> bool {
        let mut changed = false;
        for update in self.discovery.due_reapplies(now) {
            changed |= self.apply_wanted(&update, now, Attempt::Again);
        }
        if changed {
            self.after_membership_change();
        }
        changed
    }

    /// Moves VIP `update.vip`'s pool towards `update.wanted` and notes
    /// whether that finished; true if anything was changed (the caller
    /// then publishes).
    fn apply_wanted(&mut self, update: &Update, now: Nanos, attempt: Attempt) -> bool {
        // (A backend at a SNAT address never gets here: the watch's view
        // skips its key's value as a bad one, `discover::view`.)
        let vip = update.vip;
        if !self.state.discovers(&vip, &update.prefix) {
            // Sent before the reload that dropped the VIP ended its watch,
            // or for an address a VIP added at runtime took: that pool is
            // the file's (or the operator's).
            debug!(vip = %vip, prefix = %update.prefix, revision = update.revision, "discovery: update for a VIP the configuration no longer discovers from this prefix: ignored");
            self.discovery.forget(vip);
            return false;
        }
        let Some(fleet_vip) = self
            .fleet
            .vip_index(&vip)
            .ok()
            .map(|index| &self.fleet.vips[index])
            .filter(|v| !v.removed)
        else {
            warn!(vip = %vip, revision = update.revision, "discovery: update for a VIP not served (removed at runtime): ignored");
            self.discovery.forget(vip);
            return false;
        };
        let pool: Vec<Member> = fleet_vip
            .members
            .iter()
            .filter_map(|&id| self.fleet.member(id))
            .map(|m| Member {
                addr: m.addr,
                weight: m.life.weight(),
                removed: m.life.admin() == Admin::Removed,
                weight_overridden: self
                    .discovery
                    .weight_overrides
                    .contains(&(update.vip, m.addr)),
                zone: self.discovery.zones.get(&(update.vip, m.addr)).copied(),
            })
            .collect();
        let live = pool.iter().filter(|m| !m.removed).count();
        let mut changes = plan::plan(&pool, &update.wanted, self.discovery.max_removal_percent);
        for e in &update.wanted {
            match e.zone {
                Some(z) => self.discovery.zones.insert((update.vip, e.addr), z),
                None => self.discovery.zones.remove(&(update.vip, e.addr)),
            };
        }
        self.discovery.revisions.insert(update.vip, update.revision);
        if changes.is_empty() {
            self.note_deferred(update, changes.deferred, attempt);
            self.discovery.note_applied(update, true, now);
            return false;
        }
        let mut failed = 0;
        let mut added = 0;
        for e in &changes.add {
            // The watch probed its next hop before reporting it.
            match self.fleet.add(&vip, e.backend(), now) {
                Ok(id) => {
                    added += 1;
                    self.loads.reset(id, now);
                    self.apply_kept(&vip, e.addr, now);
                }
                Err(err) => {
                    failed += 1;
                    attempt.failed(update, e.addr, "add", &err);
                }
            }
        }
        // The plan counted every add as a member that stays.
        changes.keep_one(live, added);
        self.note_deferred(update, changes.deferred, attempt);
        for (addr, weight) in &changes.reweight {
            if let Err(err) = self.fleet.set_weight(&vip, *addr, *weight, now) {
                failed += 1;
                attempt.failed(update, *addr, "re-weight", &err);
            }
        }
        for (addr, zone) in &changes.rezone {
            if let Err(err) = self.fleet.set_zone(&vip, *addr, *zone) {
                failed += 1;
                attempt.failed(update, *addr, "move to another zone", &err);
            }
        }
        for addr in &changes.remove {
            if let Err(err) = self.fleet.set_admin(&vip, *addr, Admin::Removed, now) {
                failed += 1;
                attempt.failed(update, *addr, "remove", &err);
            }
            self.discovery.weight_overrides.remove(&(update.vip, *addr));
        }
        self.discovery
            .note_applied(update, !changes.retry(failed), now);
        let planned = changes.add.len()
            + changes.reweight.len()
            + changes.rezone.len()
            + changes.remove.len();
        if attempt == Attempt::Again && failed == planned {
            // Nothing new: a retry that only failed again stays quiet.
            return false;
        }
        info!(
            vip = %vip,
            revision = update.revision,
            again = attempt == Attempt::Again,
            added = changes.add.len(),
            reweighted = changes.reweight.len(),
            rezoned = changes.rezone.len(),
            removed = changes.remove.len(),
            deferred = changes.deferred,
            failed,
            "discovery update applied"
        );
        true
    }

    fn note_deferred(&self, update: &Update, deferred: usize, attempt: Attempt) {
        if deferred > 0 && attempt == Attempt::First {
            warn!(vip = %update.vip, deferred, cap_percent = self.discovery.max_removal_percent, "discovery: removals held back by the cap (or to keep a member) until the next update");
        }
    }
}

/// Whether an update is applied as it arrives or planned again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Attempt {
    First,
    /// A re-apply: its failures were logged as warnings the first time,
    /// so they are only debug lines now (a full VIP is retried every
    /// [`REAPPLY_EVERY`]).
    Again,
}

impl Attempt {
    fn failed(self, update: &Update, backend: SocketAddr, what: &str, err: &dyn std::fmt::Display) {
        match self {
            Attempt::First => {
                warn!(vip = %update.vip, backend = %backend, "discovery: cannot {what}: {err}");
            }
            Attempt::Again => {
                debug!(vip = %update.vip, backend = %backend, "discovery: still cannot {what}: {err}");
            }
        }
    }
}
