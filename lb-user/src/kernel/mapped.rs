//! A pinned `BPF_F_MMAPABLE` array map mapped into this process, so a
//! large block (a 65,537-entry Maglev table) is written with plain stores
//! instead of one map update per entry.
//!
//! The kernel lays such an array out as `max_entries` slots of
//! `round_up(value_size, 8)` bytes from the start of the mapping, the same
//! memory its lookups read. Writers only ever store into a block no
//! descriptor points at yet (see `publish::swap`); the descriptor write
//! that makes the block live is a syscall, so every store is visible to
//! the kernel before it.
use std::{
    num::NonZeroUsize,
    os::fd::{AsFd, BorrowedFd},
    ptr::NonNull,
};

use anyhow::{Context as _, bail};
use nix::sys::mman::{MapFlags, ProtFlags, mmap, munmap};

/// A mapped array of `u32` values.
pub struct MappedU32Array {
    base: NonNull<u8>,
    len_bytes: usize,
    entries: u32,
}

// SAFETY: the mapping is plain shared memory owned by this value; it is
// only written through `&mut self`.
unsafe impl Send for MappedU32Array {}

/// Bytes between two entries of an array map whose values are `u32`s.
const STRIDE: usize = 8;

impl MappedU32Array {
    /// Maps the array `fd` of `entries` `u32` values read-write; fails
    /// (EINVAL, and the caller falls back to map updates) unless the map
    /// was created with `BPF_F_MMAPABLE`.
    pub fn map(fd: BorrowedFd<'_>, entries: u32) -> anyhow::Result<Self> {
        let len_bytes = (entries as usize)
            .checked_mul(STRIDE)
            .filter(|&n| n > 0)
            .context("an empty or oversized array")?;
        let len = NonZeroUsize::new(len_bytes).context("an empty array")?;
        // SAFETY: a fresh shared mapping of the map's value area; nothing
        // else in this process aliases it.
        let base = unsafe {
            mmap(
                None,
                len,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                fd.as_fd(),
                0,
            )
        }
        .context("mapping the array map (is it BPF_F_MMAPABLE?)")?;
        Ok(Self {
            base: base.cast(),
            len_bytes,
            entries,
        })
    }

    /// Stores `values` at entries `first..first + values.len()`.
    pub fn write(&mut self, first: u32, values: &[u32]) -> anyhow::Result<()> {
        let end = (first as usize).checked_add(values.len());
        if end.is_none_or(|end| end > self.entries as usize) {
            bail!(
                "entries {first}..+{} are outside the array's {}",
                values.len(),
                self.entries
            );
        }
        for (i, v) in values.iter().enumerate() {
            // SAFETY: in bounds (checked above: each entry's 8-byte slot
            // lies inside the mapping), aligned (the mapping is page
            // aligned and slots are 8 bytes), and the kernel reads the
            // slot only after the descriptor flip that follows.
            unsafe {
                self.base
                    .as_ptr()
                    .add((first as usize + i) * STRIDE)
                    .cast::<u32>()
                    .write_volatile(*v);
            }
        }
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }

    /// The value at entry `index` (for tests and checks).
    pub fn read(&self, index: u32) -> Option<u32> {
        (index < self.entries).then(|| {
            // SAFETY: in bounds and aligned, as in `write`.
            unsafe {
                self.base
                    .as_ptr()
                    .add(index as usize * STRIDE)
                    .cast::<u32>()
                    .read_volatile()
            }
        })
    }
}

impl Drop for MappedU32Array {
    fn drop(&mut self) {
        // SAFETY: the mapping `map` created, unmapped once.
        if let Err(e) = unsafe { munmap(self.base.cast(), self.len_bytes) } {
            tracing::debug!("unmapping an array map: {e}");
        }
    }
}
