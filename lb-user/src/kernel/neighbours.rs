//! Next-hop MACs for the data path's fallback map ([`lb_common::NEIGHBOURS_MAP`]).
//!
//! The XDP program asks `bpf_fib_lookup` first; it fails when the kernel has
//! no neighbour entry yet, because XDP cannot trigger ARP itself. So the
//! control plane makes the kernel resolve every backend (a zero-byte UDP
//! datagram to the discard port makes the kernel ARP without touching the
//! backend's service, and NDP likewise for IPv6) and mirrors the complete
//! neighbours of the interface into the map, read with one rtnetlink dump
//! (`RTM_GETNEIGH`, both families; no process is forked).

use std::{
    collections::HashMap as StdHashMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket},
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

    /// Mirrors the interface's usable neighbours (both families) into the map. With `warn_unresolved`, says
    /// which backends have no entry (at startup only: backends behind a
    /// router never get one, and repeating that every few seconds is noise).
    ///
    /// Fail static: a dump that fails leaves the map as it is, and the
    /// error is returned.
    pub fn sync(&mut self, warn_unresolved: bool) -> anyhow::Result<()> {
        let dumped = faults::check(Fault::Neighbours).and_then(|()| {
            netlink::dump(self.ifindex).context("dumping neighbours over rtnetlink")
        });
        let found = match dumped {
            Ok(found) => found,
            // Fail static: the map stays as it is.
            Err(e) => return Err(e.context("neighbours not refreshed (kept as they were)")),
        };
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
        let gone: Vec<IpKey> = self
            .map
            .keys()
            .filter_map(Result::ok)
            .filter(|k| !wanted.contains_key(k))
            .collect();
        for key in gone {
            let _ = self.map.remove(&key);
        }
        for ip in self.backends.iter().filter(|_| warn_unresolved) {
            if !wanted.contains_key(&ip_key(*ip)) {
                warn!(backend = %ip, iface = %self.iface, "no neighbour entry yet (relying on bpf_fib_lookup or a router)");
            }
        }
        Ok(())
    }
}

/// The neighbour table over rtnetlink: one `RTM_GETNEIGH` dump.
mod netlink {
    use std::{
        io,
        net::{IpAddr, Ipv4Addr, Ipv6Addr},
        os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    };

    /// `struct ndmsg`.
    const NDMSG_LEN: usize = 12;
    const NLMSG_HDR_LEN: usize = 16;
    /// States whose link-layer address can be used.
    const USABLE: u16 = libc::NUD_REACHABLE
        | libc::NUD_STALE
        | libc::NUD_DELAY
        | libc::NUD_PROBE
        | libc::NUD_PERMANENT
        | libc::NUD_NOARP;

    fn align(len: usize) -> usize {
        (len + 3) & !3
    }

    /// The usable neighbours of interface `ifindex`, both families.
    pub fn dump(ifindex: u32) -> anyhow::Result<Vec<(IpAddr, [u8; 6])>> {
        // SAFETY: plain socket(2); the fd is owned below.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::NETLINK_ROUTE,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error().into());
        }
        // SAFETY: fd is a fresh descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let mut request = [0u8; NLMSG_HDR_LEN + NDMSG_LEN];
        let len = request.len() as u32;
        request[0..4].copy_from_slice(&len.to_ne_bytes());
        request[4..6].copy_from_slice(&libc::RTM_GETNEIGH.to_ne_bytes());
        let flags = (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16;
        request[6..8].copy_from_slice(&flags.to_ne_bytes());
        request[8..12].copy_from_slice(&1u32.to_ne_bytes());
        // ndm_family AF_UNSPEC (0): both families.
        // SAFETY: the buffer is valid for its length; the kernel is the peer.
        let sent = unsafe { libc::send(fd.as_raw_fd(), request.as_ptr().cast(), request.len(), 0) };
        if sent < 0 {
            return Err(io::Error::last_os_error().into());
        }
        let mut found = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            // SAFETY: the buffer is valid for its length.
            let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e.into());
            }
            if n == 0 {
                anyhow::bail!("the neighbour dump ended without NLMSG_DONE");
            }
            if parse(&buf[..n as usize], ifindex, &mut found)? {
                return Ok(found);
            }
        }
    }

    /// Parses one datagram of the dump into `found`; true at its end.
    pub fn parse(
        mut data: &[u8],
        ifindex: u32,
        found: &mut Vec<(IpAddr, [u8; 6])>,
    ) -> anyhow::Result<bool> {
        let u16_at = |b: &[u8], at: usize| u16::from_ne_bytes([b[at], b[at + 1]]);
        let u32_at =
            |b: &[u8], at: usize| u32::from_ne_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
        while data.len() >= NLMSG_HDR_LEN {
            let len = u32_at(data, 0) as usize;
            if len < NLMSG_HDR_LEN || len > data.len() {
                anyhow::bail!("malformed netlink message ({len} of {} bytes)", data.len());
            }
            let kind = u16_at(data, 4);
            let body = &data[NLMSG_HDR_LEN..len];
            match kind as libc::c_int {
                libc::NLMSG_DONE => return Ok(true),
                libc::NLMSG_ERROR => {
                    let code = body
                        .get(0..4)
                        .map_or(0, |b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
                    if code != 0 {
                        return Err(io::Error::from_raw_os_error(-code).into());
                    }
                }
                _ if kind == libc::RTM_NEWNEIGH && body.len() >= NDMSG_LEN => {
                    if let Some(entry) = neighbour(body, ifindex) {
                        found.push(entry);
                    }
                }
                _ => {}
            }
            data = &data[align(len).min(data.len())..];
        }
        Ok(false)
    }

    /// One `RTM_NEWNEIGH` body: its address and MAC, if it is usable and
    /// on `ifindex`.
    fn neighbour(body: &[u8], ifindex: u32) -> Option<(IpAddr, [u8; 6])> {
        let family = body[0];
        let index = u32::from_ne_bytes([body[4], body[5], body[6], body[7]]);
        let state = u16::from_ne_bytes([body[8], body[9]]);
        if index != ifindex || state & USABLE == 0 {
            return None;
        }
        let (mut ip, mut mac) = (None, None);
        let mut attrs = &body[NDMSG_LEN..];
        while attrs.len() >= 4 {
            let len = usize::from(u16::from_ne_bytes([attrs[0], attrs[1]]));
            let kind = u16::from_ne_bytes([attrs[2], attrs[3]]);
            if len < 4 || len > attrs.len() {
                return None;
            }
            let value = &attrs[4..len];
            match (kind, value.len()) {
                (libc::NDA_DST, 4) if family == libc::AF_INET as u8 => {
                    ip = Some(IpAddr::V4(Ipv4Addr::new(
                        value[0], value[1], value[2], value[3],
                    )));
                }
                (libc::NDA_DST, 16) if family == libc::AF_INET6 as u8 => {
                    let octets: [u8; 16] = value.try_into().ok()?;
                    ip = Some(IpAddr::V6(Ipv6Addr::from(octets)));
                }
                (libc::NDA_LLADDR, 6) => mac = value.try_into().ok(),
                _ => {}
            }
            attrs = &attrs[align(len).min(attrs.len())..];
        }
        let mac: [u8; 6] = mac.filter(|m| *m != [0; 6])?;
        Some((ip?, mac))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One `RTM_NEWNEIGH` message: family, ifindex, state, then NDA_DST and
    /// NDA_LLADDR (if given), as the kernel lays them out.
    fn message(family: u8, ifindex: u32, state: u16, dst: &[u8], mac: Option<[u8; 6]>) -> Vec<u8> {
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
        msg.extend(libc::RTM_NEWNEIGH.to_ne_bytes());
        msg.extend([0u8; 10]);
        msg.extend(body);
        msg
    }

    fn done() -> Vec<u8> {
        let mut msg = Vec::new();
        msg.extend(20u32.to_ne_bytes());
        msg.extend((libc::NLMSG_DONE as u16).to_ne_bytes());
        msg.extend([0u8; 14]);
        msg
    }

    const MAC: [u8; 6] = [0x0a, 0x1b, 0x2c, 0x3d, 0x4e, 0x5f];

    #[test]
    fn keeps_usable_neighbours_of_the_interface_from_a_dump() {
        let v6: std::net::Ipv6Addr = "fd00:213::21".parse().unwrap();
        let mut datagram = Vec::new();
        datagram.extend(message(
            libc::AF_INET as u8,
            7,
            libc::NUD_REACHABLE,
            &[10, 0, 0, 21],
            Some(MAC),
        ));
        // Another interface, an incomplete entry, no MAC: left out.
        datagram.extend(message(
            libc::AF_INET as u8,
            8,
            libc::NUD_REACHABLE,
            &[10, 0, 0, 22],
            Some(MAC),
        ));
        datagram.extend(message(
            libc::AF_INET as u8,
            7,
            libc::NUD_INCOMPLETE,
            &[10, 0, 0, 23],
            Some(MAC),
        ));
        datagram.extend(message(
            libc::AF_INET as u8,
            7,
            libc::NUD_STALE,
            &[10, 0, 0, 24],
            None,
        ));
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
                (IpAddr::V4(Ipv4Addr::new(10, 0, 0, 21)), MAC),
                (IpAddr::V6(v6), MAC)
            ]
        );
    }

    #[test]
    fn a_truncated_or_failed_dump_is_an_error() {
        let msg = message(
            libc::AF_INET as u8,
            7,
            libc::NUD_REACHABLE,
            &[10, 0, 0, 21],
            Some(MAC),
        );
        let mut found = Vec::new();
        assert!(netlink::parse(&msg[..msg.len() - 4], 7, &mut found).is_err());
        let mut error = Vec::new();
        error.extend(36u32.to_ne_bytes());
        error.extend((libc::NLMSG_ERROR as u16).to_ne_bytes());
        error.extend([0u8; 10]);
        error.extend((-libc::EPERM).to_ne_bytes());
        error.extend([0u8; 16]);
        let err = netlink::parse(&error, 7, &mut found).unwrap_err();
        assert!(err.to_string().contains("not permitted"), "{err}");
    }

    #[test]
    fn dumps_the_live_neighbour_table() {
        // Loopback has no neighbours; the dump itself must work unprivileged.
        let found = netlink::dump(1).unwrap();
        assert!(found.is_empty(), "{found:?}");
    }
}
