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
/// A local zone is overloaded once the median latency estimate of its backends reaches
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

/// Parses `--zone-min-healthy` / `zone_min_healthy`: a percentage in
/// 1..=100 with an optional `%` (`70`, `70%`, `62.5`), as the fraction
/// (`0.70`).
pub fn parse_min_healthy(text: &str) -> Result<f64, String> {
    let bad = || {
        format!(
            "invalid zone min healthy '{text}' (expected a percentage in 1..=100, e.g. 70 or 70%)"
        )
    };
    let number = text.trim();
    let number = number.strip_suffix('%').unwrap_or(number).trim_end();
    let percent: f64 = number.parse().map_err(|_| bad())?;
    if !(1.0..=100.0).contains(&percent) {
        return Err(bad());
    }
    Ok(percent / 100.0)
}

/// Parses `on` or `off` (`--zone-aware`).
pub fn parse_on_off(text: &str) -> Result<bool, String> {
    match text {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("invalid value '{text}' (expected on or off)")),
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
    fn min_healthy_is_a_percentage_kept_as_a_fraction() {
        assert_eq!(parse_min_healthy("70"), Ok(DEFAULT_ZONE_MIN_HEALTHY));
        assert_eq!(parse_min_healthy("70%"), Ok(0.70));
        assert_eq!(parse_min_healthy("100"), Ok(1.0));
        assert_eq!(parse_min_healthy("1%"), Ok(0.01));
        assert_eq!(parse_min_healthy("62.5"), Ok(0.625));
        for bad in ["0", "101", "-5", "x", "", "%", "70%%", "NaN", "inf", "0.5"] {
            let err = parse_min_healthy(bad).unwrap_err();
            assert_eq!(
                err,
                format!(
                    "invalid zone min healthy '{bad}' (expected a percentage in 1..=100, e.g. 70 or 70%)"
                )
            );
        }
    }

    #[test]
    fn on_off() {
        assert_eq!(parse_on_off("on"), Ok(true));
        assert_eq!(parse_on_off("off"), Ok(false));
        assert!(parse_on_off("yes").is_err());
    }

    #[test]
    fn names_order_and_compare_by_text() {
        let a: ZoneName = "a".parse().unwrap();
        let b: ZoneName = "b".parse().unwrap();
        assert!(a < b);
        assert_eq!(a, "a".parse().unwrap());
    }
}
