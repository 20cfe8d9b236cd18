//! The weight-derived tables some algorithms need next to a VIP's slot
//! block (see `lb_common::VipTables`): the smooth-WRR schedule, the running
//! weight sums of weighted random, and the Maglev lookup table.
//!
//! Each is a pure function of the VIP's slot backends and their effective
//! weights, so whoever changes either (reconfiguration, slow start, drain)
//! builds them again with the new values and gets the same tables a fresh
//! start would; `publish::writers::TableWriter` writes them.

use lb_common::{
    Algorithm, Backend, BackendScore, MAGLEV_TABLE_SIZE, SCORE_FAR_ABOVE, WRR_SCHEDULE_LEN,
    p2c::unweighted_cost,
};

use super::{maglev, prefix, smooth_wrr};
use crate::pool::plan::PlannedVip;

/// One slot of a VIP as the table builders see it.
#[derive(Clone, Copy, Debug)]
pub struct SlotBackend {
    pub id: u32,
    pub weight: u32,
    /// The backend's address words and port, its identity for Maglev.
    pub key: [u8; 18],
}

impl SlotBackend {
    pub fn new(id: u32, backend: &Backend, weight: u32) -> Self {
        let mut key = [0u8; 18];
        for (chunk, word) in key.chunks_exact_mut(4).zip(backend.addr) {
            chunk.copy_from_slice(&word.to_ne_bytes());
        }
        key[16..].copy_from_slice(&backend.port.to_ne_bytes());
        Self { id, weight, key }
    }
}

/// The tables of one VIP; only its algorithm's table is non-empty.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VipTableSet {
    /// Slot indexes in smooth-WRR order.
    pub schedule: Vec<u32>,
    /// Running weight sums, one per slot.
    pub prefix: Vec<u32>,
    /// `MAGLEV_TABLE_SIZE` backend ids.
    pub maglev: Vec<u32>,
}

impl VipTableSet {
    pub fn build(algorithm: Algorithm, slots: &[SlotBackend]) -> Self {
        let weights = table_weights(&slots.iter().map(|s| s.weight).collect::<Vec<_>>());
        match algorithm {
            Algorithm::WeightedRoundRobin => Self {
                schedule: smooth_wrr::schedule(&weights, WRR_SCHEDULE_LEN as usize),
                ..Self::default()
            },
            Algorithm::Random => Self {
                prefix: prefix::running_sums(&weights),
                ..Self::default()
            },
            Algorithm::Maglev => {
                let members: Vec<_> = slots
                    .iter()
                    .zip(&weights)
                    .map(|(s, &weight)| maglev::Member {
                        key: s.key,
                        value: s.id,
                        weight,
                    })
                    .collect();
                Self {
                    maglev: maglev::build(&members, MAGLEV_TABLE_SIZE),
                    ..Self::default()
                }
            }
            Algorithm::P2cEwma | Algorithm::RoundRobin | Algorithm::LeastConn => Self::default(),
        }
    }
}

/// The slots of the planned `vip` as the table builders see them, with the
/// `weights` indexed by backend id: the tables a fresh start needs before
/// the VIP is published.
pub fn planned_slots(vip: &PlannedVip, backends: &[Backend], weights: &[u32]) -> Vec<SlotBackend> {
    vip.slots
        .iter()
        .filter_map(|&id| {
            let backend = backends.get(id as usize)?;
            let weight = *weights.get(id as usize)?;
            Some(SlotBackend::new(id, backend, weight))
        })
        .collect()
}

/// Largest weight sum the tables are built from: weighted random's draw is
/// a random `u32` modulo the total, which favours the targets below
/// `2^32 mod total` by one hit in `2^32 / total`. At 2^24 that is at most
/// 1/256 of a backend's share; at 2^30, where the running sums' `u32`
/// alone would allow, it was up to a quarter (1,024 backends of weight
/// 60,000 whose divisor a ramp brought to 10: 14 % more flows to the
/// first few percent of the slots).
const MAX_WEIGHT_SUM: u64 = 1 << 24;

/// The slots' weights as the table builders take them: divided by their
/// common divisor (effective weights come in hundredths, so equal weights
/// become 1s), then scaled down if their sum would exceed
/// [`MAX_WEIGHT_SUM`], every weight staying at least 1.
pub fn table_weights(weights: &[u32]) -> Vec<u32> {
    let divisor = weights.iter().copied().fold(0, gcd).max(1);
    let reduced: Vec<u64> = weights.iter().map(|&w| u64::from(w / divisor)).collect();
    let sum: u64 = reduced.iter().sum();
    let scale = sum.div_ceil(MAX_WEIGHT_SUM).max(1);
    reduced.iter().map(|&w| (w / scale).max(1) as u32).collect()
}

fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// Where each backend id's score sits in one tick's scores, built once per
/// tick, so each group's [median](median_cost) and [holds](hold_far_above)
/// cost O(group), not O(every backend) for each VIP and zone block.
pub struct ScoreIndex(Vec<Option<u32>>);

impl ScoreIndex {
    pub fn of(scores: &[(u32, BackendScore)]) -> Self {
        // Backend ids are dense (below `lb_common::MAX_BACKENDS`).
        let len = scores
            .iter()
            .map(|(id, _)| *id as usize + 1)
            .max()
            .unwrap_or(0);
        let mut at = vec![None; len];
        for (i, (id, _)) in scores.iter().enumerate() {
            at[*id as usize] = Some(i as u32);
        }
        Self(at)
    }

    /// Where backend `id`'s score is in the slice this index was made of.
    pub fn position(&self, id: u32) -> Option<usize> {
        self.0
            .get(id as usize)
            .copied()
            .flatten()
            .map(|i| i as usize)
    }
}

/// The median of the slot backends' [unweighted
/// costs](lb_common::p2c::unweighted_cost) (their latencies in cost units;
/// the upper median for an even count), or 0 when none is known: P2C's
/// yardstick for "far above the pool", which is about speed, not weight.
/// A backend [held](hold_far_above) counts as the highest cost: it was far
/// above the median when it was held, so the median is the one its
/// estimate gave. `index` is `scores`' [`ScoreIndex`].
pub fn median_cost(slots: &[u32], scores: &[(u32, BackendScore)], index: &ScoreIndex) -> u64 {
    let mut costs: Vec<u64> = slots
        .iter()
        .filter_map(|&id| index.position(id))
        .map(|i| {
            let s = &scores[i].1;
            if s.flags & SCORE_FAR_ABOVE != 0 {
                u64::MAX
            } else {
                unweighted_cost(s.cost, s.weight)
            }
        })
        .collect();
    if costs.is_empty() {
        return 0;
    }
    costs.sort_unstable();
    costs[costs.len() / 2]
}

/// Holds the backends of `group` (the slots one P2C bound applies to: a
/// VIP's, or one zone block's) whose [unweighted
/// cost](lb_common::p2c::unweighted_cost) is far above the group's re-draw
/// bound (`lb_common::p2c::redraw_bound` of its [median](median_cost)):
/// their scores in `scores` become `held(id)` (flagged
/// [`SCORE_FAR_ABOVE`], with the cost of their mean latency), so the kernel keeps
/// them behind every backend within the bound, as before, and compares
/// them by that mean, not their peak, once the others are saturated. A
/// group without a median (nothing known yet) holds nothing. `index` is
/// `scores`' [`ScoreIndex`] (a hold replaces a score in place, so it stays
/// valid). Returns how many were held.
pub fn hold_far_above(
    group: &[u32],
    scores: &mut [(u32, BackendScore)],
    index: &ScoreIndex,
    held: impl Fn(u32) -> Option<BackendScore>,
) -> usize {
    let bound = lb_common::p2c::redraw_bound(median_cost(group, scores, index));
    if bound == 0 {
        return 0;
    }
    let mut count = 0;
    for &id in group {
        let Some(i) = index.position(id) else {
            continue;
        };
        let score = &mut scores[i].1;
        // A slot listed twice is held once: the flag is set by then.
        if score.flags & SCORE_FAR_ABOVE != 0 || unweighted_cost(score.cost, score.weight) <= bound
        {
            continue;
        }
        if let Some(h) = held(id) {
            *score = h;
            count += 1;
        }
    }
    count
}

#[cfg(test)]
mod tests {
    #[test]
    fn backends_far_above_their_group_are_held_and_the_median_stays() {
        let score = |cost| BackendScore {
            ewma_ns: cost,
            cost,
            ..BackendScore::default()
        };
        let held = |id: u32| {
            Some(BackendScore {
                ewma_ns: 30,
                cost: 30,
                flags: SCORE_FAR_ABOVE,
                updated_ns: u64::from(id),
                ..BackendScore::default()
            })
        };
        // Ten backends at 10, one at 31 (just above 3 × the median), one at
        // 30 (at the bound: not held), one at 300; id 9 outside the group.
        let mut scores: Vec<_> = [10, 10, 10, 10, 10, 10, 31, 30, 300, 1_000]
            .iter()
            .enumerate()
            .map(|(i, &c)| (i as u32, score(c)))
            .collect();
        let group: Vec<u32> = (0..9).collect();
        let index = ScoreIndex::of(&scores);
        let before = median_cost(&group, &scores, &index);
        assert_eq!(before, 10);
        assert_eq!(hold_far_above(&group, &mut scores, &index, held), 2);
        let flagged: Vec<u32> = scores
            .iter()
            .filter(|(_, s)| s.flags & SCORE_FAR_ABOVE != 0)
            .map(|(id, _)| *id)
            .collect();
        assert_eq!(flagged, [6, 8]);
        assert_eq!(scores[8].1.cost, 30, "held at what `held` gave");
        assert_eq!(scores[7].1, score(30));
        assert_eq!(scores[9].1, score(1_000), "not in the group");
        // The median the kernel's bound comes from is the one before, and
        // holding again changes nothing.
        assert_eq!(median_cost(&group, &scores, &index), before);
        assert_eq!(hold_far_above(&group, &mut scores, &index, held), 0);
        // A slot listed twice counts twice in the median, and is held once.
        let mut twice: Vec<_> = [10, 10, 300]
            .iter()
            .enumerate()
            .map(|(i, &c)| (i as u32, score(c)))
            .collect();
        let index = ScoreIndex::of(&twice);
        assert_eq!(median_cost(&[2, 2, 0, 1], &twice, &index), 300);
        assert_eq!(
            hold_far_above(&[0, 1, 2, 2, 0, 1, 0], &mut twice, &index, held),
            1
        );
        // No median yet (nothing known): nothing held.
        let mut unknown = vec![(0, score(100))];
        let index = ScoreIndex::of(&unknown);
        assert_eq!(hold_far_above(&[5], &mut unknown, &index, held), 0);
        assert_eq!(unknown[0].1, score(100));
    }

    #[test]
    fn weight_is_not_speed_for_the_median_and_the_hold() {
        // Latency 1 ms each: three of weight 4 (in weight units), one of
        // weight 1. Cost is per weight, so the light one costs 4x.
        let at = |ewma_ns: u64, weight: u32| BackendScore {
            ewma_ns,
            cost: ewma_ns * lb_common::WEIGHT_SCALE / u64::from(weight),
            weight,
            ..BackendScore::default()
        };
        let mut scores = vec![
            (0, at(1_000_000, 100)),
            (1, at(1_000_000, 400)),
            (2, at(1_000_000, 400)),
            (3, at(1_000_000, 400)),
        ];
        let index = ScoreIndex::of(&scores);
        let group = [0, 1, 2, 3];
        assert_eq!(median_cost(&group, &scores, &index), 100_000_000);
        let held = |_| {
            Some(BackendScore {
                flags: SCORE_FAR_ABOVE,
                ..BackendScore::default()
            })
        };
        assert_eq!(hold_far_above(&group, &mut scores, &index, held), 0);
        // 4x slower at weight 4 is held.
        scores[1].1 = at(4_000_000, 400);
        assert_eq!(hold_far_above(&group, &mut scores, &index, held), 1);
        assert_eq!(scores[1].1.flags, SCORE_FAR_ABOVE);
    }

    #[test]
    fn the_reference_is_the_median_cost_of_the_vips_backends() {
        let score = |cost| BackendScore {
            cost,
            ..BackendScore::default()
        };
        let scores: Vec<_> = [5, 50, 7, 6, 500]
            .iter()
            .enumerate()
            .map(|(i, &c)| (i as u32, score(c)))
            .collect();
        let index = ScoreIndex::of(&scores);
        // Two slow of five: the median stays with the fast ones.
        assert_eq!(median_cost(&[0, 1, 2, 3, 4], &scores, &index), 7);
        assert_eq!(median_cost(&[1, 4], &scores, &index), 500);
        assert_eq!(median_cost(&[9], &scores, &index), 0);
        // Scores in any order, ids with gaps.
        let scattered = vec![(7, score(40)), (2, score(20)), (30, score(10))];
        let index = ScoreIndex::of(&scattered);
        assert_eq!(median_cost(&[30, 2, 7], &scattered, &index), 20);
        assert_eq!(median_cost(&[7, 5, 31], &scattered, &index), 40);
    }

    use super::*;

    fn slots(weights: &[u32]) -> Vec<SlotBackend> {
        weights
            .iter()
            .enumerate()
            .map(|(i, &w)| {
                let backend = Backend {
                    addr: [u32::from_ne_bytes([10, 0, 0, 21 + i as u8]), 0, 0, 0],
                    port: 8080u16.to_be(),
                    ..Backend::default()
                };
                SlotBackend::new(100 + i as u32, &backend, w)
            })
            .collect()
    }

    #[test]
    fn each_algorithm_gets_only_its_own_table() {
        let s = slots(&[2, 1]);
        let wrr = VipTableSet::build(Algorithm::WeightedRoundRobin, &s);
        assert_eq!(wrr.schedule, [0, 1, 0]);
        assert!(wrr.prefix.is_empty() && wrr.maglev.is_empty());
        let random = VipTableSet::build(Algorithm::Random, &s);
        assert_eq!(random.prefix, [2, 3]);
        let maglev = VipTableSet::build(Algorithm::Maglev, &s);
        assert_eq!(maglev.maglev.len(), MAGLEV_TABLE_SIZE as usize);
        // Maglev stores backend ids, not slot indexes.
        assert!(maglev.maglev.iter().all(|&id| id == 100 || id == 101));
        assert_eq!(
            VipTableSet::build(Algorithm::P2cEwma, &s),
            VipTableSet::default()
        );
    }

    #[test]
    fn table_weights_are_small_integers_in_the_same_ratio() {
        // Effective weights in hundredths: equal ones reduce to 1s.
        assert_eq!(table_weights(&[100, 100, 300]), [1, 1, 3]);
        // Slow start: 37 % of one against a full one keeps the ratio.
        assert_eq!(table_weights(&[37, 100]), [37, 100]);
        // Huge sums are scaled down, every weight still at least 1.
        let big = table_weights(&[u32::MAX, u32::MAX - 1, 1]);
        assert!(big.iter().map(|&w| u64::from(w)).sum::<u64>() <= MAX_WEIGHT_SUM + 3);
        assert_eq!(big[2], 1);
        assert!(table_weights(&[]).is_empty());
    }

    /// Each slot's share of weighted random's draws (`random u32 % total`
    /// over the running sums), counted over all 2^32 random values, is
    /// within 1 % of its weight's share, also for large weight sums.
    #[test]
    fn weighted_random_draws_keep_each_slots_share_within_a_percent() {
        // 1,024 backends of about 60,000 hundredths, one ramping (a
        // multiple of 10 of them: the divisor is 10 at most).
        let mut weights: Vec<u32> = (0..1024).map(|i| 6_000_000 + 10 * (i % 7)).collect();
        weights[5] = 1_200_000;
        let sums = prefix::running_sums(&table_weights(&weights));
        let total = u64::from(*sums.last().unwrap());
        let space = 1u64 << 32;
        let (per, extra) = (space / total, space % total);
        let mut start = 0u64;
        for (slot, &end) in sums.iter().enumerate() {
            let end = u64::from(end);
            // Targets in [start, end): each hit `per` times, plus once more
            // if below `extra`.
            let hits = (end - start) * per + end.min(extra).saturating_sub(start);
            let share = hits as f64 / space as f64;
            let want = (end - start) as f64 / total as f64;
            assert!(
                (share / want - 1.0).abs() < 0.01,
                "slot {slot}: {share} of the draws against {want} (total {total})"
            );
            start = end;
        }
    }

    #[test]
    fn maglev_identity_is_the_address_not_the_id() {
        let a = slots(&[1, 1, 1]);
        let mut b = a.clone();
        for s in &mut b {
            s.id += 7;
        }
        let ta = VipTableSet::build(Algorithm::Maglev, &a).maglev;
        let tb = VipTableSet::build(Algorithm::Maglev, &b).maglev;
        assert!(ta.iter().zip(&tb).all(|(x, y)| x + 7 == *y));
    }
}
