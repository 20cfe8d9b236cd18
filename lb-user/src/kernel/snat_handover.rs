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
//! The cursors say where each CPU stands, not which tuples are still in
//! quarantine: a CPU that went round its slice within the quarantine (with
//! `--snat-time-wait-reuse`, every busy one does) has tuples just past its
//! cursor that a backend holds in TIME_WAIT. So the stop also saves every
//! quarantined tuple's reply entry (its close time and what the backend's
//! TIME_WAIT expects, `lb_common::time_wait`), and the cold start inserts
//! them again: they stay out of use until their quarantine ends, or until
//! a SYN their TIME_WAIT accepts takes them over, as if no restart had
//! happened. Their close times are CLOCK_MONOTONIC, valid until a reboot,
//! so the file carries the boot id and a file from another boot restores
//! no tuple.
//!
//! The connections still open at the stop lose their flows with the pins,
//! but their backends do not know that: each holds its tuple until the
//! connection ends there (an idle keep-alive connection until the
//! backend's own timeout, and then its FIN goes unanswered), and a SYN on
//! that tuple meets the old connection and waits a second. So the stop
//! saves each open connection's reply entry too, as closed at the end of
//! its idle timeout (its last packet plus the idle timeout of its
//! protocol), which is as long as the running instance would have held
//! the tuple had the connection gone idle at the stop: it stays out of use
//! for that long and a quarantine after it, and no SYN takes it over
//! (there is no TIME_WAIT to accept one). The cut clients all come back at
//! once for new tuples and entries, so only so many are held that long
//! (`OpenLimits`, the most recently used first); the rest, and the tuples
//! of connections not established both ways, are held for a quarantine
//! from the stop, as if they closed then.
//!
//! The file is keyed by VIP and backend address (ids can change across a
//! cold start, and a backend behind two VIPs has an id, and cursors, for
//! each) and carries the SNAT port range and the CPU count it was made
//! with; a file from another range or another CPU count is ignored, and
//! so are its cursors once it is older than the quarantine (the random
//! start of `maps::seed_snat_cursors` stays) and each tuple once its own
//! quarantine is over.

use std::{
    path::{Path, PathBuf},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use std::collections::{BTreeMap, HashMap};

use anyhow::Context as _;
use lb_common::{
    AF_INET6, Backend, DIR_TO_BACKEND, DIR_TO_CLIENT, FLOW_CLOSING, FLOW_F_CLOSED,
    FLOW_F_SYNACK_SEEN, FLOW_F_TAKEN, FLOW_F_TW_SEEN, FLOW_F_TW_TS, FLOW_F_TW_TS_UNKNOWN,
    FLOW_F_TW_UNACKED, FlowEntry, FlowKey, IPPROTO_TCP, VipKey,
};
use serde::{Deserialize, Serialize};

use crate::{
    kernel::{
        clock::{Clock, MonotonicClock},
        flow_tables::{BPF_NOEXIST, Capacities, FlowTables},
        maps,
    },
    settings::ports::PortRange,
};

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
    /// `/proc/sys/kernel/random/boot_id` at the stop.
    #[serde(default)]
    pub boot_id: String,
    /// The tuples in quarantine at the stop, and those of the connections
    /// still open then (as closed at the end of their idle timeout).
    #[serde(default)]
    pub quarantined: Vec<SavedTuple>,
}

/// A SNAT tuple in quarantine at the stop: its closed reply entry.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SavedTuple {
    /// Its backend: an index into [`Saved::backends`].
    pub backend: usize,
    /// The key: backend address and SNAT address, backend port and SNAT
    /// port (network byte order), protocol, family.
    pub key: ([u32; 4], [u32; 4], u16, u16, u8, u8),
    /// Where the entry translates to: VIP and client, their ports.
    pub to: ([u32; 4], [u32; 4], u16, u16),
    /// The close and TIME_WAIT bits of its flags, the TIME_WAIT view
    /// (`created_ns`) and the close time (`last_seen_ns`, CLOCK_MONOTONIC).
    pub flags: u32,
    pub view: u64,
    pub closed_ns: u64,
    pub client_mac: [u8; 6],
    pub client_ifindex: u32,
}

/// The flags a restored tuple keeps.
/// (`FLOW_F_TW_UNACKED` too: a FIN the backend never acknowledged before the
/// stop keeps its tuple out of reuse until the quarantine ends.)
const KEPT_FLAGS: u32 =
    FLOW_F_CLOSED | FLOW_F_TW_SEEN | FLOW_F_TW_TS | FLOW_F_TW_TS_UNKNOWN | FLOW_F_TW_UNACKED;

impl SavedTuple {
    fn of(backend: usize, key: &FlowKey, entry: &FlowEntry) -> Self {
        Self {
            backend,
            key: (
                key.src, key.dst, key.sport, key.dport, key.proto, key.family,
            ),
            to: (
                entry.new_src,
                entry.new_dst,
                entry.new_sport,
                entry.new_dport,
            ),
            flags: entry.flags & KEPT_FLAGS,
            view: entry.created_ns,
            closed_ns: entry.last_seen_ns,
            client_mac: entry.client_mac,
            client_ifindex: entry.client_ifindex,
        }
    }

    /// The tuple of a connection still open at the stop (`entry`, its
    /// reply entry), held as if it closed at `closed_ns`: no TIME_WAIT
    /// view, so no SYN takes it over before its quarantine ends.
    fn open_at_stop(backend: usize, key: &FlowKey, entry: &FlowEntry, closed_ns: u64) -> Self {
        Self {
            flags: FLOW_F_CLOSED,
            view: 0,
            closed_ns,
            ..Self::of(backend, key, entry)
        }
    }

    /// Whether the tuple is still out of use at `now_ns` (CLOCK_MONOTONIC
    /// of the same boot): its quarantine, from its close, is not over.
    fn held_at(&self, now_ns: u64, quarantine: Duration) -> bool {
        u128::from(now_ns.saturating_sub(self.closed_ns)) < quarantine.as_nanos()
    }

    /// The key and reply entry to insert for backend id `id` of VIP
    /// `vip_id`.
    fn entry(&self, id: u32, vip_id: u32) -> (FlowKey, FlowEntry) {
        let (src, dst, sport, dport, proto, family) = self.key;
        let key = FlowKey::new(family, proto, src, dst, sport, dport);
        let entry = FlowEntry {
            new_src: self.to.0,
            new_dst: self.to.1,
            new_sport: self.to.2,
            new_dport: self.to.3,
            backend_id: id,
            vip_id,
            direction: DIR_TO_CLIENT,
            state: FLOW_CLOSING,
            flags: self.flags & KEPT_FLAGS,
            created_ns: self.view,
            last_seen_ns: self.closed_ns,
            client_mac: self.client_mac,
            client_ifindex: self.client_ifindex,
            ..FlowEntry::default()
        };
        (key, entry)
    }
}

/// Whether a reply entry holds its tuple in quarantine at `now_ns`
/// (CLOCK_MONOTONIC): closed, not being freed or taken over, closed less
/// than `quarantine` ago.
fn in_quarantine(entry: &FlowEntry, now_ns: u64, quarantine: Duration) -> bool {
    entry.direction == DIR_TO_CLIENT
        && entry.flags & FLOW_F_CLOSED != 0
        && entry.flags & FLOW_F_TAKEN == 0
        && u128::from(now_ns.saturating_sub(entry.last_seen_ns)) < quarantine.as_nanos()
}

/// Whether a reply entry belongs to a connection still open: not closed,
/// not being freed or taken over.
fn open_reply(entry: &FlowEntry) -> bool {
    entry.direction == DIR_TO_CLIENT && entry.flags & (FLOW_F_CLOSED | FLOW_F_TAKEN) == 0
}

/// The key of the forward entry of the connection whose reply entry is
/// `reply` at `key`: the client's tuple towards the VIP, which the reply
/// entry translates back to.
fn forward_key(key: &FlowKey, reply: &FlowEntry) -> FlowKey {
    FlowKey::new(
        key.family,
        key.proto,
        reply.new_dst,
        reply.new_src,
        reply.new_dport,
        reply.new_sport,
    )
}

/// Until when (CLOCK_MONOTONIC) the running instance would have held the
/// tuple of the open reply entry `reply` at `key` had the connection gone
/// idle at the stop: its forward entry's last packet plus the idle timeout
/// of its protocol, and when that packet was (which ranks the tuples by
/// how recently they were used). `None` where the connection is not
/// established both ways, so the backend may hold nothing: no forward
/// entry pointing back at this tuple (a lone reply entry the sweep has not
/// met yet), or a TCP SYN the backend never answered.
fn open_hold(
    key: &FlowKey,
    reply: &FlowEntry,
    forward: Option<&FlowEntry>,
    idle: IdleTimeouts,
) -> Option<(u64, u64)> {
    let fwd = forward?;
    let points_back = fwd.direction == DIR_TO_BACKEND
        && fwd.flags & FLOW_F_CLOSED == 0
        && fwd.backend_id == reply.backend_id
        && (fwd.new_src, fwd.new_dst, fwd.new_sport, fwd.new_dport)
            == (key.dst, key.src, key.dport, key.sport);
    let answered = key.proto != IPPROTO_TCP || fwd.flags & FLOW_F_SYNACK_SEEN != 0;
    if !(points_back && answered) {
        return None;
    }
    let idle_ns = u64::try_from(idle.of(key.proto).as_nanos()).unwrap_or(u64::MAX);
    Some((fwd.last_seen_ns, fwd.last_seen_ns.saturating_add(idle_ns)))
}

/// An open connection's tuple found at the stop.
#[derive(Clone)]
struct OpenTuple {
    /// Its backend: an index into [`Saved::backends`].
    backend: usize,
    key: FlowKey,
    entry: FlowEntry,
    /// [`open_hold`]: its last packet and the end of its idle timeout.
    hold: Option<(u64, u64)>,
}

/// How many open connections' tuples are held past the stop for their
/// idle timeout: at most half of a backend's ports (with one SNAT address,
/// half its tuples), and at most a quarter of each family's flow table
/// (`[IPv4, IPv6]`). Every client of a connection cut by the stop comes
/// back for a new tuple and two new entries while the old ones are held,
/// so holding them all could leave the new connections no tuple or no
/// room.
#[derive(Clone, Copy, Debug)]
struct OpenLimits {
    per_backend: usize,
    per_family: [usize; 2],
}

/// The tuples to save for the open connections at `now_ns`: each
/// established one held until the end of its idle timeout, the most
/// recently used first, within `limits`; the rest (beyond the limits, or
/// not established both ways) as closed at the stop, held for a quarantine
/// like any closed tuple. None has a TIME_WAIT view: no SYN takes one
/// over while it is held.
fn held_open(mut open: Vec<OpenTuple>, limits: OpenLimits, now_ns: u64) -> Vec<SavedTuple> {
    open.sort_by_key(|o| std::cmp::Reverse(o.hold.map_or(0, |(last, _)| last)));
    let mut per_backend: HashMap<usize, usize> = HashMap::new();
    let mut per_family = [0usize; 2];
    open.iter()
        .map(|o| {
            let family = usize::from(o.key.family == AF_INET6);
            let n = per_backend.entry(o.backend).or_default();
            let closed_ns = match o.hold {
                Some((_, until))
                    if *n < limits.per_backend
                        && per_family[family] < limits.per_family[family] =>
                {
                    *n += 1;
                    per_family[family] += 1;
                    until.max(now_ns)
                }
                _ => now_ns,
            };
            SavedTuple::open_at_stop(o.backend, &o.key, &o.entry, closed_ns)
        })
        .collect()
}

/// The idle timeouts of open flows (`--tcp-idle-timeout`,
/// `--udp-idle-timeout`): how long past the stop an open connection's
/// tuple is held as if it closed then.
#[derive(Clone, Copy, Debug)]
pub struct IdleTimeouts {
    pub tcp: Duration,
    pub udp: Duration,
}

impl IdleTimeouts {
    fn of(&self, proto: u8) -> Duration {
        if proto == lb_common::IPPROTO_TCP {
            self.tcp
        } else {
            self.udp
        }
    }
}

fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
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
    /// Whether the file was made with these ports and CPU count.
    fn made_for(&self, ports: PortRange, cpus: u32) -> bool {
        (self.port_min, self.port_max) == (ports.min, ports.max) && self.cpus == cpus
    }

    /// Whether the file's cursors still apply at `now`: younger than
    /// `quarantine` (and not from the future), made with these ports and
    /// CPU count.
    fn applies(&self, now: SystemTime, quarantine: Duration, ports: PortRange, cpus: u32) -> bool {
        let age_ms = unix_ms(now).checked_sub(self.saved_unix_ms);
        let fresh = age_ms.is_some_and(|age| u128::from(age) < quarantine.as_millis());
        fresh && self.made_for(ports, cpus)
    }

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
        if !self.applies(now, quarantine, ports, cpus) {
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

impl Saved {
    /// The held tuples to insert again for `backends` at `now_ns`
    /// (CLOCK_MONOTONIC): those whose quarantine is not over, from a file
    /// of the same boot, port range and CPU count; each with its backend's
    /// current id and VIP id.
    pub fn restorable_tuples<'a>(
        &'a self,
        now_ns: u64,
        quarantine: Duration,
        ports: PortRange,
        cpus: u32,
        boot_id: &str,
        backends: &'a [VipBackend],
    ) -> impl Iterator<Item = (&'a SavedTuple, &'a VipBackend)> + 'a {
        let applies = self.made_for(ports, cpus) && !boot_id.is_empty() && self.boot_id == boot_id;
        self.quarantined
            .iter()
            .filter(move |t| applies && t.held_at(now_ns, quarantine))
            .filter_map(move |t| {
                let saved = self.backends.get(t.backend)?;
                Some((t, backends.iter().find(|b| same_backend(saved, b))?))
            })
    }
}

/// Reads every in-use backend's cursors, the tuples in quarantine and
/// those of the connections still open from the pinned maps and writes the
/// file (temporary file, then rename). Returns the backends and the tuples
/// saved.
pub fn save(
    pin_dir: &Path,
    file: &Path,
    ports: PortRange,
    (quarantine, idle): (Duration, IdleTimeouts),
    backends: &[VipBackend],
    now: SystemTime,
) -> anyhow::Result<(usize, usize)> {
    let cursors = maps::snat_cursors(pin_dir)?;
    let cpus = possible_cpus()?;
    let mut saved = Saved {
        saved_unix_ms: unix_ms(now),
        port_min: ports.min,
        port_max: ports.max,
        cpus,
        backends: Vec::new(),
        boot_id: boot_id(),
        quarantined: Vec::new(),
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
    let flows = FlowTables::open(pin_dir)?;
    let now_ns = MonotonicClock.now().0;
    let index: HashMap<u32, usize> = backends
        .iter()
        .enumerate()
        .map(|(i, b)| (b.id, i))
        .collect();
    let mut open = Vec::new();
    // Entries that fail to read (removed during the walk) are skipped.
    for (key, entry) in flows.entries() {
        if entry.direction != DIR_TO_CLIENT {
            continue;
        }
        let Some(&backend) = index.get(&entry.backend_id) else {
            continue;
        };
        if in_quarantine(&entry, now_ns, quarantine) {
            saved
                .quarantined
                .push(SavedTuple::of(backend, &key, &entry));
        } else if open_reply(&entry) {
            let forward = flows.get(&forward_key(&key, &entry));
            open.push(OpenTuple {
                backend,
                key,
                entry,
                hold: open_hold(&key, &entry, forward.as_ref(), idle),
            });
        }
    }
    let limits = OpenLimits {
        per_backend: (u32::from(ports.max) - u32::from(ports.min) + 1) as usize / 2,
        per_family: Capacities::of_pins(pin_dir)
            .map(|c| [c.ipv4 as usize / 4, c.ipv6 as usize / 4])
            .unwrap_or([0, 0]),
    };
    saved.quarantined.extend(held_open(open, limits, now_ns));
    let text = serde_json::to_vec(&saved).context("encoding the SNAT cursors")?;
    // It names the clients of open connections: nobody else's business.
    crate::kernel::instance::write_durable(file, &text)
        .with_context(|| format!("writing {}", file.display()))?;
    Ok((saved.backends.len(), saved.quarantined.len()))
}

/// Puts back what [`save`] left, if it still applies (see
/// [`Saved::restorable`] and [`Saved::restorable_tuples`]): the cursors,
/// then the quarantined tuples (each inserted only where the table has
/// nothing, and counted in its backend's tuples held). Returns the
/// backends and the tuples restored. A missing file is nothing to
/// restore; an unreadable one is an error the caller logs (the random
/// start stays).
pub fn restore(
    pin_dir: &Path,
    file: &Path,
    ports: PortRange,
    quarantine: Duration,
    backends: &[VipBackend],
    now: SystemTime,
) -> anyhow::Result<(usize, usize)> {
    let text = match std::fs::read(file) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((0, 0)),
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
    let mut flows = FlowTables::open(pin_dir)?;
    let mut held: BTreeMap<u32, u64> = BTreeMap::new();
    for (tuple, backend) in saved.restorable_tuples(
        MonotonicClock.now().0,
        quarantine,
        ports,
        possible_cpus()?,
        &boot_id(),
        backends,
    ) {
        let (key, entry) = tuple.entry(backend.id, backend.backend.vip_id);
        // NOEXIST: a tuple some flow holds already stays that flow's.
        if flows.insert(&key, entry, BPF_NOEXIST).is_ok() {
            *held.entry(backend.id).or_default() += 1;
        }
    }
    let mut used = maps::snat_used(pin_dir)?;
    for (&id, &n) in &held {
        let before = used.get(&id, 0).unwrap_or(0);
        used.set(id, before + n, 0)
            .with_context(|| format!("writing BACKEND_SNAT_USED[{id}]"))?;
    }
    Ok((restore.len(), held.values().sum::<u64>() as usize))
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
            boot_id: "boot-1".into(),
            quarantined: Vec::new(),
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

    fn closed_reply(backend_id: u32, snat_port: u16, closed_ns: u64) -> (FlowKey, FlowEntry) {
        let key = FlowKey {
            src: [21, 0, 0, 0],
            dst: [9, 0, 0, 0],
            sport: 8080u16.to_be(),
            dport: snat_port.to_be(),
            proto: 6,
            family: lb_common::AF_INET,
            _pad: [0; 2],
        };
        let entry = FlowEntry {
            new_src: [100, 0, 0, 0],
            new_dst: [10, 0, 0, 0],
            new_sport: 80u16.to_be(),
            new_dport: 51_000u16.to_be(),
            backend_id,
            vip_id: 0,
            direction: DIR_TO_CLIENT,
            state: FLOW_CLOSING,
            flags: FLOW_F_CLOSED
                | FLOW_F_TW_SEEN
                | FLOW_F_TW_TS
                | lb_common::FLOW_F_REQUEST_PENDING,
            created_ns: (5_001 << 32) | 2_000,
            last_seen_ns: closed_ns,
            request_ns: 0xdead,
            client_mac: [2, 0, 0, 0, 0, 1],
            client_ifindex: 3,
            hop_ifindex: 7,
            ..FlowEntry::default()
        };
        (key, entry)
    }

    #[test]
    fn quarantined_tuples_come_back_with_their_view_under_the_backends_new_id() {
        let quarantine = Duration::from_secs(65);
        let now_ns = 100_000_000_000;
        let (key, entry) = closed_reply(1, 40_000, now_ns - 3_000_000_000);
        assert!(in_quarantine(&entry, now_ns, quarantine));
        // Open, taken, too old, or the other direction: not in quarantine.
        let open = FlowEntry { flags: 0, ..entry };
        let taken = FlowEntry {
            flags: entry.flags | FLOW_F_TAKEN,
            ..entry
        };
        let old = FlowEntry {
            last_seen_ns: now_ns - 66_000_000_000,
            ..entry
        };
        let forward = FlowEntry {
            direction: lb_common::DIR_TO_BACKEND,
            ..entry
        };
        for e in [open, taken, old, forward] {
            assert!(!in_quarantine(&e, now_ns, quarantine), "{e:?}");
        }

        let t0 = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let mut file = saved(t0);
        // Saved under be 21 of VIP 80 (index 0); its id was 1 then.
        file.quarantined.push(SavedTuple::of(0, &key, &entry));
        let text = serde_json::to_string(&file).unwrap();
        let file: Saved = serde_json::from_str(&text).unwrap();
        // Now its id is 5, of VIP id 2.
        let mut be = backend(5, 80, 21, 8080);
        be.backend.vip_id = 2;
        let now_backends = [backend(0, 80, 22, 8080), be];
        let at = now_ns + 10_000_000_000;
        let got: Vec<_> = file
            .restorable_tuples(at, QUARANTINE, PORTS, 2, "boot-1", &now_backends)
            .map(|(t, b)| t.entry(b.id, b.backend.vip_id))
            .collect();
        assert_eq!(got.len(), 1);
        let (k, e) = got[0];
        assert_eq!(k, key);
        assert_eq!((e.backend_id, e.vip_id), (5, 2));
        // The translation, close time, view and return path come back; the
        // pending bit and the cached hop do not.
        assert_eq!(
            (e.new_src, e.new_dst, e.new_sport, e.new_dport),
            (
                entry.new_src,
                entry.new_dst,
                entry.new_sport,
                entry.new_dport
            )
        );
        assert_eq!(
            (e.created_ns, e.last_seen_ns),
            (entry.created_ns, entry.last_seen_ns)
        );
        assert_eq!(e.flags, FLOW_F_CLOSED | FLOW_F_TW_SEEN | FLOW_F_TW_TS);
        // A FIN the backend had not acknowledged stays so: its tuple is
        // not taken over inside the quarantine after the restart either.
        let unacked = FlowEntry {
            flags: entry.flags | FLOW_F_TW_UNACKED,
            ..entry
        };
        let (_, e) = SavedTuple::of(0, &key, &unacked).entry(5, 2);
        assert_eq!(
            e.flags,
            FLOW_F_CLOSED | FLOW_F_TW_SEEN | FLOW_F_TW_TS | FLOW_F_TW_UNACKED
        );
        assert_eq!((e.client_mac, e.client_ifindex), (entry.client_mac, 3));
        assert_eq!((e.request_ns, e.hop_ifindex), (0, 0));
        // Another boot (close times would mean nothing), no boot id, a
        // quarantine over, another port range or CPU count, or a backend
        // gone: no tuple.
        for boot in ["boot-2", ""] {
            assert_eq!(
                file.restorable_tuples(at, QUARANTINE, PORTS, 2, boot, &now_backends)
                    .count(),
                0,
                "{boot:?}"
            );
        }
        // 70 s after the stop: its close was 73 s ago.
        let late = now_ns + 70_000_000_000;
        assert_eq!(
            file.restorable_tuples(late, QUARANTINE, PORTS, 2, "boot-1", &now_backends)
                .count(),
            0
        );
        let other_ports = PortRange {
            min: PORTS.min,
            max: PORTS.max - 1,
        };
        for (ports, cpus) in [(other_ports, 2), (PORTS, 4)] {
            assert_eq!(
                file.restorable_tuples(at, QUARANTINE, ports, cpus, "boot-1", &now_backends)
                    .count(),
                0
            );
        }
        let without = [backend(0, 80, 22, 8080)];
        assert_eq!(
            file.restorable_tuples(at, QUARANTINE, PORTS, 2, "boot-1", &without)
                .count(),
            0
        );
    }

    #[test]
    fn an_open_connections_tuple_is_held_for_its_idle_timeout_and_a_quarantine_with_no_view() {
        let quarantine = Duration::from_secs(65);
        let idle = IdleTimeouts {
            tcp: Duration::from_secs(300),
            udp: Duration::from_secs(30),
        };
        let stop_ns = 100_000_000_000;
        let (key, closed) = closed_reply(1, 40_000, stop_ns - 3_000_000_000);
        let open = FlowEntry {
            state: lb_common::FLOW_ESTABLISHED,
            flags: lb_common::FLOW_F_REQUEST_PENDING,
            created_ns: stop_ns - 50_000_000_000,
            last_seen_ns: stop_ns - 1_000_000_000,
            ..closed
        };
        assert!(open_reply(&open));
        // Closed, being taken over, or the forward direction: not open.
        let taken = FlowEntry {
            flags: FLOW_F_TAKEN,
            ..open
        };
        let forward = FlowEntry {
            direction: lb_common::DIR_TO_BACKEND,
            ..open
        };
        for e in [closed, taken, forward] {
            assert!(!open_reply(&e), "{e:?}");
        }
        assert_eq!(idle.of(lb_common::IPPROTO_TCP), idle.tcp);
        assert_eq!(idle.of(lb_common::IPPROTO_UDP), idle.udp);

        let close_ns = stop_ns + 300_000_000_000;
        let mut file = saved(UNIX_EPOCH + Duration::from_secs(1_800_000_000));
        file.quarantined
            .push(SavedTuple::open_at_stop(0, &key, &open, close_ns));
        let text = serde_json::to_string(&file).unwrap();
        let file: Saved = serde_json::from_str(&text).unwrap();
        let now_backends = [backend(5, 80, 21, 8080)];
        let restorable = |now_ns| {
            file.restorable_tuples(now_ns, quarantine, PORTS, 2, "boot-1", &now_backends)
                .map(|(t, b)| t.entry(b.id, b.backend.vip_id))
                .collect::<Vec<_>>()
        };
        // Held from the stop through the idle timeout and a quarantine,
        // long after the cursors stop applying (65 s).
        for after_stop_s in [1, 120, 364] {
            let got = restorable(stop_ns + after_stop_s * 1_000_000_000);
            assert_eq!(got.len(), 1, "{after_stop_s} s after the stop");
            let (k, e) = got[0];
            assert_eq!(k, key);
            // Closed at the end of the idle timeout, with no TIME_WAIT view:
            // the kernel lets no SYN take it over inside the quarantine
            // (`flow::may_take_over` needs FLOW_F_TW_SEEN).
            assert_eq!(e.flags, FLOW_F_CLOSED);
            assert_eq!((e.created_ns, e.last_seen_ns), (0, close_ns));
            assert_eq!((e.direction, e.state), (DIR_TO_CLIENT, FLOW_CLOSING));
            assert_eq!((e.new_dst, e.new_dport), (open.new_dst, open.new_dport));
            assert_eq!(e.request_ns, 0);
        }
        assert!(restorable(stop_ns + 366 * 1_000_000_000).is_empty());
    }

    /// An open connection at the stop: its reply entry at its key (as
    /// `closed_reply`, open) and its forward entry, last used at `last_ns`.
    fn open_connection(snat_port: u16, last_ns: u64) -> (FlowKey, FlowEntry, FlowEntry) {
        let (key, closed) = closed_reply(1, snat_port, 0);
        let reply = FlowEntry {
            state: lb_common::FLOW_ESTABLISHED,
            flags: 0,
            created_ns: 0,
            last_seen_ns: 0,
            ..closed
        };
        let forward = FlowEntry {
            new_src: key.dst,
            new_dst: key.src,
            new_sport: key.dport,
            new_dport: key.sport,
            direction: lb_common::DIR_TO_BACKEND,
            flags: FLOW_F_SYNACK_SEEN,
            last_seen_ns: last_ns,
            ..reply
        };
        (key, reply, forward)
    }

    #[test]
    fn an_open_connection_is_held_until_its_idle_timeout_from_its_last_packet() {
        let idle = IdleTimeouts {
            tcp: Duration::from_secs(300),
            udp: Duration::from_secs(30),
        };
        let last_ns = 90_000_000_000;
        let (key, reply, forward) = open_connection(40_000, last_ns);
        // The forward entry's key is the client's tuple towards the VIP.
        let fwd_key = forward_key(&key, &reply);
        assert_eq!(
            (fwd_key.src, fwd_key.dst, fwd_key.sport, fwd_key.dport),
            (
                reply.new_dst,
                reply.new_src,
                reply.new_dport,
                reply.new_sport
            )
        );
        assert_eq!(
            open_hold(&key, &reply, Some(&forward), idle),
            Some((last_ns, last_ns + 300_000_000_000))
        );
        let udp_key = FlowKey {
            proto: lb_common::IPPROTO_UDP,
            ..key
        };
        let udp_forward = FlowEntry {
            flags: 0,
            ..forward
        };
        assert_eq!(
            open_hold(&udp_key, &reply, Some(&udp_forward), idle),
            Some((last_ns, last_ns + 30_000_000_000))
        );
        // Not established both ways: no forward entry, one that points at
        // another tuple or backend or is closed, or a SYN never answered.
        let elsewhere = FlowEntry {
            new_sport: 40_001u16.to_be(),
            ..forward
        };
        let other_backend = FlowEntry {
            backend_id: 2,
            ..forward
        };
        let closed = FlowEntry {
            flags: FLOW_F_SYNACK_SEEN | FLOW_F_CLOSED,
            ..forward
        };
        let unanswered = FlowEntry {
            flags: 0,
            ..forward
        };
        for fwd in [
            None,
            Some(elsewhere),
            Some(other_backend),
            Some(closed),
            Some(unanswered),
        ] {
            assert_eq!(open_hold(&key, &reply, fwd.as_ref(), idle), None, "{fwd:?}");
        }
    }

    #[test]
    fn open_tuples_past_the_limits_are_held_for_a_quarantine_from_the_stop() {
        let now_ns = 100_000_000_000;
        let hold = 300_000_000_000;
        // Backend 0: four connections, last used 1..4 s before the stop;
        // backend 1: one; and one of backend 0 not established both ways.
        let mut open = Vec::new();
        for (backend, port, ago_s) in [
            (0, 40_001, 4),
            (0, 40_002, 1),
            (0, 40_003, 3),
            (0, 40_004, 2),
            (1, 40_005, 5),
        ] {
            let last = now_ns - ago_s * 1_000_000_000;
            let (key, entry, _) = open_connection(port, last);
            open.push(OpenTuple {
                backend,
                key,
                entry,
                hold: Some((last, last + hold)),
            });
        }
        let (key, entry, _) = open_connection(40_006, 0);
        open.push(OpenTuple {
            backend: 0,
            key,
            entry,
            hold: None,
        });
        let closes = |limits| {
            held_open(open.clone(), limits, now_ns)
                .into_iter()
                .map(|t| (u16::from_be(t.key.3), (t.closed_ns, t.flags, t.view)))
                .collect::<BTreeMap<_, _>>()
        };
        let until = |ago_s: u64| now_ns - ago_s * 1_000_000_000 + hold;
        // Two per backend: backend 0's two most recently used are held to
        // their idle timeout, its other two and the unestablished one for
        // a quarantine from the stop; none with a TIME_WAIT view.
        let got = closes(OpenLimits {
            per_backend: 2,
            per_family: [100, 100],
        });
        let want = BTreeMap::from([
            (40_001, (now_ns, FLOW_F_CLOSED, 0)),
            (40_002, (until(1), FLOW_F_CLOSED, 0)),
            (40_003, (now_ns, FLOW_F_CLOSED, 0)),
            (40_004, (until(2), FLOW_F_CLOSED, 0)),
            (40_005, (until(5), FLOW_F_CLOSED, 0)),
            (40_006, (now_ns, FLOW_F_CLOSED, 0)),
        ]);
        assert_eq!(got, want);
        // Three in the family's table: the three most recently used of all.
        let got = closes(OpenLimits {
            per_backend: 100,
            per_family: [3, 0],
        });
        let held: Vec<u16> = got
            .iter()
            .filter(|(_, (closed, ..))| *closed > now_ns)
            .map(|(port, _)| *port)
            .collect();
        assert_eq!(held, [40_002, 40_003, 40_004]);
    }

    #[test]
    fn the_file_round_trips_through_json() {
        let s = saved(UNIX_EPOCH + Duration::from_secs(1_800_000_000));
        let text = serde_json::to_string(&s).unwrap();
        assert_eq!(serde_json::from_str::<Saved>(&text).unwrap(), s);
    }
}
