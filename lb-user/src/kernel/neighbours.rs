//! Next-hop MACs for the data path's fallback map ([`lb_common::NEIGHBOURS_MAP`]).
//!
//! The XDP program asks `bpf_fib_lookup` first; it fails when the kernel has
//! no neighbour entry yet, because XDP cannot trigger ARP itself. So the
//! control plane makes the kernel resolve every backend (a zero-byte UDP
//! datagram to the discard port makes the kernel ARP without touching the
//! backend's service, and NDP likewise for IPv6) and mirrors the complete
//! neighbours of the interface into the map: IPv4 from /proc/net/arp, IPv6
//! from `ip -6 neigh show dev IFACE`.

use std::{
    collections::HashMap as StdHashMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket},
    process::Command,
    time::Duration,
};

use anyhow::Context as _;
use lb_common::{IpKey, Neighbour};
use tracing::{debug, warn};

use crate::{
    kernel::{maps::Neighbours, wire},
    settings::faults::{self, Fault},
};

/// How often neighbours are refreshed.
pub const REFRESH_INTERVAL: Duration = Duration::from_secs(5);
/// Time the kernel gets to answer ARP before the first map write at startup.
pub const STARTUP_RESOLVE_WAIT: Duration = Duration::from_millis(300);
/// RFC 863 discard: nothing listens there, so a probe never reaches a service.
const DISCARD_PORT: u16 = 9;
/// `ATF_COM` in /proc/net/arp's flags column: the entry has a complete MAC.
const ATF_COM: u32 = 0x2;
const ARP_TABLE: &str = "/proc/net/arp";

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

/// Complete IPv4 neighbours of `iface` from the text of /proc/net/arp.
pub fn parse_arp_table(text: &str, iface: &str) -> Vec<(Ipv4Addr, [u8; 6])> {
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let cols: Vec<&str> = line.split_whitespace().collect();
            let [ip, _hw_type, flags, mac, _mask, device] = cols[..] else {
                return None;
            };
            let flags = u32::from_str_radix(flags.trim_start_matches("0x"), 16).ok()?;
            if device != iface || flags & ATF_COM == 0 {
                return None;
            }
            Some((ip.parse().ok()?, parse_mac(mac)?))
        })
        .collect()
}

/// IPv6 neighbours with a link-layer address from the text of
/// `ip -6 neigh show dev IFACE` (lines `ADDR lladdr MAC [router] STATE`);
/// entries without one (INCOMPLETE, FAILED) are left out.
pub fn parse_ip6_neigh(text: &str) -> Vec<(Ipv6Addr, [u8; 6])> {
    text.lines()
        .filter_map(|line| {
            let cols: Vec<&str> = line.split_whitespace().collect();
            let ip = cols.first()?.parse().ok()?;
            let at = cols.iter().position(|c| *c == "lladdr")?;
            Some((ip, parse_mac(cols.get(at + 1)?)?))
        })
        .collect()
}

/// Runs `ip -6 neigh show dev IFACE`.
fn ip6_neighbours(iface: &str) -> anyhow::Result<Vec<(Ipv6Addr, [u8; 6])>> {
    let output = Command::new("ip")
        .args(["-6", "neigh", "show", "dev", iface])
        .output()
        .context("running `ip -6 neigh` (is iproute2 installed?)")?;
    if !output.status.success() {
        anyhow::bail!(
            "`ip -6 neigh show dev {iface}` failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(parse_ip6_neigh(&String::from_utf8_lossy(&output.stdout)))
}

fn parse_mac(text: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = text.split(':');
    for byte in &mut mac {
        *byte = u8::from_str_radix(parts.next()?, 16).ok()?;
    }
    (parts.next().is_none() && mac != [0; 6]).then_some(mac)
}

fn ip_key(ip: IpAddr) -> IpKey {
    let (addr, family) = wire::ip_to_words(ip);
    IpKey {
        addr,
        family,
        _pad: [0; 3],
    }
}

/// Keeps NEIGHBOURS equal to the interface's complete ARP entries.
pub struct NeighbourSync {
    map: Neighbours,
    iface: String,
    ifindex: u32,
    backends: Vec<IpAddr>,
}

impl NeighbourSync {
    pub fn new(map: Neighbours, iface: &str, ifindex: u32, backends: Vec<IpAddr>) -> Self {
        Self {
            map,
            iface: iface.to_string(),
            ifindex,
            backends,
        }
    }

    pub fn probe_backends(&self) {
        for ip in &self.backends {
            probe(*ip);
        }
    }

    /// Mirrors /proc/net/arp and the IPv6 neighbours into the map. With `warn_unresolved`, says
    /// which backends have no entry (at startup only: backends behind a
    /// router never get one, and repeating that every few seconds is noise).
    ///
    /// Fail static: a source that cannot be read (the ARP table, or `ip -6
    /// neigh`) leaves its family's entries in the map as they are; the
    /// other family is still brought up to date, and the error returned.
    pub fn sync(&mut self, warn_unresolved: bool) -> anyhow::Result<()> {
        let v4 = faults::check(Fault::Neighbours)
            .and_then(|()| std::fs::read_to_string(ARP_TABLE).context("reading /proc/net/arp"))
            .map(|text| {
                parse_arp_table(&text, &self.iface)
                    .into_iter()
                    .map(|(ip, mac)| (IpAddr::V4(ip), mac))
                    .collect::<Vec<_>>()
            });
        let v6 = ip6_neighbours(&self.iface).map(|found| {
            found
                .into_iter()
                .map(|(ip, mac)| (IpAddr::V6(ip), mac))
                .collect::<Vec<_>>()
        });
        let read_v4 = v4.is_ok();
        let read_v6 = v6.is_ok();
        let mut failed = Vec::new();
        let mut found = Vec::new();
        for source in [v4, v6] {
            match source {
                Ok(entries) => found.extend(entries),
                Err(e) => failed.push(e),
            }
        }
        let wanted: StdHashMap<IpKey, Neighbour> = found
            .into_iter()
            .map(|(ip, mac)| {
                let value = Neighbour {
                    mac,
                    _pad: [0; 2],
                    ifindex: self.ifindex,
                };
                (ip_key(ip), value)
            })
            .collect();
        for (key, value) in &wanted {
            if self.map.get(key, 0).ok() != Some(*value) {
                self.map
                    .insert(key, value, 0)
                    .context("writing NEIGHBOURS")?;
            }
        }
        let read = |key: &IpKey| {
            if key.family == lb_common::AF_INET6 {
                read_v6
            } else {
                read_v4
            }
        };
        let gone: Vec<IpKey> = self
            .map
            .keys()
            .filter_map(Result::ok)
            .filter(|k| read(k) && !wanted.contains_key(k))
            .collect();
        for key in gone {
            let _ = self.map.remove(&key);
        }
        for ip in self.backends.iter().filter(|_| warn_unresolved) {
            if !wanted.contains_key(&ip_key(*ip)) {
                warn!(backend = %ip, iface = %self.iface, "no neighbour entry yet (relying on bpf_fib_lookup or a router)");
            }
        }
        match failed.into_iter().next() {
            Some(e) => Err(e.context("some neighbours were not refreshed (kept as they were)")),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ARP: &str = "\
IP address       HW type     Flags       HW address            Mask     Device
10.0.0.21        0x1         0x2         0a:1b:2c:3d:4e:5f     *        veth0
10.0.0.22        0x1         0x0         00:00:00:00:00:00     *        veth0
10.0.0.23        0x1         0x2         aa:bb:cc:dd:ee:ff     *        eth1
10.0.0.24        0x1         0x6         01:02:03:04:05:06     *        veth0
";

    #[test]
    fn keeps_complete_entries_of_the_interface_only() {
        assert_eq!(
            parse_arp_table(ARP, "veth0"),
            [
                (
                    "10.0.0.21".parse().unwrap(),
                    [0x0a, 0x1b, 0x2c, 0x3d, 0x4e, 0x5f]
                ),
                ("10.0.0.24".parse().unwrap(), [1, 2, 3, 4, 5, 6]),
            ]
        );
        assert_eq!(parse_arp_table("", "veth0"), []);
    }

    #[test]
    fn keeps_ipv6_neighbours_with_a_link_layer_address() {
        let text = "\
fd00:213::21 lladdr 0a:1b:2c:3d:4e:5f REACHABLE
fd00:213::22 lladdr 01:02:03:04:05:06 router STALE
fd00:213::23 INCOMPLETE
fe80::1 FAILED
";
        assert_eq!(
            parse_ip6_neigh(text),
            [
                (
                    "fd00:213::21".parse().unwrap(),
                    [0x0a, 0x1b, 0x2c, 0x3d, 0x4e, 0x5f]
                ),
                ("fd00:213::22".parse().unwrap(), [1, 2, 3, 4, 5, 6]),
            ]
        );
    }

    #[test]
    fn rejects_malformed_macs() {
        assert_eq!(parse_mac("0a:1b:2c:3d:4e"), None);
        assert_eq!(parse_mac("0a:1b:2c:3d:4e:5f:00"), None);
        assert_eq!(parse_mac("zz:1b:2c:3d:4e:5f"), None);
        assert_eq!(parse_mac("00:00:00:00:00:00"), None);
    }
}
