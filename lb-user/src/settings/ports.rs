//! The SNAT source-port range, `MIN-MAX` inclusive.

use std::{fmt, str::FromStr};

use lb_common::{DEFAULT_SNAT_PORT_MAX, DEFAULT_SNAT_PORT_MIN};
use thiserror::Error;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortRange {
    pub min: u16,
    pub max: u16,
}

impl Default for PortRange {
    fn default() -> Self {
        Self {
            min: DEFAULT_SNAT_PORT_MIN,
            max: DEFAULT_SNAT_PORT_MAX,
        }
    }
}

#[derive(Debug, Error, PartialEq, Eq)]
#[error("invalid port range '{0}' (expected MIN-MAX with 1 <= MIN <= MAX <= 65535)")]
pub struct PortRangeError(String);

impl FromStr for PortRange {
    type Err = PortRangeError;
    fn from_str(text: &str) -> Result<Self, PortRangeError> {
        let invalid = || PortRangeError(text.to_string());
        let (min, max) = text.split_once('-').ok_or_else(invalid)?;
        let min: u16 = min.trim().parse().map_err(|_| invalid())?;
        let max: u16 = max.trim().parse().map_err(|_| invalid())?;
        if min == 0 || min > max {
            return Err(invalid());
        }
        Ok(Self { min, max })
    }
}

impl fmt::Display for PortRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.min, self.max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_validates() {
        assert_eq!(
            "1000-2000".parse(),
            Ok(PortRange {
                min: 1000,
                max: 2000
            })
        );
        assert_eq!("7-7".parse::<PortRange>().unwrap().to_string(), "7-7");
        for bad in ["0-10", "10-9", "10", "a-b", "1-70000", ""] {
            assert!(bad.parse::<PortRange>().is_err(), "{bad:?}");
        }
    }
}
