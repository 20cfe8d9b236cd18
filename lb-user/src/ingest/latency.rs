//! Latency samples aggregated in the kernel (`BACKEND_LATENCY`, per CPU and
//! backend: sum, count and the peak of the current epoch), read at every
//! score tick instead of one ring-buffer event per response.
//!
//! A read first advances `LATENCY_EPOCH`, so samples from then on start
//! the next peak, then sums the finished epoch's peaks and the counters
//! over the CPUs. Nothing is written to the per-CPU values, so no sample is
//! lost to a race with the data path. A sample that lands on a CPU after
//! the epoch moved but before the lookup copied that CPU's value is split
//! across two reads: its count and sum are in this one, its peak is
//! stamped with the new epoch and belongs to the next one. That next read
//! reports the peak even when it has no new samples of its own (a peak
//! alone, `count` 0): otherwise a backend that answered once, 300 ms, and
//! then nothing more, lost that peak, and Peak-EWMA only saw the tick's
//! mean. Each peak is reported once: the read that finishes its epoch.

use std::time::Duration;

use anyhow::{Context as _, anyhow};
use lb_common::LatencyAgg;

use crate::kernel::batch;
use crate::kernel::maps::{self, LatencyAggs, LatencyEpoch};

/// One backend's samples since the previous read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Answered {
    pub backend: u32,
    /// Responses (latency samples) since the previous read; 0 for a peak
    /// alone, whose response the previous read counted (see the module's
    /// docs).
    pub count: u64,
    /// Their mean latency (for a peak alone, the peak: a reader that
    /// overlooks the count sees the backend no faster than it was).
    pub mean: Duration,
    /// The largest sample of the finished epoch (Peak-EWMA's jump).
    pub peak: Duration,
}

impl Answered {
    /// The peak of a sample the previous read counted.
    fn peak_alone(backend: u32, peak_ns: u64) -> Self {
        let peak = Duration::from_nanos(peak_ns);
        Self {
            backend,
            count: 0,
            mean: peak,
            peak,
        }
    }
}

/// Folds the per-CPU aggregates of one backend against the totals of the
/// previous read: `None` without new samples and without a peak of the
/// finished epoch `epoch`.
pub fn fold(
    backend: u32,
    per_cpu: &[LatencyAgg],
    previous: (u64, u64),
    epoch: u64,
) -> (Option<Answered>, (u64, u64)) {
    let sum = per_cpu.iter().fold(0u64, |a, c| a.wrapping_add(c.sum_ns));
    let count = per_cpu.iter().fold(0u64, |a, c| a.wrapping_add(c.count));
    let new_count = count.wrapping_sub(previous.1);
    let new_sum = sum.wrapping_sub(previous.0);
    let peak = finished_peak(per_cpu, epoch);
    if new_count == 0 {
        // Every sample of the finished epoch was counted by the previous
        // read (none since), which filtered their peak out as the next
        // epoch's: it is reported now, and never again. A zero peak says
        // nothing.
        let alone = peak.filter(|&p| p > 0);
        return (
            alone.map(|p| Answered::peak_alone(backend, p)),
            (sum, count),
        );
    }
    let mean = new_sum / new_count;
    let answered = Answered {
        backend,
        count: new_count,
        mean: Duration::from_nanos(mean),
        // A sample that raced the epoch change may be missing from the
        // peaks (the next read reports it); the mean stands in meanwhile.
        peak: Duration::from_nanos(peak.unwrap_or(0).max(mean)),
    };
    (Some(answered), (sum, count))
}

/// The largest peak any CPU stamped with `epoch`, if one did.
fn finished_peak(per_cpu: &[LatencyAgg], epoch: u64) -> Option<u64> {
    per_cpu
        .iter()
        .filter(|c| c.peak_epoch == epoch)
        .map(|c| c.peak_ns)
        .max()
}

/// Reads the aggregates of every backend id at each tick.
pub struct LatencyReader {
    aggs: LatencyAggs,
    epoch_map: LatencyEpoch,
    epoch: u64,
    /// (sum, count) per backend id at the previous read.
    previous: Vec<(u64, u64)>,
    /// BACKEND_LATENCY again, for the batch lookup's raw fd.
    batch_map: aya::maps::MapData,
    /// False once the kernel refused a batch lookup (older than 5.6).
    batch: bool,
    /// Possible CPUs (0 until first needed).
    cpus: usize,
}

impl LatencyReader {
    /// Opens the maps; what the kernel aggregated before (another process,
    /// before a restart) becomes the baseline rather than one huge tick.
    pub fn open(pin_dir: &std::path::Path, id_limit: usize) -> anyhow::Result<Self> {
        let epoch_map = maps::latency_epoch(pin_dir)?;
        let epoch = epoch_map.get(&0, 0).context("reading LATENCY_EPOCH")?;
        let mut reader = Self {
            aggs: maps::latency_aggs(pin_dir)?,
            epoch_map,
            epoch,
            previous: Vec::new(),
            batch_map: aya::maps::MapData::from_pin(pin_dir.join(lb_common::BACKEND_LATENCY_MAP))
                .context("opening BACKEND_LATENCY")?,
            batch: true,
            cpus: 0,
        };
        reader.read(id_limit)?;
        Ok(reader)
    }

    /// The backends (ids below `id_limit`) with samples since the last read.
    pub fn read(&mut self, id_limit: usize) -> anyhow::Result<Vec<Answered>> {
        let finished = self.epoch;
        self.epoch = finished.wrapping_add(1);
        self.epoch_map
            .set(0, self.epoch, 0)
            .map_err(|e| anyhow!("writing LATENCY_EPOCH: {e}"))?;
        let first = self.previous.is_empty();
        self.previous
            .resize(id_limit.max(self.previous.len()), (0, 0));
        // One syscall for every id (a tick with 4,096 backends made 4,096
        // lookups); one lookup per id where the kernel lacks batches.
        let cpus = self.cpus()?;
        let batched = match self
            .batch
            .then(|| batch::lookup_per_cpu(self.batch_fd(), id_limit, cpus))
        {
            Some(Ok(all)) => Some(all),
            Some(Err(e)) if !batch::unsupported(&e) => {
                return Err(anyhow!("reading BACKEND_LATENCY in one batch: {e}"));
            }
            Some(Err(_)) => {
                self.batch = false;
                None
            }
            None => None,
        };
        let mut out = Vec::new();
        for id in 0..id_limit as u32 {
            let looked_up;
            let per_cpu: &[LatencyAgg] = match &batched {
                Some(all) => &all[id as usize * cpus..(id as usize + 1) * cpus],
                None => {
                    looked_up = self.aggs.get(&id, 0).context("reading BACKEND_LATENCY")?;
                    &looked_up
                }
            };
            let (answered, totals) = fold(id, per_cpu, self.previous[id as usize], finished);
            self.previous[id as usize] = totals;
            if !first {
                out.extend(answered);
            }
        }
        Ok(out)
    }

    fn batch_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::{AsFd as _, AsRawFd as _};
        self.batch_map.fd().as_fd().as_raw_fd()
    }

    /// Possible CPUs: how many values each id has in a per-CPU map.
    fn cpus(&mut self) -> anyhow::Result<usize> {
        if self.cpus == 0 {
            self.cpus = aya::util::nr_cpus()
                .map_err(|(_, e)| e)
                .context("counting possible CPUs")?;
        }
        Ok(self.cpus)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agg(sum_ns: u64, count: u64, peak_ns: u64, peak_epoch: u64) -> LatencyAgg {
        LatencyAgg {
            sum_ns,
            count,
            peak_ns,
            peak_epoch,
        }
    }

    #[test]
    fn sums_over_cpus_and_takes_the_finished_epochs_peak() {
        let cpus = [agg(3_000, 3, 2_000, 7), agg(10_000, 1, 10_000, 7)];
        let (a, totals) = fold(4, &cpus, (0, 0), 7);
        let a = a.unwrap();
        assert_eq!(totals, (13_000, 4));
        assert_eq!((a.backend, a.count), (4, 4));
        assert_eq!(a.mean, Duration::from_nanos(3_250));
        assert_eq!(a.peak, Duration::from_nanos(10_000));
        // Only the new samples count; an old epoch's peak is ignored.
        let later = [agg(5_000, 5, 2_000, 7), agg(10_000, 1, 10_000, 7)];
        let (a, _) = fold(4, &later, totals, 8);
        let a = a.unwrap();
        assert_eq!(a.count, 2);
        assert_eq!(a.mean, Duration::from_nanos(1_000));
        assert_eq!(a.peak, a.mean, "no peak of epoch 8 yet: the mean stands in");
    }

    /// A 300 ms sample lands on CPU 1 after the read moved the epoch to 8
    /// but before the batch lookup copied CPU 1's value: its count is in
    /// epoch 7's read, its peak is stamped 8. The next read has no new
    /// samples; the peak must still reach Peak-EWMA, exactly once.
    #[test]
    fn a_peak_that_raced_the_epoch_change_is_reported_once() {
        let ms = |v: u64| v * 1_000_000;
        let cpus = [agg(ms(50), 10, ms(5), 7), agg(ms(300), 1, ms(300), 8)];
        let (first, totals) = fold(4, &cpus, (0, 0), 7);
        let (second, totals) = fold(4, &cpus, totals, 8);
        let (third, _) = fold(4, &cpus, totals, 9);
        let peaks: Vec<Duration> = [first, second, third]
            .iter()
            .flatten()
            .map(|a| a.peak)
            .filter(|&p| p == Duration::from_millis(300))
            .collect();
        assert_eq!(peaks.len(), 1, "{first:?} {second:?} {third:?}");
        // Counted once, in the first read; the second carries the peak only.
        assert_eq!(first.unwrap().count, 11);
        let second = second.unwrap();
        assert_eq!(second.count, 0);
        assert_eq!(third, None);
    }

    #[test]
    fn no_new_samples_no_answer() {
        let cpus = [agg(3_000, 3, 2_000, 1)];
        let (a, totals) = fold(0, &cpus, (3_000, 3), 2);
        assert_eq!(a, None);
        assert_eq!(totals, (3_000, 3));
    }

    /// A per-CPU array of `LatencyAgg` made with a raw `BPF_MAP_CREATE`.
    fn per_cpu_array(entries: u32) -> std::io::Result<std::os::fd::OwnedFd> {
        use std::os::fd::FromRawFd as _;
        #[repr(C)]
        #[derive(Default)]
        struct CreateAttr {
            map_type: u32,
            key_size: u32,
            value_size: u32,
            max_entries: u32,
            map_flags: u32,
        }
        let attr = CreateAttr {
            map_type: 6, // BPF_MAP_TYPE_PERCPU_ARRAY
            key_size: 4,
            value_size: size_of::<LatencyAgg>() as u32,
            max_entries: entries,
            ..CreateAttr::default()
        };
        // SAFETY: a valid prefix of `union bpf_attr` for BPF_MAP_CREATE (0).
        let fd = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                0,
                &attr as *const CreateAttr,
                size_of::<CreateAttr>(),
            )
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: the kernel just returned this fd to us.
        Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) })
    }

    /// Writes every CPU's value of `key` with a raw `BPF_MAP_UPDATE_ELEM`.
    fn write(fd: std::os::fd::RawFd, key: u32, values: &[LatencyAgg]) {
        #[repr(C)]
        struct ElemAttr {
            map_fd: u32,
            _pad: u32,
            key: u64,
            value: u64,
            flags: u64,
        }
        let attr = ElemAttr {
            map_fd: fd as u32,
            _pad: 0,
            key: &key as *const u32 as u64,
            value: values.as_ptr() as u64,
            flags: 0,
        };
        // SAFETY: key and values (one per possible CPU) outlive the call.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                2,
                &attr as *const ElemAttr,
                size_of::<ElemAttr>(),
            )
        };
        assert_eq!(ret, 0, "{}", std::io::Error::last_os_error());
    }

    #[test]
    fn one_batch_reads_what_per_key_writes_put_on_each_cpu() {
        use std::os::fd::AsRawFd as _;
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            assert!(
                std::env::var_os("LB_TESTS_REQUIRE_ROOT").is_none(),
                "needs root to create a BPF map"
            );
            // Straight to the stderr handle: libtest shows what `eprintln!`
            // prints only for a failing test, and a skip passes.
            use std::io::Write as _;
            let _ = writeln!(
                std::io::stderr().lock(),
                "\n!!!!!!!! SKIPPED one_batch_reads_what_per_key_writes_put_on_each_cpu: needs \
                 root to create a BPF map !!!!!!!!\n"
            );
            return;
        }
        let cpus = aya::util::nr_cpus().unwrap();
        let map = per_cpu_array(5).unwrap();
        let fd = map.as_raw_fd();
        let value =
            |key: u32, cpu: usize| agg(u64::from(key) * 1000 + cpu as u64, u64::from(key), 7, 1);
        for key in 0..5 {
            let per_cpu: Vec<LatencyAgg> = (0..cpus).map(|c| value(key, c)).collect();
            write(fd, key, &per_cpu);
        }
        // Fewer keys than the map holds, and all of them (the walk ends: ENOENT).
        for count in [3, 5] {
            let all = batch::lookup_per_cpu(fd, count, cpus).unwrap();
            assert_eq!(all.len(), count * cpus);
            for (key, per_cpu) in all.chunks_exact(cpus).enumerate() {
                for (cpu, v) in per_cpu.iter().enumerate() {
                    assert_eq!(*v, value(key as u32, cpu), "key {key} cpu {cpu}");
                }
            }
        }
        assert!(
            batch::lookup_per_cpu(fd, 6, cpus).is_err(),
            "more keys than the map has"
        );
        assert!(batch::lookup_per_cpu(fd, 0, cpus).unwrap().is_empty());
    }

    #[test]
    fn counters_that_wrap_still_give_the_difference() {
        let cpus = [agg(5, 2, 9, 0)];
        let (a, _) = fold(0, &cpus, (u64::MAX - 4, u64::MAX), 0);
        let a = a.unwrap();
        assert_eq!(a.count, 3);
        assert_eq!(a.mean, Duration::from_nanos(10 / 3));
    }
}
