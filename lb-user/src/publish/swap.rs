//! The order in which a VIP's weight-derived tables reach the kernel, as a
//! pure plan of map writes (see `lb_common::VipTables`): the schedule and
//! prefix tables go into the half of the VIP's blocks the kernel does not
//! read, the Maglev table into a table no VIP's descriptor names, and only
//! then do the descriptors switch to them. [`plan`] computes the writes in
//! two parts, those the kernel cannot see ([`Plan::aside`]) and the flip
//! ([`Plan::flip`]); `publish::writers::TableWriter` performs them in
//! order.
//!
//! Which half the kernel reads ([`live_half`]) follows the kernel's own
//! rule: the zone descriptor's half when the VIP has one in use (`count` in
//! `1..=MAX_ZONES`), otherwise its `VIP_TABLES` descriptor's. Both are read
//! back from the maps before every write, so a restarted control plane
//! (or one that crashed between two descriptor writes) never writes the
//! half being read.
//!
//! A packet that read a descriptor just before a flip keeps reading the
//! old half for the rest of its own selection (microseconds). That half is
//! rewritten only by the VIP's next rebuild, which the control plane makes
//! at its next change (ticks are milliseconds apart); no grace period
//! (an RCU wait) is taken, so two rebuilds of one VIP issued back to back
//! could in principle meet a packet still reading the older half.

use lb_common::{
    MAX_ZONES, TABLE_HALVES, VipTables, VipZones, prefix_base, schedule_base, table_half,
};

/// One map write, in the order the plan lists them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Write<'a> {
    /// `VIP_SCHEDULE` entries from index `first` on.
    Schedule { first: u32, entries: &'a [u32] },
    /// `VIP_WEIGHT_PREFIX` sums from index `first` on.
    Prefix { first: u32, sums: &'a [u32] },
    /// Maglev table `table`, all of it.
    Maglev { table: u32, entries: &'a [u32] },
    /// The VIP's `VIP_TABLES` descriptor.
    Tables(VipTables),
    /// The VIP's `VIP_ZONES` descriptor (boxed: ten times the other
    /// variants' size).
    Zones(Box<VipZones>),
}

/// A VIP's table writes: first `aside` (contents, and the spare half's
/// schedule length), which change nothing the kernel reads, then `flip`
/// (the descriptors naming the new half and Maglev table).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan<'a> {
    pub aside: Vec<Write<'a>>,
    pub flip: Vec<Write<'static>>,
}

impl<'a> Plan<'a> {
    /// Every write, in order.
    pub fn all(self) -> Vec<Write<'a>> {
        let mut all = self.aside;
        all.extend(self.flip);
        all
    }
}

/// What a VIP's tables become: the built tables (only its algorithm's is
/// non-empty), the Maglev table chosen to hold `maglev` (written aside by
/// the caller's choice), and for a zone-aware VIP its zone descriptor.
#[derive(Clone, Copy, Debug)]
pub struct NewTables<'a> {
    pub schedule: &'a [u32],
    pub prefix: &'a [u32],
    pub maglev: Option<(u32, &'a [u32])>,
    pub zones: Option<VipZones>,
}

/// Whether the kernel routes the VIP by `zones` (see `lb-ebpf`'s
/// `select::zones::draw`): it does for a count in `1..=MAX_ZONES`.
pub fn zones_in_use(zones: Option<&VipZones>) -> bool {
    zones.is_some_and(|z| z.count != 0 && z.count <= MAX_ZONES)
}

/// The half of the VIP's schedule and prefix blocks the kernel reads now,
/// given its `VIP_TABLES` descriptor and its `VIP_ZONES` entry (if any).
pub fn live_half(tables: &VipTables, zones: Option<&VipZones>) -> u32 {
    match zones {
        Some(z) if zones_in_use(Some(z)) => table_half(z.half),
        _ => table_half(tables.half),
    }
}

/// The half a rebuild writes: the one after the live half.
pub fn spare_half(tables: &VipTables, zones: Option<&VipZones>) -> u32 {
    table_half(live_half(tables, zones) + 1)
}

/// The writes that replace VIP `vip_id`'s tables, whose descriptors are
/// `current` (`VIP_TABLES`) and `current_zones` (`VIP_ZONES`) now:
/// 1. the new schedule and sums into the spare half, the Maglev table into
///    the table the caller chose;
/// 2. if the spare half's schedule length changes, the `VIP_TABLES`
///    descriptor with only that (unread) length changed;
/// 3. the `VIP_TABLES` descriptor naming the spare half (and the new
///    Maglev table): the flip. Nothing else in it changes, the reference
///    cost included;
/// 4. for a zone-aware VIP, its zone descriptor naming the same half.
///
/// Steps 1 and 2 are [`Plan::aside`], 3 and 4 [`Plan::flip`]. `None`
/// when `vip_id` has no blocks in the maps (overflow).
pub fn plan<'a>(
    vip_id: u32,
    current: &VipTables,
    current_zones: Option<&VipZones>,
    new: NewTables<'a>,
) -> Option<Plan<'a>> {
    let half = spare_half(current, current_zones);
    let mut writes = Vec::with_capacity(4);
    if !new.schedule.is_empty() {
        writes.push(Write::Schedule {
            first: schedule_base(vip_id, half)?,
            entries: new.schedule,
        });
    }
    if !new.prefix.is_empty() {
        writes.push(Write::Prefix {
            first: prefix_base(vip_id, half)?,
            sums: new.prefix,
        });
    }
    if let Some((table, entries)) = new.maglev {
        writes.push(Write::Maglev { table, entries });
    }
    let mut staged = *current;
    let len = u32::try_from(new.schedule.len()).ok()?;
    *staged.schedule_len.get_mut(half as usize)? = len;
    if staged != *current {
        writes.push(Write::Tables(staged));
    }
    let mut flipped = staged;
    flipped.half = half;
    match new.maglev {
        Some((table, _)) => {
            flipped.maglev_table = table;
            flipped.has_maglev = 1;
        }
        None => {
            flipped.maglev_table = 0;
            flipped.has_maglev = 0;
        }
    }
    let mut flip = Vec::with_capacity(2);
    if flipped != staged {
        flip.push(Write::Tables(flipped));
    }
    if let Some(mut zones) = new.zones {
        zones.half = half;
        flip.push(Write::Zones(Box::new(zones)));
    }
    Some(Plan {
        aside: writes,
        flip,
    })
}

const _: () = assert!(TABLE_HALVES == 2, "spare_half assumes two halves");

#[cfg(test)]
mod tests {
    use lb_common::{MAX_BACKENDS_PER_VIP, WRR_SCHEDULE_LEN, ZoneBlock};

    use super::*;

    const SCHEDULE: [u32; 7] = [0, 0, 1, 0, 2, 0, 0];
    const SUMS: [u32; 3] = [5, 6, 7];

    fn tables(half: u32, lens: [u32; 2]) -> VipTables {
        VipTables {
            schedule_len: lens,
            half,
            reference_cost: 42,
            ..VipTables::default()
        }
    }

    fn wrr(schedule: &[u32]) -> NewTables<'_> {
        NewTables {
            schedule,
            prefix: &[],
            maglev: None,
            zones: None,
        }
    }

    /// The index of the first `Tables` write that names a new half.
    fn flip_at(writes: &[Write], from: u32) -> usize {
        writes
            .iter()
            .position(|w| matches!(w, Write::Tables(t) if t.half != from))
            .expect("a flip")
    }

    #[test]
    fn the_schedule_goes_into_the_half_the_kernel_does_not_read() {
        let vip = 3;
        for live in [0, 1] {
            let current = tables(live, [7, 7]);
            let writes = plan(vip, &current, None, wrr(&SCHEDULE)).unwrap().all();
            let spare = 1 - live;
            assert_eq!(
                writes[0],
                Write::Schedule {
                    first: (vip * 2 + spare) * WRR_SCHEDULE_LEN,
                    entries: &SCHEDULE,
                }
            );
            // Same length as before: no staging, just the flip.
            assert_eq!(writes.len(), 2, "{writes:?}");
            assert_eq!(writes[1], Write::Tables(tables(spare, [7, 7])));
        }
    }

    #[test]
    fn the_flip_comes_after_the_contents_and_changes_only_the_half() {
        let current = tables(0, [4, 9]);
        let plan_ = plan(1, &current, None, wrr(&SCHEDULE)).unwrap();
        // Nothing aside names another half; the flip is one write.
        assert!(
            plan_
                .aside
                .iter()
                .all(|w| !matches!(w, Write::Tables(t) if t.half != 0))
        );
        assert_eq!(plan_.flip.len(), 1);
        let writes = plan_.all();
        let flip = flip_at(&writes, 0);
        assert!(matches!(writes[0], Write::Schedule { .. }));
        assert_eq!(flip, writes.len() - 1, "{writes:?}");
        // Before the flip: only the spare half's length (which the kernel
        // does not read) changed.
        assert_eq!(writes[1], Write::Tables(tables(0, [4, 7])));
        // The flip: only `half` differs from what the kernel holds then.
        assert_eq!(writes[2], Write::Tables(tables(1, [4, 7])));
        for w in &writes[..flip] {
            if let Write::Tables(t) = w {
                assert_eq!(t.live_schedule_len(), 4, "the live half's length moved");
            }
        }
    }

    #[test]
    fn weighted_random_sums_go_into_the_spare_half() {
        let current = tables(1, [0, 0]);
        let new = NewTables {
            schedule: &[],
            prefix: &SUMS,
            maglev: None,
            zones: None,
        };
        let writes = plan(5, &current, None, new).unwrap().all();
        assert_eq!(
            writes,
            [
                Write::Prefix {
                    first: (5 * 2) * MAX_BACKENDS_PER_VIP,
                    sums: &SUMS,
                },
                Write::Tables(tables(0, [0, 0])),
            ]
        );
    }

    #[test]
    fn consecutive_rebuilds_alternate_halves() {
        let mut kernel = VipTables::default();
        let mut seen = Vec::new();
        for round in 0..4u32 {
            let schedule: Vec<u32> = (0..=round).collect();
            for w in plan(0, &kernel, None, wrr(&schedule)).unwrap().all() {
                match w {
                    Write::Schedule { first, .. } => seen.push(first / WRR_SCHEDULE_LEN),
                    Write::Tables(t) => kernel = t,
                    other => panic!("unexpected {other:?}"),
                }
            }
            assert_eq!(kernel.live_schedule_len(), round + 1);
        }
        // A fresh VIP reads half 0 (all zero): the first rebuild writes 1.
        assert_eq!(seen, [1, 0, 1, 0]);
    }

    #[test]
    fn a_vip_added_at_runtime_starts_on_half_one_with_its_maglev_table() {
        // The id's descriptor is all zeros: the kernel reads half 0 (empty).
        let table = [7u32; 4];
        let new = NewTables {
            schedule: &[],
            prefix: &[],
            maglev: Some((2, &table)),
            zones: None,
        };
        let writes = plan(9, &VipTables::default(), None, new).unwrap().all();
        assert_eq!(
            writes,
            [
                Write::Maglev {
                    table: 2,
                    entries: &table,
                },
                Write::Tables(VipTables {
                    half: 1,
                    maglev_table: 2,
                    has_maglev: 1,
                    ..VipTables::default()
                }),
            ]
        );
    }

    #[test]
    fn a_removed_vips_id_is_rewritten_away_from_its_last_half() {
        // A removed VIP leaves its descriptor behind (half 1, a schedule of
        // 7); a VIP that takes the id over writes half 0 and flips to it.
        let left = tables(1, [3, 7]);
        let schedule = [0, 1];
        let writes = plan(4, &left, None, wrr(&schedule)).unwrap().all();
        assert_eq!(
            writes,
            [
                Write::Schedule {
                    first: 4 * 2 * WRR_SCHEDULE_LEN,
                    entries: &schedule,
                },
                Write::Tables(tables(1, [2, 7])),
                Write::Tables(tables(0, [2, 7])),
            ]
        );
    }

    fn zoned(count: u32, half: u32) -> VipZones {
        let mut zones = VipZones {
            count,
            half,
            ..VipZones::default()
        };
        zones.zones[0] = ZoneBlock {
            slot_count: 3,
            schedule_len: 7,
            cum_share: lb_common::ZONE_SHARE_SCALE,
            ..ZoneBlock::default()
        };
        zones
    }

    #[test]
    fn a_zoned_vip_writes_away_from_the_zone_descriptors_half() {
        // VIP_TABLES names half 0 but the zone descriptor, which the kernel
        // reads for a zoned VIP, names half 1 (a restart between the two
        // writes): half 0 is the spare.
        let current = tables(0, [7, 7]);
        let live = zoned(1, 1);
        let mut new_zones = zoned(1, 0);
        new_zones.zones[0].cum_share = 1;
        let new = NewTables {
            zones: Some(new_zones),
            ..wrr(&SCHEDULE)
        };
        let writes = plan(2, &current, Some(&live), new).unwrap().all();
        assert_eq!(
            writes[0],
            Write::Schedule {
                first: 2 * 2 * WRR_SCHEDULE_LEN,
                entries: &SCHEDULE,
            }
        );
        // VIP_TABLES already names half 0: nothing to flip there; the zone
        // descriptor, last, names half 0 with its new blocks.
        let mut want = new_zones;
        want.half = 0;
        assert_eq!(writes[1..], [Write::Zones(Box::new(want))]);
    }

    #[test]
    fn a_zoned_vip_flips_both_descriptors_zones_last() {
        let current = tables(1, [7, 7]);
        let live = zoned(2, 1);
        let new = NewTables {
            zones: Some(zoned(2, 0)),
            ..wrr(&SCHEDULE)
        };
        let plan_ = plan(0, &current, Some(&live), new).unwrap();
        assert_eq!(plan_.aside.len(), 1, "{plan_:?}");
        let writes = plan_.all();
        assert_eq!(writes.len(), 3, "{writes:?}");
        assert!(matches!(writes[0], Write::Schedule { first: 0, .. }));
        assert_eq!(writes[1], Write::Tables(tables(0, [7, 7])));
        assert!(matches!(&writes[2], Write::Zones(z) if z.half == 0 && z.count == 2));
    }

    #[test]
    fn zone_descriptors_not_in_use_leave_the_tables_half_live() {
        let current = tables(1, [0, 0]);
        // The zone panic (count 0) and a corrupt count: the kernel reads
        // VIP_TABLES' half.
        for zones in [zoned(0, 0), zoned(MAX_ZONES + 1, 0)] {
            assert!(!zones_in_use(Some(&zones)));
            assert_eq!(live_half(&current, Some(&zones)), 1);
            assert_eq!(spare_half(&current, Some(&zones)), 0);
        }
        assert_eq!(live_half(&current, Some(&zoned(1, 0))), 0);
        // A corrupt half still names one of the VIP's halves.
        assert_eq!(live_half(&tables(7, [0, 0]), None), 1);
    }

    #[test]
    fn no_table_at_all_still_flips() {
        // Round-robin, P2C, least-conn: no contents; the descriptor still
        // alternates (and drops a Maglev table the VIP no longer uses).
        let current = VipTables {
            maglev_table: 3,
            has_maglev: 1,
            ..tables(0, [0, 0])
        };
        let writes = plan(0, &current, None, wrr(&[])).unwrap().all();
        assert_eq!(writes, [Write::Tables(tables(1, [0, 0]))]);
    }

    #[test]
    fn a_vip_id_past_the_maps_has_no_plan() {
        assert!(plan(u32::MAX, &VipTables::default(), None, wrr(&SCHEDULE)).is_none());
    }
}
