//! Command-line interface (clap). Every run flag is optional here so that
//! [`crate::settings::config`] can tell "not given" from "given", which is what lets flags
//! override a config file's globals; defaults live in `config`, once.

use std::{
    net::{Ipv4Addr, Ipv6Addr},
    path::PathBuf,
    time::Duration,
};

use clap::{Args, Parser, Subcommand, ValueEnum};
use lb_common::{Algorithm, MAX_INFLIGHT_BIAS, MIN_INFLIGHT_BIAS};
use serde::{Deserialize, Serialize};

use crate::{
    settings::addr::{BackendAddr, VipAddr},
    settings::algorithm::parse_algorithm,
    settings::discovery::{DiscoveryArgs, RegisterArgs},
    settings::duration::parse_duration,
    settings::ops::OpsSettings,
    settings::ports::PortRange,
    settings::zone::{ZoneName, parse_min_healthy, parse_on_off},
};

/// An XDP load balancer: P2C over Peak-EWMA latency with full NAT.
#[derive(Debug, Parser)]
#[command(name = "lb-user", version, args_conflicts_with_subcommands = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub run: RunArgs,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Show the VIPs, backends and counters of a running instance.
    Status(StatusArgs),
    /// Change a running instance's backends: add, remove, weight, drain, undrain.
    Backend(BackendArgs),
    /// Register a backend in etcd under a lease until SIGTERM (the sidecar).
    Register(RegisterArgs),
    /// Add or remove a whole VIP of a running instance (kept across
    /// restarts in the state file).
    Vip(VipArgs),
}

#[derive(Debug, Args)]
pub struct VipArgs {
    #[arg(value_enum)]
    pub action: VipCommand,
    /// The instance to talk to (default: the only one running).
    #[arg(long)]
    pub instance: Option<String>,
    #[arg(long, value_name = "IP:PORT[/PROTO]")]
    pub vip: VipAddr,
    /// A backend of the new VIP (add: at least one; repeat it).
    #[arg(long = "backend", value_name = "IP:PORT[@WEIGHT][,zone=NAME]")]
    pub backends: Vec<BackendAddr>,
    /// Algorithm of the new VIP (default p2c-ewma).
    #[arg(long, value_name = "NAME", value_parser = parse_algorithm)]
    pub algorithm: Option<Algorithm>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum VipCommand {
    Add,
    Remove,
}

/// A control-socket command, as sent on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ControlCommand {
    Add,
    Remove,
    Weight,
    Drain,
    Undrain,
    VipAdd,
    VipRemove,
}

impl ControlCommand {
    /// The backend command this is, if it is one.
    pub fn backend(self) -> Option<BackendCommand> {
        Some(match self {
            Self::Add => BackendCommand::Add,
            Self::Remove => BackendCommand::Remove,
            Self::Weight => BackendCommand::Weight,
            Self::Drain => BackendCommand::Drain,
            Self::Undrain => BackendCommand::Undrain,
            Self::VipAdd | Self::VipRemove => return None,
        })
    }
}

impl From<BackendCommand> for ControlCommand {
    fn from(c: BackendCommand) -> Self {
        match c {
            BackendCommand::Add => Self::Add,
            BackendCommand::Remove => Self::Remove,
            BackendCommand::Weight => Self::Weight,
            BackendCommand::Drain => Self::Drain,
            BackendCommand::Undrain => Self::Undrain,
        }
    }
}

#[derive(Debug, Args)]
pub struct BackendArgs {
    /// What to do with the backend.
    #[arg(value_enum)]
    pub action: BackendCommand,
    /// Instance to change; may be omitted when exactly one is running.
    #[arg(long)]
    pub instance: Option<String>,
    /// The VIP, IP:PORT[/tcp|/udp].
    #[arg(long, value_name = "IP:PORT[/PROTO]")]
    pub vip: VipAddr,
    /// The backend, IP:PORT (add also takes IP:PORT@WEIGHT and ,zone=NAME).
    #[arg(long, value_name = "IP:PORT[@WEIGHT][,zone=NAME]")]
    pub backend: BackendAddr,
    /// New weight (weight only), 1..=65535.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=65535), allow_negative_numbers = true)]
    pub weight: Option<u32>,
}

/// What `lb-user backend` asks of a running instance; also the `command`
/// of the control socket's protocol (see `surface::control`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum BackendCommand {
    Add,
    Remove,
    Weight,
    Drain,
    Undrain,
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Instance to inspect; may be omitted when exactly one is running.
    #[arg(long)]
    pub instance: Option<String>,
    /// Print JSON (schema documented in `status.rs`) instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// XDP attach mode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum XdpMode {
    /// In the driver (XDP_FLAGS_DRV_MODE); fails if the driver lacks XDP.
    #[default]
    Native,
    /// Generic XDP in the kernel stack (XDP_FLAGS_SKB_MODE); works everywhere, slower.
    Skb,
}

impl XdpMode {
    pub const fn name(self) -> &'static str {
        match self {
            Self::Native => "native",
            Self::Skb => "skb",
        }
    }
}

/// Flags of the balancer itself. See `config.rs` for defaults and the TOML
/// file that can say the same things.
#[derive(Clone, Debug, Default, Args)]
pub struct RunArgs {
    /// TOML file with global settings and any number of [[vip]] sections.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Interface to attach to.
    #[arg(long, value_name = "IFACE")]
    pub iface: Option<String>,
    /// Virtual service, IP:PORT[/tcp|/udp] (tcp by default).
    #[arg(long, value_name = "IP:PORT[/PROTO]")]
    pub vip: Option<VipAddr>,
    /// Backend of --vip, IP:PORT[@WEIGHT][,zone=NAME] (weight 1..=65535,
    /// default 1; zone: none); repeat for each.
    #[arg(long = "backend", value_name = "IP:PORT[@WEIGHT][,zone=NAME]")]
    pub backends: Vec<BackendAddr>,
    /// p2c-ewma (default), round-robin, weighted-round-robin, random, least-conn or maglev.
    #[arg(long, value_name = "NAME", value_parser = parse_algorithm)]
    pub algorithm: Option<Algorithm>,
    /// Exponent b of the in-flight term (inflight+1)^b in P2C's cost, 1..=3 (default 2).
    #[arg(long, value_name = "B", value_parser = clap::value_parser!(u8).range(MIN_INFLIGHT_BIAS as i64..=MAX_INFLIGHT_BIAS as i64), allow_negative_numbers = true)]
    pub inflight_bias: Option<u8>,
    /// While a VIP (or its zone) has at most N backends, P2C compares every
    /// one when a random pair's winner is busy or far above the pool;
    /// 0 = pairs only (default 16).
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub p2c_full_scan: Option<u16>,
    /// P2C counts a backend with N or more flows in flight as saturated:
    /// it loses its precedence over backends far above the pool, and the
    /// two meet on score. Set it to about twice the backends' worker count
    /// (requests a backend serves at once); 0 = off (default 4).
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub p2c_saturation: Option<u16>,
    /// With maglev: hash only the client address, so a client keeps its backend.
    #[arg(long)]
    pub maglev_source_affinity: bool,
    /// Zone-aware routing for VIPs that do not say (default: on exactly
    /// when --zone is given; on without a zone is an error).
    #[arg(long, value_name = "on|off", value_parser = parse_on_off)]
    pub zone_aware: Option<bool>,
    /// The balancer's own zone (A-Z a-z 0-9 . _ -, at most 63 characters).
    #[arg(long, value_name = "NAME")]
    pub zone: Option<ZoneName>,
    /// Zone-aware VIPs keep traffic in the local zone while at least this
    /// share of its backends' weight is healthy, 1..=100 (default 70).
    #[arg(long, value_name = "PERCENT", value_parser = parse_min_healthy, allow_hyphen_values = true)]
    pub zone_min_healthy: Option<f64>,
    /// Avoid the local zone once its backends cost this many times the
    /// best other zone's, at least 1 (default 3).
    #[arg(long, value_name = "F", allow_hyphen_values = true)]
    pub zone_avoid_factor: Option<f64>,
    /// The other zones in the order traffic spills to them (default: by
    /// cost); comma-separated or repeated; needs --zone.
    #[arg(long, value_name = "ZONE,...", value_delimiter = ',')]
    pub zone_failover: Vec<ZoneName>,
    /// XDP attach mode.
    #[arg(long, value_enum, value_name = "MODE")]
    pub xdp_mode: Option<XdpMode>,
    /// Source address of balanced flows; repeat for a pool (default: the
    /// interface's primary IPv4 address).
    #[arg(long, value_name = "IPV4")]
    pub snat_ip: Vec<Ipv4Addr>,
    /// Source address of balanced IPv6 flows; repeat for a pool (default:
    /// the interface's first global IPv6 address).
    #[arg(long, value_name = "IPV6")]
    pub snat_ip6: Vec<Ipv6Addr>,
    /// SNAT source-port range, MIN-MAX inclusive.
    #[arg(long, value_name = "MIN-MAX")]
    pub snat_ports: Option<PortRange>,
    /// Entries of each family's flow table (both directions of a flow use
    /// one each); IPv6's can be sized apart with --flow-table-size-ipv6.
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub flow_table_size: Option<u32>,
    /// Entries of IPv6's flow table (default: --flow-table-size's value).
    /// Both tables are preallocated, so a balancer with no IPv6 VIP can
    /// keep IPv6's small.
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub flow_table_size_ipv6: Option<u32>,
    /// Time constant τ of the latency estimate's long memory (the mean
    /// latency that marks a persistently slow backend; e.g. 10s).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub ewma_tau: Option<Duration>,
    /// Time constant of the estimate's short memory: how long a peak
    /// (one slow response, a pause) counts (default: --ewma-tau's value;
    /// e.g. 1s; at most --ewma-tau).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub ewma_peak_tau: Option<Duration>,
    /// Fast responses in a row (each at most half the estimate) that
    /// refute a backend's latency memory, so a backend that was slow and
    /// is fast again comes back at once (default 16; 0: only time wears
    /// the memory down, as in plain Peak-EWMA).
    #[arg(long, value_name = "N")]
    pub ewma_refute_after: Option<u64>,
    /// Latency assumed for a backend with no samples, and the value an idle backend decays to.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub ewma_cold_start: Option<Duration>,
    /// How often scores are rewritten (1ms..=100ms).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub score_interval: Option<Duration>,
    /// UDP flows idle this long are removed.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub udp_idle_timeout: Option<Duration>,
    /// TCP flows idle this long are removed.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub tcp_idle_timeout: Option<Duration>,
    /// A SYN without SYN-ACK for this long counts as refused and is removed.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub syn_timeout: Option<Duration>,
    /// How long a closed connection's SNAT tuple stays reserved, counted
    /// from the close (the backend's TIME_WAIT plus slack).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub snat_quarantine: Option<Duration>,
    /// Whether a new TCP connection may take a SNAT tuple still in
    /// quarantine when the backend's TIME_WAIT would accept its SYN as
    /// sent (RFC 6191; default on).
    #[arg(long, value_name = "on|off", value_parser = crate::settings::zone::parse_on_off)]
    pub snat_time_wait_reuse: Option<bool>,
    /// Instance name (default lb-<iface>); pins live in /sys/fs/bpf/lb-user/<NAME>/.
    #[arg(long, value_name = "NAME")]
    pub instance: Option<String>,
    /// Log level when RUST_LOG is unset: error, warn, info, debug or trace.
    #[arg(long, value_name = "LEVEL")]
    pub log_level: Option<String>,
    /// Where runtime changes (drains, weights, added and removed backends)
    /// are kept across restarts, as <DIR>/<instance>.state.json
    /// (default /var/lib/lb-user).
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<std::path::PathBuf>,
    /// When re-adopting a running instance, replace its XDP program with
    /// this binary's even if they look the same (it is replaced anyway when
    /// they differ).
    #[arg(long)]
    pub upgrade: bool,
    /// Health checks, ejection, slow start, metrics.
    #[command(flatten)]
    pub ops: OpsSettings,
    /// etcd discovery (endpoints, TLS, user, --etcd-prefix of --vip, state dir).
    #[command(flatten)]
    pub discovery: DiscoveryArgs,
}
