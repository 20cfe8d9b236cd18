//! Publishing a VIP's selectable backends and effective weights to the
//! kernel: [`Publisher::publish_vip`] is the one place that rewrites a
//! VIP's slot block, and it rebuilds the VIP's weight-derived tables
//! (smooth-WRR schedule, weighted-random sums, Maglev table; see
//! [`crate::tables`]) from the slot ids and effective weights with it.
//!
//! Order matters, because the program reads the maps while they change:
//! backend states first (a backend leaving service is refused by the
//! program's state check at once, even while its id is still in a slot),
//! then the slot block and its tables, then the VIP's backend count.

use std::{
    path::{Path, PathBuf},
    time::Instant,
};

use anyhow::Context as _;
use lb_common::{Backend, MAX_BACKENDS_PER_VIP, VipMeta};

use crate::{
    fleet::{FleetVip, Selection},
    maps::{self, Backends, VipBackends, Vips},
    tables::{self, SlotBackend},
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

pub struct Publisher {
    pin_dir: PathBuf,
    vips: Vips,
    slots: VipBackends,
    backends: Backends,
    /// What each VIP last got, so unchanged VIPs cost nothing.
    last: Vec<Option<(Selection, Vec<Backend>)>>,
    pub times: UpdateTimes,
}

impl Publisher {
    pub fn open(pin_dir: &Path) -> anyhow::Result<Self> {
        Ok(Self {
            pin_dir: pin_dir.to_path_buf(),
            vips: maps::vips(pin_dir)?,
            slots: maps::vip_backends(pin_dir)?,
            backends: maps::backends(pin_dir)?,
            last: Vec::new(),
            times: UpdateTimes::default(),
        })
    }

    /// Writes VIP `index`'s backends (`entries`: the BACKENDS value of
    /// every member), slot block and count, if anything changed since the
    /// last call (weights included: P2C reads them from the scores, the
    /// per-VIP tables of other algorithms are rebuilt from them here).
    pub fn publish_vip(
        &mut self,
        index: usize,
        vip: &FleetVip,
        selection: &Selection,
        entries: &[(u32, Backend)],
    ) -> anyhow::Result<()> {
        if self.last.len() <= index {
            self.last.resize(index + 1, None);
        }
        let values: Vec<Backend> = entries.iter().map(|(_, b)| *b).collect();
        if let Some((s, b)) = &self.last[index]
            && s == selection
            && *b == values
        {
            return Ok(());
        }
        let started = Instant::now();
        for (id, backend) in entries {
            self.backends
                .set(*id, backend, 0)
                .context("writing BACKENDS")?;
        }
        let first = vip.meta.vip_id * MAX_BACKENDS_PER_VIP;
        for (i, id) in selection.slots.iter().enumerate() {
            self.slots
                .set(first + i as u32, id, 0)
                .context("writing VIP_BACKENDS")?;
        }
        let table_slots: Vec<SlotBackend> = selection
            .slots
            .iter()
            .zip(&selection.weights)
            .filter_map(|(&id, &weight)| {
                let (_, backend) = entries.iter().find(|(e, _)| *e == id)?;
                Some(SlotBackend::new(id, backend, weight))
            })
            .collect();
        tables::write_tables(
            &self.pin_dir,
            vip.meta.vip_id,
            vip.meta.algorithm,
            vip.maglev_table,
            &table_slots,
        )?;
        let meta = VipMeta {
            backend_count: selection.slots.len() as u32,
            ..vip.meta
        };
        self.vips.insert(vip.key, meta, 0).context("writing VIPS")?;
        self.times.record(started);
        self.last[index] = Some((selection.clone(), values));
        Ok(())
    }

    /// Clears the BACKENDS entry of a freed id.
    pub fn clear_backend(&mut self, id: u32) -> anyhow::Result<()> {
        self.backends
            .set(id, Backend::default(), 0)
            .context("clearing BACKENDS")
    }
}
