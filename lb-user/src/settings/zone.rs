//! Zone names and the balancer's zone-aware routing settings.
//!
//! A zone name is 1 to [`MAX_ZONE_NAME`] characters from `A-Z a-z 0-9 . _ -`
//! (enough for cloud names such as `eu-west-1a`), so it is safe in logs,
//! metric labels and file names. [`ZoneName`] is `Copy` (a fixed buffer),
//! so the address types that carry one stay `Copy` too.
use std::{fmt, str::FromStr};

use thiserror::Error;

/// Longest zone name accepted.
pub const MAX_ZONE_NAME: usize = 63;
/// A local zone is healthy while at least this share of its backends'
/// weight is active (`--zone-min-healthy`).
pub const DEFAULT_ZONE_MIN_HEALTHY: f64 = 0.70;
/// A local zone is overloaded once the median cost of its backends reaches
/// this many times the best other zone's (`--zone-avoid-factor`).
pub const DEFAULT_ZONE_AVOID_FACTOR: f64 = 3.0;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum ZoneNameError {
    #[error("zone name is empty")]
    Empty,
    #[error("zone name {0:?} is longer than {MAX_ZONE_NAME} characters")]
    TooLong(String),
    #[error("zone name {0:?} may only use A-Z, a-z, 0-9, '.', '_' and '-'")]
    BadChar(String),
}

/// A validated zone name.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ZoneName {
    len: u8,
    bytes: [u8; MAX_ZONE_NAME],
}

impl ZoneName {
    pub fn as_str(&self) -> &str {
        // Only ASCII is ever stored (checked in `from_str`).
        std::str::from_utf8(&self.bytes[..usize::from(self.len)]).unwrap_or("")
    }
}

impl FromStr for ZoneName {
    type Err = ZoneNameError;
    fn from_str(text: &str) -> Result<Self, ZoneNameError> {
        if text.is_empty() {
            return Err(ZoneNameError::Empty);
        }
        if text.len() > MAX_ZONE_NAME {
            return Err(ZoneNameError::TooLong(text.to_string()));
        }
        if !text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        {
            return Err(ZoneNameError::BadChar(text.to_string()));
        }
        let mut bytes = [0; MAX_ZONE_NAME];
        bytes[..text.len()].copy_from_slice(text.as_bytes());
        Ok(Self {
            len: text.len() as u8,
            bytes,
        })
    }
}

impl fmt::Display for ZoneName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Debug for ZoneName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.as_str())
    }
}

impl<'de> serde::Deserialize<'de> for ZoneName {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

impl serde::Serialize for ZoneName {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// The balancer's zone and how zone-aware VIPs route (see `zone::plan`).
#[derive(Clone, Debug, PartialEq)]
pub struct ZoneSettings {
    /// `--zone`: the balancer's own zone; `None`: no zone, and no VIP is
    /// zone-aware unless it says so (which is then a config error).
    pub local: Option<ZoneName>,
    /// `--zone-min-healthy`, in (0, 1].
    pub min_healthy: f64,
    /// `--zone-avoid-factor`, at least 1.
    pub avoid_factor: f64,
    /// `--zone-failover`: the other zones in the order traffic spills to
    /// them; empty: by cost, cheapest first. Zones not listed come after
    /// the listed ones, by cost.
    pub failover: Vec<ZoneName>,
}

impl Default for ZoneSettings {
    fn default() -> Self {
        Self {
            local: None,
            min_healthy: DEFAULT_ZONE_MIN_HEALTHY,
            avoid_factor: DEFAULT_ZONE_AVOID_FACTOR,
            failover: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked_and_round_trip() {
        for good in ["a", "eu-west-1a", "zone_2.b", &"z".repeat(MAX_ZONE_NAME)] {
            let z: ZoneName = good.parse().unwrap();
            assert_eq!(z.as_str(), good);
            assert_eq!(z.to_string(), good);
        }
        assert_eq!("".parse::<ZoneName>(), Err(ZoneNameError::Empty));
        assert!(matches!(
            "z".repeat(MAX_ZONE_NAME + 1).parse::<ZoneName>(),
            Err(ZoneNameError::TooLong(_))
        ));
        for bad in ["a b", "a/b", "é", "a\n", "a,b", "a=b"] {
            assert!(
                matches!(bad.parse::<ZoneName>(), Err(ZoneNameError::BadChar(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn names_order_and_compare_by_text() {
        let a: ZoneName = "a".parse().unwrap();
        let b: ZoneName = "b".parse().unwrap();
        assert!(a < b);
        assert_eq!(a, "a".parse().unwrap());
    }
}
