//! Service and backend addresses as users write them:
//! a VIP is `IP:PORT[/tcp|/udp]`, a backend is `IP:PORT[@WEIGHT][,zone=NAME]`.
//! IPv6 addresses use brackets (`[2001:db8::1]:80`).

use std::{
    fmt,
    net::{IpAddr, SocketAddr},
    str::FromStr,
};

use lb_common::{IPPROTO_TCP, IPPROTO_UDP};
use serde::Deserialize;
use thiserror::Error;

use crate::settings::zone::{ZoneName, ZoneNameError};

/// Transport protocol of a VIP.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    #[default]
    Tcp,
    Udp,
}

impl Protocol {
    pub const fn name(self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::Udp => "udp",
        }
    }

    pub const fn ip_proto(self) -> u8 {
        match self {
            Self::Tcp => IPPROTO_TCP,
            Self::Udp => IPPROTO_UDP,
        }
    }

    pub const fn from_ip_proto(proto: u8) -> Option<Self> {
        match proto {
            IPPROTO_TCP => Some(Self::Tcp),
            IPPROTO_UDP => Some(Self::Udp),
            _ => None,
        }
    }
}

impl FromStr for Protocol {
    type Err = AddrError;
    fn from_str(s: &str) -> Result<Self, AddrError> {
        match s {
            "tcp" => Ok(Self::Tcp),
            "udp" => Ok(Self::Udp),
            other => Err(AddrError::Protocol(other.to_string())),
        }
    }
}

/// A backend weight, 1..=65535 (0 would mean "never", which is what draining
/// is for; the upper bound keeps `ewma × WEIGHT_SCALE ÷ weight` meaningful).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Weight(u16);

impl Weight {
    pub const DEFAULT: Weight = Weight(1);

    pub fn new(value: u64) -> Result<Self, AddrError> {
        match u16::try_from(value) {
            Ok(w) if w >= 1 => Ok(Self(w)),
            _ => Err(AddrError::Weight(value.to_string())),
        }
    }

    pub const fn get(self) -> u32 {
        self.0 as u32
    }
}

impl Default for Weight {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// Why an address did not parse. Messages name the expected form.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum AddrError {
    #[error("invalid address '{0}' (expected IP:PORT)")]
    Address(String),
    #[error("invalid port in '{0}' (expected 1..=65535)")]
    Port(String),
    #[error("invalid protocol '{0}' (expected tcp or udp)")]
    Protocol(String),
    #[error("invalid weight '{0}' (expected an integer in 1..=65535)")]
    Weight(String),
    #[error("invalid zone in backend '{backend}': {reason}")]
    Zone {
        backend: String,
        reason: ZoneNameError,
    },
    #[error("unknown option '{option}' in backend '{backend}' (expected ,zone=NAME)")]
    BackendOption { backend: String, option: String },
    #[error(
        "IPv6 scope id in '{0}': the balancer takes global addresses only (the data path \
         keeps no scope, so two addresses that differ by it would be one to the kernel)"
    )]
    ScopeId(String),
}

/// What makes `addr` unusable as a VIP, a backend or a SNAT address, if
/// anything does, said as the end of "`addr` is ...": a balancer cannot
/// serve, reach or take the unspecified address, a multicast group or
/// IPv4's broadcast address; nor a loopback address (127.0.0.0/8, `::1`),
/// which never crosses a wire, so the program on the interface never sees
/// a packet to one and a host drops one from or to it that arrives from
/// outside (a martian); nor an IPv4-mapped IPv6 address
/// (`::ffff:a.b.c.d`), which only stands for an IPv4 address inside a
/// host's sockets: no IPv6 packet on a wire carries one (the IPv4 address
/// itself is what works).
pub fn not_a_host(addr: IpAddr) -> Option<&'static str> {
    if addr.is_unspecified() {
        Some("the unspecified address, no host's address")
    } else if addr.is_multicast() {
        Some("a multicast address, no host's address")
    } else if addr == IpAddr::V4(std::net::Ipv4Addr::BROADCAST) {
        Some("the broadcast address, no host's address")
    } else if addr.is_loopback() {
        Some("a loopback address, which never crosses a wire")
    } else if let IpAddr::V6(v6) = addr
        && v6.to_ipv4_mapped().is_some()
    {
        Some(
            "an IPv4-mapped IPv6 address, which no IPv6 packet carries (write the IPv4 address itself)",
        )
    } else {
        None
    }
}

/// Parses `IP:PORT`, refusing port 0 (it can never be a service port).
pub fn parse_socket_addr(text: &str) -> Result<SocketAddr, AddrError> {
    let addr: SocketAddr = text
        .parse()
        .map_err(|_| AddrError::Address(text.to_string()))?;
    if addr.port() == 0 {
        return Err(AddrError::Port(text.to_string()));
    }
    refuse_scope_id(addr, text)?;
    Ok(addr)
}

/// Refuses an IPv6 address with a scope id (`[fe80::1%2]:80`): Rust's
/// parser takes one, and `SocketAddr` equality compares it, but the
/// kernel's keys hold no scope, so `[2001:db8::1]:80` and
/// `[2001:db8::1%2]:80` passed every duplicate check and landed on one VIP
/// or backend entry.
pub fn refuse_scope_id(addr: SocketAddr, text: &str) -> Result<(), AddrError> {
    match addr {
        SocketAddr::V6(v6) if v6.scope_id() != 0 => Err(AddrError::ScopeId(text.to_string())),
        _ => Ok(()),
    }
}

/// A virtual service: `IP:PORT[/tcp|/udp]`, TCP by default.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct VipAddr {
    pub addr: SocketAddr,
    pub protocol: Protocol,
}

impl FromStr for VipAddr {
    type Err = AddrError;
    fn from_str(text: &str) -> Result<Self, AddrError> {
        let (addr, protocol) = match text.rsplit_once('/') {
            Some((addr, proto)) => (addr, proto.parse()?),
            None => (text, Protocol::default()),
        };
        Ok(Self {
            addr: parse_socket_addr(addr)?,
            protocol,
        })
    }
}

impl fmt::Display for VipAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.protocol.name())
    }
}

/// A backend: `IP:PORT[@WEIGHT][,zone=NAME]`, weight 1 by default, no zone
/// by default. Its identity is `addr`: a weight or zone is a property of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BackendAddr {
    pub addr: SocketAddr,
    pub weight: Weight,
    /// The zone the backend runs in (zone-aware routing); `None`: unknown.
    pub zone: Option<ZoneName>,
}

impl BackendAddr {
    /// A backend of weight 1 in no zone.
    pub const fn new(addr: SocketAddr) -> Self {
        Self {
            addr,
            weight: Weight::DEFAULT,
            zone: None,
        }
    }
}

/// Parses the zone of backend `backend`, with the error that names both.
pub fn parse_backend_zone(backend: &str, zone: &str) -> Result<ZoneName, AddrError> {
    zone.parse().map_err(|reason| AddrError::Zone {
        backend: backend.to_string(),
        reason,
    })
}

impl FromStr for BackendAddr {
    type Err = AddrError;
    fn from_str(text: &str) -> Result<Self, AddrError> {
        // Options follow the first ',' (no address form contains one).
        let (head, options) = match text.split_once(',') {
            Some((head, options)) => (head, Some(options)),
            None => (text, None),
        };
        let mut zone = None;
        for option in options.into_iter().flat_map(|o| o.split(',')) {
            match option.split_once('=') {
                Some(("zone", name)) if zone.is_none() => {
                    zone = Some(parse_backend_zone(text, name)?);
                }
                _ => {
                    return Err(AddrError::BackendOption {
                        backend: text.to_string(),
                        option: option.to_string(),
                    });
                }
            }
        }
        let (addr, weight) = match head.rsplit_once('@') {
            Some((addr, weight)) => {
                let value = weight
                    .parse::<u64>()
                    .map_err(|_| AddrError::Weight(weight.to_string()))?;
                (addr, Weight::new(value)?)
            }
            None => (head, Weight::DEFAULT),
        };
        Ok(Self {
            addr: parse_socket_addr(addr)?,
            weight,
            zone,
        })
    }
}

impl fmt::Display for BackendAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.addr, self.weight.get())?;
        if let Some(zone) = &self.zone {
            write!(f, ",zone={zone}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vip_defaults_to_tcp_and_accepts_udp() {
        let vip: VipAddr = "10.0.0.100:80".parse().unwrap();
        assert_eq!(vip.addr, "10.0.0.100:80".parse().unwrap());
        assert_eq!(vip.protocol, Protocol::Tcp);
        let vip: VipAddr = "10.0.0.100:53/udp".parse().unwrap();
        assert_eq!(vip.protocol, Protocol::Udp);
        let vip: VipAddr = "[2001:db8::1]:443/tcp".parse().unwrap();
        assert!(vip.addr.is_ipv6());
    }

    #[test]
    fn vip_errors_name_the_problem() {
        assert_eq!(
            "10.0.0.100:80/sctp".parse::<VipAddr>(),
            Err(AddrError::Protocol("sctp".into()))
        );
        assert_eq!(
            "10.0.0.300:80".parse::<VipAddr>(),
            Err(AddrError::Address("10.0.0.300:80".into()))
        );
        assert_eq!(
            "10.0.0.1".parse::<VipAddr>(),
            Err(AddrError::Address("10.0.0.1".into()))
        );
        assert_eq!(
            "10.0.0.1:0".parse::<VipAddr>(),
            Err(AddrError::Port("10.0.0.1:0".into()))
        );
        assert_eq!(
            "10.0.0.1:70000".parse::<VipAddr>(),
            Err(AddrError::Address("10.0.0.1:70000".into()))
        );
        // A scope id: the kernel's keys have none, so `[2001:db8::1]:80`
        // and this would be one VIP (or backend) to it, two to the checks.
        assert_eq!(
            "[2001:db8::1%2]:80".parse::<VipAddr>(),
            Err(AddrError::ScopeId("[2001:db8::1%2]:80".into()))
        );
        assert_eq!(
            "[fe80::1%1]:8080@2".parse::<BackendAddr>(),
            Err(AddrError::ScopeId("[fe80::1%1]:8080".into()))
        );
    }

    #[test]
    fn backend_weight_defaults_to_one_and_is_bounded() {
        let b: BackendAddr = "10.0.0.21:8080".parse().unwrap();
        assert_eq!(b.weight, Weight::DEFAULT);
        let b: BackendAddr = "10.0.0.21:8080@65535".parse().unwrap();
        assert_eq!(b.weight.get(), 65535);
        for bad in ["0", "65536", "-1", "x", ""] {
            assert_eq!(
                format!("10.0.0.21:8080@{bad}").parse::<BackendAddr>(),
                Err(AddrError::Weight(bad.into())),
                "weight {bad:?}"
            );
        }
    }

    #[test]
    fn display_round_trips() {
        for text in ["10.0.0.100:80/udp", "[::1]:80/tcp"] {
            assert_eq!(text.parse::<VipAddr>().unwrap().to_string(), text);
        }
        let b: BackendAddr = "10.0.0.21:8080@3".parse().unwrap();
        assert_eq!(b.to_string(), "10.0.0.21:8080@3");
        for text in [
            "10.0.0.21:8080@2,zone=a",
            "[2001:db8::1]:80@1,zone=eu-west-1a",
        ] {
            let b: BackendAddr = text.parse().unwrap();
            assert_eq!(b.to_string(), text);
            assert_eq!(b.to_string().parse::<BackendAddr>().unwrap(), b);
        }
    }

    #[test]
    fn backend_zone_is_optional_and_checked() {
        let b: BackendAddr = "10.0.0.21:8080,zone=a".parse().unwrap();
        assert_eq!(b.weight, Weight::DEFAULT);
        assert_eq!(b.zone.unwrap().as_str(), "a");
        assert_eq!(b.to_string(), "10.0.0.21:8080@1,zone=a");
        let b: BackendAddr = "10.0.0.21:8080@2,zone=b".parse().unwrap();
        assert_eq!((b.weight.get(), b.zone.unwrap().as_str()), (2, "b"));
        assert_eq!("10.0.0.21:8080".parse::<BackendAddr>().unwrap().zone, None);
        let err = "10.0.0.21:8080,zone=a b"
            .parse::<BackendAddr>()
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "invalid zone in backend '10.0.0.21:8080,zone=a b': zone name \"a b\" may only use A-Z, a-z, 0-9, '.', '_' and '-'"
        );
        assert!(
            "10.0.0.21:8080,zone="
                .parse::<BackendAddr>()
                .unwrap_err()
                .to_string()
                .ends_with("zone name is empty")
        );
        for (text, option) in [
            ("10.0.0.21:8080,region=a", "region=a"),
            ("10.0.0.21:8080,zone", "zone"),
            ("10.0.0.21:8080,", ""),
            ("10.0.0.21:8080,zone=a,zone=b", "zone=b"),
        ] {
            assert_eq!(
                text.parse::<BackendAddr>(),
                Err(AddrError::BackendOption {
                    backend: text.into(),
                    option: option.into()
                }),
                "{text}"
            );
        }
        let err = "10.0.0.21:8080,region=a"
            .parse::<BackendAddr>()
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "unknown option 'region=a' in backend '10.0.0.21:8080,region=a' (expected ,zone=NAME)"
        );
        // The weight is still checked with a zone after it.
        assert_eq!(
            "10.0.0.21:8080@0,zone=a".parse::<BackendAddr>(),
            Err(AddrError::Weight("0".into()))
        );
    }
}
