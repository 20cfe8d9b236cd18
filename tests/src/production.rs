//! Everything the test kit takes from the control plane (`lb-user`), in one
//! place: the eBPF object it embeds, its list of algorithms, and its pure
//! table builders and table writer. Tests import these from here, so a move
//! inside lb-user is a change to this file only. (Map names and layouts come
//! from `lb_common`, which the kernel and the control plane share.)
use std::path::Path;

pub use lb_user::publish::writers::PendingFlip;
use lb_user::publish::{
    tables::{ScoreIndex, median_cost},
    writers::TableWriter,
};
pub use lb_user::{
    EBPF_OBJECT,
    publish::{
        tables::{SlotBackend, VipTableSet},
        zone_tables::{ZoneInput, ZoneTableSet, build as build_zone_tables},
    },
    settings::algorithm::ALL as ALGORITHMS,
};

/// Writes VIP `vip_id`'s tables with the control plane's own writer, through
/// the table maps pinned in `pin_dir`.
pub fn write_tables(
    pin_dir: &Path,
    vip_id: u32,
    algorithm: u8,
    maglev_table: Option<u32>,
    slots: &[SlotBackend],
) -> anyhow::Result<()> {
    TableWriter::open(pin_dir)?.write(vip_id, algorithm, maglev_table, slots)
}

/// The reference cost the control plane writes for a VIP whose slot
/// backends have these `scores` (by backend id): P2C's re-draw bound is
/// `lb_common::p2c::redraw_bound` of it.
pub fn reference_cost(scores: &[(u32, lb_common::BackendScore)]) -> u64 {
    let slots: Vec<u32> = scores.iter().map(|(id, _)| *id).collect();
    let index = ScoreIndex::of(scores);
    median_cost(&slots, scores, &index)
}

/// Whether the control plane's writer maps `MAGLEV` into memory (so its
/// tables are written with plain stores) for the maps pinned in `pin_dir`.
pub fn maglev_mapped(pin_dir: &Path) -> anyhow::Result<bool> {
    Ok(TableWriter::open(pin_dir)?.maglev_mapped())
}

/// Writes the zone-aware VIP `vip_id`'s tables for its zone `blocks` (in
/// failover order) and then its `VIP_ZONES` descriptor, with the control
/// plane's own writer, through the maps pinned in `pin_dir` (the table maps
/// and VIP_ZONES).
pub fn write_zone_tables(
    pin_dir: &Path,
    vip_id: u32,
    algorithm: u8,
    maglev_table: Option<u32>,
    blocks: &[ZoneInput],
) -> anyhow::Result<()> {
    TableWriter::open(pin_dir)?.write_zoned(vip_id, algorithm, maglev_table, blocks)
}

/// Writes VIP `vip_id`'s tables as a restarted control plane's writer
/// does: it claims the Maglev tables its plan names (`planned`: VIP id and
/// table) and, when `live` is given, the tables the kernel still reads for
/// those VIP ids (VIPs of the previous instance the plan does not name),
/// then writes.
pub fn write_tables_after_restart(
    pin_dir: &Path,
    planned: &[(u32, u32)],
    live: Option<&[u32]>,
    vip_id: u32,
    algorithm: u8,
    slots: &[SlotBackend],
) -> anyhow::Result<()> {
    let mut writer = TableWriter::open(pin_dir)?;
    for &(id, table) in planned {
        writer.claim(id, table);
    }
    if let Some(live) = live {
        writer.claim_live(live)?;
    }
    let table = planned.iter().find(|(id, _)| *id == vip_id).map(|p| p.1);
    writer.write(vip_id, algorithm, table, slots)
}

/// The first half of [`write_tables`]: VIP `vip_id`'s next tables written
/// where the kernel does not read them (the spare half, a spare Maglev
/// table), with the control plane's own writer. The kernel keeps the
/// tables it had until [`flip_tables`] gets the result.
pub fn write_tables_aside(
    pin_dir: &Path,
    vip_id: u32,
    algorithm: u8,
    maglev_table: Option<u32>,
    slots: &[SlotBackend],
) -> anyhow::Result<PendingFlip> {
    TableWriter::open(pin_dir)?.write_aside(vip_id, algorithm, maglev_table, slots)
}

/// [`write_tables_aside`] for a zone-aware VIP: its zone descriptor is
/// written by the flip.
pub fn write_zone_tables_aside(
    pin_dir: &Path,
    vip_id: u32,
    algorithm: u8,
    maglev_table: Option<u32>,
    blocks: &[ZoneInput],
) -> anyhow::Result<PendingFlip> {
    TableWriter::open(pin_dir)?.write_zoned_aside(vip_id, algorithm, maglev_table, blocks)
}

/// Switches the kernel to the tables written aside: the descriptor writes
/// of the control plane's writer.
pub fn flip_tables(pin_dir: &Path, flip: PendingFlip) -> anyhow::Result<()> {
    TableWriter::open(pin_dir)?.flip(flip)
}

/// Removes VIP `vip_id`'s zone descriptor with the control plane's writer
/// (a VIP without one is no error).
pub fn clear_zones(pin_dir: &Path, vip_id: u32) -> anyhow::Result<()> {
    TableWriter::open(pin_dir)?.clear_zones(vip_id)
}

/// Writes the zone-aware VIP's tables and descriptor like
/// [`write_zone_tables`], then applies each of `updates` (shares and
/// reference costs, one per block) with the same writer's
/// `update_zone_shares`; returns whether each update wrote.
pub fn write_zone_tables_then_shares(
    pin_dir: &Path,
    vip_id: u32,
    algorithm: u8,
    blocks: &[ZoneInput],
    updates: &[(Vec<u32>, Vec<u64>)],
) -> anyhow::Result<Vec<bool>> {
    let mut writer = TableWriter::open(pin_dir)?;
    writer.write_zoned(vip_id, algorithm, Some(0), blocks)?;
    updates
        .iter()
        .map(|(shares, costs)| writer.update_zone_shares(vip_id, shares, costs))
        .collect()
}

/// Maglev table `table` of the instance pinned in `pin_dir`, as backend ids
/// (read through the control plane's own map opener).
/// The Maglev table VIP `vip_id` reads now: tables are built aside and
/// swapped, so its descriptor in VIP_TABLES names the one in use.
pub fn read_vip_maglev_table(pin_dir: &Path, vip_id: u32) -> anyhow::Result<Vec<u32>> {
    let tables = lb_user::kernel::maps::vip_tables(pin_dir)?;
    let descriptor = tables.get(&vip_id, 0)?;
    anyhow::ensure!(
        descriptor.has_maglev != 0,
        "VIP {vip_id} has no Maglev table"
    );
    read_maglev_table(pin_dir, descriptor.maglev_table)
}

pub fn read_maglev_table(pin_dir: &Path, table: u32) -> anyhow::Result<Vec<u32>> {
    let map = lb_user::kernel::maps::maglev(pin_dir)?;
    let size = lb_common::MAGLEV_TABLE_SIZE;
    (0..size)
        .map(|i| Ok(map.get(&(table * size + i), 0)?))
        .collect()
}
