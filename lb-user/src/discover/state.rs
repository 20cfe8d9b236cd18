//! What the running balancer keeps of discovery between updates: the
//! operator's weight overrides, each backend's zone, the revision applied
//! per VIP, and the watch tasks' shared status.

use std::{
    collections::{HashMap, HashSet},
    net::SocketAddr,
    sync::Arc,
};

use super::watch::DiscoveryStatus;
use crate::settings::zone::ZoneName;

/// What the runtime keeps of discovery.
#[derive(Debug, Default)]
pub struct DiscoveryState {
    pub max_removal_percent: u32,
    /// (VIP index, backend) whose weight an operator set: etcd's weight
    /// waits until `backend undrain` clears it.
    pub weight_overrides: HashSet<(usize, SocketAddr)>,
    /// Zone of each discovered backend that has one, as etcd last said
    /// (the zone a configuration re-read gives it, and what a discovery
    /// update compares to find a backend moved to another zone).
    pub zones: HashMap<(usize, SocketAddr), ZoneName>,
    /// Last revision applied per VIP index.
    pub revisions: HashMap<usize, i64>,
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
}
