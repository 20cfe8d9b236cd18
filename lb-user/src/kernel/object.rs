//! The XDP object this binary carries, and the two things done with it
//! wherever it is loaded (a fresh attach or an in-place upgrade): loading
//! its program through the verifier, and reading the map definitions it
//! declares.

use anyhow::{Context as _, anyhow};
use aya::programs::Xdp;
use lb_common::XDP_PROGRAM;

/// The compiled XDP object (built by `build.rs`), embedded so the one binary is
/// all a server needs.
pub static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lb-ebpf"));

/// Takes `lb_xdp` out of a loaded object and loads it into the kernel
/// (through the verifier), for a fresh attach or an in-place upgrade.
pub fn load_program(ebpf: &mut aya::Ebpf) -> anyhow::Result<&mut Xdp> {
    let program: &mut Xdp = ebpf
        .program_mut(XDP_PROGRAM)
        .ok_or_else(|| anyhow!("the eBPF object has no program {XDP_PROGRAM}"))?
        .try_into()
        .context("lb_xdp is not an XDP program")?;
    program
        .load()
        .map_err(|e| anyhow!("loading {XDP_PROGRAM} into the kernel: {e}"))?;
    Ok(program)
}

/// The layout the embedded object declares for one map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapLayout {
    /// The kernel's `bpf_map_type` (e.g. the flow table became a plain hash
    /// where it was an LRU: same sizes, other behaviour).
    pub map_type: u32,
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
}

/// The layout of every map the embedded object declares, by name (parsed
/// from the ELF file, without the kernel).
pub fn map_layouts() -> anyhow::Result<std::collections::HashMap<String, MapLayout>> {
    let object = aya_obj::Object::parse(EBPF_OBJECT)
        .map_err(|e| anyhow!("parsing the embedded eBPF object: {e}"))?;
    Ok(object
        .maps
        .iter()
        .map(|(name, map)| {
            let layout = MapLayout {
                map_type: map.map_type(),
                key_size: map.key_size(),
                value_size: map.value_size(),
                max_entries: map.max_entries(),
            };
            (name.clone(), layout)
        })
        .collect())
}
