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

use std::{mem::size_of, path::Path};

use anyhow::{Context as _, anyhow, bail};
use aya::{
    EbpfLoader,
    maps::MapInfo,
    programs::{links::FdLink, loaded_programs, xdp::XdpLink},
};
use lb_common::{
    ALL_MAPS, BACKEND_CONNS_MAP, BACKEND_CORRECTION_MAP, BACKEND_PROGRESS_MAP, BACKEND_SCORES_MAP,
    BACKEND_STATS_MAP, BACKENDS_MAP, Backend, BackendConns, BackendScore, BackendStats, CONFIG_MAP,
    FLOWS_MAP, FlowEntry, FlowKey, IpKey, LbConfig, MAGLEV_MAP, NEIGHBOURS_MAP,
    NEW_FLOW_BUCKETS_MAP, NEW_FLOW_LIMIT_MAP, Neighbour, NewFlowLimit, REASON_STATS_MAP,
    TokenBucket, VIP_BACKENDS_MAP, VIP_SCHEDULE_MAP, VIP_STATE_MAP, VIP_TABLES_MAP,
    VIP_WEIGHT_PREFIX_MAP, VIPS_MAP, VipKey, VipMeta, VipState, VipTables, XDP_PROGRAM, reason,
};
use tracing::info;

use crate::EBPF_OBJECT;

/// `(map, key size, value size)` this build's program expects.
fn expected_layout() -> [(&'static str, usize, usize); 19] {
    [
        (VIPS_MAP, size_of::<VipKey>(), size_of::<VipMeta>()),
        (VIP_BACKENDS_MAP, 4, 4),
        (VIP_STATE_MAP, 4, size_of::<VipState>()),
        (BACKENDS_MAP, 4, size_of::<Backend>()),
        (BACKEND_SCORES_MAP, 4, size_of::<BackendScore>()),
        (BACKEND_CONNS_MAP, 4, size_of::<BackendConns>()),
        (BACKEND_CORRECTION_MAP, 4, 8),
        (BACKEND_STATS_MAP, 4, size_of::<BackendStats>()),
        (FLOWS_MAP, size_of::<FlowKey>(), size_of::<FlowEntry>()),
        (NEIGHBOURS_MAP, size_of::<IpKey>(), size_of::<Neighbour>()),
        (CONFIG_MAP, 4, size_of::<LbConfig>()),
        (REASON_STATS_MAP, 4, 8),
        (NEW_FLOW_LIMIT_MAP, 4, size_of::<NewFlowLimit>()),
        (NEW_FLOW_BUCKETS_MAP, 4, size_of::<TokenBucket>()),
        (VIP_TABLES_MAP, 4, size_of::<VipTables>()),
        (VIP_SCHEDULE_MAP, 4, 4),
        (VIP_WEIGHT_PREFIX_MAP, 4, 4),
        (MAGLEV_MAP, 4, 4),
        (BACKEND_PROGRESS_MAP, 4, 8),
    ]
}

/// Refuses pinned maps whose layout this build's program cannot use.
fn check_layout(pin_dir: &Path) -> anyhow::Result<()> {
    for (name, key, value) in expected_layout() {
        let path = pin_dir.join(name);
        if !path.exists() {
            continue;
        }
        let info = MapInfo::from_pin(&path).with_context(|| format!("inspecting {name}"))?;
        let reasons_differ = name == REASON_STATS_MAP && info.max_entries() != reason::COUNT;
        if info.key_size() as usize != key || info.value_size() as usize != value || reasons_differ
        {
            bail!(
                "cannot upgrade in place: the pinned map {name} has another layout than this build \
                 (key {} value {} entries {}); stop the old instance cleanly (its flows end) and start again",
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
    check_layout(pin_dir)?;
    let mut ebpf = loader
        .load(EBPF_OBJECT)
        .map_err(|e| anyhow!("loading the eBPF object against the pinned maps: {e}"))?;
    let program = crate::loader::load_program(&mut ebpf)?;
    let new_tag = program.info().context("reading the new program")?.tag();
    let old_tag = tag_of(program_id);
    if old_tag == Some(new_tag) && !force {
        return Ok((link, program_id));
    }
    let xdp_link = XdpLink::try_from(link).context("the pinned link is not an XDP link")?;
    let link_id = program
        .attach_to_link(xdp_link)
        .map_err(|e| anyhow!("replacing the program on the pinned link: {e}"))?;
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
    use super::*;

    #[test]
    fn the_layout_covers_every_map_but_the_ring_buffer() {
        let names: Vec<_> = expected_layout().iter().map(|(n, ..)| *n).collect();
        for name in ALL_MAPS {
            assert!(
                names.contains(name) || *name == lb_common::EVENTS_MAP,
                "{name}"
            );
        }
    }
}
