//! What the running balancer keeps of discovery between updates: the
//! operator's weight overrides, each backend's zone, the revision applied
//! per VIP, the wanted sets not yet fully applied, and the watch tasks'
//! shared status.

use std::{
    collections::{HashMap, HashSet},
    net::SocketAddr,
    sync::Arc,
    time::Duration,
};

use tokio::task::AbortHandle;

use super::watch::{DiscoveryStatus, Update};
use crate::{
    kernel::clock::Nanos,
    settings::{
        addr::{BackendAddr, VipAddr},
        zone::ZoneName,
    },
};

/// How often a wanted set that was not fully applied is planned again.
/// Each try removes at most another capped share, so this also paces a
/// large removal.
pub const REAPPLY_EVERY: Duration = Duration::from_secs(1);

/// A VIP's last wanted set, while applying it left work undone.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Unfinished {
    update: Update,
    last_try: Nanos,
}

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
    /// Per VIP whose last update had changes fail (a full VIP refusing an
    /// add): that update, to plan again every [`REAPPLY_EVERY`]. Without
    /// it the work waits for the next etcd event, which may never come.
    /// (Removals the cap deferred wait for the next update: retried, the
    /// cap would only pace a deleted prefix's emptying of the pool.)
    unfinished: HashMap<VipAddr, Unfinished>,
    /// Shared with the watch tasks (metrics).
    pub status: Option<Arc<DiscoveryStatus>>,
    /// The running watch task of each (VIP, etcd prefix).
    pub watches: HashMap<(VipAddr, String), AbortHandle>,
}

impl DiscoveryState {
    pub fn new(max_removal_percent: u32) -> Self {
        Self {
            max_removal_percent,
            ..Self::default()
        }
    }

    /// Notes how applying `update` at `now` went: kept for another try
    /// while it left work undone, forgotten once it finished (a newer
    /// update replaces an older one either way).
    pub fn note_applied(&mut self, update: &Update, finished: bool, now: Nanos) {
        if finished {
            self.unfinished.remove(&update.vip);
        } else {
            let unfinished = Unfinished {
                update: update.clone(),
                last_try: now,
            };
            self.unfinished.insert(update.vip, unfinished);
        }
    }

    /// Ends the watch of every (VIP, prefix) that `still_discovered` no
    /// longer names (a reload dropped the VIP: a reload never adds a
    /// discovered VIP, so none needs it again until a restart), and forgets
    /// the VIP's unfinished update. Returns those ended, in VIP order.
    pub fn end_watches(
        &mut self,
        still_discovered: impl Fn(&VipAddr, &str) -> bool,
    ) -> Vec<(VipAddr, String)> {
        let mut ended: Vec<(VipAddr, String)> = self
            .watches
            .keys()
            .filter(|(vip, prefix)| !still_discovered(vip, prefix))
            .cloned()
            .collect();
        ended.sort_by_key(|(vip, prefix)| (vip.addr, vip.to_string(), prefix.clone()));
        for key in &ended {
            if let Some(task) = self.watches.remove(key) {
                task.abort();
            }
            if let Some(status) = &self.status {
                status.end(&key.0.to_string(), &key.1);
            }
            self.forget(key.0);
        }
        ended
    }

    /// Forgets VIP `vip`'s unfinished update (the VIP is no longer served).
    pub fn forget(&mut self, vip: VipAddr) {
        self.unfinished.remove(&vip);
    }

    /// The unfinished updates due for another try at `now` (each
    /// [`REAPPLY_EVERY`] after its last), in VIP order; each one's clock
    /// restarts, and applying it notes the outcome again.
    pub fn due_reapplies(&mut self, now: Nanos) -> Vec<Update> {
        let mut due: Vec<Update> = self
            .unfinished
            .values_mut()
            .filter(|u| now >= u.last_try.plus(REAPPLY_EVERY))
            .map(|u| {
                u.last_try = now;
                u.update.clone()
            })
            .collect();
        due.sort_by_key(|u| (u.vip.addr, u.vip.to_string()));
        due
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

    fn update(vip: &str, revision: i64) -> Update {
        Update {
            vip: vip.parse().unwrap(),
            prefix: "/lb/web/".into(),
            revision,
            wanted: Vec::new(),
        }
    }

    #[test]
    fn an_unfinished_update_is_due_again_every_period_until_it_finishes() {
        let mut state = DiscoveryState::new(30);
        let t0 = Nanos(1_000_000_000);
        let second = |n: u64| t0.plus(REAPPLY_EVERY * n as u32);
        state.note_applied(&update("10.0.0.100:80", 7), true, t0);
        assert_eq!(
            state.due_reapplies(second(5)),
            [],
            "finished: nothing to do"
        );
        state.note_applied(&update("10.0.0.100:80", 8), false, t0);
        assert_eq!(state.due_reapplies(t0), []);
        assert_eq!(state.due_reapplies(second(1)), [update("10.0.0.100:80", 8)]);
        assert_eq!(state.due_reapplies(second(1)), [], "the clock restarted");
        // Another try still left work: due a period after that try.
        state.note_applied(&update("10.0.0.100:80", 8), false, second(1));
        assert_eq!(state.due_reapplies(second(2)), [update("10.0.0.100:80", 8)]);
        state.note_applied(&update("10.0.0.100:80", 8), true, second(2));
        assert_eq!(state.due_reapplies(second(9)), []);
    }

    #[test]
    fn a_newer_update_replaces_the_unfinished_one_and_vips_go_in_order() {
        let mut state = DiscoveryState::new(30);
        let t0 = Nanos(5);
        state.note_applied(&update("10.0.0.101:80", 3), false, t0);
        state.note_applied(&update("10.0.0.100:80", 8), false, t0);
        state.note_applied(&update("10.0.0.100:80", 9), false, t0);
        let later = t0.plus(REAPPLY_EVERY);
        assert_eq!(
            state.due_reapplies(later),
            [update("10.0.0.100:80", 9), update("10.0.0.101:80", 3)]
        );
        state.forget("10.0.0.101:80".parse().unwrap());
        state.note_applied(&update("10.0.0.100:80", 10), true, later);
        assert_eq!(state.due_reapplies(later.plus(REAPPLY_EVERY * 3)), []);
    }

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

    /// A reload that drops a discovered VIP ends its watch task (and its
    /// unfinished update); the kept VIP's watch runs on.
    #[tokio::test]
    async fn a_dropped_vips_watch_ends_and_a_kept_ones_runs_on() {
        let mut state = DiscoveryState::new(30);
        let (web, api): (VipAddr, VipAddr) = (
            "10.0.0.100:80".parse().unwrap(),
            "10.0.0.101:80".parse().unwrap(),
        );
        let web_task = tokio::spawn(std::future::pending::<()>());
        let api_task = tokio::spawn(std::future::pending::<()>());
        state
            .watches
            .insert((web, "/lb/web/".into()), web_task.abort_handle());
        state
            .watches
            .insert((api, "/lb/api/".into()), api_task.abort_handle());
        state.note_applied(&update("10.0.0.100:80", 8), false, Nanos(0));
        // The dropped VIP's watch in backoff (etcd unreachable for it), at
        // a higher revision than the kept one's.
        let slot = |name: &str, prefix: &str, connected: bool, revision: i64| {
            let slot = super::super::watch::VipStatus {
                name: name.into(),
                prefix: prefix.into(),
                ..Default::default()
            };
            slot.connected
                .store(connected, std::sync::atomic::Ordering::Relaxed);
            slot.revision
                .store(revision, std::sync::atomic::Ordering::Relaxed);
            slot
        };
        let status = Arc::new(DiscoveryStatus {
            vips: vec![
                slot("10.0.0.100:80/tcp", "/lb/web/", false, 99),
                slot("10.0.0.101:80/tcp", "/lb/api/", true, 5),
            ],
            ..Default::default()
        });
        state.status = Some(status.clone());
        assert!(!status.connected());
        let ended = state.end_watches(|vip, prefix| *vip == api && prefix == "/lb/api/");
        assert_eq!(ended, [(web, "/lb/web/".to_string())]);
        // Metrics leave the ended watch out of `connected`; the highest
        // revision applied does not go back.
        assert!(status.connected());
        assert_eq!(status.revision(), 99);
        assert!(web_task.await.unwrap_err().is_cancelled());
        assert_eq!(state.due_reapplies(Nanos(u64::MAX / 2)), []);
        tokio::task::yield_now().await;
        assert!(!api_task.is_finished());
        assert_eq!(state.end_watches(|_, _| true), []);
        assert_eq!(state.watches.len(), 1);
        status.vips[1]
            .connected
            .store(false, std::sync::atomic::Ordering::Relaxed);
        assert!(!status.connected(), "the running watch is down");
        state.end_watches(|_, _| false);
        assert!(status.connected(), "no watch runs: none is down");
        assert!(api_task.await.unwrap_err().is_cancelled());
    }
}
