//! The control plane's live model of every VIP and backend: the ids, each
//! backend's [`Lifecycle`] and outlier [`Detector`], and the rules that
//! turn them into what the kernel may select (with the ejection cap and the
//! panic fallback). Runtime changes (socket commands, SIGHUP) go through
//! here. Pure: no maps, time passed in.
//!
//! Ids: the configured backends get the ids of [`Plan`] (stable across
//! restarts, by address). A backend added at
//! runtime gets the lowest free id. A removed backend keeps its id, as
//! draining, until the reconciler finds no live flow to it; only then is
//! the id freed for reuse, so events and counters of old flows never land
//! on a new backend.

use std::{collections::BTreeMap, net::SocketAddr};

use lb_common::{
    Algorithm, BACKEND_ACTIVE, Backend, MAX_BACKENDS, MAX_BACKENDS_PER_VIP, MAX_MAGLEV_TABLES,
    MAX_VIPS, VipKey, VipMeta,
};
use thiserror::Error;
use tracing::{info, warn};

use crate::{
    ingest::events::{CloseReason, Event},
    kernel::clock::Nanos,
    kernel::wire,
    pool::lifecycle::{Admin, Lifecycle, State},
    pool::outlier::{Detector, Failure, Finding, ejection_cap, latency_outliers},
    pool::plan::{Plan, vip_key, vip_meta},
    pool::zones::{self, Spill, ZoneMember, ZonePlan},
    settings::addr::{BackendAddr, VipAddr},
    settings::config::{Config, VipConfig},
    settings::ops::{HealthCheck, LifecycleParams, OutlierParams},
    settings::zone::{ZoneName, ZoneSettings},
};

/// A runtime change that cannot be applied, as the operator sees it.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum FleetError {
    #[error("no VIP {0}")]
    NoVip(String),
    #[error("VIP {vip} has no backend {backend}")]
    NoBackend { vip: String, backend: String },
    #[error("VIP {vip} already has backend {backend}")]
    Exists { vip: String, backend: String },
    #[error("no free backend id (at most {MAX_BACKENDS}, including removed ones still draining)")]
    Full,
    #[error("VIP {0} is full ({MAX_BACKENDS_PER_VIP} backends)")]
    VipFull(String),
    #[error("VIP {0} already exists")]
    VipExists(String),
    #[error(
        "backend {backend} is the last of VIP {vip}, which needs one: add another first, or remove the VIP"
    )]
    LastBackend { vip: String, backend: String },
    #[error("VIP {0} is the last one served, and the balancer needs one: add another first")]
    LastVip(String),
    #[error("VIP {0} was removed and still drains its flows; add it again once they ended")]
    VipDraining(String),
    #[error("no free VIP id (at most {MAX_VIPS}, including removed ones still draining)")]
    VipsFull,
    #[error("no free Maglev table (at most {MAX_MAGLEV_TABLES} Maglev VIPs)")]
    MaglevFull,
}

#[derive(Clone, Debug)]
pub struct Member {
    pub addr: SocketAddr,
    pub vip: usize,
    /// The backend's zone (`None`: no zone).
    pub zone: Option<ZoneName>,
    pub life: Lifecycle,
    pub outlier: Detector,
}

#[derive(Clone, Debug)]
pub struct FleetVip {
    pub addr: VipAddr,
    pub key: VipKey,
    /// `backend_count` is filled in at publish time.
    pub meta: VipMeta,
    pub health: Option<HealthCheck>,
    pub params: LifecycleParams,
    /// Member ids (including removed ones still draining), in order.
    pub members: Vec<u32>,
    /// True while no backend is selectable and all are served anyway.
    pub panic: bool,
    /// Index of the VIP's Maglev table (maglev VIPs only).
    pub maglev_table: Option<u32>,
    /// Removed: out of VIPS (the kernel passes its new connections on
    /// like any unknown address) while its flows drain; its id and its
    /// backends' ids are freed once no flow is left.
    pub removed: bool,
    /// Routes by zone (`pool::zones`): the VIP asks for it and the
    /// balancer has a zone.
    pub zone_aware: bool,
    /// The zone plan of the last tick (zone-aware VIPs).
    pub zone_plan: Option<ZonePlan>,
    /// Times the VIP entered the zone panic.
    pub zone_panics: u64,
}

/// Steps a ramp (slow start, weight smoothing) takes on a VIP whose
/// algorithm reads a table built from the weights: each step rebuilds the
/// table, so a ramp costs at most this many rebuilds, not one per tick.
pub const TABLE_RAMP_STEPS: u32 = 10;

/// Whether VIP algorithm `algorithm` (a `VipMeta::algorithm`) reads a
/// table built from the weights (WRR schedule, weighted-random sums, Maglev).
pub fn table_based(algorithm: u8) -> bool {
    matches!(
        Algorithm::from_u8(algorithm),
        Some(Algorithm::WeightedRoundRobin | Algorithm::Random | Algorithm::Maglev)
    )
}

/// `weight` (in weight units) rounded to a step of `full / TABLE_RAMP_STEPS`
/// (`full`: the largest weight of the ramp in units, `Lifecycle::ramp_span`),
/// never below one step.
pub fn coarse_weight(weight: u32, full: u32) -> u32 {
    let step = (full / TABLE_RAMP_STEPS).max(1);
    ((weight + step / 2) / step * step).max(step)
}

/// What the kernel should see of one VIP.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selection {
    /// Selectable backend ids, in slot order.
    pub slots: Vec<u32>,
    /// Effective weight of each slot, in [`crate::estimate::WEIGHT_UNITS`].
    pub weights: Vec<u32>,
    /// `(id, kernel state)` of every member.
    pub states: Vec<(u32, u8)>,
    /// Zone-aware VIPs routing by zone: the number of slots of each zone
    /// block, in block order (the slots are grouped by block). Empty: the
    /// VIP selects over all its slots.
    pub zone_blocks: Vec<u32>,
}

impl Selection {
    /// Whether `self` gives the kernel what `last` gave it, for a VIP whose
    /// algorithm is `algorithm`: the weights count only where the
    /// algorithm reads a table built from them ([`table_based`]). P2C reads
    /// its weights from the scores, written apart, and round-robin and
    /// least connections read none, so a slow-start ramp on such a VIP
    /// rewrites none of its slots or tables.
    pub fn same_in_kernel(&self, last: &Selection, algorithm: u8) -> bool {
        self.slots == last.slots
            && self.states == last.states
            && self.zone_blocks == last.zone_blocks
            && (!table_based(algorithm) || self.weights == last.weights)
    }

    /// Backend id → its slot, so per-tick work stays linear in the VIP's size.
    fn slot_index(&self) -> std::collections::HashMap<u32, usize> {
        self.slots
            .iter()
            .enumerate()
            .map(|(i, &id)| (id, i))
            .collect()
    }

    /// Groups the slots by the blocks of `plan` (blocks without a
    /// selectable backend are left out: they get no share). A zone panic
    /// has no blocks: every backend serves, as the selection has them.
    /// Returns false if the plan did not cover the selection (a planning
    /// bug, logged), which is then left whole.
    pub fn group_by_zone(&mut self, plan: &ZonePlan) -> bool {
        if plan.spill == Spill::Panic {
            return true;
        }
        let index = self.slot_index();
        let mut slots = Vec::with_capacity(self.slots.len());
        let mut weights = Vec::with_capacity(self.weights.len());
        let mut blocks = Vec::new();
        for block in plan.blocks.iter().filter(|b| !b.slots.is_empty()) {
            for id in &block.slots {
                if let Some(&i) = index.get(id) {
                    slots.push(self.slots[i]);
                    weights.push(self.weights[i]);
                }
            }
            blocks.push(block.slots.len() as u32);
        }
        if slots.len() != self.slots.len() {
            // Every selectable backend is in exactly one block; anything
            // else is a planning bug, and the whole VIP is the safe answer.
            warn!("zone plan does not cover the selection: routing over all backends");
            return false;
        }
        self.slots = slots;
        self.weights = weights;
        self.zone_blocks = blocks;
        true
    }
}

#[derive(Debug)]
pub struct Fleet {
    pub vips: Vec<FleetVip>,
    /// Indexed by backend id.
    pub members: Vec<Option<Member>>,
    /// Ids that no member has but flows still hold: backends of a VIP
    /// that was gone when this process started ([`Plan::orphaned`]), with
    /// that VIP's id (kept from new VIPs too: the entries still name it).
    /// Not handed out until a scan finds them free.
    reserved: BTreeMap<u32, u32>,
    /// Removed members' marks: how many reconciliation passes had started
    /// when this process first saw them removed (see [`Fleet::free_drained`]).
    removal_marks: BTreeMap<u32, u64>,
    /// The balancer's zone and the zone-aware routing settings.
    pub zones: ZoneSettings,
    outlier: OutlierParams,
    max_ejection_percent: u32,
}

impl Fleet {
    pub fn new(config: &Config, plan: &Plan, now: Nanos) -> Self {
        let mut members: Vec<Option<Member>> = vec![None; plan.backends.len()];
        let mut vips: Vec<FleetVip> = config
            .vips
            .iter()
            .zip(&plan.vips)
            .enumerate()
            .map(|(index, (v, p))| {
                for (&id, b) in p.slots.iter().zip(&v.backends) {
                    members[id as usize] = Some(Member {
                        addr: b.addr,
                        vip: index,
                        zone: b.zone,
                        life: if plan.down.contains(&id) {
                            Lifecycle::down_before_restart(id, b.weight.get(), now)
                        } else {
                            Lifecycle::new(id, b.weight.get(), now)
                        },
                        outlier: Detector::default(),
                    });
                }
                FleetVip {
                    addr: v.vip,
                    key: p.key,
                    meta: p.meta,
                    health: v.health.clone(),
                    params: config.ops.lifecycle_for(v.health.as_ref()),
                    members: p.slots.clone(),
                    panic: false,
                    maglev_table: p.maglev_table,
                    removed: false,
                    zone_aware: v.zone_aware && config.zones.local.is_some(),
                    zone_plan: None,
                    zone_panics: 0,
                }
            })
            .collect();
        for d in &plan.draining {
            let params = vips[d.vip].params;
            let mut life = Lifecycle::new(d.id, d.weight, now);
            life.set_admin(Admin::Removed, now, &params);
            members[d.id as usize] = Some(Member {
                addr: d.addr,
                vip: d.vip,
                zone: None,
                life,
                outlier: Detector::default(),
            });
            vips[d.vip].members.push(d.id);
            info!(backend = d.id, address = %d.addr, vip = %vips[d.vip].addr, "backend no longer configured: draining until its flows end");
        }
        for &id in &plan.orphaned {
            info!(
                backend = id,
                "backend of a VIP no longer served: its flows go on, its id stays reserved until they end"
            );
        }
        Self {
            vips,
            members,
            reserved: plan
                .orphaned
                .iter()
                .map(|&id| (id, plan.backends[id as usize].vip_id))
                .collect(),
            removal_marks: BTreeMap::new(),
            zones: config.zones.clone(),
            outlier: config.ops.outlier,
            max_ejection_percent: config.ops.max_ejection_percent,
        }
    }

    pub fn member(&self, id: u32) -> Option<&Member> {
        self.members.get(id as usize)?.as_ref()
    }

    /// Whether backend `id`'s users' answers of one tick, the slowest of
    /// which took `peak`, measure its latency
    /// ([`Lifecycle::measures_service`]). In a VIP's panic mode the
    /// backends the checks fail serve every user (the checks themselves
    /// may be what is broken), so their answers are the only latency there
    /// is and are taken. An unknown id's are taken, as before.
    pub fn measures_latency(&self, id: u32, peak: std::time::Duration, now: Nanos) -> bool {
        let Some(m) = self.member(id) else {
            return true;
        };
        self.vips.get(m.vip).is_some_and(|v| v.panic) || m.life.measures_service(peak, now)
    }

    /// The latency probe interval of backend `id`'s VIP's health check
    /// (`None`: no check, or probes off).
    pub fn latency_probe(&self, id: u32) -> Option<std::time::Duration> {
        let m = self.member(id)?;
        self.vips.get(m.vip)?.health.as_ref()?.latency_probe
    }

    fn member_mut(&mut self, id: u32) -> Option<&mut Member> {
        self.members.get_mut(id as usize)?.as_mut()
    }

    /// The VIPs that route by zone: zone-aware, and not removed and
    /// draining.
    pub fn zone_aware_vips(&self) -> impl Iterator<Item = &FleetVip> {
        self.vips.iter().filter(|v| v.zone_aware && !v.removed)
    }

    /// The index of VIP `vip` (not one removed and draining).
    pub fn vip_index(&self, vip: &VipAddr) -> Result<usize, FleetError> {
        self.vips
            .iter()
            .position(|v| v.addr == *vip && !v.removed)
            .ok_or_else(|| FleetError::NoVip(vip.to_string()))
    }

    /// The id of `backend` in `vip` (removed ones included).
    pub fn find(&self, vip: &VipAddr, backend: SocketAddr) -> Result<u32, FleetError> {
        let index = self.vip_index(vip)?;
        self.vips[index]
            .members
            .iter()
            .copied()
            .find(|&id| self.member(id).is_some_and(|m| m.addr == backend))
            .ok_or_else(|| FleetError::NoBackend {
                vip: vip.to_string(),
                backend: backend.to_string(),
            })
    }

    /// [`Self::find`]'s member itself, with the lifecycle parameters of
    /// its VIP: one lookup of the VIP, and no second lookup of the id.
    fn find_member_mut(
        &mut self,
        vip: &VipAddr,
        backend: SocketAddr,
    ) -> Result<(u32, &mut Member, LifecycleParams), FleetError> {
        let index = self.vip_index(vip)?;
        let params = self.vips[index].params;
        let Self { vips, members, .. } = self;
        vips[index]
            .members
            .iter()
            .copied()
            .find(|&id| {
                members
                    .get(id as usize)
                    .and_then(Option::as_ref)
                    .is_some_and(|m| m.addr == backend)
            })
            .and_then(|id| Some((id, members.get_mut(id as usize)?.as_mut()?, params)))
            .ok_or_else(|| FleetError::NoBackend {
                vip: vip.to_string(),
                backend: backend.to_string(),
            })
    }

    /// Adds a backend (or brings back a removed one that is still draining).
    pub fn add(
        &mut self,
        vip: &VipAddr,
        backend: BackendAddr,
        now: Nanos,
    ) -> Result<u32, FleetError> {
        let index = self.vip_index(vip)?;
        let params = self.vips[index].params;
        if let Ok(id) = self.find(vip, backend.addr) {
            let m = self.member_mut(id).expect("found above");
            if m.life.admin() != Admin::Removed {
                return Err(FleetError::Exists {
                    vip: vip.to_string(),
                    backend: backend.addr.to_string(),
                });
            }
            m.life.set_weight(backend.weight.get(), now, &params);
            m.life.set_admin(Admin::Active, now, &params);
            m.zone = backend.zone;
            return Ok(id);
        }
        if self.vips[index].members.len() >= MAX_BACKENDS_PER_VIP as usize {
            return Err(FleetError::VipFull(vip.to_string()));
        }
        let free = self
            .members
            .iter()
            .enumerate()
            .position(|(id, m)| m.is_none() && !self.reserved.contains_key(&(id as u32)));
        let id = match free {
            Some(free) => free,
            None if self.members.len() < MAX_BACKENDS as usize => {
                self.members.push(None);
                self.members.len() - 1
            }
            None => return Err(FleetError::Full),
        } as u32;
        self.members[id as usize] = Some(Member {
            addr: backend.addr,
            vip: index,
            zone: backend.zone,
            life: Lifecycle::added(id, backend.weight.get(), now),
            outlier: Detector::default(),
        });
        self.vips[index].members.push(id);
        info!(backend = id, address = %backend.addr, vip = %vip, "backend added");
        Ok(id)
    }

    /// The lowest VIP id no VIP has; a removed VIP keeps its id until it
    /// is freed by [`Self::free_drained`].
    pub fn free_vip_id(&self) -> Option<u32> {
        (0..MAX_VIPS).find(|id| {
            !self.vips.iter().any(|v| v.meta.vip_id == *id)
                && !self.reserved.values().any(|v| v == id)
        })
    }

    /// Adds VIP `v` with its backends under the lowest free VIP id (and
    /// backend ids); returns the VIP id and the backend ids. Nothing
    /// changes if it fails.
    pub fn add_vip(
        &mut self,
        v: &VipConfig,
        params: LifecycleParams,
        now: Nanos,
    ) -> Result<(u32, Vec<u32>), FleetError> {
        let name = v.vip.to_string();
        if let Some(old) = self.vips.iter().find(|f| f.addr == v.vip) {
            return Err(if old.removed {
                FleetError::VipDraining(name)
            } else {
                FleetError::VipExists(name)
            });
        }
        if v.backends.len() > MAX_BACKENDS_PER_VIP as usize {
            return Err(FleetError::VipFull(name));
        }
        let vip_id = self.free_vip_id().ok_or(FleetError::VipsFull)?;
        let maglev_table = if v.algorithm == Algorithm::Maglev {
            // A removed VIP's table is not counted: it leaves VIPS at the
            // next publish, and no flow reads it (its flows drain through
            // the flow table). The writer hands it on only after the last
            // program that found the VIP is done with it
            // (`publish::writers::TABLE_READER_GRACE`).
            let used: Vec<u32> = self
                .vips
                .iter()
                .filter(|f| !f.removed)
                .filter_map(|f| f.maglev_table)
                .collect();
            let table = (0..MAX_MAGLEV_TABLES).find(|t| !used.contains(t));
            Some(table.ok_or(FleetError::MaglevFull)?)
        } else {
            None
        };
        let free = self.members.iter().filter(|m| m.is_none()).count()
            + (MAX_BACKENDS as usize).saturating_sub(self.members.len());
        if free < v.backends.len() {
            return Err(FleetError::Full);
        }
        self.vips.push(FleetVip {
            addr: v.vip,
            key: vip_key(v),
            meta: vip_meta(v, vip_id, 0),
            health: v.health.clone(),
            params,
            members: Vec::new(),
            panic: false,
            maglev_table,
            removed: false,
            zone_aware: v.zone_aware && self.zones.local.is_some(),
            zone_plan: None,
            zone_panics: 0,
        });
        let mut ids = Vec::with_capacity(v.backends.len());
        for b in &v.backends {
            match self.add(&v.vip, *b, now) {
                Ok(id) => ids.push(id),
                Err(e) => {
                    // Checked above; undone all the same.
                    for id in ids {
                        self.members[id as usize] = None;
                    }
                    self.vips.pop();
                    return Err(e);
                }
            }
        }
        info!(vip = %v.vip, vip_id, backends = ids.len(), "VIP added");
        Ok((vip_id, ids))
    }

    /// Removes VIP `vip`: every backend is removed and drains; the VIP
    /// leaves VIPS at the next publish. Returns its id.
    pub fn remove_vip(&mut self, vip: &VipAddr, now: Nanos) -> Result<u32, FleetError> {
        let index = self.vip_index(vip)?;
        let params = self.vips[index].params;
        let ids = self.vips[index].members.clone();
        for id in ids {
            if let Some(m) = self.member_mut(id) {
                m.life.set_admin(Admin::Removed, now, &params);
            }
        }
        let v = &mut self.vips[index];
        v.removed = true;
        v.panic = false;
        info!(vip = %vip, vip_id = v.meta.vip_id, "VIP removed: draining until its flows end");
        Ok(v.meta.vip_id)
    }

    /// Drops removed VIPs whose backends are all freed; returns the
    /// indices they had (highest first) and their ids. Member indices are
    /// renumbered.
    pub fn free_drained_vips(&mut self) -> Vec<(usize, u32)> {
        let mut freed = Vec::new();
        for index in (0..self.vips.len()).rev() {
            let v = &self.vips[index];
            if !v.removed || !v.members.is_empty() {
                continue;
            }
            let v = self.vips.remove(index);
            for m in self.members.iter_mut().flatten() {
                if m.vip > index {
                    m.vip -= 1;
                }
            }
            info!(vip = %v.addr, vip_id = v.meta.vip_id, "removed VIP has no flows left; id freed");
            freed.push((index, v.meta.vip_id));
        }
        freed
    }

    /// Sets the administrative state of `backend` in `vip`.
    pub fn set_admin(
        &mut self,
        vip: &VipAddr,
        backend: SocketAddr,
        admin: Admin,
        now: Nanos,
    ) -> Result<u32, FleetError> {
        if admin != Admin::Removed {
            self.check_not_removed(vip, backend)?;
        }
        let (id, m, params) = self.find_member_mut(vip, backend)?;
        let back_in_service = admin == Admin::Active && m.life.admin() != Admin::Active;
        m.life.set_admin(admin, now, &params);
        if back_in_service {
            // Undrained: it returns clean, as from an ejection. A run of
            // failures from before the drain is not evidence any more (the
            // operator took it out, maybe to fix just that).
            m.outlier.reset(now);
        }
        Ok(id)
    }

    /// Refuses an operator's change to `backend` of `vip` if it was
    /// removed (it only drains its last flows): re-weighting it would be
    /// recorded and answered "done" for a backend no new flow can reach,
    /// as its drain or undrain is refused (`set_admin`).
    pub fn check_not_removed(&self, vip: &VipAddr, backend: SocketAddr) -> Result<(), FleetError> {
        let id = self.find(vip, backend)?;
        if self
            .member(id)
            .is_some_and(|m| m.life.admin() == Admin::Removed)
        {
            return Err(FleetError::NoBackend {
                vip: vip.to_string(),
                backend: backend.to_string(),
            });
        }
        Ok(())
    }

    /// Refuses to remove `backend` if it is the last backend `vip` has
    /// (not counting removed ones): an operator's removal that the state
    /// file's overlay would undo at the next restart or reload (a VIP
    /// keeps its last backend there, as the configuration's rules say).
    pub fn check_not_last(&self, vip: &VipAddr, backend: SocketAddr) -> Result<(), FleetError> {
        let id = self.find(vip, backend)?;
        let index = self.vip_index(vip)?;
        let others = self.vips[index]
            .members
            .iter()
            .filter(|&&i| i != id)
            .filter_map(|&i| self.member(i))
            .any(|m| m.life.admin() != Admin::Removed);
        let removed = self
            .member(id)
            .is_some_and(|m| m.life.admin() == Admin::Removed);
        if others || removed {
            return Ok(());
        }
        Err(FleetError::LastBackend {
            vip: vip.to_string(),
            backend: backend.to_string(),
        })
    }

    /// Refuses to remove `vip` if it is the last VIP served (see
    /// [`Fleet::check_not_last`]).
    pub fn check_not_last_vip(&self, vip: &VipAddr) -> Result<(), FleetError> {
        let index = self.vip_index(vip)?;
        let others = self
            .vips
            .iter()
            .enumerate()
            .any(|(i, v)| i != index && !v.removed);
        if others || self.vips[index].removed {
            return Ok(());
        }
        Err(FleetError::LastVip(vip.to_string()))
    }

    pub fn set_weight(
        &mut self,
        vip: &VipAddr,
        backend: SocketAddr,
        weight: u32,
        now: Nanos,
    ) -> Result<u32, FleetError> {
        let (id, m, params) = self.find_member_mut(vip, backend)?;
        m.life.set_weight(weight, now, &params);
        Ok(id)
    }

    /// Moves `backend` of `vip` to `zone` (a discovery update or a reload).
    pub fn set_zone(
        &mut self,
        vip: &VipAddr,
        backend: SocketAddr,
        zone: Option<ZoneName>,
    ) -> Result<u32, FleetError> {
        let (id, m, _) = self.find_member_mut(vip, backend)?;
        if m.zone != zone {
            info!(backend = id, address = %backend, vip = %vip, from = ?m.zone, to = ?zone, "backend changed zone");
            m.zone = zone;
        }
        Ok(id)
    }

    /// Applies a reloaded configuration: adds, removes and re-weights
    /// the backends of VIPs in both; removes (drains) the VIPs the file no
    /// longer has, then adds the new ones (so a freed id can be reused).
    /// Returns what it refused, and the ids of the backends it added.
    pub fn reload(&mut self, config: &Config, now: Nanos) -> (Vec<String>, Vec<u32>) {
        let mut notes = Vec::new();
        let mut added = Vec::new();
        if self.zones != config.zones {
            info!(zone = ?config.zones.local, "reload changed the zone settings");
            self.zones = config.zones.clone();
        }
        let gone: Vec<VipAddr> = self
            .vips
            .iter()
            .filter(|f| !f.removed && !config.vips.iter().any(|v| v.vip == f.addr))
            .map(|f| f.addr)
            .collect();
        for vip in gone {
            if self.remove_vip(&vip, now).is_ok() {
                info!(%vip, "reload removed VIP {vip}: draining");
            }
        }
        for v in &config.vips {
            match self.vip_index(&v.vip) {
                // Its backends follow etcd, not the file.
                Ok(_) if v.etcd_prefix.is_some() => {}
                Ok(index) => {
                    let before = self.vips[index].members.clone();
                    self.reload_vip(index, v, now, &mut notes);
                    added.extend(
                        self.vips[index]
                            .members
                            .iter()
                            .filter(|id| !before.contains(id)),
                    );
                }
                Err(_) => match self.add_vip(v, config.ops.lifecycle_for(v.health.as_ref()), now) {
                    Ok((vip_id, ids)) => {
                        info!(vip = %v.vip, vip_id, "reload added VIP {} (id {vip_id})", v.vip);
                        added.extend(ids);
                    }
                    Err(e) => notes.push(format!("VIP {} not added: {e}", v.vip)),
                },
            }
        }
        (notes, added)
    }

    fn reload_vip(&mut self, index: usize, v: &VipConfig, now: Nanos, notes: &mut Vec<String>) {
        let vip = v.vip;
        let zone_aware = v.zone_aware && self.zones.local.is_some();
        if self.vips[index].zone_aware != zone_aware {
            info!(%vip, zone_aware, "reload changed the VIP's zone-aware routing");
            self.vips[index].zone_aware = zone_aware;
        }
        // New backends that found no room: as many of the backends the file
        // no longer has stay in service (below).
        let mut unplaced = 0;
        for b in &v.backends {
            match self.find(&vip, b.addr) {
                Ok(id) => {
                    let m = self.member(id).expect("found");
                    if m.life.admin() == Admin::Removed {
                        let _ = self.add(&vip, *b, now);
                    } else if m.life.weight() != b.weight.get() {
                        let _ = self.set_weight(&vip, b.addr, b.weight.get(), now);
                    }
                    let _ = self.set_zone(&vip, b.addr, b.zone);
                }
                Err(_) => {
                    if let Err(e) = self.add(&vip, *b, now) {
                        if matches!(e, FleetError::VipFull(_) | FleetError::Full) {
                            unplaced += 1;
                        }
                        notes.push(e.to_string());
                    }
                }
            }
        }
        let gone: Vec<SocketAddr> = self.vips[index]
            .members
            .iter()
            .filter_map(|&id| self.member(id))
            .filter(|m| m.life.admin() != Admin::Removed)
            .map(|m| m.addr)
            .filter(|addr| !v.backends.iter().any(|b| b.addr == *addr))
            .collect();
        // A removed backend holds its place until its flows end, so a file
        // that replaces many backends at once may find no room for all the
        // new ones: the VIP keeps its capacity with old backends, one for
        // each new one refused, rather than shrink. A later reload, once
        // the removed ones have drained, places the rest.
        let kept = unplaced.min(gone.len());
        if kept > 0 {
            notes.push(format!(
                "VIP {vip}: {kept} backend(s) the file no longer lists stay in service, one for \
                 each new backend that found no room (removed backends hold theirs until their \
                 flows end); reload again once they have"
            ));
        }
        for addr in gone.into_iter().skip(kept) {
            let _ = self.set_admin(&vip, addr, Admin::Removed, now);
            info!(address = %addr, vip = %vip, "backend removed by reload");
        }
    }

    /// Frees the ids of removed backends, and the reserved ids of gone
    /// VIPs' backends, without live flows in `live` (scan number `pass`);
    /// returns them. `started`: the passes started by now.
    ///
    /// A removed backend is freed only by a pass that started after this
    /// process first saw it removed: an earlier pass may have read its
    /// counters before flows the backend then took (it may even have been
    /// added after that read), and would free an id flows still hold.
    pub fn free_drained(&mut self, live: &[u64], pass: u64, started: u64) -> Vec<u32> {
        let held = |id: u32| live.get(id as usize).copied().unwrap_or(0) > 0;
        let removed: Vec<u32> = (0..self.members.len() as u32)
            .filter(|&id| {
                self.member(id)
                    .is_some_and(|m| m.life.admin() == Admin::Removed)
            })
            .collect();
        self.removal_marks.retain(|id, _| removed.contains(id));
        for &id in &removed {
            self.removal_marks.entry(id).or_insert(started);
        }
        let released: Vec<u32> = self
            .reserved
            .keys()
            .copied()
            .filter(|&id| !held(id))
            .collect();
        for id in &released {
            self.reserved.remove(id);
            info!(
                backend = id,
                "backend of a VIP no longer served has no flows left; id freed"
            );
        }
        let freed: Vec<u32> = removed
            .into_iter()
            .filter(|&id| !held(id) && self.removal_marks.get(&id).is_some_and(|&mark| pass > mark))
            .collect();
        for &id in &freed {
            self.removal_marks.remove(&id);
            if let Some(m) = self.members[id as usize].take() {
                self.vips[m.vip].members.retain(|&x| x != id);
                info!(backend = id, address = %m.addr, "removed backend has no flows left; id freed");
            }
        }
        released.into_iter().chain(freed).collect()
    }

    /// Feeds a kernel event to outlier detection: a failure (a refused
    /// connection, a backend's reset) is recorded, and judged with the
    /// tick's answers by [`Fleet::judge_outliers`]; other events are not
    /// outcomes.
    pub fn on_event(&mut self, event: Event, now: Nanos) {
        let p = self.outlier;
        let (id, failure) = match event {
            Event::Refused { backend } => (backend, Failure::Refused),
            Event::Closed {
                backend,
                reason: CloseReason::BackendRst,
            } => (backend, Failure::Reset),
            _ => return,
        };
        let Some(m) = self.member_mut(id) else {
            return;
        };
        if m.life.state(now) != State::Active {
            // Out of service (ejected, down, draining): late evidence (SYN
            // timeouts and resets of flows from before) is not held
            // against it when it returns, which it does clean.
            m.outlier.failures_total += 1;
            return;
        }
        m.outlier.failure(failure, now, &p);
    }

    /// The score tick's judgement of every backend in service: `answers`
    /// (indexed by id) are its responses since the last tick, and the
    /// failures recorded since are judged with them and, for a backend
    /// with refusals to judge, with `handshakes(id)`, the kernel's count of
    /// connections it accepted (see [`crate::pool::outlier::Detector`]);
    /// outliers are ejected within the cap. True if any was.
    pub fn judge_outliers(
        &mut self,
        answers: &[u64],
        mut handshakes: impl FnMut(u32) -> Option<u64>,
        now: Nanos,
    ) -> bool {
        let p = self.outlier;
        let mut ejected = false;
        for id in 0..self.members.len() as u32 {
            let Some(m) = self.member_mut(id) else {
                continue;
            };
            if m.life.state(now) != State::Active {
                continue;
            }
            let answered = answers.get(id as usize).copied().unwrap_or(0);
            let accepted = m
                .outlier
                .needs_handshakes()
                .then(|| handshakes(id))
                .flatten();
            if let Some(finding) = m.outlier.judge(answered, accepted, now, &p) {
                ejected |= self.try_eject(id, finding, now);
            }
        }
        ejected
    }

    /// Ejects `id` unless that would pass the VIP's ejection cap; true if
    /// it did.
    fn try_eject(&mut self, id: u32, finding: Finding, now: Nanos) -> bool {
        let Some(m) = self.member(id) else {
            return false;
        };
        if m.life.state(now) != State::Active {
            return false;
        }
        let vip = m.vip;
        let pool: Vec<u32> = self.vips[vip]
            .members
            .iter()
            .copied()
            .filter(|&i| {
                self.member(i)
                    .is_some_and(|m| m.life.admin() == Admin::Active)
            })
            .collect();
        // Ejected and down alike are out of service: ejecting past the
        // cap counting only the ejected could take the last backend the
        // checks pass, and the panic that followed would serve the down.
        let unavailable = pool
            .iter()
            .filter(|&&i| {
                self.member(i)
                    .is_some_and(|m| m.life.state(now) != State::Active)
            })
            .count();
        let cap = ejection_cap(pool.len(), self.max_ejection_percent);
        let params = self.vips[vip].params;
        let m = self.member_mut(id).expect("checked");
        if unavailable >= cap {
            warn!(
                backend = id,
                why = finding.name(),
                unavailable,
                cap,
                "outlier not ejected: the VIP is at its ejection cap (ejected and down backends)"
            );
            m.outlier.reset(now);
            return false;
        }
        m.life.eject(now, &params, finding.name());
        m.outlier.reset(now);
        true
    }

    /// Advances timers, and ejects latency outliers (`ewma_ns` by id:
    /// `None` for a backend users have not measured lately, which is
    /// neither judged nor part of the median: its estimate is the
    /// cold-start guess or drifting towards it, not a latency).
    pub fn tick(&mut self, now: Nanos, ewma_ns: impl Fn(u32) -> Option<u64>) {
        for vip in 0..self.vips.len() {
            let params = self.vips[vip].params;
            for &id in &self.vips[vip].members.clone() {
                if let Some(m) = self.member_mut(id) {
                    m.life.tick(now, &params);
                }
            }
            if self.outlier.latency_factor > 0.0 {
                let (active, ewmas): (Vec<u32>, Vec<u64>) = self.vips[vip]
                    .members
                    .iter()
                    .copied()
                    .filter(|&i| {
                        self.member(i)
                            .is_some_and(|m| m.life.state(now) == State::Active)
                    })
                    .filter_map(|i| Some((i, ewma_ns(i)?)))
                    .unzip();
                for i in latency_outliers(&ewmas, self.outlier.latency_factor) {
                    // Published by the tick that called this.
                    let _ = self.try_eject(active[i], Finding::Latency, now);
                }
            }
        }
    }

    /// An active health-check result for backend `id`; true if its
    /// health flipped.
    pub fn health_result(&mut self, id: u32, passed: bool, now: Nanos) -> bool {
        let Some(vip) = self.member(id).map(|m| m.vip) else {
            return false;
        };
        let params = self.vips[vip].params;
        self.member_mut(id).is_some_and(|m| {
            let flipped = m.life.check_result(passed, now, &params);
            if flipped && passed {
                // Back up: it returns clean, as from an ejection.
                m.outlier.reset(now);
            }
            flipped
        })
    }

    /// What the kernel should see of VIP `index` now. With no backend
    /// selectable, every administratively active one is (the panic mode
    /// of Envoy's panic threshold): a pool whose checks all fail, e.g.
    /// because the checks themselves are broken, keeps being served.
    pub fn selection(&mut self, index: usize, now: Nanos) -> Selection {
        let vip = &self.vips[index];
        let members: Vec<&Member> = vip
            .members
            .iter()
            .filter_map(|&id| self.member(id))
            .collect();
        let selectable = |m: &Member| m.life.state(now) == State::Active;
        let any = members.iter().any(|m| selectable(m));
        let panic = !any && members.iter().any(|m| m.life.admin() == Admin::Active);
        // In a panic, backends the checks pass (ejected ones) before those
        // they fail: all of them only when the checks fail everywhere.
        let passing = members.iter().any(|m| m.life.state(now) == State::Ejected);
        let chosen = |m: &Member| {
            if panic {
                m.life.admin() == Admin::Active && (!passing || m.life.state(now) == State::Ejected)
            } else {
                selectable(m)
            }
        };
        let mut out = Selection {
            slots: Vec::new(),
            weights: Vec::new(),
            states: Vec::new(),
            zone_blocks: Vec::new(),
        };
        for (&id, m) in vip
            .members
            .iter()
            .filter(|&&id| self.member(id).is_some())
            .zip(&members)
        {
            if chosen(m) {
                out.slots.push(id);
                let weight = m.life.effective_weight(now, &vip.params);
                out.weights.push(if table_based(vip.meta.algorithm) {
                    coarse_weight(weight, m.life.ramp_span(now, &vip.params))
                } else {
                    weight
                });
                out.states.push((id, BACKEND_ACTIVE));
            } else {
                out.states.push((id, m.life.kernel_state(now)));
            }
        }
        if panic != vip.panic {
            if panic {
                warn!(vip = %vip.addr, "no backend passes its checks: serving all of them (panic mode)");
            } else {
                info!(vip = %vip.addr, "backends pass their checks again: panic mode over");
            }
            self.vips[index].panic = panic;
        }
        out
    }

    /// The zone plan of zone-aware VIP `index` for its `selection` (see
    /// [`crate::pool::zones`]); `None` for a VIP that is not zone-aware.
    /// A VIP in panic mode (no backend passes its checks) is in the zone
    /// panic too: every backend serves.
    pub fn zone_plan(
        &self,
        index: usize,
        selection: &Selection,
        now: Nanos,
        ewma_ns: impl Fn(u32) -> Option<u64>,
    ) -> Option<ZonePlan> {
        let vip = &self.vips[index];
        let local = self.zones.local?;
        if !vip.zone_aware || vip.removed {
            return None;
        }
        if vip.panic {
            return Some(ZonePlan {
                blocks: Vec::new(),
                spill: Spill::Panic,
                reason: "no backend passes its checks: every backend serves".to_string(),
            });
        }
        let index = selection.slot_index();
        let members: Vec<ZoneMember> = vip
            .members
            .iter()
            .filter_map(|&id| Some((id, self.member(id)?)))
            .filter(|(_, m)| m.life.admin() != Admin::Removed)
            .map(|(id, m)| {
                let slot = index.get(&id).copied();
                ZoneMember {
                    id,
                    zone: m.zone,
                    selectable: slot.is_some(),
                    weight: slot.map_or(0, |i| selection.weights[i]),
                    // The configured weight as smoothing moves it, so that
                    // only the slow-start ramp and being out of service make
                    // a zone look less healthy, not a raised weight.
                    full_weight: m.life.smoothed_weight(now, &vip.params),
                    ewma_ns: ewma_ns(id),
                }
            })
            .collect();
        Some(zones::plan(local, &self.zones, &members))
    }

    /// Keeps VIP `index`'s zone plan of this tick; logs every change of
    /// its spill state, with the reason, and counts zone panics.
    pub fn note_zone_plan(&mut self, index: usize, plan: Option<ZonePlan>) {
        let vip = &mut self.vips[index];
        let before = vip.zone_plan.as_ref().map(|p| p.spill);
        let after = plan.as_ref().map(|p| p.spill);
        if before != after
            && let Some(p) = &plan
        {
            match p.spill {
                Spill::Local => {
                    info!(vip = %vip.addr, "zone routing: local zone takes every new connection ({p})");
                }
                Spill::Spilling => {
                    warn!(vip = %vip.addr, reason = %p.reason, "zone routing: spilling to other zones ({p})");
                }
                Spill::Panic => {
                    vip.zone_panics += 1;
                    warn!(vip = %vip.addr, reason = %p.reason, "zone routing: panic, every backend serves");
                }
            }
        }
        vip.zone_plan = plan;
    }

    /// The BACKENDS entry of member `id`.
    pub fn backend_entry(&self, id: u32, state: u8) -> Option<Backend> {
        let m = self.member(id)?;
        Some(wire::backend_entry(
            m.addr,
            self.vips[m.vip].meta.vip_id,
            m.life.weight(),
            state,
        ))
    }

    /// Every backend id that may be in use (the length of the id space).
    pub fn id_limit(&self) -> usize {
        self.members.len()
    }

    /// Backends with an active health check: `(id, address, check)`.
    pub fn checks(&self) -> Vec<(u32, SocketAddr, HealthCheck)> {
        self.members
            .iter()
            .enumerate()
            .filter_map(|(id, m)| {
                let m = m.as_ref()?;
                let check = self.vips[m.vip].health.clone()?;
                Some((id as u32, m.addr, check))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::estimate::WEIGHT_UNITS;

    const SEC: u64 = 1_000_000_000;

    fn fleet(extra: &[&str]) -> (Fleet, VipAddr) {
        let mut argv = vec![
            "--iface",
            "eth0",
            "--vip",
            "10.0.0.100:80",
            "--backend",
            "10.0.0.21:80",
            "--backend",
            "10.0.0.22:80",
            "--backend",
            "10.0.0.23:80",
            "--backend",
            "10.0.0.24:80",
            "--outlier-consecutive",
            "3",
            "--slow-start",
            "0s",
        ];
        argv.extend_from_slice(extra);
        let config = config_of(&argv);
        let plan = Plan::new(&config);
        (
            Fleet::new(&config, &plan, Nanos(SEC)),
            "10.0.0.100:80".parse().unwrap(),
        )
    }

    /// The configuration of the flags `argv`.
    fn config_of(argv: &[&str]) -> Config {
        Config::of(argv, "")
    }

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    /// VIP 10.0.0.100:80 with the one backend 10.0.0.21:80.
    fn one_backend_config() -> Config {
        config_of(&[
            "--iface",
            "eth0",
            "--vip",
            "10.0.0.100:80",
            "--backend",
            "10.0.0.21:80",
        ])
    }

    /// A gone VIP's id stays taken while its backends' flows go on: a new
    /// VIP (configured or added at runtime) under that id would take the
    /// gone VIP's backends for its own (status, metrics, a second restart's
    /// plan).
    #[test]
    fn a_gone_vips_id_is_not_given_to_a_new_vip_while_its_flows_go_on() {
        let config = one_backend_config();
        // The previous instance served only a VIP now gone, id 0, whose
        // backend (id 0) still has flows.
        let gone = crate::kernel::wire::backend_entry(
            addr("10.0.0.31:80"),
            0,
            1,
            lb_common::BACKEND_DRAINING,
        );
        let previous = crate::pool::plan::Previous {
            vips: Vec::new(),
            backends: vec![(0, gone)],
        };
        let plan = crate::pool::plan::Plan::adopting(&config, &previous);
        assert_eq!(plan.orphaned, [0]);
        assert_ne!(
            plan.vips[0].meta.vip_id, 0,
            "the new VIP took the gone VIP's id"
        );
        let now = Nanos(SEC);
        let mut f = Fleet::new(&config, &plan, now);
        assert_ne!(f.free_vip_id(), Some(0), "a runtime VIP would take it");
        // Once a scan frees the backend, its VIP's id is free too.
        assert_eq!(f.free_drained(&[0, 0], 1, 0), [0]);
        assert_eq!(f.free_vip_id(), Some(0));
    }

    /// A restart after the VIP of backend id 1 was gone (removed at
    /// runtime while its flows drained): the flows go on, so id 1 is not
    /// handed to a new backend until a scan finds none left on it.
    #[test]
    fn a_gone_vips_backend_id_stays_reserved_until_its_flows_end() {
        let (first, vip) = fleet(&[]);
        let config = one_backend_config();
        // What the previous instance left: its VIP, backends 0 (.21, still
        // configured) and 1 of another VIP (id 9), which VIPS no longer has.
        let gone = crate::kernel::wire::backend_entry(
            addr("10.0.0.99:80"),
            9,
            1,
            lb_common::BACKEND_DRAINING,
        );
        let plan = crate::pool::plan::Plan::adopting(
            &config,
            &crate::pool::plan::Previous {
                vips: vec![(
                    crate::pool::plan::vip_key(&config.vips[0]),
                    first.vips[0].meta.vip_id,
                    None,
                )],
                backends: vec![
                    (
                        0,
                        crate::kernel::wire::backend_entry(
                            addr("10.0.0.21:80"),
                            first.vips[0].meta.vip_id,
                            1,
                            lb_common::BACKEND_ACTIVE,
                        ),
                    ),
                    (1, gone),
                ],
            },
        );
        assert_eq!(plan.orphaned, [1]);
        // Written back draining and in use, so a second restart (reading
        // what this one wrote) reserves it again.
        assert_eq!(plan.backends[1].in_use, 1);
        assert_eq!(plan.backends[1].state, lb_common::BACKEND_DRAINING);
        let again = crate::pool::plan::Plan::adopting(
            &config,
            &crate::pool::plan::Previous {
                vips: vec![(
                    crate::pool::plan::vip_key(&config.vips[0]),
                    plan.vips[0].meta.vip_id,
                    None,
                )],
                backends: (0..plan.backends.len() as u32)
                    .map(|id| (id, plan.backends[id as usize]))
                    .filter(|(_, b)| b.in_use != 0)
                    .collect(),
            },
        );
        assert_eq!(
            again.orphaned,
            [1],
            "the second restart lost the reservation"
        );
        let now = Nanos(SEC);
        let mut f = Fleet::new(&config, &plan, now);
        assert_eq!(f.id_limit(), 2, "the scans cover the reserved id");
        let new = "10.0.0.22:80".parse::<BackendAddr>().unwrap();
        assert_eq!(f.add(&vip, new, now), Ok(2), "id 1 still has flows");
        // Its flows hold it in one scan, and are gone in the next.
        assert_eq!(f.free_drained(&[1, 4, 1], 1, 0), Vec::<u32>::new());
        assert_eq!(f.free_drained(&[1, 0, 1], 2, 0), [1]);
        let newer = "10.0.0.23:80".parse::<BackendAddr>().unwrap();
        assert_eq!(f.add(&vip, newer, now), Ok(1));
    }

    /// Four backends: .21 and .23 in zone b, .22 and .24 in zone a (the
    /// balancer's), so grouping by zone must reorder the slots.
    fn zoned_fleet() -> Fleet {
        zoned_fleet_with(&[])
    }

    fn zoned_fleet_with(extra: &[&str]) -> Fleet {
        let mut argv = vec![
            "--iface",
            "eth0",
            "--zone",
            "a",
            "--vip",
            "10.0.0.100:80",
            "--backend",
            "10.0.0.21:80,zone=b",
            "--backend",
            "10.0.0.22:80,zone=a",
            "--backend",
            "10.0.0.23:80,zone=b",
            "--backend",
            "10.0.0.24:80,zone=a",
            "--slow-start",
            "0s",
        ];
        argv.extend_from_slice(extra);
        let config = config_of(&argv);
        Fleet::new(&config, &Plan::new(&config), Nanos(SEC))
    }

    /// A zone-aware VIP whose backends all fail their checks is in the
    /// zone panic every tick: that is no planning bug (no warning a tick),
    /// and every backend serves.
    #[test]
    fn the_zone_panic_serves_every_backend_without_a_planning_warning() {
        let mut f = zoned_fleet_with(&["--health-check", "tcp", "--health-fall", "1"]);
        let now = Nanos(2 * SEC);
        for id in 0..4 {
            f.health_result(id, false, now);
        }
        let mut s = f.selection(0, now);
        let plan = f.zone_plan(0, &s, now, |_| Some(1_000_000)).unwrap();
        assert_eq!(plan.spill, Spill::Panic);
        assert!(
            s.group_by_zone(&plan),
            "the panic read as an uncovered plan"
        );
        assert_eq!(s.slots, [0, 1, 2, 3]);
        assert!(s.zone_blocks.is_empty());
    }

    /// Raising the local zone's weights under weight smoothing adds
    /// capacity there: it must not read as a less healthy zone that
    /// spills its traffic out while the weights move.
    #[test]
    fn a_raised_weight_under_smoothing_keeps_the_zone_local() {
        let mut f = zoned_fleet_with(&["--weight-smoothing", "30s"]);
        let vip: VipAddr = "10.0.0.100:80".parse().unwrap();
        let now = Nanos(2 * SEC);
        for b in ["10.0.0.22:80", "10.0.0.24:80"] {
            f.set_weight(&vip, addr(b), 4, now).unwrap();
        }
        for t in [now, Nanos(12 * SEC), Nanos(40 * SEC)] {
            let s = f.selection(0, t);
            let plan = f.zone_plan(0, &s, t, |_| Some(1_000_000)).unwrap();
            assert_eq!(plan.spill, Spill::Local, "at {t:?}: {plan:?}");
        }
    }

    #[test]
    fn a_zone_aware_vip_groups_its_slots_by_zone_local_first() {
        let mut f = zoned_fleet();
        let now = Nanos(2 * SEC);
        let mut s = f.selection(0, now);
        assert_eq!(s.slots, [0, 1, 2, 3]);
        let plan = f.zone_plan(0, &s, now, |_| Some(1_000_000)).unwrap();
        assert_eq!(plan.spill, Spill::Local);
        assert!(s.group_by_zone(&plan));
        assert_eq!(s.slots, [1, 3, 0, 2]);
        assert_eq!(s.zone_blocks, [2, 2]);
        assert_eq!(s.weights.len(), 4);
        // One of zone a's two down: 50% < 70%, so zone a keeps 50/70.
        f.health_result(1, false, now);
        f.health_result(1, false, now);
        f.health_result(1, false, now);
        let s = f.selection(0, now);
        let plan = f.zone_plan(0, &s, now, |_| Some(1_000_000)).unwrap();
        assert_eq!(plan.spill, Spill::Spilling, "{plan:?}");
        assert_eq!(plan.blocks[0].slots, [3]);
        // Not zone-aware without the balancer's zone.
        let (plain, _) = fleet(&[]);
        let s = Selection {
            slots: vec![0, 1],
            weights: vec![100, 100],
            states: Vec::new(),
            zone_blocks: Vec::new(),
        };
        assert!(plain.zone_plan(0, &s, Nanos(2 * SEC), |_| None).is_none());
    }

    /// `times` refusals by backend `id`, judged by a tick in which no
    /// backend answered.
    fn refuse(f: &mut Fleet, id: u32, times: u32, now: Nanos) {
        for _ in 0..times {
            f.on_event(Event::Refused { backend: id }, now);
        }
        f.judge_outliers(&[], |_| None, now);
    }

    #[test]
    fn consecutive_refusals_eject_until_the_cap() {
        let (mut f, _) = fleet(&[]);
        let now = Nanos(2 * SEC);
        refuse(&mut f, 0, 3, now);
        assert_eq!(f.selection(0, now).slots, [1, 2, 3]);
        refuse(&mut f, 1, 3, now);
        assert_eq!(f.selection(0, now).slots, [2, 3]);
        // 50% of 4 is 2: the third outlier stays in.
        refuse(&mut f, 2, 3, now);
        assert_eq!(f.selection(0, now).slots, [2, 3]);
        // After the base ejection time (30s) the first two return.
        let later = Nanos(33 * SEC);
        f.tick(later, |_| None);
        assert_eq!(f.selection(0, later).slots, [0, 1, 2, 3]);
    }

    /// Latency outliers are judged among the backends users measured
    /// lately: one not measured (`None`: its estimate is the cold-start
    /// guess) is neither ejected nor part of the median. Before, the
    /// guesses were medians too: the first backend to answer at light load
    /// (5 ms among three 1 ms guesses) was ejected for its real latency.
    #[test]
    fn latency_outliers_are_judged_among_backends_users_measured() {
        let (mut f, _) = fleet(&["--outlier-latency-factor", "3"]);
        let now = Nanos(2 * SEC);
        // Backend 0 measured at 5 ms, the others never: nothing to judge.
        f.tick(now, |id| (id == 0).then_some(5_000_000));
        assert_eq!(f.selection(0, now).slots, [0, 1, 2, 3]);
        // Three measured at 5 ms and one at 20 ms: that one goes; the
        // unmeasured one stays.
        let measured = [Some(5_000_000), Some(5_000_000), Some(20_000_000), None];
        f.tick(now, |id| measured[id as usize]);
        assert_eq!(f.selection(0, now).slots, [0, 1, 3]);
    }

    #[test]
    fn drained_and_down_backends_leave_the_slots_and_panic_serves_all() {
        let (mut f, vip) = fleet(&["--health-check", "tcp", "--health-fall", "1"]);
        let now = Nanos(2 * SEC);
        f.set_admin(&vip, addr("10.0.0.21:80"), Admin::Draining, now)
            .unwrap();
        let s = f.selection(0, now);
        assert_eq!(s.slots, [1, 2, 3]);
        assert!(s.states.contains(&(0, lb_common::BACKEND_DRAINING)));
        for id in 1..4 {
            f.health_result(id, false, now);
        }
        // Every active backend is down: serve them anyway, not the drained one.
        let s = f.selection(0, now);
        assert_eq!(s.slots, [1, 2, 3]);
        assert!(f.vips[0].panic);
        f.health_result(2, true, now);
        f.health_result(2, true, now);
        assert_eq!(f.selection(0, now).slots, [2]);
    }

    /// Answers of backends the checks fail are not latency, but in a
    /// panic, where they serve everyone, they are.
    #[test]
    fn down_backends_latency_is_taken_only_while_the_panic_serves_them() {
        let (mut f, _) = fleet(&["--health-check", "tcp", "--health-fall", "1"]);
        let now = Nanos(2 * SEC);
        let slow = Duration::from_secs(2);
        f.health_result(0, false, now);
        f.selection(0, now);
        assert!(!f.measures_latency(0, slow, now));
        assert!(f.measures_latency(1, slow, now));
        for id in 1..4 {
            f.health_result(id, false, now);
        }
        f.selection(0, now);
        assert!(f.vips[0].panic);
        for id in 0..4 {
            assert!(f.measures_latency(id, slow, now), "backend {id}");
        }
        // Unknown ids: as before the rule.
        assert!(f.measures_latency(99, slow, now));
    }

    /// Two backends down by their checks, and the two left overloaded into
    /// refusals: the cap counts the down ones, so the last backend the
    /// checks pass stays in, and no panic sends flows to the down ones.
    #[test]
    fn the_cap_counts_down_backends_and_keeps_the_last_passing_one() {
        let (mut f, _) = fleet(&["--health-check", "tcp", "--health-fall", "1"]);
        let now = Nanos(2 * SEC);
        f.health_result(0, false, now);
        f.health_result(1, false, now);
        refuse(&mut f, 2, 3, now);
        refuse(&mut f, 3, 3, now);
        let s = f.selection(0, now);
        assert_eq!(s.slots, [2, 3]);
        assert!(!f.vips[0].panic);
        // Were one of them ejected anyway (an older instance's state), the
        // panic serves the ejected one, which passes its checks, not the
        // down ones.
        let params = f.vips[0].params;
        f.member_mut(2).unwrap().life.eject(now, &params, "test");
        f.member_mut(3).unwrap().life.eject(now, &params, "test");
        let s = f.selection(0, now);
        assert!(f.vips[0].panic);
        assert_eq!(s.slots, [2, 3]);
    }

    /// Refusals that arrive while a backend is ejected (SYN timeouts of
    /// flows sent before) are not held against it when it returns.
    #[test]
    fn failures_while_out_of_service_are_not_evidence_on_return() {
        let (mut f, _) = fleet(&["--health-check", "tcp", "--health-fall", "1"]);
        let t = Nanos(2 * SEC);
        refuse(&mut f, 0, 3, t);
        assert_eq!(f.selection(0, t).slots, [1, 2, 3]);
        refuse(&mut f, 0, 5, Nanos(3 * SEC));
        let back = Nanos(33 * SEC);
        f.tick(back, |_| None);
        assert_eq!(f.selection(0, back).slots, [0, 1, 2, 3]);
        f.on_event(Event::Refused { backend: 0 }, back);
        assert!(!f.judge_outliers(&[], |_| None, back));
        assert_eq!(f.selection(0, back).slots, [0, 1, 2, 3]);
        // The same after failed checks: down, refused, up again.
        f.health_result(1, false, back);
        refuse(&mut f, 1, 5, back);
        f.health_result(1, true, back);
        f.health_result(1, true, back);
        f.on_event(Event::Refused { backend: 1 }, back);
        assert!(!f.judge_outliers(&[], |_| None, back));
        assert_eq!(f.selection(0, back).slots, [0, 1, 2, 3]);
        // Counted all the same.
        assert_eq!(f.member(0).unwrap().outlier.failures_total, 9);
    }

    /// An undrained backend returns clean: a run of failures from before
    /// its drain does not carry over into the first failure after it.
    #[test]
    fn an_undrained_backend_returns_with_no_run_of_failures() {
        let (mut f, _) = fleet(&[]);
        let t = Nanos(2 * SEC);
        let vip: VipAddr = f.vips[0].addr;
        let addr = f.member(0).unwrap().addr;
        refuse(&mut f, 0, 2, t);
        f.set_admin(&vip, addr, Admin::Draining, t).unwrap();
        f.set_admin(&vip, addr, Admin::Active, t).unwrap();
        refuse(&mut f, 0, 1, t);
        assert_eq!(f.selection(0, t).slots, [0, 1, 2, 3]);
        // Two more make a run of three: ejected.
        refuse(&mut f, 0, 2, t);
        assert_eq!(f.selection(0, t).slots, [1, 2, 3]);
    }

    /// The ejection count falls per base time in service: time down does
    /// not count, so a backend the checks also flap keeps its history.
    #[test]
    fn the_ejection_count_does_not_fall_while_down() {
        let (mut f, _) = fleet(&["--health-check", "tcp", "--health-fall", "1"]);
        let t = Nanos(2 * SEC);
        refuse(&mut f, 0, 3, t);
        let back = Nanos(33 * SEC);
        f.tick(back, |_| None);
        f.health_result(0, false, back);
        // 100 s down: three base times, none in service.
        let up = Nanos(133 * SEC);
        f.tick(up, |_| None);
        assert_eq!(f.member(0).unwrap().life.ejections(), 1);
        f.health_result(0, true, up);
        f.health_result(0, true, up);
        f.tick(Nanos(164 * SEC), |_| None);
        assert_eq!(f.member(0).unwrap().life.ejections(), 0);
    }

    /// The operator cannot remove a VIP's last backend or the last VIP:
    /// the state file would bring them back at the next restart.
    #[test]
    fn the_last_backend_and_the_last_vip_are_not_removed() {
        let (mut f, vip) = fleet(&[]);
        let now = Nanos(2 * SEC);
        for b in ["10.0.0.21:80", "10.0.0.22:80", "10.0.0.23:80"] {
            f.check_not_last(&vip, addr(b)).unwrap();
            f.set_admin(&vip, addr(b), Admin::Removed, now).unwrap();
        }
        // Drained, not removed: it still counts as the VIP's.
        f.set_admin(&vip, addr("10.0.0.24:80"), Admin::Draining, now)
            .unwrap();
        let e = f.check_not_last(&vip, addr("10.0.0.24:80")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "backend 10.0.0.24:80 is the last of VIP 10.0.0.100:80/tcp, which needs one: add another first, or remove the VIP"
        );
        // One already removed may be removed again (a no-op).
        f.check_not_last(&vip, addr("10.0.0.21:80")).unwrap();
        let e = f.check_not_last_vip(&vip).unwrap_err();
        assert!(e.to_string().contains("is the last one served"), "{e}");
    }

    /// A pass that started before the event loop saw a backend removed
    /// may have read its counters before the backend took its flows (it
    /// may have been added after that read): its zero frees nothing.
    #[test]
    fn only_a_pass_started_after_a_removal_frees_its_id() {
        let (mut f, vip) = fleet(&[]);
        let now = Nanos(2 * SEC);
        let added = f.add(&vip, "10.0.0.25:80".parse().unwrap(), now).unwrap();
        f.set_admin(&vip, addr("10.0.0.25:80"), Admin::Removed, now)
            .unwrap();
        // Passes 1..=7 had started when the removal was first seen; pass 7
        // read its counters before the backend was even there.
        assert_eq!(f.free_drained(&[0; 4], 7, 7), Vec::<u32>::new());
        assert_eq!(f.free_drained(&[0; 5], 7, 8), Vec::<u32>::new());
        // Pass 8 read them afterwards: its count decides.
        assert_eq!(f.free_drained(&[0, 0, 0, 0, 2], 8, 8), Vec::<u32>::new());
        assert_eq!(f.free_drained(&[0; 5], 9, 9), [added]);
        // Brought back and removed again: a new mark.
        let again = f.add(&vip, "10.0.0.25:80".parse().unwrap(), now).unwrap();
        f.set_admin(&vip, addr("10.0.0.25:80"), Admin::Removed, now)
            .unwrap();
        assert_eq!(f.free_drained(&[0; 5], 12, 12), Vec::<u32>::new());
        assert_eq!(f.free_drained(&[0; 5], 13, 13), [again]);
    }

    #[test]
    fn a_removed_backend_cannot_be_re_weighted() {
        let (mut f, vip) = fleet(&[]);
        let now = Nanos(2 * SEC);
        let b = addr("10.0.0.21:80");
        assert_eq!(f.check_not_removed(&vip, b), Ok(()));
        f.set_admin(&vip, b, Admin::Removed, now).unwrap();
        assert_eq!(
            f.check_not_removed(&vip, b),
            Err(FleetError::NoBackend {
                vip: vip.to_string(),
                backend: b.to_string()
            })
        );
        assert!(f.check_not_removed(&vip, addr("10.9.9.9:1")).is_err());
    }

    #[test]
    fn removed_ids_are_kept_until_their_flows_end() {
        let (mut f, vip) = fleet(&[]);
        let now = Nanos(2 * SEC);
        f.set_admin(&vip, addr("10.0.0.21:80"), Admin::Removed, now)
            .unwrap();
        assert_eq!(f.selection(0, now).slots, [1, 2, 3]);
        let new = f.add(&vip, "10.0.0.25:80@2".parse().unwrap(), now).unwrap();
        assert_eq!(new, 4, "id 0 still has flows, so it is not reused");
        assert_eq!(f.free_drained(&[3, 0, 0, 0, 0], 1, 0), Vec::<u32>::new());
        assert_eq!(f.free_drained(&[0, 0, 0, 0, 0], 2, 0), [0]);
        assert_eq!(
            f.add(&vip, "10.0.0.26:80".parse().unwrap(), now).unwrap(),
            0
        );
        assert_eq!(
            f.add(&vip, "10.0.0.26:80".parse().unwrap(), now),
            Err(FleetError::Exists {
                vip: vip.to_string(),
                backend: "10.0.0.26:80".into()
            })
        );
        assert!(matches!(
            f.set_admin(&vip, addr("10.9.9.9:1"), Admin::Draining, now),
            Err(FleetError::NoBackend { .. })
        ));
    }

    #[test]
    fn reload_adds_removes_and_reweights() {
        let (mut f, _) = fleet(&[]);
        let argv = [
            "--iface",
            "eth0",
            "--vip",
            "10.0.0.100:80",
            "--backend",
            "10.0.0.21:80@3",
            "--backend",
            "10.0.0.22:80",
            "--backend",
            "10.0.0.30:80",
            "--weight-smoothing",
            "0s",
        ];
        let config = config_of(&argv);
        let now = Nanos(2 * SEC);
        assert!(f.reload(&config, now).0.is_empty());
        let s = f.selection(0, now + Duration::from_secs(20));
        assert_eq!(s.slots, [0, 1, 4]);
        assert_eq!(s.weights[0], 300);
    }

    fn vip_config(vip: &str, backends: &[&str]) -> Config {
        let mut argv = vec!["--iface", "eth0", "--vip", vip];
        for b in backends {
            argv.extend(["--backend", b]);
        }
        config_of(&argv)
    }

    #[test]
    fn vip_ids_come_from_a_free_list_and_a_removed_vip_is_reused_only_once_drained() {
        let (mut f, vip0) = fleet(&[]);
        let now = Nanos(2 * SEC);
        let params = f.vips[0].params;
        let b = vip_config("10.0.0.101:80", &["10.0.0.31:80", "10.0.0.32:80"]);
        let (id_b, ids_b) = f.add_vip(&b.vips[0], params, now).unwrap();
        assert_eq!((id_b, ids_b.clone()), (1, vec![4, 5]));
        assert_eq!(
            f.add_vip(&b.vips[0], params, now),
            Err(FleetError::VipExists("10.0.0.101:80/tcp".into()))
        );
        // Removing VIP 0 keeps its id and its backends' ids while they drain.
        assert_eq!(f.remove_vip(&vip0, now), Ok(0));
        let s = f.selection(0, now);
        assert!(s.slots.is_empty(), "a removed VIP selects nothing");
        assert!(
            s.states.iter().all(|&(_, st)| st != BACKEND_ACTIVE),
            "{s:?}"
        );
        assert_eq!(f.vip_index(&vip0), Err(FleetError::NoVip(vip0.to_string())));
        let again = vip_config("10.0.0.100:80", &["10.0.0.21:80"]);
        assert_eq!(
            f.add_vip(&again.vips[0], params, now),
            Err(FleetError::VipDraining("10.0.0.100:80/tcp".into()))
        );
        let c = vip_config("10.0.0.102:80", &["10.0.0.41:80"]);
        let (id_c, ids_c) = f.add_vip(&c.vips[0], params, now).unwrap();
        assert_eq!((id_c, ids_c), (2, vec![6]), "id 0 still drains");
        // Backend 1 of VIP 0 still has a flow: nothing of VIP 0 is freed.
        let mut live = vec![0u64; 8];
        live[1] = 1;
        assert_eq!(f.free_drained(&live, 1, 0), vec![0, 2, 3]);
        assert!(f.free_drained_vips().is_empty());
        assert_eq!(f.free_vip_id(), Some(3));
        // Its last flow ends: the VIP is dropped, members renumbered.
        assert_eq!(f.free_drained(&[0; 8], 2, 0), vec![1]);
        assert_eq!(f.free_drained_vips(), vec![(0, 0)]);
        assert_eq!(f.free_vip_id(), Some(0));
        assert_eq!(f.member(4).unwrap().vip, 0);
        assert_eq!(f.vips[f.member(6).unwrap().vip].addr, c.vips[0].vip);
        let (id_d, ids_d) = f.add_vip(&again.vips[0], params, now).unwrap();
        assert_eq!((id_d, ids_d), (0, vec![0]));
    }

    /// A file that replaces more backends than the VIP has room for while
    /// the old ones drain keeps as many old ones in service as new ones
    /// were refused: the VIP never shrinks below what the file asks for.
    #[test]
    fn a_reload_that_replaces_too_many_backends_keeps_the_vips_capacity() {
        let addrs = |net: u32| -> Vec<String> {
            (0..600)
                .map(|i| format!("10.{net}.{}.{}:80", i / 250, i % 250 + 1))
                .collect()
        };
        let config = |net: u32| {
            let list = addrs(net);
            let refs: Vec<&str> = list.iter().map(String::as_str).collect();
            vip_config("10.0.0.100:80", &refs)
        };
        let first = config(1);
        let mut f = Fleet::new(&first, &Plan::new(&first), Nanos(SEC));
        let now = Nanos(2 * SEC);
        let (notes, added) = f.reload(&config(2), now);
        // 1,024 places: 600 held by the old ones, 424 for the new.
        assert_eq!(added.len(), 424);
        assert!(
            notes
                .iter()
                .any(|n| n.contains("176 backend(s) the file no longer lists stay")),
            "{notes:?}"
        );
        let serving = |f: &Fleet| {
            f.vips[0]
                .members
                .iter()
                .filter_map(|&id| f.member(id))
                .filter(|m| m.life.admin() != Admin::Removed)
                .count()
        };
        assert_eq!(serving(&f), 600);
        // Once the removed ones drained, the next reload places the rest.
        let live = vec![0u64; f.members.len()];
        assert_eq!(f.free_drained(&live, 1, 0).len(), 424);
        let (notes, added) = f.reload(&config(2), Nanos(3 * SEC));
        assert!(notes.is_empty(), "{notes:?}");
        assert_eq!(added.len(), 176);
        assert_eq!(serving(&f), 600);
        let old = addrs(1);
        assert!(
            f.vips[0]
                .members
                .iter()
                .filter_map(|&id| f.member(id))
                .filter(|m| m.life.admin() != Admin::Removed)
                .all(|m| !old.contains(&m.addr.to_string())),
            "only the file's backends serve"
        );
    }

    /// Eight Maglev VIPs take every table. A SIGHUP that moves one to
    /// another port removes the old VIP (it drains) and adds the new one
    /// in its place: the old VIP's table is not read once it leaves VIPS,
    /// so it does not count (the writer hands it on after its grace).
    #[test]
    fn a_reload_moves_a_maglev_vip_while_every_table_is_taken() {
        let file = |last_port: u16| {
            let vips: Vec<String> = (0..MAX_MAGLEV_TABLES as u16)
                .map(|i| {
                    let port = if i == 7 { last_port } else { 80 + i };
                    format!(
                        "[[vip]]\naddress = \"10.0.0.100:{port}\"\nalgorithm = \"maglev\"\n\
                         backends = [\"10.0.0.21:80\"]\n"
                    )
                })
                .collect();
            Config::of(&["--iface", "eth0"], &vips.join("\n"))
        };
        let first = file(87);
        let mut f = Fleet::new(&first, &Plan::new(&first), Nanos(SEC));
        let tables = |f: &Fleet| -> Vec<u32> {
            f.vips
                .iter()
                .filter(|v| !v.removed)
                .filter_map(|v| v.maglev_table)
                .collect()
        };
        assert_eq!(tables(&f).len(), MAX_MAGLEV_TABLES as usize);
        let moved = file(8080);
        let (notes, added) = f.reload(&moved, Nanos(2 * SEC));
        assert!(notes.is_empty(), "{notes:?}");
        assert_eq!(added.len(), 1);
        let old: VipAddr = "10.0.0.100:87".parse().unwrap();
        let new: VipAddr = "10.0.0.100:8080".parse().unwrap();
        assert!(f.vip_index(&old).is_err(), "the old VIP drains");
        let index = f.vip_index(&new).unwrap();
        let old_table = f.vips.iter().find(|v| v.addr == old).unwrap().maglev_table;
        assert_eq!(f.vips[index].maglev_table, old_table);
        let mut serving = tables(&f);
        serving.sort_unstable();
        assert_eq!(serving, (0..MAX_MAGLEV_TABLES).collect::<Vec<_>>());
        // A ninth Maglev VIP still finds none.
        let ninth = Config::of(
            &["--iface", "eth0"],
            "[[vip]]\naddress = \"10.0.0.101:80\"\nalgorithm = \"maglev\"\n\
             backends = [\"10.0.0.21:80\"]\n",
        );
        let params = f.vips[0].params;
        assert_eq!(
            f.add_vip(&ninth.vips[0], params, Nanos(3 * SEC)),
            Err(FleetError::MaglevFull)
        );
    }

    #[test]
    fn reload_adds_and_removes_whole_vips() {
        let (mut f, vip0) = fleet(&[]);
        let now = Nanos(2 * SEC);
        let config = vip_config("10.0.0.101:80", &["10.0.0.31:80", "10.0.0.32:80"]);
        let (notes, added) = f.reload(&config, now);
        assert!(notes.is_empty(), "{notes:?}");
        assert_eq!(added, [4, 5]);
        assert!(f.vips[0].removed && f.vips[0].addr == vip0);
        let index = f.vip_index(&config.vips[0].vip).unwrap();
        assert_eq!(f.vips[index].meta.vip_id, 1);
        // A full id space refuses the VIP and changes nothing.
        let many: Vec<String> = (0..MAX_BACKENDS_PER_VIP)
            .map(|i| format!("10.1.{}.{}:80", i / 250, i % 250 + 1))
            .collect();
        let refs: Vec<&str> = many.iter().map(String::as_str).collect();
        let mut big = vip_config("10.0.0.101:80", &["10.0.0.31:80", "10.0.0.32:80"]);
        big.vips.extend(vip_config("10.0.0.103:80", &refs).vips);
        let vips = f.vips.len();
        f.members.resize(MAX_BACKENDS as usize - 10, None);
        for m in f.members.iter_mut().skip(6) {
            *m = Some(Member {
                addr: "10.9.9.9:1".parse().unwrap(),
                vip: 0,
                zone: None,
                life: Lifecycle::new(0, 1, now),
                outlier: Detector::default(),
            });
        }
        let (notes, added) = f.reload(&big, now);
        assert!(added.is_empty());
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(notes[0].contains("no free backend id"), "{notes:?}");
        assert_eq!(f.vips.len(), vips);
    }

    impl std::ops::Add<Duration> for Nanos {
        type Output = Nanos;
        fn add(self, d: Duration) -> Nanos {
            Nanos(self.0 + d.as_nanos() as u64)
        }
    }

    #[test]
    fn table_weights_ramp_in_coarse_steps() {
        let full = 3 * WEIGHT_UNITS;
        // Every effective weight of a ramp lands on one of ten steps.
        let steps: std::collections::BTreeSet<u32> =
            (1..=full).map(|w| coarse_weight(w, full)).collect();
        assert_eq!(steps.len(), TABLE_RAMP_STEPS as usize);
        assert_eq!(coarse_weight(full, full), full);
        assert_eq!(coarse_weight(1, full), full / 10);
        assert_eq!(coarse_weight(150, full), 150);
        assert_eq!(coarse_weight(1, 1), 1);
        assert!(table_based(Algorithm::Maglev as u8));
        assert!(!table_based(Algorithm::P2cEwma as u8));
    }

    /// The distinct weights backend 0 (weight `from`, then set to `to`)
    /// shows a VIP of `algorithm` over a 10 s smoothing, at 50 ms ticks.
    fn weights_over_a_smoothing(algorithm: &str, from: u32, to: u32) -> Vec<u32> {
        let (mut f, vip) = fleet(&["--algorithm", algorithm, "--weight-smoothing", "10s"]);
        // The first change's smoothing is over by `start`.
        let start = Nanos(12 * SEC);
        if from != 1 {
            f.set_weight(&vip, addr("10.0.0.21:80"), from, Nanos(SEC))
                .unwrap();
        }
        f.set_weight(&vip, addr("10.0.0.21:80"), to, start).unwrap();
        let mut seen: Vec<u32> = (0..=220)
            .map(|tick| {
                f.selection(0, start + Duration::from_millis(50 * tick))
                    .weights[0]
            })
            .collect();
        seen.dedup();
        seen
    }

    #[test]
    fn a_lowered_weight_moves_a_table_in_as_few_steps_as_a_raised_one() {
        // Maglev rebuilds its 65,537-entry table for every distinct weight.
        let down = weights_over_a_smoothing("maglev", 100, 1);
        assert!(down.len() <= TABLE_RAMP_STEPS as usize + 2, "{down:?}");
        assert_eq!(down.last(), Some(&WEIGHT_UNITS), "ends at weight 1");
        let up = weights_over_a_smoothing("maglev", 1, 100);
        assert!(up.len() <= TABLE_RAMP_STEPS as usize + 2, "{up:?}");
        assert_eq!(up.last(), Some(&(100 * WEIGHT_UNITS)));
        // P2C reads the exact weight, through its score.
        let exact = weights_over_a_smoothing("p2c-ewma", 100, 1);
        assert!(exact.len() > 100, "{}", exact.len());
        assert_eq!(exact.last(), Some(&WEIGHT_UNITS));
    }

    #[test]
    fn a_ramp_on_a_p2c_vip_leaves_its_kernel_selection_as_it_was() {
        let config = config_of(&[
            "--iface",
            "eth0",
            "--vip",
            "10.0.0.100:80",
            "--backend",
            "10.0.0.21:80",
            "--backend",
            "10.0.0.22:80",
            "--slow-start",
            "10s",
        ]);
        let mut f = Fleet::new(&config, &Plan::new(&config), Nanos(SEC));
        let vip: VipAddr = "10.0.0.100:80".parse().unwrap();
        let now = Nanos(2 * SEC);
        let id = f.add(&vip, "10.0.0.25:80".parse().unwrap(), now).unwrap();
        let p2c = Algorithm::P2cEwma as u8;
        let first = f.selection(0, now);
        let later = f.selection(0, now + Duration::from_secs(8));
        let slot = first.slots.iter().position(|&s| s == id).unwrap();
        assert_ne!(first.weights[slot], later.weights[slot], "it ramps");
        assert!(later.same_in_kernel(&first, p2c), "P2C's tables ignore it");
        let maglev = Algorithm::Maglev as u8;
        assert!(!later.same_in_kernel(&first, maglev));
        // A change of slots or states is a change under every algorithm.
        let mut fewer = later.clone();
        fewer.slots.pop();
        assert!(!fewer.same_in_kernel(&first, p2c));
        let mut state = later.clone();
        state.states[0].1 = lb_common::BACKEND_DRAINING;
        assert!(!state.same_in_kernel(&first, p2c));
    }
}
