//! The writers of the per-VIP tables and of the scores, each holding its
//! map handles open from startup: no publish reopens a pinned map.

use std::{path::Path, time::Instant};

use anyhow::Context as _;
use lb_common::{
    Algorithm, BackendScore, MAGLEV_TABLE_SIZE, MAX_BACKENDS_PER_VIP, VipTables, WRR_SCHEDULE_LEN,
};

use crate::{
    kernel::maps::{self, Maglev, Scores, VipSchedule, VipTablesMap, VipWeightPrefix},
    publish::tables::{SlotBackend, VipTableSet, median_cost},
    settings::faults::{self, Fault},
};

/// Count, total and worst time of map updates (for metrics).
#[derive(Clone, Copy, Debug, Default)]
pub struct UpdateTimes {
    pub count: u64,
    pub sum_seconds: f64,
    pub max_seconds: f64,
}

impl UpdateTimes {
    pub fn record(&mut self, started: Instant) {
        let s = started.elapsed().as_secs_f64();
        self.count += 1;
        self.sum_seconds += s;
        self.max_seconds = self.max_seconds.max(s);
    }
}

/// Writes a VIP's weight-derived tables (see `publish::tables`).
pub struct TableWriter {
    schedule: VipSchedule,
    prefix: VipWeightPrefix,
    maglev: Maglev,
    descriptors: VipTablesMap,
}

impl TableWriter {
    pub fn open(pin_dir: &Path) -> anyhow::Result<Self> {
        Ok(Self {
            schedule: maps::vip_schedule(pin_dir)?,
            prefix: maps::vip_weight_prefix(pin_dir)?,
            maglev: maps::maglev(pin_dir)?,
            descriptors: maps::vip_tables(pin_dir)?,
        })
    }

    /// Builds and writes the tables of VIP `vip_id` (whose
    /// `VipMeta::algorithm` is `algorithm`) for `slots` in slot order: table
    /// contents first, then the descriptor that makes the kernel use them.
    pub fn write(
        &mut self,
        vip_id: u32,
        algorithm: u8,
        maglev_table: Option<u32>,
        slots: &[SlotBackend],
    ) -> anyhow::Result<()> {
        let algorithm = Algorithm::from_u8(algorithm).unwrap_or(Algorithm::P2cEwma);
        let set = VipTableSet::build(algorithm, slots);
        for (i, slot) in set.schedule.iter().enumerate() {
            self.schedule
                .set(vip_id * WRR_SCHEDULE_LEN + i as u32, slot, 0)
                .context("writing VIP_SCHEDULE")?;
        }
        for (i, sum) in set.prefix.iter().enumerate() {
            self.prefix
                .set(vip_id * MAX_BACKENDS_PER_VIP + i as u32, sum, 0)
                .context("writing VIP_WEIGHT_PREFIX")?;
        }
        // The reference cost is the score loop's ([`ScoreWriter`]): kept.
        let mut descriptor = VipTables {
            schedule_len: set.schedule.len() as u32,
            reference_cost: self
                .descriptors
                .get(&vip_id, 0)
                .map_or(0, |t| t.reference_cost),
            ..VipTables::default()
        };
        if let Some(table) = maglev_table
            && !set.maglev.is_empty()
        {
            for (i, id) in set.maglev.iter().enumerate() {
                self.maglev
                    .set(table * MAGLEV_TABLE_SIZE + i as u32, id, 0)
                    .context("writing MAGLEV")?;
            }
            descriptor.maglev_table = table;
            descriptor.has_maglev = 1;
        }
        self.descriptors
            .set(vip_id, descriptor, 0)
            .context("writing VIP_TABLES")
    }
}

/// Writes the backends' scores, and with them each VIP's
/// `VipTables::reference_cost` (P2C's yardstick).
pub struct ScoreWriter {
    scores: Scores,
    references: VipTablesMap,
    pub times: UpdateTimes,
}

impl ScoreWriter {
    pub fn open(pin_dir: &Path) -> anyhow::Result<Self> {
        Ok(Self {
            scores: maps::scores(pin_dir)?,
            references: maps::vip_tables(pin_dir)?,
            times: UpdateTimes::default(),
        })
    }

    /// Writes backend `id`'s score.
    pub fn set(&mut self, id: u32, score: &BackendScore) -> anyhow::Result<()> {
        self.scores
            .set(id, score, 0)
            .context("writing BACKEND_SCORES")
    }

    /// Writes the `fresh` scores (by backend id), then each VIP's reference
    /// cost from the scores of its slot backends (`vips`: vip id and slots),
    /// and records the time since `started` (the scores' computation
    /// included).
    pub fn write<'a>(
        &mut self,
        started: Instant,
        fresh: &[(u32, BackendScore)],
        vips: impl IntoIterator<Item = (u32, &'a [u32])>,
    ) -> anyhow::Result<()> {
        faults::check(Fault::ScoreWrite).context("writing BACKEND_SCORES")?;
        for (id, score) in fresh {
            self.set(*id, score)?;
        }
        for (vip_id, slots) in vips {
            self.write_reference(vip_id, slots, fresh)?;
        }
        self.times.record(started);
        Ok(())
    }

    /// Rewrites VIP `vip_id`'s reference cost from the `scores` (by
    /// backend id) of its slot backends `slots`.
    fn write_reference(
        &mut self,
        vip_id: u32,
        slots: &[u32],
        scores: &[(u32, BackendScore)],
    ) -> anyhow::Result<()> {
        let mut tables = self
            .references
            .get(&vip_id, 0)
            .context("reading VIP_TABLES")?;
        tables.reference_cost = median_cost(slots, scores);
        self.references
            .set(vip_id, tables, 0)
            .context("writing VIP_TABLES")
    }
}
