//! Keeps the host's own connections out of the SNAT port range:
//! `net.ipv4.ip_local_reserved_ports` (which covers IPv6 too) gets the range
//! added, so the kernel never picks one of those ports as an ephemeral
//! source port. Without it, a host connection from the SNAT address and a
//! port in the range would collide with a balanced flow's tuple (and its
//! replies would be dropped as `drop_snat_no_flow`). The sysctl is per
//! network namespace; existing entries are kept.
//!
//! What lb-user added is given back on a clean stop, and only that: the
//! ports it added (those of the range that were not reserved already) are
//! written to a record, `/run/lb-user/<instance>.reserved-ports`, with the
//! network namespace they belong to. A clean stop removes the recorded
//! ports from the sysctl and the record. A start that finds the record of a
//! predecessor that died (same instance, same namespace) takes its ports
//! over, so a crash, a restart and a clean stop leave the sysctl as it was
//! before the first start.
//!
//! Several instances in one namespace (one per NIC) may share ports: the
//! default range is the same for all. The record also names the range an
//! instance uses, and a clean stop keeps reserved what another running
//! instance of the namespace uses, handing those ports to that instance's
//! record: the last of them to stop gives them back.
//!
//! A range that would leave the host fewer than [`MIN_FREE_EPHEMERAL_PORTS`]
//! of its ephemeral ports (`net.ipv4.ip_local_port_range`) is refused
//! before anything is reserved: lb-user's own health checks, its etcd
//! client and every other connection the host opens need a source port,
//! and `connect` fails once every port of that range is reserved.

use std::{
    fs,
    path::{Path, PathBuf},
};

use anyhow::Context as _;
use tracing::{info, warn};

use crate::{
    kernel::instance::{RESERVED_PORTS_SUFFIX, RUN_FILE_MODE, run_file, write_private},
    settings::ports::PortRange,
};

/// The sysctl's file.
pub const RESERVED_PORTS: &str = "/proc/sys/net/ipv4/ip_local_reserved_ports";
/// The host's ephemeral port range (`low high`).
pub const EPHEMERAL_PORTS: &str = "/proc/sys/net/ipv4/ip_local_port_range";
/// The fewest ephemeral ports the reservation may leave the host.
pub const MIN_FREE_EPHEMERAL_PORTS: u32 = 1024;

/// Where an instance records the ports it added to the sysctl.
pub fn record_path(instance: &str) -> PathBuf {
    run_file(instance, RESERVED_PORTS_SUFFIX)
}

/// This process's network namespace, as `/proc/self/ns/net` names it
/// (`net:[4026531840]`); empty if it cannot be read.
fn current_netns() -> String {
    fs::read_link("/proc/self/ns/net")
        .map(|p| p.display().to_string())
        .unwrap_or_default()
}

/// Adds `range` to the reserved ports, unless already reserved, records
/// what it added for [`release_snat_ports`], and logs it. A failure to
/// reserve is an error the caller reports (the balancer must not run with
/// host connections able to take SNAT ports); a failure to record is a
/// warning (the ports then stay reserved after the stop).
pub fn reserve_snat_ports(range: PortRange, instance: &str) -> anyhow::Result<()> {
    reserve_in(
        Path::new(RESERVED_PORTS),
        Path::new(EPHEMERAL_PORTS),
        &record_path(instance),
        &current_netns(),
        range,
    )
}

/// Whether [`reserve_snat_ports`] would accept `range`, reading only: the
/// start runs it before it attaches or adopts anything, so a range that
/// leaves the host too few ephemeral ports is refused with the running
/// instance (if any) untouched. The reservation itself checks again.
pub fn check_snat_ports(range: PortRange, instance: &str) -> anyhow::Result<()> {
    check_in(
        Path::new(RESERVED_PORTS),
        Path::new(EPHEMERAL_PORTS),
        &record_path(instance),
        &current_netns(),
        range,
    )
    .map(|_| ())
}

/// Removes the ports this instance (or a predecessor of it that died in
/// this network namespace) added to the reserved ports, and its record.
/// Called once the program is detached; failures are logged, not fatal.
pub fn release_snat_ports(instance: &str) {
    release_in(
        Path::new(RESERVED_PORTS),
        &record_path(instance),
        &current_netns(),
        |record| {
            instance_of(record).is_some_and(|name| {
                holds_ports(
                    name,
                    &crate::kernel::instance::pin_root(),
                    crate::kernel::instance::is_running,
                )
            })
        },
    );
}

/// Whether instance `name` still uses its SNAT ports: its process runs, or
/// its program does without it (killed, or left attached by a failed start
/// on a running instance: its link is pinned under `pin_root`). Its ports
/// are then handed to its record, not released under its live flows.
fn holds_ports(name: &str, pin_root: &Path, running: impl Fn(&str) -> bool) -> bool {
    running(name)
        || pin_root
            .join(name)
            .join(crate::kernel::instance::LINK_PIN)
            .exists()
}

/// The instance a record in [`LOCK_DIR`](crate::kernel::instance::LOCK_DIR) belongs to.
fn instance_of(record: &Path) -> Option<&str> {
    record
        .file_name()?
        .to_str()?
        .strip_suffix(RESERVED_PORTS_SUFFIX)
}

fn reserve_in(
    sysctl: &Path,
    ephemeral: &Path,
    record: &Path,
    netns: &str,
    range: PortRange,
) -> anyhow::Result<()> {
    let _records = RecordsLock::take(record);
    let Judged {
        current,
        wanted,
        inherited,
    } = check_in(sysctl, ephemeral, record, netns, range)?;
    let added = wanted.difference(&current);
    if added.is_empty() {
        info!(
            ports = %range,
            "SNAT ports already in net.ipv4.ip_local_reserved_ports"
        );
    } else {
        let value = current.union(&wanted).to_text();
        fs::write(sysctl, &value).with_context(|| {
            format!(
                "reserving the SNAT ports {range} in {} (the host's own connections must \
                 not take them)",
                sysctl.display()
            )
        })?;
        info!(ports = %range, value, "reserved the SNAT ports: net.ipv4.ip_local_reserved_ports");
    }
    // A predecessor's ports (it died without its clean stop) are ours now.
    // Recorded even when we added none: what we use is kept reserved when
    // another instance of this namespace that added them stops.
    let own = Record {
        owned: added.union(&inherited),
        wanted,
    };
    let result = fs::create_dir_all(record.parent().unwrap_or(Path::new("/")))
        .and_then(|()| own.write(record, netns));
    if let Err(e) = result {
        warn!(
            record = %record.display(),
            "cannot record the SNAT ports added to net.ipv4.ip_local_reserved_ports \
             (they will stay reserved after the stop): {e}"
        );
    }
    Ok(())
}

/// What [`check_in`] read and accepted.
struct Judged {
    /// The reserved ports now.
    current: PortSet,
    /// The SNAT range's ports.
    wanted: PortSet,
    /// Those a predecessor of this instance (same namespace) added.
    inherited: PortSet,
}

/// Reads the reserved ports and `record`, and refuses `range` if it leaves
/// the host too few ephemeral ports ([`check_ephemeral_left`]). Writes
/// nothing.
fn check_in(
    sysctl: &Path,
    ephemeral: &Path,
    record: &Path,
    netns: &str,
    range: PortRange,
) -> anyhow::Result<Judged> {
    let text = fs::read_to_string(sysctl)
        .with_context(|| format!("reading {} to reserve the SNAT ports", sysctl.display()))?;
    let current = PortSet::parse(&text);
    let mut wanted = PortSet::default();
    wanted.insert_range(range.min, range.max);
    // Judged against the reservations that are not ours: a predecessor's
    // ports (it died without its clean stop) count as this range's.
    let inherited = read_record(record, netns)
        .map(|r| r.owned)
        .unwrap_or_default();
    check_ephemeral_left(ephemeral, &current.difference(&inherited), &wanted, range)?;
    Ok(Judged {
        current,
        wanted,
        inherited,
    })
}

/// The ports a record of this network namespace lists; `None` without a
/// record, or for one written in another namespace (it is not ours).
/// Refuses the SNAT ports `wanted` if they leave fewer than
/// [`MIN_FREE_EPHEMERAL_PORTS`] of the host's ephemeral range outside the
/// reserved ports (`others`: those reserved by anyone but lb-user, plus
/// `wanted`). A range that takes none of the ephemeral ports is never
/// refused, however few the operator's own reservations leave. A range
/// file it cannot read or parse is a warning, not a refusal: the
/// reservation itself is what keeps balanced flows safe.
fn check_ephemeral_left(
    ephemeral: &Path,
    others: &PortSet,
    wanted: &PortSet,
    range: PortRange,
) -> anyhow::Result<()> {
    let text = match fs::read_to_string(ephemeral) {
        Ok(text) => text,
        Err(e) => {
            warn!(file = %ephemeral.display(), "cannot read the host's ephemeral port range: {e}");
            return Ok(());
        }
    };
    let mut bounds = text.split_whitespace().map(str::parse::<u16>);
    let (Some(Ok(low)), Some(Ok(high))) = (bounds.next(), bounds.next()) else {
        warn!(file = %ephemeral.display(), text = text.trim(), "cannot parse the host's ephemeral port range");
        return Ok(());
    };
    let (low, high) = (low.min(high), low.max(high));
    let free_of = |set: &PortSet| (low..=high).filter(|&p| !set.contains(p)).count() as u32;
    let before = free_of(others);
    let free = free_of(&others.union(wanted));
    if free == before {
        return Ok(());
    }
    let total = u32::from(high - low) + 1;
    if free < MIN_FREE_EPHEMERAL_PORTS.min(total) {
        anyhow::bail!(
            "the SNAT ports {range} would leave the host {free} of its {total} ephemeral ports \
             ({} = {low}-{high}, less net.ipv4.ip_local_reserved_ports): health checks and the \
             host's own connections need at least {MIN_FREE_EPHEMERAL_PORTS}. Narrow --snat-ports, \
             or move the ephemeral range out of it (sysctl net.ipv4.ip_local_port_range)",
            ephemeral.display()
        );
    }
    info!(
        ports = %range,
        ephemeral = %format!("{low}-{high}"),
        free,
        "the SNAT ports overlap the host's ephemeral range; the host keeps the rest"
    );
    Ok(())
}

/// An instance's record: the ports it added to the sysctl (its own to give
/// back) and the ports its SNAT range uses.
struct Record {
    owned: PortSet,
    wanted: PortSet,
}

impl Record {
    /// `netns`, the owned ports and the wanted ones, a line each.
    fn write(&self, path: &Path, netns: &str) -> std::io::Result<()> {
        let text = format!(
            "{netns}\n{}\n{}\n",
            self.owned.to_text(),
            self.wanted.to_text()
        );
        write_private(path, text.as_bytes())
    }
}

/// The record at `record` if it was written in network namespace `netns`;
/// `None` without one, or for another namespace's (it is not ours). A
/// record of an earlier version has no wanted ports.
fn read_record(record: &Path, netns: &str) -> Option<Record> {
    let text = fs::read_to_string(record).ok()?;
    let mut lines = text.lines();
    (lines.next()? == netns).then(|| Record {
        owned: PortSet::parse(lines.next().unwrap_or_default()),
        wanted: PortSet::parse(lines.next().unwrap_or_default()),
    })
}

/// Gives back the ports `record` owns, but for those another running
/// instance of `netns` (its record beside this one, `live` for it) wants:
/// those go into that instance's record, so they stay reserved until it
/// stops too.
fn release_in(sysctl: &Path, record: &Path, netns: &str, live: impl Fn(&Path) -> bool) {
    let _records = RecordsLock::take(record);
    let Some(own) = read_record(record, netns) else {
        return;
    };
    let mut handed = PortSet::default();
    for other in sibling_records(record) {
        if !live(&other) {
            continue;
        }
        let Some(mut theirs) = read_record(&other, netns) else {
            continue;
        };
        let theirs_now = own.owned.intersection(&theirs.wanted).difference(&handed);
        if theirs_now.is_empty() {
            continue;
        }
        theirs.owned = theirs.owned.union(&theirs_now);
        if let Err(e) = theirs.write(&other, netns) {
            warn!(
                record = %other.display(),
                "cannot hand SNAT ports to another instance's record (they will stay \
                 reserved after it stops): {e}"
            );
        }
        info!(
            ports = %theirs_now.to_text(), record = %other.display(),
            "SNAT ports kept reserved for another running instance"
        );
        handed = handed.union(&theirs_now);
    }
    let owned = own.owned.difference(&handed);
    if owned.is_empty() {
        remove_record(record);
        return;
    }
    let released = fs::read_to_string(sysctl).and_then(|text| {
        let current = PortSet::parse(&text);
        let kept = current.difference(&owned);
        if kept == current {
            return Ok(None);
        }
        let value = kept.to_text();
        // The kernel reads an empty value as "no ports"; a bare newline
        // is what it prints then.
        fs::write(sysctl, if value.is_empty() { "\n" } else { &value }).map(|()| Some(value))
    });
    match released {
        Ok(Some(value)) => info!(
            ports = %owned.to_text(), value,
            "released the SNAT ports: net.ipv4.ip_local_reserved_ports"
        ),
        Ok(None) => {}
        Err(e) => {
            warn!(
                ports = %owned.to_text(),
                "cannot release the SNAT ports from net.ipv4.ip_local_reserved_ports \
                 (they stay reserved): {e}"
            );
            return;
        }
    }
    remove_record(record);
}

fn remove_record(record: &Path) {
    if let Err(e) = fs::remove_file(record) {
        warn!(record = %record.display(), "cannot remove the SNAT ports' record: {e}");
    }
}

/// Serializes the reservations and releases of every instance on the host
/// (a `flock` on a file beside the records): a start that finds the ports
/// reserved records that it uses them before a stop of the instance that
/// reserved them reads the records, or after it gave them back (and then
/// reserves them itself). Held until dropped.
struct RecordsLock {
    _held: Option<nix::fcntl::Flock<fs::File>>,
}

impl RecordsLock {
    /// How long a start or a stop waits for another one's reservation.
    const WAIT: std::time::Duration = std::time::Duration::from_secs(5);

    /// Takes the lock of `record`'s directory, waiting at most
    /// [`Self::WAIT`]; past that, or if the lock file cannot be opened, it
    /// goes on without it and says so (a reservation or release is a
    /// few file writes: a holder that long is stuck).
    fn take(record: &Path) -> Self {
        use std::os::unix::fs::OpenOptionsExt as _;

        use nix::fcntl::{Flock, FlockArg};
        let path = record
            .parent()
            .unwrap_or(Path::new("/"))
            .join(".reserved-ports.lock");
        let mut file = match fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(RUN_FILE_MODE)
            .open(&path)
        {
            Ok(file) => file,
            Err(e) => {
                warn!(lock = %path.display(), "cannot open the SNAT records' lock: {e}");
                return Self { _held: None };
            }
        };
        // One left by an earlier version may be readable by all.
        let _ = file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(RUN_FILE_MODE));
        let deadline = std::time::Instant::now() + Self::WAIT;
        // The same open file each try: `Flock::lock` hands it back when the
        // lock is held elsewhere.
        loop {
            match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
                Ok(lock) => return Self { _held: Some(lock) },
                Err((again, nix::errno::Errno::EWOULDBLOCK))
                    if std::time::Instant::now() < deadline =>
                {
                    file = again;
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                Err((_, e)) => {
                    warn!(lock = %path.display(), "going on without the SNAT records' lock: {e}");
                    return Self { _held: None };
                }
            }
        }
    }
}

/// The other records in `record`'s directory.
fn sibling_records(record: &Path) -> Vec<PathBuf> {
    let Some(dir) = record.parent() else {
        return Vec::new();
    };
    let mut records: Vec<PathBuf> = fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p != record && instance_of(p).is_some())
        .collect();
    records.sort();
    records
}

/// A set of TCP/UDP ports, read from and written as the sysctl's text:
/// comma-separated ports and `a-b` ranges.
#[derive(Clone, PartialEq, Eq)]
pub struct PortSet {
    bits: Box<[u64; 1024]>,
}

impl Default for PortSet {
    fn default() -> Self {
        Self {
            bits: Box::new([0; 1024]),
        }
    }
}

impl PortSet {
    /// The ports of `text`; parts that are not a port or a range are
    /// skipped (the kernel's own text has none).
    pub fn parse(text: &str) -> Self {
        let mut set = Self::default();
        for part in text.trim().split(',') {
            let part = part.trim();
            let (a, b) = part.split_once('-').unwrap_or((part, part));
            if let (Ok(a), Ok(b)) = (a.trim().parse::<u16>(), b.trim().parse::<u16>()) {
                set.insert_range(a.min(b), a.max(b));
            }
        }
        set
    }

    pub fn insert_range(&mut self, min: u16, max: u16) {
        for port in min..=max {
            self.bits[usize::from(port / 64)] |= 1 << (port % 64);
        }
    }

    pub fn contains(&self, port: u16) -> bool {
        self.bits[usize::from(port / 64)] & (1 << (port % 64)) != 0
    }

    pub fn is_empty(&self) -> bool {
        self.bits.iter().all(|&w| w == 0)
    }

    /// The ports of `self` that are not in `other`.
    pub fn difference(&self, other: &Self) -> Self {
        let mut out = self.clone();
        for (w, o) in out.bits.iter_mut().zip(other.bits.iter()) {
            *w &= !o;
        }
        out
    }

    /// The ports in both.
    pub fn intersection(&self, other: &Self) -> Self {
        let mut out = self.clone();
        for (w, o) in out.bits.iter_mut().zip(other.bits.iter()) {
            *w &= o;
        }
        out
    }

    pub fn union(&self, other: &Self) -> Self {
        let mut out = self.clone();
        for (w, o) in out.bits.iter_mut().zip(other.bits.iter()) {
            *w |= o;
        }
        out
    }

    /// The sysctl's text: ascending, consecutive ports as `a-b`.
    pub fn to_text(&self) -> String {
        let mut parts = Vec::new();
        let mut port = 0u32;
        while port <= u32::from(u16::MAX) {
            if !self.contains(port as u16) {
                port += 1;
                continue;
            }
            let start = port;
            while port < u32::from(u16::MAX) && self.contains(port as u16 + 1) {
                port += 1;
            }
            parts.push(if start == port {
                start.to_string()
            } else {
                format!("{start}-{port}")
            });
            port += 1;
        }
        parts.join(",")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(text: &str) -> PortSet {
        PortSet::parse(text)
    }

    /// A sibling whose process died but whose program still runs (its
    /// link pinned) keeps its ports.
    #[test]
    fn an_instance_whose_program_runs_on_holds_its_ports() {
        let root = std::env::temp_dir().join(format!("lb-pins-{}", std::process::id()));
        std::fs::create_dir_all(root.join("lb-eth1")).unwrap();
        std::fs::write(
            root.join("lb-eth1").join(crate::kernel::instance::LINK_PIN),
            "",
        )
        .unwrap();
        std::fs::create_dir_all(root.join("lb-eth2")).unwrap();
        let dead = |_: &str| false;
        assert!(
            holds_ports("lb-eth1", &root, dead),
            "killed, still attached"
        );
        assert!(
            !holds_ports("lb-eth2", &root, dead),
            "stopped: pins without a link"
        );
        assert!(!holds_ports("lb-eth3", &root, dead), "gone");
        assert!(holds_ports("lb-eth3", &root, |n| n == "lb-eth3"), "running");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn port_sets_read_and_write_the_kernels_text() {
        assert_eq!(set("").to_text(), "");
        assert_eq!(set("\n").to_text(), "");
        assert_eq!(set("8080,9000-9100\n").to_text(), "8080,9000-9100");
        // Overlaps and neighbours merge; order does not matter.
        assert_eq!(
            set("20000-30000,20000-32767,8080").to_text(),
            "8080,20000-32767"
        );
        assert_eq!(set("5,6,7,9").to_text(), "5-7,9");
        assert_eq!(set("0,65535").to_text(), "0,65535");
        assert_eq!(set("65530-65535").to_text(), "65530-65535");
        // Junk is skipped, not fatal.
        assert_eq!(set("x,12,a-b").to_text(), "12");
    }

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("lb-sysctl-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    const NS: &str = "net:[1]";

    /// Linux's default ephemeral range, written as its sysctl reads.
    fn ephemeral(dir: &Path) -> PathBuf {
        let path = dir.join("ip_local_port_range");
        fs::write(&path, "32768\t60999\n").unwrap();
        path
    }

    #[test]
    fn a_stop_releases_exactly_the_ports_the_start_added() {
        let dir = temp_dir("release");
        let (sysctl, record) = (dir.join("reserved"), dir.join("default.reserved-ports"));
        // 25000 was the operator's before the start; so were 8080 and 100-120.
        fs::write(&sysctl, "8080,25000,100-120\n").unwrap();
        reserve_in(
            &sysctl,
            &ephemeral(&dir),
            &record,
            NS,
            PortRange {
                min: 20000,
                max: 32767,
            },
        )
        .unwrap();
        assert_eq!(
            fs::read_to_string(&sysctl).unwrap(),
            "100-120,8080,20000-32767"
        );
        assert_eq!(
            fs::read_to_string(&record).unwrap(),
            format!("{NS}\n20000-24999,25001-32767\n20000-32767\n")
        );
        // Meanwhile the operator reserves another port.
        fs::write(&sysctl, "100-120,8080,9090,20000-32767").unwrap();
        release_in(&sysctl, &record, NS, |_| false);
        assert_eq!(
            fs::read_to_string(&sysctl).unwrap(),
            "100-120,8080,9090,25000"
        );
        assert!(!record.exists(), "the record goes with the release");
        // A second release (no record) changes nothing.
        release_in(&sysctl, &record, NS, |_| false);
        assert_eq!(
            fs::read_to_string(&sysctl).unwrap(),
            "100-120,8080,9090,25000"
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_range_already_reserved_is_recorded_as_used_but_never_released() {
        let dir = temp_dir("covered");
        let (sysctl, record) = (dir.join("reserved"), dir.join("default.reserved-ports"));
        fs::write(&sysctl, "1000-40000").unwrap();
        reserve_in(
            &sysctl,
            &ephemeral(&dir),
            &record,
            NS,
            PortRange {
                min: 20000,
                max: 32767,
            },
        )
        .unwrap();
        assert_eq!(fs::read_to_string(&sysctl).unwrap(), "1000-40000");
        // Nothing added, but the range it uses is on record.
        assert_eq!(
            fs::read_to_string(&record).unwrap(),
            format!("{NS}\n\n20000-32767\n")
        );
        release_in(&sysctl, &record, NS, |_| false);
        assert_eq!(fs::read_to_string(&sysctl).unwrap(), "1000-40000");
        fs::remove_dir_all(&dir).unwrap();
    }

    /// Two instances of one namespace with the default range, and a third
    /// with another: whichever stops first keeps reserved what a running
    /// one uses, and the last one gives the ports back.
    #[test]
    fn instances_sharing_ports_release_them_when_the_last_one_stops() {
        let dir = temp_dir("shared");
        let sysctl = dir.join("reserved");
        let record = |name: &str| dir.join(format!("{name}{RESERVED_PORTS_SUFFIX}"));
        fs::write(&sysctl, "8080\n").unwrap();
        let reserve = |name: &str, min: u16, max: u16| {
            reserve_in(
                &sysctl,
                &ephemeral(&dir),
                &record(name),
                NS,
                PortRange { min, max },
            )
            .unwrap()
        };
        reserve("lb-eth0", 20000, 32767);
        reserve("lb-eth1", 20000, 32767);
        reserve("lb-eth2", 30000, 40000);
        assert_eq!(fs::read_to_string(&sysctl).unwrap(), "8080,20000-40000");
        // The first stops; lb-eth1 and lb-eth2 run and use some of its ports.
        let running = |names: &'static [&'static str]| {
            move |p: &Path| instance_of(p).is_some_and(|i| names.contains(&i))
        };
        release_in(
            &sysctl,
            &record("lb-eth0"),
            NS,
            running(&["lb-eth1", "lb-eth2"]),
        );
        assert_eq!(fs::read_to_string(&sysctl).unwrap(), "8080,20000-40000");
        assert!(!record("lb-eth0").exists());
        assert_eq!(
            fs::read_to_string(record("lb-eth1")).unwrap(),
            format!("{NS}\n20000-32767\n20000-32767\n"),
            "lb-eth1 now owns the ports it uses"
        );
        // lb-eth1 stops: lb-eth2 still uses 30000-32767 (and owns
        // 32768-40000 already).
        release_in(&sysctl, &record("lb-eth1"), NS, running(&["lb-eth2"]));
        assert_eq!(fs::read_to_string(&sysctl).unwrap(), "8080,30000-40000");
        // The last one gives everything back.
        release_in(&sysctl, &record("lb-eth2"), NS, running(&[]));
        assert_eq!(fs::read_to_string(&sysctl).unwrap(), "8080");
        // A record of an instance that is not running changes nothing.
        reserve("lb-eth0", 20000, 32767);
        reserve("lb-eth1", 20000, 32767);
        release_in(&sysctl, &record("lb-eth0"), NS, running(&[]));
        assert_eq!(fs::read_to_string(&sysctl).unwrap(), "8080");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn reservations_and_releases_wait_for_each_other() {
        let dir = temp_dir("records-lock");
        let record = dir.join("a.reserved-ports");
        let held = RecordsLock::take(&record);
        assert!(held._held.is_some());
        use std::os::unix::fs::PermissionsExt as _;
        let mode = fs::metadata(dir.join(".reserved-ports.lock"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, RUN_FILE_MODE, "root's alone, as the records");
        let waiter = {
            let record = dir.join("b.reserved-ports");
            std::thread::spawn(move || {
                let start = std::time::Instant::now();
                let lock = RecordsLock::take(&record);
                (start.elapsed(), lock._held.is_some())
            })
        };
        std::thread::sleep(std::time::Duration::from_millis(200));
        drop(held);
        let (waited, got) = waiter.join().unwrap();
        assert!(got, "the second one got the lock once the first let go");
        assert!(
            waited >= std::time::Duration::from_millis(150),
            "it waited for the first: {waited:?}"
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_record_of_an_earlier_version_is_read_as_owned_ports_only() {
        let dir = temp_dir("old-record");
        let (sysctl, record) = (dir.join("reserved"), dir.join("default.reserved-ports"));
        fs::write(&sysctl, "8080,20000-32767\n").unwrap();
        fs::write(&record, format!("{NS}\n20000-32767\n")).unwrap();
        let read = read_record(&record, NS).unwrap();
        assert_eq!(read.owned.to_text(), "20000-32767");
        assert!(read.wanted.is_empty());
        release_in(&sysctl, &record, NS, |_| false);
        assert_eq!(fs::read_to_string(&sysctl).unwrap(), "8080");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_restart_after_a_crash_takes_over_its_predecessors_ports() {
        let dir = temp_dir("crash");
        let (sysctl, record) = (dir.join("reserved"), dir.join("default.reserved-ports"));
        fs::write(&sysctl, "8080").unwrap();
        reserve_in(
            &sysctl,
            &ephemeral(&dir),
            &record,
            NS,
            PortRange { min: 100, max: 200 },
        )
        .unwrap();
        // Killed: no release. The restart (with another range) finds
        // 100-200 reserved, but the record says they were added by us.
        reserve_in(
            &sysctl,
            &ephemeral(&dir),
            &record,
            NS,
            PortRange { min: 150, max: 300 },
        )
        .unwrap();
        assert_eq!(fs::read_to_string(&sysctl).unwrap(), "100-300,8080");
        release_in(&sysctl, &record, NS, |_| false);
        assert_eq!(fs::read_to_string(&sysctl).unwrap(), "8080");
        // Another namespace's record is not ours: kept, and not used.
        reserve_in(
            &sysctl,
            &ephemeral(&dir),
            &record,
            "net:[2]",
            PortRange { min: 100, max: 200 },
        )
        .unwrap();
        release_in(&sysctl, &record, NS, |_| false);
        assert_eq!(fs::read_to_string(&sysctl).unwrap(), "100-200,8080");
        assert!(record.exists());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_unreadable_sysctl_is_an_error_that_names_it() {
        let dir = temp_dir("missing");
        let err = reserve_in(
            &dir.join("missing"),
            &ephemeral(&dir),
            &dir.join("record"),
            NS,
            PortRange { min: 1, max: 2 },
        )
        .unwrap_err();
        assert!(
            format!("{err:#}").contains("reserve the SNAT ports"),
            "{err:#}"
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_range_that_leaves_the_host_too_few_ephemeral_ports_is_refused_before_anything_is_reserved()
    {
        let dir = temp_dir("ephemeral");
        let (sysctl, record) = (dir.join("reserved"), dir.join("default.reserved-ports"));
        // 40000-60999 of the ephemeral range is the operator's already.
        fs::write(&sysctl, "40000-60999").unwrap();
        let whole = PortRange {
            min: 1024,
            max: 65535,
        };
        let err = reserve_in(&sysctl, &ephemeral(&dir), &record, NS, whole).unwrap_err();
        let text = format!("{err:#}");
        assert!(
            text.contains("would leave the host 0 of its 28232 ephemeral ports")
                && text.contains("32768-60999")
                && text.contains("--snat-ports"),
            "{text}"
        );
        assert_eq!(
            fs::read_to_string(&sysctl).unwrap(),
            "40000-60999",
            "untouched"
        );
        assert!(!record.exists());
        // The start's check before it attaches reads only: the same
        // verdicts, nothing written.
        let err = check_in(&sysctl, &ephemeral(&dir), &record, NS, whole).err();
        assert!(
            format!("{err:?}").contains("would leave the host 0 of its 28232 ephemeral ports"),
            "{err:?}"
        );
        let fits = PortRange {
            min: 20000,
            max: 38975,
        };
        check_in(&sysctl, &ephemeral(&dir), &record, NS, fits).unwrap();
        assert_eq!(fs::read_to_string(&sysctl).unwrap(), "40000-60999");
        assert!(!record.exists());
        // 1,023 left (32768-33790 reserved with the operator's): refused;
        // 1,024 left: taken, with the overlap logged.
        let short = PortRange {
            min: 20000,
            max: 38976,
        };
        let err = reserve_in(&sysctl, &ephemeral(&dir), &record, NS, short).unwrap_err();
        assert!(format!("{err:#}").contains("1023 of its 28232"), "{err:#}");
        let enough = PortRange {
            min: 20000,
            max: 38975,
        };
        reserve_in(&sysctl, &ephemeral(&dir), &record, NS, enough).unwrap();
        assert_eq!(
            fs::read_to_string(&sysctl).unwrap(),
            "20000-38975,40000-60999"
        );
        // A restart after a kill -9 judges the range as the first start
        // did: its predecessor's ports are its own, not the operator's.
        reserve_in(&sysctl, &ephemeral(&dir), &record, NS, short).unwrap_err();
        reserve_in(&sysctl, &ephemeral(&dir), &record, NS, enough).unwrap();
        // A range file that cannot be read does not block the start.
        release_in(&sysctl, &record, NS, |_| false);
        reserve_in(&sysctl, &dir.join("none"), &record, NS, whole).unwrap();
        release_in(&sysctl, &record, NS, |_| false);
        // The operator's own reservations leave 999 ephemeral ports: a
        // range outside the ephemeral one takes none of them and starts.
        fs::write(&sysctl, "32768-60000").unwrap();
        let below = PortRange {
            min: 20000,
            max: 32767,
        };
        reserve_in(&sysctl, &ephemeral(&dir), &record, NS, below).unwrap();
        assert_eq!(fs::read_to_string(&sysctl).unwrap(), "20000-60000");
        release_in(&sysctl, &record, NS, |_| false);
        // One that takes one more of those 999 is refused.
        let into = PortRange {
            min: 20000,
            max: 60001,
        };
        let err = reserve_in(&sysctl, &ephemeral(&dir), &record, NS, into).unwrap_err();
        assert!(format!("{err:#}").contains("998 of its 28232"), "{err:#}");
        assert_eq!(fs::read_to_string(&sysctl).unwrap(), "32768-60000");
        fs::remove_dir_all(&dir).unwrap();
    }
}
