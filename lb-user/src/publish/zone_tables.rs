//! The tables of a zone-aware VIP (see `lb_common::VipZones`): its slot
//! block is ordered zone by zone, and each zone block gets its own part of
//! the weight-derived tables, so the kernel runs the VIP's algorithm inside
//! the block drawn for a new flow exactly as it runs over a whole slot
//! block otherwise.
//!
//! A pure function of the ordered blocks (their slot backends, weights,
//! shares and reference costs); `publish::writers::TableWriter::write_zoned`
//! writes the result. Layout:
//! - the descriptor: block `i` covers slots `first_slot .. + slot_count`,
//!   `first_slot` being the running count of the slots before it; its
//!   `cum_share` is the running sum of the shares (the last block's is
//!   `ZONE_SHARE_SCALE`: it takes what the others leave);
//! - weighted random: the running weight sums restart at each block's first
//!   slot;
//! - smooth WRR: each block's schedule, of slot indexes *relative to the
//!   block's first slot*, at entries `schedule_first .. + schedule_len` of
//!   one half (`WRR_SCHEDULE_LEN` entries) of the VIP's schedule block, the
//!   blocks' runs one after the other (the length is shared out in
//!   proportion to each block's need, each block with slots getting at
//!   least one entry per slot). The writer picks the half and records it in
//!   the descriptor (`VipZones::half`, see `publish::swap`);
//! - Maglev: block `i`'s table of `ZONE_MAGLEV_SIZE` backend ids at entries
//!   `i * ZONE_MAGLEV_SIZE ..` of one `MAGLEV_TABLE_SIZE` table. The rest of
//!   the table repeats those entries, so a reader that takes it for a
//!   whole-VIP table (the window after the zones are cleared and before the
//!   whole-VIP table replaces it) still finds only this VIP's backends.

use anyhow::ensure;
use lb_common::{
    Algorithm, MAGLEV_TABLE_SIZE, MAX_BACKENDS_PER_VIP, MAX_ZONES, VipZones, WRR_SCHEDULE_LEN,
    ZONE_MAGLEV_SIZE, ZONE_SHARE_SCALE, ZoneBlock,
};

use super::{
    maglev, prefix, smooth_wrr,
    tables::{SlotBackend, table_weights},
};

/// One zone block of a VIP, in failover order.
#[derive(Clone, Debug, Default)]
pub struct ZoneInput {
    /// The block's slot backends, in slot order.
    pub slots: Vec<SlotBackend>,
    /// The block's share of new connections, out of `ZONE_SHARE_SCALE`;
    /// the shares of all blocks sum to `ZONE_SHARE_SCALE` (a shortfall goes
    /// to the last block, an excess is cut off).
    pub share: u32,
    /// P2C's re-draw reference inside the block (0 = none).
    pub reference_cost: u64,
}

/// A zone-aware VIP's descriptor and tables; only the VIP's algorithm's
/// table is non-empty.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ZoneTableSet {
    pub zones: VipZones,
    /// Smooth WRR: the blocks' schedules, one after the other.
    pub schedule: Vec<u32>,
    /// Weighted random: running weight sums, one per slot of the VIP.
    pub prefix: Vec<u32>,
    /// Maglev: `MAGLEV_TABLE_SIZE` backend ids.
    pub maglev: Vec<u32>,
}

/// The cumulative shares of blocks with `shares`: running sums capped at
/// `ZONE_SHARE_SCALE`, the last one `ZONE_SHARE_SCALE`.
pub fn cumulative_shares(shares: &[u32]) -> Vec<u32> {
    let mut sum = 0u64;
    let mut out: Vec<u32> = shares
        .iter()
        .map(|&s| {
            sum += u64::from(s);
            sum.min(u64::from(ZONE_SHARE_SCALE)) as u32
        })
        .collect();
    if let Some(last) = out.last_mut() {
        *last = ZONE_SHARE_SCALE;
    }
    out
}

/// Builds the descriptor and tables of a VIP running `algorithm` over
/// `blocks` (at most `MAX_ZONES`, with at most `MAX_BACKENDS_PER_VIP` slots
/// in all).
pub fn build(algorithm: Algorithm, blocks: &[ZoneInput]) -> anyhow::Result<ZoneTableSet> {
    ensure!(
        blocks.len() <= MAX_ZONES as usize,
        "{} zone blocks, at most {MAX_ZONES}",
        blocks.len()
    );
    let total_slots: usize = blocks.iter().map(|b| b.slots.len()).sum();
    ensure!(
        total_slots <= MAX_BACKENDS_PER_VIP as usize,
        "{total_slots} slots in the zone blocks, at most {MAX_BACKENDS_PER_VIP}"
    );
    let weights: Vec<Vec<u32>> = blocks
        .iter()
        .map(|b| table_weights(&b.slots.iter().map(|s| s.weight).collect::<Vec<_>>()))
        .collect();
    let schedules = match algorithm {
        Algorithm::WeightedRoundRobin => schedules(&weights),
        _ => vec![Vec::new(); blocks.len()],
    };
    let cum = cumulative_shares(&blocks.iter().map(|b| b.share).collect::<Vec<_>>());
    let mut set = ZoneTableSet {
        zones: VipZones {
            count: blocks.len() as u32,
            ..VipZones::default()
        },
        ..ZoneTableSet::default()
    };
    let mut first_slot = 0u32;
    for (i, block) in blocks.iter().enumerate() {
        let schedule = &schedules[i];
        set.zones.zones[i] = ZoneBlock {
            first_slot,
            slot_count: block.slots.len() as u32,
            cum_share: cum[i],
            schedule_first: set.schedule.len() as u32,
            schedule_len: schedule.len() as u32,
            _pad: 0,
            reference_cost: block.reference_cost,
        };
        first_slot += block.slots.len() as u32;
        set.schedule.extend_from_slice(schedule);
        if algorithm == Algorithm::Random {
            set.prefix.extend(prefix::running_sums(&weights[i]));
        }
    }
    if algorithm == Algorithm::Maglev {
        set.maglev = maglev_table(blocks, &weights);
    }
    Ok(set)
}

/// Each block's smooth WRR schedule for its table `weights`, all of them
/// together at most `WRR_SCHEDULE_LEN` long.
fn schedules(weights: &[Vec<u32>]) -> Vec<Vec<u32>> {
    let len = WRR_SCHEDULE_LEN as usize;
    let natural: Vec<Vec<u32>> = weights
        .iter()
        .map(|w| smooth_wrr::schedule(w, len))
        .collect();
    if natural.iter().map(Vec::len).sum::<usize>() <= len {
        return natural;
    }
    // Too long together: every block keeps one entry per slot (the floor
    // under which its shares stop being exact), and the rest of the length
    // is shared out in proportion to what each block needs beyond it.
    let floors: Vec<usize> = weights.iter().map(Vec::len).collect();
    let spare = len.saturating_sub(floors.iter().sum());
    let extra: Vec<usize> = natural
        .iter()
        .zip(&floors)
        .map(|(s, &f)| s.len().saturating_sub(f))
        .collect();
    let extra_sum: usize = extra.iter().sum::<usize>().max(1);
    weights
        .iter()
        .zip(floors.iter().zip(&extra))
        .map(|(w, (&floor, &more))| {
            let budget = floor + more * spare / extra_sum;
            smooth_wrr::schedule(w, budget)
        })
        .collect()
}

/// One `MAGLEV_TABLE_SIZE` table holding block `i`'s table of
/// `ZONE_MAGLEV_SIZE` entries at `i * ZONE_MAGLEV_SIZE`, the rest repeating
/// them (see the module documentation).
fn maglev_table(blocks: &[ZoneInput], weights: &[Vec<u32>]) -> Vec<u32> {
    let mut table = Vec::with_capacity(MAGLEV_TABLE_SIZE as usize);
    for (block, weights) in blocks.iter().zip(weights) {
        let members: Vec<maglev::Member> = block
            .slots
            .iter()
            .zip(weights)
            .map(|(s, &weight)| maglev::Member {
                key: s.key,
                value: s.id,
                weight,
            })
            .collect();
        let mut zone = maglev::build(&members, ZONE_MAGLEV_SIZE);
        if zone.is_empty() {
            // An empty block is never read (the kernel scans the VIP
            // instead); any backend of the VIP keeps the filler honest.
            let any = blocks.iter().flat_map(|b| b.slots.first()).next();
            zone = vec![any.map_or(0, |s| s.id); ZONE_MAGLEV_SIZE as usize];
        }
        table.extend(zone);
    }
    let used = table.len();
    if used == 0 {
        return Vec::new();
    }
    for i in used..MAGLEV_TABLE_SIZE as usize {
        table.push(table[i % used]);
    }
    table
}

#[cfg(test)]
mod tests {
    use lb_common::Backend;

    use super::*;

    /// Slot backends with ids `first_id ..` of `weights`, distinct addresses.
    fn slots(first_id: u32, weights: &[u32]) -> Vec<SlotBackend> {
        weights
            .iter()
            .enumerate()
            .map(|(i, &w)| {
                let id = first_id + i as u32;
                let backend = Backend {
                    addr: [
                        u32::from_ne_bytes([10, 1, (id >> 8) as u8, id as u8]),
                        0,
                        0,
                        0,
                    ],
                    port: 8080u16.to_be(),
                    ..Backend::default()
                };
                SlotBackend::new(id, &backend, w)
            })
            .collect()
    }

    fn zone(first_id: u32, weights: &[u32], share: u32) -> ZoneInput {
        ZoneInput {
            slots: slots(first_id, weights),
            share,
            reference_cost: u64::from(first_id) * 10,
        }
    }

    const HALF: u32 = ZONE_SHARE_SCALE / 2;

    #[test]
    fn descriptor_offsets_and_cumulative_shares() {
        let blocks = [
            zone(0, &[1, 1, 1], HALF),
            zone(10, &[1, 1], HALF / 2),
            zone(20, &[1], HALF / 2),
        ];
        let set = build(Algorithm::P2cEwma, &blocks).unwrap();
        let z = &set.zones;
        assert_eq!(z.count, 3);
        let firsts: Vec<_> = z.zones[..3].iter().map(|b| b.first_slot).collect();
        let counts: Vec<_> = z.zones[..3].iter().map(|b| b.slot_count).collect();
        let cums: Vec<_> = z.zones[..3].iter().map(|b| b.cum_share).collect();
        let refs: Vec<_> = z.zones[..3].iter().map(|b| b.reference_cost).collect();
        assert_eq!(firsts, [0, 3, 5]);
        assert_eq!(counts, [3, 2, 1]);
        assert_eq!(cums, [HALF, HALF + HALF / 2, ZONE_SHARE_SCALE]);
        assert_eq!(refs, [0, 100, 200]);
        assert_eq!(z.zones[3], ZoneBlock::default());
        // P2C has no tables.
        assert!(set.schedule.is_empty() && set.prefix.is_empty() && set.maglev.is_empty());
    }

    #[test]
    fn the_last_block_takes_what_the_shares_leave() {
        assert_eq!(
            cumulative_shares(&[ZONE_SHARE_SCALE, 0]),
            [ZONE_SHARE_SCALE, ZONE_SHARE_SCALE]
        );
        assert_eq!(cumulative_shares(&[100, 200]), [100, ZONE_SHARE_SCALE]);
        // An excess is cut off.
        assert_eq!(
            cumulative_shares(&[ZONE_SHARE_SCALE, 5, 0]),
            [ZONE_SHARE_SCALE, ZONE_SHARE_SCALE, ZONE_SHARE_SCALE]
        );
        assert!(cumulative_shares(&[]).is_empty());
    }

    #[test]
    fn more_blocks_than_max_zones_is_an_error() {
        let blocks = vec![zone(0, &[1], 0); MAX_ZONES as usize + 1];
        assert!(build(Algorithm::RoundRobin, &blocks).is_err());
        let blocks = vec![zone(0, &[1], 0); MAX_ZONES as usize];
        assert!(build(Algorithm::RoundRobin, &blocks).is_ok());
    }

    #[test]
    fn prefix_sums_restart_at_each_block() {
        let blocks = [zone(0, &[1, 2, 3], HALF), zone(10, &[200, 100], HALF)];
        let set = build(Algorithm::Random, &blocks).unwrap();
        // The second block's weights reduce by their gcd to 2, 1.
        assert_eq!(set.prefix, [1, 3, 6, 2, 3]);
    }

    #[test]
    fn each_zone_schedule_follows_its_weights_within_its_run() {
        let blocks = [
            zone(0, &[5, 1, 1], HALF),
            zone(10, &[1, 3], HALF / 2),
            zone(20, &[], 0),
            zone(30, &[2], HALF / 2),
        ];
        let set = build(Algorithm::WeightedRoundRobin, &blocks).unwrap();
        let z = &set.zones.zones;
        assert_eq!(
            &set.schedule[z[0].schedule_first as usize..][..z[0].schedule_len as usize],
            [0, 0, 1, 0, 2, 0, 0]
        );
        let second = &set.schedule[z[1].schedule_first as usize..][..z[1].schedule_len as usize];
        assert_eq!(second.len(), 4);
        assert_eq!(second.iter().filter(|&&s| s == 1).count(), 3);
        assert_eq!((z[2].schedule_first, z[2].schedule_len), (11, 0));
        assert_eq!((z[3].schedule_first, z[3].schedule_len), (11, 1));
        assert_eq!(set.schedule.len(), 12);
    }

    #[test]
    fn long_schedules_share_the_length_and_stay_in_range() {
        // Coprime weights whose natural schedules would not fit together.
        let a: Vec<u32> = (0..300).map(|i| 1 + i % 13).collect();
        let b: Vec<u32> = (0..100).map(|i| 1 + i % 7).collect();
        let blocks = [zone(0, &a, HALF), zone(1000, &b, HALF)];
        let set = build(Algorithm::WeightedRoundRobin, &blocks).unwrap();
        assert!(set.schedule.len() <= WRR_SCHEDULE_LEN as usize);
        for (i, block) in blocks.iter().enumerate() {
            let z = set.zones.zones[i];
            let run = &set.schedule[z.schedule_first as usize..][..z.schedule_len as usize];
            assert!(run.len() >= block.slots.len(), "zone {i}: {}", run.len());
            // Relative slot indexes of the block, every slot present.
            let mut seen = vec![0usize; block.slots.len()];
            for &s in run {
                seen[s as usize] += 1;
            }
            assert!(seen.iter().all(|&c| c >= 1), "zone {i}");
            // Heavier slots get more steps than the lightest.
            let heavy = seen[12.min(block.slots.len() - 1)];
            assert!(heavy > seen[0], "zone {i}: {heavy} vs {}", seen[0]);
        }
        // The second run starts where the first ends.
        let z = set.zones.zones;
        assert_eq!(z[1].schedule_first, z[0].schedule_len);
    }

    #[test]
    fn maglev_segments_hold_only_their_zones_backends_in_balance() {
        let blocks = [
            zone(0, &[1, 1, 1, 1], HALF),
            zone(100, &[1, 1, 1], HALF / 2),
            zone(200, &[1, 3], HALF / 2),
        ];
        let set = build(Algorithm::Maglev, &blocks).unwrap();
        assert_eq!(set.maglev.len(), MAGLEV_TABLE_SIZE as usize);
        let size = ZONE_MAGLEV_SIZE as usize;
        for (i, block) in blocks.iter().enumerate() {
            let segment = &set.maglev[i * size..][..size];
            let weights: Vec<u32> = block.slots.iter().map(|s| s.weight).collect();
            let total: u32 = weights.iter().sum();
            for (s, &w) in block.slots.iter().zip(&weights) {
                let got = segment.iter().filter(|&&id| id == s.id).count() as f64 / size as f64;
                let want = f64::from(w) / f64::from(total);
                assert!(
                    (got - want).abs() < 0.02,
                    "zone {i} backend {}: {got:.3} of the entries, want {want:.3}",
                    s.id
                );
            }
            let ids: Vec<u32> = block.slots.iter().map(|s| s.id).collect();
            assert!(segment.iter().all(|id| ids.contains(id)), "zone {i}");
        }
        // The rest only names the VIP's backends.
        let all: Vec<u32> = blocks
            .iter()
            .flat_map(|b| b.slots.iter().map(|s| s.id))
            .collect();
        assert!(set.maglev[3 * size..].iter().all(|id| all.contains(id)));
    }

    #[test]
    fn a_zones_maglev_segment_is_stable_when_another_zone_changes() {
        let before = build(
            Algorithm::Maglev,
            &[zone(0, &[1, 1, 1], HALF), zone(10, &[1], HALF)],
        )
        .unwrap();
        let after = build(
            Algorithm::Maglev,
            &[zone(0, &[1, 1, 1], HALF), zone(10, &[1, 1, 1], HALF)],
        )
        .unwrap();
        let size = ZONE_MAGLEV_SIZE as usize;
        assert_eq!(before.maglev[..size], after.maglev[..size]);
    }
}
