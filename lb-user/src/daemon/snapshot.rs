//! The metrics of the running state at one moment (a scrape).

use std::collections::HashMap;

use lb_common::{BackendStats, reason};

use super::runtime::Runtime;
use crate::{
    estimate::WEIGHT_UNITS,
    kernel::{clock::Nanos, maps::BackendCounters},
    pool::zones::zone_label,
    settings::zone::ZoneName,
    surface::{
        metrics::{BackendMetrics, ProcessStats, Snapshot, VipZoneMetrics, ZoneMetrics},
        status::{snat_held_by_address, snat_tuples},
    },
};

impl Runtime {
    /// The metrics of this moment.
    pub fn snapshot(&mut self, now: Nanos) -> Snapshot {
        let reasons: Vec<(&'static str, u64)> = (0..reason::COUNT)
            .map(|r| {
                (
                    reason::NAMES[r as usize],
                    self.kernel.counters.reason_total(r),
                )
            })
            .collect();
        let events_lost = reasons[reason::EVENT_LOST as usize].1;
        // Every member's counters, read once per id: a backend in several
        // VIPs, and the zone metrics' members, use the same read.
        let counters: HashMap<u32, BackendCounters> = self
            .fleet
            .vips
            .iter()
            .flat_map(|vip| vip.members.iter())
            .map(|&id| (id, self.kernel.counters.backend(id)))
            .collect();
        Snapshot {
            backends: self.backend_metrics(now, &counters),
            reasons,
            events_lost,
            events_received: self.events_received,
            latency_reads: self.latency_reads,
            latency_outage_skips: self.latency_outage_skips,
            latency_probes: vec![
                ("applied", self.probes.applied),
                ("busy", self.probes.busy),
                ("unchanged", self.probes.unchanged),
                ("barred", self.probes.barred),
            ],
            publish_times: self.kernel.publisher.times.clone(),
            score_times: self.kernel.publisher.scores.times.clone(),
            tick_times: self.tick_times.clone(),
            reconcile_times: self.reconcile_times.clone(),
            vips_in_panic: self.fleet.vips.iter().filter(|v| v.panic).count() as u64,
            zones: self.zone_metrics(&counters),
            zone_vips: self
                .fleet
                .zone_aware_vips()
                .map(|v| VipZoneMetrics {
                    vip: v.addr.to_string(),
                    spill: v.zone_plan.as_ref().map_or(0, |p| p.spill.gauge()),
                    panics: v.zone_panics,
                })
                .collect(),
            flows_evicted: self.flows_evicted,
            flow_entries: self.flow_entries,
            reconcile_interval: self.reconcile_interval,
            flow_table_capacity: self.kernel.flow_tables,
            discovery: self.discovery_metrics(),
            control_errors: self.errors.totals(),
            config_generation: self.config_generation,
            score_syscalls: self.kernel.publisher.scores.syscalls,
            process: ProcessStats::read(),
        }
    }

    /// Every zone of every zone-aware VIP: its members, the selectable
    /// ones, its planned share and the connections its backends opened.
    fn zone_metrics(&mut self, counters: &HashMap<u32, BackendCounters>) -> Vec<ZoneMetrics> {
        let mut out = Vec::new();
        let opened = &mut self.zone_opened;
        for vip in self.fleet.zone_aware_vips() {
            let Some(plan) = &vip.zone_plan else {
                continue;
            };
            let members: Vec<(u32, Option<ZoneName>)> = vip
                .members
                .iter()
                .filter_map(|&id| Some((id, self.fleet.member(id)?.zone)))
                .collect();
            let mut zones: Vec<Option<ZoneName>> = members.iter().map(|(_, z)| *z).collect();
            zones.sort();
            zones.dedup();
            for zone in zones {
                let block = plan.blocks.iter().find(|b| b.zones.contains(&zone));
                let ids: Vec<u32> = members
                    .iter()
                    .filter(|(_, z)| *z == zone)
                    .map(|(id, _)| *id)
                    .collect();
                out.push(ZoneMetrics {
                    vip: vip.addr.to_string(),
                    zone: zone_label(zone),
                    backends: ids.len() as u64,
                    active: block.map_or(0, |b| {
                        ids.iter().filter(|id| b.slots.contains(id)).count() as u64
                    }),
                    // A lumped block's share is the block's, shown on each of its zones.
                    share: block.map_or(0.0, |b| {
                        f64::from(b.share) / f64::from(lb_common::ZONE_SHARE_SCALE)
                    }),
                    new_connections: {
                        let key = (vip.addr.to_string(), zone);
                        for &id in &ids {
                            let count = counters.get(&id).map_or(0, |c| c.conns.opened);
                            let addr = self.fleet.member(id).map(|m| m.addr);
                            opened.observe((id, addr), &key, count);
                        }
                        opened.total(&key)
                    },
                });
            }
        }
        let fleet = &self.fleet;
        opened.end_scrape(|id, addr| fleet.member(id).map(|m| m.addr) != addr);
        out
    }

    /// Each member's metrics, from `counters` (read for this scrape).
    fn backend_metrics(
        &self,
        now: Nanos,
        counters: &HashMap<u32, BackendCounters>,
    ) -> Vec<BackendMetrics> {
        let mut backends = Vec::new();
        let tallies: HashMap<u32, _> = self.loads.tallies().collect();
        let scores: HashMap<u32, _> = self.loads.scores(now).collect();
        let config = self.kernel.counters.config().unwrap_or_default();
        // A reply key holds the protocol too: TCP and UDP tuples are apart.
        let held = snat_held_by_address(self.fleet.vips.iter().flat_map(|vip| {
            vip.members.iter().filter_map(|id| {
                let used = counters.get(id)?.snat_used;
                Some(((vip.addr.protocol, self.fleet.member(*id)?.addr), used))
            })
        }));
        for vip in &self.fleet.vips {
            for &id in &vip.members {
                let Some(m) = self.fleet.member(id) else {
                    continue;
                };
                let Some(counters) = counters.get(&id) else {
                    continue;
                };
                let family = if m.addr.is_ipv6() {
                    lb_common::AF_INET6
                } else {
                    lb_common::AF_INET
                };
                let held_by_address = held
                    .get(&(vip.addr.protocol, m.addr))
                    .copied()
                    .unwrap_or(counters.snat_used);
                let score = scores.get(&id).copied().unwrap_or_default();
                let checks = self.checks.get(&id).copied().unwrap_or_default();
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
                    health_passed: checks.passed,
                    health_failed: checks.failed,
                    health_busy: checks.busy,
                    snat_tuples_held: counters.snat_used,
                    snat_tuples_free: snat_tuples(&config, family).saturating_sub(held_by_address),
                });
            }
        }
        backends
    }
}
