//! Typed access to the pinned maps: one type per map, an opener per map,
//! the kernel's counters read as one group, and the one-shot writes of
//! startup (global config, new-flow cap).

use std::path::Path;

use anyhow::{Context as _, anyhow};
use aya::maps::{Array, HashMap, Map, MapData, PerCpuArray, RingBuf};
use lb_common::{
    BACKEND_CONNS_MAP, BACKEND_CORRECTION_MAP, BACKEND_SCORES_MAP, BACKEND_STATS_MAP, BACKENDS_MAP,
    Backend, BackendConns, BackendScore, BackendStats, CONFIG_MAP, EVENTS_MAP, FLOWS_MAP,
    FlowEntry, FlowKey, IpKey, LbConfig, NEIGHBOURS_MAP, NEW_FLOW_LIMIT_MAP, Neighbour,
    NewFlowLimit, REASON_STATS_MAP, VIP_BACKENDS_MAP, VIPS_MAP, VipKey, VipMeta,
};
use lb_common::{
    BACKEND_HANDSHAKES_MAP, BACKEND_LATENCY_MAP, BACKEND_SNAT_USED_MAP, LATENCY_EPOCH_MAP,
    LatencyAgg, MAX_SNAT_ADDRS, SNAT_ADDR_INDEX_MAP, SNAT_ADDRS_MAP, SWEEP_STATS_MAP, SnatAddr,
    SweepStats,
};
use lb_common::{BACKEND_HOPS_MAP, BackendHop, SNAT_CURSORS_MAP, VIP_ZONES_MAP, VipZones};
use lb_common::{MAGLEV_MAP, VIP_SCHEDULE_MAP, VIP_TABLES_MAP, VIP_WEIGHT_PREFIX_MAP, VipTables};

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
pub type SnatAddrs = Array<MapData, SnatAddr>;
pub type SnatAddrIndex = HashMap<MapData, IpKey, u32>;
pub type SnatUsed = Array<MapData, u64>;
pub type SweepStatsMap = Array<MapData, SweepStats>;
pub type LatencyAggs = PerCpuArray<MapData, LatencyAgg>;
pub type LatencyEpoch = Array<MapData, u64>;
pub type VipZonesMap = HashMap<MapData, u32, VipZones>;
pub type BackendHops = PerCpuArray<MapData, BackendHop>;
pub type Handshakes = PerCpuArray<MapData, u64>;

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
    snat_addrs -> SnatAddrs = SNAT_ADDRS_MAP;
    snat_addr_index -> SnatAddrIndex = SNAT_ADDR_INDEX_MAP;
    snat_used -> SnatUsed = BACKEND_SNAT_USED_MAP;
    sweep_stats -> SweepStatsMap = SWEEP_STATS_MAP;
    latency_aggs -> LatencyAggs = BACKEND_LATENCY_MAP;
    latency_epoch -> LatencyEpoch = LATENCY_EPOCH_MAP;
    vip_zones -> VipZonesMap = VIP_ZONES_MAP;
    snat_cursors -> SnatCursors = SNAT_CURSORS_MAP;
    backend_hops -> BackendHops = BACKEND_HOPS_MAP;
    handshakes -> Handshakes = BACKEND_HANDSHAKES_MAP;
}

pub type SnatCursors = PerCpuArray<MapData, u64>;

/// Starts every CPU's SNAT cursor of every backend id at a random place in
/// its slice. Called on a cold start (fresh maps): a previous instance's
/// tuples are gone from the flow table but may still sit in the backends'
/// TIME_WAIT, and cursors that all start at 0 would hand out exactly the
/// tuples it used first, whose SYNs a backend in TIME_WAIT may answer with
/// an ACK instead of a SYN-ACK (a 1 s SYN retransmit for the client).
/// Random starts make such a reuse unlikely instead of certain; a
/// re-adopted instance keeps its cursors and its quarantine.
pub fn seed_snat_cursors(pin_dir: &Path) -> anyhow::Result<()> {
    let mut cursors = snat_cursors(pin_dir)?;
    let cpus = aya::util::nr_cpus()
        .map_err(|(_, e)| e)
        .context("counting possible CPUs")?;
    for id in 0..lb_common::MAX_BACKENDS {
        let values: Vec<u64> = (0..cpus).map(|_| rand::random::<u64>()).collect();
        cursors
            .set(
                id,
                aya::maps::PerCpuValues::try_from(values).context("per-CPU values")?,
                0,
            )
            .context("writing SNAT_CURSORS")?;
    }
    Ok(())
}

/// Writes the SNAT pools (each at most [`MAX_SNAT_ADDRS`] addresses, as the
/// config validated): `SNAT_ADDRS` slots `0..` for IPv4 and
/// `MAX_SNAT_ADDRS..` for IPv6, and the address index the data path uses to
/// recognise replies to a SNAT address. Returns the pool sizes.
pub fn write_snat_pools(
    pin_dir: &Path,
    v4: &[std::net::Ipv4Addr],
    v6: &[std::net::Ipv6Addr],
) -> anyhow::Result<(u16, u16)> {
    use std::net::IpAddr;
    let mut addrs = snat_addrs(pin_dir)?;
    let mut index = snat_addr_index(pin_dir)?;
    let pools: [(u32, Vec<IpAddr>); 2] = [
        (0, v4.iter().map(|a| IpAddr::V4(*a)).collect()),
        (MAX_SNAT_ADDRS, v6.iter().map(|a| IpAddr::V6(*a)).collect()),
    ];
    for (base, pool) in &pools {
        if pool.len() > MAX_SNAT_ADDRS as usize {
            return Err(anyhow!(
                "more than {MAX_SNAT_ADDRS} SNAT addresses in one family"
            ));
        }
        for (i, ip) in pool.iter().enumerate() {
            let slot = base + i as u32;
            let (words, family) = crate::kernel::wire::ip_to_words(*ip);
            addrs
                .set(slot, SnatAddr { addr: words }, 0)
                .map_err(|e| anyhow!("writing SNAT_ADDRS: {e}"))?;
            let key = IpKey {
                addr: words,
                family,
                _pad: [0; 3],
            };
            index
                .insert(key, slot, 0)
                .map_err(|e| anyhow!("writing SNAT_ADDR_INDEX: {e}"))?;
        }
    }
    Ok((v4.len() as u16, v6.len() as u16))
}

/// The control plane's own connections to each backend (its health
/// checks), written to `BACKEND_CORRECTION` so that the kernel's in-flight
/// count, which P2C and least-connections compare, includes them: a backend
/// answering a check is as busy as one answering a user. Each backend's
/// entry has one writer (its check task), which writes absolute values.
#[derive(Clone)]
pub struct ControlConnections(std::sync::Arc<std::sync::Mutex<Corrections>>);

impl ControlConnections {
    /// Opens the map and zeroes it: a previous instance stopped in the
    /// middle of a check may have left a 1 behind.
    pub fn open(pin_dir: &Path) -> anyhow::Result<Self> {
        let mut map = corrections(pin_dir)?;
        for id in 0..map.len() {
            if map.get(&id, 0).unwrap_or_default() != 0 {
                map.set(id, 0, 0)
                    .with_context(|| format!("clearing BACKEND_CORRECTION[{id}]"))?;
            }
        }
        Ok(Self(std::sync::Arc::new(std::sync::Mutex::new(map))))
    }

    /// Backend `id` has `open` connections of the control plane now.
    pub fn set(&self, id: u32, open: u64) -> anyhow::Result<()> {
        let mut map = self
            .0
            .lock()
            .map_err(|_| anyhow!("BACKEND_CORRECTION lock poisoned"))?;
        map.set(id, open, 0)
            .with_context(|| format!("writing BACKEND_CORRECTION[{id}]"))
    }
}

/// One backend's kernel counters.
#[derive(Clone, Debug, Default)]
pub struct BackendCounters {
    pub conns: BackendConns,
    /// lb-user's own connections to the backend (health checks), added to
    /// `opened - closed`.
    pub correction: u64,
    /// Traffic counters, one per CPU.
    pub per_cpu: Vec<BackendStats>,
    /// SNAT tuples this id holds (open, lingering or in quarantine).
    pub snat_used: u64,
}

impl BackendCounters {
    /// A traffic counter summed over the CPUs.
    pub fn sum(&self, field: fn(&BackendStats) -> u64) -> u64 {
        self.per_cpu.iter().map(field).sum()
    }
}

/// The counters the kernel keeps (per backend, and per verdict reason),
/// opened once and read on every scrape.
pub struct Counters {
    conns: Conns,
    corrections: Corrections,
    stats: Stats,
    reasons: Reasons,
    snat_used: SnatUsed,
    config: Configs,
}

impl Counters {
    pub fn open(pin_dir: &Path) -> anyhow::Result<Self> {
        Ok(Self {
            conns: conns(pin_dir)?,
            corrections: corrections(pin_dir)?,
            stats: stats(pin_dir)?,
            reasons: reasons(pin_dir)?,
            snat_used: snat_used(pin_dir)?,
            config: configs(pin_dir)?,
        })
    }

    /// Backend `id`'s connections in flight as the kernel's selection
    /// counts them, lb-user's own included (0 where unreadable).
    pub fn inflight(&self, id: u32) -> u64 {
        let conns: BackendConns = self.conns.get(&id, 0).unwrap_or_default();
        conns.inflight(self.corrections.get(&id, 0).unwrap_or_default())
    }

    /// Backend `id`'s counters (zero where unreadable).
    pub fn backend(&self, id: u32) -> BackendCounters {
        BackendCounters {
            conns: self.conns.get(&id, 0).unwrap_or_default(),
            correction: self.corrections.get(&id, 0).unwrap_or_default(),
            per_cpu: self
                .stats
                .get(&id, 0)
                .map(|v| v.iter().copied().collect())
                .unwrap_or_default(),
            snat_used: self.snat_used.get(&id, 0).unwrap_or_default(),
        }
    }

    /// The global config as the data path reads it (`None` where unreadable).
    pub fn config(&self) -> Option<LbConfig> {
        self.config.get(&CONFIG_KEY, 0).ok()
    }

    /// Packets counted under verdict reason `reason`, over all CPUs.
    pub fn reason_total(&self, reason: u32) -> u64 {
        self.reasons
            .get(&reason, 0)
            .map(|v| v.iter().sum())
            .unwrap_or(0)
    }
}

/// Index of the single [`LbConfig`] entry.
pub const CONFIG_KEY: u32 = 0;

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
