//! Typed access to the pinned maps, and writing a [`Plan`] into them.

use std::{collections::HashSet, path::Path};

use anyhow::{Context as _, anyhow};
use aya::maps::{Array, HashMap, Map, MapData, PerCpuArray, RingBuf};
use lb_common::{
    BACKEND_CONNS_MAP, BACKEND_CORRECTION_MAP, BACKEND_SCORES_MAP, BACKEND_STATS_MAP, BACKENDS_MAP,
    Backend, BackendConns, BackendScore, BackendStats, CONFIG_MAP, EVENTS_MAP, FLOWS_MAP,
    FlowEntry, FlowKey, IpKey, LbConfig, MAX_BACKENDS, NEIGHBOURS_MAP, NEW_FLOW_LIMIT_MAP,
    Neighbour, NewFlowLimit, REASON_STATS_MAP, VIP_BACKENDS_MAP, VIPS_MAP, VipKey, VipMeta,
};
use lb_common::{MAGLEV_MAP, VIP_SCHEDULE_MAP, VIP_TABLES_MAP, VIP_WEIGHT_PREFIX_MAP, VipTables};
use tracing::debug;

use crate::plan::Plan;

/// Opens a pinned map as the typed handle `T`.
pub fn open<T>(pin_dir: &Path, name: &str) -> anyhow::Result<T>
where
    T: TryFrom<Map, Error = aya::maps::MapError>,
{
    let path = pin_dir.join(name);
    let data = MapData::from_pin(&path).with_context(|| format!("opening {}", path.display()))?;
    let map = Map::from_map_data(data).with_context(|| format!("map {name}"))?;
    T::try_from(map).with_context(|| format!("map {name} has an unexpected type or layout"))
}

pub type Vips = HashMap<MapData, VipKey, VipMeta>;
pub type VipBackends = Array<MapData, u32>;
pub type Backends = Array<MapData, Backend>;
pub type Scores = Array<MapData, BackendScore>;
pub type Conns = Array<MapData, BackendConns>;
pub type Corrections = Array<MapData, u64>;
pub type Stats = PerCpuArray<MapData, BackendStats>;
pub type Flows = HashMap<MapData, FlowKey, FlowEntry>;
pub type Neighbours = HashMap<MapData, IpKey, Neighbour>;
pub type Configs = Array<MapData, LbConfig>;
pub type Reasons = PerCpuArray<MapData, u64>;
pub type Events = RingBuf<MapData>;
pub type VipTablesMap = Array<MapData, VipTables>;
pub type VipSchedule = Array<MapData, u32>;
pub type VipWeightPrefix = Array<MapData, u32>;
pub type Maglev = Array<MapData, u32>;
pub type NewFlowLimits = Array<MapData, NewFlowLimit>;

macro_rules! openers {
    ($($fn_name:ident -> $ty:ty = $map:expr;)+) => {
        $(
            pub fn $fn_name(pin_dir: &Path) -> anyhow::Result<$ty> {
                open(pin_dir, $map)
            }
        )+
    };
}

openers! {
    vips -> Vips = VIPS_MAP;
    vip_backends -> VipBackends = VIP_BACKENDS_MAP;
    backends -> Backends = BACKENDS_MAP;
    scores -> Scores = BACKEND_SCORES_MAP;
    conns -> Conns = BACKEND_CONNS_MAP;
    corrections -> Corrections = BACKEND_CORRECTION_MAP;
    stats -> Stats = BACKEND_STATS_MAP;
    flows -> Flows = FLOWS_MAP;
    neighbours -> Neighbours = NEIGHBOURS_MAP;
    configs -> Configs = CONFIG_MAP;
    reasons -> Reasons = REASON_STATS_MAP;
    events -> Events = EVENTS_MAP;
    vip_tables -> VipTablesMap = VIP_TABLES_MAP;
    vip_schedule -> VipSchedule = VIP_SCHEDULE_MAP;
    vip_weight_prefix -> VipWeightPrefix = VIP_WEIGHT_PREFIX_MAP;
    maglev -> Maglev = MAGLEV_MAP;
    new_flow_limits -> NewFlowLimits = NEW_FLOW_LIMIT_MAP;
}

/// Index of the single [`LbConfig`] entry.
pub const CONFIG_KEY: u32 = 0;

/// Writes the plan in an order that never shows the program a reference to
/// something unwritten: backends and their initial scores, then slot
/// blocks and their weight-derived tables, then VIPs; VIPs and backends that are no longer configured (a
/// re-adopted instance with a changed config) are removed last.
pub fn write_plan(
    pin_dir: &Path,
    plan: &Plan,
    initial_scores: &[BackendScore],
) -> anyhow::Result<()> {
    let mut backends = backends(pin_dir)?;
    let mut scores = scores(pin_dir)?;
    for (id, (backend, score)) in plan.backends.iter().zip(initial_scores).enumerate() {
        let id = id as u32;
        scores.set(id, score, 0).context("writing BACKEND_SCORES")?;
        backends.set(id, backend, 0).context("writing BACKENDS")?;
    }
    let mut slots = vip_backends(pin_dir)?;
    for vip in &plan.vips {
        for (i, backend_id) in vip.slots.iter().enumerate() {
            slots
                .set(vip.first_slot() + i as u32, backend_id, 0)
                .context("writing VIP_BACKENDS")?;
        }
    }
    let weights: Vec<u32> = plan.weights.iter().map(|w| w.get()).collect();
    for vip in &plan.vips {
        crate::tables::write_vip(pin_dir, vip, &plan.backends, &weights)?;
    }
    let mut vips = vips(pin_dir)?;
    for vip in &plan.vips {
        vips.insert(vip.key, vip.meta, 0).context("writing VIPS")?;
    }

    let wanted: HashSet<VipKey> = plan.vips.iter().map(|v| v.key).collect();
    let stale: Vec<VipKey> = vips
        .keys()
        .filter_map(Result::ok)
        .filter(|k| !wanted.contains(k))
        .collect();
    for key in stale {
        vips.remove(&key)
            .context("removing a VIP no longer configured")?;
        debug!(?key, "removed a VIP that is no longer configured");
    }
    for id in plan.backends.len() as u32..MAX_BACKENDS {
        let old = backends.get(&id, 0).context("reading BACKENDS")?;
        if old.in_use != 0 {
            backends
                .set(id, Backend::default(), 0)
                .context("clearing a backend no longer configured")?;
        }
    }
    Ok(())
}

/// Writes the global config; with [`lb_common::CONFIG_F_READY`] in `config.flags`
/// this is what lets the program start balancing, so it goes last.
pub fn write_config(pin_dir: &Path, config: &LbConfig) -> anyhow::Result<()> {
    configs(pin_dir)?
        .set(CONFIG_KEY, config, 0)
        .map_err(|e| anyhow!("writing CONFIG: {e}"))
}

/// Writes the new-flow cap: `per_second` for the whole balancer (0: none),
/// shared out over the CPUs, each of which keeps its own token bucket with
/// one second of depth.
pub fn write_new_flow_limit(pin_dir: &Path, per_second: u32, cpus: u32) -> anyhow::Result<()> {
    let rate_per_cpu = match per_second {
        0 => 0,
        n => n.div_ceil(cpus.max(1)),
    };
    new_flow_limits(pin_dir)?
        .set(
            0,
            NewFlowLimit {
                rate_per_cpu,
                burst: rate_per_cpu.max(1),
            },
            0,
        )
        .map_err(|e| anyhow!("writing NEW_FLOW_LIMIT: {e}"))
}
