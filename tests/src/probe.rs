//! One-off requests from inside a lab namespace, for tests: a blocking HTTP
//! exchange, a UDP echo, a ping. Each runs on a thread that joined the
//! namespace, with short timeouts so a broken data path fails fast.

use std::{
    net::{Ipv4Addr, SocketAddr, TcpStream, UdpSocket},
    os::fd::FromRawFd,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, ensure};

use crate::{
    http::{Response, blocking_exchange, encode_request},
    lab::in_netns,
};

/// Connect, read and write timeout of probes.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest UDP reply a probe accepts.
const MAX_DATAGRAM: usize = 65_536;

/// A TCP connection opened from namespace `ns` (it stays in `ns`).
pub fn connect(ns: &str, addr: SocketAddr) -> Result<TcpStream> {
    in_netns(ns, || {
        let stream = TcpStream::connect_timeout(&addr, PROBE_TIMEOUT)
            .with_context(|| format!("connecting to {addr} from {ns}"))?;
        stream.set_read_timeout(Some(PROBE_TIMEOUT))?;
        stream.set_write_timeout(Some(PROBE_TIMEOUT))?;
        Ok(stream)
    })
}

/// One request on an open connection; `body` makes it a POST the server echoes.
pub fn request(
    stream: &mut TcpStream,
    path: &str,
    body: &[u8],
    keep_alive: bool,
) -> Result<Response> {
    let method = if body.is_empty() { "GET" } else { "POST" };
    blocking_exchange(stream, &encode_request(method, path, body, keep_alive))
}

/// One request on a new connection from `ns` to `addr`.
pub fn http(ns: &str, addr: SocketAddr, path: &str, body: &[u8]) -> Result<Response> {
    let mut stream = connect(ns, addr)?;
    request(&mut stream, path, body, false)
        .with_context(|| format!("HTTP {path} to {addr} from {ns}"))
}

/// Sends one datagram from a new socket in `ns` and returns the reply.
pub fn udp(ns: &str, addr: SocketAddr, payload: &[u8]) -> Result<Vec<u8>> {
    in_netns(ns, || {
        let any: std::net::IpAddr = if addr.is_ipv6() {
            std::net::Ipv6Addr::UNSPECIFIED.into()
        } else {
            std::net::Ipv4Addr::UNSPECIFIED.into()
        };
        let socket = UdpSocket::bind((any, 0))?;
        socket.set_read_timeout(Some(PROBE_TIMEOUT))?;
        socket.connect(addr)?;
        socket.send(payload)?;
        let mut buf = vec![0u8; MAX_DATAGRAM];
        let n = socket
            .recv(&mut buf)
            .with_context(|| format!("UDP reply from {addr} to {ns}"))?;
        buf.truncate(n);
        Ok(buf)
    })
}

/// Echo requests sent by [`ping`]; every one must be answered.
const PING_COUNT: u16 = 3;
const ICMP_ECHO_REQUEST: u8 = 8;
const ICMP_ECHO_REPLY: u8 = 0;

/// Pings `addr` from `ns` with a raw ICMP socket (no `ping` binary needed);
/// fails unless every echo request gets its reply.
pub fn ping(ns: &str, addr: Ipv4Addr) -> Result<()> {
    in_netns(ns, || {
        // SAFETY: plain socket(2); the descriptor is owned right away.
        let fd = unsafe {
            libc::socket(
                libc::AF_INET,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::IPPROTO_ICMP,
            )
        };
        ensure!(
            fd >= 0,
            "raw ICMP socket: {}",
            std::io::Error::last_os_error()
        );
        // A UdpSocket is only a typed descriptor here: sendto/recvfrom and the
        // receive timeout work the same on a raw socket (the port is ignored).
        // SAFETY: `fd` is a fresh descriptor nothing else owns.
        let socket = unsafe { UdpSocket::from_raw_fd(fd) };
        // wait_for_echo_reply sets the read timeout to the time it has left.
        let id = std::process::id() as u16;
        for seq in 1..=PING_COUNT {
            socket.send_to(&echo_request(id, seq), SocketAddr::from((addr, 0)))?;
            wait_for_echo_reply(&socket, addr, id, seq)
                .with_context(|| format!("ping {addr} from {ns}"))?;
        }
        Ok(())
    })
}

fn echo_request(id: u16, seq: u16) -> Vec<u8> {
    let mut packet = vec![ICMP_ECHO_REQUEST, 0, 0, 0];
    packet.extend_from_slice(&id.to_be_bytes());
    packet.extend_from_slice(&seq.to_be_bytes());
    packet.extend_from_slice(b"lb-lab ping payload");
    let checksum = crate::xdp::packet::checksum(&[&packet]);
    packet[2..4].copy_from_slice(&checksum.to_be_bytes());
    packet
}

/// Reads ICMP packets (raw sockets see every one in the namespace) until the
/// reply to `id`/`seq` from `addr` arrives or [`PROBE_TIMEOUT`] has passed.
/// The deadline is for the whole wait, not each read: other ICMP traffic in
/// the namespace (another test's pings, errors) arriving more often than
/// the timeout would otherwise restart it for ever.
fn wait_for_echo_reply(socket: &UdpSocket, addr: Ipv4Addr, id: u16, seq: u16) -> Result<()> {
    let deadline = Instant::now() + PROBE_TIMEOUT;
    let mut buf = vec![0u8; MAX_DATAGRAM];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        // A zero read timeout would mean none at all.
        ensure!(!left.is_zero(), "no echo reply within {PROBE_TIMEOUT:?}");
        socket.set_read_timeout(Some(left))?;
        let (n, from) = socket.recv_from(&mut buf).context("no echo reply")?;
        let packet = &buf[..n];
        let header_len = usize::from(packet.first().copied().unwrap_or(0) & 0x0f) * 4;
        let Some(icmp) = packet.get(header_len..header_len + 8) else {
            continue;
        };
        let matches = from.ip() == addr
            && icmp[0] == ICMP_ECHO_REPLY
            && icmp[4..6] == id.to_be_bytes()
            && icmp[6..8] == seq.to_be_bytes();
        if matches {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksum_of_a_request_verifies_to_zero() {
        let packet = echo_request(0x1234, 7);
        assert_eq!(crate::xdp::packet::checksum(&[&packet]), 0);
    }
}
