//! Each zone's connections as a Prometheus counter that only grows.

use std::{
    collections::{BTreeMap, HashMap},
    net::SocketAddr,
};

use crate::settings::zone::ZoneName;

/// A zone: its VIP (as the metrics label it) and its name.
pub type ZoneKey = (String, Option<ZoneName>);

/// The connections each zone's backends opened, as a counter that only
/// grows (`lb_zone_new_connections_total`). Summing the kernel's `opened`
/// over a zone's members at each scrape made it fall whenever a member
/// left the zone (moved, or removed and its id freed, which zeroes its
/// counters): Prometheus reads a fall as a reset and counts the rest
/// again. Instead each member's increase since the last scrape is added to
/// the zone it is in now, and what a zone counted stays counted. A process
/// that re-adopted a running program starts every zone at 0 (its first
/// scrape only takes each member's count as its start): the kernel's
/// counts survive in the pins, but not those of members gone since, so
/// starting from them would be a fall too. A fresh start's counts are all
/// its own, and count from the first scrape on.
#[derive(Debug, Default)]
pub struct ZoneOpened {
    /// Counts are increases (after a fresh start, or the first scrape of
    /// an adopted one).
    primed: bool,
    /// Per backend id and address (an id freed and reused by another
    /// backend is another member): its `opened` at the last scrape.
    seen: HashMap<(u32, Option<SocketAddr>), u64>,
    totals: BTreeMap<ZoneKey, u64>,
}

impl ZoneOpened {
    /// `adopted`: the process re-adopted a running program and its counts.
    pub fn new(adopted: bool) -> Self {
        Self {
            primed: !adopted,
            ..Self::default()
        }
    }

    /// Backend `id`, in zone `key`, has opened `opened` connections (the
    /// kernel's count, which starts again from 0 when the id is reused).
    pub fn observe(&mut self, id: (u32, Option<SocketAddr>), key: &ZoneKey, opened: u64) {
        let total = self.totals.entry(key.clone()).or_default();
        let before = self.seen.insert(id, opened);
        if !self.primed {
            return;
        }
        let before = before.unwrap_or(0);
        let increase = if opened >= before {
            opened - before
        } else {
            opened
        };
        *total = total.saturating_add(increase);
    }

    /// Ends a scrape: forgets the members for which `gone` says so (their
    /// ids freed or taken by another backend), so that churn does not grow
    /// the map.
    pub fn end_scrape(&mut self, gone: impl Fn(u32, Option<SocketAddr>) -> bool) {
        self.seen.retain(|&(id, addr), _| !gone(id, addr));
        self.primed = true;
    }

    pub fn total(&self, key: &ZoneKey) -> u64 {
        self.totals.get(key).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_zones_connection_count_never_falls() {
        let zone = |z: &str| ("10.0.0.100:80/tcp".to_string(), Some(z.parse().unwrap()));
        let (a, b) = (zone("a"), zone("b"));
        let mut z = ZoneOpened::new(true);
        let member = |id: u32, last: u8| (id, Some(SocketAddr::from(([10, 0, 0, last], 80))));
        let none = |_: u32, _: Option<SocketAddr>| false;
        // A process that re-adopted the pins (counts of 1,000 and 500):
        // every zone starts at 0.
        z.observe(member(0, 21), &a, 1000);
        z.observe(member(1, 22), &a, 500);
        z.end_scrape(none);
        assert_eq!(z.total(&a), 0);
        z.observe(member(0, 21), &a, 1400);
        z.observe(member(1, 22), &a, 600);
        z.end_scrape(none);
        assert_eq!(z.total(&a), 500);
        // Backend 1 moves to zone b: a keeps what it counted, b counts on.
        z.observe(member(0, 21), &a, 1410);
        z.observe(member(1, 22), &b, 620);
        assert_eq!((z.total(&a), z.total(&b)), (510, 20));
        // Backend 0 is removed and its id freed, then reused (its counters
        // zeroed) by a new backend of zone b, which opened 2,000 by the
        // next scrape: all of them count.
        z.observe(member(0, 25), &b, 2000);
        assert_eq!((z.total(&a), z.total(&b)), (510, 2020));
        z.observe(member(0, 25), &b, 2010);
        assert_eq!(z.total(&b), 2030);
        // A counter that fell under the same member (read torn, or zeroed
        // in between) counts from zero.
        z.observe(member(1, 22), &b, 5);
        assert_eq!(z.total(&b), 2035);
        // Gone members are forgotten; the totals stay.
        z.end_scrape(|id, addr| id == 1 || addr == member(0, 21).1);
        assert_eq!(z.seen.len(), 1);
        assert_eq!(z.total(&b), 2035);
    }

    /// A fresh start's counters are its own: its first scrape counts them.
    #[test]
    fn a_fresh_start_counts_from_its_first_scrape() {
        let a = ("10.0.0.100:80/tcp".to_string(), Some("a".parse().unwrap()));
        let mut z = ZoneOpened::new(false);
        z.observe((0, None), &a, 300);
        assert_eq!(z.total(&a), 300);
    }
}
