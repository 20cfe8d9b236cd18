//! The three scenarios of the balance benchmark and the rows run in each.

use crate::lab::{Algorithm, BackendSpec};

/// Service time of a normal backend.
pub const FAST_MS: u64 = 10;
/// 10× slower: the slow nodes of `hetero` and the degraded one of `degrade`.
pub const SLOW_FACTOR: u64 = 10;
/// Worker slots of every backend (slow ones too: a slow node is a slower
/// server, not a smaller one).
pub const WORKERS: u32 = 2;
/// Backends per scenario.
pub const BACKENDS: usize = 10;
/// Open-loop load as a fraction of the pool's service capacity.
pub const LOAD_FRACTION: f64 = 0.7;
/// GC-like pauses of `stall`.
pub const STALL_EVERY_MS: u64 = 2_000;
pub const STALL_FOR_MS: u64 = 300;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// 8 fast, 2 slow (10× service time).
    Hetero,
    /// 10 equal, 2 of them pause every worker 300 ms every 2 s.
    Stall,
    /// 10 equal; one turns 10× slower halfway through the run.
    Degrade,
}

impl Kind {
    pub const ALL: [Kind; 3] = [Kind::Hetero, Kind::Stall, Kind::Degrade];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Hetero => "hetero",
            Kind::Stall => "stall",
            Kind::Degrade => "degrade",
        }
    }

    /// Indexes of the backends that misbehave (the "slow" share column).
    pub fn slow(self) -> Vec<usize> {
        match self {
            Kind::Hetero | Kind::Stall => vec![BACKENDS - 2, BACKENDS - 1],
            Kind::Degrade => vec![BACKENDS - 1],
        }
    }

    pub fn backends(self) -> Vec<BackendSpec> {
        let slow = self.slow();
        (0..BACKENDS)
            .map(|i| {
                let mut spec = BackendSpec::new(FAST_MS, WORKERS);
                match self {
                    Kind::Hetero if slow.contains(&i) => spec.service_time_ms *= SLOW_FACTOR,
                    Kind::Stall if slow.contains(&i) => {
                        spec.stall_every_ms = STALL_EVERY_MS;
                        spec.stall_for_ms = STALL_FOR_MS;
                    }
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
        self.backends()
            .iter()
            .map(|b| f64::from(b.workers) * 1000.0 / b.service_time_ms as f64)
            .sum()
    }

    pub fn rate(self) -> f64 {
        (self.capacity_rps() * LOAD_FRACTION).round()
    }
}

/// One way of getting the clients' requests to the servers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Row {
    Ours(Algorithm),
    Haproxy(&'static str),
    /// nginx stream with this upstream directive ("" = round robin).
    Nginx(&'static str),
    Nftables,
    /// Clients spread their requests over the well-behaved backends directly.
    Oracle,
}

impl Row {
    pub fn all() -> Vec<Row> {
        let mut rows: Vec<Row> = Algorithm::ALL.into_iter().map(Row::Ours).collect();
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
            Row::Haproxy(a) => format!("haproxy {a}"),
            Row::Nginx("") => "nginx round-robin".into(),
            Row::Nginx(m) => format!("nginx {}", m.trim_end_matches(';')),
            Row::Nftables => "nftables numgen random".into(),
            Row::Oracle => "oracle (fast backends direct)".into(),
        }
    }

    /// Whether the XDP data path carries this row's packets (its softirq
    /// time is part of the balancer's cost).
    pub fn in_kernel(self) -> bool {
        matches!(self, Row::Ours(_) | Row::Nftables)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hetero_capacity_counts_slow_nodes_at_a_tenth() {
        // 8 × 2/10ms + 2 × 2/100ms = 1600 + 40.
        assert_eq!(Kind::Hetero.capacity_rps(), 1640.0);
        assert_eq!(Kind::Hetero.rate(), 1148.0);
        assert_eq!(Kind::Stall.capacity_rps(), 2000.0);
        assert_eq!(Kind::Degrade.slow(), [9]);
    }

    #[test]
    fn row_names_are_distinct() {
        let names: std::collections::HashSet<_> = Row::all().iter().map(|r| r.name()).collect();
        assert_eq!(names.len(), Row::all().len());
    }
}
