//! The one error type of bad input, and the one-line form every reported
//! error takes.

use lb_common::{MAX_INFLIGHT_BIAS, MIN_INFLIGHT_BIAS};
use thiserror::Error;

use crate::settings::addr::AddrError;

/// Bad input, reported as one line before the kernel is touched.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {reason}")]
    Unreadable { path: String, reason: String },
    #[error("invalid config file {path}: {reason}")]
    Invalid { path: String, reason: String },
    #[error("--state-dir must not be empty")]
    EmptyStateDir,
    #[error("no interface given (use --iface or iface in the config file)")]
    NoIface,
    #[error("invalid interface name '{0}'")]
    BadIface(String),
    #[error("no VIP configured (use --vip with --backend, or [[vip]] in the config file)")]
    NoVip,
    #[error("--backend given without --vip")]
    BackendWithoutVip,
    #[error("VIP {0} has no backends")]
    NoBackends(String),
    #[error("SNAT address {0} given twice")]
    DuplicateSnatIp(String),
    #[error("duplicate VIP {0}")]
    DuplicateVip(String),
    #[error("duplicate backend {backend} in VIP {vip}")]
    DuplicateBackend { vip: String, backend: String },
    #[error("in config file: {0}")]
    FileAddress(AddrError),
    #[error("VIP {vip} says protocol {protocol} but its address says otherwise")]
    ProtocolConflict { vip: String, protocol: String },
    #[error("backend {backend} of VIP {vip}: a VIP and its backends must be of one address family")]
    MixedFamily { vip: String, backend: String },
    #[error("inflight bias {0} out of range (expected {MIN_INFLIGHT_BIAS}..={MAX_INFLIGHT_BIAS})")]
    InflightBias(u8),
    #[error("{name} must be greater than zero")]
    ZeroDuration { name: &'static str },
    #[error("score interval {0} is out of range (1ms..=100ms)")]
    ScoreInterval(String),
    #[error(
        "snat quarantine {0} is too long (at most 1h: TIME_WAIT is 60s on Linux, at most 4m elsewhere)"
    )]
    SnatQuarantine(String),
    #[error(
        "ewma peak tau {peak} is longer than ewma tau {tau} (the peaks' memory is the short one)"
    )]
    PeakTauAboveTau { peak: String, tau: String },
    /// The table (`""` for the size of each, `"ipv6 "`) and its size.
    #[error("{0}flow table size {1} is out of range (2..=268435456)")]
    FlowTableSize(&'static str, u32),
    #[error("too many {what}: {count} (at most {max})")]
    TooMany {
        what: &'static str,
        count: usize,
        max: u32,
    },
    /// A reloaded configuration that passes on its own but not once the
    /// settings a reload cannot change are kept at their running values
    /// (`config::held_reload`): `held`, those settings as reported.
    #[error(
        "{error} once what needs a restart is kept as it runs ({held}); a restart applies the file"
    )]
    HeldUntilRestart {
        held: String,
        error: Box<ConfigError>,
    },
    #[error(
        "invalid instance name '{0}' (use 1-64 letters, digits, '-', '_' or '.', not starting with '.')"
    )]
    BadInstance(String),
    #[error(
        "the interface name '{0}' cannot name the instance (lb-{0}): give --instance NAME (1-64 letters, digits, '-', '_' or '.')"
    )]
    BadIfaceInstance(String),
    /// `what`: [`crate::settings::config::not_a_host`]'s reason.
    #[error("{role} {addr} is {what}")]
    NotAHost {
        role: &'static str,
        addr: String,
        what: &'static str,
    },
    #[error("VIP {0} lists itself as a backend")]
    BackendIsVip(String),
    /// `flag`: the SNAT flag of the VIP's family (`--snat-ip`, `--snat-ip6`).
    #[error(
        "VIP {vip} is on SNAT address {snat} with its port in the SNAT port range {ports}: the \
         balancer would drop every new connection to it as a reply to a SNAT connection that \
         has ended (move the VIP's port out of --snat-ports, or use another {flag})"
    )]
    VipOnSnatPorts {
        vip: String,
        snat: String,
        ports: String,
        flag: &'static str,
    },
    /// A VIP taken in at runtime (`vip add`, a SIGHUP's file, the runtime
    /// state file) of a family the balancer took no SNAT address for at its
    /// start: the kernel's pools change only with a restart.
    #[error(
        "VIP {vip} is {family}, and this balancer has no {family} SNAT address: it took none \
         at its start (no {flag}, and no {family} VIP in the configuration to take the \
         interface's address for), so every new connection to the VIP would be dropped \
         (restart with {flag}, or with an {family} VIP in the configuration)"
    )]
    NoSnatPool {
        vip: String,
        family: &'static str,
        flag: &'static str,
    },
    /// `flag`: as [`Self::VipOnSnatPorts`]'s.
    #[error(
        "backend {backend} of VIP {vip} is at SNAT address {snat}: the balancer would send it \
         its connections from its own address (use another {flag}, or another backend)"
    )]
    BackendOnSnatAddr {
        vip: String,
        backend: String,
        snat: String,
        flag: &'static str,
    },
    #[error("invalid log level '{0}' (expected error, warn, info, debug or trace)")]
    LogLevel(String),
    #[error("{0}")]
    Ops(String),
    #[error("zone avoid factor {0} is invalid (expected a finite number of at least 1)")]
    ZoneAvoidFactor(String),
    #[error("invalid zone min healthy {0} (expected a percentage in 1..=100)")]
    ZoneMinHealthy(String),
    #[error("zone failover lists zone {0} twice")]
    ZoneFailoverDuplicate(String),
    #[error("zone failover lists the balancer's own zone {0}")]
    ZoneFailoverLocal(String),
    #[error("zone failover needs the balancer's own zone (use --zone or zone in the config file)")]
    ZoneFailoverWithoutZone,
    #[error(
        "VIP {0} is zone-aware but the balancer has no zone (use --zone or zone in the config file)"
    )]
    ZoneAwareWithoutZone(String),
    #[error(
        "cannot use the state file {path}: {reason} (move it away to start from the configuration alone)"
    )]
    State { path: String, reason: String },
}

/// Multi-line messages (verifier logs, clap usage, toml excerpts) folded
/// into one line.
pub fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}
