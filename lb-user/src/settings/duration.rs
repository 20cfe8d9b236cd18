//! Human-friendly durations for flags and config files: an unsigned integer
//! followed by a unit, e.g. `500ms`, `10s`, `5m` (the subset of humantime's
//! syntax that the balancer's settings need, without another dependency).

use std::time::Duration;

/// Units accepted after the number, longest suffix first so `ms` wins over `s`.
const UNITS: &[(&str, Duration)] = &[
    ("ns", Duration::from_nanos(1)),
    ("us", Duration::from_micros(1)),
    ("ms", Duration::from_millis(1)),
    ("s", Duration::from_secs(1)),
    ("m", Duration::from_secs(60)),
    ("h", Duration::from_secs(3600)),
];

/// The longest duration any setting takes: 30 days, past every timeout a
/// balancer has a use for (conntrack's established TCP timeout is 5 days),
/// and far inside the kernel's 64-bit nanoseconds (584 years), so no value
/// saturates on its way into a map.
pub const MAX_DURATION: Duration = Duration::from_secs(30 * 24 * 3600);

/// Parses `<integer><unit>` with unit one of ns, us, ms, s, m, h; at most
/// [`MAX_DURATION`].
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let digits_end = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(digits_end);
    let invalid = || format!("invalid duration '{text}' (expected e.g. 500ms, 10s, 5m)");
    if number.is_empty() {
        return Err(invalid());
    }
    let count: u32 = number.parse().map_err(|_| invalid())?;
    let (_, scale) = UNITS
        .iter()
        .find(|(name, _)| *name == unit)
        .ok_or_else(invalid)?;
    let d = scale.checked_mul(count).ok_or_else(invalid)?;
    if d > MAX_DURATION {
        return Err(format!(
            "duration '{text}' is too long (at most {})",
            format_duration(MAX_DURATION)
        ));
    }
    Ok(d)
}

/// Formats a duration the way [`parse_duration`] reads it (used by `status`
/// and the logs, so what is printed can be pasted back).
pub fn format_duration(d: Duration) -> String {
    let ns = d.as_nanos();
    UNITS
        .iter()
        .rev()
        .find(|(_, unit)| ns.is_multiple_of(unit.as_nanos()) && ns >= unit.as_nanos())
        .map(|(name, unit)| format!("{}{name}", ns / unit.as_nanos()))
        .unwrap_or_else(|| "0s".to_string())
}

/// serde adapter for an optional duration written as text, so the file
/// and the flags accept the same text and report the same errors.
pub fn deserialize_opt<'de, D>(d: D) -> Result<Option<Duration>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    use serde::{Deserialize as _, de::Error as _};
    parse_duration(&String::deserialize(d)?)
        .map(Some)
        .map_err(D::Error::custom)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_unit() {
        assert_eq!(parse_duration("7ns"), Ok(Duration::from_nanos(7)));
        assert_eq!(parse_duration("7us"), Ok(Duration::from_micros(7)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("2h"), Ok(Duration::from_secs(7200)));
    }

    #[test]
    fn rejects_missing_or_unknown_units_and_fractions() {
        for bad in ["10", "s", "", "1.5s", "10x", "-1s", "10 s"] {
            assert!(parse_duration(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn refuses_more_than_thirty_days() {
        assert_eq!(parse_duration("720h"), Ok(MAX_DURATION));
        assert_eq!(parse_duration("43200m"), Ok(MAX_DURATION));
        for long in ["721h", "43201m", "4294967295h", "2592000001ms"] {
            let e = parse_duration(long).unwrap_err();
            assert!(e.contains("too long (at most 720h)"), "{long}: {e}");
        }
    }

    #[test]
    fn format_round_trips() {
        for text in ["50ms", "10s", "5m", "1h", "3us", "0s"] {
            let d = parse_duration(text).unwrap();
            assert_eq!(format_duration(d), text);
        }
        assert_eq!(format_duration(Duration::from_millis(1500)), "1500ms");
    }
}
