//! The JSON printed by `lb-user status --json` (the CLI contract in
//! DESIGN.md), as the lab reads it. Fields the lab does not need are ignored,
//! and missing numeric fields read as zero, so the lab keeps working while the
//! status output grows.

use std::collections::BTreeMap;

use serde::Deserialize;

/// The whole status document.
#[derive(Debug, Clone, Deserialize)]
pub struct Status {
    /// lb-user has written its whole configuration to the maps.
    #[serde(default)]
    pub ready: bool,
    pub vips: Vec<VipStatus>,
    /// Pass/drop reason counters by name.
    #[serde(default)]
    pub reasons: BTreeMap<String, u64>,
    /// Entries each family's flow table holds (`ipv4`, `ipv6`).
    #[serde(default)]
    pub flow_table_capacity: BTreeMap<String, u64>,
    /// Both families in one table: the running program predates IPv4's own.
    #[serde(default)]
    pub flow_tables_shared: bool,
}

/// One VIP and its backends.
#[derive(Debug, Clone, Deserialize)]
pub struct VipStatus {
    pub address: String,
    #[serde(default)]
    pub protocol: String,
    #[serde(default)]
    pub algorithm: String,
    /// A P2C VIP selected by least connections for now.
    #[serde(default)]
    pub least_conn_relief: bool,
    /// P2C's re-draw bound (3 × the median latency of its backends), ms;
    /// absent for other algorithms, before any estimate, and zone-aware VIPs.
    #[serde(default)]
    pub p2c_bound_ms: Option<f64>,
    /// `static`, or `etcd PREFIX` for a discovered VIP.
    #[serde(default)]
    pub source: String,
    /// The etcd revision applied (discovered VIPs only).
    #[serde(default)]
    pub revision: Option<i64>,
    /// Zone-aware VIPs: the routing the control plane last planned.
    #[serde(default)]
    pub zone_routing: Option<ZoneRouting>,
    pub backends: Vec<BackendStatus>,
}

/// A zone-aware VIP's routing state.
#[derive(Debug, Clone, Deserialize)]
pub struct ZoneRouting {
    #[serde(default)]
    pub local_zone: String,
    /// `local`, `spilling` or `panic`.
    pub spill: String,
    #[serde(default)]
    pub reason: String,
    /// In failover order.
    pub zones: Vec<ZoneStatus>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ZoneStatus {
    pub zone: String,
    pub share: f64,
    #[serde(default)]
    pub backends: usize,
    #[serde(default)]
    pub active: usize,
}

impl ZoneRouting {
    /// The planned share of zone `zone` (0 if it has no block).
    pub fn share(&self, zone: &str) -> f64 {
        self.zones
            .iter()
            .find(|z| z.zone == zone)
            .map_or(0.0, |z| z.share)
    }
}

/// One backend of a VIP.
#[derive(Debug, Clone, Deserialize)]
pub struct BackendStatus {
    #[serde(default)]
    pub id: u32,
    pub address: String,
    #[serde(default)]
    pub zone: Option<String>,
    #[serde(default)]
    pub weight: f64,
    #[serde(default)]
    pub state: String,
    #[serde(default)]
    pub inflight: u64,
    #[serde(default)]
    pub ewma_ms: f64,
    #[serde(default)]
    pub cost: f64,
    /// Connections opened to this backend since the state was created.
    #[serde(default)]
    pub opened: u64,
    #[serde(default)]
    pub closed: u64,
    #[serde(default)]
    pub bytes_to_backend: u64,
    #[serde(default)]
    pub bytes_from_backend: u64,
    /// SNAT tuples free towards the backend's address.
    #[serde(default)]
    pub snat_free: u64,
    /// SNAT tuples this backend id holds.
    #[serde(default)]
    pub snat_used: u64,
}

impl Status {
    /// The VIP whose address is `address` (`IP:PORT`).
    pub fn vip(&self, address: &str) -> Option<&VipStatus> {
        self.vips.iter().find(|vip| vip.address == address)
    }
}
