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
/// the zone it is in now, and what a zone counted stays counted.
#[derive(Debug, Default)]
pub struct ZoneOpened {
    /// Per backend id and address (an id freed and reused by another
    /// backend is another member): its `opened` at the last scrape.
    seen: HashMap<(u32, Option<SocketAddr>), u64>,
    totals: BTreeMap<ZoneKey, u64>,
}

impl ZoneOpened {
    /// Backend `id`, in zone `key`, has opened `opened` connections (the
    /// kernel's count, which starts again from 0 when the id is reused).
    pub fn observe(&mut self, id: (u32, Option<SocketAddr>), key: &ZoneKey, opened: u64) {
        let before = self.seen.insert(id, opened).unwrap_or(0);
        let increase = if opened >= before {
            opened - before
        } else {
            opened
        };
        let total = self.totals.entry(key.clone()).or_default();
        *total = total.saturating_add(increase);
    }

    /// Forgets the members for which `gone` says so (their ids freed or
    /// taken by another backend), so that churn does not grow the map.
    pub fn forget(&mut self, gone: impl Fn(u32, Option<SocketAddr>) -> bool) {
        self.seen.retain(|&(id, addr), _| !gone(id, addr));
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
        let mut z = ZoneOpened::default();
        let member = |id: u32, last: u8| (id, Some(SocketAddr::from(([10, 0, 0, last], 80))));
        z.observe(member(0, 21), &a, 1000);
        z.observe(member(1, 22), &a, 500);
        assert_eq!(z.total(&a), 1500);
        // Backend 1 moves to zone b: a keeps what it counted, b counts on.
        z.observe(member(0, 21), &a, 1010);
        z.observe(member(1, 22), &b, 520);
        assert_eq!((z.total(&a), z.total(&b)), (1510, 20));
        // Backend 0 is removed and its id freed, then reused (its counters
        // zeroed) by a new backend of zone b, which opened 2,000 by the
        // next scrape: all of them count.
        z.observe(member(0, 25), &b, 2000);
        assert_eq!((z.total(&a), z.total(&b)), (1510, 2020));
        z.observe(member(0, 25), &b, 2010);
        assert_eq!(z.total(&b), 2030);
        // A counter that fell under the same member (read torn, or zeroed
        // in between) counts from zero.
        z.observe(member(1, 22), &b, 5);
        assert_eq!(z.total(&b), 2035);
        // Gone members are forgotten; the totals stay.
        z.forget(|id, _| id == 1);
        assert_eq!(z.seen.len(), 2);
        assert_eq!(z.total(&b), 2035);
    }
}
