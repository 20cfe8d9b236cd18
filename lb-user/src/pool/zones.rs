//! Zone-aware routing: how a VIP's new connections are split between the
//! zones of its backends. Pure: the runtime feeds it every tick and writes
//! the result as the VIP's zone blocks (`lb_common::VipZones`), and the
//! kernel draws a block per new connection, then runs the VIP's algorithm
//! inside it.
//!
//! The rule combines three classic ones:
//! - **Envoy's zone-aware routing and priority spill**: the local zone takes
//!   what it can carry and only the rest leaves it. A zone's *capacity* is
//!   `min(1, healthy / min_healthy)`, where `healthy` is the share of its
//!   configured weight that is selectable now, at its effective weight (so a
//!   backend in slow start counts for what it carries, and a recovering zone
//!   takes its traffic back as its backends warm up). With the default 70%,
//!   a zone with 4 of 5 equal backends still takes everything; with 2 of 5
//!   it takes 40/70 = 57% and the other 43% spills.
//! - **Ribbon's ZoneAvoidanceRule**: a zone whose median latency estimate
//!   is `avoid_factor` or more times the best other zone's carries only
//!   `avoid_factor / ratio` of what it could (10× slower with the default
//!   3: 30%). A backend's latency here is the mean its users measured over
//!   the last half second or so (`LatencyEstimate::recent_mean_ns`), not P2C's
//!   peak-sensitive estimate: a busy local zone keeps the worst of hundreds
//!   of responses in its peaks and a probed failover zone the worst of a
//!   few, so equally fast zones would look several times apart. Weights
//!   rank backends inside a zone, not zones, and an in-flight term would
//!   fall as traffic leaves and pull it back, so neither counts.
//! - **Istio's ordered failover**: the local zone first, then the zones of
//!   `--zone-failover` in that order, then every other zone by latency,
//!   cheapest first (backends without a zone are one more such group). Each
//!   takes what is left, up to its own capacity; if the zones together
//!   cannot carry everything, the shares are scaled up in proportion.
//!
//! If no zone has a selectable backend, the VIP uses every backend: the
//! zone panic ([`Spill::Panic`]), as in Envoy's panic threshold.
//!
//! Latency is compared only where it was measured: a zone whose backends
//! have no recent sample has no median and is never the "best other".
//! So that the first failover zone stays measured while the local zone
//! takes everything, it keeps a probe share of [`PROBE_SHARE`] (1.2%) of
//! new connections: the price of knowing when to leave.
use std::fmt;

use lb_common::{MAX_ZONES, ZONE_SHARE_SCALE};

use crate::settings::zone::{ZoneName, ZoneSettings};

/// Shares are written in steps of this many units of `ZONE_SHARE_SCALE`
/// (1/256), so estimate jitter does not rewrite the kernel's descriptor at
/// every tick.
const SHARE_STEP: u32 = ZONE_SHARE_SCALE / 256;
/// What the first failover zone gets while the local zone could take
/// everything: 3 steps, 1.17% of new connections.
pub const PROBE_SHARE: u32 = 3 * SHARE_STEP;

/// One member of a zone-aware VIP as the planner sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ZoneMember {
    pub id: u32,
    pub zone: Option<ZoneName>,
    /// In the VIP's selection now.
    pub selectable: bool,
    /// Effective weight now (0 when not selectable).
    pub weight: u32,
    /// Configured weight, in the same units.
    pub full_weight: u32,
    /// Recent mean latency (ns), if it rests on recent samples: an unused
    /// backend's old figure must not make its zone look fast or slow.
    pub ewma_ns: Option<u64>,
}

/// The VIP's routing state, logged when it changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spill {
    /// Every new connection stays in the local zone.
    Local,
    /// Part (or all) of the traffic leaves the local zone.
    Spilling,
    /// No zone has a selectable backend: every backend serves.
    Panic,
}

impl Spill {
    pub const fn name(self) -> &'static str {
        match self {
            Self::Local => "local",
            Self::Spilling => "spilling",
            Self::Panic => "panic",
        }
    }

    /// The value of the `lb_zone_spill` gauge.
    pub const fn gauge(self) -> i64 {
        match self {
            Self::Local => 0,
            Self::Spilling => 1,
            Self::Panic => 2,
        }
    }
}

/// One block of the VIP's slot block: a zone (or, past `MAX_ZONES - 1`
/// zones, the rest lumped together) with its share of new connections.
#[derive(Clone, Debug, PartialEq)]
pub struct ZoneBlockPlan {
    /// The zones of the block: one, except for a last block that lumps the
    /// rest. `None` stands for backends without a zone.
    pub zones: Vec<Option<ZoneName>>,
    /// Selectable backend ids, in the order they were given.
    pub slots: Vec<u32>,
    /// Share of new connections, out of `ZONE_SHARE_SCALE`.
    pub share: u32,
    /// Members (selectable or not) and selectable ones.
    pub members: usize,
    pub active: usize,
    /// Selectable share of the configured weight, 0..=1.
    pub healthy: f64,
    /// Median recent mean latency of the selectable backends (0: none).
    pub median_ewma_ns: u64,
}

impl ZoneBlockPlan {
    /// The block's name for logs, metrics and status: the zone, `-` for
    /// backends without one, and `a+b` for a lumped block.
    pub fn label(&self) -> String {
        let names: Vec<String> = self.zones.iter().map(|z| zone_label(*z)).collect();
        names.join("+")
    }
}

pub fn zone_label(zone: Option<ZoneName>) -> String {
    zone.map_or_else(|| "-".to_string(), |z| z.to_string())
}

/// What one tick decided for a zone-aware VIP.
#[derive(Clone, Debug, PartialEq)]
pub struct ZonePlan {
    /// Failover order, local zone first. Empty on [`Spill::Panic`].
    pub blocks: Vec<ZoneBlockPlan>,
    pub spill: Spill,
    /// Why the traffic leaves the local zone (empty when it does not).
    pub reason: String,
}

impl ZonePlan {
    /// The local zone's share of new connections, 0..=1.
    pub fn local_share(&self) -> f64 {
        self.blocks
            .first()
            .map_or(0.0, |b| f64::from(b.share) / f64::from(ZONE_SHARE_SCALE))
    }
}

/// One zone's figures while planning.
struct Group {
    zone: Option<ZoneName>,
    slots: Vec<u32>,
    members: usize,
    weight: u64,
    full_weight: u64,
    ewmas: Vec<u64>,
}

impl Group {
    fn healthy(&self) -> f64 {
        if self.full_weight == 0 {
            return 0.0;
        }
        (self.weight as f64 / self.full_weight as f64).min(1.0)
    }

    fn median(&self) -> u64 {
        let mut v = self.ewmas.clone();
        v.sort_unstable();
        v.get(v.len() / 2).copied().unwrap_or(0)
    }
}

/// Plans VIP's zone blocks from its `members` (every member not removed,
/// in slot order). `local` is the balancer's zone.
pub fn plan(local: ZoneName, settings: &ZoneSettings, members: &[ZoneMember]) -> ZonePlan {
    let mut groups: Vec<Group> = Vec::new();
    for m in members {
        let index = match groups.iter().position(|g| g.zone == m.zone) {
            Some(i) => i,
            None => {
                groups.push(Group {
                    zone: m.zone,
                    slots: Vec::new(),
                    members: 0,
                    weight: 0,
                    full_weight: 0,
                    ewmas: Vec::new(),
                });
                groups.len() - 1
            }
        };
        let g = &mut groups[index];
        g.members += 1;
        g.full_weight += u64::from(m.full_weight);
        if m.selectable {
            g.slots.push(m.id);
            g.weight += u64::from(m.weight);
            g.ewmas.extend(m.ewma_ns);
        }
    }
    if groups.iter().all(|g| g.slots.is_empty()) {
        return ZonePlan {
            blocks: Vec::new(),
            spill: Spill::Panic,
            reason: "no zone has a selectable backend: every backend serves".to_string(),
        };
    }
    if !groups.iter().any(|g| g.zone == Some(local)) {
        groups.push(Group {
            zone: Some(local),
            slots: Vec::new(),
            members: 0,
            weight: 0,
            full_weight: 0,
            ewmas: Vec::new(),
        });
    }
    order(&mut groups, local, &settings.failover);
    let medians: Vec<u64> = groups.iter().map(Group::median).collect();
    let capacity: Vec<f64> = groups
        .iter()
        .enumerate()
        .map(|(i, g)| {
            if g.slots.is_empty() {
                return 0.0;
            }
            let health = (g.healthy() / settings.min_healthy).min(1.0);
            health * load_share(i, &medians, &groups, settings.avoid_factor)
        })
        .collect();
    let mut shares = spill(&capacity);
    let reason = reason(&groups[0], capacity[0], &medians, &groups, settings);
    let spill = if shares[0] >= 1.0 - 1e-9 {
        Spill::Local
    } else {
        Spill::Spilling
    };
    if spill == Spill::Local
        && let Some(probe) = (1..groups.len()).find(|&i| !groups[i].slots.is_empty())
    {
        let p = f64::from(PROBE_SHARE) / f64::from(ZONE_SHARE_SCALE);
        shares[0] -= p;
        shares[probe] += p;
    }
    let blocks = to_blocks(groups, &shares, &medians);
    ZonePlan {
        blocks,
        spill,
        reason: if spill == Spill::Local {
            String::new()
        } else {
            reason
        },
    }
}

/// Local zone first, then the listed failover zones, then the rest by
/// median latency (zones with no selectable backend last), then by name.
fn order(groups: &mut [Group], local: ZoneName, failover: &[ZoneName]) {
    let rank = |g: &Group| -> (u8, usize, u64, Option<ZoneName>) {
        if g.zone == Some(local) {
            return (0, 0, 0, g.zone);
        }
        if let Some(pos) = g.zone.and_then(|z| failover.iter().position(|f| *f == z)) {
            return (1, pos, 0, g.zone);
        }
        // Measured zones by latency, then unmeasured ones, then empty ones.
        let median = match (g.slots.is_empty(), g.median()) {
            (true, _) => u64::MAX,
            (false, 0) => u64::MAX - 1,
            (false, m) => m,
        };
        (2, 0, median, g.zone)
    };
    groups.sort_by_key(|g| rank(g));
}

/// `min(1, factor / ratio)` where `ratio` is the zone's median latency over
/// the best other zone's (1 when there is nothing to compare with).
fn load_share(index: usize, medians: &[u64], groups: &[Group], factor: f64) -> f64 {
    let own = medians[index];
    let best_other = medians
        .iter()
        .enumerate()
        .filter(|&(i, &m)| i != index && m > 0 && !groups[i].slots.is_empty())
        .map(|(_, &m)| m)
        .min();
    match best_other {
        Some(best) if own > 0 => {
            let ratio = own as f64 / best as f64;
            if ratio >= factor { factor / ratio } else { 1.0 }
        }
        _ => 1.0,
    }
}

/// Each zone in order takes what is left, up to its capacity; what no zone
/// can take is spread over them in proportion to what they took.
fn spill(capacity: &[f64]) -> Vec<f64> {
    let mut left = 1.0f64;
    let mut shares: Vec<f64> = capacity
        .iter()
        .map(|&c| {
            let take = c.clamp(0.0, 1.0).min(left);
            left -= take;
            take
        })
        .collect();
    let total: f64 = shares.iter().sum();
    if left > 1e-9 && total > 0.0 {
        for s in &mut shares {
            *s /= total;
        }
    }
    shares
}

/// Why the local zone does not keep all of its traffic.
fn reason(
    local: &Group,
    capacity: f64,
    medians: &[u64],
    groups: &[Group],
    settings: &ZoneSettings,
) -> String {
    let name = zone_label(local.zone);
    if local.slots.is_empty() {
        return if local.members == 0 {
            format!("no backend in local zone {name}")
        } else {
            format!(
                "local zone {name}: 0 of {} backends selectable",
                local.members
            )
        };
    }
    let mut why = Vec::new();
    let healthy = local.healthy();
    if healthy < settings.min_healthy {
        why.push(format!(
            "local zone {name}: {} of {} backends selectable, {:.0}% of its weight (< {:.0}%)",
            local.slots.len(),
            local.members,
            healthy * 100.0,
            settings.min_healthy * 100.0
        ));
    }
    let best_other = medians
        .iter()
        .enumerate()
        .skip(1)
        .filter(|&(i, &m)| m > 0 && !groups[i].slots.is_empty())
        .map(|(_, &m)| m)
        .min();
    if let Some(best) = best_other
        && medians[0] > 0
    {
        let ratio = medians[0] as f64 / best as f64;
        if ratio >= settings.avoid_factor {
            why.push(format!(
                "local zone {name}: median latency {:.1}× the best other zone's (≥ {}×)",
                ratio, settings.avoid_factor
            ));
        }
    }
    if why.is_empty() {
        why.push(format!(
            "local zone {name} carries {:.0}%",
            capacity * 100.0
        ));
    }
    why.join("; ")
}

/// The groups as at most `MAX_ZONES` blocks with integer shares that add
/// up to `ZONE_SHARE_SCALE`.
fn to_blocks(groups: Vec<Group>, shares: &[f64], medians: &[u64]) -> Vec<ZoneBlockPlan> {
    let mut blocks: Vec<ZoneBlockPlan> = Vec::new();
    let mut raw: Vec<f64> = Vec::new();
    for ((g, &share), &median) in groups.into_iter().zip(shares).zip(medians) {
        let healthy = g.healthy();
        if blocks.len() == MAX_ZONES as usize {
            let last = blocks.last_mut().expect("MAX_ZONES > 0");
            last.zones.push(g.zone);
            last.slots.extend(g.slots);
            last.members += g.members;
            last.active = last.slots.len();
            *raw.last_mut().expect("one per block") += share;
            continue;
        }
        blocks.push(ZoneBlockPlan {
            zones: vec![g.zone],
            active: g.slots.len(),
            slots: g.slots,
            share: 0,
            members: g.members,
            healthy,
            median_ewma_ns: median,
        });
        raw.push(share);
    }
    // Cumulative rounding to steps keeps the total exact.
    let mut cum = 0.0f64;
    let mut given = 0u32;
    for (b, s) in blocks.iter_mut().zip(&raw) {
        cum += s;
        let through = quantize(cum);
        b.share = through.saturating_sub(given);
        given = through;
    }
    if let Some(last_with_slots) = blocks.iter_mut().rev().find(|b| b.share > 0) {
        last_with_slots.share += ZONE_SHARE_SCALE.saturating_sub(given);
    }
    blocks
}

fn quantize(fraction: f64) -> u32 {
    let units = (fraction.clamp(0.0, 1.0) * f64::from(ZONE_SHARE_SCALE)).round() as u32;
    let stepped = (units + SHARE_STEP / 2) / SHARE_STEP * SHARE_STEP;
    stepped.min(ZONE_SHARE_SCALE)
}

impl fmt::Display for ZonePlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self
            .blocks
            .iter()
            .map(|b| {
                format!(
                    "{} {:.1}%",
                    b.label(),
                    f64::from(b.share) * 100.0 / f64::from(ZONE_SHARE_SCALE)
                )
            })
            .collect();
        write!(f, "{}", parts.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn z(name: &str) -> Option<ZoneName> {
        Some(name.parse().unwrap())
    }

    fn settings() -> ZoneSettings {
        ZoneSettings {
            local: z("a"),
            ..ZoneSettings::default()
        }
    }

    /// `up` selectable backends of `n` in `zone`, ids from `first`, each
    /// weight 100 and latency `ewma_ms`.
    fn zone(zone: &str, first: u32, n: u32, up: u32, ewma_ms: u64) -> Vec<ZoneMember> {
        (0..n)
            .map(|i| ZoneMember {
                id: first + i,
                zone: z(zone),
                selectable: i < up,
                weight: if i < up { 100 } else { 0 },
                full_weight: 100,
                ewma_ns: Some(ewma_ms * 1_000_000),
            })
            .collect()
    }

    fn shares(p: &ZonePlan) -> Vec<(String, f64)> {
        p.blocks
            .iter()
            .map(|b| {
                (
                    b.label(),
                    (f64::from(b.share) / f64::from(ZONE_SHARE_SCALE) * 1000.0).round() / 1000.0,
                )
            })
            .collect()
    }

    fn local() -> ZoneName {
        "a".parse().unwrap()
    }

    #[test]
    fn a_healthy_local_zone_takes_everything() {
        let members = [zone("b", 5, 5, 5, 1), zone("a", 0, 5, 5, 1)].concat();
        let p = plan(local(), &settings(), &members);
        assert_eq!(p.spill, Spill::Local);
        assert_eq!(shares(&p), [("a".into(), 0.988), ("b".into(), 0.012)]);
        assert_eq!(p.blocks[0].slots, [0, 1, 2, 3, 4]);
        assert_eq!(p.blocks[1].slots, [5, 6, 7, 8, 9]);
        assert!(p.reason.is_empty());
    }

    #[test]
    fn the_first_failover_zone_keeps_a_probe_share_while_local_takes_everything() {
        let members = [
            zone("a", 0, 5, 5, 1),
            zone("b", 5, 5, 5, 1),
            zone("c", 10, 5, 5, 1),
        ]
        .concat();
        let p = plan(local(), &settings(), &members);
        assert_eq!(p.spill, Spill::Local);
        let got: Vec<u32> = p.blocks.iter().map(|b| b.share).collect();
        assert_eq!(got, [ZONE_SHARE_SCALE - PROBE_SHARE, PROBE_SHARE, 0]);
        // While spilling there is no probe on top.
        let members = [zone("a", 0, 5, 2, 1), zone("b", 5, 5, 5, 1)].concat();
        let p = plan(local(), &settings(), &members);
        assert!(p.blocks[1].share > PROBE_SHARE * 10);
    }

    #[test]
    fn unmeasured_zones_are_not_compared() {
        // Zone b idle: its estimate would be the optimistic cold start.
        let mut members = [zone("a", 0, 5, 5, 10), zone("b", 5, 5, 5, 1)].concat();
        for m in &mut members[5..] {
            m.ewma_ns = None;
        }
        let p = plan(local(), &settings(), &members);
        assert_eq!(p.spill, Spill::Local, "{p:?}");
        // Measured and 10× faster: avoided.
        for m in &mut members[5..] {
            m.ewma_ns = Some(1_000_000);
        }
        assert_eq!(plan(local(), &settings(), &members).spill, Spill::Spilling);
        // Some of b measured: its median is over those.
        for m in &mut members[5..8] {
            m.ewma_ns = None;
        }
        assert_eq!(plan(local(), &settings(), &members).spill, Spill::Spilling);
    }

    #[test]
    fn one_down_of_five_is_still_healthy_at_seventy_percent() {
        let members = [zone("a", 0, 5, 4, 1), zone("b", 5, 5, 5, 1)].concat();
        assert_eq!(plan(local(), &settings(), &members).spill, Spill::Local);
    }

    #[test]
    fn an_unhealthy_local_zone_spills_only_what_it_cannot_carry() {
        let members = [zone("a", 0, 5, 2, 1), zone("b", 5, 5, 5, 1)].concat();
        let p = plan(local(), &settings(), &members);
        assert_eq!(p.spill, Spill::Spilling);
        let s = shares(&p);
        // 40% healthy / 70% = 57.1% stays.
        assert!((s[0].1 - 0.571).abs() < 0.005, "{s:?}");
        assert!((s[1].1 - 0.429).abs() < 0.005, "{s:?}");
        assert!(p.reason.contains("2 of 5"), "{}", p.reason);
        assert!(p.reason.contains("< 70%"), "{}", p.reason);
    }

    #[test]
    fn a_slow_local_zone_keeps_factor_over_ratio() {
        let members = [zone("a", 0, 5, 5, 10), zone("b", 5, 5, 5, 1)].concat();
        let p = plan(local(), &settings(), &members);
        let s = shares(&p);
        assert!((s[0].1 - 0.3).abs() < 0.005, "{s:?}");
        assert!(p.reason.contains("10.0×"), "{}", p.reason);
        // Just under the factor: no avoidance at all.
        let members = [zone("a", 0, 5, 5, 29), zone("b", 5, 5, 5, 10)].concat();
        assert_eq!(plan(local(), &settings(), &members).spill, Spill::Local);
    }

    #[test]
    fn slow_start_counts_at_the_effective_weight() {
        let mut members = [zone("a", 0, 5, 5, 1), zone("b", 5, 5, 5, 1)].concat();
        // Three of zone a's backends are back at 10% of their weight.
        for m in &mut members[..3] {
            m.weight = 10;
        }
        let s = shares(&plan(local(), &settings(), &members));
        // (3 × 10 + 2 × 100) / 500 = 46% healthy → 65.7% stays.
        assert!((s[0].1 - 0.657).abs() < 0.005, "{s:?}");
        for m in &mut members[..3] {
            m.weight = 100;
        }
        assert_eq!(plan(local(), &settings(), &members).spill, Spill::Local);
    }

    #[test]
    fn failover_order_is_followed_then_cost() {
        let members = [
            zone("a", 0, 2, 0, 1),
            zone("b", 2, 2, 2, 25),
            zone("c", 4, 2, 2, 10),
            zone("d", 6, 2, 2, 20),
        ]
        .concat();
        // By cost: c (10 ms) before d (20 ms) before b (25 ms).
        let p = plan(local(), &settings(), &members);
        let labels: Vec<String> = p.blocks.iter().map(ZoneBlockPlan::label).collect();
        assert_eq!(labels, ["a", "c", "d", "b"]);
        assert_eq!(shares(&p)[1].1, 1.0);
        assert!(p.reason.contains("0 of 2"), "{}", p.reason);
        let s = ZoneSettings {
            failover: vec!["b".parse().unwrap(), "d".parse().unwrap()],
            ..settings()
        };
        let p = plan(local(), &s, &members);
        let labels: Vec<String> = p.blocks.iter().map(ZoneBlockPlan::label).collect();
        assert_eq!(labels, ["a", "b", "d", "c"]);
        assert_eq!(
            shares(&p),
            [
                ("a".into(), 0.0),
                ("b".into(), 1.0),
                ("d".into(), 0.0),
                ("c".into(), 0.0)
            ]
        );
        // Avoidance applies to failover zones too: b at 5× c's latency
        // carries 3/5 of it, and d (2×) takes the rest.
        let mut slow_b = members.clone();
        for m in &mut slow_b[2..4] {
            m.ewma_ns = Some(50_000_000);
        }
        let got = shares(&plan(local(), &s, &slow_b));
        assert!((got[1].1 - 0.6).abs() < 0.005, "{got:?}");
        assert!((got[2].1 - 0.4).abs() < 0.005, "{got:?}");
    }

    #[test]
    fn a_sick_failover_zone_passes_the_rest_on() {
        let members = [
            zone("a", 0, 5, 0, 1),
            zone("b", 5, 5, 2, 1),
            zone("c", 10, 5, 5, 1),
        ]
        .concat();
        let s = ZoneSettings {
            failover: vec!["b".parse().unwrap(), "c".parse().unwrap()],
            ..settings()
        };
        let got = shares(&plan(local(), &s, &members));
        assert!((got[1].1 - 0.571).abs() < 0.005, "{got:?}");
        assert!((got[2].1 - 0.429).abs() < 0.005, "{got:?}");
    }

    #[test]
    fn zones_that_cannot_carry_everything_are_scaled_up() {
        let members = [zone("a", 0, 10, 2, 1), zone("b", 10, 10, 1, 1)].concat();
        let got = shares(&plan(local(), &settings(), &members));
        // Capacities 0.286 and 0.143: scaled to 2/3 and 1/3.
        assert!((got[0].1 - 0.667).abs() < 0.005, "{got:?}");
        assert!((got[1].1 - 0.333).abs() < 0.005, "{got:?}");
    }

    #[test]
    fn no_selectable_backend_anywhere_is_the_zone_panic() {
        let members = [zone("a", 0, 3, 0, 1), zone("b", 3, 3, 0, 1)].concat();
        let p = plan(local(), &settings(), &members);
        assert_eq!(p.spill, Spill::Panic);
        assert!(p.blocks.is_empty());
    }

    #[test]
    fn backends_without_a_zone_are_a_group_of_their_own() {
        let mut members = zone("a", 0, 2, 0, 1);
        members.extend((2..4).map(|id| ZoneMember {
            id,
            zone: None,
            selectable: true,
            weight: 100,
            full_weight: 100,
            ewma_ns: Some(1_000_000),
        }));
        let p = plan(local(), &settings(), &members);
        assert_eq!(p.blocks[1].label(), "-");
        assert_eq!(p.blocks[1].slots, [2, 3]);
        assert_eq!(shares(&p)[1].1, 1.0);
        // No local backend at all.
        let p = plan(local(), &settings(), &members[2..]);
        assert_eq!(p.blocks[0].label(), "a");
        assert!(p.blocks[0].slots.is_empty());
        assert_eq!(p.reason, "no backend in local zone a");
    }

    #[test]
    fn more_zones_than_blocks_lump_the_rest_into_the_last() {
        let names = ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j"];
        let members: Vec<ZoneMember> = names
            .iter()
            .enumerate()
            .flat_map(|(i, n)| zone(n, i as u32 * 2, 2, 2, 1 + i as u64))
            .collect();
        let p = plan(local(), &settings(), &members);
        assert_eq!(p.blocks.len(), MAX_ZONES as usize);
        assert_eq!(p.blocks[7].label(), "h+i+j");
        assert_eq!(p.blocks[7].slots.len(), 6);
        let total: u32 = p.blocks.iter().map(|b| b.share).sum();
        assert_eq!(total, ZONE_SHARE_SCALE);
    }

    #[test]
    fn shares_always_add_up_and_move_in_steps() {
        for up in 0..=5 {
            for slow in [1, 2, 3, 4, 7, 10, 30] {
                let members = [
                    zone("a", 0, 5, up, slow),
                    zone("b", 5, 5, 3, 1),
                    zone("c", 10, 3, 3, 2),
                ]
                .concat();
                let p = plan(local(), &settings(), &members);
                let total: u32 = p.blocks.iter().map(|b| b.share).sum();
                assert_eq!(total, ZONE_SHARE_SCALE, "up {up} slow {slow}");
                for b in &p.blocks {
                    assert_eq!(b.share % SHARE_STEP, 0, "shares move in steps: {p:?}");
                    if b.slots.is_empty() {
                        assert_eq!(b.share, 0, "an empty block gets nothing: {p:?}");
                    }
                }
            }
        }
    }
}
