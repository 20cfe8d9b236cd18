//! One discovery key's value: `{"addr":"IP:PORT","weight":N,"zone":"NAME"}`.
//! `weight` is 1..=65535 and defaults to 1, `zone` is optional, unknown
//! fields are ignored. A value that does not parse is reported as one line
//! (the caller skips the key and counts it).

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::settings::addr::{BackendAddr, Weight};

/// A discovered backend.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub addr: SocketAddr,
    pub weight: u32,
    /// Kept in the model for zone-aware routing; not used for selection yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
}

impl Entry {
    pub fn backend(&self) -> BackendAddr {
        BackendAddr {
            addr: self.addr,
            weight: Weight::new(u64::from(self.weight)).unwrap_or(Weight::DEFAULT),
        }
    }
}

#[derive(Deserialize)]
struct Raw {
    addr: String,
    weight: Option<serde_json::Value>,
    zone: Option<String>,
}

/// Parses `value`; `ipv6` is the VIP's family, which the backend must share.
pub fn parse(value: &[u8], ipv6: bool) -> Result<Entry, String> {
    let text = std::str::from_utf8(value).map_err(|_| "value is not UTF-8".to_string())?;
    let raw: Raw = serde_json::from_str(text).map_err(|e| format!("value is not valid: {e}"))?;
    let addr: SocketAddr = raw
        .addr
        .parse()
        .map_err(|_| format!("addr '{}' is not IP:PORT", raw.addr))?;
    if addr.port() == 0 || addr.ip().is_unspecified() {
        return Err(format!("addr '{addr}' is not a usable backend"));
    }
    if addr.is_ipv6() != ipv6 {
        return Err(format!("addr '{addr}' is not of the VIP's address family"));
    }
    let weight = match raw.weight {
        None | Some(serde_json::Value::Null) => 1,
        Some(serde_json::Value::Number(n)) => match n.as_u64() {
            Some(w @ 1..=65535) => w as u32,
            _ => return Err(format!("weight {n} out of range (expected 1..=65535)")),
        },
        Some(other) => return Err(format!("weight {other} is not a number")),
    };
    let zone = match raw.zone {
        Some(z) if z.len() > 64 || z.chars().any(|c| c.is_control()) => {
            return Err("zone must be at most 64 printable characters".to_string());
        }
        Some(z) if z.is_empty() => None,
        z => z,
    };
    Ok(Entry { addr, weight, zone })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(text: &str) -> Entry {
        parse(text.as_bytes(), false).unwrap()
    }

    #[test]
    fn weight_defaults_to_one_zone_is_optional_unknown_fields_are_ignored() {
        let e = ok(r#"{"addr":"10.0.0.21:8080"}"#);
        assert_eq!(e.weight, 1);
        assert_eq!(e.zone, None);
        let e = ok(r#"{"addr":"10.0.0.21:8080","weight":7,"zone":"a","owner":"x","n":{"k":1}}"#);
        assert_eq!((e.weight, e.zone.as_deref()), (7, Some("a")));
        assert_eq!(
            ok(r#"{"addr":"10.0.0.21:80","weight":65535}"#).weight,
            65535
        );
        assert_eq!(e.backend().weight.get(), 7);
    }

    #[test]
    fn bad_values_are_one_line_errors() {
        for bad in [
            "",
            "not json",
            "[]",
            r#"{"weight":1}"#,
            r#"{"addr":"10.0.0.21"}"#,
            r#"{"addr":"host:80"}"#,
            r#"{"addr":"10.0.0.21:0"}"#,
            r#"{"addr":"0.0.0.0:80"}"#,
            r#"{"addr":"[fd00::1]:80"}"#,
            r#"{"addr":"10.0.0.21:80","weight":0}"#,
            r#"{"addr":"10.0.0.21:80","weight":65536}"#,
            r#"{"addr":"10.0.0.21:80","weight":-1}"#,
            r#"{"addr":"10.0.0.21:80","weight":1.5}"#,
            r#"{"addr":"10.0.0.21:80","weight":"2"}"#,
        ] {
            let e = parse(bad.as_bytes(), false).unwrap_err();
            assert!(!e.contains('\n'), "{bad}: {e}");
        }
        assert!(parse(&[0xff, 0xfe], false).is_err());
    }

    #[test]
    fn ipv6_vips_take_ipv6_backends() {
        let e = parse(br#"{"addr":"[fd00::21]:80"}"#, true).unwrap();
        assert!(e.addr.is_ipv6());
        assert!(parse(br#"{"addr":"10.0.0.1:80"}"#, true).is_err());
    }
}
