//! In-flight accounting from the kernel's own counters, and the kernel
//! sweep's cadence.
//!
//! The kernel counts every end of a flow: FIN/FIN and RST in the data path,
//! idle expiry, unanswered SYNs and orphans in the sweep (`lb_sweep`, run
//! here once a second with one `BPF_PROG_TEST_RUN`). So in-flight is
//! exactly `opened - closed`, with no correction from user space, and a
//! pass costs one syscall plus two array reads per backend, independent of
//! the flow table's size. (The per-entry walk from user space this replaced
//! cost two syscalls per entry, and deleted by key long after reading, so a
//! SYN that re-created a key during the walk lost its entry.)
//!
//! The sweep's expiries reach the event loop as ring-buffer events
//! (`Closed{idle}`, `Refused` for an unanswered SYN), like every other
//! close.

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use anyhow::Context as _;
use lb_common::{BackendConns, SweepStats};

use crate::kernel::{
    maps::{self, Conns, SnatUsed},
    sweep::Sweeper,
};

/// How often a pass (one kernel sweep) runs.
pub const RECONCILE_INTERVAL: Duration = Duration::from_secs(1);

/// What one pass learnt from the kernel.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Scan {
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
}

impl Reconciler {
    pub fn open(
        pin_dir: &std::path::Path,
        backend_count: Arc<AtomicUsize>,
    ) -> anyhow::Result<Self> {
        Ok(Self {
            sweeper: Sweeper::open(pin_dir)?,
            conns: maps::conns(pin_dir)?,
            snat_used: maps::snat_used(pin_dir)?,
            backend_count,
            orphans_seen: None,
        })
    }

    /// One pass: a kernel sweep, then the per-backend counters.
    pub fn pass(&mut self) -> anyhow::Result<Scan> {
        let started = std::time::Instant::now();
        let sweep = self.sweeper.run()?;
        let backend_count = self.backend_count.load(Ordering::Relaxed);
        let live = (0..backend_count as u32)
            .map(|id| {
                let conns = self.conns.get(&id, 0).context("reading BACKEND_CONNS")?;
                let used = self
                    .snat_used
                    .get(&id, 0)
                    .context("reading BACKEND_SNAT_USED")?;
                Ok(holding(conns, used))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        // The first pass of a process (perhaps re-adopting) reports none.
        let orphans = sweep
            .orphans
            .saturating_sub(self.orphans_seen.unwrap_or(sweep.orphans));
        self.orphans_seen = Some(sweep.orphans);
        Ok(Scan {
            live,
            orphans,
            entries: sweep.entries,
            sweep,
            took: started.elapsed(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
