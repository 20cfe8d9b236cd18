//! The two pinned flow tables as the control plane sees them: IPv6's
//! `FLOWS`, keyed by the 40-byte [`FlowKey`], and IPv4's `FLOWS4`, keyed by
//! the same 5-tuple packed in 16 bytes ([`FlowKeyV4`]; the kernel hashes
//! and compares the whole key on every lookup, so the shorter key makes
//! every IPv4 packet cheaper). Every entry is read and written here by its
//! [`FlowKey`]; the family picks the table.
//!
//! A program of a build before IPv4's table kept both families in `FLOWS`.
//! Upgrading it in place moves its IPv4 entries over
//! ([`move_ipv4_entries`]).

use std::{
    os::fd::{AsFd as _, AsRawFd as _},
    path::Path,
};

use anyhow::Context as _;
use aya::maps::{HashMap, MapData, MapError};
use lb_common::{AF_INET, FLOWS_MAP, FLOWS4_MAP, FlowEntry, FlowKey, FlowKeyV4};

use crate::kernel::maps::{self, Flows};

/// `BPF_NOEXIST`: write only where the table has no entry.
pub const BPF_NOEXIST: u64 = 1;

/// IPv4's pinned flow table.
pub type Flows4 = HashMap<MapData, FlowKeyV4, FlowEntry>;

/// Both pinned flow tables.
pub struct FlowTables {
    v6: Flows,
    v4: Flows4,
}

impl FlowTables {
    pub fn open(pin_dir: &Path) -> anyhow::Result<Self> {
        Ok(Self {
            v6: maps::flows(pin_dir)?,
            v4: maps::open(pin_dir, FLOWS4_MAP)?,
        })
    }

    /// Every entry of both tables with its key; entries that fail to read
    /// (removed during the walk) are skipped.
    pub fn entries(&self) -> impl Iterator<Item = (FlowKey, FlowEntry)> + '_ {
        self.v6.iter().filter_map(Result::ok).chain(
            self.v4
                .iter()
                .filter_map(Result::ok)
                .map(|(key, entry)| (key.widen(), entry)),
        )
    }

    /// Writes `entry` under `key` in its family's table (`BPF_*` `flags`).
    pub fn insert(&mut self, key: &FlowKey, entry: FlowEntry, flags: u64) -> Result<(), MapError> {
        if key.family == AF_INET {
            self.v4.insert(FlowKeyV4::of(key), entry, flags)
        } else {
            self.v6.insert(key, entry, flags)
        }
    }

    /// The entry under `key`, from its family's table.
    pub fn get(&self, key: &FlowKey) -> Option<FlowEntry> {
        if key.family == AF_INET {
            self.v4.get(&FlowKeyV4::of(key), 0).ok()
        } else {
            self.v6.get(key, 0).ok()
        }
    }
}

/// The entries each family's table can hold: `--flow-table-size` and
/// `--flow-table-size-ipv6` when they were created (a map's size is fixed
/// then).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Capacities {
    pub ipv4: u32,
    pub ipv6: u32,
}

impl Capacities {
    /// Of the pinned tables.
    pub fn of_pins(pin_dir: &Path) -> anyhow::Result<Self> {
        let of = |name: &str| {
            aya::maps::MapInfo::from_pin(pin_dir.join(name))
                .map(|info| info.max_entries())
                .with_context(|| format!("opening the pinned flow table {name}"))
        };
        Ok(Self {
            ipv4: of(FLOWS4_MAP)?,
            ipv6: of(FLOWS_MAP)?,
        })
    }

    /// Of the pinned tables as `status` finds them: both, or only `FLOWS`
    /// when the running program is of a build before IPv4's own table
    /// (this build's `status` run before the daemon was restarted on it).
    /// Such a program keeps both families in `FLOWS`, which is then both
    /// capacities, and the second value is true.
    pub fn of_pins_or_shared(pin_dir: &Path) -> anyhow::Result<(Self, bool)> {
        if pin_dir.join(FLOWS4_MAP).exists() {
            return Ok((Self::of_pins(pin_dir)?, false));
        }
        let shared = aya::maps::MapInfo::from_pin(pin_dir.join(FLOWS_MAP))
            .map(|info| info.max_entries())
            .with_context(|| format!("opening the pinned flow table {FLOWS_MAP}"))?;
        Ok((
            Self {
                ipv4: shared,
                ipv6: shared,
            },
            true,
        ))
    }
}

/// The memory the kernel holds for both pinned tables, in bytes: their
/// `memlock` as `/proc/self/fdinfo` gives it. A plain hash map allocates
/// every entry when it is created, so this is what the sizes cost whether
/// or not flows fill them.
pub fn preallocated_bytes(pin_dir: &Path) -> anyhow::Result<u64> {
    let mut total = 0;
    for name in [FLOWS4_MAP, FLOWS_MAP] {
        let fd = aya::maps::MapInfo::from_pin(pin_dir.join(name))
            .and_then(|info| info.fd())
            .with_context(|| format!("opening the pinned flow table {name}"))?;
        let path = format!("/proc/self/fdinfo/{}", fd.as_fd().as_raw_fd());
        let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
        total += memlock_of(&text).with_context(|| format!("no memlock line in {path}"))?;
    }
    Ok(total)
}

/// What one preallocated element of a plain hash map costs the kernel
/// besides its key and value: its `struct htab_elem` header.
const HTAB_ELEM_HEADER: u64 = 48;
/// One bucket of a hash map (a list head and its lock); the kernel makes
/// the next power of two of buckets.
const HTAB_BUCKET: u64 = 16;

/// The kernel memory that flow tables of `ipv4` and `ipv6` entries take
/// when they are created (a plain hash map allocates every element then):
/// each entry's header, key and value, and the buckets. A lower bound
/// (the kernel adds a few spare elements per CPU); it matches `memlock`
/// within a fraction of a percent (176 and 200 bytes an entry at 2^18).
pub fn needed_bytes(ipv4: u32, ipv6: u32) -> u64 {
    let value = size_of::<FlowEntry>().next_multiple_of(8) as u64;
    let table = |entries: u32, key: usize| {
        if entries == 0 {
            return 0;
        }
        let element = HTAB_ELEM_HEADER + key.next_multiple_of(8) as u64 + value;
        u64::from(entries) * element + u64::from(entries).next_power_of_two() * HTAB_BUCKET
    };
    table(ipv4, size_of::<FlowKeyV4>()) + table(ipv6, size_of::<FlowKey>())
}

/// Refuses flow tables of `ipv4` and `ipv6` entries that need more memory
/// than the host has available (`available`, bytes: `MemAvailable`), with
/// an error that says what to lower, before anything is created: the
/// kernel would refuse them with ENOMEM, or take the memory the host's
/// other work needs.
pub fn check_memory(ipv4: u32, ipv6: u32, available: u64) -> anyhow::Result<()> {
    let needed = needed_bytes(ipv4, ipv6);
    if needed <= available {
        return Ok(());
    }
    let mib = |b: u64| b.div_ceil(1 << 20);
    anyhow::bail!(
        "flow tables of {ipv4} IPv4 and {ipv6} IPv6 entries need {} MiB of kernel memory, \
         more than the {} MiB this host has available: lower --flow-table-size \
         (and --flow-table-size-ipv6, which defaults to it)",
        mib(needed),
        mib(available)
    )
}

/// The host's `MemAvailable` in bytes, from `/proc/meminfo` text.
pub fn mem_available(meminfo: &str) -> Option<u64> {
    let kib: u64 = meminfo
        .lines()
        .find_map(|line| line.strip_prefix("MemAvailable:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse()
        .ok()?;
    kib.checked_mul(1024)
}

/// The `memlock:` value of a map's fdinfo text.
fn memlock_of(fdinfo: &str) -> Option<u64> {
    fdinfo
        .lines()
        .find_map(|line| line.strip_prefix("memlock:"))
        .and_then(|value| value.trim().parse().ok())
}

/// Moves the IPv4 entries that a program of an older build kept in `FLOWS`
/// into `FLOWS4`; returns how many were written there. `remove`: take them
/// out of `FLOWS` too, and write only where `FLOWS4` has nothing (the
/// second pass of an upgrade, after the swap, when the new program may
/// already have changed the entries of the first pass); otherwise they are
/// copied over whatever `FLOWS4` has (the first pass, before the swap,
/// while the old program still owns them).
pub fn move_ipv4_entries(pin_dir: &Path, remove: bool) -> anyhow::Result<u64> {
    let mut v6: Flows = maps::flows(pin_dir)?;
    let mut v4: Flows4 = maps::open(pin_dir, FLOWS4_MAP)?;
    let ipv4: Vec<(FlowKey, FlowEntry)> = v6
        .iter()
        .filter_map(Result::ok)
        .filter(|(key, _)| key.family == AF_INET)
        .collect();
    let flags = if remove { BPF_NOEXIST } else { 0 };
    let mut written = 0;
    for (key, entry) in &ipv4 {
        // Refused: already there (the new program's), or the table is
        // full; then the entry is lost to the new program.
        if v4.insert(FlowKeyV4::of(key), *entry, flags).is_ok() {
            written += 1;
        }
        if remove {
            // Gone already (the sweep) is fine.
            let _ = v6.remove(key);
        }
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::{check_memory, mem_available, memlock_of, needed_bytes};

    #[test]
    fn the_memory_estimate_matches_what_the_kernel_reported() {
        // `bpftool map create` of 262,144 entries (stop 58's measurement):
        // 46,138,576 bytes of memlock for IPv4's keys, 52,430,080 for
        // IPv6's; the estimate is a lower bound within 0.1 %.
        for (needed, memlock) in [
            (needed_bytes(262_144, 0), 46_138_576u64),
            (needed_bytes(0, 262_144), 52_430_080),
        ] {
            assert!(needed <= memlock, "{needed} > {memlock}");
            assert!(memlock - needed < memlock / 1000, "{needed} vs {memlock}");
        }
        // Buckets come in powers of two.
        assert_eq!(needed_bytes(3, 0), 3 * 160 + 4 * 16);
    }

    #[test]
    fn tables_larger_than_the_available_memory_are_refused_with_what_to_lower() {
        let gib = 1u64 << 30;
        assert!(check_memory(262_144, 262_144, gib).is_ok());
        let e = check_memory(1 << 24, 1 << 24, gib).unwrap_err().to_string();
        assert!(
            e.starts_with(
                "flow tables of 16777216 IPv4 and 16777216 IPv6 entries need 6016 MiB of kernel memory, \
                 more than the 1024 MiB this host has available: lower --flow-table-size"
            ),
            "{e}"
        );
    }

    #[test]
    fn mem_available_is_read_from_meminfo() {
        let meminfo = "MemTotal:        8131276 kB\nMemFree:         1234567 kB\n\
                       MemAvailable:    6500000 kB\nBuffers:  1 kB\n";
        assert_eq!(mem_available(meminfo), Some(6_500_000 * 1024));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
        assert_eq!(mem_available("MemAvailable: lots\n"), None);
    }

    #[test]
    fn memlock_is_read_from_a_maps_fdinfo() {
        let fdinfo = "pos:\t0\nflags:\t02000002\nmnt_id:\t15\nino:\t2053\nmap_type:\t1\n\
                      key_size:\t16\nvalue_size:\t96\nmax_entries:\t1024\nmap_flags:\t0x0\n\
                      map_extra:\t0x0\nmemlock:\t180544\nmap_id:\t42\nfrozen:\t0\n";
        assert_eq!(memlock_of(fdinfo), Some(180_544));
        assert_eq!(memlock_of("pos:\t0\nflags:\t02\n"), None);
        assert_eq!(memlock_of("memlock:\tmany\n"), None);
    }
}
