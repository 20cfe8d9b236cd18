//! Next-hop MACs for the data path's fallback map ([`lb_common::NEIGHBOURS_MAP`]).
//!
//! The XDP program asks `bpf_fib_lookup` first; it fails when the kernel has
//! no neighbour entry yet, because XDP cannot trigger ARP itself. So the
//! control plane makes the kernel resolve every backend (a zero-byte UDP
//! datagram to the discard port makes the kernel ARP without touching the
//! backend's service, and NDP likewise for IPv6) and keeps the map equal to
//! the kernel's usable neighbour entries for the backends' addresses on the
//! balancer's interface (IPv4 and IPv6), through rtnetlink ([`netlink`]; no
//! process is forked):
//!
//! - changes as they happen, from the neighbour multicast group
//!   (`RTM_NEWNEIGH`/`RTM_DELNEIGH`): [`NeighbourSync::apply`];
//! - a full `RTM_GETNEIGH` dump at start, after a membership change, after
//!   the multicast socket overran, and every [`RESYNC_INTERVAL`] as a safety
//!   net: [`NeighbourSync::sync`].
//!
//! An address is in the map while the kernel has a usable MAC for it
//! (reachable, stale, delay, probe, permanent, noarp). An entry that
//! `FAILED` or was deleted is removed, as the dump would (the kernel itself
//! no longer sends to that MAC), and the backend is probed again so the
//! kernel resolves it anew. Entries being resolved (`INCOMPLETE`) change
//! nothing. Other interfaces and addresses that are not backends are ignored.
//!
//! Every address whose MAC changes or whose entry is removed is noted
//! ([`NeighbourSync::take_changed_addrs`]): the data path's shared next hops
//! to it may hold the old MAC, and the caller forgets them
//! ([`super::backend_hops`]).

pub mod netlink;

use std::{
    collections::{BTreeSet, HashMap as StdHashMap, HashSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket},
    time::Duration,
};

use anyhow::Context as _;
use lb_common::{IpKey, Neighbour};
use tracing::{debug, info, warn};

use crate::{
    kernel::{maps::Neighbours, wire},
    settings::faults::{self, Fault},
};

/// How often the full dump re-reads the neighbour table (a safety net: the
/// multicast group reports every change as it happens).
pub const RESYNC_INTERVAL: Duration = Duration::from_secs(30);
/// Time the kernel gets to answer ARP before the first map write at startup.
pub const STARTUP_RESOLVE_WAIT: Duration = Duration::from_millis(300);
/// RFC 863 discard: nothing listens there, so a probe never reaches a service.
const DISCARD_PORT: u16 = 9;

/// Makes the kernel resolve `ip` (ARP or NDP) by sending it one empty datagram.
pub fn probe(ip: IpAddr) {
    let unspecified: IpAddr = match ip {
        IpAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
        IpAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
    };
    let result = UdpSocket::bind((unspecified, 0))
        .and_then(|s| s.send_to(&[], SocketAddr::new(ip, DISCARD_PORT)));
    if let Err(e) = result {
        debug!(%ip, "neighbour probe failed: {e}");
    }
}

fn ip_key(ip: IpAddr) -> IpKey {
    let (addr, family) = wire::ip_to_words(ip);
    IpKey {
        addr,
        family,
        _pad: [0; 3],
    }
}

/// What one neighbour message says about an address of the interface.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    /// The kernel has a usable MAC for the address.
    Learnt(IpAddr, [u8; 6]),
    /// It has none any more: the entry `FAILED` or was deleted.
    Lost(IpAddr),
}

/// What [`NeighbourSync::apply`] did with a change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    /// Not a backend: left alone.
    Ignored,
    /// The map already said so.
    Unchanged,
    /// The backend's entry was written (new or a changed MAC).
    Written,
    /// The backend's entry was removed (or there was none to remove).
    Removed,
}

/// Where the neighbours go: the pinned map in the daemon, a plain hash map
/// in unit tests.
pub trait NeighbourTable {
    fn get(&self, key: &IpKey) -> Option<Neighbour>;
    fn insert(&mut self, key: IpKey, value: Neighbour) -> anyhow::Result<()>;
    /// Removing a key that is not there is not an error.
    fn remove(&mut self, key: &IpKey) -> anyhow::Result<()>;
    fn keys(&self) -> anyhow::Result<Vec<IpKey>>;
}

impl NeighbourTable for Neighbours {
    fn get(&self, key: &IpKey) -> Option<Neighbour> {
        aya::maps::HashMap::get(self, key, 0).ok()
    }

    fn insert(&mut self, key: IpKey, value: Neighbour) -> anyhow::Result<()> {
        aya::maps::HashMap::insert(self, key, value, 0).context("writing NEIGHBOURS")
    }

    fn remove(&mut self, key: &IpKey) -> anyhow::Result<()> {
        match aya::maps::HashMap::remove(self, key) {
            Ok(()) => Ok(()),
            Err(aya::maps::MapError::SyscallError(e))
                if e.io_error.raw_os_error() == Some(libc::ENOENT) =>
            {
                Ok(())
            }
            Err(e) => Err(e).context("removing from NEIGHBOURS"),
        }
    }

    fn keys(&self) -> anyhow::Result<Vec<IpKey>> {
        aya::maps::HashMap::keys(self)
            .collect::<Result<_, _>>()
            .context("listing NEIGHBOURS")
    }
}

impl NeighbourTable for StdHashMap<IpKey, Neighbour> {
    fn get(&self, key: &IpKey) -> Option<Neighbour> {
        StdHashMap::get(self, key).copied()
    }

    fn insert(&mut self, key: IpKey, value: Neighbour) -> anyhow::Result<()> {
        StdHashMap::insert(self, key, value);
        Ok(())
    }

    fn remove(&mut self, key: &IpKey) -> anyhow::Result<()> {
        StdHashMap::remove(self, key);
        Ok(())
    }

    fn keys(&self) -> anyhow::Result<Vec<IpKey>> {
        Ok(StdHashMap::keys(self).copied().collect())
    }
}

/// Keeps NEIGHBOURS equal to the kernel's usable entries for the backends'
/// addresses on the balancer's interface.
pub struct NeighbourSync<T = Neighbours> {
    table: T,
    iface: String,
    ifindex: u32,
    backends: HashSet<IpAddr>,
    /// Addresses whose MAC changed or whose entry was removed since the
    /// caller last took them (see [`Self::take_changed_addrs`]).
    changed: BTreeSet<IpAddr>,
}

impl<T: NeighbourTable> NeighbourSync<T> {
    pub fn new(table: T, iface: &str, ifindex: u32, backends: Vec<IpAddr>) -> Self {
        Self {
            table,
            iface: iface.to_string(),
            ifindex,
            backends: backends.into_iter().collect(),
            changed: BTreeSet::new(),
        }
    }

    pub fn ifindex(&self) -> u32 {
        self.ifindex
    }

    pub fn is_backend(&self, ip: &IpAddr) -> bool {
        self.backends.contains(ip)
    }

    /// Replaces the backends' addresses; returns the ones that are new.
    pub fn set_backends(&mut self, backends: impl IntoIterator<Item = IpAddr>) -> Vec<IpAddr> {
        let backends: HashSet<IpAddr> = backends.into_iter().collect();
        let added = backends.difference(&self.backends).copied().collect();
        self.backends = backends;
        added
    }

    pub fn probe_backends(&self) {
        for ip in &self.backends {
            probe(*ip);
        }
    }

    fn value(&self, mac: [u8; 6]) -> Neighbour {
        Neighbour {
            mac,
            _pad: [0; 2],
            ifindex: self.ifindex,
        }
    }

    /// The addresses whose entry got another MAC or was removed since the
    /// last call, each once, in order. The data path's shared next hops to
    /// them may still hold a MAC the backend no longer has, and new flows
    /// would start with it until it ages out (`BACKEND_HOP_JIFFIES`). A
    /// first MAC is not reported: a hop resolved while the map had none
    /// came from the kernel's own entry (`bpf_fib_lookup`), and a hop kept
    /// from before a removal was forgotten with the removal.
    pub fn take_changed_addrs(&mut self) -> Vec<IpAddr> {
        std::mem::take(&mut self.changed).into_iter().collect()
    }

    /// Writes `ip`'s entry over `old` (what the map had), noting the
    /// address as changed if the MAC is another; returns whether it was.
    fn write(
        &mut self,
        ip: IpAddr,
        old: Option<Neighbour>,
        value: Neighbour,
    ) -> anyhow::Result<bool> {
        self.table.insert(ip_key(ip), value)?;
        let changed = old.is_some_and(|old| old.mac != value.mac);
        if changed {
            self.changed.insert(ip);
        }
        Ok(changed)
    }

    /// Removes the entry at `key` and notes its address as changed (a key
    /// of no known family has no address, and no backend's hop).
    fn remove(&mut self, key: &IpKey) -> anyhow::Result<()> {
        self.table.remove(key)?;
        if let Some(ip) = wire::words_to_ip(key.addr, key.family) {
            self.changed.insert(ip);
        }
        Ok(())
    }

    /// Applies one change the kernel reported (already filtered to the
    /// interface by [`netlink::parse`]): only backends' addresses are
    /// written or removed.
    pub fn apply(&mut self, change: Change) -> anyhow::Result<Applied> {
        let ip = match change {
            Change::Learnt(ip, _) | Change::Lost(ip) => ip,
        };
        if !self.backends.contains(&ip) {
            return Ok(Applied::Ignored);
        }
        let key = ip_key(ip);
        let old = self.table.get(&key);
        match change {
            Change::Learnt(_, mac) => {
                let value = self.value(mac);
                if old == Some(value) {
                    return Ok(Applied::Unchanged);
                }
                let changed = self.write(ip, old, value)?;
                if let Some(old) = old.filter(|_| changed) {
                    info!(backend = %ip, old = %mac_text(old.mac), new = %mac_text(mac), "backend MAC changed");
                } else {
                    debug!(backend = %ip, mac = %mac_text(mac), "backend MAC learnt");
                }
                Ok(Applied::Written)
            }
            Change::Lost(_) => {
                if old.is_none() {
                    return Ok(Applied::Unchanged);
                }
                self.remove(&key)?;
                info!(backend = %ip, iface = %self.iface, "backend neighbour entry failed or was deleted");
                Ok(Applied::Removed)
            }
        }
    }

    /// Makes the map equal to a full dump of the interface's neighbours
    /// (both families), for the backends' addresses. With `warn_unresolved`,
    /// says which backends have no entry (at startup only: backends behind a
    /// router never get one, and repeating that is noise).
    ///
    /// Fail static: a dump that fails leaves the map as it is, and the
    /// error is returned.
    pub fn sync(&mut self, warn_unresolved: bool) -> anyhow::Result<()> {
        let dumped = faults::check(Fault::Neighbours).and_then(|()| {
            netlink::dump(self.ifindex).context("dumping neighbours over rtnetlink")
        });
        match dumped {
            Ok(found) => self.sync_from(found, warn_unresolved),
            // Fail static: the map stays as it is.
            Err(e) => Err(e.context("neighbours not refreshed (kept as they were)")),
        }
    }

    /// [`Self::sync`] with the dump's entries given: writes the backends'
    /// entries that differ and removes every other key (entries that
    /// failed, addresses that are no longer backends).
    pub fn sync_from(
        &mut self,
        found: Vec<(IpAddr, [u8; 6])>,
        warn_unresolved: bool,
    ) -> anyhow::Result<()> {
        let wanted: StdHashMap<IpKey, (IpAddr, Neighbour)> = found
            .into_iter()
            .filter(|(ip, _)| self.backends.contains(ip))
            .map(|(ip, mac)| (ip_key(ip), (ip, self.value(mac))))
            .collect();
        for (key, (ip, value)) in &wanted {
            let old = self.table.get(key);
            if old != Some(*value) {
                self.write(*ip, old, *value)?;
            }
        }
        for key in self.table.keys()? {
            if !wanted.contains_key(&key) {
                self.remove(&key)?;
            }
        }
        for ip in self.backends.iter().filter(|_| warn_unresolved) {
            if !wanted.contains_key(&ip_key(*ip)) {
                warn!(backend = %ip, iface = %self.iface, "no neighbour entry yet (relying on bpf_fib_lookup or a router)");
            }
        }
        Ok(())
    }

    #[cfg(test)]
    fn table(&self) -> &T {
        &self.table
    }
}

fn mac_text(mac: [u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One neighbour message of type `kind` (`RTM_NEWNEIGH`/`RTM_DELNEIGH`):
    /// family, ifindex, state, then NDA_DST and NDA_LLADDR (if given), laid
    /// out by hand as the kernel does (linux/neighbour.h), independently of
    /// the parser under test.
    fn message_of(
        kind: u16,
        family: u8,
        ifindex: u32,
        state: u16,
        dst: &[u8],
        mac: Option<[u8; 6]>,
    ) -> Vec<u8> {
        let mut body = vec![family, 0, 0, 0];
        body.extend(ifindex.to_ne_bytes());
        body.extend(state.to_ne_bytes());
        body.extend([0, 0]);
        let mut attr = |kind: u16, value: &[u8]| {
            body.extend(((4 + value.len()) as u16).to_ne_bytes());
            body.extend(kind.to_ne_bytes());
            body.extend(value);
            while body.len() % 4 != 0 {
                body.push(0);
            }
        };
        attr(libc::NDA_DST, dst);
        if let Some(mac) = mac {
            attr(libc::NDA_LLADDR, &mac);
        }
        let mut msg = Vec::new();
        msg.extend(((16 + body.len()) as u32).to_ne_bytes());
        msg.extend(kind.to_ne_bytes());
        msg.extend([0u8; 10]);
        msg.extend(body);
        msg
    }

    fn message(family: u8, ifindex: u32, state: u16, dst: &[u8], mac: Option<[u8; 6]>) -> Vec<u8> {
        message_of(libc::RTM_NEWNEIGH, family, ifindex, state, dst, mac)
    }

    fn v4(ifindex: u32, state: u16, last: u8, mac: Option<[u8; 6]>) -> Vec<u8> {
        message(libc::AF_INET as u8, ifindex, state, &[10, 0, 0, last], mac)
    }

    fn done() -> Vec<u8> {
        let mut msg = Vec::new();
        msg.extend(20u32.to_ne_bytes());
        msg.extend((libc::NLMSG_DONE as u16).to_ne_bytes());
        msg.extend([0u8; 14]);
        msg
    }

    fn parsed(datagram: &[u8], ifindex: u32) -> Vec<Change> {
        let mut changes = Vec::new();
        netlink::parse(datagram, ifindex, &mut changes).unwrap();
        changes
    }

    const MAC: [u8; 6] = [0x0a, 0x1b, 0x2c, 0x3d, 0x4e, 0x5f];
    const MOVED: [u8; 6] = [0x0a, 0x1b, 0x2c, 0x3d, 0x4e, 0x60];

    fn ip4(last: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(10, 0, 0, last))
    }

    #[test]
    fn keeps_usable_neighbours_of_the_interface_from_a_dump() {
        let v6: std::net::Ipv6Addr = "fd00:213::21".parse().unwrap();
        let mut datagram = Vec::new();
        datagram.extend(v4(7, libc::NUD_REACHABLE, 21, Some(MAC)));
        // Another interface, an incomplete entry, no MAC: left out.
        datagram.extend(v4(8, libc::NUD_REACHABLE, 22, Some(MAC)));
        datagram.extend(v4(7, libc::NUD_INCOMPLETE, 23, Some(MAC)));
        datagram.extend(v4(7, libc::NUD_STALE, 24, None));
        datagram.extend(message(
            libc::AF_INET6 as u8,
            7,
            libc::NUD_STALE,
            &v6.octets(),
            Some(MAC),
        ));
        let mut found = Vec::new();
        assert!(!netlink::parse(&datagram, 7, &mut found).unwrap());
        assert!(netlink::parse(&done(), 7, &mut found).unwrap());
        assert_eq!(
            found,
            [
                Change::Learnt(ip4(21), MAC),
                Change::Learnt(IpAddr::V6(v6), MAC)
            ]
        );
    }

    #[test]
    fn failed_and_deleted_entries_are_lost_and_others_say_nothing() {
        assert_eq!(
            parsed(&v4(7, libc::NUD_FAILED, 21, None), 7),
            [Change::Lost(ip4(21))]
        );
        let deleted = message_of(
            libc::RTM_DELNEIGH,
            libc::AF_INET as u8,
            7,
            libc::NUD_STALE,
            &[10, 0, 0, 21],
            Some(MAC),
        );
        assert_eq!(parsed(&deleted, 7), [Change::Lost(ip4(21))]);
        // Deleted on another interface, or a bridge FDB entry: not ours.
        assert!(parsed(&deleted, 8).is_empty());
        let fdb = message_of(
            libc::RTM_NEWNEIGH,
            libc::AF_BRIDGE as u8,
            7,
            libc::NUD_REACHABLE,
            &[10, 0, 0, 21],
            Some(MAC),
        );
        assert!(parsed(&fdb, 7).is_empty());
        // Being resolved: neither learnt nor lost.
        assert!(parsed(&v4(7, libc::NUD_INCOMPLETE, 21, None), 7).is_empty());
        assert!(parsed(&v4(7, libc::NUD_NONE, 21, None), 7).is_empty());
        // Permanent and noarp entries are usable; an all-zero MAC is not.
        assert_eq!(
            parsed(&v4(7, libc::NUD_PERMANENT, 21, Some(MAC)), 7),
            [Change::Learnt(ip4(21), MAC)]
        );
        assert!(parsed(&v4(7, libc::NUD_REACHABLE, 21, Some([0; 6])), 7).is_empty());
    }

    #[test]
    fn a_truncated_or_failed_dump_is_an_error() {
        let msg = v4(7, libc::NUD_REACHABLE, 21, Some(MAC));
        let mut found = Vec::new();
        assert!(netlink::parse(&msg[..msg.len() - 4], 7, &mut found).is_err());
        // Shorter than a header, and a length beyond the datagram.
        assert!(netlink::parse(&msg[..10], 7, &mut found).is_err());
        let mut long = msg.clone();
        long[0..4].copy_from_slice(&((msg.len() + 8) as u32).to_ne_bytes());
        assert!(netlink::parse(&long, 7, &mut found).is_err());
        let mut error = Vec::new();
        error.extend(36u32.to_ne_bytes());
        error.extend((libc::NLMSG_ERROR as u16).to_ne_bytes());
        error.extend([0u8; 10]);
        error.extend((-libc::EPERM).to_ne_bytes());
        error.extend([0u8; 16]);
        let err = netlink::parse(&error, 7, &mut found).unwrap_err();
        assert!(err.to_string().contains("not permitted"), "{err}");
        assert!(found.is_empty(), "{found:?}");
    }

    #[test]
    fn no_cut_or_corrupted_datagram_panics() {
        let mut datagram = v4(7, libc::NUD_REACHABLE, 21, Some(MAC));
        datagram.extend(message_of(
            libc::RTM_DELNEIGH,
            libc::AF_INET6 as u8,
            7,
            libc::NUD_FAILED,
            &[0xfd; 16],
            None,
        ));
        for cut in 0..datagram.len() {
            let mut changes = Vec::new();
            let _ = netlink::parse(&datagram[..cut], 7, &mut changes);
        }
        for at in 0..datagram.len() {
            for byte in [0x00, 0x01, 0x7f, 0xff] {
                let mut bad = datagram.clone();
                bad[at] = byte;
                let mut changes = Vec::new();
                let _ = netlink::parse(&bad, 7, &mut changes);
            }
        }
    }

    fn sync(backends: &[u8]) -> NeighbourSync<StdHashMap<IpKey, Neighbour>> {
        NeighbourSync::new(
            StdHashMap::new(),
            "eth0",
            7,
            backends.iter().map(|b| ip4(*b)).collect(),
        )
    }

    fn mac_of(sync: &NeighbourSync<StdHashMap<IpKey, Neighbour>>, last: u8) -> Option<[u8; 6]> {
        NeighbourTable::get(sync.table(), &ip_key(ip4(last))).map(|n| {
            assert_eq!(n.ifindex, 7);
            n.mac
        })
    }

    /// Parses a multicast datagram and applies what it says.
    fn receive(
        sync: &mut NeighbourSync<StdHashMap<IpKey, Neighbour>>,
        datagram: &[u8],
    ) -> Vec<Applied> {
        parsed(datagram, sync.ifindex())
            .into_iter()
            .map(|c| sync.apply(c).unwrap())
            .collect()
    }

    #[test]
    fn a_backends_new_or_changed_mac_is_written_at_once() {
        let mut s = sync(&[21, 22]);
        assert_eq!(
            receive(&mut s, &v4(7, libc::NUD_REACHABLE, 21, Some(MAC))),
            [Applied::Written]
        );
        assert_eq!(mac_of(&s, 21), Some(MAC));
        // STALE → REACHABLE with the same MAC: nothing to write.
        assert_eq!(
            receive(&mut s, &v4(7, libc::NUD_STALE, 21, Some(MAC))),
            [Applied::Unchanged]
        );
        assert_eq!(
            receive(&mut s, &v4(7, libc::NUD_STALE, 21, Some(MOVED))),
            [Applied::Written]
        );
        assert_eq!(mac_of(&s, 21), Some(MOVED));
        assert_eq!(mac_of(&s, 22), None);
    }

    #[test]
    fn a_changed_mac_reports_its_address_and_a_first_or_the_same_mac_nothing() {
        let mut s = sync(&[21, 22]);
        assert!(s.take_changed_addrs().is_empty());
        // A first MAC: no hop can hold another one from the map.
        receive(&mut s, &v4(7, libc::NUD_REACHABLE, 21, Some(MAC)));
        receive(&mut s, &v4(7, libc::NUD_REACHABLE, 22, Some(MAC)));
        assert!(s.take_changed_addrs().is_empty());
        receive(&mut s, &v4(7, libc::NUD_REACHABLE, 21, Some(MOVED)));
        assert_eq!(s.take_changed_addrs(), [ip4(21)]);
        // Taken: reported once.
        assert!(s.take_changed_addrs().is_empty());
        // The same MAC again, in another state: the hops stay right.
        receive(&mut s, &v4(7, libc::NUD_STALE, 21, Some(MOVED)));
        receive(&mut s, &v4(7, libc::NUD_PERMANENT, 21, Some(MOVED)));
        assert!(s.take_changed_addrs().is_empty());
        // Changed MACs of two backends, one of them twice before the take:
        // each address once, in order.
        receive(&mut s, &v4(7, libc::NUD_REACHABLE, 22, Some(MOVED)));
        receive(&mut s, &v4(7, libc::NUD_STALE, 21, Some(MAC)));
        receive(&mut s, &v4(7, libc::NUD_STALE, 21, Some(MOVED)));
        assert_eq!(s.take_changed_addrs(), [ip4(21), ip4(22)]);
        // Not a backend, or another interface: nothing written, nothing reported.
        receive(&mut s, &v4(7, libc::NUD_REACHABLE, 99, Some(MOVED)));
        receive(&mut s, &v4(8, libc::NUD_REACHABLE, 21, Some(MOVED)));
        receive(&mut s, &v4(7, libc::NUD_FAILED, 99, None));
        assert!(s.take_changed_addrs().is_empty());
    }

    #[test]
    fn a_lost_entry_reports_its_address_once() {
        let mut s = sync(&[21, 22]);
        receive(&mut s, &v4(7, libc::NUD_REACHABLE, 21, Some(MAC)));
        s.take_changed_addrs();
        assert_eq!(
            receive(&mut s, &v4(7, libc::NUD_FAILED, 21, None)),
            [Applied::Removed]
        );
        assert_eq!(s.take_changed_addrs(), [ip4(21)]);
        // Lost again, or lost without ever being learnt: nothing removed.
        receive(&mut s, &v4(7, libc::NUD_FAILED, 21, None));
        receive(&mut s, &v4(7, libc::NUD_FAILED, 22, None));
        assert!(s.take_changed_addrs().is_empty());
    }

    #[test]
    fn other_addresses_and_interfaces_are_ignored() {
        let mut s = sync(&[21]);
        // Not a backend.
        assert_eq!(
            receive(&mut s, &v4(7, libc::NUD_REACHABLE, 99, Some(MAC))),
            [Applied::Ignored]
        );
        // A backend's address, but on another interface.
        assert!(receive(&mut s, &v4(8, libc::NUD_REACHABLE, 21, Some(MAC))).is_empty());
        assert!(s.table().is_empty());
        // The lost entry of a non-backend leaves a backend alone.
        receive(&mut s, &v4(7, libc::NUD_REACHABLE, 21, Some(MAC)));
        assert_eq!(
            receive(&mut s, &v4(7, libc::NUD_FAILED, 99, None)),
            [Applied::Ignored]
        );
        assert_eq!(mac_of(&s, 21), Some(MAC));
    }

    #[test]
    fn a_failed_or_deleted_backend_entry_is_removed() {
        let mut s = sync(&[21, 22]);
        receive(&mut s, &v4(7, libc::NUD_REACHABLE, 21, Some(MAC)));
        receive(&mut s, &v4(7, libc::NUD_REACHABLE, 22, Some(MAC)));
        assert_eq!(
            receive(&mut s, &v4(7, libc::NUD_FAILED, 21, None)),
            [Applied::Removed]
        );
        assert_eq!(mac_of(&s, 21), None);
        let deleted = message_of(
            libc::RTM_DELNEIGH,
            libc::AF_INET as u8,
            7,
            libc::NUD_STALE,
            &[10, 0, 0, 22],
            Some(MAC),
        );
        assert_eq!(receive(&mut s, &deleted), [Applied::Removed]);
        assert!(s.table().is_empty());
        // Again: nothing left to remove.
        assert_eq!(receive(&mut s, &deleted), [Applied::Unchanged]);
        // An entry being resolved again keeps nothing from coming back.
        assert!(receive(&mut s, &v4(7, libc::NUD_INCOMPLETE, 21, None)).is_empty());
        assert_eq!(
            receive(&mut s, &v4(7, libc::NUD_REACHABLE, 21, Some(MOVED))),
            [Applied::Written]
        );
        assert_eq!(mac_of(&s, 21), Some(MOVED));
    }

    #[test]
    fn a_dump_keeps_only_the_backends_and_follows_the_backend_set() {
        let mut s = sync(&[21, 22]);
        // What an older instance left: a non-backend and a stale MAC.
        let (at_99, moved) = (s.value(MAC), s.value(MOVED));
        NeighbourTable::insert(&mut s.table, ip_key(ip4(99)), at_99).unwrap();
        NeighbourTable::insert(&mut s.table, ip_key(ip4(21)), moved).unwrap();
        s.sync_from(vec![(ip4(21), MAC), (ip4(22), MAC), (ip4(98), MAC)], false)
            .unwrap();
        assert_eq!(mac_of(&s, 21), Some(MAC));
        assert_eq!(mac_of(&s, 22), Some(MAC));
        assert_eq!(s.table().len(), 2);
        // 21 changed and 99 went; 22 is a first MAC, 98 no backend.
        assert_eq!(s.take_changed_addrs(), [ip4(21), ip4(99)]);
        // The same dump again changes nothing.
        s.sync_from(vec![(ip4(21), MAC), (ip4(22), MAC), (ip4(98), MAC)], false)
            .unwrap();
        assert!(s.take_changed_addrs().is_empty());
        // 22 leaves, 98 joins.
        let added = s.set_backends([ip4(21), ip4(98)]);
        assert_eq!(added, [ip4(98)]);
        assert!(s.is_backend(&ip4(98)) && !s.is_backend(&ip4(22)));
        s.sync_from(
            vec![(ip4(21), MAC), (ip4(22), MAC), (ip4(98), MOVED)],
            false,
        )
        .unwrap();
        assert_eq!(mac_of(&s, 22), None);
        assert_eq!(mac_of(&s, 98), Some(MOVED));
        // 22 went (no backend any more); 98's MAC is a first one.
        assert_eq!(s.take_changed_addrs(), [ip4(22)]);
        // A backend missing from the dump (failed, deleted) is removed.
        s.sync_from(vec![(ip4(98), MOVED)], false).unwrap();
        assert_eq!(mac_of(&s, 21), None);
        assert_eq!(s.table().len(), 1);
        assert_eq!(s.take_changed_addrs(), [ip4(21)]);
    }

    #[test]
    fn a_dump_reports_the_ipv6_address_it_moves_or_removes() {
        let v6: IpAddr = "fd00:213::21".parse().unwrap();
        let mut s = NeighbourSync::new(StdHashMap::new(), "eth0", 7, vec![v6]);
        s.sync_from(vec![(v6, MAC)], false).unwrap();
        s.sync_from(vec![(v6, MOVED)], false).unwrap();
        assert_eq!(s.take_changed_addrs(), [v6]);
        s.sync_from(Vec::new(), false).unwrap();
        assert!(s.table().is_empty());
        assert_eq!(s.take_changed_addrs(), [v6]);
    }

    #[test]
    fn dumps_the_live_neighbour_table() {
        // Loopback has no neighbours; the dump itself must work unprivileged.
        let found = netlink::dump(1).unwrap();
        assert!(found.is_empty(), "{found:?}");
    }

    #[test]
    fn subscribes_to_the_neighbour_group() {
        // Joining the group needs no privilege; nothing is pending yet on a
        // non-blocking socket (or only real neighbour news of this host).
        let socket = netlink::subscribe().unwrap();
        let mut buf = Vec::with_capacity(netlink::DATAGRAM_MAX);
        match socket.recv(&mut buf, 0) {
            Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock, "{e}"),
            Ok(_) => {
                let mut changes = Vec::new();
                netlink::parse(&buf, 1, &mut changes).unwrap();
            }
        }
    }
}
