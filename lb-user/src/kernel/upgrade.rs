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

use std::path::Path;

use anyhow::{Context as _, anyhow, bail};
use aya::{
    EbpfLoader,
    maps::MapInfo,
    programs::{links::FdLink, loaded_programs, xdp::XdpLink},
};
use lb_common::{ALL_MAPS, EVENTS_MAP, FLOWS_MAP, FLOWS4_MAP, XDP_PROGRAM};
use tracing::info;

use crate::kernel::{
    flow_tables,
    object::{EBPF_OBJECT, MapLayout, load_program, map_layouts},
};

/// Whether a pinned map can serve as the map `name` that this build's
/// object declares as `wanted`: same key and value sizes, and the same
/// length except for the flow table (sized by `--flow-table-size`) and the
/// ring buffer (whose length is bytes, not entries).
fn layout_fits(name: &str, pinned: MapLayout, wanted: MapLayout) -> bool {
    let sized_elsewhere = name == FLOWS_MAP || name == FLOWS4_MAP || name == EVENTS_MAP;
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

/// Swaps this build's program into `link` if it differs from the running
/// one (or if `force`). Returns the link and the program id now attached.
pub fn upgrade_if_needed(
    pin_dir: &Path,
    link: FdLink,
    program_id: u32,
    force: bool,
) -> anyhow::Result<(FdLink, u32)> {
    let mut loader = EbpfLoader::new();
    for name in ALL_MAPS {
        // Existing pins are reused as they are; a map new in this build is
        // created and pinned.
        loader.map_pin_path(name, pin_dir.join(name));
    }
    // IPv4's flow table, new to a program of an older build, is created as
    // large as the pinned table that held both families.
    let flow_entries = MapInfo::from_pin(pin_dir.join(FLOWS_MAP))
        .context("opening the pinned flow table")?
        .max_entries();
    loader.map_max_entries(FLOWS4_MAP, flow_entries);
    check_layout(pin_dir)?;
    let mut ebpf = loader
        .load(EBPF_OBJECT)
        .map_err(|e| anyhow!("loading the eBPF object against the pinned maps: {e}"))?;
    let program = load_program(&mut ebpf)?;
    let new_tag = program.info().context("reading the new program")?.tag();
    let old_tag = tag_of(program_id);
    if old_tag == Some(new_tag) && !force {
        return Ok((link, program_id));
    }
    // The old program may keep IPv4 flows in FLOWS (a build before IPv4's
    // own table): copied into FLOWS4 before the swap, so the new program
    // finds them; after it, what the old one created meanwhile is moved
    // too, and FLOWS keeps IPv6's entries only.
    let copied = flow_tables::move_ipv4_entries(pin_dir, false)?;
    let xdp_link = XdpLink::try_from(link).context("the pinned link is not an XDP link")?;
    let link_id = program
        .attach_to_link(xdp_link)
        .map_err(|e| anyhow!("replacing the program on the pinned link: {e}"))?;
    let moved_late = flow_tables::move_ipv4_entries(pin_dir, true)?;
    if copied + moved_late > 0 {
        info!(
            copied,
            moved_late, "moved the old program's IPv4 flow entries into IPv4's own table (FLOWS4)"
        );
    }
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
    Ok((link, new_id))
}

#[cfg(test)]
mod tests {
    use std::mem::size_of;

    use lb_common::{
        BACKENDS_MAP, Backend, FlowEntry, FlowKey, REASON_STATS_MAP, VIPS_MAP, VipKey, VipMeta,
        reason,
    };

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
        assert!(layout_fits(FLOWS_MAP, l(40, 64, 1024), l(40, 64, 262_144)));
        assert!(!layout_fits(FLOWS_MAP, l(40, 72, 1024), l(40, 64, 1024)));
        // The same sizes in a map of another type (an older build's LRU
        // flow table) do not fit either.
        let lru = MapLayout {
            map_type: LRU_HASH,
            ..l(40, 64, 1024)
        };
        assert!(!layout_fits(FLOWS_MAP, lru, l(40, 64, 1024)));
    }

    #[test]
    fn the_flow_table_is_a_plain_hash() {
        // BPF_MAP_TYPE_HASH: nothing evicts one direction of a connection.
        assert_eq!(map_layouts().unwrap()[FLOWS_MAP].map_type, 1);
    }
}
