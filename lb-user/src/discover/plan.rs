//! What one discovery update changes in a VIP's pool: backends to add,
//! to re-weight and to remove, with two guards.
//!
//! - **Removal cap.** At most `max_removal_percent` of the pool's current
//!   members (rounded down, but at least one) are removed by one update,
//!   and never the last one: a deleted prefix, or a half-written one,
//!   cannot empty a pool. At least one, because a pool smaller than
//!   100/P members would otherwise never lose one (3 members at 30%).
//!   The rest is deferred; the next update removes the next share (not a
//!   timer: retried every second, the cap would only pace a deleted
//!   prefix's emptying of the pool).
//! - **Zones.** A backend is known by its address: a new zone for one in
//!   the pool is a change of it (`rezone`), like a new weight.
//! - **Operator overrides.** A backend whose weight an operator set keeps
//!   that weight until the override is cleared; a drained backend stays
//!   drained (an update never undrains). Removing one still applies: a
//!   removed backend drains anyway.

use std::{collections::BTreeMap, net::SocketAddr};

use super::entry::Entry;
use crate::settings::zone::ZoneName;

/// A member of the running pool, as the plan needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    pub addr: SocketAddr,
    /// The configured weight (before smoothing and slow start).
    pub weight: u32,
    /// Removed and still draining its flows (not a member any more).
    pub removed: bool,
    /// An operator set its weight; etcd's weight waits.
    pub weight_overridden: bool,
    /// The zone the pool has for it.
    pub zone: Option<ZoneName>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// New (or removed and now back) backends.
    pub add: Vec<Entry>,
    /// (address, new weight).
    pub reweight: Vec<(SocketAddr, u32)>,
    /// (address, new zone) of members whose zone changed.
    pub rezone: Vec<(SocketAddr, Option<ZoneName>)>,
    pub remove: Vec<SocketAddr>,
    /// Removals held back by the cap.
    pub deferred: usize,
}

impl Changes {
    pub fn is_empty(&self) -> bool {
        self.add.is_empty()
            && self.reweight.is_empty()
            && self.rezone.is_empty()
            && self.remove.is_empty()
    }
}

/// The changes that move `pool` towards `wanted`.
pub fn plan(pool: &[Member], wanted: &[Entry], max_removal_percent: u32) -> Changes {
    let live: BTreeMap<SocketAddr, &Member> = pool
        .iter()
        .filter(|m| !m.removed)
        .map(|m| (m.addr, m))
        .collect();
    let wanted_by: BTreeMap<SocketAddr, &Entry> = wanted.iter().map(|e| (e.addr, e)).collect();
    let mut changes = Changes::default();
    for (addr, e) in &wanted_by {
        let Some(m) = live.get(addr) else {
            changes.add.push((*e).clone());
            continue;
        };
        if m.weight != e.weight && !m.weight_overridden {
            changes.reweight.push((*addr, e.weight));
        }
        if m.zone != e.zone {
            changes.rezone.push((*addr, e.zone));
        }
    }
    let gone: Vec<SocketAddr> = live
        .keys()
        .filter(|a| !wanted_by.contains_key(a))
        .copied()
        .collect();
    let by_share = (live.len() * max_removal_percent.min(100) as usize / 100).max(1);
    changes.remove = gone;
    changes.trim_removals(by_share);
    changes.keep_one(live.len(), changes.add.len());
    changes
}

impl Changes {
    /// Defers the removals beyond the first `allowed`.
    fn trim_removals(&mut self, allowed: usize) {
        let allowed = allowed.min(self.remove.len());
        self.deferred += self.remove.len() - allowed;
        self.remove.truncate(allowed);
    }

    /// Whether the update these changes came from is to be planned again
    /// (every second), `failed` of them having failed: only then. Removals
    /// the cap deferred wait for the next update: retried on a timer, the
    /// cap would only pace the emptying of a pool whose prefix was deleted
    /// (20 backends at 50% down to 1 in four seconds).
    pub fn retry(&self, failed: usize) -> bool {
        failed > 0
    }

    /// Never the last member: of `live` members plus `added` new ones, at
    /// least one stays. The plan counts every add; the daemon calls this
    /// again with the adds that took, since a full VIP refuses some and
    /// removing the old ones then would empty the pool.
    pub fn keep_one(&mut self, live: usize, added: usize) {
        self.trim_removals((live + added).saturating_sub(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(i: u8) -> SocketAddr {
        SocketAddr::from(([10, 0, 0, i], 80))
    }

    fn member(i: u8, weight: u32) -> Member {
        Member {
            addr: addr(i),
            weight,
            removed: false,
            weight_overridden: false,
            zone: None,
        }
    }

    fn entry(i: u8, weight: u32) -> Entry {
        Entry {
            addr: addr(i),
            weight,
            zone: None,
        }
    }

    #[test]
    fn adds_reweights_and_removes_the_difference() {
        let pool = [member(1, 1), member(2, 1), member(3, 1), member(4, 1)];
        let wanted = [entry(1, 1), entry(2, 5), entry(3, 1), entry(9, 2)];
        let c = plan(&pool, &wanted, 50);
        assert_eq!(c.add, [entry(9, 2)]);
        assert_eq!(c.reweight, [(addr(2), 5)]);
        assert_eq!(c.remove, [addr(4)]);
        assert_eq!(c.deferred, 0);
        assert!(
            plan(
                &pool,
                &[entry(1, 1), entry(2, 1), entry(3, 1), entry(4, 1)],
                50
            )
            .is_empty()
        );
    }

    #[test]
    fn a_new_zone_is_a_change_of_the_member_and_a_new_member_brings_its_zone() {
        let z = |n: &str| Some(n.parse::<ZoneName>().unwrap());
        let mut in_a = member(1, 1);
        in_a.zone = z("a");
        let mut to_b = entry(1, 1);
        to_b.zone = z("b");
        let mut new = entry(2, 1);
        new.zone = z("a");
        let c = plan(&[in_a.clone()], &[to_b, new.clone()], 50);
        assert_eq!(c.rezone, [(addr(1), z("b"))]);
        assert_eq!(c.add, [new.clone()]);
        assert_eq!(c.add[0].backend().zone, z("a"));
        assert!(c.reweight.is_empty());
        // Losing its zone is a change too; the same zone is none.
        let c = plan(&[in_a.clone()], &[entry(1, 1)], 50);
        assert_eq!(c.rezone, [(addr(1), None)]);
        let mut same = entry(1, 1);
        same.zone = z("a");
        assert!(plan(&[in_a], &[same], 50).is_empty());
    }

    #[test]
    fn a_deleted_prefix_removes_at_most_the_cap_and_never_the_last() {
        let pool: Vec<Member> = (1..=10).map(|i| member(i, 1)).collect();
        let c = plan(&pool, &[], 50);
        assert_eq!(c.remove.len(), 5);
        assert_eq!(c.deferred, 5);
        let c = plan(&pool, &[], 100);
        assert_eq!(c.remove.len(), 9, "the last one stays");
        assert_eq!(plan(&[member(1, 1)], &[], 100).remove, []);
        assert_eq!(plan(&[member(1, 1)], &[entry(2, 1)], 100).remove, [addr(1)]);
        let c = plan(&pool, &[], 10);
        assert_eq!((c.remove.len(), c.deferred), (1, 9));
    }

    #[test]
    fn a_small_pool_still_loses_one_member_per_update() {
        // 3 × 30% rounds down to 0: the cap must not keep a dead backend
        // in a pool smaller than 100/P forever.
        let pool = [member(1, 1), member(2, 1), member(3, 1)];
        let c = plan(&pool, &[entry(1, 1), entry(2, 1)], 30);
        assert_eq!((c.remove, c.deferred), (vec![addr(3)], 0));
        // Two gone at once: one now, the other deferred.
        let c = plan(&pool, &[entry(1, 1)], 30);
        assert_eq!((c.remove.len(), c.deferred), (1, 1));
    }

    #[test]
    fn a_lone_backend_is_replaced_in_one_update_and_never_leaves_zero() {
        let c = plan(&[member(1, 1)], &[entry(2, 1)], 50);
        assert_eq!(c.add, [entry(2, 1)]);
        assert_eq!(c.remove, [addr(1)], "the new one is added, the old removed");
        assert_eq!(c.deferred, 0);
        // With nothing to add, the last member stays whatever the cap.
        let c = plan(&[member(1, 1)], &[], 30);
        assert_eq!((c.remove.len(), c.deferred), (0, 1));
        let c = plan(&[member(1, 1), member(2, 1)], &[], 30);
        assert_eq!((c.remove.len(), c.deferred), (1, 1));
    }

    #[test]
    fn a_replacement_whose_add_failed_keeps_the_old_member() {
        let mut c = plan(&[member(1, 1)], &[entry(2, 1)], 50);
        c.keep_one(1, 0);
        assert_eq!((c.remove.len(), c.deferred), (0, 1));
        let mut c = plan(&[member(1, 1), member(2, 1)], &[entry(3, 1)], 100);
        assert_eq!(c.remove.len(), 2);
        c.keep_one(2, 0);
        assert_eq!((c.remove, c.deferred), (vec![addr(1)], 1));
    }

    #[test]
    fn removed_members_come_back_and_overrides_keep_their_weight() {
        let mut gone = member(1, 1);
        gone.removed = true;
        let mut pinned = member(2, 7);
        pinned.weight_overridden = true;
        let c = plan(
            &[gone, pinned, member(3, 1)],
            &[entry(1, 1), entry(2, 3), entry(3, 1)],
            50,
        );
        assert_eq!(c.add, [entry(1, 1)]);
        assert_eq!(c.reweight, []);
        assert!(c.remove.is_empty());
    }

    #[test]
    fn the_same_inputs_give_the_same_changes_whatever_the_pool_order() {
        let a = [member(3, 1), member(1, 1), member(2, 1)];
        let b = [member(2, 1), member(3, 1), member(1, 1)];
        let wanted = [entry(4, 1)];
        assert_eq!(plan(&a, &wanted, 100), plan(&b, &wanted, 100));
    }

    /// A deleted prefix: the cap removes half, and what it deferred is not
    /// retried on a timer (it would be a pace, not a cap); a failed add is.
    #[test]
    fn only_failed_changes_are_retried_not_the_caps_deferrals() {
        let pool: Vec<Member> = (1..=20).map(|i| member(i, 1)).collect();
        let c = plan(&pool, &[], 50);
        assert_eq!((c.remove.len(), c.deferred), (10, 10));
        assert!(!c.retry(0), "the cap's deferral was retried");
        let c = plan(&pool[..1], &[entry(2, 1)], 50);
        assert!(c.retry(1), "a failed add was not retried");
    }
}
