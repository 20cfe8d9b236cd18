//! One validated [`Config`] from flags and an optional TOML file.
//!
//! # Config file schema
//!
//! Every key is optional and means exactly what the flag of the same name
//! (with `-` for `_`) means; unknown keys are an error.
//!
//! ```toml
//! iface = "eth0"
//! xdp_mode = "native"            # or "skb"
//! snat_ip = "10.0.0.1"           # or a pool: ["10.0.0.1", "10.0.0.2"]; default: the
//!                                # interface's primary IPv4 address
//! snat_ip6 = "2001:db8::1"       # or a pool; default: the interface's first global IPv6 address
//! snat_ports = "20000-32767"
//! flow_table_size = 262144       # each family's flow table
//! flow_table_size_ipv6 = 262144  # IPv6's; default: flow_table_size
//! algorithm = "p2c-ewma"         # default for VIPs that do not name one
//! inflight_bias = 2              # default for VIPs that do not set one
//! p2c_full_scan = 16             # default for VIPs that do not set one (0: always two)
//! maglev_source_affinity = false # default for VIPs that do not set one
//! zone_aware = true              # default for VIPs that do not set one;
//!                                # default: true exactly when `zone` is set
//! zone = "a"                     # the balancer's own zone; default: none
//! zone_min_healthy = 70          # percent (or "70%"), 1..=100: the local zone is
//!                                # healthy while this share of its weight is
//! zone_avoid_factor = 3.0        # at least 1: avoid the local zone when it costs
//!                                # this many times the best other zone
//! zone_failover = ["b", "c"]     # spill order to other zones; default: by cost;
//!                                # needs `zone`, must not list it
//! ewma_tau = "10s"               # memory of the mean latency
//! ewma_peak_tau = "10s"          # memory of peaks; default and at most ewma_tau
//! ewma_refute_after = 16         # fast responses in a row that refute it; 0: off
//! ewma_cold_start = "1ms"
//! score_interval = "50ms"
//! udp_idle_timeout = "30s"
//! tcp_idle_timeout = "300s"
//! syn_timeout = "3s"
//! snat_quarantine = "65s"        # a closed connection's SNAT tuple, from the close
//! snat_time_wait_reuse = true    # a SYN the backend's TIME_WAIT accepts may take one sooner
//! instance = "lb-eth0"
//! log_level = "info"
//! state_dir = "/var/lib/lb-user"   # runtime changes kept across restarts
//!
//! [[vip]]
//! address = "10.0.0.100:80"      # same syntax as --vip: IP:PORT[/tcp|/udp]
//! protocol = "tcp"               # optional alternative to the /tcp suffix
//! algorithm = "round-robin"      # optional, overrides the global one
//! inflight_bias = 1              # optional
//! p2c_full_scan = 0              # optional
//! maglev_source_affinity = true  # optional: maglev hashes only the client address
//! zone_aware = false             # optional; true needs the balancer's `zone`
//! backends = ["10.0.0.21:8080", "10.0.0.22:8080@2,zone=a"]   # same syntax as --backend
//! # A backend may also be a table (unknown keys are an error; weight
//! # defaults to 1, zone to none); both forms mix in one list:
//! # backends = ["10.0.0.21:8080", { addr = "10.0.0.22:8080", weight = 2, zone = "b" }]
//! ```
//!
//! # Flags and file together
//!
//! A flag overrides the file's global of the same name (`--algorithm`,
//! `--inflight-bias` and `--zone-aware` override the global defaults, so they
//! apply to file VIPs that do not set their own). `--vip` with its `--backend`s adds one more VIP
//! after the file's VIPs. VIPs and backends get their ids in that order, so the
//! same configuration always yields the same ids (which is what lets a
//! restarted instance keep its pinned flow table meaningful).

use std::{
    collections::HashSet,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::{Path, PathBuf},
    time::Duration,
};

use lb_common::{
    Algorithm, DEFAULT_FLOW_TABLE_SIZE, DEFAULT_INFLIGHT_BIAS, DEFAULT_P2C_FULL_SCAN, MAX_BACKENDS,
    MAX_BACKENDS_PER_VIP, MAX_INFLIGHT_BIAS, MAX_MAGLEV_TABLES, MAX_SNAT_ADDRS, MAX_VIPS,
    MIN_INFLIGHT_BIAS,
};
use serde::Deserialize;

use crate::{
    settings::addr::{BackendAddr, Protocol, VipAddr},
    settings::algorithm::parse_algorithm,
    settings::cli::{RunArgs, XdpMode},
    settings::discovery::{Discovery, FileDiscovery, check_prefix},
    settings::duration::{self, format_duration},
    settings::error::{ConfigError, one_line},
    settings::ops::{HealthCheck, HealthSettings, Ops, OpsSettings},
    settings::ports::PortRange,
    settings::written::{change, key_changes},
    settings::zone::{ZoneName, ZoneSettings},
};

/// Lives with the address parsing; named here too, where its callers look.
pub use crate::settings::addr::not_a_host;

/// Memory of the mean latency: linkerd's and Finagle's Peak-EWMA τ.
pub const DEFAULT_EWMA_TAU: Duration = Duration::from_secs(10);
/// Latency assumed before the first sample and the value an idle backend
/// drifts back to. A LAN-scale 1 ms is deliberately optimistic for most
/// services: Peak-EWMA corrects an optimistic guess with the first slow
/// sample (peaks replace the estimate at once), whereas a pessimistic guess
/// would starve a new or recovered backend until it decayed over τ.
pub const DEFAULT_EWMA_COLD_START: Duration = Duration::from_millis(1);
/// The estimators' settings: `ewma_cold_start`, `ewma_tau` and
/// `ewma_peak_tau`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EstimateParams {
    /// Latency assumed before the first sample, and where an idle
    /// backend's estimate drifts to.
    pub cold_start: Duration,
    /// Memory of the mean latency (persistent slowness).
    pub tau: Duration,
    /// Memory of the peaks (capped at `tau`).
    pub peak_tau: Duration,
    /// Fast responses in a row that refute both memories (0: never; see
    /// [`crate::estimate::refute`]).
    pub refute_after: u64,
}

/// See [`crate::estimate::refute`].
pub const DEFAULT_EWMA_REFUTE_AFTER: u64 = 16;
pub const DEFAULT_SCORE_INTERVAL: Duration = Duration::from_millis(50);
/// The kernel must see fresh scores at least this often (issue contract).
pub const MAX_SCORE_INTERVAL: Duration = Duration::from_millis(100);
/// Shorter would spend the control plane on rewriting the same scores.
pub const MIN_SCORE_INTERVAL: Duration = Duration::from_millis(1);
pub const DEFAULT_UDP_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
pub const DEFAULT_TCP_IDLE_TIMEOUT: Duration = Duration::from_secs(300);
pub const DEFAULT_SYN_TIMEOUT: Duration = Duration::from_secs(3);
/// Linux's 60 s TIME_WAIT on the backend, plus slack.
pub const DEFAULT_SNAT_QUARANTINE: Duration =
    Duration::from_nanos(lb_common::DEFAULT_SNAT_QUARANTINE_NS);
/// Each flow uses two entries (one per direction).
pub const MIN_FLOW_TABLE_SIZE: u32 = 2;
/// 2^28 entries: 134 million flows, about 44 GiB of kernel memory for an
/// IPv4 table (the kernel preallocates every entry). The kernel itself
/// refuses past 2^31; a host's memory long before (checked at the start,
/// `kernel::attach`).
pub const MAX_FLOW_TABLE_SIZE: u32 = 1 << 28;
/// The longest SNAT quarantine: TIME_WAIT is 60 s on Linux and at most
/// 4 minutes (2 MSL) elsewhere; a longer quarantine only holds tuples back
/// (a backend's capacity is addresses × ports ÷ quarantine).
pub const MAX_SNAT_QUARANTINE: Duration = Duration::from_secs(3600);
/// Linux's IFNAMSIZ minus the terminating NUL.
const MAX_IFACE_NAME: usize = 15;
const MAX_INSTANCE_NAME: usize = 64;

/// Where runtime state files live unless `--state-dir` says otherwise.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/lb-user";

/// The validated configuration of a running balancer.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub iface: String,
    pub xdp_mode: XdpMode,
    /// The IPv4 SNAT pool; empty: the interface's primary IPv4 address
    /// (resolved at startup).
    pub snat_ip: Vec<Ipv4Addr>,
    /// The IPv6 SNAT pool; empty: the interface's first global IPv6 address
    /// (resolved at startup, needed only when a VIP is IPv6).
    pub snat_ip6: Vec<Ipv6Addr>,
    pub snat_ports: PortRange,
    /// Entries of IPv4's flow table (`FLOWS4`).
    pub flow_table_size: u32,
    /// Entries of IPv6's flow table (`FLOWS`).
    pub flow_table_size_ipv6: u32,
    pub ewma_tau: Duration,
    pub ewma_peak_tau: Duration,
    pub ewma_refute_after: u64,
    pub ewma_cold_start: Duration,
    pub score_interval: Duration,
    pub udp_idle_timeout: Duration,
    pub tcp_idle_timeout: Duration,
    pub syn_timeout: Duration,
    /// How long a closed connection's SNAT tuple stays reserved.
    pub snat_quarantine: Duration,
    /// A SYN may take over a tuple in quarantine that the backend's
    /// TIME_WAIT accepts it on (`lb_common::time_wait`).
    pub snat_time_wait_reuse: bool,
    pub instance: String,
    pub log_level: String,
    /// Where the runtime state file lives (see `settings::state`).
    pub state_dir: std::path::PathBuf,
    /// Health checks, ejection, slow start, metrics (see `ops_config.rs`).
    pub ops: Ops,
    /// Replace a re-adopted program even when its tag matches (`--upgrade`).
    pub upgrade: bool,
    /// In id order: `vips[i]` gets vip id `i`.
    pub vips: Vec<VipConfig>,
    /// etcd, the state folder, the removal cap (see `discovery.rs`).
    pub discovery: Discovery,
    /// The balancer's zone and the zone-aware routing settings.
    pub zones: ZoneSettings,
}

#[derive(Clone, Debug, PartialEq)]
pub struct VipConfig {
    pub vip: VipAddr,
    pub algorithm: Algorithm,
    pub inflight_bias: u8,
    /// P2C compares every backend while the VIP (or its zone) has at most
    /// this many (0: always two random ones).
    pub p2c_full_scan: u16,
    /// In-flight count from which P2C counts a backend as saturated (0: never).
    pub p2c_saturation: u16,
    /// Maglev hashes only the client address (one client, one backend).
    pub maglev_source_affinity: bool,
    /// Route by zone (see [`ZoneSettings`]); only ever true when the
    /// balancer has a zone.
    pub zone_aware: bool,
    /// In config order (backend ids follow it).
    pub backends: Vec<BackendAddr>,
    /// Active health check of this VIP's backends, if any.
    pub health: Option<HealthCheck>,
    /// The backends come from the etcd keys under this prefix (then
    /// `backends` is empty in the configuration, and filled at startup).
    pub etcd_prefix: Option<String>,
}

impl VipConfig {
    /// What the VIP takes of the count limits ([`check_limits`]): its
    /// backends, and whether it uses a Maglev table.
    pub fn footprint(&self) -> (usize, bool) {
        (self.backends.len(), self.algorithm == Algorithm::Maglev)
    }
}

/// The TOML file as written (see the module docs).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    iface: Option<String>,
    xdp_mode: Option<XdpMode>,
    #[serde(default, deserialize_with = "de::one_or_many")]
    snat_ip: Vec<Ipv4Addr>,
    #[serde(default, deserialize_with = "de::one_or_many")]
    snat_ip6: Vec<Ipv6Addr>,
    #[serde(default, deserialize_with = "de::from_str_opt")]
    snat_ports: Option<PortRange>,
    flow_table_size: Option<u32>,
    flow_table_size_ipv6: Option<u32>,
    #[serde(default, deserialize_with = "de::algorithm_opt")]
    algorithm: Option<Algorithm>,
    inflight_bias: Option<u8>,
    p2c_full_scan: Option<u16>,
    p2c_saturation: Option<u16>,
    maglev_source_affinity: Option<bool>,
    zone_aware: Option<bool>,
    zone: Option<ZoneName>,
    #[serde(default, deserialize_with = "de::min_healthy_opt")]
    zone_min_healthy: Option<f64>,
    zone_avoid_factor: Option<f64>,
    #[serde(default)]
    zone_failover: Vec<ZoneName>,
    #[serde(default, deserialize_with = "duration::deserialize_opt")]
    ewma_tau: Option<Duration>,
    #[serde(default, deserialize_with = "duration::deserialize_opt")]
    ewma_peak_tau: Option<Duration>,
    ewma_refute_after: Option<u64>,
    #[serde(default, deserialize_with = "duration::deserialize_opt")]
    ewma_cold_start: Option<Duration>,
    #[serde(default, deserialize_with = "duration::deserialize_opt")]
    score_interval: Option<Duration>,
    #[serde(default, deserialize_with = "duration::deserialize_opt")]
    udp_idle_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "duration::deserialize_opt")]
    tcp_idle_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "duration::deserialize_opt")]
    syn_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "duration::deserialize_opt")]
    snat_quarantine: Option<Duration>,
    snat_time_wait_reuse: Option<bool>,
    instance: Option<String>,
    log_level: Option<String>,
    state_dir: Option<std::path::PathBuf>,
    #[serde(default)]
    operations: OpsSettings,
    #[serde(default)]
    vip: Vec<FileVip>,
    etcd_endpoints: Option<Vec<String>>,
    etcd_ca: Option<PathBuf>,
    etcd_cert: Option<PathBuf>,
    etcd_key: Option<PathBuf>,
    etcd_user: Option<String>,
    etcd_password: Option<String>,
    etcd_password_file: Option<PathBuf>,
    max_removal_percent: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileVip {
    /// Parsed in [`Config::merge`], which must know whether a `/proto`
    /// suffix was written to detect a conflict with `protocol`.
    address: String,
    protocol: Option<Protocol>,
    #[serde(default, deserialize_with = "de::algorithm_opt")]
    algorithm: Option<Algorithm>,
    inflight_bias: Option<u8>,
    p2c_full_scan: Option<u16>,
    p2c_saturation: Option<u16>,
    maglev_source_affinity: Option<bool>,
    zone_aware: Option<bool>,
    #[serde(default, deserialize_with = "de::backends")]
    backends: Vec<BackendAddr>,
    /// Overrides `[operations.health]` key by key.
    #[serde(default)]
    health: HealthSettings,
    etcd_prefix: Option<String>,
}

impl FileConfig {
    fn discovery(&self) -> FileDiscovery {
        FileDiscovery {
            etcd_endpoints: self.etcd_endpoints.clone(),
            etcd_ca: self.etcd_ca.clone(),
            etcd_cert: self.etcd_cert.clone(),
            etcd_key: self.etcd_key.clone(),
            etcd_user: self.etcd_user.clone(),
            etcd_password: self.etcd_password.clone(),
            etcd_password_file: self.etcd_password_file.clone(),
            max_removal_percent: self.max_removal_percent,
        }
    }

    pub fn parse(text: &str, path: &Path) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| {
            // toml's rendering spans lines (with a caret excerpt): the
            // position and the gist, on one line.
            let at = e
                .span()
                .and_then(|span| text.get(..span.start))
                .map(|before| {
                    let line = before.matches('\n').count() + 1;
                    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
                    format!("line {line}, column {column}: ")
                })
                .unwrap_or_default();
            ConfigError::Invalid {
                path: path.display().to_string(),
                reason: format!("{at}{}", one_line(e.message())),
            }
        })
    }

    pub fn read(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Unreadable {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        Self::parse(&text, path)
    }
}

/// What a VIP that does not say otherwise gets: the flag, else the file's
/// global, else the default.
struct VipDefaults {
    algorithm: Algorithm,
    inflight_bias: u8,
    p2c_full_scan: u16,
    p2c_saturation: u16,
    maglev_source_affinity: bool,
    zone_aware: bool,
}

impl VipDefaults {
    fn pick(args: &RunArgs, file: &FileConfig) -> Self {
        Self {
            algorithm: args
                .algorithm
                .or(file.algorithm)
                .unwrap_or(Algorithm::P2cEwma),
            inflight_bias: args
                .inflight_bias
                .or(file.inflight_bias)
                .unwrap_or(DEFAULT_INFLIGHT_BIAS),
            p2c_full_scan: args
                .p2c_full_scan
                .or(file.p2c_full_scan)
                .unwrap_or(DEFAULT_P2C_FULL_SCAN),
            p2c_saturation: args
                .p2c_saturation
                .or(file.p2c_saturation)
                .unwrap_or(lb_common::DEFAULT_P2C_SATURATION),
            maglev_source_affinity: args.maglev_source_affinity
                || file.maglev_source_affinity.unwrap_or(false),
            zone_aware: args
                .zone_aware
                .or(file.zone_aware)
                .unwrap_or(args.zone.or(file.zone).is_some()),
        }
    }
}

impl FileVip {
    /// This `[[vip]]` with the `defaults` filled in, and its health check
    /// from its own keys over `[operations.health]`.
    fn resolve(
        self,
        defaults: &VipDefaults,
        health: &HealthSettings,
    ) -> Result<VipConfig, ConfigError> {
        let mut vip: VipAddr = self.address.parse().map_err(ConfigError::FileAddress)?;
        if let Some(protocol) = self.protocol {
            let said_in_address = self.address.contains('/');
            if said_in_address && vip.protocol != protocol {
                return Err(ConfigError::ProtocolConflict {
                    vip: vip.to_string(),
                    protocol: protocol.name().to_string(),
                });
            }
            vip.protocol = protocol;
        }
        Ok(VipConfig {
            vip,
            algorithm: self.algorithm.unwrap_or(defaults.algorithm),
            inflight_bias: self.inflight_bias.unwrap_or(defaults.inflight_bias),
            p2c_full_scan: self.p2c_full_scan.unwrap_or(defaults.p2c_full_scan),
            p2c_saturation: self.p2c_saturation.unwrap_or(defaults.p2c_saturation),
            maglev_source_affinity: self
                .maglev_source_affinity
                .unwrap_or(defaults.maglev_source_affinity),
            zone_aware: self.zone_aware.unwrap_or(defaults.zone_aware),
            backends: self.backends,
            health: self.health.or(health).resolve()?,
            etcd_prefix: self.etcd_prefix,
        })
    }
}

impl Config {
    /// Reads `--config` (if any) and merges it with the flags.
    pub fn from_args(args: RunArgs) -> Result<Self, ConfigError> {
        let file = match &args.config {
            Some(path) => FileConfig::read(path)?,
            None => FileConfig::default(),
        };
        Self::merge(args, file)
    }

    /// For tests: the configuration of the flags `flags` (after the
    /// program name) and the TOML `file`, which must be valid.
    #[cfg(test)]
    pub fn of(flags: &[&str], file: &str) -> Self {
        use clap::Parser as _;
        let argv = [&["lb-user"][..], flags].concat();
        let args = super::cli::Cli::try_parse_from(argv).unwrap().run;
        let file = FileConfig::parse(file, Path::new("t.toml")).unwrap();
        Self::merge(args, file).unwrap()
    }

    /// Flags override the file's globals; `--vip` adds a VIP after the file's.
    pub fn merge(mut args: RunArgs, mut file: FileConfig) -> Result<Self, ConfigError> {
        let iface = args
            .iface
            .take()
            .or(file.iface.take())
            .ok_or(ConfigError::NoIface)?;
        let defaults = VipDefaults::pick(&args, &file);
        let ops_settings = args.ops.clone().or(std::mem::take(&mut file.operations));
        let ops = ops_settings.resolve()?;
        let mut vips = Vec::with_capacity(file.vip.len() + 1);
        for v in std::mem::take(&mut file.vip) {
            vips.push(v.resolve(&defaults, &ops_settings.health)?);
        }
        match args.vip.take() {
            Some(vip) => vips.push(VipConfig {
                vip,
                algorithm: defaults.algorithm,
                inflight_bias: defaults.inflight_bias,
                p2c_full_scan: defaults.p2c_full_scan,
                p2c_saturation: defaults.p2c_saturation,
                maglev_source_affinity: defaults.maglev_source_affinity,
                zone_aware: defaults.zone_aware,
                backends: std::mem::take(&mut args.backends),
                health: ops_settings.health.resolve()?,
                etcd_prefix: args.discovery.etcd_prefix.take(),
            }),
            None if !args.backends.is_empty() => return Err(ConfigError::BackendWithoutVip),
            None if args.discovery.etcd_prefix.is_some() => {
                return Err(ConfigError::Ops("--etcd-prefix given without --vip".into()));
            }
            None => {}
        }
        let discovery = args.discovery.resolve(&file.discovery())?;
        let mut config = Self::from_globals(args, file, iface, ops, vips);
        config.discovery = discovery;
        config.validate()?;
        Ok(config)
    }

    /// The global settings: a flag, else the file's key, else the default.
    fn from_globals(
        args: RunArgs,
        file: FileConfig,
        iface: String,
        ops: Ops,
        vips: Vec<VipConfig>,
    ) -> Self {
        let pick = |flag: Option<Duration>, key: Option<Duration>, default| {
            flag.or(key).unwrap_or(default)
        };
        let zone_defaults = ZoneSettings::default();
        let zones = ZoneSettings {
            local: args.zone.or(file.zone),
            min_healthy: args
                .zone_min_healthy
                .or(file.zone_min_healthy)
                .unwrap_or(zone_defaults.min_healthy),
            avoid_factor: args
                .zone_avoid_factor
                .or(file.zone_avoid_factor)
                .unwrap_or(zone_defaults.avoid_factor),
            failover: if args.zone_failover.is_empty() {
                file.zone_failover
            } else {
                args.zone_failover
            },
        };
        Self {
            xdp_mode: args.xdp_mode.or(file.xdp_mode).unwrap_or_default(),
            snat_ip: if args.snat_ip.is_empty() {
                file.snat_ip
            } else {
                args.snat_ip
            },
            snat_ip6: if args.snat_ip6.is_empty() {
                file.snat_ip6
            } else {
                args.snat_ip6
            },
            snat_ports: args.snat_ports.or(file.snat_ports).unwrap_or_default(),
            flow_table_size: args
                .flow_table_size
                .or(file.flow_table_size)
                .unwrap_or(DEFAULT_FLOW_TABLE_SIZE),
            // Not given: as large as IPv4's (the resolved flow_table_size).
            flow_table_size_ipv6: args
                .flow_table_size_ipv6
                .or(file.flow_table_size_ipv6)
                .or(args.flow_table_size)
                .or(file.flow_table_size)
                .unwrap_or(DEFAULT_FLOW_TABLE_SIZE),
            ewma_tau: pick(args.ewma_tau, file.ewma_tau, DEFAULT_EWMA_TAU),
            // Not given: as long as the (resolved) ewma_tau.
            ewma_peak_tau: pick(
                args.ewma_peak_tau,
                file.ewma_peak_tau,
                pick(args.ewma_tau, file.ewma_tau, DEFAULT_EWMA_TAU),
            ),
            ewma_refute_after: args
                .ewma_refute_after
                .or(file.ewma_refute_after)
                .unwrap_or(DEFAULT_EWMA_REFUTE_AFTER),
            ewma_cold_start: pick(
                args.ewma_cold_start,
                file.ewma_cold_start,
                DEFAULT_EWMA_COLD_START,
            ),
            score_interval: pick(
                args.score_interval,
                file.score_interval,
                DEFAULT_SCORE_INTERVAL,
            ),
            udp_idle_timeout: pick(
                args.udp_idle_timeout,
                file.udp_idle_timeout,
                DEFAULT_UDP_IDLE_TIMEOUT,
            ),
            tcp_idle_timeout: pick(
                args.tcp_idle_timeout,
                file.tcp_idle_timeout,
                DEFAULT_TCP_IDLE_TIMEOUT,
            ),
            syn_timeout: pick(args.syn_timeout, file.syn_timeout, DEFAULT_SYN_TIMEOUT),
            snat_quarantine: pick(
                args.snat_quarantine,
                file.snat_quarantine,
                DEFAULT_SNAT_QUARANTINE,
            ),
            snat_time_wait_reuse: args
                .snat_time_wait_reuse
                .or(file.snat_time_wait_reuse)
                .unwrap_or(true),
            log_level: args
                .log_level
                .or(file.log_level)
                .unwrap_or_else(|| "info".to_string()),
            upgrade: args.upgrade,
            state_dir: args
                .state_dir
                .or(file.state_dir)
                .unwrap_or_else(|| DEFAULT_STATE_DIR.into()),
            instance: args
                .instance
                .or(file.instance)
                .unwrap_or_else(|| format!("lb-{iface}")),
            iface,
            ops,
            vips,
            discovery: Discovery::default(),
            zones,
        }
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if self.iface.is_empty()
            || self.iface.len() > MAX_IFACE_NAME
            || self
                .iface
                .chars()
                .any(|c| c == '/' || c == ':' || c.is_whitespace() || c.is_control())
        {
            return Err(ConfigError::BadIface(self.iface.clone()));
        }
        if !valid_instance_name(&self.instance) {
            // Named after the interface (no --instance given): say so.
            if self.instance == format!("lb-{}", self.iface) {
                return Err(ConfigError::BadIfaceInstance(self.iface.clone()));
            }
            return Err(ConfigError::BadInstance(self.instance.clone()));
        }
        if !super::LOG_LEVELS.contains(&self.log_level.as_str()) {
            return Err(ConfigError::LogLevel(self.log_level.clone()));
        }
        if self.state_dir.as_os_str().is_empty() {
            return Err(ConfigError::EmptyStateDir);
        }
        for (name, d) in [
            ("ewma tau", self.ewma_tau),
            ("ewma peak tau", self.ewma_peak_tau),
            ("ewma cold start", self.ewma_cold_start),
            ("score interval", self.score_interval),
            ("udp idle timeout", self.udp_idle_timeout),
            ("tcp idle timeout", self.tcp_idle_timeout),
            ("syn timeout", self.syn_timeout),
            ("snat quarantine", self.snat_quarantine),
        ] {
            if d.is_zero() {
                return Err(ConfigError::ZeroDuration { name });
            }
        }
        if self.ewma_peak_tau > self.ewma_tau {
            return Err(ConfigError::PeakTauAboveTau {
                peak: format_duration(self.ewma_peak_tau),
                tau: format_duration(self.ewma_tau),
            });
        }
        if !(MIN_SCORE_INTERVAL..=MAX_SCORE_INTERVAL).contains(&self.score_interval) {
            return Err(ConfigError::ScoreInterval(format_duration(
                self.score_interval,
            )));
        }
        if self.snat_quarantine > MAX_SNAT_QUARANTINE {
            return Err(ConfigError::SnatQuarantine(format_duration(
                self.snat_quarantine,
            )));
        }
        let sizes = MIN_FLOW_TABLE_SIZE..=MAX_FLOW_TABLE_SIZE;
        if !sizes.contains(&self.flow_table_size) {
            return Err(ConfigError::FlowTableSize("", self.flow_table_size));
        }
        if !sizes.contains(&self.flow_table_size_ipv6) {
            return Err(ConfigError::FlowTableSize(
                "ipv6 ",
                self.flow_table_size_ipv6,
            ));
        }
        self.validate_snat()?;
        self.validate_zones()?;
        self.validate_vips()
    }

    /// The zone settings: the ranges, and a failover list of other zones,
    /// each once, that needs the balancer's own zone.
    fn validate_zones(&self) -> Result<(), ConfigError> {
        let z = &self.zones;
        if !(z.min_healthy > 0.0 && z.min_healthy <= 1.0) {
            return Err(ConfigError::ZoneMinHealthy(format!(
                "{}%",
                z.min_healthy * 100.0
            )));
        }
        if !(z.avoid_factor.is_finite() && z.avoid_factor >= 1.0) {
            return Err(ConfigError::ZoneAvoidFactor(z.avoid_factor.to_string()));
        }
        if z.failover.is_empty() {
            return Ok(());
        }
        let Some(local) = z.local else {
            return Err(ConfigError::ZoneFailoverWithoutZone);
        };
        let mut seen = HashSet::new();
        for zone in &z.failover {
            if *zone == local {
                return Err(ConfigError::ZoneFailoverLocal(zone.to_string()));
            }
            if !seen.insert(zone) {
                return Err(ConfigError::ZoneFailoverDuplicate(zone.to_string()));
            }
        }
        Ok(())
    }

    /// The latency estimators' settings.
    pub fn estimate_params(&self) -> EstimateParams {
        EstimateParams {
            cold_start: self.ewma_cold_start,
            tau: self.ewma_tau,
            peak_tau: self.ewma_peak_tau,
            refute_after: self.ewma_refute_after,
        }
    }

    /// Each SNAT pool: at most `MAX_SNAT_ADDRS` addresses, each usable
    /// ([`not_a_host`]), none twice. (What a VIP or a backend must not do
    /// with them: [`check_snat`], in [`Self::validate_vips`].)
    fn validate_snat(&self) -> Result<(), ConfigError> {
        check_count("IPv4 SNAT addresses", self.snat_ip.len(), MAX_SNAT_ADDRS)?;
        check_count("IPv6 SNAT addresses", self.snat_ip6.len(), MAX_SNAT_ADDRS)?;
        let mut seen = HashSet::new();
        for addr in self.snat_addrs() {
            if let Some(what) = not_a_host(addr) {
                return Err(ConfigError::NotAHost {
                    role: "SNAT address",
                    addr: addr.to_string(),
                    what,
                });
            }
            if !seen.insert(addr) {
                return Err(ConfigError::DuplicateSnatIp(addr.to_string()));
            }
        }
        Ok(())
    }

    /// Settings that are valid but cannot do what they say, one line each
    /// (logged at the start).
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        let life = &self.ops.lifecycle;
        if life.ejection_base > life.ejection_max {
            out.push(format!(
                "ejection_base {} is longer than ejection_max {}: every ejection lasts {}",
                format_duration(life.ejection_base),
                format_duration(life.ejection_max),
                format_duration(life.ejection_max)
            ));
        }
        for v in &self.vips {
            if v.maglev_source_affinity && v.algorithm != Algorithm::Maglev {
                out.push(format!(
                    "VIP {}: maglev_source_affinity does nothing with algorithm {}",
                    v.vip,
                    v.algorithm.name()
                ));
            }
            // Only for a slow start the operator tuned: with the default
            // every round-robin VIP would warn at every start.
            if v.algorithm == Algorithm::RoundRobin
                && !life.slow_start.is_zero()
                && life.slow_start != crate::settings::ops::DEFAULT_SLOW_START
            {
                out.push(format!(
                    "VIP {}: round-robin reads no weights, so slow start does nothing for it: a \
                     backend back in service takes its full share at once (weighted-round-robin \
                     ramps it)",
                    v.vip
                ));
            }
            if let Some(check) = &v.health
                && check.timeout > check.interval
            {
                out.push(format!(
                    "VIP {}: health timeout {} is longer than its interval {}: a check that \
                     times out delays the next",
                    v.vip,
                    format_duration(check.timeout),
                    format_duration(check.interval)
                ));
            }
        }
        out
    }

    pub fn validate_vips(&self) -> Result<(), ConfigError> {
        if self.vips.is_empty() {
            return Err(ConfigError::NoVip);
        }
        check_limits(self.vips.iter().map(VipConfig::footprint))?;
        let snat = self.snat_addrs();
        let mut seen_vips = HashSet::new();
        for v in &self.vips {
            let name = v.vip.to_string();
            if let Some(what) = not_a_host(v.vip.addr.ip()) {
                return Err(ConfigError::NotAHost {
                    role: "VIP",
                    addr: name,
                    what,
                });
            }
            if !seen_vips.insert(v.vip) {
                return Err(ConfigError::DuplicateVip(name));
            }
            if v.zone_aware && self.zones.local.is_none() {
                return Err(ConfigError::ZoneAwareWithoutZone(name));
            }
            if let Some(prefix) = &v.etcd_prefix {
                check_prefix(prefix)?;
                if self.discovery.etcd.is_none() {
                    return Err(ConfigError::Ops(format!(
                        "VIP {name} has an etcd prefix but no --etcd-endpoints are given"
                    )));
                }
                if !v.backends.is_empty() {
                    return Err(ConfigError::Ops(format!(
                        "VIP {name} takes its backends from etcd prefix {prefix}: static backends as well are not allowed"
                    )));
                }
            } else if v.backends.is_empty() {
                return Err(ConfigError::NoBackends(name));
            }
            if !(MIN_INFLIGHT_BIAS..=MAX_INFLIGHT_BIAS).contains(&v.inflight_bias) {
                return Err(ConfigError::InflightBias(v.inflight_bias));
            }
            check_backends(&v.vip, &v.backends)?;
            check_snat(v, &snat, self.snat_ports)?;
        }
        Ok(())
    }

    /// The configured SNAT pools' addresses, both families (none for a
    /// family that takes the interface's address: `daemon::startup::Snat`
    /// checks that one once it is known).
    pub fn snat_addrs(&self) -> Vec<IpAddr> {
        pool_addrs(&self.snat_ip, &self.snat_ip6)
    }
}

/// The addresses of a SNAT pool per family as one list, IPv4 first: the
/// configured pools ([`Config::snat_addrs`]) or those the kernel has
/// (`daemon::startup::Snat::addrs`).
pub fn pool_addrs(v4: &[Ipv4Addr], v6: &[Ipv6Addr]) -> Vec<IpAddr> {
    let v4 = v4.iter().map(|&a| IpAddr::V4(a));
    v4.chain(v6.iter().map(|&a| IpAddr::V6(a))).collect()
}

/// The rules VIP `v` and its backends must meet against the SNAT
/// addresses `snat` (both families) and port range `ports`, the
/// configured pools or the interface's address the balancer takes when
/// none is given: [`check_vip_snat`] and [`check_backend_snat`].
pub fn check_snat(v: &VipConfig, snat: &[IpAddr], ports: PortRange) -> Result<(), ConfigError> {
    check_vip_snat(&v.vip, snat, ports)?;
    v.backends
        .iter()
        .try_for_each(|b| check_backend_snat(&v.vip, b.addr, snat))
}

/// A VIP needs a SNAT address of its own family in `snat`, the pools the
/// kernel has: the data path drops every new connection to a VIP whose
/// family's pool is empty (`drop_bad_config`). Checked for what the running
/// balancer takes in (`startup::Snat::check`, the runtime state's VIPs), not
/// for the configuration as read, whose empty pool means the interface's
/// address (`startup::Snat::resolve`).
pub fn check_snat_family(vip: &VipAddr, snat: &[IpAddr]) -> Result<(), ConfigError> {
    let v6 = vip.addr.is_ipv6();
    if snat.iter().any(|a| a.is_ipv6() == v6) {
        return Ok(());
    }
    Err(ConfigError::NoSnatPool {
        vip: vip.to_string(),
        family: if v6 { "IPv6" } else { "IPv4" },
        flag: if v6 { "--snat-ip6" } else { "--snat-ip" },
    })
}

/// A VIP on a SNAT address must keep its port out of the SNAT port range
/// `ports`, whatever its protocol: the data path takes a packet of no flow
/// to a SNAT address and a port in that range for a late reply to one of
/// its SNAT connections and drops it (`drop_snat_no_flow`, lb-ebpf's
/// `is_snat_tuple`) before it looks for a VIP, so every new connection to
/// such a VIP would be dropped.
pub fn check_vip_snat(vip: &VipAddr, snat: &[IpAddr], ports: PortRange) -> Result<(), ConfigError> {
    let ip = vip.addr.ip();
    if snat.contains(&ip) && (ports.min..=ports.max).contains(&vip.addr.port()) {
        return Err(ConfigError::VipOnSnatPorts {
            vip: vip.to_string(),
            snat: ip.to_string(),
            ports: ports.to_string(),
            flag: snat_flag(ip),
        });
    }
    Ok(())
}

/// A backend must not be at a SNAT address (`snat`, both families): the
/// balancer would send it its connections from that address, its own,
/// which a host drops when it comes from the wire (and the balancer takes
/// what is sent to a SNAT address for itself).
pub fn check_backend_snat(
    vip: &VipAddr,
    backend: SocketAddr,
    snat: &[IpAddr],
) -> Result<(), ConfigError> {
    let ip = backend.ip();
    if snat.contains(&ip) {
        return Err(ConfigError::BackendOnSnatAddr {
            vip: vip.to_string(),
            backend: backend.to_string(),
            snat: ip.to_string(),
            flag: snat_flag(ip),
        });
    }
    Ok(())
}

/// The flag that sets the SNAT pool of `ip`'s family.
pub fn snat_flag(ip: IpAddr) -> &'static str {
    if ip.is_ipv6() {
        "--snat-ip6"
    } else {
        "--snat-ip"
    }
}

/// The rules the backends of VIP `vip` must meet, wherever the VIP comes
/// from (the configuration, or the runtime state file's VIPs added at
/// runtime): each meets [`check_backend`], and each is listed once.
pub fn check_backends(vip: &VipAddr, backends: &[BackendAddr]) -> Result<(), ConfigError> {
    let mut seen = HashSet::new();
    for b in backends {
        check_backend(vip, b.addr)?;
        if !seen.insert(b.addr) {
            let vip = vip.to_string();
            let backend = b.addr.to_string();
            return Err(ConfigError::DuplicateBackend { vip, backend });
        }
    }
    Ok(())
}

/// The rules one backend of VIP `vip` must meet, wherever it comes from
/// (the configuration, the state file, the control socket's `backend add`
/// or an etcd key): a usable host's address ([`not_a_host`]: not
/// loopback nor IPv4-mapped either), not the VIP itself, of the VIP's
/// family. Not on a SNAT address either, which depends on the pools the
/// balancer runs with: [`check_backend_snat`], where those are known.
pub fn check_backend(vip: &VipAddr, backend: SocketAddr) -> Result<(), ConfigError> {
    if let Some(what) = not_a_host(backend.ip()) {
        return Err(ConfigError::NotAHost {
            role: "backend",
            addr: backend.to_string(),
            what,
        });
    }
    if backend == vip.addr {
        return Err(ConfigError::BackendIsVip(vip.to_string()));
    }
    if backend.is_ipv6() != vip.addr.is_ipv6() {
        let vip = vip.to_string();
        let backend = backend.to_string();
        return Err(ConfigError::MixedFamily { vip, backend });
    }
    Ok(())
}

/// Whether `name` can name an instance: its pins' folder, its control
/// socket and its state file are named after it. Not starting with `.`:
/// the files in the run directory whose names do are no instance's (the
/// shared SNAT ports' lock, `.reserved-ports.lock`, is one; see
/// `kernel::instance::run_file_instance`), and neither are `.` and `..`.
pub fn valid_instance_name(name: &str) -> bool {
    (1..=MAX_INSTANCE_NAME).contains(&name.len())
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
}

/// The count limits a configuration's VIPs are held to (VIPs, backends in
/// total, Maglev VIPs, backends in one VIP), checked in that order over
/// each VIP's [`VipConfig::footprint`]: the file's own
/// ([`Config::validate_vips`]) and what the runtime state lays over a file
/// that passed them on its own (`RuntimeState::overlay`).
pub fn check_limits(vips: impl IntoIterator<Item = (usize, bool)>) -> Result<(), ConfigError> {
    let (mut count, mut total, mut maglev, mut largest) = (0, 0, 0, 0);
    for (backends, is_maglev) in vips {
        count += 1;
        total += backends;
        maglev += usize::from(is_maglev);
        largest = largest.max(backends);
    }
    check_count("VIPs", count, MAX_VIPS)?;
    check_count("backends in total", total, MAX_BACKENDS)?;
    check_count("VIPs using maglev", maglev, MAX_MAGLEV_TABLES)?;
    check_count("backends in one VIP", largest, MAX_BACKENDS_PER_VIP)
}

fn check_count(what: &'static str, count: usize, max: u32) -> Result<(), ConfigError> {
    if count > max as usize {
        return Err(ConfigError::TooMany { what, count, max });
    }
    Ok(())
}

/// serde adapters that reuse the flag parsers, so file and flags accept the
/// same text and report the same errors.
mod de {
    use std::{fmt::Display, str::FromStr};

    use lb_common::Algorithm;
    use serde::{Deserialize, Deserializer, de::Error};

    use super::parse_algorithm;
    use crate::settings::{
        addr::{AddrError, BackendAddr, Weight, parse_backend_zone, parse_socket_addr},
        zone::parse_min_healthy,
    };

    pub fn from_str_opt<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
    where
        D: Deserializer<'de>,
        T: FromStr,
        T::Err: Display,
    {
        String::deserialize(d)?
            .parse()
            .map(Some)
            .map_err(D::Error::custom)
    }

    /// One address, or a list of them (`snat_ip = "a"` or `["a", "b"]`).
    pub fn one_or_many<'de, D, T>(d: D) -> Result<Vec<T>, D::Error>
    where
        D: Deserializer<'de>,
        T: FromStr,
        T::Err: Display,
    {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum OneOrMany {
            One(String),
            Many(Vec<String>),
        }
        let texts = match OneOrMany::deserialize(d)? {
            OneOrMany::One(one) => vec![one],
            OneOrMany::Many(many) => many,
        };
        texts
            .iter()
            .map(|s| s.parse().map_err(D::Error::custom))
            .collect()
    }

    /// `zone_min_healthy`: a number (`70`, `62.5`) or text (`"70%"`), as
    /// the flag takes it.
    pub fn min_healthy_opt<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Percent {
            Int(i64),
            Float(f64),
            Text(String),
        }
        let text = match Percent::deserialize(d)? {
            Percent::Int(n) => n.to_string(),
            Percent::Float(f) => f.to_string(),
            Percent::Text(t) => t,
        };
        parse_min_healthy(&text).map(Some).map_err(D::Error::custom)
    }

    /// A backend as a table: `{ addr = "IP:PORT", weight = N, zone = "NAME" }`.
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct BackendTable {
        addr: String,
        weight: Option<i64>,
        zone: Option<String>,
    }

    impl BackendTable {
        fn resolve(self) -> Result<BackendAddr, AddrError> {
            let weight = match self.weight {
                None => Weight::DEFAULT,
                Some(w) => u64::try_from(w)
                    .map_err(|_| AddrError::Weight(w.to_string()))
                    .and_then(Weight::new)?,
            };
            let zone = match &self.zone {
                None => None,
                Some(z) => Some(parse_backend_zone(&self.addr, z)?),
            };
            Ok(BackendAddr {
                addr: parse_socket_addr(&self.addr)?,
                weight,
                zone,
            })
        }
    }

    /// One `backends` element: the `--backend` text, or a table.
    struct BackendItem(BackendAddr);

    impl<'de> Deserialize<'de> for BackendItem {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct Visitor;
            impl<'de> serde::de::Visitor<'de> for Visitor {
                type Value = BackendItem;
                fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                    f.write_str("\"IP:PORT[@WEIGHT][,zone=NAME]\" or { addr, weight, zone }")
                }
                fn visit_str<E: Error>(self, text: &str) -> Result<BackendItem, E> {
                    text.parse().map(BackendItem).map_err(E::custom)
                }
                fn visit_map<A: serde::de::MapAccess<'de>>(
                    self,
                    map: A,
                ) -> Result<BackendItem, A::Error> {
                    BackendTable::deserialize(serde::de::value::MapAccessDeserializer::new(map))?
                        .resolve()
                        .map(BackendItem)
                        .map_err(A::Error::custom)
                }
            }
            d.deserialize_any(Visitor)
        }
    }

    /// `backends`: a list of `--backend` texts and tables, mixed.
    pub fn backends<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<BackendAddr>, D::Error> {
        Ok(Vec::<BackendItem>::deserialize(d)?
            .into_iter()
            .map(|b| b.0)
            .collect())
    }

    pub fn algorithm_opt<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Algorithm>, D::Error> {
        parse_algorithm(&String::deserialize(d)?)
            .map(Some)
            .map_err(D::Error::custom)
    }
}

#[cfg(test)]
mod tests;

/// What a reload (SIGHUP) cannot apply to a running instance: every global
/// setting that differs between `running` and `reloaded`, and every VIP
/// present in both whose algorithm, bias, affinity or health check differs.
/// (Backends, and VIPs added or removed, are the reload's to apply.)
pub fn needs_restart(running: &Config, reloaded: &Config) -> Vec<String> {
    restart_settings(running, &mut reloaded.clone(), false)
}

/// [`needs_restart`], and `reloaded` given `running`'s value of each of
/// them: what the reload applies, and what the instance runs with after it.
/// Kept as the running configuration, the file's values of these would
/// reach what the reload does apply later (a VIP added by this reload or by
/// `vip add` took the new slow start the log said was not applied), and a
/// second SIGHUP of the same file would no longer warn of them.
pub fn hold_restart_settings(running: &Config, reloaded: &mut Config) -> Vec<String> {
    restart_settings(running, reloaded, true)
}

fn restart_settings(running: &Config, reloaded: &mut Config, hold: bool) -> Vec<String> {
    let mut out = Vec::new();
    // Each reported as `<field> (old → new)`, the values as the flags
    // and the file write them (`written::Written`); one made of several
    // keys (given a prefix) as one such line per key that changed, named
    // `<prefix><key>` (`written::WrittenKeys`). Held whole either way.
    macro_rules! global {
        ($($field:ident).+) => {
            global!(@ $($field).+, [change(
                stringify!($($field).+),
                &running.$($field).+,
                &reloaded.$($field).+
            )])
        };
        ($($field:ident).+, $prefix:literal) => {
            global!(@ $($field).+, key_changes(
                stringify!($($field).+).rsplit('.').next().unwrap_or_default(),
                $prefix,
                &running.$($field).+,
                &reloaded.$($field).+
            ))
        };
        (@ $($field:ident).+, $report:expr) => {
            if running.$($field).+ != reloaded.$($field).+ {
                out.extend($report);
                if hold {
                    reloaded.$($field).+ = running.$($field).+.clone();
                }
            }
        };
    }
    global!(iface);
    global!(xdp_mode);
    global!(snat_ip);
    global!(snat_ip6);
    global!(snat_ports);
    global!(flow_table_size);
    global!(flow_table_size_ipv6);
    global!(ewma_tau);
    global!(ewma_peak_tau);
    global!(ewma_refute_after);
    global!(ewma_cold_start);
    global!(score_interval);
    global!(udp_idle_timeout);
    global!(tcp_idle_timeout);
    global!(syn_timeout);
    global!(snat_quarantine);
    global!(snat_time_wait_reuse);
    global!(instance);
    global!(log_level);
    global!(state_dir);
    global!(ops.lifecycle, "ops.");
    global!(ops.outlier, "ops.");
    global!(ops.max_ejection_percent);
    global!(ops.max_new_flows);
    global!(ops.metrics_addr);
    global!(ops.control_group);
    global!(discovery.max_removal_percent);
    if running.discovery.etcd != reloaded.discovery.etcd {
        // Not the values: they may hold a password.
        out.push("etcd settings (endpoints, TLS files or user)".into());
        if hold {
            reloaded.discovery.etcd = running.discovery.etcd.clone();
        }
    }
    for new in &mut reloaded.vips {
        let Some(old) = running.vips.iter().find(|v| v.vip == new.vip) else {
            if let Some(prefix) = &new.etcd_prefix {
                out.push(format!("VIP {} with etcd prefix {prefix} (new)", new.vip));
            }
            continue;
        };
        if old.etcd_prefix != new.etcd_prefix {
            let prefix = |p: &Option<String>| p.clone().unwrap_or_else(|| "none".into());
            out.push(format!(
                "VIP {} etcd_prefix ({} → {})",
                new.vip,
                prefix(&old.etcd_prefix),
                prefix(&new.etcd_prefix)
            ));
        }
        // Each reported as `VIP <vip> <name>` (with the two values shown by
        // `$show`, if given), and held like the globals. The etcd prefix
        // above is `keep_discovery`'s to hold.
        macro_rules! per_vip {
            ($field:ident, $name:literal) => {
                per_vip!(@ $field, format!("VIP {} {}", new.vip, $name))
            };
            ($field:ident, $name:literal, $show:expr) => {
                per_vip!(@ $field, format!(
                    "VIP {} {} ({} → {})",
                    new.vip,
                    $name,
                    $show(old.$field),
                    $show(new.$field)
                ))
            };
            (@ $field:ident, $report:expr) => {
                if old.$field != new.$field {
                    out.push($report);
                    if hold {
                        new.$field = old.$field.clone();
                    }
                }
            };
        }
        per_vip!(algorithm, "algorithm", Algorithm::name);
        per_vip!(inflight_bias, "inflight_bias");
        per_vip!(p2c_full_scan, "p2c_full_scan");
        per_vip!(p2c_saturation, "p2c_saturation");
        per_vip!(maglev_source_affinity, "maglev_source_affinity");
        per_vip!(health, "health check");
    }
    out
}

/// What a reload (SIGHUP) of `file`, already validated, applies to an
/// instance running `running`: `file` with the settings a reload cannot
/// change kept at their running values ([`hold_restart_settings`]) and
/// discovery kept as it runs ([`keep_discovery`]), and the report of the
/// settings held. What is held was not in the file, so the result is
/// checked again by the rules the file passed: a VIP that keeps Maglev
/// until a restart counts against the Maglev table limit the file's own
/// Maglev VIPs were measured against. A result that fails them is an
/// error that names the held settings, and the reload is refused whole,
/// like a file that fails them.
pub fn held_reload(running: &Config, file: &Config) -> Result<(Config, Vec<String>), ConfigError> {
    let mut held = file.clone();
    let restart = hold_restart_settings(running, &mut held);
    keep_discovery(running, &mut held);
    // A VIP that keeps following etcd (`keep_discovery`) gets its backends
    // from there: the file's list for it, if any, is unused.
    let mut check = held.clone();
    for v in check.vips.iter_mut().filter(|v| v.etcd_prefix.is_some()) {
        v.backends.clear();
    }
    check
        .validate()
        .map_err(|error| ConfigError::HeldUntilRestart {
            held: restart.join(", "),
            error: Box::new(error),
        })?;
    Ok((held, restart))
}

/// What a reload leaves of discovery, which is set up at the start only
/// (one watch per VIP with a prefix): each running VIP keeps its etcd
/// prefix (a VIP that gains one keeps its backends, one that loses it
/// keeps following etcd), and a new VIP with a prefix is not added.
/// [`needs_restart`] reports each of these.
pub fn keep_discovery(running: &Config, reloaded: &mut Config) {
    reloaded
        .vips
        .retain(|v| v.etcd_prefix.is_none() || running.vips.iter().any(|r| r.vip == v.vip));
    for v in &mut reloaded.vips {
        let Some(r) = running.vips.iter().find(|r| r.vip == v.vip) else {
            continue;
        };
        if r.etcd_prefix.is_none() && v.etcd_prefix.is_some() {
            v.backends = r.backends.clone();
        }
        v.etcd_prefix = r.etcd_prefix.clone();
    }
}

/// The backend changes a reload applies, one line per VIP that has any:
/// backends added, removed and re-weighted, and (when any) moved to
/// another zone. A backend is known by its address.
pub fn backend_changes(running: &Config, reloaded: &Config) -> Vec<String> {
    let mut out = Vec::new();
    for new in &reloaded.vips {
        let Some(old) = running.vips.iter().find(|v| v.vip == new.vip) else {
            continue;
        };
        let find = |list: &[crate::settings::addr::BackendAddr], addr| {
            list.iter().find(|b| b.addr == addr).map(|b| b.weight)
        };
        let zone_of = |list: &[crate::settings::addr::BackendAddr], addr| {
            list.iter().find(|b| b.addr == addr).map(|b| b.zone)
        };
        let added: Vec<String> = new
            .backends
            .iter()
            .filter(|b| find(&old.backends, b.addr).is_none())
            .map(|b| b.to_string())
            .collect();
        let removed: Vec<String> = old
            .backends
            .iter()
            .filter(|b| find(&new.backends, b.addr).is_none())
            .map(|b| b.addr.to_string())
            .collect();
        let reweighted: Vec<String> = new
            .backends
            .iter()
            .filter(|b| find(&old.backends, b.addr).is_some_and(|w| w != b.weight))
            .map(|b| b.to_string())
            .collect();
        let rezoned: Vec<String> = new
            .backends
            .iter()
            .filter(|b| zone_of(&old.backends, b.addr).is_some_and(|z| z != b.zone))
            .map(|b| b.to_string())
            .collect();
        if !(added.is_empty() && removed.is_empty() && reweighted.is_empty() && rezoned.is_empty())
        {
            let mut line = format!(
                "VIP {}: added [{}], removed [{}], re-weighted [{}]",
                new.vip,
                added.join(", "),
                removed.join(", "),
                reweighted.join(", ")
            );
            if !rezoned.is_empty() {
                line.push_str(&format!(", re-zoned [{}]", rezoned.join(", ")));
            }
            out.push(line);
        }
    }
    out
}
