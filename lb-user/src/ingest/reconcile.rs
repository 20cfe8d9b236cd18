//! In-flight accounting from the kernel's own counters, and the kernel
//! sweep's cadence.
//!
//! The kernel counts every end of a flow: FIN/FIN and RST in the data path,
//! idle expiry, unanswered SYNs and orphans in the sweep (`lb_sweep`, run
//! here with one `BPF_PROG_TEST_RUN`). So in-flight is exactly
//! `opened - closed`, with no correction from user space, and a pass costs
//! one syscall plus two array reads per backend. (The per-entry walk from
//! user space this replaced cost two syscalls per entry, and deleted by key
//! long after reading, so a SYN that re-created a key during the walk lost
//! its entry.)
//!
//! The sweep's one syscall still walks every bucket and entry of the table
//! in the kernel: about 5 ms for an empty table of 262,144 entries and
//! 0.45–0.6 s with 1,000,000 entries in one of 2,097,152. So passes are spaced
//! by what the last one cost ([`pass_interval`]): every second while a pass
//! is cheap, less often as the table fills, so the sweep uses at most
//! [`SWEEP_CPU_SHARE`] of a core. Expiries are late by at most the
//! interval: nothing at lab sizes, up to [`MAX_PASS_INTERVAL`] with a
//! million entries, where the TCP idle timeout (5 minutes) is long against it.
//! What must be on time does not wait for a pass: the data path closes an
//! unanswered SYN as refused when the client retransmits it past the SYN
//! timeout, and frees a SNAT tuple past its quarantine when its CPU's
//! cursor comes round to it.
//!
//! Most passes are light: an open entry's other direction is looked up
//! only to close the flow, not to look for lone entries, which every
//! [`FULL_PASS_EVERY`]th pass (and a process's first) does.
//!
//! The sweep's expiries reach the event loop as ring-buffer events
//! (`Closed{idle}`, `Refused` for an unanswered SYN), like every other
//! close.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use anyhow::Context as _;
use lb_common::{BackendConns, SweepStats};

use crate::kernel::{
    batch,
    maps::{self, Conns, SnatUsed},
    sweep::Sweeper,
};

/// The shortest time between two passes (a cheap sweep's cadence).
pub const MIN_PASS_INTERVAL: Duration = Duration::from_secs(1);
/// The longest time between two passes, however large the table.
pub const MAX_PASS_INTERVAL: Duration = Duration::from_secs(120);
/// Every this many passes one is full (checks each open entry against its
/// other direction, finding lone entries); the others are light (look an
/// entry's other direction up only to close it), about 0.7 times the
/// cost on a large table, where most of it is the walk itself. The first
/// pass of a process is full.
pub const FULL_PASS_EVERY: u64 = 10;

/// The share of one core the passes may use on average.
pub const SWEEP_CPU_SHARE: f64 = 0.001;

/// When the next pass is due after one that cost `cpu` (the CPU time of
/// the thread that ran it, kernel time included): `cpu ÷ SWEEP_CPU_SHARE`,
/// at least [`MIN_PASS_INTERVAL`] and at most [`MAX_PASS_INTERVAL`].
pub fn pass_interval(cpu: Duration) -> Duration {
    cpu.div_f64(SWEEP_CPU_SHARE)
        .clamp(MIN_PASS_INTERVAL, MAX_PASS_INTERVAL)
}

/// CPU time the calling thread has used (user and system).
fn thread_cpu_time() -> Duration {
    use nix::time::{ClockId, clock_gettime};
    clock_gettime(ClockId::CLOCK_THREAD_CPUTIME_ID)
        .map(Duration::from)
        .unwrap_or_default()
}

/// What one pass learnt from the kernel.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Scan {
    /// This pass's number among those the process started (from 1): it
    /// read its counters after every removal the event loop had seen
    /// when fewer passes had started (see `Fleet::free_drained`).
    pub pass: u64,
    /// Per backend id: what still holds the id in the kernel, open flows
    /// (`opened - closed`) plus SNAT tuples held (open, lingering or in
    /// quarantine). A removed backend's id is free once this is 0.
    pub live: Vec<u64>,
    /// Lone entries the sweep found since the previous pass (each one was
    /// closed and its tuple quarantined); 0 unless something removed one
    /// direction of a connection behind the program's back.
    pub orphans: u64,
    /// Entries in the flow table (both directions), as the sweep counted.
    pub entries: u64,
    /// The sweep's cumulative counters.
    pub sweep: SweepStats,
    /// How long the pass took (the sweep and the counter reads).
    pub took: Duration,
    /// The CPU time the pass used (its thread's, kernel time included).
    pub cpu: Duration,
}

/// Keys `0..count` of an array: one batch call, or one lookup each where
/// the kernel has no batch lookup for arrays.
fn read_all<V: aya::Pod + Default>(
    map: &aya::maps::Array<aya::maps::MapData, V>,
    count: usize,
) -> anyhow::Result<Vec<V>> {
    use std::os::fd::{AsFd as _, AsRawFd as _};

    use aya::maps::IterableMap as _;
    match batch::lookup_array(map.map().fd().as_fd().as_raw_fd(), count) {
        Ok(values) => Ok(values),
        Err(e) if batch::unsupported(&e) => {
            (0..count as u32).map(|id| Ok(map.get(&id, 0)?)).collect()
        }
        Err(e) => Err(e.into()),
    }
}

/// What holds a backend id: its open flows plus its SNAT tuples.
pub fn holding(conns: BackendConns, snat_used: u64) -> u64 {
    conns.inflight(0).saturating_add(snat_used)
}

/// Owns its own handles on the pinned maps so a pass can run on a
/// blocking thread without holding up the event loop.
pub struct Reconciler {
    sweeper: Sweeper,
    conns: Conns,
    snat_used: SnatUsed,
    /// Length of the backend id space; grows when backends are added at runtime.
    backend_count: Arc<AtomicUsize>,
    /// Orphans counted by the previous pass (the kernel's count is cumulative).
    orphans_seen: Option<u64>,
    /// Passes this process has started; shared with the event loop.
    started: Arc<AtomicU64>,
}

impl Reconciler {
    pub fn open(
        pin_dir: &std::path::Path,
        backend_count: Arc<AtomicUsize>,
        started: Arc<AtomicU64>,
    ) -> anyhow::Result<Self> {
        Ok(Self {
            sweeper: Sweeper::open(pin_dir)?,
            conns: maps::conns(pin_dir)?,
            snat_used: maps::snat_used(pin_dir)?,
            backend_count,
            orphans_seen: None,
            started,
        })
    }

    /// One pass: a kernel sweep, then the per-backend counters.
    pub fn pass(&mut self) -> anyhow::Result<Scan> {
        let started = std::time::Instant::now();
        let cpu_before = thread_cpu_time();
        // Counted before anything is read (the event loop's removals
        // compare with it).
        let pass = self.started.fetch_add(1, Ordering::SeqCst) + 1;
        let light = !(pass - 1).is_multiple_of(FULL_PASS_EVERY);
        let sweep = self.sweeper.run(light)?;
        let backend_count = self.backend_count.load(Ordering::Relaxed);
        let conns = read_all(&self.conns, backend_count).context("reading BACKEND_CONNS")?;
        let used = read_all(&self.snat_used, backend_count).context("reading BACKEND_SNAT_USED")?;
        let live = conns
            .into_iter()
            .zip(used)
            .map(|(conns, used)| holding(conns, used))
            .collect();
        // The first pass of a process (perhaps re-adopting) reports none.
        let orphans = sweep
            .orphans
            .saturating_sub(self.orphans_seen.unwrap_or(sweep.orphans));
        self.orphans_seen = Some(sweep.orphans);
        Ok(Scan {
            pass,
            live,
            orphans,
            entries: sweep.entries,
            sweep,
            took: started.elapsed(),
            cpu: thread_cpu_time().saturating_sub(cpu_before),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cheap_pass_runs_every_second_and_a_costly_one_is_spaced_by_its_cost() {
        // A small table (a pass under 1 ms): once a second.
        assert_eq!(pass_interval(Duration::from_micros(800)), MIN_PASS_INTERVAL);
        assert_eq!(pass_interval(Duration::ZERO), MIN_PASS_INTERVAL);
        // An empty 262,144-entry table (about 5 ms): every 5 s, so passes
        // use 0.1% of a core.
        assert_eq!(
            pass_interval(Duration::from_millis(5)),
            Duration::from_secs(5)
        );
        // A million entries (about 0.45 s): capped at two minutes.
        assert_eq!(pass_interval(Duration::from_millis(450)), MAX_PASS_INTERVAL);
        // The share holds wherever neither bound binds.
        for ms in [2u64, 20, 50, 110] {
            let cpu = Duration::from_millis(ms);
            let share = cpu.as_secs_f64() / pass_interval(cpu).as_secs_f64();
            assert!(
                (share - SWEEP_CPU_SHARE).abs() < 1e-9,
                "{ms} ms: share {share}"
            );
        }
    }

    #[test]
    fn thread_cpu_time_counts_this_threads_work() {
        let before = thread_cpu_time();
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = std::hint::black_box(x.wrapping_add(i));
        }
        assert!(thread_cpu_time() > before, "{x}");
    }

    #[test]
    fn an_id_is_held_by_open_flows_and_by_snat_tuples() {
        let open = BackendConns {
            opened: 10,
            closed: 7,
        };
        assert_eq!(holding(open, 0), 3);
        assert_eq!(holding(open, 5), 8);
        let done = BackendConns {
            opened: 10,
            closed: 10,
        };
        // Every flow closed, but tuples still in quarantine hold the id.
        assert_eq!(holding(done, 2), 2);
        assert_eq!(holding(done, 0), 0);
        // Closed ahead of opened (torn read): no underflow.
        assert_eq!(
            holding(
                BackendConns {
                    opened: 1,
                    closed: 2
                },
                0
            ),
            0
        );
    }
}
