//! Service and backend addresses as users write them:
//! a VIP is `IP:PORT[/tcp|/udp]`, a backend is `IP:PORT[@WEIGHT]`.
//! IPv6 addresses use brackets (`[2001:db8::1]:80`).

use std::{fmt, net::SocketAddr, str::FromStr};

use lb_common::{IPPROTO_TCP, IPPROTO_UDP};
use serde::Deserialize;
use thiserror::Error;

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
}

/// Parses `IP:PORT`, refusing port 0 (it can never be a service port).
pub fn parse_socket_addr(text: &str) -> Result<SocketAddr, AddrError> {
    let addr: SocketAddr = text
        .parse()
        .map_err(|_| AddrError::Address(text.to_string()))?;
    if addr.port() == 0 {
        return Err(AddrError::Port(text.to_string()));
    }
    Ok(addr)
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

/// A backend: `IP:PORT[@WEIGHT]`, weight 1 by default.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BackendAddr {
    pub addr: SocketAddr,
    pub weight: Weight,
}

impl FromStr for BackendAddr {
    type Err = AddrError;
    fn from_str(text: &str) -> Result<Self, AddrError> {
        let (addr, weight) = match text.rsplit_once('@') {
            Some((addr, weight)) => {
                let value = weight
                    .parse::<u64>()
                    .map_err(|_| AddrError::Weight(weight.to_string()))?;
                (addr, Weight::new(value)?)
            }
            None => (text, Weight::DEFAULT),
        };
        Ok(Self {
            addr: parse_socket_addr(addr)?,
            weight,
        })
    }
}

impl fmt::Display for BackendAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.addr, self.weight.get())
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
    }
}
