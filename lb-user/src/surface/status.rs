//! `lb-user status`: what a running instance is doing, read from its pins.
//!
//! # JSON schema (`--json`; stable, parsed by the lab and the demo)
//!
//! ```json
//! {
//!   "instance": "lb-eth0",
//!   "ifindex": 2,
//!   "ready": true,                     // CONFIG_F_READY is set
//!   "snat_ip": "10.0.0.1",            // the IPv4 pool's first address
//!   "snat_pool": ["10.0.0.1", "10.0.0.2"],   // every SNAT address, both families
//!   "snat_ports": "20000-32767",
//!   "flow_entries": 4,                 // entries of both flow tables (two per connection) at the last kernel sweep
//!   "flow_table_capacity": { "ipv4": 262144, "ipv6": 262144 },   // entries each family's table holds
//!   "flow_tables_shared": true,        // only when true: the running program predates IPv4's own table (both families in one, whose size both capacities give)
//!   "vips": [{
//!     "id": 0,
//!     "address": "10.0.0.100:80",
//!     "protocol": "tcp",               // or "udp"
//!     "algorithm": "p2c-ewma",         // lb_common::Algorithm::name, as configured
//!     "least_conn_relief": false,      // a P2C VIP selected by least connections for now, while its held backends are needed or its whole pool queues (publish::relief)
//!     "inflight_bias": 2,
//!     "p2c_full_scan": 16,             // P2C may compare all backends up to this many (0: pairs)
//!     "p2c_saturation": 4,             // in flight from which a backend is saturated (0: off)
//!     "p2c_bound_ms": 18.3,            // P2C's re-draw bound: 3 × the median latency of the VIP's backends; absent: not P2C, nothing measured yet, or zone-aware (each zone block has its own)
//!     "source": "static",              // or "etcd /lb/web/" (discovered)
//!     "revision": 42,                  // etcd revision applied (discovered only)
//!     "zone_routing": {                // zone-aware VIPs only
//!       "local_zone": "a",
//!       "spill": "spilling",           // "local" | "spilling" | "panic"
//!       "reason": "local zone a: 2 of 5 backends selectable, 40% of its weight (< 70%)",
//!       "zones": [{ "zone": "a", "share": 0.57, "backends": 5, "active": 2 }],  // failover order
//!       "backend_zones": { "10.0.0.21:8080": "a" }   // "-": no zone
//!     },
//!     "backends": [{
//!       "id": 0,
//!       "address": "10.0.0.21:8080",
//!       "zone": "a",                   // absent: no zone (or not zone-aware)
//!       "weight": 0.5,                 // effective weight (slow start, smoothing)
//!       "state": "active",             // "active" | "draining" | "ejected" | "down"
//!       "inflight": 3,                 // opened - closed + correction
//!       "ewma_ms": 1.2,                // Peak-EWMA latency, milliseconds
//!       "cost": 1200000,               // ewma_ns * 100 / (weight * 100)
//!       "held": false,                 // far above P2C's bound, cost from its mean (SCORE_FAR_ABOVE)
//!       "opened": 10, "closed": 7, "correction": 0, // lb-user's own (health checks)
//!       "snat_free": 25534,            // SNAT tuples (addresses × ports) free towards its address
//!       "snat_used": 2,                // held by this id: open, lingering or in quarantine
//!       "packets_to_backend": 0, "bytes_to_backend": 0,
//!       "packets_from_backend": 0, "bytes_from_backend": 0   // summed over CPUs
//!     }]
//!   }],
//!   "reasons": { "pass_not_ip": 0, "tx_to_backend": 0, ... }   // lb_common::reason::NAMES
//! }
//! ```

use std::path::Path;

use anyhow::{Context as _, anyhow, bail};
use lb_common::{
    BACKEND_ACTIVE, BACKEND_DOWN, BACKEND_DRAINING, BACKEND_EJECTED, CONFIG_F_READY, MAX_BACKENDS,
    MAX_SNAT_ADDRS, VIP_F_P2C_RELIEF, reason,
};
use serde::{Serialize, de::DeserializeOwned};

use crate::{
    estimate::WEIGHT_UNITS, kernel::bpffs, kernel::flow_tables::Capacities, kernel::instance,
    kernel::maps, kernel::wire, settings::addr::Protocol,
};

#[derive(Debug, Serialize)]
pub struct Status {
    pub instance: String,
    pub ifindex: u32,
    pub ready: bool,
    pub snat_ip: String,
    pub snat_pool: Vec<String>,
    pub snat_ports: String,
    pub flow_entries: u64,
    pub flow_table_capacity: Capacities,
    /// Both families in one table (`FLOWS`): the running program is of a
    /// build before IPv4's own table, and this build's `status` reads it
    /// before the daemon was restarted on this build (which creates it).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub flow_tables_shared: bool,
    pub vips: Vec<VipStatus>,
    pub reasons: serde_json::Map<String, serde_json::Value>,
}

#[derive(Debug, Serialize)]
pub struct VipStatus {
    pub id: u32,
    pub address: String,
    pub protocol: String,
    pub algorithm: String,
    /// A P2C VIP that the kernel selects by least connections for now,
    /// while its held backends are needed (`publish::relief`).
    pub least_conn_relief: bool,
    pub inflight_bias: u8,
    pub p2c_full_scan: u16,
    pub p2c_saturation: u16,
    /// P2C's re-draw bound in milliseconds ([`p2c_bound_ms`]); `None` for
    /// other algorithms, before any estimate, and for zone-aware VIPs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub p2c_bound_ms: Option<f64>,
    /// `static`, or `etcd PREFIX` for a discovered VIP.
    pub source: String,
    /// The etcd revision applied (discovered VIPs only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub revision: Option<i64>,
    /// Zone-aware VIPs: the routing state the control plane last planned.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub zone_routing: Option<ZoneRouting>,
    pub backends: Vec<BackendStatus>,
}

/// What the control plane tells `status` about zone-aware routing, in
/// `/run/lb-user/<instance>.zones.json` (replaced atomically at each change).
#[derive(Debug, Default, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct ZonesFile {
    /// Per VIP (`IP:PORT/proto`).
    pub vips: std::collections::BTreeMap<String, ZoneRouting>,
}

#[derive(Debug, Default, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct ZoneRouting {
    pub local_zone: String,
    pub spill: String,
    pub reason: String,
    pub zones: Vec<ZoneStatus>,
    /// Backend address → zone (`-`: none).
    pub backend_zones: std::collections::BTreeMap<String, String>,
}

#[derive(Debug, Default, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct ZoneStatus {
    pub zone: String,
    pub share: f64,
    pub backends: usize,
    pub active: usize,
}

pub fn zones_path(instance_name: &str) -> std::path::PathBuf {
    instance::run_file(instance_name, instance::ZONES_SUFFIX)
}

/// Each zone-aware VIP's routing and its backends' zones, from the zones
/// file if any.
fn apply_zones(instance_name: &str, vips: &mut [VipStatus]) {
    let file: ZonesFile = read_or_default(&zones_path(instance_name));
    for v in vips {
        if let Some(z) = file.vips.get(&file_key(v)) {
            for b in &mut v.backends {
                b.zone = z
                    .backend_zones
                    .get(&b.address)
                    .filter(|z| *z != "-")
                    .cloned();
            }
            v.zone_routing = Some(z.clone());
            // Each zone block has its own bound; the VIP's is not the one
            // its picks use.
            v.p2c_bound_ms = None;
        }
    }
}

/// What the discovery watch tells `status`, per VIP (`IP:PORT/proto`), in
/// `/run/lb-user/<instance>.discovery.json` (replaced atomically).
#[derive(Debug, Default, Serialize, serde::Deserialize)]
pub struct DiscoveryFile {
    pub vips: std::collections::BTreeMap<String, DiscoveredVip>,
}

#[derive(Debug, Default, Clone, Serialize, serde::Deserialize)]
pub struct DiscoveredVip {
    pub prefix: String,
    pub revision: i64,
    pub connected: bool,
}

pub fn discovery_path(instance_name: &str) -> std::path::PathBuf {
    instance::run_file(instance_name, instance::DISCOVERY_SUFFIX)
}

/// Each VIP's source and revision, from the discovery file if any.
fn apply_sources(instance_name: &str, vips: &mut [VipStatus]) {
    let file: DiscoveryFile = read_or_default(&discovery_path(instance_name));
    for v in vips {
        if let Some(d) = file.vips.get(&file_key(v)) {
            v.source = format!("etcd {}", d.prefix);
            v.revision = Some(d.revision);
        }
    }
}

/// The file the daemon writes for `status` at `path` (JSON), or the
/// default, which adds nothing, when it is missing or unreadable.
fn read_or_default<T: DeserializeOwned + Default>(path: &Path) -> T {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default()
}

/// The name the zones and discovery files give VIP `v`: `IP:PORT/proto`.
fn file_key(v: &VipStatus) -> String {
    format!("{}/{}", v.address, v.protocol)
}

#[derive(Debug, Serialize)]
pub struct BackendStatus {
    pub id: u32,
    pub address: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
    /// Effective weight (slow start and smoothing applied), in configured units.
    pub weight: f64,
    pub state: String,
    pub inflight: u64,
    pub ewma_ms: f64,
    pub cost: u64,
    /// Held far above P2C's re-draw bound (`lb_common::SCORE_FAR_ABOVE`):
    /// `cost` then comes from its mean latency, not its peak.
    pub held: bool,
    pub opened: u64,
    pub closed: u64,
    pub correction: u64,
    pub snat_free: u64,
    pub snat_used: u64,
    pub packets_to_backend: u64,
    pub bytes_to_backend: u64,
    pub packets_from_backend: u64,
    pub bytes_from_backend: u64,
}

/// The instance to show: the one named, or the only one running.
pub fn resolve_instance(requested: Option<String>) -> anyhow::Result<String> {
    if let Some(name) = requested {
        if !crate::settings::config::valid_instance_name(&name) {
            bail!("{}", crate::settings::ConfigError::BadInstance(name));
        }
        return Ok(name);
    }
    let running = if bpffs::is_mounted() {
        instance::list()
    } else {
        Vec::new()
    };
    match running.as_slice() {
        [one] => Ok(one.clone()),
        [] => bail!(
            "no running instance (nothing under {})",
            instance::pin_root().display()
        ),
        many => bail!(
            "several instances are running ({}); pick one with --instance",
            many.join(", ")
        ),
    }
}

fn state_name(state: u8) -> String {
    match state {
        BACKEND_ACTIVE => "active",
        BACKEND_DRAINING => "draining",
        BACKEND_EJECTED => "ejected",
        BACKEND_DOWN => "down",
        _ => "unknown",
    }
    .to_string()
}

pub fn read(instance: &str) -> anyhow::Result<Status> {
    let dir = instance::pin_dir(instance);
    if !dir.is_dir() {
        bail!(
            "instance '{instance}' is not running (no {})",
            dir.display()
        );
    }
    let config = maps::configs(&dir)?
        .get(&maps::CONFIG_KEY, 0)
        .context("reading CONFIG")?;
    let snat_ip = wire::words_to_ip(config.snat_v4, lb_common::AF_INET)
        .map(|ip| ip.to_string())
        .unwrap_or_default();
    let snat_addrs = maps::snat_addrs(&dir)?;
    let mut snat_pool = Vec::new();
    for (base, count, family) in [
        (0, config.snat_v4_count, lb_common::AF_INET),
        (MAX_SNAT_ADDRS, config.snat_v6_count, lb_common::AF_INET6),
    ] {
        for slot in base..base + u32::from(count).min(MAX_SNAT_ADDRS) {
            let a = snat_addrs.get(&slot, 0).context("reading SNAT_ADDRS")?;
            snat_pool.extend(wire::words_to_ip(a.addr, family).map(|ip| ip.to_string()));
        }
    }
    let sweep = maps::sweep_stats(&dir)?
        .get(&0, 0)
        .context("reading SWEEP_STATS")?;
    let (flow_table_capacity, flow_tables_shared) = Capacities::of_pins_or_shared(&dir)?;
    let mut vips = read_vips(&dir, &config)?;
    apply_sources(instance, &mut vips);
    apply_zones(instance, &mut vips);
    Ok(Status {
        instance: instance.to_string(),
        ifindex: config.ifindex,
        ready: config.flags & CONFIG_F_READY != 0,
        snat_ip,
        snat_pool,
        snat_ports: format!("{}-{}", config.snat_port_min, config.snat_port_max),
        flow_entries: sweep.entries,
        flow_table_capacity,
        flow_tables_shared,
        vips,
        reasons: read_reasons(&dir)?,
    })
}

/// One backend's line of the status, from its BACKENDS entry and counters.
fn backend_status(
    id: u32,
    b: &lb_common::Backend,
    score: lb_common::BackendScore,
    c: lb_common::BackendConns,
    correction: u64,
    snat: SnatCount,
    per_cpu: &[lb_common::BackendStats],
) -> BackendStatus {
    let SnatCount {
        tuples: snat_tuples,
        used: snat_used,
        held_by_address,
    } = snat;
    let sum = |f: fn(&lb_common::BackendStats) -> u64| per_cpu.iter().map(f).sum::<u64>();
    BackendStatus {
        id,
        address: wire::socket_addr(b.addr, b.family, b.port)
            .map(|a| a.to_string())
            .unwrap_or_default(),
        zone: None,
        weight: if score.weight != 0 {
            f64::from(score.weight) / f64::from(WEIGHT_UNITS)
        } else {
            f64::from(b.weight)
        },
        state: state_name(b.state),
        inflight: c.inflight(correction),
        ewma_ms: score.ewma_ns as f64 / 1e6,
        cost: score.cost,
        held: score.flags & lb_common::SCORE_FAR_ABOVE != 0,
        opened: c.opened,
        closed: c.closed,
        correction,
        snat_free: snat_tuples.saturating_sub(held_by_address),
        snat_used,
        packets_to_backend: sum(|s| s.packets_to_backend),
        bytes_to_backend: sum(|s| s.bytes_to_backend),
        packets_from_backend: sum(|s| s.packets_from_backend),
        bytes_from_backend: sum(|s| s.bytes_from_backend),
    }
}

/// One backend id's SNAT tuples: `tuples` of its family (pool addresses ×
/// ports), `used` by this id, `held_by_address` by every id of its address.
#[derive(Clone, Copy, Debug, Default)]
pub struct SnatCount {
    pub tuples: u64,
    pub used: u64,
    pub held_by_address: u64,
}

/// SNAT tuples held towards each backend address, summed over its ids
/// (`rows`: an address with its protocol, and what one id of it holds).
/// One backend behind two VIPs of a protocol has an id per VIP, and both
/// draw on the same tuples: the reply key holds the backend's address,
/// port and protocol, not its id. So the tuples free towards either id are
/// the family's less what both hold.
pub fn snat_held_by_address<A: Eq + std::hash::Hash>(
    rows: impl IntoIterator<Item = (A, u64)>,
) -> std::collections::HashMap<A, u64> {
    let mut held = std::collections::HashMap::new();
    for (address, used) in rows {
        let sum: &mut u64 = held.entry(address).or_default();
        *sum = sum.saturating_add(used);
    }
    held
}

/// The SNAT tuples an address holds, for one of its ids that holds `used`:
/// `own`, the sum over the ids of its VIP's protocol, plus `gone`, the sum
/// over ids of VIPs gone from `VIPS`, whose protocol is unknown (`of_gone`:
/// the id is one of those, and `own` is that sum already).
fn held_with_gone_vips(own: Option<u64>, gone: Option<u64>, of_gone: bool, used: u64) -> u64 {
    let own = own.unwrap_or(used);
    if of_gone {
        own
    } else {
        own.saturating_add(gone.unwrap_or(0))
    }
}

/// SNAT tuples towards one backend of `family`: pool addresses × ports.
pub fn snat_tuples(config: &lb_common::LbConfig, family: u8) -> u64 {
    let addrs = if family == lb_common::AF_INET6 {
        config.snat_v6_count
    } else {
        config.snat_v4_count
    };
    let ports = u64::from(config.snat_port_max.saturating_sub(config.snat_port_min)) + 1;
    u64::from(addrs) * ports
}

fn read_vips(dir: &Path, config: &lb_common::LbConfig) -> anyhow::Result<Vec<VipStatus>> {
    let snat_used = maps::snat_used(dir)?;
    let backends = maps::backends(dir)?;
    let scores = maps::scores(dir)?;
    let conns = maps::conns(dir)?;
    let corrections = maps::corrections(dir)?;
    let stats = maps::stats(dir)?;
    let tables = maps::vip_tables(dir)?;
    // Every backend id in use, read once: the SNAT tuples an address holds
    // are summed over its ids, which may belong to several VIPs.
    let mut in_use = Vec::new();
    for id in 0..MAX_BACKENDS {
        let b = backends.get(&id, 0).context("reading BACKENDS")?;
        if b.in_use != 0 {
            let used = snat_used.get(&id, 0).context("reading BACKEND_SNAT_USED")?;
            in_use.push((id, b, used));
        }
    }
    let vip_entries = maps::vips(dir)?
        .iter()
        .collect::<Result<Vec<_>, _>>()
        .context("reading VIPS")?;
    // A reply key holds the protocol too: TCP and UDP tuples are apart.
    let proto: std::collections::HashMap<u32, u8> = vip_entries
        .iter()
        .map(|(key, meta)| (meta.vip_id, key.proto))
        .collect();
    let address = |b: &lb_common::Backend| {
        let proto = proto.get(&b.vip_id).copied();
        (proto, b.family, b.addr, b.port)
    };
    let held = snat_held_by_address(in_use.iter().map(|(_, b, used)| (address(b), *used)));
    // The ids of a VIP no longer in `VIPS` (removed, its flows draining)
    // still hold tuples, under a protocol the pins no longer name: they are
    // counted against the address under either protocol, so `snat_free`
    // errs low, never high.
    let held_by = |b: &lb_common::Backend, used: u64| {
        let (proto, family, addr, port) = address(b);
        let gone = held.get(&(None, family, addr, port)).copied();
        let own = held.get(&(proto, family, addr, port)).copied();
        held_with_gone_vips(own, gone, proto.is_none(), used)
    };
    let mut vips = Vec::new();
    for (key, meta) in vip_entries {
        let address_of_vip = wire::socket_addr(key.addr, key.family, key.port)
            .ok_or_else(|| anyhow!("VIPS has an entry of unknown family {}", key.family))?;
        let mut list = Vec::new();
        for (id, b, used) in in_use.iter().filter(|(_, b, _)| b.vip_id == meta.vip_id) {
            let id = *id;
            let score = scores.get(&id, 0).context("reading BACKEND_SCORES")?;
            let c = conns.get(&id, 0).context("reading BACKEND_CONNS")?;
            let correction = corrections
                .get(&id, 0)
                .context("reading BACKEND_CORRECTION")?;
            let per_cpu = stats.get(&id, 0).context("reading BACKEND_STATS")?;
            let snat = SnatCount {
                tuples: snat_tuples(config, b.family),
                used: *used,
                held_by_address: held_by(b, *used),
            };
            list.push(backend_status(id, b, score, c, correction, snat, &per_cpu));
        }
        let reference = tables
            .get(&meta.vip_id, 0)
            .context("reading VIP_TABLES")?
            .reference_cost;
        let p2c = meta.configured_algorithm() == Some(lb_common::Algorithm::P2cEwma);
        vips.push(VipStatus {
            id: meta.vip_id,
            address: address_of_vip.to_string(),
            protocol: Protocol::from_ip_proto(key.proto)
                .map(|p| p.name().to_string())
                .unwrap_or_else(|| key.proto.to_string()),
            algorithm: meta
                .configured_algorithm()
                .map(|a| a.name().to_string())
                .unwrap_or_else(|| format!("unknown({})", meta.algorithm)),
            least_conn_relief: meta.flags & VIP_F_P2C_RELIEF != 0,
            inflight_bias: meta.inflight_bias,
            p2c_full_scan: meta.p2c_full_scan,
            p2c_saturation: meta.p2c_saturation,
            p2c_bound_ms: p2c.then(|| p2c_bound_ms(reference)).flatten(),
            source: "static".to_string(),
            revision: None,
            zone_routing: None,
            backends: list,
        });
    }
    vips.sort_by_key(|v| v.id);
    Ok(vips)
}

/// P2C's re-draw bound in milliseconds for a VIP whose reference cost (the
/// median [unweighted cost](lb_common::p2c::unweighted_cost) of its
/// backends, so their latency × `WEIGHT_SCALE`) is `reference_cost`; `None`
/// while it is 0 (nothing measured yet: no bound).
pub fn p2c_bound_ms(reference_cost: u64) -> Option<f64> {
    let bound = lb_common::p2c::redraw_bound(reference_cost);
    (bound != 0).then(|| bound as f64 / lb_common::WEIGHT_SCALE as f64 / 1e6)
}

fn read_reasons(dir: &Path) -> anyhow::Result<serde_json::Map<String, serde_json::Value>> {
    let reasons = maps::reasons(dir)?;
    let mut out = serde_json::Map::new();
    for (i, name) in reason::NAMES.iter().enumerate() {
        let per_cpu = reasons
            .get(&(i as u32), 0)
            .context("reading REASON_STATS")?;
        out.insert(name.to_string(), per_cpu.iter().sum::<u64>().into());
    }
    Ok(out)
}

/// The human-readable form.
pub fn render_table(s: &Status) -> String {
    let tables = if s.flow_tables_shared {
        format!(
            "one table of {} for both families: the running program predates IPv4's own table, \
             which a restart on this build creates",
            s.flow_table_capacity.ipv6
        )
    } else {
        format!(
            "tables: ipv4 {}, ipv6 {}",
            s.flow_table_capacity.ipv4, s.flow_table_capacity.ipv6
        )
    };
    let mut out = format!(
        "instance {} (ifindex {}, {}), snat {} ports {}, {} flow entries ({tables})\n",
        s.instance,
        s.ifindex,
        if s.ready { "ready" } else { "NOT READY" },
        s.snat_pool.join(","),
        s.snat_ports,
        s.flow_entries,
    );
    for v in &s.vips {
        out += &format!(
            "\nVIP {}/{}  algorithm {}{}  inflight bias {}{}  source {}{}\n",
            v.address,
            v.protocol,
            v.algorithm,
            if v.least_conn_relief {
                " (relieved: least connections while its held backends are needed)"
            } else {
                ""
            },
            v.inflight_bias,
            v.p2c_bound_ms
                .map(|b| format!("  p2c bound {b:.1} ms"))
                .unwrap_or_default(),
            v.source,
            v.revision
                .map(|r| format!(" @ revision {r}"))
                .unwrap_or_default()
        );
        if let Some(z) = &v.zone_routing {
            let zones: Vec<String> = z
                .zones
                .iter()
                .map(|b| {
                    format!(
                        "{} {:.1}% ({}/{} active)",
                        b.zone,
                        b.share * 100.0,
                        b.active,
                        b.backends
                    )
                })
                .collect();
            out += &format!(
                "  zones: local {}, {}{}: {}\n",
                z.local_zone,
                z.spill,
                if z.reason.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", z.reason)
                },
                zones.join(", ")
            );
        }
        out += &format!(
            "  {:>3} {:<22} {:<8} {:>6} {:<8} {:>8} {:>9} {:>12} {:>9} {:>9} {:>9} {:>12} {:>12} {}\n",
            "id",
            "backend",
            "zone",
            "weight",
            "state",
            "inflight",
            "ewma_ms",
            "cost",
            "opened",
            "closed",
            "snat_free",
            "bytes_to",
            "bytes_from",
            "held"
        );
        for b in &v.backends {
            out += &format!(
                "  {:>3} {:<22} {:<8} {:>6.2} {:<8} {:>8} {:>9.3} {:>12} {:>9} {:>9} {:>9} {:>12} {:>12} {}\n",
                b.id,
                b.address,
                b.zone.as_deref().unwrap_or("-"),
                b.weight,
                b.state,
                b.inflight,
                b.ewma_ms,
                b.cost,
                b.opened,
                b.closed,
                b.snat_free,
                b.bytes_to_backend,
                b.bytes_from_backend,
                if b.held { "yes" } else { "-" }
            );
        }
    }
    out += "\nreasons:";
    for (name, count) in &s.reasons {
        if count.as_u64() != Some(0) {
            out += &format!(" {name}={count}");
        }
    }
    out.push('\n');
    out
}

#[cfg(test)]
mod tests {
    use lb_common::{BACKEND_ACTIVE, BACKEND_DOWN, BACKEND_DRAINING, BACKEND_EJECTED, LbConfig};

    use super::{
        BackendStatus, SnatCount, Status, VipStatus, backend_status, held_with_gone_vips,
        p2c_bound_ms, render_table, snat_held_by_address, snat_tuples, state_name,
    };
    use crate::kernel::wire;

    #[test]
    fn the_p2c_bound_is_three_times_the_median_latency_in_milliseconds() {
        // A 6 ms median: 6,000,000 ns × WEIGHT_SCALE in cost units.
        let reference = 6_000_000 * lb_common::WEIGHT_SCALE;
        assert_eq!(p2c_bound_ms(reference), Some(18.0));
        assert_eq!(p2c_bound_ms(0), None, "nothing measured yet: no bound");
    }

    /// Backend `id` at `addr` holding `used` SNAT tuples (no other id of
    /// its address holds any), paired with its family's tuples as
    /// `read_vips` pairs them.
    fn backend(config: &LbConfig, id: u32, addr: &str, used: u64) -> BackendStatus {
        backend_sharing(config, id, addr, used, used)
    }

    /// [`backend`] whose address holds `held` tuples over all its ids.
    fn backend_sharing(
        config: &LbConfig,
        id: u32,
        addr: &str,
        used: u64,
        held: u64,
    ) -> BackendStatus {
        let b = wire::backend_entry(addr.parse().unwrap(), 0, 1, BACKEND_ACTIVE);
        let snat = SnatCount {
            tuples: snat_tuples(config, b.family),
            used,
            held_by_address: held,
        };
        backend_status(id, &b, Default::default(), Default::default(), 0, snat, &[])
    }

    #[test]
    fn one_backend_behind_two_vips_shares_its_snat_tuples() {
        // Ids 0 and 4 are one backend address in two VIPs; id 1 is another.
        let held = snat_held_by_address([
            ("10.0.0.21:8080", 300),
            ("10.0.0.22:8080", 40),
            ("10.0.0.21:8080", 200),
        ]);
        assert_eq!(held["10.0.0.21:8080"], 500);
        assert_eq!(held["10.0.0.22:8080"], 40);
        assert_eq!(held.len(), 2);
        // 1 IPv4 address, ports 20000-20999: 1,000 tuples, and each id of
        // the shared address has 1,000 - 500 free, not 1,000 less its own.
        let config = LbConfig {
            snat_port_min: 20_000,
            snat_port_max: 20_999,
            snat_v4_count: 1,
            ..LbConfig::default()
        };
        let first = backend_sharing(&config, 0, "10.0.0.21:8080", 300, 500);
        let second = backend_sharing(&config, 4, "10.0.0.21:8080", 200, 500);
        assert_eq!((first.snat_free, first.snat_used), (500, 300));
        assert_eq!((second.snat_free, second.snat_used), (500, 200));
        // More held than there are (counts racing a reuse): none free.
        assert_eq!(
            backend_sharing(&config, 0, "10.0.0.21:8080", 700, 1_200).snat_free,
            0
        );
    }

    #[test]
    fn a_gone_vips_tuples_count_against_its_backends_address() {
        // A VIP removed while its flows drain is gone from VIPS, so its
        // ids' protocol is unknown: their 300 tuples count against the
        // address's live ids (200 of their own), which see 500 held.
        assert_eq!(held_with_gone_vips(Some(200), Some(300), false, 120), 500);
        // The gone VIP's own ids: their sum, once.
        assert_eq!(held_with_gone_vips(Some(300), Some(300), true, 100), 300);
        // Nothing gone: the address's own sum; nothing summed: the id's own.
        assert_eq!(held_with_gone_vips(Some(200), None, false, 120), 200);
        assert_eq!(held_with_gone_vips(None, None, false, 120), 120);
    }

    fn vip(id: u32, address: &str, backends: Vec<BackendStatus>) -> VipStatus {
        VipStatus {
            id,
            address: address.into(),
            protocol: "tcp".into(),
            algorithm: "round-robin".into(),
            least_conn_relief: false,
            inflight_bias: 0,
            p2c_full_scan: 0,
            p2c_saturation: 0,
            p2c_bound_ms: None,
            source: "static".into(),
            revision: None,
            zone_routing: None,
            backends,
        }
    }

    /// The text table's `snat_free` column: (backend, value) per row.
    fn snat_free_column(table: &str) -> Vec<(String, u64)> {
        let mut column = None;
        let mut rows = Vec::new();
        for line in table.lines() {
            let words: Vec<&str> = line.split_whitespace().collect();
            if words.first() == Some(&"id") {
                column = words.iter().position(|w| *w == "snat_free");
            } else if let Some(at) = column
                && words.first().is_some_and(|w| w.parse::<u32>().is_ok())
            {
                rows.push((words[1].to_string(), words[at].parse().unwrap()));
            }
        }
        rows
    }

    #[test]
    fn snat_free_is_the_family_pools_tuples_less_those_used() {
        // Ports 20000-20999 (1,000): 2 IPv4 addresses give 2,000 tuples
        // per backend, 3 IPv6 addresses 3,000.
        let config = LbConfig {
            snat_port_min: 20_000,
            snat_port_max: 20_999,
            snat_v4_count: 2,
            snat_v6_count: 3,
            ..LbConfig::default()
        };
        let status = Status {
            instance: "lb-test".into(),
            ifindex: 1,
            ready: true,
            snat_ip: "10.0.0.1".into(),
            snat_pool: [
                "10.0.0.1",
                "10.0.0.2",
                "2001:db8::1",
                "2001:db8::2",
                "2001:db8::3",
            ]
            .map(String::from)
            .to_vec(),
            snat_ports: "20000-20999".into(),
            flow_entries: 0,
            flow_table_capacity: crate::kernel::flow_tables::Capacities {
                ipv4: 4096,
                ipv6: 64,
            },
            flow_tables_shared: false,
            vips: vec![
                vip(
                    0,
                    "10.0.0.100:80",
                    vec![
                        backend(&config, 0, "10.0.0.21:8080", 5),
                        backend(&config, 1, "10.0.0.22:8080", 2_500),
                    ],
                ),
                vip(
                    1,
                    "[2001:db8::100]:80",
                    vec![
                        backend(&config, 2, "[2001:db8::21]:8080", 7),
                        backend(&config, 3, "[2001:db8::22]:8080", 2_500),
                    ],
                ),
            ],
            reasons: serde_json::Map::new(),
        };
        // 2,500 used is more than the IPv4 pool holds (none free, not a
        // wrapped count) and less than the IPv6 one.
        let want = [
            ("10.0.0.21:8080", 1_995),
            ("10.0.0.22:8080", 0),
            ("[2001:db8::21]:8080", 2_993),
            ("[2001:db8::22]:8080", 500),
        ]
        .map(|(b, free)| (b.to_string(), free))
        .to_vec();

        let json = serde_json::to_value(&status).unwrap();
        let from_json: Vec<(String, u64)> = json["vips"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|v| v["backends"].as_array().unwrap())
            .map(|b| {
                let free = b["snat_free"].as_u64().expect("snat_free is a number");
                (b["address"].as_str().unwrap().to_string(), free)
            })
            .collect();
        assert_eq!(from_json, want, "JSON");
        assert_eq!(json["vips"][0]["backends"][1]["snat_used"], 2_500);
        assert_eq!(json["flow_table_capacity"]["ipv4"], 4096);
        assert_eq!(json["flow_table_capacity"]["ipv6"], 64);
        assert!(
            render_table(&status).starts_with(
                "instance lb-test (ifindex 1, ready), snat 10.0.0.1,10.0.0.2,2001:db8::1,2001:db8::2,2001:db8::3 \
                 ports 20000-20999, 0 flow entries (tables: ipv4 4096, ipv6 64)\n"
            ),
            "{}",
            render_table(&status)
        );
        assert_eq!(snat_free_column(&render_table(&status)), want, "text");
        assert!(json.get("flow_tables_shared").is_none(), "{json}");

        // A running program of a build before IPv4's own table: one table,
        // said so in both forms.
        let shared = Status {
            flow_table_capacity: crate::kernel::flow_tables::Capacities {
                ipv4: 8192,
                ipv6: 8192,
            },
            flow_tables_shared: true,
            ..status
        };
        let json = serde_json::to_value(&shared).unwrap();
        assert_eq!(json["flow_tables_shared"], true);
        assert_eq!(json["flow_table_capacity"]["ipv4"], 8192);
        let table = render_table(&shared);
        assert!(
            table.contains(
                "0 flow entries (one table of 8192 for both families: the running program \
                 predates IPv4's own table, which a restart on this build creates)\n"
            ),
            "{table}"
        );
    }

    /// A backend down by its checks reads "down", not "ejected" (outlier
    /// detection's), so an operator looks at the right cause.
    #[test]
    fn each_kernel_state_has_its_own_name() {
        let names: Vec<String> = [
            BACKEND_ACTIVE,
            BACKEND_DRAINING,
            BACKEND_EJECTED,
            BACKEND_DOWN,
            9,
        ]
        .into_iter()
        .map(state_name)
        .collect();
        assert_eq!(names, ["active", "draining", "ejected", "down", "unknown"]);
    }
}
