//! Loading, attaching and pinning the XDP program, re-adopting a pinned one
//! after a crash, and taking it all down again.
//!
//! Fresh start: load [`crate::EBPF_OBJECT`] with the flow tables sized from
//! the config (`FLOWS4` by `--flow-table-size`, `FLOWS` by
//! `--flow-table-size-ipv6`), pin every map under the instance's pin
//! directory, attach `lb_xdp` with a bpf_link and pin the link. From then
//! on every user of the maps (runtime tasks, `status`) opens them from
//! their pins.
//!
//! Re-adoption: if the pin directory already holds a link (the previous
//! process died without cleaning up, e.g. SIGKILL) and that link's program
//! is the one attached to the interface here, nothing is loaded or
//! re-attached: the program keeps running with its flow table, counters and
//! SNAT state, so established flows never notice; the control plane just
//! rewrites VIPs, backends and config. A link that is no longer attached to
//! this interface (the interface was deleted, the pins came from another
//! network namespace) is stale: its pins are removed and the start is fresh.

use std::{
    fs,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context as _, anyhow, bail};
use aya::{
    EbpfLoader,
    maps::MapInfo,
    programs::{
        XdpMode as AyaXdpMode,
        links::{FdLink, PinnedLink},
        loaded_programs,
    },
};
use lb_common::{
    ALL_MAPS, BACKEND_HANDSHAKES_MAP, BACKEND_HOPS_MAP, BACKEND_PENDING_MAP, FLOWS_MAP, FLOWS4_MAP,
    XDP_PROGRAM,
};
use tracing::{info, warn};

use crate::{
    kernel::iface,
    kernel::instance::{self, LINK_PIN},
    kernel::{
        flow_tables::{self, Capacities},
        object::{EBPF_OBJECT, load_program},
        upgrade,
    },
    settings::cli::XdpMode,
    settings::config::{Config, MIN_FLOW_TABLE_SIZE},
};

/// Maps added to the program (or first pinned) after in-place upgrades
/// existed: a running program of an older build has no pin for them, and
/// re-adopting it upgrades it (`upgrade::upgrade_if_needed` creates and
/// pins maps new in this build, which the upgraded program then uses).
const ADDED_MAPS: &[&str] = &[
    BACKEND_PENDING_MAP,
    BACKEND_HOPS_MAP,
    FLOWS4_MAP,
    BACKEND_HANDSHAKES_MAP,
];

/// A program attached to an interface, with its pins.
#[derive(Debug)]
pub struct Attachment {
    pub pin_dir: PathBuf,
    /// Interface the program is attached to.
    iface: String,
    pub program_id: u32,
    /// True when a previous instance's program and state were re-adopted.
    pub adopted: bool,
    link: FdLink,
}

impl Attachment {
    /// Re-adopts the instance's pinned program, or loads and attaches a new one.
    pub fn start(config: &Config, ifindex: u32) -> anyhow::Result<Self> {
        let pin_dir = instance::pin_dir(&config.instance);
        let attachment = Self::adopt_or_attach(&pin_dir, config, ifindex)?;
        log_flow_tables(&pin_dir, config);
        Ok(attachment)
    }

    fn adopt_or_attach(pin_dir: &Path, config: &Config, ifindex: u32) -> anyhow::Result<Self> {
        if pin_dir.join(LINK_PIN).exists() {
            match adopt(pin_dir, config)? {
                Some(attachment) => return Ok(attachment),
                None => remove_pins(pin_dir)?,
            }
        } else if pin_dir.exists() {
            // A start that died between creating the directory and pinning
            // the link: nothing is attached, so leftovers are just removed.
            remove_pins(pin_dir)?;
        }
        attach_fresh(pin_dir, config, ifindex).inspect_err(|_| {
            // Dropping the partially built state already closed every fd (so
            // nothing stays attached); the pins are what remains.
            let _ = remove_pins(pin_dir);
        })
    }

    /// Detaches the program and removes the pins: after this the kernel
    /// frees the program and its maps.
    pub fn stop(self) -> anyhow::Result<()> {
        let Self {
            pin_dir,
            iface,
            program_id,
            link,
            ..
        } = self;
        // The pinned link holds the attachment; with the pin gone, dropping
        // the last fd detaches the program.
        let result = remove_pins(&pin_dir);
        drop(link);
        // Leave /sys/fs/bpf/lb-user itself if other instances use it.
        let _ = fs::remove_dir(instance::pin_root());
        wait_detached(&iface, program_id);
        result
    }
}

fn attach_fresh(pin_dir: &Path, config: &Config, ifindex: u32) -> anyhow::Result<Attachment> {
    // Before anything is created. A host whose meminfo cannot be read is
    // left to the kernel's own refusal.
    if let Some(available) = fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| flow_tables::mem_available(&m))
    {
        flow_tables::check_memory(
            config.flow_table_size,
            config.flow_table_size_ipv6,
            available,
        )?;
    }
    fs::create_dir_all(pin_dir).with_context(|| format!("creating {}", pin_dir.display()))?;
    let mut ebpf = EbpfLoader::new()
        .map_max_entries(FLOWS_MAP, config.flow_table_size_ipv6)
        .map_max_entries(FLOWS4_MAP, config.flow_table_size)
        .load(EBPF_OBJECT)
        .map_err(|e| anyhow!("loading the eBPF object: {e}"))?;
    for name in ALL_MAPS {
        let map = ebpf
            .map(name)
            .ok_or_else(|| anyhow!("the eBPF object has no map {name}"))?;
        map.pin(pin_dir.join(name))
            .with_context(|| format!("pinning map {name} in {}", pin_dir.display()))?;
    }
    let program = load_program(&mut ebpf)?;
    let mode = match config.xdp_mode {
        XdpMode::Native => AyaXdpMode::Driver,
        XdpMode::Skb => AyaXdpMode::Skb,
    };
    let link_id = program.attach_to_if_index(ifindex, mode).map_err(|e| {
        anyhow!(
            "attaching to {} in {} mode: {e}",
            config.iface,
            config.xdp_mode.name()
        )
    })?;
    let link: FdLink = program
        .take_link(link_id)?
        .try_into()
        .context("this kernel attached XDP without a bpf_link, which cannot be pinned")?;
    let program_id = link.info().context("reading the XDP link")?.program_id();
    let pinned = link
        .pin(pin_dir.join(LINK_PIN))
        .context("pinning the XDP link")?;
    info!(
        iface = %config.iface, mode = config.xdp_mode.name(), program_id,
        pins = %pin_dir.display(), "attached {XDP_PROGRAM}"
    );
    Ok(Attachment {
        pin_dir: pin_dir.to_path_buf(),
        iface: config.iface.clone(),
        program_id,
        adopted: false,
        link: pinned.into(),
    })
}

/// Logs the flow tables' sizes and the memory the kernel preallocated for
/// them, with a hint when IPv6's is as large as IPv4's on a balancer with
/// no IPv6 VIP (it holds nothing then; a reload can add an IPv6 VIP, which
/// is why it is not shrunk on its own). Only a log: a failure to read them
/// is a warning.
fn log_flow_tables(pin_dir: &Path, config: &Config) {
    let read = || -> anyhow::Result<(Capacities, u64)> {
        Ok((
            Capacities::of_pins(pin_dir)?,
            flow_tables::preallocated_bytes(pin_dir)?,
        ))
    };
    let (sizes, bytes) = match read() {
        Ok(read) => read,
        Err(e) => {
            warn!("reading the flow tables' sizes: {e:#}");
            return;
        }
    };
    let mib = bytes.div_ceil(1 << 20);
    info!(
        ipv4_entries = sizes.ipv4,
        ipv6_entries = sizes.ipv6,
        "flow tables: {mib} MiB preallocated"
    );
    let ipv6_vips = config.vips.iter().any(|v| v.vip.addr.is_ipv6());
    if !ipv6_vips && sizes.ipv6 >= sizes.ipv4 && sizes.ipv6 > MIN_FLOW_TABLE_SIZE {
        info!(
            "no VIP is IPv6: IPv6's flow table of {} entries stays empty; --flow-table-size-ipv6 shrinks it",
            sizes.ipv6
        );
    }
}

/// Warns for each pinned flow table that an adoption keeps at another size
/// than the configuration asks for: a map's size is fixed when it is
/// created. IPv4's table is missing when the running program predates it
/// (the upgrade creates it, as large as the pinned `FLOWS`).
fn warn_kept_table_sizes(pin_dir: &Path, config: &Config) -> anyhow::Result<()> {
    let tables = [
        (FLOWS4_MAP, "--flow-table-size", config.flow_table_size),
        (
            FLOWS_MAP,
            "--flow-table-size-ipv6",
            config.flow_table_size_ipv6,
        ),
    ];
    for (name, flag, wanted) in tables {
        let path = pin_dir.join(name);
        if !path.exists() {
            continue;
        }
        let pinned = MapInfo::from_pin(&path)
            .with_context(|| format!("opening the pinned flow table {name}"))?
            .max_entries();
        if pinned != wanted {
            warn!(
                "keeping the pinned flow table {name} of {pinned} entries; {flag} {wanted} applies after a clean stop"
            );
        }
    }
    Ok(())
}

/// `Some` if the pinned link is the program attached to the interface here.
fn adopt(pin_dir: &Path, config: &Config) -> anyhow::Result<Option<Attachment>> {
    let link: FdLink = PinnedLink::from_pin(pin_dir.join(LINK_PIN))
        .context("opening the pinned XDP link")?
        .into();
    let program_id = link
        .info()
        .context("reading the pinned XDP link")?
        .program_id();
    let attached = iface::attached_xdp_program(&config.iface)?;
    if !is_our_link(attached, program_id) {
        // Still attached to another interface (a changed --iface under the
        // same --instance, or another network namespace sharing this
        // bpffs): a running balancer, whose flows a removal would cut.
        let elsewhere = iface::pinned_xdp_link_ifindex(&pin_dir.join(LINK_PIN))?;
        if elsewhere != 0 {
            bail!(
                "instance {}'s program {program_id} is attached to another interface (index \
                 {elsewhere}, here or in another network namespace), not {}: stop that \
                 instance, or start this one with its own --instance",
                config.instance,
                config.iface
            );
        }
        warn!(
            pins = %pin_dir.display(), "removing stale pins: their program {program_id} is not the one \
             attached to {} ({attached:?})", config.iface
        );
        return Ok(None);
    }
    // A map this build added is not pinned by the running program of an
    // older build: the upgrade below creates and pins it (and so must run).
    // Any other missing map means a damaged pin directory.
    let missing: Vec<&str> = ALL_MAPS
        .iter()
        .copied()
        .filter(|name| !pin_dir.join(name).exists())
        .collect();
    if let Some(name) = missing.iter().find(|name| !ADDED_MAPS.contains(name)) {
        bail!(
            "{} has a pinned link but no map {name}; stop the old instance or remove the directory",
            pin_dir.display()
        );
    }
    if !missing.is_empty() {
        info!(
            maps = ?missing,
            "the running program predates these maps: upgrading it in place, which creates them"
        );
    }
    warn_kept_table_sizes(pin_dir, config)?;
    let (link, program_id) = upgrade::upgrade_if_needed(
        pin_dir,
        link,
        program_id,
        config.upgrade || !missing.is_empty(),
    )?;
    info!(
        iface = %config.iface, program_id, pins = %pin_dir.display(),
        "re-adopted the running {XDP_PROGRAM} with its flow table and counters (attach mode unchanged)"
    );
    Ok(Some(Attachment {
        pin_dir: pin_dir.to_path_buf(),
        iface: config.iface.clone(),
        program_id,
        adopted: true,
        link,
    }))
}

/// How long [`Attachment::stop`] waits to see the program leave the interface.
const DETACH_WAIT: Duration = Duration::from_secs(3);

/// Waits until the interface no longer runs `program_id`, so a stopped
/// instance has really detached when it exits. A bpffs pin's reference is
/// released only after an RCU grace period, so the last reference to the
/// link (and the detach) can trail the unlink by a few milliseconds.
fn wait_detached(iface: &str, program_id: u32) {
    let deadline = Instant::now() + DETACH_WAIT;
    loop {
        match iface::attached_xdp_program(iface) {
            Ok(Some(id)) if id == program_id => {}
            // Detached, replaced by someone else, or the interface is gone.
            _ => return,
        }
        if Instant::now() >= deadline {
            warn!(
                iface,
                program_id,
                "the program is still attached {DETACH_WAIT:?} after its link was released"
            );
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether the interface runs the pinned link's program. After a
/// `bpf_link_update` (see `upgrade.rs`) this kernel's netlink keeps
/// reporting the replaced program's id, although that program is gone; a
/// reported id that names no loaded program is therefore that stale report
/// of an upgraded link, which is ours.
fn is_our_link(attached: Option<u32>, link_program: u32) -> bool {
    match attached {
        Some(id) if id == link_program => true,
        Some(id) => !loaded_programs()
            .filter_map(Result::ok)
            .any(|p| p.id() == id),
        None => false,
    }
}

/// Removes an instance's pins and its directory (missing entries are fine).
fn remove_pins(pin_dir: &Path) -> anyhow::Result<()> {
    let entries = match fs::read_dir(pin_dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", pin_dir.display())),
    };
    // The link's pin first: a removal that fails or is killed part way
    // then leaves map pins with no link, which the next start removes as
    // leftovers, never a link whose maps are partly gone (which a start
    // refuses, or, if only maps added by newer builds were gone, takes for
    // an older build and upgrades onto new, empty ones).
    let link = pin_dir.join(LINK_PIN);
    match fs::remove_file(&link) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("removing pin {}", link.display())),
    }
    for entry in entries.flatten() {
        match fs::remove_file(entry.path()) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(e).with_context(|| format!("removing pin {}", entry.path().display()));
            }
        }
    }
    fs::remove_dir(pin_dir).with_context(|| format!("removing {}", pin_dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A removal that stops part way has already removed the link's pin:
    /// what is left are map pins with no link, which a start clears as
    /// leftovers.
    #[test]
    fn a_removal_that_fails_part_way_leaves_no_link_behind() {
        let dir = std::env::temp_dir().join(format!("lb-pins-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        // Entries a file removal cannot take (directories), made before the
        // link (a listing in creation order meets them first) and many (a
        // listing in hash order most likely does).
        for i in 0..32 {
            fs::create_dir(dir.join(format!("MAP{i}"))).unwrap();
        }
        fs::write(dir.join(LINK_PIN), b"").unwrap();
        let failed = remove_pins(&dir);
        let link_left = dir.join(LINK_PIN).exists();
        let _ = fs::remove_dir_all(&dir);
        assert!(failed.is_err());
        assert!(!link_left, "the link's pin outlived a failed removal");
    }
}
