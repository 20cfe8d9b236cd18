//! One discovery key's value: `{"addr":"IP:PORT","weight":N,"zone":"NAME"}`.
//! `weight` is 1..=65535 and defaults to 1, `zone` is optional (a zone name
//! as `--zone` takes it; empty means none), unknown fields are ignored. A value that does not parse is reported as one line
//! (the caller skips the key and counts it).

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::settings::{
    addr::{BackendAddr, VipAddr, Weight},
    config::check_backend,
    zone::{MAX_ZONE_NAME, ZoneName, ZoneNameError},
};

/// A discovered backend.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub addr: SocketAddr,
    pub weight: u32,
    /// The backend's zone, for zone-aware routing.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "lenient_zone"
    )]
    pub zone: Option<ZoneName>,
}

/// A zone read back from the cache: one that is not a valid name any more
/// (a cache written before names were checked) is dropped rather than
/// refusing the whole cache.
fn lenient_zone<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<ZoneName>, D::Error> {
    Ok(Option::<String>::deserialize(d)?.and_then(|z| z.parse().ok()))
}

impl Entry {
    pub fn backend(&self) -> BackendAddr {
        BackendAddr {
            addr: self.addr,
            weight: Weight::new(u64::from(self.weight)).unwrap_or(Weight::DEFAULT),
            zone: self.zone,
        }
    }
}

#[derive(Deserialize)]
struct Raw {
    addr: String,
    weight: Option<serde_json::Value>,
    zone: Option<String>,
}

/// Parses `value`, a backend of `vip`, which must meet a configured
/// backend's rules (`config::check_backend`).
pub fn parse(value: &[u8], vip: &VipAddr) -> Result<Entry, String> {
    let text = std::str::from_utf8(value).map_err(|_| "value is not UTF-8".to_string())?;
    let raw: Raw = serde_json::from_str(text).map_err(|e| format!("value is not valid: {e}"))?;
    let addr: SocketAddr = raw
        .addr
        .parse()
        .map_err(|_| format!("addr {} is not IP:PORT", shown(&raw.addr)))?;
    if addr.port() == 0 {
        return Err(format!("addr '{addr}' is not a usable backend"));
    }
    crate::settings::addr::refuse_scope_id(addr, &raw.addr).map_err(|e| e.to_string())?;
    check_backend(vip, addr).map_err(|e| e.to_string())?;
    let weight = match raw.weight {
        None | Some(serde_json::Value::Null) => 1,
        Some(serde_json::Value::Number(n)) => match n.as_u64() {
            Some(w @ 1..=65535) => w as u32,
            _ => return Err(format!("weight {n} out of range (expected 1..=65535)")),
        },
        Some(other) => return Err(format!("weight {other} is not a number")),
    };
    let zone = match raw.zone.as_deref() {
        None | Some("") => None,
        Some(z) => Some(z.parse::<ZoneName>().map_err(|e| match e {
            // Not the whole (possibly huge) value in a log line.
            ZoneNameError::TooLong(_) => {
                format!("zone is longer than {MAX_ZONE_NAME} characters")
            }
            e => format!("invalid zone: {e}"),
        })?),
    };
    Ok(Entry { addr, weight, zone })
}

/// Most of a text from etcd that a log line shows ([`shown`]).
const SHOWN_CHARS: usize = 64;

/// `text` (a key or value anybody with write access to the prefix chose)
/// as a log line shows it: quoted with its control characters escaped, so
/// it cannot break the line or forge another, and cut after
/// [`SHOWN_CHARS`] characters.
pub fn shown(text: &str) -> String {
    match text.char_indices().nth(SHOWN_CHARS) {
        Some((end, _)) => format!("{:?}…", &text[..end]),
        None => format!("{text:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vip4() -> VipAddr {
        "10.0.0.1:80".parse().unwrap()
    }

    fn ok(text: &str) -> Entry {
        parse(text.as_bytes(), &vip4()).unwrap()
    }

    #[test]
    fn weight_defaults_to_one_zone_is_optional_unknown_fields_are_ignored() {
        let e = ok(r#"{"addr":"10.0.0.21:8080"}"#);
        assert_eq!(e.weight, 1);
        assert_eq!(e.zone, None);
        let e = ok(r#"{"addr":"10.0.0.21:8080","weight":7,"zone":"a","owner":"x","n":{"k":1}}"#);
        assert_eq!(
            (e.weight, e.zone.map(|z| z.to_string())),
            (7, Some("a".into()))
        );
        assert_eq!(
            ok(r#"{"addr":"10.0.0.21:80","weight":65535}"#).weight,
            65535
        );
        assert_eq!(e.backend().weight.get(), 7);
        assert_eq!(e.backend().zone, e.zone);
        assert_eq!(e.backend().to_string(), "10.0.0.21:8080@7,zone=a");
        assert_eq!(ok(r#"{"addr":"10.0.0.21:8080","zone":""}"#).zone, None);
        assert_eq!(ok(r#"{"addr":"10.0.0.21:8080","zone":null}"#).zone, None);
    }

    #[test]
    fn an_ipv6_scope_id_rejects_the_value() {
        let vip6: VipAddr = "[2001:db8::1]:80".parse().unwrap();
        let e = parse(br#"{"addr":"[2001:db8::21%3]:8080"}"#, &vip6).unwrap_err();
        assert!(
            e.starts_with("IPv6 scope id in '[2001:db8::21%3]:8080'"),
            "{e}"
        );
        assert!(parse(br#"{"addr":"[2001:db8::21]:8080"}"#, &vip6).is_ok());
    }

    #[test]
    fn a_bad_zone_rejects_the_value() {
        for (zone, why) in [
            ("a b", "may only use"),
            ("eu/1", "may only use"),
            ("a\\u0001", "may only use"),
            (&"z".repeat(64), "zone is longer than 63 characters"),
        ] {
            let value = format!(r#"{{"addr":"10.0.0.21:8080","zone":"{zone}"}}"#);
            let err = parse(value.as_bytes(), &vip4()).unwrap_err();
            assert!(err.contains(why), "{zone:?}: {err}");
            assert!(!err.contains('\n'), "{err}");
        }
        let err = parse(br#"{"addr":"10.0.0.21:80","zone":7}"#, &vip4()).unwrap_err();
        assert!(err.starts_with("value is not valid"), "{err}");
    }

    #[test]
    fn the_cache_form_round_trips_and_drops_a_zone_no_longer_valid() {
        let e = ok(r#"{"addr":"10.0.0.21:8080","weight":2,"zone":"eu-1"}"#);
        let text = serde_json::to_string(&e).unwrap();
        assert_eq!(
            text,
            r#"{"addr":"10.0.0.21:8080","weight":2,"zone":"eu-1"}"#
        );
        assert_eq!(serde_json::from_str::<Entry>(&text).unwrap(), e);
        let old: Entry =
            serde_json::from_str(r#"{"addr":"10.0.0.21:8080","weight":2,"zone":"eu 1"}"#).unwrap();
        assert_eq!(old.zone, None);
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
            r#"{"addr":"224.0.0.5:80"}"#,
            r#"{"addr":"255.255.255.255:80"}"#,
            r#"{"addr":"10.0.0.1:80"}"#,
            r#"{"addr":"10.0.0.21:80","weight":0}"#,
            r#"{"addr":"10.0.0.21:80","weight":65536}"#,
            r#"{"addr":"10.0.0.21:80","weight":-1}"#,
            r#"{"addr":"10.0.0.21:80","weight":1.5}"#,
            r#"{"addr":"10.0.0.21:80","weight":"2"}"#,
            r#"{"addr":"x\nINFO forged line"}"#,
        ] {
            let e = parse(bad.as_bytes(), &vip4()).unwrap_err();
            assert!(!e.contains('\n'), "{bad}: {e}");
        }
        // A huge value is not repeated whole.
        let huge = format!(r#"{{"addr":"{}"}}"#, "9".repeat(100_000));
        let e = parse(huge.as_bytes(), &vip4()).unwrap_err();
        assert!(e.len() < 200, "{} characters", e.len());
        assert!(parse(&[0xff, 0xfe], &vip4()).is_err());
        // The configuration's words for a backend no host has, and for the
        // VIP itself (the VIP's port only: another port of its address is
        // a backend like any other).
        let e = parse(br#"{"addr":"224.0.0.5:80"}"#, &vip4()).unwrap_err();
        assert!(e.contains("a multicast address"), "{e}");
        let e = parse(br#"{"addr":"10.0.0.1:80"}"#, &vip4()).unwrap_err();
        assert!(e.contains("lists itself as a backend"), "{e}");
        assert!(parse(br#"{"addr":"10.0.0.1:81"}"#, &vip4()).is_ok());
    }

    #[test]
    fn ipv6_vips_take_ipv6_backends() {
        let vip6: VipAddr = "[fd00::1]:80".parse().unwrap();
        let e = parse(br#"{"addr":"[fd00::21]:80"}"#, &vip6).unwrap();
        assert!(e.addr.is_ipv6());
        assert!(parse(br#"{"addr":"10.0.0.21:80"}"#, &vip6).is_err());
    }
}
