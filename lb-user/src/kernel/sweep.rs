//! The kernel sweep as the control plane drives it: `lb_sweep` (see
//! lb-ebpf's `sweep.rs`) loaded against the pinned maps and run with
//! `BPF_PROG_TEST_RUN`. One syscall a pass, whatever the flow table holds:
//! the walk, idle expiry, SNAT quarantine and orphan cleanup happen in the
//! kernel.

use std::path::Path;

use anyhow::{Context as _, anyhow};
use aya::{
    Ebpf, EbpfLoader,
    programs::{TestRun, TestRunOptions, Xdp},
};
use lb_common::{ALL_MAPS, SWEEP_LIGHT, SWEEP_PROGRAM, SweepStats};

use crate::kernel::{
    maps::{self, SweepStatsMap},
    object::EBPF_OBJECT,
};

/// The frame of a full pass (an XDP test run needs one; its first byte
/// says which pass).
const FULL_PASS: [u8; 64] = [0; 64];
/// The frame of a light pass (no pair checks; see lb-ebpf's `sweep.rs`).
const LIGHT_PASS: [u8; 64] = {
    let mut frame = [0; 64];
    frame[0] = SWEEP_LIGHT;
    frame
};
/// `lb_sweep`'s return value when it ran (XDP_PASS).
const SWEEP_RAN: u32 = 2;

/// `lb_sweep`, loaded and ready to run, with the stats it writes.
pub struct Sweeper {
    ebpf: Ebpf,
    stats: SweepStatsMap,
}

impl Sweeper {
    /// Loads `lb_sweep` from the embedded object against the pinned maps.
    pub fn open(pin_dir: &Path) -> anyhow::Result<Self> {
        let mut loader = EbpfLoader::new();
        for name in ALL_MAPS {
            loader.map_pin_path(name, pin_dir.join(name));
        }
        let mut ebpf = loader
            .load(EBPF_OBJECT)
            .map_err(|e| anyhow!("loading the eBPF object for the sweep: {e}"))?;
        let program: &mut Xdp = ebpf
            .program_mut(SWEEP_PROGRAM)
            .ok_or_else(|| anyhow!("the eBPF object has no program {SWEEP_PROGRAM}"))?
            .try_into()
            .context("lb_sweep is not an XDP program")?;
        program
            .load()
            .map_err(|e| anyhow!("loading {SWEEP_PROGRAM} into the kernel: {e}"))?;
        Ok(Self {
            ebpf,
            stats: maps::sweep_stats(pin_dir)?,
        })
    }

    /// Runs one sweep, `light` (without the pair checks) or full; returns
    /// the kernel's sweep counters after it.
    pub fn run(&mut self, light: bool) -> anyhow::Result<SweepStats> {
        let program: &Xdp = self
            .ebpf
            .program(SWEEP_PROGRAM)
            .ok_or_else(|| anyhow!("no program {SWEEP_PROGRAM}"))?
            .try_into()
            .context("lb_sweep is not an XDP program")?;
        let mut opts = TestRunOptions::new();
        opts.data_in = Some(if light { &LIGHT_PASS } else { &FULL_PASS });
        let result = program
            .test_run(opts)
            .map_err(|e| anyhow!("running {SWEEP_PROGRAM}: {e}"))?;
        if result.return_value != SWEEP_RAN {
            return Err(anyhow!(
                "{SWEEP_PROGRAM} found no config or stats map (returned {})",
                result.return_value
            ));
        }
        self.stats
            .get(&0, 0)
            .map_err(|e| anyhow!("reading SWEEP_STATS: {e}"))
    }
}
