//! The writers of the per-VIP tables and of the scores, each holding its
//! map handles open from startup: no publish reopens a pinned map.

use std::{
    os::fd::{AsFd as _, AsRawFd as _},
    path::Path,
    time::Instant,
};

use aya::maps::IterableMap as _;

use anyhow::Context as _;
use lb_common::{
    Algorithm, BackendScore, MAGLEV_TABLE_SIZE, MAX_MAGLEV_TABLES, VIP_ZONES_MAP, VipTables,
    VipZones,
};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};

use crate::kernel::batch;
use crate::{
    estimate::backend_load::moved,
    kernel::mapped::MappedU32Array,
    kernel::maps::{self, Maglev, Scores, VipSchedule, VipTablesMap, VipWeightPrefix, VipZonesMap},
    publish::{
        swap::{self, NewTables, Write},
        tables::{ScoreIndex, SlotBackend, VipTableSet, median_cost},
        zone_tables::{self, ZoneInput, ZoneTableSet, cumulative_shares},
    },
    settings::faults::{self, Fault},
};

/// Durations of map updates (for metrics): a histogram, and the worst.
#[derive(Clone, Debug)]
pub struct UpdateTimes {
    pub histogram: Histogram,
    pub max_seconds: f64,
}

/// Histogram buckets of control-plane durations: 10 µs × 4ⁿ, to about 2.6 s.
pub fn duration_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(1e-5, 4.0, 10)
}

impl Default for UpdateTimes {
    fn default() -> Self {
        Self {
            histogram: Histogram::new(duration_buckets()),
            max_seconds: 0.0,
        }
    }
}

impl UpdateTimes {
    pub fn record(&mut self, started: Instant) {
        self.record_duration(started.elapsed());
    }

    pub fn record_duration(&mut self, took: std::time::Duration) {
        let s = took.as_secs_f64();
        self.histogram.observe(s);
        self.max_seconds = self.max_seconds.max(s);
    }
}

/// Writes a VIP's weight-derived tables (see `publish::tables`), each
/// block in one `BPF_MAP_UPDATE_BATCH` call.
///
/// Every table is built aside and swapped in (`publish::swap`):
/// - the WRR schedule and the weight prefix sums go into the half of the
///   VIP's blocks the kernel does not read, and the VIP's descriptor then
///   flips to that half;
/// - a Maglev table is written into a table no VIP's descriptor points
///   at, and the same descriptor write switches the VIP to it. (With
///   every one of the [`MAX_MAGLEV_TABLES`] tables in use, there is no
///   spare: the table is rewritten in place, counted in
///   `maglev_in_place`.)
///
/// So the kernel never reads a half-written table.
///
/// A zone-aware VIP's tables ([`TableWriter::write_zoned`]) take the same
/// path, followed by its `VIP_ZONES` descriptor. Leaving zone mode is
/// [`TableWriter::clear_zones`] followed by [`TableWriter::write`], in that
/// order: between the two the kernel selects over the whole slot block from
/// the zone layout's tables, skewed but naming only the VIP's backends.
pub struct TableWriter {
    schedule: VipSchedule,
    prefix: VipWeightPrefix,
    maglev: Maglev,
    /// `MAGLEV` mapped into memory (`None` where the pinned map is not
    /// mappable: then each table is one batch update).
    maglev_mapped: Option<MappedU32Array>,
    descriptors: VipTablesMap,
    /// `VIP_ZONES`, opened at the first zone write (a pin directory that
    /// holds only the table maps serves zone-unaware VIPs).
    zones: Option<VipZonesMap>,
    pin_dir: std::path::PathBuf,
    /// The Maglev table each VIP's descriptor points at, by vip id.
    current: std::collections::HashMap<u32, u32>,
    /// Tables of VIPs just taken out of `VIPS`, with when
    /// ([`TableWriter::retire`]): spares only after [`TABLE_READER_GRACE`].
    retiring: Vec<(u32, Instant)>,
    /// The zone descriptor last written for each zone-aware VIP.
    last_zones: std::collections::HashMap<u32, VipZones>,
    /// Maglev tables rewritten in place for want of a spare.
    pub maglev_in_place: u64,
    /// `VIP_TABLES` descriptor writes (stagings and flips).
    pub descriptor_writes: u64,
}

/// The descriptor writes that switch a VIP to tables written aside
/// ([`TableWriter::write_aside`]); [`TableWriter::flip`] performs them.
#[derive(Debug)]
#[must_use = "the kernel reads the new tables only after the flip"]
pub struct PendingFlip {
    vip_id: u32,
    writes: Vec<Write<'static>>,
    maglev_table: Option<u32>,
}

/// How long the Maglev table of a VIP taken out of `VIPS` stays out of
/// use. A program that looked the VIP up just before its entry went may
/// still be reading the table: XDP runs a packet to its end in
/// microseconds, so a tenth of a second is far past the last such reader.
/// A VIP that waits for the table is written at the first score tick after
/// the grace.
pub const TABLE_READER_GRACE: std::time::Duration = std::time::Duration::from_millis(100);

/// The lowest Maglev table no VIP uses and no retired VIP's last reader
/// may still read at `now` (see [`TABLE_READER_GRACE`]).
fn spare_table(
    current: &std::collections::HashMap<u32, u32>,
    retiring: &[(u32, Instant)],
    now: Instant,
) -> Option<u32> {
    (0..MAX_MAGLEV_TABLES).find(|t| {
        !current.values().any(|c| c == t)
            && !retiring
                .iter()
                .any(|(r, at)| r == t && now.duration_since(*at) < TABLE_READER_GRACE)
    })
}

impl TableWriter {
    pub fn open(pin_dir: &Path) -> anyhow::Result<Self> {
        let maglev = maps::maglev(pin_dir)?;
        let maglev_mapped = match MappedU32Array::map(
            maglev.map().fd().as_fd(),
            MAX_MAGLEV_TABLES * MAGLEV_TABLE_SIZE,
        ) {
            Ok(mapped) => Some(mapped),
            Err(e) => {
                tracing::debug!("writing Maglev tables by map updates: {e:#}");
                None
            }
        };
        Ok(Self {
            schedule: maps::vip_schedule(pin_dir)?,
            prefix: maps::vip_weight_prefix(pin_dir)?,
            maglev,
            maglev_mapped,
            descriptors: maps::vip_tables(pin_dir)?,
            zones: None,
            pin_dir: pin_dir.to_path_buf(),
            current: std::collections::HashMap::new(),
            retiring: Vec::new(),
            last_zones: std::collections::HashMap::new(),
            maglev_in_place: 0,
            descriptor_writes: 0,
        })
    }

    /// Records that VIP `vip_id`'s descriptor points at Maglev table
    /// `table` (the plan's, read from the pinned descriptors): it is not a
    /// spare. Called for every VIP before the first write.
    pub fn claim(&mut self, vip_id: u32, table: u32) {
        self.current.insert(vip_id, table);
    }

    /// Claims the Maglev table each of `vip_ids` reads now (its pinned
    /// descriptor's), for VIPs the kernel still selects for but the plan
    /// does not name under that id: no planned VIP takes such a table as
    /// its spare and writes its own backends into it while the old VIP's
    /// SYNs still hash into it. (A restart takes every such VIP out of
    /// VIPS first, `Publisher::move_table_readers`; the claim stays for a
    /// reader that move missed.) [`TableWriter::retire`] frees them once
    /// those VIPs are gone.
    pub fn claim_live(&mut self, vip_ids: &[u32]) -> anyhow::Result<()> {
        for &vip_id in vip_ids {
            if let Some(table) = self.live_maglev_table(vip_id)? {
                self.current.entry(vip_id).or_insert(table);
            }
        }
        Ok(())
    }

    /// The Maglev table VIP `vip_id`'s pinned descriptor names, if any.
    pub fn live_maglev_table(&self, vip_id: u32) -> anyhow::Result<Option<u32>> {
        match self.descriptors.get(&vip_id, 0) {
            Ok(live) => Ok(
                (live.has_maglev != 0 && live.maglev_table < MAX_MAGLEV_TABLES)
                    .then_some(live.maglev_table),
            ),
            Err(aya::maps::MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(e).context("reading VIP_TABLES"),
        }
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
        let flip = self.write_aside(vip_id, algorithm, maglev_table, slots)?;
        self.flip(flip)
    }

    /// Builds and writes the tables of the zone-aware VIP `vip_id` for its
    /// zone `blocks` in failover order (see `publish::zone_tables`; the
    /// VIP's slot block must hold the blocks' slots in that order), then
    /// its `VIP_ZONES` descriptor, which makes the kernel route by zone
    /// and names the half just written.
    pub fn write_zoned(
        &mut self,
        vip_id: u32,
        algorithm: u8,
        maglev_table: Option<u32>,
        blocks: &[ZoneInput],
    ) -> anyhow::Result<()> {
        let flip = self.write_zoned_aside(vip_id, algorithm, maglev_table, blocks)?;
        self.flip(flip)
    }

    /// Removes VIP `vip_id`'s zone descriptor: the kernel selects over its
    /// whole slot block again. A VIP without one is no error.
    pub fn clear_zones(&mut self, vip_id: u32) -> anyhow::Result<()> {
        self.last_zones.remove(&vip_id);
        match self.zones_map()?.remove(&vip_id) {
            Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
            // The kernel says ENOENT for a key it does not hold.
            Err(aya::maps::MapError::SyscallError(e))
                if e.io_error.raw_os_error() == Some(libc::ENOENT) =>
            {
                Ok(())
            }
            Err(e) => Err(e).context("removing from VIP_ZONES"),
        }
    }

    /// Rewrites the shares and reference costs of the zone descriptor last
    /// written for VIP `vip_id` (one of each per block, in block order; the
    /// shares out of `ZONE_SHARE_SCALE`, as in [`ZoneInput::share`]), and
    /// writes it only if that changed it. Returns whether it wrote.
    pub fn update_zone_shares(
        &mut self,
        vip_id: u32,
        shares: &[u32],
        reference_costs: &[u64],
    ) -> anyhow::Result<bool> {
        let Some(last) = self.last_zones.get(&vip_id) else {
            anyhow::bail!("VIP {vip_id} has no zone descriptor to update");
        };
        let count = last.count as usize;
        anyhow::ensure!(
            shares.len() == count && reference_costs.len() == count,
            "VIP {vip_id} has {count} zone blocks: got {} shares and {} reference costs",
            shares.len(),
            reference_costs.len()
        );
        let mut zones = *last;
        for ((block, cum), &cost) in zones
            .zones
            .iter_mut()
            .zip(cumulative_shares(shares))
            .zip(reference_costs)
        {
            block.cum_share = cum;
            block.reference_cost = cost;
        }
        if zones == *last {
            return Ok(false);
        }
        self.insert_zones(vip_id, zones)?;
        Ok(true)
    }

    fn zones_map(&mut self) -> anyhow::Result<&mut VipZonesMap> {
        if self.zones.is_none() {
            self.zones = Some(maps::vip_zones(&self.pin_dir)?);
        }
        self.zones
            .as_mut()
            .ok_or_else(|| anyhow::anyhow!("VIP_ZONES is not open"))
    }

    fn insert_zones(&mut self, vip_id: u32, zones: VipZones) -> anyhow::Result<()> {
        self.zones_map()?
            .insert(vip_id, zones, 0)
            .context("writing VIP_ZONES")?;
        self.last_zones.insert(vip_id, zones);
        Ok(())
    }

    /// The first part of [`TableWriter::write`]: builds VIP `vip_id`'s
    /// tables and writes everything the kernel does not read (the spare
    /// half, a spare Maglev table); the kernel keeps selecting from the
    /// tables it had until [`TableWriter::flip`] gets the result.
    pub fn write_aside(
        &mut self,
        vip_id: u32,
        algorithm: u8,
        maglev_table: Option<u32>,
        slots: &[SlotBackend],
    ) -> anyhow::Result<PendingFlip> {
        let algorithm = Algorithm::from_u8(algorithm).unwrap_or(Algorithm::P2cEwma);
        let set = VipTableSet::build(algorithm, slots);
        self.write_set_aside(
            vip_id,
            maglev_table,
            (&set.schedule, &set.prefix, &set.maglev),
            None,
        )
    }

    /// [`TableWriter::write_aside`] for a zone-aware VIP (see
    /// [`TableWriter::write_zoned`]): its zone descriptor is part of the flip.
    pub fn write_zoned_aside(
        &mut self,
        vip_id: u32,
        algorithm: u8,
        maglev_table: Option<u32>,
        blocks: &[ZoneInput],
    ) -> anyhow::Result<PendingFlip> {
        let algorithm = Algorithm::from_u8(algorithm).unwrap_or(Algorithm::P2cEwma);
        let ZoneTableSet {
            zones,
            schedule,
            prefix,
            maglev,
        } = zone_tables::build(algorithm, blocks)?;
        self.write_set_aside(
            vip_id,
            maglev_table,
            (&schedule, &prefix, &maglev),
            Some(zones),
        )
    }

    /// Makes the kernel select from the tables [`TableWriter::write_aside`]
    /// wrote: the descriptor writes of the plan.
    pub fn flip(&mut self, flip: PendingFlip) -> anyhow::Result<()> {
        for write in flip.writes {
            self.apply(flip.vip_id, write)?;
        }
        if let Some(table) = flip.maglev_table {
            self.current.insert(flip.vip_id, table);
        }
        Ok(())
    }

    /// Writes VIP `vip_id`'s table contents aside, in the order
    /// `publish::swap::plan` gives: the schedule and sums into the half the
    /// kernel does not read, the Maglev table aside (see [`TableWriter`]).
    /// The flips that follow are returned for [`TableWriter::flip`];
    /// `zones`: a zone-aware VIP's new zone descriptor, written last.
    fn write_set_aside(
        &mut self,
        vip_id: u32,
        maglev_table: Option<u32>,
        tables: (&[u32], &[u32], &[u32]),
        zones: Option<VipZones>,
    ) -> anyhow::Result<PendingFlip> {
        let (schedule, prefix, maglev) = tables;
        // What the kernel reads now, from the maps themselves (so a
        // restarted control plane knows the live halves too). The
        // reference cost is the score loop's ([`ScoreWriter`]): kept.
        let current = match self.descriptors.get(&vip_id, 0) {
            Ok(t) => t,
            Err(aya::maps::MapError::KeyNotFound) => VipTables::default(),
            Err(e) => return Err(e).context("reading VIP_TABLES"),
        };
        let current_zones = self.live_zones(vip_id)?;
        let maglev = match maglev_table {
            Some(planned) if !maglev.is_empty() => {
                // A VIP added at runtime takes a table no VIP uses.
                let now = Instant::now();
                let fresh = spare_table(&self.current, &self.retiring, now).unwrap_or(planned);
                let current = *self.current.entry(vip_id).or_insert(fresh);
                let table = spare_table(&self.current, &self.retiring, now).unwrap_or_else(|| {
                    self.maglev_in_place += 1;
                    current
                });
                Some((table, maglev))
            }
            _ => None,
        };
        let new = NewTables {
            schedule,
            prefix,
            maglev,
            zones,
        };
        let plan = swap::plan(vip_id, &current, current_zones.as_ref(), new)
            .with_context(|| format!("VIP {vip_id} has no table blocks"))?;
        for write in plan.aside {
            self.apply(vip_id, write)?;
        }
        Ok(PendingFlip {
            vip_id,
            writes: plan.flip,
            maglev_table: maglev.map(|(table, _)| table),
        })
    }

    /// Performs one write of a plan.
    fn apply(&mut self, vip_id: u32, write: Write<'_>) -> anyhow::Result<()> {
        let block = |first: u32, len: usize| (first..first + len as u32).collect::<Vec<u32>>();
        match write {
            Write::Schedule { first, entries } => {
                write_block(&mut self.schedule, &block(first, entries.len()), entries)
                    .context("writing VIP_SCHEDULE")
            }
            Write::Prefix { first, sums } => {
                write_block(&mut self.prefix, &block(first, sums.len()), sums)
                    .context("writing VIP_WEIGHT_PREFIX")
            }
            Write::Maglev { table, entries } => match &mut self.maglev_mapped {
                Some(mapped) => mapped
                    .write(table * MAGLEV_TABLE_SIZE, entries)
                    .context("writing MAGLEV"),
                None => write_block(
                    &mut self.maglev,
                    &block(table * MAGLEV_TABLE_SIZE, entries.len()),
                    entries,
                )
                .context("writing MAGLEV"),
            },
            Write::Tables(tables) => {
                self.descriptor_writes += 1;
                self.descriptors
                    .set(vip_id, tables, 0)
                    .context("writing VIP_TABLES")
            }
            Write::Zones(zones) => self.insert_zones(vip_id, *zones),
        }
    }

    /// VIP `vip_id`'s entry in `VIP_ZONES`, read back from the map (a
    /// previous instance may have left one); without the map pinned (a pin
    /// directory holding only the table maps), the one last written.
    fn live_zones(&mut self, vip_id: u32) -> anyhow::Result<Option<VipZones>> {
        if self.zones.is_none() && !self.pin_dir.join(VIP_ZONES_MAP).exists() {
            return Ok(self.last_zones.get(&vip_id).copied());
        }
        match self.zones_map()?.get(&vip_id, 0) {
            Ok(zones) => Ok(Some(zones)),
            Err(aya::maps::MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(e).context("reading VIP_ZONES"),
        }
    }

    /// Frees the Maglev table of VIP `vip_id` (removed and drained).
    pub fn release(&mut self, vip_id: u32) {
        self.current.remove(&vip_id);
    }

    /// Frees the Maglev table of VIP `vip_id`, just taken out of `VIPS`
    /// (removed; its flows drain through the flow table, which no table
    /// is read for): a spare once [`TABLE_READER_GRACE`] has passed. So
    /// a SIGHUP that moves a Maglev VIP while every table is taken places
    /// the new VIP instead of refusing it for a table nothing reads.
    pub fn retire(&mut self, vip_id: u32) {
        let now = Instant::now();
        self.retiring
            .retain(|(_, at)| now.duration_since(*at) < TABLE_READER_GRACE);
        if let Some(table) = self.current.remove(&vip_id) {
            self.retiring.push((table, now));
        }
    }

    /// Whether VIP `vip_id` has a Maglev table to be written into: the one
    /// it reads, or else a spare, claimed now. False while every table is
    /// read (a retired one within its grace): the VIP waits, out of
    /// `VIPS`, for a later tick.
    pub fn claim_spare(&mut self, vip_id: u32) -> bool {
        if self.current.contains_key(&vip_id) {
            return true;
        }
        match spare_table(&self.current, &self.retiring, Instant::now()) {
            Some(table) => {
                self.current.insert(vip_id, table);
                true
            }
            None => false,
        }
    }

    /// Whether Maglev tables are written through the memory mapping (the
    /// pinned `MAGLEV` is `BPF_F_MMAPABLE`), not by map updates.
    pub fn maglev_mapped(&self) -> bool {
        self.maglev_mapped.is_some()
    }

    /// The Maglev table VIP `vip_id` uses now.
    pub fn maglev_table(&self, vip_id: u32) -> Option<u32> {
        self.current.get(&vip_id).copied()
    }
}

/// Writes `values[i]` at `keys[i]` of an array map in one batch call, or
/// one update each where the kernel has no batch operations on arrays.
pub fn write_block<V: aya::Pod>(
    map: &mut aya::maps::Array<aya::maps::MapData, V>,
    keys: &[u32],
    values: &[V],
) -> anyhow::Result<()> {
    if keys.is_empty() {
        return Ok(());
    }
    let fd = map.map().fd().as_fd().as_raw_fd();
    match batch::update(fd, keys, values) {
        Ok(()) => Ok(()),
        Err(e) if batch::unsupported(&e) => {
            for (k, v) in keys.iter().zip(values) {
                map.set(*k, v, 0)?;
            }
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}

/// Writes the backends' scores, and with them each VIP's
/// `VipTables::reference_cost` (P2C's yardstick): each tick only what
/// changed by more than a step ([`moved`]), the scores in one
/// `BPF_MAP_UPDATE_BATCH` call.
pub struct ScoreWriter {
    scores: Scores,
    references: VipTablesMap,
    pub times: UpdateTimes,
    /// What each backend id last got (`updated_ns` aside).
    last: Vec<Option<BackendScore>>,
    /// Each VIP's last reference cost, by vip id.
    last_reference: std::collections::HashMap<u32, u64>,
    /// False once the kernel refused a batch update (older than 5.6):
    /// then one update per changed score.
    batch: bool,
    /// Map-update syscalls made (for metrics and the cost tests).
    pub syscalls: u64,
}

/// The scores of `fresh` worth writing over `last`: a new weight or flag,
/// or a cost or latency that [`moved`] (`updated_ns`, the time of the
/// write, aside). What is not written keeps the last written score, so a
/// slow drift is written once it adds up to a step.
pub fn changed_scores(
    last: &[Option<BackendScore>],
    fresh: &[(u32, BackendScore)],
) -> Vec<(u32, BackendScore)> {
    let same = |a: &BackendScore, b: &BackendScore| {
        a.weight == b.weight
            && a.flags == b.flags
            && !moved(a.cost, b.cost)
            && !moved(a.ewma_ns, b.ewma_ns)
    };
    fresh
        .iter()
        .filter(|(id, score)| {
            !last
                .get(*id as usize)
                .and_then(Option::as_ref)
                .is_some_and(|old| same(old, score))
        })
        .copied()
        .collect()
}

impl ScoreWriter {
    pub fn open(pin_dir: &Path) -> anyhow::Result<Self> {
        Ok(Self {
            scores: maps::scores(pin_dir)?,
            references: maps::vip_tables(pin_dir)?,
            times: UpdateTimes::default(),
            last: Vec::new(),
            last_reference: std::collections::HashMap::new(),
            batch: true,
            syscalls: 0,
        })
    }

    /// Writes backend `id`'s score.
    pub fn set(&mut self, id: u32, score: &BackendScore) -> anyhow::Result<()> {
        self.syscalls += 1;
        self.scores
            .set(id, score, 0)
            .context("writing BACKEND_SCORES")?;
        self.remember(id, *score);
        Ok(())
    }

    fn remember(&mut self, id: u32, score: BackendScore) {
        let id = id as usize;
        if self.last.len() <= id {
            self.last.resize(id + 1, None);
        }
        self.last[id] = Some(score);
    }

    /// Writes the `fresh` scores (by backend id) that changed, then each
    /// VIP's reference cost that changed, from the scores of its slot
    /// backends (`vips`: vip id and slots; `index`: `fresh`'s
    /// [`ScoreIndex`], the tick's), and records the time since `started`
    /// (the scores' computation included).
    pub fn write<'a>(
        &mut self,
        started: Instant,
        fresh: &[(u32, BackendScore)],
        index: &ScoreIndex,
        vips: impl IntoIterator<Item = (u32, &'a [u32])>,
    ) -> anyhow::Result<()> {
        faults::check(Fault::ScoreWrite).context("writing BACKEND_SCORES")?;
        let changed = changed_scores(&self.last, fresh);
        self.write_batch(&changed)?;
        for (vip_id, slots) in vips {
            self.write_reference(vip_id, slots, fresh, index)?;
        }
        self.times.record(started);
        Ok(())
    }

    /// One `BPF_MAP_UPDATE_BATCH` for `scores`, or one update each where
    /// the kernel has no batch operations on arrays.
    fn write_batch(&mut self, scores: &[(u32, BackendScore)]) -> anyhow::Result<()> {
        if scores.is_empty() {
            return Ok(());
        }
        if self.batch {
            let keys: Vec<u32> = scores.iter().map(|(id, _)| *id).collect();
            let values: Vec<BackendScore> = scores.iter().map(|(_, s)| *s).collect();
            let fd = self.scores.map().fd().as_fd().as_raw_fd();
            self.syscalls += 1;
            match batch::update(fd, &keys, &values) {
                Ok(()) => {
                    for (id, score) in scores {
                        self.remember(*id, *score);
                    }
                    return Ok(());
                }
                Err(e) if batch::unsupported(&e) => {
                    tracing::info!(
                        "no batch map updates in this kernel ({e}): one update per score"
                    );
                    self.batch = false;
                }
                Err(e) => return Err(e).context("writing BACKEND_SCORES (batch)"),
            }
        }
        for (id, score) in scores {
            self.set(*id, score)?;
        }
        Ok(())
    }

    /// Rewrites VIP `vip_id`'s reference cost from the `scores` (by
    /// backend id) of its slot backends `slots`, if it [`moved`].
    fn write_reference(
        &mut self,
        vip_id: u32,
        slots: &[u32],
        scores: &[(u32, BackendScore)],
        index: &ScoreIndex,
    ) -> anyhow::Result<()> {
        let cost = median_cost(slots, scores, index);
        // The median of drifting costs drifts too: written by the step.
        if self
            .last_reference
            .get(&vip_id)
            .is_some_and(|&written| !moved(written, cost))
        {
            return Ok(());
        }
        self.syscalls += 2;
        let mut tables = self
            .references
            .get(&vip_id, 0)
            .context("reading VIP_TABLES")?;
        tables.reference_cost = cost;
        self.references
            .set(vip_id, tables, 0)
            .context("writing VIP_TABLES")?;
        self.last_reference.insert(vip_id, cost);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn score(ewma_ns: u64, updated_ns: u64) -> BackendScore {
        BackendScore {
            ewma_ns,
            cost: ewma_ns,
            weight: 100,
            flags: 0,
            updated_ns,
        }
    }

    #[test]
    fn a_maglev_table_is_written_where_no_vip_reads() {
        let now = Instant::now();
        let mut current = std::collections::HashMap::new();
        current.insert(0, 0);
        current.insert(3, 1);
        assert_eq!(spare_table(&current, &[], now), Some(2));
        // After a swap the old table is the spare.
        current.insert(0, 2);
        assert_eq!(spare_table(&current, &[], now), Some(0));
        let full: std::collections::HashMap<u32, u32> =
            (0..MAX_MAGLEV_TABLES).map(|t| (t + 10, t)).collect();
        assert_eq!(spare_table(&full, &[], now), None);
    }

    /// A removed VIP's table is no spare while a program that found the
    /// VIP just before it left `VIPS` may still read it; after the grace
    /// it is.
    #[test]
    fn a_retired_table_is_a_spare_only_after_the_grace() {
        let retired_at = Instant::now();
        let mut current: std::collections::HashMap<u32, u32> =
            (0..MAX_MAGLEV_TABLES).map(|t| (t + 10, t)).collect();
        current.remove(&15);
        let retiring = [(5, retired_at)];
        assert_eq!(spare_table(&current, &retiring, retired_at), None);
        let almost = retired_at + TABLE_READER_GRACE - std::time::Duration::from_millis(1);
        assert_eq!(spare_table(&current, &retiring, almost), None);
        assert_eq!(
            spare_table(&current, &retiring, retired_at + TABLE_READER_GRACE),
            Some(5)
        );
    }

    /// The scores of `table` at `now` that [`changed_scores`] writes, with
    /// `last` updated as the writer does.
    fn tick(
        table: &crate::estimate::backend_load::LoadTable,
        last: &mut [Option<BackendScore>],
        now: crate::kernel::clock::Nanos,
    ) -> usize {
        let fresh: Vec<_> = table.scores(now).collect();
        let changed = changed_scores(last, &fresh);
        for (id, score) in &changed {
            last[*id as usize] = Some(*score);
        }
        changed.len()
    }

    /// 1,000 backends answer once each, 5 ms, in the first second, then
    /// nothing: their estimates drift towards the 1 ms cold start for
    /// minutes. A minute later a tick writes (close to) nothing, as the
    /// README says of an idle balancer; it wrote every one of them each
    /// tick (the drift moves `ewma_ns` by about 50 ns a tick still). A
    /// real change is written at once.
    #[test]
    fn an_idle_drift_is_not_rewritten_every_tick_and_a_real_change_is_at_once() {
        use crate::{
            estimate::{backend_load::LoadTable, latency::LatencySample},
            kernel::clock::{Clock, ManualClock},
            settings::{addr::Weight, config::EstimateParams},
        };
        use std::time::Duration;
        let params = EstimateParams {
            cold_start: Duration::from_millis(1),
            tau: Duration::from_secs(10),
            peak_tau: Duration::from_secs(10),
            refute_after: crate::settings::config::DEFAULT_EWMA_REFUTE_AFTER,
        };
        let tick_every = Duration::from_millis(50);
        let clock = ManualClock::starting_at(0);
        let mut table = LoadTable::new(&[Weight::new(1).unwrap(); 1_000], params, clock.now());
        let mut last = vec![None; 1_000];
        let five_ms = LatencySample::single(Duration::from_millis(5));
        for id in 0..1_000 {
            clock.advance(Duration::from_millis(1));
            table.observe(id, five_ms, clock.now());
        }
        let mut ticks = |count: u32| -> usize {
            (0..count)
                .map(|_| {
                    clock.advance(tick_every);
                    tick(&table, &mut last, clock.now())
                })
                .sum()
        };
        // About 170 each, in the first minute (2,000 each to the nanosecond).
        let written = ticks(1_200);
        assert!(written < 250 * 1_000, "{written} writes while idle");
        // A minute after the last sample: the last steps of a few.
        let late = ticks(2);
        assert!(
            late <= 20,
            "{late} scores written a minute after the last sample"
        );
        // Within a step of cold start (after τ·ln(127 × 4) = 62 s), published
        // as cold start: nothing more.
        ticks(100);
        assert_eq!(ticks(200), 0);
        // Backend 7's next answer takes twice its estimate: written now.
        clock.advance(tick_every);
        let twice = Duration::from_nanos(2 * table.ewma_ns(7, clock.now()));
        table.observe(7, LatencySample::single(twice), clock.now());
        let fresh: Vec<_> = table.scores(clock.now()).collect();
        let changed = changed_scores(&last, &fresh);
        assert_eq!(changed.iter().map(|(id, _)| *id).collect::<Vec<_>>(), [7]);
        // And so is a new weight or flag, however little the cost moved.
        let mut reweighted = fresh.clone();
        reweighted[3].1.weight += 1;
        reweighted[4].1.flags = lb_common::SCORE_FAR_ABOVE;
        let ids: Vec<u32> = changed_scores(&last, &reweighted)
            .iter()
            .map(|(id, _)| *id)
            .collect();
        assert_eq!(ids, [3, 4, 7]);
    }

    #[test]
    fn only_scores_that_changed_are_written_again() {
        let last = vec![Some(score(5, 1)), None, Some(score(7, 1))];
        let fresh = [
            (0, score(5, 2)),
            (1, score(3, 2)),
            (2, score(8, 2)),
            (3, score(1, 2)),
        ];
        let ids: Vec<u32> = changed_scores(&last, &fresh)
            .iter()
            .map(|(id, _)| *id)
            .collect();
        // 0 is the same but for its write time; 1 and 3 were never written.
        assert_eq!(ids, [1, 2, 3]);
        assert!(changed_scores(&last, &[]).is_empty());
    }
}
