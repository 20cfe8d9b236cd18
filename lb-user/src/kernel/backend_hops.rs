//! Forgetting the data path's shared next hop of a backend
//! ([`lb_common::BACKEND_HOPS_MAP`]: per CPU, by backend id).
//!
//! New flows to a backend start with the hop that a flow to it last
//! resolved on their CPU, for as long as that hop is younger than
//! [`lb_common::BACKEND_HOP_JIFFIES`]. Once the backend's MAC changes or its
//! neighbour entry goes, that hop sends to a MAC the backend no longer has:
//! the neighbour sync reports the address
//! ([`super::neighbours::NeighbourSync::take_changed_addrs`]), and every
//! backend id at that address (one per VIP the backend serves) has its hop
//! zeroed on every CPU, so the next new flow resolves its hop afresh.

use std::{collections::BTreeMap, net::IpAddr, path::Path};

use anyhow::Context as _;
use aya::maps::PerCpuValues;
use lb_common::BackendHop;

use crate::kernel::maps;

/// Where the hops are zeroed: the pinned map in the daemon, a record of
/// the ids in unit tests.
pub trait HopTable {
    /// Zeroes backend `id`'s hop on every CPU.
    fn clear(&mut self, id: u32) -> anyhow::Result<()>;
}

/// The pinned `BACKEND_HOPS`, with the number of possible CPUs (a per-CPU
/// write gives one value per possible CPU).
pub struct PinnedHops {
    map: maps::BackendHops,
    cpus: usize,
}

impl PinnedHops {
    pub fn open(pin_dir: &Path) -> anyhow::Result<Self> {
        let cpus = aya::util::nr_cpus()
            .map_err(|(_, e)| e)
            .context("counting possible CPUs")?;
        Ok(Self {
            map: maps::backend_hops(pin_dir)?,
            cpus,
        })
    }
}

impl HopTable for PinnedHops {
    fn clear(&mut self, id: u32) -> anyhow::Result<()> {
        let zeroed = PerCpuValues::try_from(vec![BackendHop::default(); self.cpus])
            .context("zeroed per-CPU hops")?;
        self.map
            .set(id, zeroed, 0)
            .with_context(|| format!("zeroing BACKEND_HOPS[{id}]"))
    }
}

/// The backend ids at each backend address: a backend behind several VIPs
/// has one id (and one shared hop) per VIP.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BackendIds(BTreeMap<IpAddr, Vec<u32>>);

impl BackendIds {
    /// Every backend address, each once.
    pub fn addrs(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.0.keys().copied()
    }

    /// The ids at `ip` (none for an address that is no backend's).
    pub fn at(&self, ip: &IpAddr) -> &[u32] {
        self.0.get(ip).map_or(&[], Vec::as_slice)
    }
}

impl FromIterator<(u32, IpAddr)> for BackendIds {
    fn from_iter<I: IntoIterator<Item = (u32, IpAddr)>>(pairs: I) -> Self {
        let mut ids: BTreeMap<IpAddr, Vec<u32>> = BTreeMap::new();
        for (id, ip) in pairs {
            ids.entry(ip).or_default().push(id);
        }
        for at in ids.values_mut() {
            at.sort_unstable();
            at.dedup();
        }
        Self(ids)
    }
}

/// The shared hops of the backends, by address: what the neighbour task
/// zeroes when an address's neighbour entry changed.
pub struct BackendHops<T = PinnedHops> {
    table: T,
    ids: BackendIds,
}

impl<T: HopTable> BackendHops<T> {
    pub fn new(table: T, ids: BackendIds) -> Self {
        Self { table, ids }
    }

    /// Follows a change of the backend set (or of their ids).
    pub fn set_ids(&mut self, ids: BackendIds) {
        self.ids = ids;
    }

    /// Zeroes the hops of every backend id at `addrs`. Every id is tried
    /// even after one fails (the others' hops are as stale); the first
    /// failure is returned, with how many there were.
    pub fn forget(&mut self, addrs: &[IpAddr]) -> anyhow::Result<()> {
        let mut failed = 0usize;
        let mut first = None;
        for ip in addrs {
            for &id in self.ids.at(ip) {
                if let Err(e) = self.table.clear(id) {
                    failed += 1;
                    first.get_or_insert(e.context(format!("backend {ip}")));
                }
            }
        }
        match first {
            None => Ok(()),
            Some(e) => Err(e.context(format!(
                "{failed} backend next hop(s) not forgotten; new flows may use the old MAC \
                 until the hop ages out"
            ))),
        }
    }

    #[cfg(test)]
    fn table(&self) -> &T {
        &self.table
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    /// Records the ids it zeroes; refuses the ids in `refused`.
    #[derive(Default)]
    struct Recorded {
        cleared: Vec<u32>,
        refused: Vec<u32>,
    }

    impl HopTable for Recorded {
        fn clear(&mut self, id: u32) -> anyhow::Result<()> {
            if self.refused.contains(&id) {
                anyhow::bail!("refused {id}");
            }
            self.cleared.push(id);
            Ok(())
        }
    }

    fn ip4(last: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(10, 0, 0, last))
    }

    /// Backend 21 behind three VIPs (ids 0, 4, 7), 22 behind one (id 1).
    fn ids() -> BackendIds {
        [(4, ip4(21)), (1, ip4(22)), (0, ip4(21)), (7, ip4(21))]
            .into_iter()
            .collect()
    }

    #[test]
    fn ids_are_grouped_by_address() {
        let ids = ids();
        assert_eq!(ids.at(&ip4(21)), [0, 4, 7]);
        assert_eq!(ids.at(&ip4(22)), [1]);
        assert!(ids.at(&ip4(23)).is_empty());
        assert_eq!(ids.addrs().collect::<Vec<_>>(), [ip4(21), ip4(22)]);
    }

    #[test]
    fn every_id_at_a_changed_address_is_forgotten_and_no_other() {
        let mut hops = BackendHops::new(Recorded::default(), ids());
        hops.forget(&[ip4(21)]).unwrap();
        assert_eq!(hops.table().cleared, [0, 4, 7]);
        // Not a backend's address (any more): nothing to forget.
        hops.forget(&[ip4(99)]).unwrap();
        hops.forget(&[]).unwrap();
        assert_eq!(hops.table().cleared, [0, 4, 7]);
        // The ids follow the backend set.
        hops.set_ids([(3, ip4(99))].into_iter().collect());
        hops.forget(&[ip4(21), ip4(99)]).unwrap();
        assert_eq!(hops.table().cleared, [0, 4, 7, 3]);
    }

    #[test]
    fn a_refused_id_leaves_the_others_forgotten_and_is_reported() {
        let table = Recorded {
            refused: vec![4],
            ..Recorded::default()
        };
        let mut hops = BackendHops::new(table, ids());
        let err = hops.forget(&[ip4(21), ip4(22)]).unwrap_err();
        assert_eq!(hops.table().cleared, [0, 7, 1]);
        let text = format!("{err:#}");
        assert!(text.contains("1 backend next hop(s)"), "{text}");
        assert!(text.contains("refused 4"), "{text}");
    }
}
