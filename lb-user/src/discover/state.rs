//! What the running balancer keeps of discovery between updates: the
//! operator's weight overrides, each backend's zone, the revision applied
//! per VIP, and the watch tasks' shared status.

use std::{
    collections::{HashMap, HashSet},
    net::SocketAddr,
    sync::Arc,
};

use super::watch::DiscoveryStatus;
use crate::settings::{
    addr::{BackendAddr, VipAddr},
    zone::ZoneName,
};

/// What the runtime keeps of discovery.
#[derive(Debug, Default)]
pub struct DiscoveryState {
    pub max_removal_percent: u32,
    /// (VIP, backend) whose weight an operator set: etcd's weight waits
    /// until `backend undrain` clears it. Keyed by the VIP's address, as
    /// everything here: its index moves as VIPs are added and freed.
    pub weight_overrides: HashSet<(VipAddr, SocketAddr)>,
    /// Zone of each discovered backend that has one, as etcd last said
    /// (the zone a configuration re-read gives it, and what a discovery
    /// update compares to find a backend moved to another zone).
    pub zones: HashMap<(VipAddr, SocketAddr), ZoneName>,
    /// Last revision applied per VIP.
    pub revisions: HashMap<VipAddr, i64>,
    /// Shared with the watch tasks (metrics).
    pub status: Option<Arc<DiscoveryStatus>>,
}

impl DiscoveryState {
    pub fn new(max_removal_percent: u32) -> Self {
        Self {
            max_removal_percent,
            ..Self::default()
        }
    }

    /// Takes the zones of VIP `vip`'s backends as discovery gave them at
    /// start (`seed` put them in the configuration), so that a reload and
    /// the first update see them.
    pub fn seed_zones(&mut self, vip: VipAddr, backends: &[BackendAddr]) {
        self.zones.retain(|(v, _), _| *v != vip);
        for b in backends {
            if let Some(zone) = b.zone {
                self.zones.insert((vip, b.addr), zone);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeded_zones_replace_the_vips_own() {
        let mut state = DiscoveryState::new(50);
        let b = |t: &str| t.parse::<BackendAddr>().unwrap();
        let (v0, v1): (VipAddr, VipAddr) = (
            "10.0.0.100:80".parse().unwrap(),
            "10.0.0.101:80".parse().unwrap(),
        );
        state.seed_zones(v0, &[b("10.0.0.21:80,zone=a"), b("10.0.0.22:80")]);
        state.seed_zones(v1, &[b("10.0.0.31:80,zone=b")]);
        state.seed_zones(v0, &[b("10.0.0.23:80,zone=c")]);
        let mut got: Vec<String> = state
            .zones
            .iter()
            .map(|((v, a), z)| format!("{v} {a} {z}"))
            .collect();
        got.sort();
        assert_eq!(
            got,
            [
                "10.0.0.100:80/tcp 10.0.0.23:80 c",
                "10.0.0.101:80/tcp 10.0.0.31:80 b"
            ]
        );
    }
}
