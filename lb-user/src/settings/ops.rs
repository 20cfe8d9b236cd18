//! Operations settings: health checks, outlier ejection, slow start, weight
//! smoothing, metrics. The same struct is a clap flag group (`--health-*`,
//! `--outlier-*`, ...) and the `[operations]` table of the config file, so
//! flags and file accept the same text; flags win field by field.
//!
//! ```toml
//! [operations]
//! slow_start = "10s"
//! slow_start_floor = 0.5
//! weight_smoothing = "0s"
//! outlier_consecutive = 5
//! outlier_failure_rate = 0.5
//! outlier_min_volume = 20
//! outlier_interval = "10s"
//! outlier_latency_factor = 0     # 0: off
//! ejection_base = "30s"
//! ejection_max = "300s"
//! max_ejection_percent = 50
//! max_new_flows = 0              # new connections per second, 0: no cap
//! metrics_addr = "127.0.0.1:9470"   # or "off"
//! control_group = "lbops"         # may use the control socket besides root
//!
//! [operations.health]            # default check of every VIP
//! check = "http"                 # none (default) | tcp | http
//! path = "/health"               # http only
//! status = 200                   # http only: expected status
//! interval = "1s"
//! timeout = "500ms"
//! rise = 2
//! fall = 2
//! latency_probe_interval = "250ms"  # the default (HTTP checks only); or "off"
//!
//! [[vip]]
//! address = "10.0.0.100:80"
//! backends = ["10.0.0.21:8080"]
//! [vip.health]                   # overrides [operations.health] key by key
//! check = "tcp"
//! ```

use std::{net::SocketAddr, time::Duration};

use clap::{Args, ValueEnum};
use serde::Deserialize;

use crate::settings::{
    duration::{self, parse_duration},
    error::ConfigError,
};

pub const DEFAULT_HEALTH_PATH: &str = "/";
pub const DEFAULT_HEALTH_STATUS: u16 = 200;
pub const DEFAULT_HEALTH_INTERVAL: Duration = Duration::from_secs(1);
pub const DEFAULT_HEALTH_TIMEOUT: Duration = Duration::from_millis(500);
pub const DEFAULT_HEALTH_RISE: u32 = 2;
pub const DEFAULT_HEALTH_FALL: u32 = 2;
/// Out-of-band latency probes of avoided backends, every 250 ms by default
/// wherever the check is HTTP (a TCP check's connect time cannot lower an
/// estimate, so it never probes). They were opt-in while they cost the
/// stall P99.9 (65.7 → 316 ms: the stalling backends were forgiven between
/// pauses); the relapse bar (`crate::estimate::refute`) fixed that, and
/// spreading the checks (`pool::health`) removed what HTTP checks cost
/// `hetero`'s P99. In the balance bench (README, "Refutation and relapse")
/// a backend back to normal then gets its share back in 0.6 s instead of 6.
pub const DEFAULT_LATENCY_PROBE_INTERVAL: ProbeInterval =
    ProbeInterval::Every(Duration::from_millis(250));
/// Shortest latency probe interval accepted: faster probes would measure
/// little more than the score interval can publish.
pub const MIN_LATENCY_PROBE_INTERVAL: Duration = Duration::from_millis(10);
pub const DEFAULT_SLOW_START: Duration = Duration::from_secs(10);
pub const DEFAULT_SLOW_START_FLOOR: f64 = 0.5;
pub const DEFAULT_OUTLIER_CONSECUTIVE: u32 = 5;
pub const DEFAULT_OUTLIER_FAILURE_RATE: f64 = 0.5;
pub const DEFAULT_OUTLIER_MIN_VOLUME: u32 = 20;
pub const DEFAULT_OUTLIER_INTERVAL: Duration = Duration::from_secs(10);
pub const DEFAULT_EJECTION_BASE: Duration = Duration::from_secs(30);
pub const DEFAULT_EJECTION_MAX: Duration = Duration::from_secs(300);
pub const DEFAULT_MAX_EJECTION_PERCENT: u32 = 50;
/// Loopback only: metrics are not for the world unless asked.
pub const DEFAULT_METRICS_ADDR: &str = "127.0.0.1:9470";

/// Tunables of the lifecycle (defaults above).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LifecycleParams {
    /// Window over which a new or recovered backend ramps to full weight
    /// (zero: no slow start).
    pub slow_start: Duration,
    /// Share of the weight a ramping backend never goes below (0..=1).
    pub slow_start_floor: f64,
    /// Time over which a weight change is applied linearly (zero: at once).
    pub weight_smoothing: Duration,
    /// Consecutive passed checks that bring a down backend back.
    pub rise: u32,
    /// Consecutive failed checks that take a backend down.
    pub fall: u32,
    /// Ejection time of the first ejection; the n-th lasts n times this.
    pub ejection_base: Duration,
    /// Upper bound on one ejection.
    pub ejection_max: Duration,
}

/// Tunables of outlier detection (defaults above).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OutlierParams {
    /// Failures in a row, or refused connections in a row with none
    /// accepted in between, that make an outlier (0: off).
    pub consecutive: u32,
    /// Failure share in one interval that makes an outlier (0: off).
    pub failure_rate: f64,
    /// Outcomes needed in an interval before the rate counts.
    pub min_volume: u32,
    /// Length of the failure-rate window.
    pub interval: Duration,
    /// Latency estimate above this multiple of the pool median is an
    /// outlier (0: off).
    pub latency_factor: f64,
}

/// Kind of active health check.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CheckKind {
    #[default]
    None,
    /// A TCP connect to the backend address.
    Tcp,
    /// `GET path` over HTTP/1.1, passing on the expected status.
    Http,
}

/// Health-check settings, all optional (flags, `[operations]`, `[vip.health]`).
#[derive(Clone, Debug, Default, Args, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HealthSettings {
    /// Active health check: none (default), tcp or http.
    #[arg(long = "health-check", value_enum, value_name = "KIND")]
    #[serde(alias = "check")]
    pub health_check: Option<CheckKind>,
    /// HTTP path of the check (default /).
    #[arg(long, value_name = "PATH")]
    #[serde(alias = "path")]
    pub health_path: Option<String>,
    /// HTTP status that passes (default 200).
    #[arg(long, value_name = "CODE")]
    #[serde(alias = "status")]
    pub health_status: Option<u16>,
    /// Time between checks of one backend (default 1s).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    #[serde(
        default,
        alias = "interval",
        deserialize_with = "duration::deserialize_opt"
    )]
    pub health_interval: Option<Duration>,
    /// A check not done in this time fails (default 500ms).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    #[serde(
        default,
        alias = "timeout",
        deserialize_with = "duration::deserialize_opt"
    )]
    pub health_timeout: Option<Duration>,
    /// Passed checks in a row that bring a failed backend back (default 2).
    #[arg(long, value_name = "N")]
    #[serde(alias = "rise")]
    pub health_rise: Option<u32>,
    /// Failed checks in a row that take a backend out (default 2).
    #[arg(long, value_name = "N")]
    #[serde(alias = "fall")]
    pub health_fall: Option<u32>,
    /// Latency probes of avoided backends: how often a backend that got no
    /// user request for this long is probed with the health check, whose
    /// timing then corrects its latency estimate (default 250ms with an
    /// HTTP check; off: the checks only decide up or down).
    #[arg(long, value_name = "DURATION|off", value_parser = parse_probe_interval)]
    #[serde(
        default,
        alias = "probe_interval",
        deserialize_with = "deserialize_probe_interval"
    )]
    pub latency_probe_interval: Option<ProbeInterval>,
}

/// `--latency-probe-interval`: a duration, or off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeInterval {
    Off,
    Every(Duration),
}

impl ProbeInterval {
    /// The interval, `None` when off.
    pub fn every(self) -> Option<Duration> {
        match self {
            ProbeInterval::Off => None,
            ProbeInterval::Every(d) => Some(d),
        }
    }
}

/// `off`, or a duration of at least [`MIN_LATENCY_PROBE_INTERVAL`].
pub fn parse_probe_interval(text: &str) -> Result<ProbeInterval, String> {
    if text.trim() == "off" {
        return Ok(ProbeInterval::Off);
    }
    let d = parse_duration(text).map_err(|e| format!("{e}, or off (latency probe interval)"))?;
    if d < MIN_LATENCY_PROBE_INTERVAL {
        return Err(format!(
            "latency probe interval '{}' is too short: at least {}, or off",
            text.trim(),
            duration::format_duration(MIN_LATENCY_PROBE_INTERVAL)
        ));
    }
    Ok(ProbeInterval::Every(d))
}

fn deserialize_probe_interval<'de, D>(d: D) -> Result<Option<ProbeInterval>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    use serde::de::Error as _;
    parse_probe_interval(&String::deserialize(d)?)
        .map(Some)
        .map_err(D::Error::custom)
}

impl HealthSettings {
    /// `self` where set, else `fallback`.
    pub fn or(self, fallback: &HealthSettings) -> HealthSettings {
        let f = fallback.clone();
        HealthSettings {
            health_check: self.health_check.or(f.health_check),
            health_path: self.health_path.or(f.health_path),
            health_status: self.health_status.or(f.health_status),
            health_interval: self.health_interval.or(f.health_interval),
            health_timeout: self.health_timeout.or(f.health_timeout),
            health_rise: self.health_rise.or(f.health_rise),
            health_fall: self.health_fall.or(f.health_fall),
            latency_probe_interval: self.latency_probe_interval.or(f.latency_probe_interval),
        }
    }

    /// Refuses every value given that no check could use, whether or not
    /// these settings select a check: `[operations.health]` values are
    /// also the defaults of every VIP's own `[vip.health]`.
    fn validate_given(&self) -> Result<(), ConfigError> {
        if let Some(path) = &self.health_path {
            check_health_path(path)?;
        }
        if let Some(status) = self.health_status
            && !(100..=599).contains(&status)
        {
            return Err(ConfigError::Ops(format!(
                "health status {status} is not an HTTP status (100..=599)"
            )));
        }
        if self.health_interval.is_some_and(|d| d.is_zero())
            || self.health_timeout.is_some_and(|d| d.is_zero())
        {
            return Err(ConfigError::Ops(
                "health interval and timeout must be greater than zero".into(),
            ));
        }
        if self.health_rise == Some(0) || self.health_fall == Some(0) {
            return Err(ConfigError::Ops(
                "health rise and fall must be at least 1".into(),
            ));
        }
        Ok(())
    }

    /// The check these settings describe (`None`: no active checks).
    pub fn resolve(&self) -> Result<Option<HealthCheck>, ConfigError> {
        self.validate_given()?;
        let kind = self.health_check.unwrap_or_default();
        let check = HealthCheck {
            http: match kind {
                CheckKind::None => return Ok(None),
                CheckKind::Tcp => None,
                CheckKind::Http => Some(HttpCheck {
                    path: self
                        .health_path
                        .clone()
                        .unwrap_or_else(|| DEFAULT_HEALTH_PATH.into()),
                    status: self.health_status.unwrap_or(DEFAULT_HEALTH_STATUS),
                }),
            },
            interval: self.health_interval.unwrap_or(DEFAULT_HEALTH_INTERVAL),
            timeout: self.health_timeout.unwrap_or(DEFAULT_HEALTH_TIMEOUT),
            rise: self.health_rise.unwrap_or(DEFAULT_HEALTH_RISE),
            fall: self.health_fall.unwrap_or(DEFAULT_HEALTH_FALL),
            // The default only for an HTTP check: a TCP check's connect
            // time cannot bring an estimate down, so it never probes.
            latency_probe: match self.latency_probe_interval {
                Some(given) => given,
                None if kind == CheckKind::Http => DEFAULT_LATENCY_PROBE_INTERVAL,
                None => ProbeInterval::Off,
            }
            .every(),
        };
        // Every value is a given one (checked above) or a valid default.
        Ok(Some(check))
    }
}

/// An HTTP check's path: from the root, no spaces.
fn check_health_path(path: &str) -> Result<(), ConfigError> {
    if !path.starts_with('/') || path.contains(char::is_whitespace) {
        return Err(ConfigError::Ops(format!(
            "health path '{path}' must start with / and contain no spaces"
        )));
    }
    Ok(())
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HttpCheck {
    pub path: String,
    pub status: u16,
}

/// A resolved active health check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthCheck {
    /// `None`: a TCP connect check.
    pub http: Option<HttpCheck>,
    pub interval: Duration,
    pub timeout: Duration,
    pub rise: u32,
    pub fall: u32,
    /// Out-of-band latency probes (`None`: off). A backend that had no
    /// user response for this long is *avoided*: a check's timing then
    /// enters its latency estimate (see
    /// [`crate::estimate::latency::LatencyEstimate::observe_probe`]), and
    /// an HTTP check is run this often instead of every `interval` while
    /// its VIP's other backends are in use. Such extra checks only
    /// measure: they never count towards rise and fall.
    pub latency_probe: Option<Duration>,
}

/// Every operations setting, all optional (flags and `[operations]`).
#[derive(Clone, Debug, Default, Args, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpsSettings {
    /// The `[operations.health]` table in a file.
    #[command(flatten)]
    #[serde(default)]
    pub health: HealthSettings,
    /// Window over which a new or recovered backend ramps up (default 10s; 0s: off).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    #[serde(default, deserialize_with = "duration::deserialize_opt")]
    pub slow_start: Option<Duration>,
    /// Share of its weight a ramping backend never goes below, 0..=1 (default 0.5).
    #[arg(long, value_name = "SHARE")]
    pub slow_start_floor: Option<f64>,
    /// Time over which a weight change takes effect (default 0s: at once).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    #[serde(default, deserialize_with = "duration::deserialize_opt")]
    pub weight_smoothing: Option<Duration>,
    /// Failures in a row (refused, SYN timeout, reset by the backend), or connections refused in a row with none accepted in between, that eject (default 5; 0: off).
    #[arg(long, value_name = "N")]
    pub outlier_consecutive: Option<u32>,
    /// Failure share within one interval that ejects, 0..=1 (default 0.5; 0: off).
    #[arg(long, value_name = "SHARE")]
    pub outlier_failure_rate: Option<f64>,
    /// Outcomes needed in an interval before the failure rate counts (default 20).
    #[arg(long, value_name = "N")]
    pub outlier_min_volume: Option<u32>,
    /// Window of the failure rate (default 10s).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    #[serde(default, deserialize_with = "duration::deserialize_opt")]
    pub outlier_interval: Option<Duration>,
    /// Eject a backend whose latency is this multiple of the pool median (default 0: off).
    #[arg(long, value_name = "FACTOR")]
    pub outlier_latency_factor: Option<f64>,
    /// First ejection time; the n-th ejection lasts n times this (default 30s).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    #[serde(default, deserialize_with = "duration::deserialize_opt")]
    pub ejection_base: Option<Duration>,
    /// Longest ejection (default 300s).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    #[serde(default, deserialize_with = "duration::deserialize_opt")]
    pub ejection_max: Option<Duration>,
    /// Largest share of a VIP's backends ejected at once, in percent (default 50; never all).
    #[arg(long, value_name = "PERCENT")]
    pub max_ejection_percent: Option<u32>,
    /// Most new connections per second the balancer accepts, shared out
    /// over the CPUs (default 0: no cap); beyond it new flows are refused
    /// before they touch the flow table.
    #[arg(long, value_name = "PER_SECOND")]
    pub max_new_flows: Option<u32>,
    /// Prometheus metrics listener, IP:PORT or "off" (default 127.0.0.1:9470).
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<String>,
    /// A group whose members may use the control socket (default: root only).
    #[arg(long, value_name = "NAME")]
    pub control_group: Option<String>,
}

impl OpsSettings {
    /// Flags (`self`) over the file's `[operations]`.
    pub fn or(self, file: OpsSettings) -> OpsSettings {
        OpsSettings {
            health: self.health.or(&file.health),
            slow_start: self.slow_start.or(file.slow_start),
            slow_start_floor: self.slow_start_floor.or(file.slow_start_floor),
            weight_smoothing: self.weight_smoothing.or(file.weight_smoothing),
            outlier_consecutive: self.outlier_consecutive.or(file.outlier_consecutive),
            outlier_failure_rate: self.outlier_failure_rate.or(file.outlier_failure_rate),
            outlier_min_volume: self.outlier_min_volume.or(file.outlier_min_volume),
            outlier_interval: self.outlier_interval.or(file.outlier_interval),
            outlier_latency_factor: self.outlier_latency_factor.or(file.outlier_latency_factor),
            ejection_base: self.ejection_base.or(file.ejection_base),
            ejection_max: self.ejection_max.or(file.ejection_max),
            max_ejection_percent: self.max_ejection_percent.or(file.max_ejection_percent),
            max_new_flows: self.max_new_flows.or(file.max_new_flows),
            metrics_addr: self.metrics_addr.or(file.metrics_addr),
            control_group: self.control_group.or(file.control_group),
        }
    }

    /// The lifecycle's parameters, with the default health rise and fall.
    fn lifecycle(&self) -> Result<LifecycleParams, ConfigError> {
        Ok(LifecycleParams {
            slow_start: self.slow_start.unwrap_or(DEFAULT_SLOW_START),
            slow_start_floor: share(
                "slow start floor",
                self.slow_start_floor,
                DEFAULT_SLOW_START_FLOOR,
            )?,
            weight_smoothing: self.weight_smoothing.unwrap_or_default(),
            rise: DEFAULT_HEALTH_RISE,
            fall: DEFAULT_HEALTH_FALL,
            ejection_base: self.ejection_base.unwrap_or(DEFAULT_EJECTION_BASE),
            ejection_max: self.ejection_max.unwrap_or(DEFAULT_EJECTION_MAX),
        })
    }

    fn outlier(&self) -> Result<OutlierParams, ConfigError> {
        let latency_factor = self.outlier_latency_factor.unwrap_or(0.0);
        // Finite too: `inf` would turn the ejection on with a threshold
        // no backend can reach.
        if !(latency_factor == 0.0 || (latency_factor >= 1.0 && latency_factor.is_finite())) {
            return Err(ConfigError::Ops(format!(
                "outlier latency factor {latency_factor} must be 0 (off) or a finite number \
                 at least 1"
            )));
        }
        let outlier = OutlierParams {
            consecutive: self
                .outlier_consecutive
                .unwrap_or(DEFAULT_OUTLIER_CONSECUTIVE),
            failure_rate: share(
                "outlier failure rate",
                self.outlier_failure_rate,
                DEFAULT_OUTLIER_FAILURE_RATE,
            )?,
            min_volume: self
                .outlier_min_volume
                .unwrap_or(DEFAULT_OUTLIER_MIN_VOLUME),
            interval: self.outlier_interval.unwrap_or(DEFAULT_OUTLIER_INTERVAL),
            latency_factor,
        };
        if outlier.interval.is_zero() {
            return Err(ConfigError::Ops(
                "outlier interval must be greater than zero".into(),
            ));
        }
        Ok(outlier)
    }

    /// Validated values with defaults filled in. Rise and fall of the
    /// lifecycle come from the VIP's health check (see [`Ops::lifecycle_for`]).
    pub fn resolve(&self) -> Result<Ops, ConfigError> {
        self.health.validate_given()?;
        let lifecycle = self.lifecycle()?;
        let outlier = self.outlier()?;
        let max_ejection_percent = self
            .max_ejection_percent
            .unwrap_or(DEFAULT_MAX_EJECTION_PERCENT);
        if max_ejection_percent > 100 {
            return Err(ConfigError::Ops(format!(
                "max ejection percent {max_ejection_percent} out of range (0..=100)"
            )));
        }
        let metrics_addr = match self.metrics_addr.as_deref().unwrap_or(DEFAULT_METRICS_ADDR) {
            "off" => None,
            text => Some(text.parse::<SocketAddr>().map_err(|_| {
                ConfigError::Ops(format!("metrics address '{text}' is not IP:PORT or off"))
            })?),
        };
        let control_group = self
            .control_group
            .as_deref()
            .map(ControlGroup::lookup)
            .transpose()?;
        Ok(Ops {
            lifecycle,
            outlier,
            max_ejection_percent,
            max_new_flows: self.max_new_flows.unwrap_or(0),
            metrics_addr,
            control_group,
        })
    }
}

/// A share in 0..=1 (`default` when not given).
fn share(name: &str, v: Option<f64>, default: f64) -> Result<f64, ConfigError> {
    match v.unwrap_or(default) {
        v if (0.0..=1.0).contains(&v) => Ok(v),
        v => Err(ConfigError::Ops(format!(
            "{name} {v} out of range (expected 0..=1)"
        ))),
    }
}

/// Resolved operations settings shared by every VIP.
#[derive(Clone, Debug, PartialEq)]
pub struct Ops {
    pub lifecycle: LifecycleParams,
    pub outlier: OutlierParams,
    pub max_ejection_percent: u32,
    /// New flows per second for the whole balancer (0: no cap).
    pub max_new_flows: u32,
    pub metrics_addr: Option<SocketAddr>,
    /// Besides root, who may use the control socket.
    pub control_group: Option<ControlGroup>,
}

/// A group allowed on the control socket, by name and id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ControlGroup {
    pub name: String,
    pub gid: u32,
}

impl ControlGroup {
    /// The group `name` of this host's group database.
    pub fn lookup(name: &str) -> Result<Self, ConfigError> {
        match nix::unistd::Group::from_name(name) {
            Ok(Some(group)) => Ok(Self {
                name: name.to_string(),
                gid: group.gid.as_raw(),
            }),
            Ok(None) => Err(ConfigError::Ops(format!("unknown control group '{name}'"))),
            Err(e) => Err(ConfigError::Ops(format!(
                "cannot look up control group '{name}': {e}"
            ))),
        }
    }
}

impl Ops {
    /// Lifecycle parameters of a VIP: rise and fall from its health check.
    pub fn lifecycle_for(&self, check: Option<&HealthCheck>) -> LifecycleParams {
        match check {
            Some(c) => LifecycleParams {
                rise: c.rise,
                fall: c.fall,
                ..self.lifecycle
            },
            None => self.lifecycle,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> OpsSettings {
        toml::from_str(text).unwrap()
    }

    #[test]
    fn defaults_resolve() {
        let ops = OpsSettings::default().resolve().unwrap();
        assert_eq!(ops.lifecycle.slow_start, DEFAULT_SLOW_START);
        assert_eq!(ops.outlier.consecutive, 5);
        assert_eq!(
            ops.metrics_addr,
            Some(DEFAULT_METRICS_ADDR.parse().unwrap())
        );
        assert_eq!(OpsSettings::default().health.resolve().unwrap(), None);
    }

    #[test]
    fn file_health_and_overrides() {
        let global =
            parse("metrics_addr = \"off\"\n[health]\ncheck = \"http\"\npath = \"/h\"\nrise = 3");
        let vip: HealthSettings = toml::from_str("check = \"tcp\"\nfall = 4").unwrap();
        let check = vip.or(&global.health).resolve().unwrap().unwrap();
        assert_eq!(check.http, None);
        assert_eq!((check.rise, check.fall), (3, 4));
        let http = global.health.resolve().unwrap().unwrap();
        assert_eq!(http.http.unwrap().path, "/h");
        assert_eq!(global.resolve().unwrap().metrics_addr, None);
    }

    #[test]
    fn bad_values_are_refused() {
        for text in [
            "slow_start_floor = 1.5",
            "max_ejection_percent = 101",
            "metrics_addr = \"nowhere\"",
            "outlier_latency_factor = 0.5",
            "outlier_latency_factor = inf",
            "outlier_latency_factor = nan",
        ] {
            assert!(parse(text).resolve().is_err(), "{text}");
        }
        assert!(
            parse("[health]\ncheck = \"http\"\npath = \"x\"")
                .health
                .resolve()
                .is_err()
        );
        assert!(
            parse("[health]\ncheck = \"tcp\"\nrise = 0")
                .health
                .resolve()
                .is_err()
        );
        // Given values are checked without a check too (they are every
        // VIP's defaults), and an HTTP status is one.
        for text in [
            "[health]\npath = \"/x\"\nrise = 0",
            "[health]\ncheck = \"tcp\"\npath = \"no-slash\"",
            "[health]\nstatus = 0",
            "[health]\ncheck = \"http\"\nstatus = 999",
            "[health]\ninterval = \"0s\"",
        ] {
            let settings = parse(text);
            assert!(settings.resolve().is_err(), "{text}");
            assert!(settings.health.resolve().is_err(), "{text}");
        }
        assert!(
            parse("[health]\ncheck = \"http\"\nstatus = 204")
                .health
                .resolve()
                .is_ok()
        );
        assert!(toml::from_str::<OpsSettings>("bogus = 1").is_err());
    }

    #[test]
    fn latency_probes_default_to_250ms_and_can_be_set_or_turned_off() {
        let probe = |text: &str| parse(text).health.resolve().unwrap().unwrap().latency_probe;
        assert_eq!(
            probe("[health]\ncheck = \"http\""),
            Some(Duration::from_millis(250))
        );
        // A TCP check never probes unless asked to.
        assert_eq!(probe("[health]\ncheck = \"tcp\""), None);
        assert_eq!(
            probe("[health]\ncheck = \"http\"\nlatency_probe_interval = \"250ms\""),
            Some(Duration::from_millis(250))
        );
        assert_eq!(
            probe("[health]\ncheck = \"http\"\nlatency_probe_interval = \"off\""),
            None
        );
        assert_eq!(
            probe("[health]\ncheck = \"http\"\nprobe_interval = \"100ms\""),
            Some(Duration::from_millis(100))
        );
        // A VIP's own value wins over [operations.health].
        let global = parse("[health]\ncheck = \"http\"\nlatency_probe_interval = \"off\"");
        let vip: HealthSettings = toml::from_str("latency_probe_interval = \"1s\"").unwrap();
        let check = vip.or(&global.health).resolve().unwrap().unwrap();
        assert_eq!(check.latency_probe, Some(Duration::from_secs(1)));
    }

    #[test]
    fn bad_latency_probe_intervals_say_what_is_wrong() {
        assert_eq!(
            parse_probe_interval("5ms").unwrap_err(),
            "latency probe interval '5ms' is too short: at least 10ms, or off"
        );
        assert_eq!(
            parse_probe_interval("0s").unwrap_err(),
            "latency probe interval '0s' is too short: at least 10ms, or off"
        );
        let err = parse_probe_interval("soon").unwrap_err();
        assert!(
            err.contains("invalid duration 'soon'")
                && err.ends_with("or off (latency probe interval)"),
            "{err}"
        );
        let err = toml::from_str::<OpsSettings>("[health]\nlatency_probe_interval = \"1ms\"")
            .unwrap_err()
            .to_string();
        assert!(err.contains("too short"), "{err}");
    }

    #[test]
    fn the_control_group_is_looked_up_by_name() {
        assert_eq!(
            ControlGroup::lookup("root").unwrap(),
            ControlGroup {
                name: "root".into(),
                gid: 0
            }
        );
        let err = ControlGroup::lookup("no-such-group-lb").unwrap_err();
        assert_eq!(err.to_string(), "unknown control group 'no-such-group-lb'");
    }
}
