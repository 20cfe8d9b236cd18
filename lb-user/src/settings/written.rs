//! Settings' values as the flags and the config file write them, for the
//! reload's report of what needs a restart (`config::needs_restart`):
//! `snat_ports (20000-32767 → 30000-39999)`, `ops.metrics_addr
//! (127.0.0.1:9470 → off)`, and one line per changed key of a setting
//! made of several (`ops.slow_start (10s → 30s)`).

use std::{
    fmt::Display,
    net::{Ipv4Addr, Ipv6Addr, SocketAddr},
    path::PathBuf,
    time::Duration,
};

use crate::settings::{
    cli::XdpMode,
    duration::format_duration,
    ops::{ControlGroup, LifecycleParams, OutlierParams},
    ports::PortRange,
};

/// A value as the flags and the config file write it.
pub trait Written {
    fn written(&self) -> String;
}

/// Values whose `Display` is how they are written.
macro_rules! written_by_display {
    ($($type:ty),+) => {
        $(impl Written for $type {
            fn written(&self) -> String {
                self.to_string()
            }
        })+
    };
}

written_by_display!(String, u32, u64, f64, bool, PortRange);

impl Written for Duration {
    fn written(&self) -> String {
        format_duration(*self)
    }
}

impl Written for PathBuf {
    fn written(&self) -> String {
        self.display().to_string()
    }
}

impl Written for XdpMode {
    fn written(&self) -> String {
        self.name().into()
    }
}

impl Written for Vec<Ipv4Addr> {
    fn written(&self) -> String {
        pool(self)
    }
}

impl Written for Vec<Ipv6Addr> {
    fn written(&self) -> String {
        pool(self)
    }
}

/// A SNAT pool, comma-separated; empty: the interface's address is taken.
fn pool(addrs: &[impl Display]) -> String {
    if addrs.is_empty() {
        return "the interface's address".into();
    }
    let addrs: Vec<String> = addrs.iter().map(|a| a.to_string()).collect();
    addrs.join(",")
}

/// The metrics listener: `IP:PORT` or `off`.
impl Written for Option<SocketAddr> {
    fn written(&self) -> String {
        self.map_or_else(|| "off".into(), |addr| addr.to_string())
    }
}

/// The control group by name; none: root only.
impl Written for Option<ControlGroup> {
    fn written(&self) -> String {
        self.as_ref()
            .map_or_else(|| "root only".into(), |group| group.name.clone())
    }
}

/// A setting made of several keys: each key's name in the config file
/// and its value as written there.
pub trait WrittenKeys {
    fn written_keys(&self) -> Vec<(&'static str, String)>;
}

impl WrittenKeys for LifecycleParams {
    fn written_keys(&self) -> Vec<(&'static str, String)> {
        let LifecycleParams {
            slow_start,
            slow_start_floor,
            weight_smoothing,
            rise,
            fall,
            ejection_base,
            ejection_max,
        } = self;
        vec![
            ("slow_start", slow_start.written()),
            ("slow_start_floor", slow_start_floor.written()),
            ("weight_smoothing", weight_smoothing.written()),
            // The defaults here: a VIP's own come from its health check.
            ("health.rise", rise.written()),
            ("health.fall", fall.written()),
            ("ejection_base", ejection_base.written()),
            ("ejection_max", ejection_max.written()),
        ]
    }
}

impl WrittenKeys for OutlierParams {
    fn written_keys(&self) -> Vec<(&'static str, String)> {
        let OutlierParams {
            consecutive,
            failure_rate,
            min_volume,
            interval,
            latency_factor,
        } = self;
        vec![
            ("outlier_consecutive", consecutive.written()),
            ("outlier_failure_rate", failure_rate.written()),
            ("outlier_min_volume", min_volume.written()),
            ("outlier_interval", interval.written()),
            ("outlier_latency_factor", latency_factor.written()),
        ]
    }
}

/// `name (old → new)`; `name (old, changed)` where both read the same
/// (a control group re-created under its name with another gid).
pub fn change(name: &str, old: &impl Written, new: &impl Written) -> String {
    let (old, new) = (old.written(), new.written());
    if old == new {
        return format!("{name} ({old}, changed)");
    }
    format!("{name} ({old} → {new})")
}

/// [`change`] of each key that differs between `old` and `new`, named
/// `{prefix}{key}`; `{prefix}{setting} (changed)` if the two differ (the
/// caller compared them) in nothing their keys write.
pub fn key_changes<T: WrittenKeys>(setting: &str, prefix: &str, old: &T, new: &T) -> Vec<String> {
    let changes: Vec<String> = old
        .written_keys()
        .into_iter()
        .zip(new.written_keys())
        .filter(|((_, old), (_, new))| old != new)
        .map(|((key, old), (_, new))| format!("{prefix}{key} ({old} → {new})"))
        .collect();
    if changes.is_empty() {
        return vec![format!("{prefix}{setting} (changed)")];
    }
    changes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_read_as_the_flags_write_them() {
        assert_eq!(
            change(
                "snat_ports",
                &PortRange::default(),
                &"30000-39999".parse::<PortRange>().unwrap()
            ),
            "snat_ports (20000-32767 → 30000-39999)"
        );
        assert_eq!(XdpMode::Skb.written(), "skb");
        assert_eq!(Duration::from_millis(1500).written(), "1500ms");
        assert_eq!(
            PathBuf::from("/var/lib/lb-user").written(),
            "/var/lib/lb-user"
        );
        assert_eq!(
            vec![Ipv4Addr::new(10, 0, 0, 1), Ipv4Addr::new(10, 0, 0, 2)].written(),
            "10.0.0.1,10.0.0.2"
        );
        assert_eq!(Vec::<Ipv6Addr>::new().written(), "the interface's address");
        assert_eq!(None::<SocketAddr>.written(), "off");
        assert_eq!(None::<ControlGroup>.written(), "root only");
        assert_eq!(0.5_f64.written(), "0.5");
        // Changes that read the same still say so.
        let group = |gid| {
            Some(ControlGroup {
                name: "lbops".into(),
                gid,
            })
        };
        assert_eq!(
            change("ops.control_group", &group(1001), &group(1002)),
            "ops.control_group (lbops, changed)"
        );
        let floor = |f: f64| LifecycleParams {
            slow_start: Duration::from_secs(10),
            slow_start_floor: f,
            weight_smoothing: Duration::ZERO,
            rise: 2,
            fall: 3,
            ejection_base: Duration::from_secs(30),
            ejection_max: Duration::from_secs(300),
        };
        assert_eq!(
            key_changes("lifecycle", "ops.", &floor(0.5), &floor(0.25)),
            ["ops.slow_start_floor (0.5 → 0.25)"]
        );
        assert_eq!(
            key_changes("lifecycle", "ops.", &floor(0.5), &floor(0.5)),
            ["ops.lifecycle (changed)"]
        );
    }
}
