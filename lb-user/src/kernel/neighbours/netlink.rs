//! The neighbour table over rtnetlink, parsed with `netlink-packet-route`:
//! one `RTM_GETNEIGH` dump (both families), and a socket subscribed to the
//! neighbour multicast group (`RTNLGRP_NEIGH`) that reports every
//! `RTM_NEWNEIGH`/`RTM_DELNEIGH` as it happens.

use std::{io, net::IpAddr, time::Duration};

use anyhow::Context as _;
use netlink_packet_core::{
    NLM_F_DUMP, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_route::{
    AddressFamily, RouteNetlinkMessage,
    neighbour::{
        NeighbourAddress, NeighbourAttribute, NeighbourFlags, NeighbourMessage, NeighbourState,
    },
};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

use super::Change;

/// `RTNLGRP_NEIGH` (linux/rtnetlink.h).
const RTNLGRP_NEIGH: u32 = 3;
/// Receive buffer of the subscribed socket: a burst of changes (a whole
/// subnet re-resolving) fits before the kernel reports an overrun.
const EVENT_RCVBUF: usize = 1 << 20;
/// How long one read of the dump may wait for the kernel.
const DUMP_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Large enough for any datagram the kernel sends on a route socket.
pub const DATAGRAM_MAX: usize = 64 * 1024;

fn align(len: usize) -> usize {
    (len + 3) & !3
}

/// The usable neighbours of interface `ifindex`, both families, as
/// [`Change::Learnt`] entries (one dump; a failed or truncated dump is an
/// error).
pub fn dump(ifindex: u32) -> anyhow::Result<Vec<(IpAddr, [u8; 6])>> {
    let mut socket = Socket::new(NETLINK_ROUTE).context("opening a route netlink socket")?;
    socket.bind_auto().context("binding the netlink socket")?;
    set_read_timeout(&socket, DUMP_READ_TIMEOUT)?;
    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST | NLM_F_DUMP;
    header.sequence_number = 1;
    // AF_UNSPEC: both families.
    let mut request = NetlinkMessage::new(
        header,
        NetlinkPayload::InnerMessage(RouteNetlinkMessage::GetNeighbour(
            NeighbourMessage::default(),
        )),
    );
    request.finalize();
    let mut bytes = vec![0u8; request.buffer_len()];
    request.serialize(&mut bytes);
    socket
        .send_to(&bytes, &SocketAddr::new(0, 0), 0)
        .context("sending RTM_GETNEIGH")?;
    let mut changes = Vec::new();
    let mut buf = Vec::with_capacity(DATAGRAM_MAX);
    loop {
        buf.clear();
        match socket.recv(&mut buf, 0) {
            Ok(0) => anyhow::bail!("the neighbour dump ended without NLMSG_DONE"),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(anyhow::Error::from(e).context("reading the neighbour dump")),
        }
        if parse(&buf, ifindex, &mut changes)? {
            break;
        }
    }
    Ok(changes
        .into_iter()
        .filter_map(|c| match c {
            Change::Learnt(ip, mac) => Some((ip, mac)),
            Change::Lost(_) => None,
        })
        .collect())
}

fn set_read_timeout(socket: &Socket, timeout: Duration) -> anyhow::Result<()> {
    let tv = libc::timeval {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_usec: timeout.subsec_micros() as libc::suseconds_t,
    };
    // SAFETY: setsockopt(2) with a valid timeval of the right size.
    let rc = unsafe {
        libc::setsockopt(
            std::os::fd::AsRawFd::as_raw_fd(socket),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&raw const tv).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(anyhow::Error::from(io::Error::last_os_error()).context("SO_RCVTIMEO"));
    }
    Ok(())
}

/// A non-blocking route socket that receives the neighbour group.
pub fn subscribe() -> anyhow::Result<Socket> {
    let mut socket = Socket::new(NETLINK_ROUTE).context("opening a route netlink socket")?;
    socket.bind_auto().context("binding the netlink socket")?;
    // Best effort: the default buffer works, only overruns come sooner.
    let _ = socket.set_rx_buf_sz(EVENT_RCVBUF);
    socket
        .add_membership(RTNLGRP_NEIGH)
        .context("joining the neighbour multicast group")?;
    socket
        .set_non_blocking(true)
        .context("making the netlink socket non-blocking")?;
    Ok(socket)
}

/// Parses one datagram (of a dump or of the multicast group) into
/// `changes`: the neighbour messages about interface `ifindex`, in order.
/// True at the end of a dump (`NLMSG_DONE`). A truncated or malformed
/// message, or an `NLMSG_ERROR` with an error, is an error.
pub fn parse(mut data: &[u8], ifindex: u32, changes: &mut Vec<Change>) -> anyhow::Result<bool> {
    while !data.is_empty() {
        let message = NetlinkMessage::<RouteNetlinkMessage>::deserialize(data)
            .map_err(|e| anyhow::anyhow!("malformed netlink message: {e}"))?;
        let len = message.header.length as usize;
        if len < 16 || len > data.len() {
            anyhow::bail!("malformed netlink message ({len} of {} bytes)", data.len());
        }
        match message.payload {
            NetlinkPayload::Done(_) => return Ok(true),
            NetlinkPayload::Error(e) => {
                if let Some(code) = e.code {
                    return Err(io::Error::from_raw_os_error(-code.get()).into());
                }
            }
            NetlinkPayload::Overrun(_) => anyhow::bail!("netlink overrun"),
            NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewNeighbour(n)) => {
                changes.extend(change(&n, ifindex, false));
            }
            NetlinkPayload::InnerMessage(RouteNetlinkMessage::DelNeighbour(n)) => {
                changes.extend(change(&n, ifindex, true));
            }
            _ => {}
        }
        data = &data[align(len).min(data.len())..];
    }
    Ok(false)
}

/// What one neighbour message says about an IP address of `ifindex`:
/// a usable MAC (reachable, stale, delay, probe, permanent, noarp), or
/// none any more (`FAILED`, or deleted). Entries being resolved
/// (`INCOMPLETE`, `NONE`) say nothing; proxy entries and other families
/// (bridge FDB) are not neighbours of the interface.
fn change(n: &NeighbourMessage, ifindex: u32, deleted: bool) -> Option<Change> {
    let h = &n.header;
    if h.ifindex != ifindex
        || h.flags.contains(NeighbourFlags::Proxy)
        || !matches!(h.family, AddressFamily::Inet | AddressFamily::Inet6)
    {
        return None;
    }
    let (mut ip, mut mac) = (None, None);
    for attr in &n.attributes {
        match attr {
            NeighbourAttribute::Destination(NeighbourAddress::Inet(a)) => ip = Some(IpAddr::V4(*a)),
            NeighbourAttribute::Destination(NeighbourAddress::Inet6(a)) => {
                ip = Some(IpAddr::V6(*a));
            }
            NeighbourAttribute::LinkLayerAddress(a) => {
                mac = <[u8; 6]>::try_from(a.as_slice()).ok();
            }
            _ => {}
        }
    }
    let ip = ip?;
    if deleted {
        return Some(Change::Lost(ip));
    }
    match h.state {
        NeighbourState::Failed => Some(Change::Lost(ip)),
        NeighbourState::Reachable
        | NeighbourState::Stale
        | NeighbourState::Delay
        | NeighbourState::Probe
        | NeighbourState::Permanent
        | NeighbourState::Noarp => mac.filter(|m| *m != [0; 6]).map(|m| Change::Learnt(ip, m)),
        _ => None,
    }
}
