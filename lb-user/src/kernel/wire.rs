//! Conversions between std addresses and the kernel's wire layout: address
//! bytes in network order in four `u32` words (IPv4 in word 0), ports in
//! network byte order (lb_common's conventions).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use lb_common::{AF_INET, AF_INET6, Backend};

/// `(words, family)` for an address.
pub fn ip_to_words(ip: IpAddr) -> ([u32; 4], u8) {
    match ip {
        IpAddr::V4(v4) => ([u32::from_ne_bytes(v4.octets()), 0, 0, 0], AF_INET),
        IpAddr::V6(v6) => {
            let o = v6.octets();
            let word = |i: usize| u32::from_ne_bytes([o[i], o[i + 1], o[i + 2], o[i + 3]]);
            ([word(0), word(4), word(8), word(12)], AF_INET6)
        }
    }
}

/// The address that [`ip_to_words`] encoded; `None` for an unknown family.
pub fn words_to_ip(words: [u32; 4], family: u8) -> Option<IpAddr> {
    match family {
        AF_INET => Some(IpAddr::V4(Ipv4Addr::from(words[0].to_ne_bytes()))),
        AF_INET6 => {
            let mut o = [0u8; 16];
            for (chunk, word) in o.chunks_exact_mut(4).zip(words) {
                chunk.copy_from_slice(&word.to_ne_bytes());
            }
            Some(IpAddr::V6(Ipv6Addr::from(o)))
        }
        _ => None,
    }
}

pub const fn port_to_wire(port: u16) -> u16 {
    port.to_be()
}

pub const fn port_from_wire(port: u16) -> u16 {
    u16::from_be(port)
}

/// Decodes an address and wire port; `None` for an unknown family.
pub fn socket_addr(words: [u32; 4], family: u8, wire_port: u16) -> Option<SocketAddr> {
    words_to_ip(words, family).map(|ip| SocketAddr::new(ip, port_from_wire(wire_port)))
}

/// The BACKENDS entry of the backend at `addr` in VIP `vip_id`, with its
/// `weight` and kernel `state` (`lb_common::BACKEND_*`).
pub fn backend_entry(addr: SocketAddr, vip_id: u32, weight: u32, state: u8) -> Backend {
    let (words, family) = ip_to_words(addr.ip());
    Backend {
        addr: words,
        port: port_to_wire(addr.port()),
        family,
        state,
        vip_id,
        weight,
        in_use: 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv4_sits_in_word_zero_in_packet_order() {
        let (words, family) = ip_to_words("10.0.0.1".parse().unwrap());
        assert_eq!(family, AF_INET);
        assert_eq!(words[0].to_ne_bytes(), [10, 0, 0, 1]);
        assert_eq!(&words[1..], &[0, 0, 0]);
        assert_eq!(port_to_wire(80).to_ne_bytes(), [0, 80]);
    }

    #[test]
    fn round_trips_both_families() {
        for text in ["10.1.2.3:8080", "[2001:db8::7]:443"] {
            let addr: SocketAddr = text.parse().unwrap();
            let (words, family) = ip_to_words(addr.ip());
            assert_eq!(
                socket_addr(words, family, port_to_wire(addr.port())),
                Some(addr)
            );
        }
        assert_eq!(words_to_ip([0; 4], 0), None);
    }
}
