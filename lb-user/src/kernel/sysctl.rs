//! Keeps the host's own connections out of the SNAT port range:
//! `net.ipv4.ip_local_reserved_ports` (which covers IPv6 too) gets the range
//! added, so the kernel never picks one of those ports as an ephemeral
//! source port. Without it, a host connection from the SNAT address and a
//! port in the range would collide with a balanced flow's tuple (and its
//! replies would be dropped as `drop_snat_no_flow`). The sysctl is per
//! network namespace; existing entries are kept.

use std::{fs, path::Path};

use anyhow::Context as _;
use tracing::info;

use crate::settings::ports::PortRange;

/// The sysctl's file.
pub const RESERVED_PORTS: &str = "/proc/sys/net/ipv4/ip_local_reserved_ports";

/// Adds `range` to the reserved ports, unless already reserved; logs what
/// it did. A failure is an error the caller reports (the balancer must not
/// run with host connections able to take SNAT ports).
pub fn reserve_snat_ports(range: PortRange) -> anyhow::Result<()> {
    reserve_in(Path::new(RESERVED_PORTS), range)
}

fn reserve_in(path: &Path, range: PortRange) -> anyhow::Result<()> {
    let current = fs::read_to_string(path)
        .with_context(|| format!("reading {} to reserve the SNAT ports", path.display()))?;
    match merged(&current, range.min, range.max) {
        None => info!(
            ports = %range,
            "SNAT ports already in net.ipv4.ip_local_reserved_ports"
        ),
        Some(value) => {
            fs::write(path, &value).with_context(|| {
                format!(
                    "reserving the SNAT ports {range} in {} (the host's own connections must \
                     not take them)",
                    path.display()
                )
            })?;
            info!(ports = %range, value, "reserved the SNAT ports: net.ipv4.ip_local_reserved_ports");
        }
    }
    Ok(())
}

/// The sysctl value with `min..=max` added, or `None` when every port of
/// it is already reserved. `current` is the kernel's text: comma-separated
/// ports and `a-b` ranges.
pub fn merged(current: &str, min: u16, max: u16) -> Option<String> {
    let mut ranges: Vec<(u16, u16)> = current
        .trim()
        .split(',')
        .filter_map(|part| {
            let part = part.trim();
            let (a, b) = part.split_once('-').unwrap_or((part, part));
            Some((a.trim().parse().ok()?, b.trim().parse().ok()?))
        })
        .collect();
    ranges.sort_unstable();
    // Walk the sorted ranges: is every port of min..=max covered?
    let mut next = u32::from(min);
    for &(a, b) in &ranges {
        if u32::from(a) <= next && u32::from(b) >= next {
            next = u32::from(b) + 1;
        }
    }
    if next > u32::from(max) {
        return None;
    }
    ranges.push((min, max));
    Some(
        ranges
            .iter()
            .map(|&(a, b)| {
                if a == b {
                    a.to_string()
                } else {
                    format!("{a}-{b}")
                }
            })
            .collect::<Vec<_>>()
            .join(","),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adds_the_range_and_keeps_other_entries() {
        assert_eq!(merged("", 20000, 32767).as_deref(), Some("20000-32767"));
        assert_eq!(merged("\n", 20000, 32767).as_deref(), Some("20000-32767"));
        assert_eq!(
            merged("8080,9000-9100\n", 20000, 32767).as_deref(),
            Some("8080,9000-9100,20000-32767")
        );
    }

    #[test]
    fn a_covered_range_is_left_alone() {
        assert_eq!(merged("20000-32767", 20000, 32767), None);
        assert_eq!(merged("1000-25000,25001-40000", 20000, 32767), None);
        // Partly covered: added (the kernel merges overlaps itself).
        assert_eq!(
            merged("20000-30000", 20000, 32767).as_deref(),
            Some("20000-30000,20000-32767")
        );
    }

    #[test]
    fn writes_the_file() {
        let dir = std::env::temp_dir().join(format!("lb-sysctl-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("reserved");
        fs::write(&path, "8080\n").unwrap();
        reserve_in(&path, PortRange { min: 100, max: 200 }).unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), "8080,100-200");
        let missing = dir.join("missing");
        let err = reserve_in(&missing, PortRange { min: 1, max: 2 }).unwrap_err();
        assert!(
            format!("{err:#}").contains("reserve the SNAT ports"),
            "{err:#}"
        );
        fs::remove_dir_all(&dir).unwrap();
    }
}
