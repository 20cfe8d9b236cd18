//! The metrics of the running state at one moment (a scrape).

use std::collections::HashMap;

use lb_common::{BackendStats, reason};

use super::runtime::Runtime;
use crate::{
    estimate::WEIGHT_UNITS,
    kernel::clock::Nanos,
    surface::metrics::{BackendMetrics, ProcessStats, Snapshot},
};

impl Runtime {
    /// The metrics of this moment.
    pub fn snapshot(&self, now: Nanos) -> Snapshot {
        let reasons: Vec<(&'static str, u64)> = (0..reason::COUNT)
            .map(|r| {
                (
                    reason::NAMES[r as usize],
                    self.kernel.counters.reason_total(r),
                )
            })
            .collect();
        let events_lost = reasons[reason::EVENT_LOST as usize].1;
        Snapshot {
            backends: self.backend_metrics(now),
            reasons,
            events_lost,
            events_received: self.events_received,
            publish_times: self.kernel.publisher.times.clone(),
            score_times: self.kernel.publisher.scores.times.clone(),
            tick_times: self.tick_times.clone(),
            vips_in_panic: self.fleet.vips.iter().filter(|v| v.panic).count() as u64,
            flows_evicted: self.flows_evicted,
            flow_entries: self.flow_entries,
            flow_table_size: u64::from(self.flow_table_size),
            discovery: self.discovery_metrics(),
            control_errors: self.errors.totals(),
            config_generation: self.config_generation,
            score_syscalls: self.kernel.publisher.scores.syscalls,
            process: ProcessStats::read(),
        }
    }

    fn backend_metrics(&self, now: Nanos) -> Vec<BackendMetrics> {
        let mut backends = Vec::new();
        let tallies: HashMap<u32, _> = self.loads.tallies().collect();
        let scores: HashMap<u32, _> = self.loads.scores(now).collect();
        for vip in &self.fleet.vips {
            for &id in &vip.members {
                let Some(m) = self.fleet.member(id) else {
                    continue;
                };
                let counters = self.kernel.counters.backend(id);
                let score = scores.get(&id).copied().unwrap_or_default();
                let (passed, failed) = self.checks.get(&id).copied().unwrap_or_default();
                backends.push(BackendMetrics {
                    vip: vip.addr.to_string(),
                    backend: m.addr.to_string(),
                    opened: counters.conns.opened,
                    closed: counters.conns.closed,
                    active: counters.conns.inflight(counters.correction),
                    refused: tallies.get(&id).map_or(0, |t| t.refused),
                    bytes_to_backend: counters.sum(|s: &BackendStats| s.bytes_to_backend),
                    bytes_from_backend: counters.sum(|s: &BackendStats| s.bytes_from_backend),
                    ewma_seconds: score.ewma_ns as f64 / 1e9,
                    score: score.cost,
                    effective_weight: f64::from(score.weight) / f64::from(WEIGHT_UNITS),
                    state: Some(m.life.state(now)),
                    ejections: m.life.ejections_total,
                    outlier_failures: m.outlier.failures_total,
                    health_passed: passed,
                    health_failed: failed,
                });
            }
        }
        backends
    }
}
