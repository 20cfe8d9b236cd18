//! CPU time a balancer spends, read from /proc.
//!
//! Two parts, both as deltas over a run:
//! - the user + system time of every process whose network namespace is the
//!   balancer's (lb-user, haproxy, nginx and their workers);
//! - the machine's softirq time (`/proc/stat`), where XDP, nftables' NAT
//!   and the kernel's TCP receive path all run. It includes the softirq work
//!   of the client and the backends too, so only differences between rows
//!   mean something: the oracle row (no balancer hop) is the baseline.

use std::{fs, os::unix::fs::MetadataExt, path::Path};

use anyhow::{Context, Result};

/// A reading of both counters, in seconds.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuSample {
    pub processes_s: f64,
    pub softirq_s: f64,
}

impl CpuSample {
    pub fn since(self, earlier: CpuSample) -> CpuSample {
        CpuSample {
            processes_s: (self.processes_s - earlier.processes_s).max(0.0),
            softirq_s: (self.softirq_s - earlier.softirq_s).max(0.0),
        }
    }
}

/// Reads the counters for the processes in network namespace `ns`.
pub fn sample(ns: &str) -> Result<CpuSample> {
    Ok(CpuSample {
        processes_s: namespace_process_seconds(ns)?,
        softirq_s: softirq_seconds()?,
    })
}

fn ticks_per_second() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 { hz as f64 } else { 100.0 }
}

/// utime + stime of every process in namespace `ns` (by the inode of
/// `/run/netns/<ns>`, which is the namespace's).
fn namespace_process_seconds(ns: &str) -> Result<f64> {
    let wanted = fs::metadata(Path::new("/run/netns").join(ns))
        .with_context(|| format!("namespace {ns}"))?
        .ino();
    let mut ticks = 0u64;
    for entry in fs::read_dir("/proc").context("reading /proc")? {
        let Ok(entry) = entry else { continue };
        let name = entry.file_name();
        if !name.to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        // Processes come and go while we look: skip those that vanished.
        let Ok(ns_meta) = fs::metadata(entry.path().join("ns/net")) else {
            continue;
        };
        if ns_meta.ino() != wanted {
            continue;
        }
        if let Ok(stat) = fs::read_to_string(entry.path().join("stat")) {
            ticks += utime_plus_stime(&stat).unwrap_or(0);
        }
    }
    Ok(ticks as f64 / ticks_per_second())
}

/// Fields 14 and 15 of /proc/PID/stat; the command name (field 2) may
/// contain spaces, so fields are counted after its closing parenthesis.
fn utime_plus_stime(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state): utime is field 14 → index 11.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// Machine-wide softirq time: the 7th value of the `cpu` line of /proc/stat.
fn softirq_seconds() -> Result<f64> {
    let stat = fs::read_to_string("/proc/stat").context("reading /proc/stat")?;
    let line = stat.lines().next().context("empty /proc/stat")?;
    let softirq: u64 = line
        .split_whitespace()
        .nth(7)
        .and_then(|v| v.parse().ok())
        .context("no softirq field in /proc/stat")?;
    Ok(softirq as f64 / ticks_per_second())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_after_the_command_name() {
        let stat = "42 (a b) c) S 1 42 42 0 -1 4194560 100 0 0 0 17 5 0 0 20 0 1 0 9 1 1";
        assert_eq!(utime_plus_stime(stat), Some(22));
    }
}
