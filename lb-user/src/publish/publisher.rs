//! Publishing a VIP's selectable backends and effective weights to the
//! kernel: [`Publisher::publish_vip`] is the one place that rewrites a
//! VIP's slot block, and it rebuilds the VIP's weight-derived tables
//! (smooth-WRR schedule, weighted-random sums, Maglev table; see
//! [`crate::publish::tables`]) from the slot ids and effective weights with it.
//!
//! Order matters, because the program reads the maps while they change:
//! backend states first (a backend leaving service is refused by the
//! program's state check at once, even while its id is still in a slot),
//! then the slot block and its tables, then the VIP's backend count.

use std::{collections::HashSet, path::Path, time::Instant};

use anyhow::Context as _;
use lb_common::{
    Backend, BackendConns, BackendScore, BackendStats, MAX_BACKENDS, MAX_BACKENDS_PER_VIP, VipKey,
    VipMeta,
};
use tracing::{debug, info};

use crate::{
    kernel::maps::{self, Backends, Conns, Stats, VipBackends, Vips},
    pool::{
        fleet::{FleetVip, Selection},
        plan::Plan,
    },
    publish::{
        relief::relieved_meta,
        tables::{SlotBackend, planned_slots},
        writers::{ScoreWriter, TABLE_READER_GRACE, TableWriter, UpdateTimes, write_block},
        zone_tables::ZoneInput,
    },
    settings::faults::{self, Fault},
};

/// Every write the control plane makes while it runs, through handles
/// opened once at startup: the initial plan, each VIP's selection and
/// tables, and the scores.
/// What [`Publisher::publish_vip`] last wrote for a VIP.
#[derive(Clone)]
struct Published {
    algorithm: u8,
    selection: Selection,
    /// The BACKENDS value of every member.
    entries: Vec<Backend>,
    /// Removed, and so deleted from VIPS.
    removed: bool,
}

pub struct Publisher {
    vips: Vips,
    slots: VipBackends,
    backends: Backends,
    /// Each backend id's connection and traffic counters, zeroed when the
    /// id is freed ([`Publisher::clear_backend`]).
    conns: Conns,
    stats: Stats,
    cpus: usize,
    tables: TableWriter,
    pub scores: ScoreWriter,
    /// What each VIP last got, so unchanged VIPs cost nothing: with
    /// whether it was then removed (and so deleted from VIPS), since a
    /// removal can leave the rest as it was (a VIP whose backends were all
    /// drained, or a discovered VIP etcd had emptied) and must still take
    /// the VIP out.
    last: Vec<Option<Published>>,
    /// Each VIP's least-connections relief as last written to VIPS (it can
    /// change while nothing else does: `relief`).
    last_relief: Vec<Option<bool>>,
    pub times: UpdateTimes,
}

impl Publisher {
    pub fn open(pin_dir: &Path) -> anyhow::Result<Self> {
        Ok(Self {
            vips: maps::vips(pin_dir)?,
            slots: maps::vip_backends(pin_dir)?,
            backends: maps::backends(pin_dir)?,
            conns: maps::conns(pin_dir)?,
            stats: maps::stats(pin_dir)?,
            cpus: aya::util::nr_cpus()
                .map_err(|(_, e)| e)
                .context("counting possible CPUs")?,
            tables: TableWriter::open(pin_dir)?,
            scores: ScoreWriter::open(pin_dir)?,
            last: Vec::new(),
            last_relief: Vec::new(),
            times: UpdateTimes::default(),
        })
    }

    /// Writes the plan in an order that never shows the program a
    /// reference to something unwritten: backends and their initial scores,
    /// then slot blocks and their weight-derived tables, then VIPs. VIPs
    /// and backends that are no longer configured (a re-adopted instance
    /// with a changed config) are removed last, except a VIP that reads a
    /// Maglev table, which stops reading it before any table is written
    /// ([`Publisher::move_table_readers`]).
    pub fn write_plan(
        &mut self,
        plan: &Plan,
        initial_scores: &[BackendScore],
    ) -> anyhow::Result<()> {
        for (id, (backend, score)) in plan.backends.iter().zip(initial_scores).enumerate() {
            let id = id as u32;
            self.scores.set(id, score)?;
            self.backends
                .set(id, backend, 0)
                .context("writing BACKENDS")?;
        }
        for vip in &plan.vips {
            for (i, backend_id) in vip.slots.iter().enumerate() {
                self.slots
                    .set(vip.first_slot() + i as u32, backend_id, 0)
                    .context("writing VIP_BACKENDS")?;
            }
        }
        let weights: Vec<u32> = plan.weights.iter().map(|w| w.get()).collect();
        for vip in &plan.vips {
            if let Some(table) = vip.maglev_table {
                self.tables.claim(vip.meta.vip_id, table);
            }
        }
        // From here no VIP in VIPS reads a Maglev table the plan does not
        // keep it on: every other table may be written. (Claimed all the
        // same for a VIP left in VIPS under an id the plan does not give
        // it, in case one still reads one; freed after the grace once
        // removed, below.)
        self.move_table_readers(plan, &weights)?;
        let planned: HashSet<u32> = plan.vips.iter().map(|v| v.meta.vip_id).collect();
        let live_unplanned: Vec<u32> = self
            .vips
            .iter()
            .filter_map(Result::ok)
            .map(|(_, meta)| meta.vip_id)
            .filter(|id| !planned.contains(id))
            .collect();
        self.tables.claim_live(&live_unplanned)?;
        for vip in &plan.vips {
            let slots = planned_slots(vip, &plan.backends, &weights);
            self.tables.write(
                vip.meta.vip_id,
                vip.meta.algorithm,
                vip.maglev_table,
                &slots,
            )?;
        }
        for vip in &plan.vips {
            self.vips
                .insert(vip.key, vip.meta, 0)
                .context("writing VIPS")?;
        }
        self.remove_unplanned(plan)?;
        for id in live_unplanned {
            self.tables.retire(id);
        }
        Ok(())
    }

    /// Before the plan's Maglev tables are written: every VIP in VIPS
    /// that reads a Maglev table the plan does not keep it on stops reading
    /// it first, since that table may be written for another VIP (the plan
    /// gives a new VIP one only when a previous instance's VIPs read every
    /// table, see `Plan::adopting`; a write aside takes any table no
    /// planned VIP claims). One the plan no longer has leaves VIPS; one it
    /// keeps under another algorithm gets its new tables and VIPS entry
    /// now. Then [`TABLE_READER_GRACE`] passes (once, at the start), so no
    /// SYN hashes into a table while it is written with another VIP's
    /// backends. VIPs are matched by key: a VIP's id may be a new VIP's.
    fn move_table_readers(&mut self, plan: &Plan, weights: &[u32]) -> anyhow::Result<()> {
        let planned: Vec<(VipKey, Option<u32>)> =
            plan.vips.iter().map(|v| (v.key, v.maglev_table)).collect();
        let (mut live, mut live_ids) = (Vec::new(), Vec::new());
        for entry in self.vips.iter() {
            let (key, meta) = entry.context("reading VIPS")?;
            if let Some(table) = self.tables.live_maglev_table(meta.vip_id)? {
                live.push((key, table));
                live_ids.push(meta.vip_id);
            }
        }
        let mut readers = readers_to_move(&planned, &live);
        if readers.is_empty() {
            return Ok(());
        }
        // The VIPs the plan no longer has first: a VIP kept under another
        // algorithm writes no Maglev table, but nothing is written while a
        // VIP about to leave still reads one.
        readers.sort_by_key(|&i| plan.vips.iter().any(|v| v.key == live[i].0));
        for i in readers {
            let ((key, table), vip_id) = (live[i], live_ids[i]);
            match plan.vips.iter().find(|v| v.key == key) {
                Some(vip) => {
                    let slots = planned_slots(vip, &plan.backends, weights);
                    let (id, algorithm) = (vip.meta.vip_id, vip.meta.algorithm);
                    self.tables.write(id, algorithm, vip.maglev_table, &slots)?;
                    self.vips
                        .insert(vip.key, vip.meta, 0)
                        .context("writing VIPS")?;
                }
                None => self
                    .vips
                    .remove(&key)
                    .context("removing a VIP no longer configured")?,
            }
            info!(
                vip_id,
                table,
                "a previous VIP stopped reading its Maglev table before the plan's tables are written"
            );
        }
        std::thread::sleep(TABLE_READER_GRACE);
        Ok(())
    }

    /// Removes the VIPs and clears the backends a previous instance wrote
    /// that `plan` no longer has.
    fn remove_unplanned(&mut self, plan: &Plan) -> anyhow::Result<()> {
        let wanted: HashSet<VipKey> = plan.vips.iter().map(|v| v.key).collect();
        let stale: Vec<VipKey> = self
            .vips
            .keys()
            .filter_map(Result::ok)
            .filter(|k| !wanted.contains(k))
            .collect();
        for key in stale {
            self.vips
                .remove(&key)
                .context("removing a VIP no longer configured")?;
            debug!(?key, "removed a VIP that is no longer configured");
        }
        for id in plan.backends.len() as u32..MAX_BACKENDS {
            let old = self.backends.get(&id, 0).context("reading BACKENDS")?;
            if old.in_use != 0 {
                self.backends
                    .set(id, Backend::default(), 0)
                    .context("clearing a backend no longer configured")?;
            }
        }
        Ok(())
    }

    /// Writes VIP `index`'s backends (`entries`: the BACKENDS value of
    /// every member), slot block and count, if anything changed since the
    /// last call (`Selection::same_in_kernel`: the weights only for the
    /// algorithms whose tables are built from them here; P2C reads them
    /// from the scores).
    /// `zone_shares`: for a VIP routing by zone (`selection.zone_blocks`),
    /// each block's share and reference cost, rewritten whenever they move
    /// (the slot layout and tables only when the selection changes).
    /// `relieved`: a P2C VIP to be selected by least connections for now
    /// (`relief::HeldShare`); a change alone rewrites the VIP's VIPS entry
    /// and nothing else.
    pub fn publish_vip(
        &mut self,
        index: usize,
        vip: &FleetVip,
        selection: &Selection,
        entries: &[(u32, Backend)],
        zone_shares: &[(u32, u64)],
        relieved: bool,
    ) -> anyhow::Result<()> {
        if self.last.len() <= index {
            self.last.resize(index + 1, None);
        }
        if self.last_relief.len() <= index {
            self.last_relief.resize(index + 1, None);
        }
        let values: Vec<Backend> = entries.iter().map(|(_, b)| *b).collect();
        let algorithm = vip.meta.algorithm;
        if let Some(last) = &self.last[index]
            && last.algorithm == algorithm
            && selection.same_in_kernel(&last.selection, algorithm)
            && last.entries == values
            && last.removed == vip.removed
        {
            if vip.removed {
                return Ok(());
            }
            if !selection.zone_blocks.is_empty() {
                let (shares, costs): (Vec<u32>, Vec<u64>) = zone_shares.iter().copied().unzip();
                self.tables
                    .update_zone_shares(vip.meta.vip_id, &shares, &costs)
                    .context("writing VIP_ZONES")?;
            }
            if self.last_relief[index] != Some(relieved) {
                self.write_meta(index, vip, selection, relieved)?;
            }
            return Ok(());
        }
        let started = Instant::now();
        faults::check(Fault::TableWrite).context("writing BACKENDS")?;
        // One batch call each (a 1,000-backend VIP: 2 syscalls, not 2,000).
        let ids: Vec<u32> = entries.iter().map(|(id, _)| *id).collect();
        write_block(&mut self.backends, &ids, &values).context("writing BACKENDS")?;
        let first = vip.meta.vip_id * MAX_BACKENDS_PER_VIP;
        let slot_keys: Vec<u32> = (first..first + selection.slots.len() as u32).collect();
        write_block(&mut self.slots, &slot_keys, &selection.slots)
            .context("writing VIP_BACKENDS")?;
        let by_id: std::collections::HashMap<u32, &Backend> =
            entries.iter().map(|(id, b)| (*id, b)).collect();
        let table_slots: Vec<SlotBackend> = selection
            .slots
            .iter()
            .zip(&selection.weights)
            .filter_map(|(&id, &weight)| Some(SlotBackend::new(id, by_id.get(&id)?, weight)))
            .collect();
        if vip.removed {
            // Unknown to the kernel from now on: new connections are passed
            // on as for any other address; established flows are found in
            // the flow table before the VIP is looked up, and finish.
            match self.vips.remove(&vip.key) {
                Ok(()) | Err(aya::maps::MapError::KeyNotFound) => {}
                // Deleted by an earlier tick: the kernel says ENOENT.
                Err(aya::maps::MapError::SyscallError(e))
                    if e.io_error.raw_os_error() == Some(libc::ENOENT) => {}
                Err(e) => return Err(e).context("removing a VIP from VIPS"),
            }
            self.tables.retire(vip.meta.vip_id);
            self.times.record(started);
            self.last[index] = Some(Published {
                algorithm,
                selection: selection.clone(),
                entries: values,
                removed: true,
            });
            return Ok(());
        }
        if vip.maglev_table.is_some() && !self.tables.claim_spare(vip.meta.vip_id) {
            // Every table is read: a removed VIP's is within its grace.
            // Not in VIPS yet; the next tick tries again (`last` unset).
            debug!(vip = %vip.addr, "no Maglev table free yet: the VIP waits a tick");
            return Ok(());
        }
        if selection.zone_blocks.is_empty() || selection.zone_blocks.len() != zone_shares.len() {
            self.tables.clear_zones(vip.meta.vip_id)?;
            self.tables.write(
                vip.meta.vip_id,
                vip.meta.algorithm,
                vip.maglev_table,
                &table_slots,
            )?;
        } else {
            let mut rest = table_slots.as_slice();
            let mut blocks = Vec::with_capacity(zone_shares.len());
            for (&len, &(share, reference_cost)) in selection.zone_blocks.iter().zip(zone_shares) {
                let (block, after) = rest.split_at((len as usize).min(rest.len()));
                rest = after;
                blocks.push(ZoneInput {
                    slots: block.to_vec(),
                    share,
                    reference_cost,
                });
            }
            self.tables.write_zoned(
                vip.meta.vip_id,
                vip.meta.algorithm,
                vip.maglev_table,
                &blocks,
            )?;
        }
        self.write_meta(index, vip, selection, relieved)?;
        self.times.record(started);
        self.last[index] = Some(Published {
            algorithm,
            selection: selection.clone(),
            entries: values,
            removed: false,
        });
        Ok(())
    }

    /// Writes VIP `index`'s VIPS entry: its configuration with the
    /// selection's backend count, relieved (least connections, flagged
    /// [`lb_common::VIP_F_P2C_RELIEF`]) or not.
    fn write_meta(
        &mut self,
        index: usize,
        vip: &FleetVip,
        selection: &Selection,
        relieved: bool,
    ) -> anyhow::Result<()> {
        let meta = VipMeta {
            backend_count: selection.slots.len() as u32,
            ..relieved_meta(vip.meta, relieved)
        };
        self.vips.insert(vip.key, meta, 0).context("writing VIPS")?;
        self.last_relief[index] = Some(relieved);
        Ok(())
    }

    /// Forgets a removed VIP that had index `index` and id `vip_id` once
    /// it is freed (later VIPs move down one index); its Maglev table
    /// becomes a spare.
    pub fn forget_vip(&mut self, index: usize, vip_id: u32) -> anyhow::Result<()> {
        if index < self.last.len() {
            self.last.remove(index);
        }
        if index < self.last_relief.len() {
            self.last_relief.remove(index);
        }
        self.tables.release(vip_id);
        // A new VIP may get this id: it must not find these zone blocks.
        self.tables.clear_zones(vip_id)
    }

    /// Clears the BACKENDS entry of a freed id.
    pub fn clear_backend(&mut self, id: u32) -> anyhow::Result<()> {
        self.backends
            .set(id, Backend::default(), 0)
            .context("clearing BACKENDS")?;
        // The id is freed only when no flow or SNAT tuple holds it, so no
        // packet counts under it any more: the next backend to take it
        // starts from zero instead of showing this one's history
        // (`lb_backend_connections_opened_total`, bytes, `status`).
        self.conns
            .set(id, BackendConns::default(), 0)
            .context("zeroing BACKEND_CONNS")?;
        let zeroed = aya::maps::PerCpuValues::try_from(vec![BackendStats::default(); self.cpus])
            .context("zeroed per-CPU counters")?;
        self.stats
            .set(id, zeroed, 0)
            .context("zeroing BACKEND_STATS")
    }
}

/// The VIPs of `live` (key, the Maglev table it reads) that must stop
/// reading it before the plan's tables are written, as indexes into
/// `live`: each one `planned` (key, Maglev table) does not keep on that
/// same table, gone from the plan or no longer Maglev.
fn readers_to_move<K: PartialEq>(planned: &[(K, Option<u32>)], live: &[(K, u32)]) -> Vec<usize> {
    live.iter()
        .enumerate()
        .filter(|(_, (key, table))| !planned.iter().any(|(k, t)| k == key && *t == Some(*table)))
        .map(|(i, _)| i)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A VIP the plan keeps on its own table reads on; one dropped from
    /// the plan, or kept under another algorithm, stops first (its table
    /// may be given to a new VIP, or taken as a spare by a write aside).
    #[test]
    fn only_a_vip_the_plan_keeps_on_its_table_reads_on() {
        let planned = [
            ("a", Some(0)),
            ("b", Some(1)),
            ("k", None),
            ("new", Some(2)),
        ];
        let none: [usize; 0] = [];
        assert_eq!(readers_to_move(&planned, &[("a", 0), ("b", 1)]), none);
        // Dropped (its table given to the new VIP, or to no one).
        assert_eq!(readers_to_move(&planned, &[("a", 0), ("gone", 2)]), [1]);
        assert_eq!(readers_to_move(&planned, &[("gone", 5), ("b", 1)]), [0]);
        // Kept, but no longer Maglev.
        assert_eq!(readers_to_move(&planned, &[("k", 3), ("a", 0)]), [0]);
        assert_eq!(readers_to_move(&[], &[("a", 0)]), [0]);
        assert_eq!(readers_to_move(&planned, &[]), none);
    }
}
