//! Prometheus metrics on `--metrics-addr` (default 127.0.0.1:9470), in the
//! OpenMetrics text format (the `prometheus-client` crate's encoder), at
//! `GET /metrics`.
//!
//! The values are snapshots: kernel counters read from the maps and the
//! control plane's own state, taken by the event loop when a scrape
//! arrives, and encoded by a `prometheus-client` collector; durations
//! (map updates, score ticks) are the crate's histograms, observed as they
//! happen. Names follow Prometheus conventions: `lb_` prefix, `_total` counters,
//! base units (`_seconds`, `_bytes`). The reference is in the README.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use anyhow::Context as _;
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric as _, MetricEncoder},
    metrics::{MetricType, counter::ConstCounter, gauge::ConstGauge, histogram::Histogram},
    registry::Registry,
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpListener,
    sync::{Semaphore, mpsc, oneshot},
    task::JoinHandle,
    time::{sleep, timeout},
};
use tracing::{debug, info, warn};

use crate::{pool::lifecycle::State, publish::writers::UpdateTimes};

/// Largest request head read.
const MAX_REQUEST: usize = 8 * 1024;
/// A client that has not sent its whole request head in this time (all of
/// it, not each read: a slow trickle is dropped too) is dropped.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// A client that has not taken the whole answer in this time is dropped:
/// one that sends its request and never reads would otherwise hold its
/// slot for good once the answer outgrows the socket buffers (thousands of
/// backends), and sixteen such clients would lock every scrape out.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// Most scrapes served at once; more connections are closed unanswered.
const MAX_CONNECTIONS: usize = 16;
/// Pause after a failed accept (e.g. out of file descriptors).
const ACCEPT_RETRY: Duration = Duration::from_millis(100);
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// One backend's values.
#[derive(Clone, Debug, Default)]
pub struct BackendMetrics {
    pub vip: String,
    pub backend: String,
    pub opened: u64,
    pub closed: u64,
    pub active: u64,
    pub refused: u64,
    pub bytes_to_backend: u64,
    pub bytes_from_backend: u64,
    pub ewma_seconds: f64,
    pub score: u64,
    pub effective_weight: f64,
    pub state: Option<State>,
    pub ejections: u64,
    pub outlier_failures: u64,
    pub health_passed: u64,
    pub health_failed: u64,
    /// Checks that timed out while the backend answered users (see
    /// `pool::health::Counted::Busy`).
    pub health_busy: u64,
    /// SNAT tuples this backend id holds (open, lingering or in quarantine).
    pub snat_tuples_held: u64,
    /// SNAT tuples free towards the backend's address (see
    /// `surface::status::snat_held_by_address`).
    pub snat_tuples_free: u64,
}

/// Everything one scrape shows.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub backends: Vec<BackendMetrics>,
    /// Packets per pass/drop reason.
    pub reasons: Vec<(&'static str, u64)>,
    pub events_lost: u64,
    /// Records taken off the ring buffer.
    pub events_received: u64,
    /// Per-backend latency aggregates read from the kernel at score ticks.
    pub latency_reads: u64,
    /// Of those, aggregates not taken as latency: their answers waited on
    /// a health outage.
    pub latency_outage_skips: u64,
    /// Latency probes by outcome (`applied`, `busy`, `unchanged`, `barred`).
    pub latency_probes: Vec<(&'static str, u64)>,
    pub publish_times: UpdateTimes,
    pub score_times: UpdateTimes,
    /// Whole score ticks (scores and selections).
    pub tick_times: UpdateTimes,
    /// Reconciliation passes (kernel sweep and counter reads).
    pub reconcile_times: UpdateTimes,
    /// VIPs currently in panic mode (serving backends that fail checks).
    pub vips_in_panic: u64,
    /// Zone-aware VIPs: their zone blocks and routing state.
    pub zones: Vec<ZoneMetrics>,
    pub zone_vips: Vec<VipZoneMetrics>,
    pub flows_evicted: u64,
    pub flow_entries: u64,
    /// Time until the next reconciliation pass, as the last one's cost set it.
    pub reconcile_interval: std::time::Duration,
    /// Each family's flow-table size.
    pub flow_table_capacity: crate::kernel::flow_tables::Capacities,
    /// etcd discovery, when a VIP uses it.
    pub discovery: Option<DiscoveryMetrics>,
    /// Errors the control plane survived, per stage.
    pub control_errors: Vec<(&'static str, u64)>,
    /// Configurations applied: 1 at start, one more per applied SIGHUP.
    pub config_generation: u64,
    /// Map-update syscalls of the score writer.
    pub score_syscalls: u64,
    /// This process's CPU time and memory.
    pub process: Option<ProcessStats>,
}

/// One zone block of a zone-aware VIP (`lb_zone_*`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ZoneMetrics {
    pub vip: String,
    /// The zone, `-` for backends without one, `a+b` for a lumped block.
    pub zone: String,
    pub backends: u64,
    pub active: u64,
    /// Planned share of new connections, 0..=1.
    pub share: f64,
    /// Connections opened to the zone's backends (their kernel counters).
    pub new_connections: u64,
}

/// A zone-aware VIP's routing state.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct VipZoneMetrics {
    pub vip: String,
    /// 0 local, 1 spilling, 2 panic (`pool::zones::Spill::gauge`).
    pub spill: i64,
    pub panics: u64,
}

/// What etcd discovery reports (`lb_discovery_*`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DiscoveryMetrics {
    /// Every discovered VIP's watch is established.
    pub connected: bool,
    /// Highest etcd revision applied.
    pub revision: i64,
    /// Updates applied, keys skipped as invalid, full re-reads.
    pub applied: u64,
    pub invalid: u64,
    pub resyncs: u64,
    /// `None` before the first update.
    pub seconds_since_update: Option<f64>,
}

/// CPU time and resident memory of this process.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ProcessStats {
    pub cpu_seconds: f64,
    pub resident_bytes: u64,
}

impl ProcessStats {
    /// From /proc/self/stat.
    pub fn read() -> Option<Self> {
        let text = std::fs::read_to_string("/proc/self/stat").ok()?;
        // SAFETY: sysconf has no preconditions.
        let (ticks, page) = unsafe {
            (
                libc::sysconf(libc::_SC_CLK_TCK),
                libc::sysconf(libc::_SC_PAGESIZE),
            )
        };
        parse_stat(&text, u64::try_from(ticks).ok()?, u64::try_from(page).ok()?)
    }
}

/// utime + stime (fields 14 and 15, in clock ticks) and rss (field 24, in
/// pages) of a /proc/PID/stat line; the command name (field 2) may hold
/// spaces and parentheses, so fields are counted after its last ')'.
pub fn parse_stat(text: &str, ticks_per_second: u64, page_size: u64) -> Option<ProcessStats> {
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // `rest` starts at field 3 (state).
    let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
    let ticks = field(14)? + field(15)?;
    Some(ProcessStats {
        cpu_seconds: ticks as f64 / ticks_per_second.max(1) as f64,
        resident_bytes: field(24)? * page_size,
    })
}

/// One sample's value.
#[derive(Debug)]
enum Value {
    Number(f64),
    Histogram(Histogram),
}

/// One family as the render functions describe it.
#[derive(Debug)]
struct Family {
    /// The full name (a counter's with its `_total`).
    name: String,
    kind: MetricType,
    help: String,
    samples: Vec<(Vec<(String, String)>, Value)>,
}

/// The families of one scrape, encoded by `prometheus-client` as a
/// [`Collector`].
#[derive(Debug, Default)]
struct Exposition(Vec<Family>);

impl Exposition {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let kind = match kind {
            "counter" => MetricType::Counter,
            "histogram" => MetricType::Histogram,
            _ => MetricType::Gauge,
        };
        self.0.push(Family {
            name: name.to_string(),
            kind,
            help: help.to_string(),
            samples: Vec::new(),
        });
    }

    fn push(&mut self, labels: &[(&str, &str)], value: Value) {
        let labels = labels
            .iter()
            .map(|(k, v)| ((*k).to_string(), escape(v)))
            .collect();
        if let Some(family) = self.0.last_mut() {
            family.samples.push((labels, value));
        }
    }

    /// A sample of the family last begun (`name` is that family's).
    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        debug_assert_eq!(self.0.last().map(|f| f.name.as_str()), Some(name));
        self.push(labels, Value::Number(value));
    }

    fn histogram(&mut self, labels: &[(&str, &str)], histogram: &Histogram) {
        self.push(labels, Value::Histogram(histogram.clone()));
    }
}

/// A label value as the text format needs it (the encoder of
/// `prometheus-client` 0.23 writes label values as they are).
fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Encodes one sample; whole numbers as integers.
fn encode_value(kind: MetricType, value: &Value, encoder: MetricEncoder) -> std::fmt::Result {
    let whole = |v: f64| (v.fract() == 0.0 && (0.0..9.0e15).contains(&v)).then_some(v as u64);
    match (value, kind) {
        (Value::Histogram(h), _) => h.encode(encoder),
        (Value::Number(v), MetricType::Counter) => match whole(*v) {
            Some(n) => ConstCounter::new(n).encode(encoder),
            None => ConstCounter::new(*v).encode(encoder),
        },
        (Value::Number(v), _) => match whole(*v) {
            Some(n) => ConstGauge::new(n as i64).encode(encoder),
            None => ConstGauge::new(*v).encode(encoder),
        },
    }
}

impl Collector for Exposition {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        for f in &self.0 {
            // The OpenMetrics encoder adds a counter's `_total` itself.
            let name = match f.kind {
                MetricType::Counter => f.name.strip_suffix("_total").unwrap_or(&f.name),
                _ => &f.name,
            };
            let mut family = encoder.encode_descriptor(name, &f.help, None, f.kind)?;
            match f.samples.as_slice() {
                [(labels, value)] if labels.is_empty() => {
                    encode_value(f.kind, value, family)?;
                }
                samples => {
                    for (labels, value) in samples {
                        encode_value(f.kind, value, family.encode_family(labels)?)?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// A family with one sample per backend: `value` picks the number.
struct BackendFamily {
    name: &'static str,
    kind: &'static str,
    help: &'static str,
    value: fn(&BackendMetrics) -> f64,
}

const CONNECTION_FAMILIES: [BackendFamily; 4] = [
    BackendFamily {
        name: "lb_backend_connections_opened_total",
        kind: "counter",
        help: "Connections the kernel opened to the backend.",
        value: |b| b.opened as f64,
    },
    BackendFamily {
        name: "lb_backend_connections_closed_total",
        kind: "counter",
        help: "Connections the kernel saw end (FIN or RST).",
        value: |b| b.closed as f64,
    },
    BackendFamily {
        name: "lb_backend_connections_active",
        kind: "gauge",
        help: "Connections open now (opened - closed, plus lb-user's own health checks).",
        value: |b| b.active as f64,
    },
    BackendFamily {
        name: "lb_backend_connections_refused_total",
        kind: "counter",
        help: "Connections refused by the backend or unanswered SYNs, seen by this process.",
        value: |b| b.refused as f64,
    },
];

const SNAT_FAMILIES: [BackendFamily; 2] = [
    BackendFamily {
        name: "lb_backend_snat_tuples_held",
        kind: "gauge",
        help: "SNAT tuples held towards the backend for this VIP: open, lingering or in quarantine.",
        value: |b| b.snat_tuples_held as f64,
    },
    BackendFamily {
        name: "lb_backend_snat_tuples_free",
        kind: "gauge",
        help: "SNAT tuples (pool addresses x ports) free towards the backend's address, less what every VIP's flows to it hold; at 0 its new flows are refused (drop_snat_exhausted) unless time-wait reuse takes one over.",
        value: |b| b.snat_tuples_free as f64,
    },
];

const ESTIMATE_FAMILIES: [BackendFamily; 3] = [
    BackendFamily {
        name: "lb_backend_latency_ewma_seconds",
        kind: "gauge",
        help: "Peak-EWMA latency estimate (client payload to first backend payload).",
        value: |b| b.ewma_seconds,
    },
    BackendFamily {
        name: "lb_backend_score",
        kind: "gauge",
        help: "Cost the kernel's P2C multiplies by (inflight+1)^bias (lower is better).",
        value: |b| b.score as f64,
    },
    BackendFamily {
        name: "lb_backend_effective_weight",
        kind: "gauge",
        help: "Weight used for selection after slow start and smoothing, in configured units.",
        value: |b| b.effective_weight,
    },
];

const OUTLIER_FAMILIES: [BackendFamily; 2] = [
    BackendFamily {
        name: "lb_backend_ejections_total",
        kind: "counter",
        help: "Outlier ejections of the backend.",
        value: |b| b.ejections as f64,
    },
    BackendFamily {
        name: "lb_backend_outlier_failures_total",
        kind: "counter",
        help: "Failures counted by outlier detection (refused, SYN timeout, reset by the backend).",
        value: |b| b.outlier_failures as f64,
    },
];

impl Exposition {
    fn per_backend(&mut self, s: &Snapshot, families: &[BackendFamily]) {
        for f in families {
            self.family(f.name, f.kind, f.help);
            for b in &s.backends {
                self.sample(
                    f.name,
                    &[("vip", &b.vip), ("backend", &b.backend)],
                    (f.value)(b),
                );
            }
        }
    }

    /// A per-backend family split by one more label: `split` gives each
    /// backend's `(label value, number)` pairs.
    fn per_backend_split(
        &mut self,
        s: &Snapshot,
        (name, kind, help): (&str, &str, &str),
        label: &str,
        split: impl Fn(&BackendMetrics) -> Vec<(&'static str, f64)>,
    ) {
        self.family(name, kind, help);
        for b in &s.backends {
            for (value_label, v) in split(b) {
                let labels = [
                    ("vip", b.vip.as_str()),
                    ("backend", &b.backend),
                    (label, value_label),
                ];
                self.sample(name, &labels, v);
            }
        }
    }

    /// A family of one unlabelled sample.
    fn single(&mut self, (name, kind, help): (&str, &str, &str), value: f64) {
        self.family(name, kind, help);
        self.sample(name, &[], value);
    }
}

pub fn render(s: &Snapshot) -> String {
    let mut out = Exposition::default();
    out.per_backend(s, &CONNECTION_FAMILIES);
    out.per_backend(s, &SNAT_FAMILIES);
    render_backend_splits(&mut out, s);
    render_kernel_counters(&mut out, s);
    render_map_updates(&mut out, s);
    render_pool_and_flows(&mut out, s);
    if !s.zone_vips.is_empty() {
        render_zones(&mut out, s);
    }
    if let Some(d) = &s.discovery {
        render_discovery(&mut out, d);
    }
    render_process(&mut out, s);
    let mut registry = Registry::default();
    registry.register_collector(Box::new(out));
    let mut text = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut text, &registry) {
        warn!("metrics: encoding failed: {e}");
    }
    text
}

/// Zone-aware routing: per zone block and per VIP.
fn render_zones(out: &mut Exposition, s: &Snapshot) {
    type Field = fn(&ZoneMetrics) -> f64;
    let families: [(&str, &str, &str, Field); 4] = [
        (
            "lb_zone_backends",
            "gauge",
            "Backends of the VIP in the zone (selectable or not).",
            |z| z.backends as f64,
        ),
        (
            "lb_zone_active_backends",
            "gauge",
            "Backends of the VIP in the zone that may take new connections.",
            |z| z.active as f64,
        ),
        (
            "lb_zone_share",
            "gauge",
            "Share of the VIP's new connections the zone gets (0 to 1), as planned.",
            |z| z.share,
        ),
        (
            "lb_zone_new_connections_total",
            "counter",
            "Connections opened to the zone's backends.",
            |z| z.new_connections as f64,
        ),
    ];
    for (name, kind, help, field) in families {
        out.family(name, kind, help);
        for z in &s.zones {
            out.sample(name, &[("vip", &z.vip), ("zone", &z.zone)], field(z));
        }
    }
    out.family(
        "lb_zone_spill",
        "gauge",
        "Zone routing state: 0 the local zone takes everything, 1 spilling to other zones, 2 zone panic (every backend serves).",
    );
    for v in &s.zone_vips {
        out.sample("lb_zone_spill", &[("vip", &v.vip)], v.spill as f64);
    }
    out.family(
        "lb_zone_panics_total",
        "counter",
        "Times the VIP entered the zone panic (no zone had a selectable backend).",
    );
    for v in &s.zone_vips {
        out.sample("lb_zone_panics_total", &[("vip", &v.vip)], v.panics as f64);
    }
}

/// etcd discovery's connection, revision and updates.
fn render_discovery(out: &mut Exposition, d: &DiscoveryMetrics) {
    out.family(
        "lb_discovery_connected",
        "gauge",
        "1 while every discovered VIP's etcd watch is established.",
    );
    out.sample(
        "lb_discovery_connected",
        &[],
        f64::from(u8::from(d.connected)),
    );
    out.family(
        "lb_discovery_revision",
        "gauge",
        "Highest etcd revision the balancer has applied.",
    );
    out.sample("lb_discovery_revision", &[], d.revision as f64);
    out.family(
        "lb_discovery_updates_total",
        "counter",
        "Discovery updates: applied, invalid (a key skipped) or resync (prefix read again).",
    );
    for (result, v) in [
        ("applied", d.applied),
        ("invalid", d.invalid),
        ("resync", d.resyncs),
    ] {
        out.sample(
            "lb_discovery_updates_total",
            &[("result", result)],
            v as f64,
        );
    }
    out.family(
        "lb_discovery_last_update_age_seconds",
        "gauge",
        "Seconds since the last discovery update (-1 before the first).",
    );
    out.sample(
        "lb_discovery_last_update_age_seconds",
        &[],
        d.seconds_since_update.unwrap_or(-1.0),
    );
}

/// Build, configuration generation, score-writer syscalls and the process.
fn render_process(out: &mut Exposition, s: &Snapshot) {
    out.family(
        "lb_build_info",
        "gauge",
        "Always 1; the version of this lb-user build.",
    );
    out.sample(
        "lb_build_info",
        &[("version", env!("CARGO_PKG_VERSION"))],
        1.0,
    );
    out.single(
        (
            "lb_config_generation",
            "gauge",
            "Configurations applied: 1 at start, one more per applied SIGHUP.",
        ),
        s.config_generation as f64,
    );
    out.single(
        (
            "lb_score_map_syscalls_total",
            "counter",
            "Map-update syscalls made to write scores and reference costs (one batch per tick at most for the scores).",
        ),
        s.score_syscalls as f64,
    );
    if let Some(p) = s.process {
        out.single(
            (
                "process_cpu_seconds_total",
                "counter",
                "User and system CPU time of lb-user.",
            ),
            p.cpu_seconds,
        );
        out.single(
            (
                "process_resident_memory_bytes",
                "gauge",
                "Resident memory of lb-user.",
            ),
            p.resident_bytes as f64,
        );
    }
}

/// Bytes by direction, estimates, states, outlier counts and health checks.
fn render_backend_splits(out: &mut Exposition, s: &Snapshot) {
    out.per_backend_split(
        s,
        (
            "lb_backend_bytes_total",
            "counter",
            "Bytes of balanced traffic, by direction.",
        ),
        "direction",
        |b| {
            vec![
                ("to_backend", b.bytes_to_backend as f64),
                ("from_backend", b.bytes_from_backend as f64),
            ]
        },
    );
    out.per_backend(s, &ESTIMATE_FAMILIES);
    out.per_backend_split(
        s,
        (
            "lb_backend_state",
            "gauge",
            "1 for the backend's current state, 0 for the others.",
        ),
        "state",
        |b| {
            let current = |state| if b.state == Some(state) { 1.0 } else { 0.0 };
            State::ALL
                .iter()
                .map(|&state| (state.name(), current(state)))
                .collect()
        },
    );
    out.per_backend(s, &OUTLIER_FAMILIES);
    out.per_backend_split(
        s,
        (
            "lb_health_checks_total",
            "counter",
            "Active health-check results.",
        ),
        "result",
        |b| {
            vec![
                ("pass", b.health_passed as f64),
                ("fail", b.health_failed as f64),
                ("busy", b.health_busy as f64),
            ]
        },
    );
}

/// Packets by reason and the ring buffer's events.
fn render_kernel_counters(out: &mut Exposition, s: &Snapshot) {
    out.family(
        "lb_latency_probes_total",
        "counter",
        "Timed health checks by what they did to an avoided backend's latency estimate.",
    );
    for (outcome, v) in &s.latency_probes {
        out.sample(
            "lb_latency_probes_total",
            &[("outcome", outcome)],
            *v as f64,
        );
    }
    out.family(
        "lb_packets_total",
        "counter",
        "Packets by the verdict reason the XDP program counted.",
    );
    for (reason, v) in &s.reasons {
        out.sample("lb_packets_total", &[("reason", reason)], *v as f64);
    }
    out.single(
        (
            "lb_ring_buffer_events_lost_total",
            "counter",
            "Flow events the kernel could not queue (ring buffer full).",
        ),
        s.events_lost as f64,
    );
    out.single(
        (
            "lb_ring_buffer_events_total",
            "counter",
            "Flow events this process took off the ring buffer (failures only).",
        ),
        s.events_received as f64,
    );
    out.single(
        (
            "lb_latency_aggregates_read_total",
            "counter",
            "Per-backend latency aggregates read from the kernel at score ticks.",
        ),
        s.latency_reads as f64,
    );
    out.single(
        (
            "lb_latency_aggregates_skipped_total",
            "counter",
            "Latency aggregates not taken into a backend's estimate: their answers waited on a health outage.",
        ),
        s.latency_outage_skips as f64,
    );
}

/// How long the writes of selections and scores take.
fn render_map_updates(out: &mut Exposition, s: &Snapshot) {
    let kinds = [("publish", &s.publish_times), ("scores", &s.score_times)];
    out.family(
        "lb_map_update_seconds",
        "histogram",
        "Time to write map updates: a VIP's backends and slots (publish) or all scores (scores).",
    );
    for (kind, t) in kinds {
        out.histogram(&[("kind", kind)], &t.histogram);
    }
    out.family(
        "lb_score_tick_seconds",
        "histogram",
        "Time of one score tick: estimates, scores and every VIP's selection written.",
    );
    out.histogram(&[], &s.tick_times.histogram);
    out.family(
        "lb_reconcile_seconds",
        "histogram",
        "Time of one reconciliation pass: the kernel sweep of the flow table and the per-backend counter reads.",
    );
    out.histogram(&[], &s.reconcile_times.histogram);
    out.single(
        (
            "lb_reconcile_interval_seconds",
            "gauge",
            "Time between reconciliation passes: 1 s, longer when a pass costs more than 0.1% of a core at that rate (a large flow table), at most 120 s.",
        ),
        s.reconcile_interval.as_secs_f64(),
    );
    out.family(
        "lb_map_update_max_seconds",
        "gauge",
        "Slowest map update so far.",
    );
    for (kind, t) in kinds {
        out.sample(
            "lb_map_update_max_seconds",
            &[("kind", kind)],
            t.max_seconds,
        );
    }
}

/// VIPs in panic mode and the flow table's fill.
fn render_pool_and_flows(out: &mut Exposition, s: &Snapshot) {
    out.single(
        (
            "lb_vips_in_panic",
            "gauge",
            "VIPs serving backends that fail their checks because none passes.",
        ),
        s.vips_in_panic as f64,
    );
    out.single(
        (
            "lb_flows_evicted_total",
            "counter",
            "Lone flow entries (one direction of a connection without the other) the kernel sweep found and cleaned up, seen by this process.",
        ),
        s.flows_evicted as f64,
    );
    out.single(
        (
            "lb_flow_table_entries",
            "gauge",
            "Flow-table entries (two per connection) at the last reconciliation pass.",
        ),
        s.flow_entries as f64,
    );
    out.family(
        "lb_flow_table_capacity",
        "gauge",
        "Entries each family's flow table holds.",
    );
    let capacity = s.flow_table_capacity;
    for (family, entries) in [("ipv4", capacity.ipv4), ("ipv6", capacity.ipv6)] {
        out.sample(
            "lb_flow_table_capacity",
            &[("family", family)],
            f64::from(entries),
        );
    }
    out.family(
        "lb_control_errors_total",
        "counter",
        "Control-plane errors survived (logged, retried; the data path kept running), per stage.",
    );
    for (stage, count) in &s.control_errors {
        out.sample(
            "lb_control_errors_total",
            &[("stage", stage)],
            *count as f64,
        );
    }
}

/// A scrape waiting for the event loop's snapshot.
pub type Scrape = oneshot::Sender<String>;

/// Serves `GET /metrics`; each scrape asks the event loop for the text.
pub async fn serve(
    addr: SocketAddr,
    scrapes: mpsc::Sender<Scrape>,
) -> anyhow::Result<JoinHandle<()>> {
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the metrics listener {addr}"))?;
    info!(%addr, "metrics at http://{addr}/metrics");
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    Ok(tokio::spawn(async move {
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(e) => {
                    warn!("metrics listener: accept: {e}");
                    sleep(ACCEPT_RETRY).await;
                    continue;
                }
            };
            let Ok(permit) = slots.clone().try_acquire_owned() else {
                debug!("metrics listener: over {MAX_CONNECTIONS} connections, closing one");
                continue;
            };
            let scrapes = scrapes.clone();
            tokio::spawn(async move {
                if let Err(e) = answer(stream, scrapes).await {
                    debug!("metrics request: {e:#}");
                }
                drop(permit);
            });
        }
    }))
}

/// Reads a request head: up to its blank line, [`MAX_REQUEST`] bytes or
/// the end, all within [`REQUEST_TIMEOUT`].
async fn read_head<R: tokio::io::AsyncRead + Unpin>(stream: &mut R) -> anyhow::Result<Vec<u8>> {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    let read = async {
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < MAX_REQUEST {
            let n = stream.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            head.extend_from_slice(&buf[..n]);
        }
        anyhow::Ok(())
    };
    timeout(REQUEST_TIMEOUT, read)
        .await
        .context("request head not received in time")??;
    Ok(head)
}

async fn answer<S>(mut stream: S, scrapes: mpsc::Sender<Scrape>) -> anyhow::Result<()>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let head = read_head(&mut stream).await?;
    let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let (status, body) = if line.starts_with(b"GET /metrics ") || line == b"GET /metrics" {
        let (tx, rx) = oneshot::channel();
        scrapes.send(tx).await.ok();
        match rx.await {
            Ok(text) => ("200 OK", text),
            Err(_) => ("503 Service Unavailable", "shutting down\n".to_string()),
        }
    } else {
        ("404 Not Found", "metrics are at /metrics\n".to_string())
    };
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {CONTENT_TYPE}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    timeout(WRITE_TIMEOUT, stream.write_all(response.as_bytes()))
        .await
        .context("the answer was not taken in time")??;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_families_with_labels_and_conventions() {
        let s = Snapshot {
            backends: vec![BackendMetrics {
                vip: "10.0.0.100:80/tcp".into(),
                backend: "10.0.0.21:8080".into(),
                opened: 5,
                state: Some(State::Ejected),
                effective_weight: 0.5,
                snat_tuples_held: 40,
                snat_tuples_free: 12_728,
                ..Default::default()
            }],
            reasons: vec![("drop_snat_exhausted", 3)],
            events_lost: 2,
            events_received: 6,
            latency_reads: 9,
            latency_outage_skips: 1,
            control_errors: vec![("tick", 4), ("health", 0)],
            zones: vec![ZoneMetrics {
                vip: "10.0.0.100:80/tcp".into(),
                zone: "a".into(),
                backends: 5,
                active: 2,
                share: 0.5,
                new_connections: 7,
            }],
            zone_vips: vec![VipZoneMetrics {
                vip: "10.0.0.100:80/tcp".into(),
                spill: 1,
                panics: 3,
            }],
            flow_table_capacity: crate::kernel::flow_tables::Capacities {
                ipv4: 1_048_576,
                ipv6: 4096,
            },
            ..Default::default()
        };
        s.publish_times.histogram.observe(0.003);
        s.publish_times.histogram.observe(5.0);
        s.tick_times.histogram.observe(0.00002);
        s.reconcile_times.histogram.observe(0.003);
        let text = render(&s);
        assert!(text.contains(
            "lb_backend_connections_opened_total{vip=\"10.0.0.100:80/tcp\",backend=\"10.0.0.21:8080\"} 5\n"
        ));
        assert!(text.contains("state=\"ejected\"} 1\n"));
        assert!(text.contains("# TYPE lb_backend_snat_tuples_free gauge\n"));
        assert!(text.contains(
            "lb_backend_snat_tuples_free{vip=\"10.0.0.100:80/tcp\",backend=\"10.0.0.21:8080\"} 12728\n"
        ));
        assert!(text.contains(
            "lb_backend_snat_tuples_held{vip=\"10.0.0.100:80/tcp\",backend=\"10.0.0.21:8080\"} 40\n"
        ));
        assert!(text.contains("state=\"active\"} 0\n"));
        assert!(text.contains("lb_backend_effective_weight{vip=\"10.0.0.100:80/tcp\",backend=\"10.0.0.21:8080\"} 0.5\n"));
        assert!(text.contains("lb_packets_total{reason=\"drop_snat_exhausted\"} 3\n"));
        assert!(text.contains("lb_ring_buffer_events_lost_total 2\n"));
        assert!(text.contains("lb_ring_buffer_events_total 6\n"));
        assert!(text.contains("lb_latency_aggregates_read_total 9\n"));
        assert!(text.contains("lb_latency_aggregates_skipped_total 1\n"));
        assert!(text.contains("lb_control_errors_total{stage=\"tick\"} 4\n"));
        assert!(text.contains("lb_zone_active_backends{vip=\"10.0.0.100:80/tcp\",zone=\"a\"} 2\n"));
        assert!(text.contains("lb_zone_share{vip=\"10.0.0.100:80/tcp\",zone=\"a\"} 0.5\n"));
        assert!(
            text.contains(
                "lb_zone_new_connections_total{vip=\"10.0.0.100:80/tcp\",zone=\"a\"} 7\n"
            )
        );
        assert!(text.contains("lb_zone_spill{vip=\"10.0.0.100:80/tcp\"} 1\n"));
        assert!(text.contains("lb_flow_table_capacity{family=\"ipv4\"} 1048576\n"));
        assert!(text.contains("lb_flow_table_capacity{family=\"ipv6\"} 4096\n"));
        assert!(text.contains("lb_zone_panics_total{vip=\"10.0.0.100:80/tcp\"} 3\n"));
        // OpenMetrics: counters typed by their name without `_total`, a
        // histogram per map-update kind and one of score ticks, and EOF.
        assert!(text.contains("# TYPE lb_backend_connections_opened counter\n"));
        assert!(text.contains("# TYPE lb_map_update_seconds histogram\n"));
        assert!(text.contains("lb_map_update_seconds_count{kind=\"publish\"} 2\n"));
        assert!(text.contains("lb_map_update_seconds_sum{kind=\"publish\"} 5.003\n"));
        assert!(text.contains("lb_map_update_seconds_bucket{le=\"0.00256\",kind=\"publish\"} 0\n"));
        assert!(text.contains("lb_map_update_seconds_bucket{le=\"0.01024\",kind=\"publish\"} 1\n"));
        assert!(text.contains("lb_map_update_seconds_bucket{le=\"+Inf\",kind=\"publish\"} 2\n"));
        assert!(text.contains("lb_map_update_seconds_count{kind=\"scores\"} 0\n"));
        assert!(text.contains("# TYPE lb_score_tick_seconds histogram\n"));
        assert!(text.contains("# TYPE lb_reconcile_seconds histogram\n"));
        assert!(text.contains("lb_reconcile_seconds_count 1\n"));
        assert!(text.contains("lb_reconcile_seconds_bucket{le=\"0.00256\"} 0\n"));
        assert!(text.contains("lb_reconcile_seconds_bucket{le=\"0.01024\"} 1\n"));
        assert!(text.contains("lb_score_tick_seconds_bucket{le=\"0.00004\"} 1\n"));
        assert!(text.ends_with("# EOF\n"));
        // Every sample belongs to a declared family.
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let name = line.split(['{', ' ']).next().unwrap();
            let base = ["_total", "_sum", "_count", "_bucket"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .unwrap_or(name);
            assert!(text.contains(&format!("# TYPE {base} ")), "{line}");
        }
    }

    #[test]
    fn label_values_are_escaped() {
        let s = Snapshot {
            backends: vec![BackendMetrics {
                vip: "a\"b\\c\nd".into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        let text = render(&s);
        assert!(text.contains("vip=\"a\\\"b\\\\c\\nd\""), "{text}");
    }

    #[tokio::test]
    async fn serves_metrics_over_http() {
        let (tx, mut rx) = mpsc::channel::<Scrape>(1);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let server = serve(addr, tx).await.unwrap();
        tokio::spawn(async move {
            while let Some(reply) = rx.recv().await {
                let _ = reply.send("lb_x 1\n".into());
            }
        });
        for (path, want) in [("/metrics", "200 OK"), ("/", "404")] {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
                .await
                .unwrap();
            let mut text = String::new();
            s.read_to_string(&mut text).await.unwrap();
            assert!(text.contains(want), "{text}");
            if path == "/metrics" {
                assert!(text.ends_with("lb_x 1\n"));
            }
        }
        server.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_head_trickled_slowly_is_dropped_at_the_deadline() {
        let (mut client, mut server) = tokio::io::duplex(64);
        let started = tokio::time::Instant::now();
        let trickle = tokio::spawn(async move {
            for _ in 0..100 {
                if client.write_all(b"G").await.is_err() {
                    return;
                }
                sleep(Duration::from_secs(1)).await;
            }
        });
        let head = read_head(&mut server).await;
        assert!(head.is_err(), "a trickled head must not be read to its end");
        assert_eq!(started.elapsed().as_secs(), REQUEST_TIMEOUT.as_secs());
        trickle.abort();
        let (mut client, mut server) = tokio::io::duplex(64);
        client
            .write_all(b"GET /metrics HTTP/1.1\r\n\r\n")
            .await
            .unwrap();
        assert!(
            read_head(&mut server)
                .await
                .unwrap()
                .starts_with(b"GET /metrics")
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_never_reads_its_answer_is_dropped_at_the_deadline() {
        let (tx, mut rx) = mpsc::channel::<Scrape>(1);
        tokio::spawn(async move {
            while let Some(reply) = rx.recv().await {
                // Far more than the pipe's 64 bytes.
                let _ = reply.send("lb_x 1\n".repeat(10_000));
            }
        });
        let (mut client, server) = tokio::io::duplex(64);
        client
            .write_all(b"GET /metrics HTTP/1.1\r\n\r\n")
            .await
            .unwrap();
        let started = tokio::time::Instant::now();
        let answered = answer(server, tx.clone()).await;
        let e = answered.expect_err("a client that never reads held its slot");
        assert!(e.to_string().contains("not taken in time"), "{e:#}");
        assert_eq!(started.elapsed().as_secs(), WRITE_TIMEOUT.as_secs());
        drop(client);
        // One that reads gets all of it.
        let (mut client, server) = tokio::io::duplex(64);
        client
            .write_all(b"GET /metrics HTTP/1.1\r\n\r\n")
            .await
            .unwrap();
        let reader = tokio::spawn(async move {
            let mut text = String::new();
            client.read_to_string(&mut text).await.unwrap();
            text
        });
        answer(server, tx).await.unwrap();
        assert!(reader.await.unwrap().ends_with(&"lb_x 1\n".repeat(10_000)));
    }

    #[test]
    fn reads_cpu_and_memory_from_a_stat_line() {
        // A command name with a space and a parenthesis.
        let line = "4242 (lb user) x) S 1 4242 4242 0 -1 4194560 500 0 0 0 250 50 0 0 20 0 3 0 100 20000000 1500 18446744073709551615";
        let p = parse_stat(line, 100, 4096).unwrap();
        assert_eq!(p.cpu_seconds, 3.0);
        assert_eq!(p.resident_bytes, 1500 * 4096);
        assert_eq!(parse_stat("garbage", 100, 4096), None);
        let me = ProcessStats::read().unwrap();
        assert!(me.resident_bytes > 0);
    }
}
