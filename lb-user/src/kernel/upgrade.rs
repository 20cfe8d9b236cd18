//! Replacing a running XDP program with this binary's, without losing a
//! packet or a flow: the new program is loaded against the pinned maps
//! (flow table, counters, SNAT state all kept) and swapped into the pinned
//! bpf_link with `bpf_link_update`, which the kernel does atomically: every
//! packet runs either the old or the new program.
//!
//! It happens on re-adoption when the running program's tag (a hash of its
//! instructions) differs from the embedded one, or always with `--upgrade`.
//! The maps must keep their layout: if a pinned map's key or value size (or
//! the reason counters' length) differs from what this build expects, the
//! swap is refused with a clear error.
//!
//! An upgrade from a build before the flow table's split by family (one
//! `FLOWS` of 40-byte keys for both families) finds no pinned `FLOWS4`: the
//! loader creates it, sized like the pinned `FLOWS`, and the IPv4 flows move
//! into it ([`copy_v4_flows`] before the swap, [`move_v4_flows`] after),
//! since the new program looks IPv4 flows up in `FLOWS4` only.

use std::{
    borrow::{Borrow, BorrowMut},
    path::Path,
};

use anyhow::{Context as _, anyhow, bail};
use aya::{
    EbpfLoader,
    maps::{HashMap, MapData, MapInfo},
    programs::{links::FdLink, loaded_programs, xdp::XdpLink},
};
use lb_common::{
    ALL_MAPS, EVENTS_MAP, FLOWS_MAP, FLOWS4_MAP, FlowEntry, FlowKey, FlowKey4, XDP_PROGRAM,
};
use tracing::{info, warn};

use crate::kernel::{
    maps,
    object::{EBPF_OBJECT, MapLayout, load_program, map_layouts},
};

/// Whether a pinned map can serve as the map `name` that this build's
/// object declares as `wanted`: same key and value sizes, and the same
/// length except for the flow tables (sized by `--flow-table-size`) and the
/// ring buffer (whose length is bytes, not entries).
fn layout_fits(name: &str, pinned: MapLayout, wanted: MapLayout) -> bool {
    let sized_elsewhere = name == FLOWS4_MAP || name == FLOWS_MAP || name == EVENTS_MAP;
    pinned.map_type == wanted.map_type
        && pinned.key_size == wanted.key_size
        && pinned.value_size == wanted.value_size
        && (sized_elsewhere || pinned.max_entries == wanted.max_entries)
}

/// Refuses pinned maps whose layout this build's program cannot use: every
/// map of [`ALL_MAPS`] that is pinned is compared with the embedded
/// object's definition of it.
fn check_layout(pin_dir: &Path) -> anyhow::Result<()> {
    let wanted = map_layouts()?;
    for name in ALL_MAPS {
        let path = pin_dir.join(name);
        if !path.exists() {
            continue;
        }
        let want = *wanted
            .get(*name)
            .ok_or_else(|| anyhow!("the eBPF object has no map {name}"))?;
        let info = MapInfo::from_pin(&path).with_context(|| format!("inspecting {name}"))?;
        let map_type = info.map_type().map(|t| t as u32).map_err(|e| {
            anyhow!("the pinned map {name} has a type this build does not know: {e}")
        })?;
        let pinned = MapLayout {
            map_type,
            key_size: info.key_size(),
            value_size: info.value_size(),
            max_entries: info.max_entries(),
        };
        if !layout_fits(name, pinned, want) {
            bail!(
                "cannot upgrade in place: the pinned map {name} has another layout than this build \
                 (type {map_type} key {} value {} entries {}); stop the old instance cleanly (its flows end) \
                 and start again",
                info.key_size(),
                info.value_size(),
                info.max_entries()
            );
        }
    }
    Ok(())
}

fn tag_of(program_id: u32) -> Option<u64> {
    loaded_programs()
        .filter_map(Result::ok)
        .find(|p| p.id() == program_id)
        .map(|p| p.tag())
}

/// What a pass of the IPv4 flows' move from `FLOWS` to `FLOWS4` did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct V4Move {
    /// Entries copied into `FLOWS4`.
    pub copied: usize,
    /// IPv4 entries removed from `FLOWS` (each one `FLOWS4` holds).
    pub removed: usize,
    /// IPv4 entries `FLOWS4` could not take (full): they stay in `FLOWS`
    /// for the sweep to age out.
    pub failed: usize,
}

/// Copies every IPv4 entry of `flows` (the single flow table of a build
/// before the split by family) into `flows4` where it has none yet
/// (`BPF_NOEXIST`: an entry the new program made stays). Entries removed
/// during the walk are skipped.
pub fn copy_v4_flows<A, B>(
    flows: &HashMap<A, FlowKey, FlowEntry>,
    flows4: &mut HashMap<B, FlowKey4, FlowEntry>,
) -> V4Move
where
    A: Borrow<MapData>,
    B: BorrowMut<MapData>,
{
    let mut moved = V4Move::default();
    for (key, entry) in flows.iter().filter_map(Result::ok) {
        if !key.is_v4() {
            continue;
        }
        let key4 = key.compact();
        if flows4.insert(key4, entry, BPF_NOEXIST).is_ok() {
            moved.copied += 1;
        } else if flows4.get(&key4, 0).is_err() {
            // Not a key already there: the table is full.
            moved.failed += 1;
        }
    }
    moved
}

/// Finishes the move once the new program runs: copies again what the old
/// program created since [`copy_v4_flows`], then removes from `flows` every
/// IPv4 key that `flows4` holds, leaving `flows` to IPv6.
pub fn move_v4_flows<A, B>(
    flows: &mut HashMap<A, FlowKey, FlowEntry>,
    flows4: &mut HashMap<B, FlowKey4, FlowEntry>,
) -> V4Move
where
    A: BorrowMut<MapData>,
    B: BorrowMut<MapData>,
{
    let mut moved = copy_v4_flows(flows, flows4);
    // Collected first: removing while walking restarts the kernel's walk.
    let v4: Vec<FlowKey> = flows
        .keys()
        .filter_map(Result::ok)
        .filter(FlowKey::is_v4)
        .collect();
    for key in v4 {
        if flows4.get(&key.compact(), 0).is_ok() && flows.remove(&key).is_ok() {
            moved.removed += 1;
        }
    }
    moved
}

/// `bpf_map_update_elem`'s flag: only where the key has no entry.
const BPF_NOEXIST: u64 = 1;

/// Swaps this build's program into `link` if it differs from the running
/// one (or if `force`, or if the IPv4 flows must move to a new `FLOWS4`).
/// Returns the link and the program id now attached.
pub fn upgrade_if_needed(
    pin_dir: &Path,
    link: FdLink,
    program_id: u32,
    force: bool,
) -> anyhow::Result<(FdLink, u32)> {
    // No FLOWS4: the running program predates the split, and its IPv4
    // flows are in FLOWS.
    let split = !pin_dir.join(FLOWS4_MAP).exists();
    // Until the swap, a failure leaves the old program running with its
    // one table: the FLOWS4 the loader pins is then taken away again, so
    // that the next attempt moves the IPv4 flows too.
    let mut unpin = UnpinOnError(split.then(|| pin_dir.join(FLOWS4_MAP)));
    let mut loader = EbpfLoader::new();
    for name in ALL_MAPS {
        // Existing pins are reused as they are; a map new in this build is
        // created and pinned.
        loader.map_pin_path(name, pin_dir.join(name));
    }
    if split {
        let flows =
            MapInfo::from_pin(pin_dir.join(FLOWS_MAP)).context("opening the pinned flow table")?;
        loader.map_max_entries(FLOWS4_MAP, flows.max_entries());
    }
    check_layout(pin_dir)?;
    let mut ebpf = loader
        .load(EBPF_OBJECT)
        .map_err(|e| anyhow!("loading the eBPF object against the pinned maps: {e}"))?;
    let program = load_program(&mut ebpf)?;
    let new_tag = program.info().context("reading the new program")?.tag();
    let old_tag = tag_of(program_id);
    // After a split the swap is due whatever the tags say: the running
    // program cannot be using the FLOWS4 just created.
    if old_tag == Some(new_tag) && !force && !split {
        return Ok((link, program_id));
    }
    let mut tables = if split {
        let mut tables = maps::FlowTables::open(pin_dir)?;
        let before = copy_v4_flows(&tables.v6, &mut tables.v4);
        info!(
            copied = before.copied,
            failed = before.failed,
            "copied the IPv4 flows of FLOWS into the new FLOWS4 before the swap"
        );
        Some(tables)
    } else {
        None
    };
    let xdp_link = XdpLink::try_from(link).context("the pinned link is not an XDP link")?;
    let link_id = program
        .attach_to_link(xdp_link)
        .map_err(|e| anyhow!("replacing the program on the pinned link: {e}"))?;
    // The new program runs with FLOWS4 now: its pin stays, whatever follows.
    unpin.disarm();
    let link: FdLink = program
        .take_link(link_id)?
        .try_into()
        .context("the replaced link is no bpf_link")?;
    let new_id = link.info().context("reading the XDP link")?.program_id();
    info!(
        old_program_id = program_id,
        new_program_id = new_id,
        old_tag = ?old_tag.map(|t| format!("{t:016x}")),
        new_tag = %format!("{new_tag:016x}"),
        "upgraded {XDP_PROGRAM} in place (atomic bpf_link_update); flows, counters and maps kept"
    );
    if let Some(tables) = tables.as_mut() {
        let after = move_v4_flows(&mut tables.v6, &mut tables.v4);
        info!(
            copied_after_swap = after.copied,
            removed_from_flows = after.removed,
            "moved the IPv4 flows from FLOWS to FLOWS4 (IPv4 entries moved: {})",
            after.removed
        );
        if after.failed > 0 {
            warn!(
                failed = after.failed,
                "FLOWS4 is full: IPv4 flows left in FLOWS, where the new program no longer finds them"
            );
        }
    }
    Ok((link, new_id))
}

/// Removes a pin (if there is one) when dropped, unless disarmed.
struct UnpinOnError(Option<std::path::PathBuf>);

impl UnpinOnError {
    fn disarm(&mut self) {
        self.0 = None;
    }
}

impl Drop for UnpinOnError {
    fn drop(&mut self) {
        let Some(path) = self.0.take() else { return };
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                warn!("removing {} after a failed upgrade: {e}", path.display());
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::mem::size_of;

    use lb_common::{BACKENDS_MAP, Backend, REASON_STATS_MAP, VIPS_MAP, VipKey, VipMeta, reason};

    use super::*;

    #[test]
    fn the_object_defines_every_map_the_layout_check_covers() {
        let layouts = map_layouts().unwrap();
        for name in ALL_MAPS {
            assert!(layouts.contains_key(*name), "{name}");
        }
    }

    #[test]
    fn the_objects_layouts_are_lb_commons_types() {
        let layouts = map_layouts().unwrap();
        let sizes = |name: &str| {
            let l = layouts[name];
            (l.key_size as usize, l.value_size as usize)
        };
        assert_eq!(sizes(VIPS_MAP), (size_of::<VipKey>(), size_of::<VipMeta>()));
        assert_eq!(sizes(BACKENDS_MAP), (4, size_of::<Backend>()));
        assert_eq!(
            sizes(FLOWS_MAP),
            (size_of::<FlowKey>(), size_of::<FlowEntry>())
        );
        assert_eq!(
            sizes(FLOWS4_MAP),
            (size_of::<FlowKey4>(), size_of::<FlowEntry>())
        );
        assert_eq!(layouts[REASON_STATS_MAP].max_entries, reason::COUNT);
    }

    #[test]
    fn a_pinned_map_fits_only_with_the_same_layout() {
        const HASH: u32 = 1;
        const LRU_HASH: u32 = 9;
        let l = |key_size, value_size, max_entries| MapLayout {
            map_type: HASH,
            key_size,
            value_size,
            max_entries,
        };
        assert!(layout_fits(BACKENDS_MAP, l(4, 40, 8), l(4, 40, 8)));
        assert!(!layout_fits(BACKENDS_MAP, l(4, 48, 8), l(4, 40, 8)));
        assert!(!layout_fits(REASON_STATS_MAP, l(4, 8, 30), l(4, 8, 31)));
        // Both flow tables may differ in length (--flow-table-size), not in
        // their key or value.
        assert!(layout_fits(FLOWS_MAP, l(40, 96, 1024), l(40, 96, 262_144)));
        assert!(!layout_fits(FLOWS_MAP, l(40, 72, 1024), l(40, 96, 1024)));
        assert!(layout_fits(FLOWS4_MAP, l(16, 96, 1024), l(16, 96, 262_144)));
        assert!(!layout_fits(FLOWS4_MAP, l(40, 96, 1024), l(16, 96, 1024)));
        assert!(!layout_fits(FLOWS4_MAP, l(16, 64, 1024), l(16, 96, 1024)));
        // The same sizes in a map of another type (an older build's LRU
        // flow table) do not fit either.
        let lru = MapLayout {
            map_type: LRU_HASH,
            ..l(40, 96, 1024)
        };
        assert!(!layout_fits(FLOWS_MAP, lru, l(40, 96, 1024)));
    }

    #[test]
    fn the_flow_tables_are_plain_hashes() {
        // BPF_MAP_TYPE_HASH: nothing evicts one direction of a connection.
        assert_eq!(map_layouts().unwrap()[FLOWS_MAP].map_type, 1);
        assert_eq!(map_layouts().unwrap()[FLOWS4_MAP].map_type, 1);
    }
}
