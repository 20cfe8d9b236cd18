//! SNAT cursors across a clean restart.
//!
//! A clean stop (SIGTERM, SIGINT) detaches the program and removes the
//! pins, flow table included: the next start is cold and knows nothing of
//! the tuples the last instance handed out. Those are still in the
//! backends' TIME_WAIT for a minute, and a SYN on such a tuple waits a
//! second for its retransmit (README, "The 1 s tail"). So the stop saves
//! each backend's per-CPU SNAT cursors next to the runtime state, and a
//! cold start within the quarantine puts them back: every CPU goes on
//! from where it stopped, into the tuples handed out longest ago (or
//! never), instead of from a random place that may be among the last
//! ones used.
//!
//! The file is keyed by VIP and backend address (ids can change across a
//! cold start, and a backend behind two VIPs has an id, and cursors, for
//! each) and carries the SNAT port range and the CPU count it was made
//! with; a file from another range, another CPU count or older than the
//! quarantine is ignored (the random start of `maps::seed_snat_cursors`
//! stays).

use std::{
    path::{Path, PathBuf},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::Context as _;
use lb_common::{Backend, VipKey};
use serde::{Deserialize, Serialize};

use crate::{kernel::maps, settings::ports::PortRange};

/// The file, next to the runtime state file of `instance`.
pub fn path(state_dir: &Path, instance: &str) -> PathBuf {
    state_dir.join(format!("{instance}.snat-cursors.json"))
}

/// What a clean stop leaves.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Saved {
    /// Wall-clock time of the stop (ms since the Unix epoch).
    pub saved_unix_ms: u64,
    pub port_min: u16,
    pub port_max: u16,
    pub cpus: u32,
    pub backends: Vec<SavedBackend>,
}

/// One backend's cursors (of one VIP), one per possible CPU.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SavedBackend {
    /// The VIP's key ([`VipKey`]'s fields).
    pub vip_addr: [u32; 4],
    pub vip_port: u16,
    pub vip_proto: u8,
    pub vip_family: u8,
    pub family: u8,
    pub addr: [u32; 4],
    /// Network byte order, as in [`Backend::port`].
    pub port: u16,
    pub cursors: Vec<u64>,
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// A backend of a VIP, as the plan or the pinned maps know it.
#[derive(Clone, Copy, Debug)]
pub struct VipBackend {
    pub id: u32,
    pub vip: VipKey,
    pub backend: Backend,
}

fn same_backend(saved: &SavedBackend, b: &VipBackend) -> bool {
    saved.vip_addr == b.vip.addr
        && saved.vip_port == b.vip.port
        && saved.vip_proto == b.vip.proto
        && saved.vip_family == b.vip.family
        && saved.family == b.backend.family
        && saved.addr == b.backend.addr
        && saved.port == b.backend.port
}

impl Saved {
    /// The cursors to put back for `backends` at `now`: none
    /// if the file is older than `quarantine` (or from the future), or was
    /// made with another port range or CPU count.
    pub fn restorable(
        &self,
        now: SystemTime,
        quarantine: Duration,
        ports: PortRange,
        cpus: u32,
        backends: &[VipBackend],
    ) -> Vec<(u32, Vec<u64>)> {
        let age_ms = unix_ms(now).checked_sub(self.saved_unix_ms);
        let fresh = age_ms.is_some_and(|age| u128::from(age) < quarantine.as_millis());
        if !fresh || (self.port_min, self.port_max) != (ports.min, ports.max) || self.cpus != cpus {
            return Vec::new();
        }
        backends
            .iter()
            .filter_map(|b| {
                let saved = self.backends.iter().find(|s| same_backend(s, b))?;
                (saved.cursors.len() == cpus as usize).then(|| (b.id, saved.cursors.clone()))
            })
            .collect()
    }
}

/// Reads every in-use backend's cursors from the pinned maps and writes
/// the file (temporary file, then rename).
pub fn save(
    pin_dir: &Path,
    file: &Path,
    ports: PortRange,
    backends: &[VipBackend],
    now: SystemTime,
) -> anyhow::Result<usize> {
    let cursors = maps::snat_cursors(pin_dir)?;
    let cpus = possible_cpus()?;
    let mut saved = Saved {
        saved_unix_ms: unix_ms(now),
        port_min: ports.min,
        port_max: ports.max,
        cpus,
        backends: Vec::new(),
    };
    for b in backends {
        let values = cursors
            .get(&b.id, 0)
            .with_context(|| format!("reading SNAT_CURSORS[{}]", b.id))?;
        saved.backends.push(SavedBackend {
            vip_addr: b.vip.addr,
            vip_port: b.vip.port,
            vip_proto: b.vip.proto,
            vip_family: b.vip.family,
            family: b.backend.family,
            addr: b.backend.addr,
            port: b.backend.port,
            cursors: values.iter().copied().collect(),
        });
    }
    let text = serde_json::to_vec(&saved).context("encoding the SNAT cursors")?;
    if let Some(dir) = file.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let tmp = file.with_extension("json.tmp");
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, file).with_context(|| format!("renaming to {}", file.display()))?;
    Ok(saved.backends.len())
}

/// Puts back what [`save`] left, if it still applies (see
/// [`Saved::restorable`]); the number of backends restored. A missing
/// file is nothing to restore; an unreadable one is an error the caller
/// logs (the random start stays).
pub fn restore(
    pin_dir: &Path,
    file: &Path,
    ports: PortRange,
    quarantine: Duration,
    backends: &[VipBackend],
    now: SystemTime,
) -> anyhow::Result<usize> {
    let text = match std::fs::read(file) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e).with_context(|| format!("reading {}", file.display())),
    };
    let saved: Saved =
        serde_json::from_slice(&text).with_context(|| format!("parsing {}", file.display()))?;
    let restore = saved.restorable(now, quarantine, ports, possible_cpus()?, backends);
    let mut cursors = maps::snat_cursors(pin_dir)?;
    for (id, values) in &restore {
        cursors
            .set(
                *id,
                aya::maps::PerCpuValues::try_from(values.clone()).context("per-CPU values")?,
                0,
            )
            .with_context(|| format!("writing SNAT_CURSORS[{id}]"))?;
    }
    Ok(restore.len())
}

fn possible_cpus() -> anyhow::Result<u32> {
    let n = aya::util::nr_cpus()
        .map_err(|(_, e)| e)
        .context("counting possible CPUs")?;
    u32::try_from(n).context("CPU count")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vip(port: u16) -> VipKey {
        VipKey {
            addr: [100, 0, 0, 0],
            port: port.to_be(),
            proto: 6,
            family: lb_common::AF_INET,
        }
    }

    fn backend(id: u32, vip_port: u16, last: u32, port: u16) -> VipBackend {
        VipBackend {
            id,
            vip: vip(vip_port),
            backend: Backend {
                addr: [last, 0, 0, 0],
                port: port.to_be(),
                family: lb_common::AF_INET,
                in_use: 1,
                ..Backend::default()
            },
        }
    }

    fn saved_backend(vip_port: u16, last: u32, cursors: Vec<u64>) -> SavedBackend {
        SavedBackend {
            vip_addr: [100, 0, 0, 0],
            vip_port: vip_port.to_be(),
            vip_proto: 6,
            vip_family: lb_common::AF_INET,
            family: lb_common::AF_INET,
            addr: [last, 0, 0, 0],
            port: 8080u16.to_be(),
            cursors,
        }
    }

    fn saved(at: SystemTime) -> Saved {
        Saved {
            saved_unix_ms: unix_ms(at),
            port_min: 20_000,
            port_max: 32_767,
            cpus: 2,
            backends: vec![
                saved_backend(80, 21, vec![7, 9]),
                saved_backend(80, 22, vec![3, 4]),
                // The same backend behind another VIP: cursors of its own.
                saved_backend(8053, 21, vec![1, 2]),
            ],
        }
    }

    const PORTS: PortRange = PortRange {
        min: 20_000,
        max: 32_767,
    };
    const QUARANTINE: Duration = Duration::from_secs(65);

    #[test]
    fn a_fresh_file_gives_each_backend_its_cursors_by_vip_and_address_not_id() {
        let t0 = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        // Ids swapped and one backend new since the stop; be 21 behind two VIPs.
        let now_backends = [
            backend(0, 80, 22, 8080),
            backend(1, 80, 21, 8080),
            backend(2, 80, 23, 8080),
            backend(3, 8053, 21, 8080),
        ];
        let got = saved(t0).restorable(
            t0 + Duration::from_secs(10),
            QUARANTINE,
            PORTS,
            2,
            &now_backends,
        );
        assert_eq!(got, vec![(0, vec![3, 4]), (1, vec![7, 9]), (3, vec![1, 2])]);
    }

    #[test]
    fn a_file_that_does_not_apply_restores_nothing() {
        let t0 = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let b = [backend(0, 80, 21, 8080)];
        let s = saved(t0);
        let at = |secs| t0 + Duration::from_secs(secs);
        assert!(
            s.restorable(at(65), QUARANTINE, PORTS, 2, &b).is_empty(),
            "too old"
        );
        assert!(
            s.restorable(t0 - Duration::from_secs(1), QUARANTINE, PORTS, 2, &b)
                .is_empty(),
            "from the future"
        );
        let other = PortRange {
            min: 1024,
            max: 32_767,
        };
        assert!(
            s.restorable(at(1), QUARANTINE, other, 2, &b).is_empty(),
            "other range"
        );
        assert!(
            s.restorable(at(1), QUARANTINE, PORTS, 4, &b).is_empty(),
            "other CPU count"
        );
        assert!(
            s.restorable(at(1), QUARANTINE, PORTS, 2, &[backend(0, 80, 21, 9090)])
                .is_empty(),
            "another port is another backend"
        );
        assert!(
            s.restorable(at(1), QUARANTINE, PORTS, 2, &[backend(0, 443, 21, 8080)])
                .is_empty(),
            "another VIP's backend has cursors of its own"
        );
        assert_eq!(s.restorable(at(64), QUARANTINE, PORTS, 2, &b).len(), 1);
    }

    #[test]
    fn the_file_round_trips_through_json() {
        let s = saved(UNIX_EPOCH + Duration::from_secs(1_800_000_000));
        let text = serde_json::to_string(&s).unwrap();
        assert_eq!(serde_json::from_str::<Saved>(&text).unwrap(), s);
    }
}
