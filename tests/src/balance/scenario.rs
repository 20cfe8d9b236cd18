//! The scenarios of the balance benchmark and the rows run in each.
//!
//! Five are the ones the balancer was tuned on (`hetero`, `stall`,
//! `degrade`, `zones`, `recover`). Two more are **held out**
//! ([`Kind::held_out`]): no setting or rule is chosen by their results,
//! they only check that what the tuned five reward carries over to pools
//! of another shape (`hetero-20`: 3 slow of 20; `big-slow`: the slow
//! backend has 4× the workers, so it can carry more than a fast one's
//! share of in-flight requests while each of them is slow).

use crate::lab::{Algorithm, BackendSpec};

/// Service time of a normal backend.
pub const FAST_MS: u64 = 10;
/// 10× slower: the slow nodes of `hetero` and the degraded one of `degrade`.
pub const SLOW_FACTOR: u64 = 10;
/// Worker slots of every backend (slow ones too: a slow node is a slower
/// server, not a smaller one).
pub const WORKERS: u32 = 2;
/// Backends per scenario (but `hetero-20`).
pub const BACKENDS: usize = 10;
/// `hetero-20`: backends, and how many of them are slow.
pub const WIDE_BACKENDS: usize = 20;
pub const WIDE_SLOW: usize = 3;
/// `big-slow`: the slow backend's workers, as a multiple of [`WORKERS`].
pub const BIG_SLOW_WORKERS: u32 = 4;
/// Open-loop load in percent of the pool's service capacity, by default
/// (`--load` runs other loads, published as their own tables).
pub const LOAD_PERCENT: u32 = 70;
/// GC-like pauses of `stall`.
pub const STALL_EVERY_MS: u64 = 2_000;
pub const STALL_FOR_MS: u64 = 300;
/// `recover`: how long the backend stays slow, from a third of the run on.
pub const RECOVER_SLOW_MS: u64 = 1_000;
/// `zones`: the balancer's (and the clients') zone, and the other one.
pub const LOCAL_ZONE: &str = "a";
pub const REMOTE_ZONE: &str = "b";
/// `zones`: backends per zone (the first half of the pool is zone a).
pub const ZONE_BACKENDS: usize = BACKENDS / 2;
/// `zones`: latency added to every answer of a zone b backend, outside its
/// worker slots: the network between the zones, which slows the client but
/// costs the server nothing. 5 ms is half a service time. Real cross-zone
/// round trips are nearer 0.5–2 ms, but a new connection per request pays
/// several of them (handshake, request, and TLS in real deployments); 5 ms
/// makes going across visibly dearer than staying without drowning the
/// service time, so P50 and P99 show which balancer stayed local.
pub const CROSS_ZONE_MS: u64 = 5;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// 8 fast, 2 slow (10× service time).
    Hetero,
    /// 10 equal, 2 of them pause every worker 300 ms every 2 s.
    Stall,
    /// 10 equal; one turns 10× slower halfway through the run.
    Degrade,
    /// 10 equal in two zones of 5; the balancer and clients are in zone a,
    /// and zone b's answers take [`CROSS_ZONE_MS`] longer (cross-zone).
    Zones,
    /// 10 equal; from a third of the run one is 10× slower for
    /// [`RECOVER_SLOW_MS`], then as fast as the others again: how soon
    /// does it get its share back?
    Recover,
    /// Held out: 20 backends, 3 of them 10× slower.
    HeteroWide,
    /// Held out: 10 backends; one is 10× slower with [`BIG_SLOW_WORKERS`]×
    /// the workers.
    BigSlow,
}

impl Kind {
    pub const ALL: [Kind; 7] = [
        Kind::Hetero,
        Kind::Stall,
        Kind::Degrade,
        Kind::Zones,
        Kind::Recover,
        Kind::HeteroWide,
        Kind::BigSlow,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Hetero => "hetero",
            Kind::Stall => "stall",
            Kind::Degrade => "degrade",
            Kind::Zones => "zones",
            Kind::Recover => "recover",
            Kind::HeteroWide => "hetero-20",
            Kind::BigSlow => "big-slow",
        }
    }

    /// Whether no setting is tuned on this scenario (see the module's docs).
    pub fn held_out(self) -> bool {
        matches!(self, Kind::HeteroWide | Kind::BigSlow)
    }

    /// Number of backends.
    pub fn count(self) -> usize {
        match self {
            Kind::HeteroWide => WIDE_BACKENDS,
            _ => BACKENDS,
        }
    }

    /// The name of this scenario's table at `load_percent`: the plain name
    /// at the default load, `NAME at P%` otherwise.
    pub fn table(self, load_percent: u32) -> String {
        if load_percent == LOAD_PERCENT {
            self.name().to_string()
        } else {
            format!("{} at {load_percent}%", self.name())
        }
    }

    /// The scenario and load of a table name ([`Kind::table`]).
    pub fn of_table(table: &str) -> Option<(Kind, u32)> {
        let (name, load) = match table.split_once(" at ") {
            Some((name, load)) => (name, load.strip_suffix('%')?.parse().ok()?),
            None => (table, LOAD_PERCENT),
        };
        Some((Kind::ALL.into_iter().find(|k| k.name() == name)?, load))
    }

    /// Indexes of the backends that misbehave (the "slow" share column).
    /// The oracle row sends to every other backend. In `zones` these are
    /// zone b's: nothing is wrong with them, but every request to them
    /// crosses zones, so the share is the cross-zone share and the oracle
    /// sends straight to zone a's, the best a balancer could pick.
    pub fn slow(self) -> Vec<usize> {
        match self {
            Kind::Hetero | Kind::Stall => vec![BACKENDS - 2, BACKENDS - 1],
            Kind::Degrade | Kind::Recover | Kind::BigSlow => vec![BACKENDS - 1],
            Kind::HeteroWide => (WIDE_BACKENDS - WIDE_SLOW..WIDE_BACKENDS).collect(),
            Kind::Zones => (ZONE_BACKENDS..BACKENDS).collect(),
        }
    }

    /// The zone of backend `index` (`None` outside `zones`).
    pub fn zone(self, index: usize) -> Option<&'static str> {
        match self {
            Kind::Zones if index < ZONE_BACKENDS => Some(LOCAL_ZONE),
            Kind::Zones => Some(REMOTE_ZONE),
            _ => None,
        }
    }

    pub fn backends(self) -> Vec<BackendSpec> {
        let slow = self.slow();
        (0..self.count())
            .map(|i| {
                let mut spec = BackendSpec::new(FAST_MS, WORKERS);
                match self {
                    Kind::Hetero | Kind::HeteroWide if slow.contains(&i) => {
                        spec.service_time_ms *= SLOW_FACTOR
                    }
                    Kind::BigSlow if slow.contains(&i) => {
                        spec.service_time_ms *= SLOW_FACTOR;
                        spec.workers *= BIG_SLOW_WORKERS;
                    }
                    Kind::Stall if slow.contains(&i) => {
                        spec.stall_every_ms = STALL_EVERY_MS;
                        spec.stall_for_ms = STALL_FOR_MS;
                    }
                    Kind::Zones if slow.contains(&i) => spec.added_latency_ms = CROSS_ZONE_MS,
                    _ => {}
                }
                spec
            })
            .collect()
    }

    /// Requests per second the pool can serve: Σ workers / service time
    /// (before any degradation; stalls cost `stall`'s two nodes 15 % of
    /// their time, which this ignores).
    pub fn capacity_rps(self) -> f64 {
        capacity(&self.backends())
    }

    /// The capacity the load percentage applies to: the whole pool's, except in
    /// `zones`, where it is the local zone's (zone a's 5 backends, half the
    /// pool). `zones` asks whether a balancer keeps traffic local when the
    /// local zone can carry it. At 70 % of the whole pool (1400 req/s) zone a
    /// alone would be at 140 %: spilling would be forced, the scenario would
    /// measure the spill rule instead of locality, and the oracle ("zone a's
    /// backends direct") would overload them. At 70 % of zone a (700 req/s)
    /// the local zone runs as loaded as the pools of the other scenarios, a
    /// zone-aware balancer has no reason to leave it, and a zone-blind one
    /// spreads over both zones at 35 % each.
    pub fn load_base_rps(self) -> f64 {
        match self {
            Kind::Zones => capacity(&self.backends()[..ZONE_BACKENDS]),
            _ => self.capacity_rps(),
        }
    }

    /// The open-loop rate at `load_percent` of [`Kind::load_base_rps`].
    pub fn rate(self, load_percent: u32) -> f64 {
        (self.load_base_rps() * f64::from(load_percent) / 100.0).round()
    }

    /// Whether `row` runs in this scenario. `zones` compares zone-aware
    /// p2c-ewma with plain p2c-ewma and the oracle only (the peers have no
    /// zones to compare); the other scenarios run every row but the
    /// zone-aware one (they have no zones).
    pub fn runs(self, row: Row) -> bool {
        match (self, row) {
            (Kind::Zones, Row::Ours(Algorithm::P2cEwma) | Row::OursZoneAware(_) | Row::Oracle) => {
                true
            }
            (Kind::Zones, _) | (_, Row::OursZoneAware(_)) => false,
            _ => true,
        }
    }
}

/// Σ workers / service time: requests per second `backends` can serve.
fn capacity(backends: &[BackendSpec]) -> f64 {
    backends
        .iter()
        .map(|b| f64::from(b.workers) * 1000.0 / b.service_time_ms as f64)
        .sum()
}

/// One way of getting the clients' requests to the servers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Row {
    Ours(Algorithm),
    /// lb-user in zone a (`--zone a`), every backend given with its zone
    /// (zone-aware routing is on by default then).
    OursZoneAware(Algorithm),
    Haproxy(&'static str),
    /// nginx stream with this upstream directive ("" = round robin).
    Nginx(&'static str),
    Nftables,
    /// Clients spread their requests over the well-behaved backends directly.
    Oracle,
}

impl Row {
    pub fn all() -> Vec<Row> {
        // Zone-aware first: it leads the `zones` table, the only one it is in.
        let mut rows = vec![Row::OursZoneAware(Algorithm::P2cEwma)];
        rows.extend(Algorithm::ALL.into_iter().map(Row::Ours));
        rows.extend([
            Row::Haproxy("roundrobin"),
            Row::Haproxy("leastconn"),
            Row::Haproxy("random(2)"),
            Row::Nginx(""),
            Row::Nginx("least_conn;"),
            Row::Nginx("random two least_conn;"),
            Row::Nftables,
            Row::Oracle,
        ]);
        rows
    }

    pub fn name(self) -> String {
        match self {
            Row::Ours(a) => format!("lb {}", a.name()),
            Row::OursZoneAware(a) => format!("lb {} zone-aware", a.name()),
            Row::Haproxy(a) => format!("haproxy {a}"),
            Row::Nginx("") => "nginx round-robin".into(),
            Row::Nginx(m) => format!("nginx {}", m.trim_end_matches(';')),
            Row::Nftables => "nftables numgen random".into(),
            Row::Oracle => "oracle (fast backends direct)".into(),
        }
    }

    /// The row's name in `kind`'s table: [`Row::name`], except the oracle
    /// of `zones`, whose "fast" backends are zone a's.
    pub fn label(self, kind: Kind) -> String {
        match (self, kind) {
            (Row::Oracle, Kind::Zones) => "oracle (zone a backends direct)".into(),
            _ => self.name(),
        }
    }

    /// Whether the XDP data path carries this row's packets (its softirq
    /// time is part of the balancer's cost).
    pub fn in_kernel(self) -> bool {
        matches!(self, Row::Ours(_) | Row::OursZoneAware(_) | Row::Nftables)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hetero_capacity_counts_slow_nodes_at_a_tenth() {
        // 8 × 2/10ms + 2 × 2/100ms = 1600 + 40.
        assert_eq!(Kind::Hetero.capacity_rps(), 1640.0);
        assert_eq!(Kind::Hetero.rate(70), 1148.0);
        assert_eq!(Kind::Stall.capacity_rps(), 2000.0);
        assert_eq!(Kind::Degrade.slow(), [9]);
        assert_eq!(Kind::Recover.slow(), [9]);
        assert_eq!(Kind::Recover.rate(70), 1400.0);
    }

    #[test]
    fn the_held_out_pools() {
        // 17 × 2/10ms + 3 × 2/100ms.
        let wide = Kind::HeteroWide;
        assert_eq!(wide.backends().len(), 20);
        assert_eq!(wide.slow(), [17, 18, 19]);
        assert_eq!(wide.capacity_rps(), 3460.0);
        assert_eq!(wide.rate(70), 2422.0);
        assert_eq!(wide.rate(85), 2941.0);
        // 9 × 2/10ms + 8/100ms: the slow one serves 80/s, a fast one 200/s.
        let big = Kind::BigSlow;
        let specs = big.backends();
        assert_eq!((specs[9].service_time_ms, specs[9].workers), (100, 8));
        assert_eq!((specs[0].service_time_ms, specs[0].workers), (10, 2));
        assert_eq!(big.capacity_rps(), 1880.0);
        assert!(wide.held_out() && big.held_out());
        assert!(!Kind::ALL[..5].iter().any(|k| k.held_out()));
    }

    #[test]
    fn table_names_carry_the_load_when_it_is_not_the_default() {
        assert_eq!(Kind::Hetero.table(70), "hetero");
        assert_eq!(Kind::Hetero.table(85), "hetero at 85%");
        for kind in Kind::ALL {
            for load in [70, 85, 50] {
                assert_eq!(Kind::of_table(&kind.table(load)), Some((kind, load)));
            }
        }
        assert_eq!(Kind::of_table("hetero at x%"), None);
        assert_eq!(Kind::of_table("nope"), None);
    }

    #[test]
    fn zones_load_is_seventy_percent_of_the_local_zone() {
        // 10 × 2/10ms for the pool, 5 × 2/10ms for zone a alone.
        assert_eq!(Kind::Zones.capacity_rps(), 2000.0);
        assert_eq!(Kind::Zones.load_base_rps(), 1000.0);
        assert_eq!(Kind::Zones.rate(70), 700.0);
        // The other scenarios keep loading their whole pool.
        assert_eq!(Kind::Stall.load_base_rps(), Kind::Stall.capacity_rps());
        assert_eq!(Kind::Stall.rate(70), 1400.0);
    }

    #[test]
    fn zone_b_is_the_second_half_and_only_it_is_farther() {
        let zones = Kind::Zones;
        assert_eq!(zones.slow(), [5, 6, 7, 8, 9]);
        let specs = zones.backends();
        assert_eq!(specs.len(), BACKENDS);
        for (i, spec) in specs.iter().enumerate() {
            let remote = i >= ZONE_BACKENDS;
            assert_eq!(zones.zone(i), Some(if remote { "b" } else { "a" }));
            assert_eq!(
                spec.added_latency_ms,
                if remote { CROSS_ZONE_MS } else { 0 }
            );
            // Same servers as everywhere else: only the distance differs.
            assert_eq!((spec.service_time_ms, spec.workers), (FAST_MS, WORKERS));
            assert_eq!((spec.stall_every_ms, spec.stall_for_ms), (0, 0));
        }
        assert_eq!(Kind::Hetero.zone(0), None);
        assert!(
            Kind::Hetero
                .backends()
                .iter()
                .all(|b| b.added_latency_ms == 0)
        );
    }

    #[test]
    fn zones_runs_three_rows_and_the_others_all_but_zone_aware() {
        let zones: Vec<String> = Row::all()
            .into_iter()
            .filter(|&r| Kind::Zones.runs(r))
            .map(|r| r.label(Kind::Zones))
            .collect();
        assert_eq!(
            zones,
            [
                "lb p2c-ewma zone-aware",
                "lb p2c-ewma",
                "oracle (zone a backends direct)"
            ]
        );
        for kind in Kind::ALL.into_iter().filter(|&k| k != Kind::Zones) {
            let rows: Vec<Row> = Row::all().into_iter().filter(|&r| kind.runs(r)).collect();
            assert_eq!(rows.len(), Row::all().len() - 1);
            assert!(!rows.contains(&Row::OursZoneAware(Algorithm::P2cEwma)));
            assert_eq!(Row::Oracle.label(kind), "oracle (fast backends direct)");
        }
    }

    #[test]
    fn row_names_are_distinct() {
        let names: std::collections::HashSet<_> = Row::all().iter().map(|r| r.name()).collect();
        assert_eq!(names.len(), Row::all().len());
    }
}
