//! Where an instance keeps its state, and the lock that makes it unique.
//!
//! * Pins: `/sys/fs/bpf/lb-user/<instance>/` holds every map (by its name in
//!   lb_common) and the XDP link (`link`).
//! * Lock: `/run/lb-user/<instance>.lock`, held with `flock` for the life of
//!   the process. The kernel drops it when the process dies, even by
//!   SIGKILL, so a crashed instance never blocks its successor, while a live
//!   one makes a second start fail cleanly. The file itself is left in place:
//!   unlinking a lock file races with a starter that already opened it.

use std::{
    fs::{File, OpenOptions},
    io::Write as _,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, bail};
use nix::fcntl::{Flock, FlockArg};

use crate::kernel::bpffs::BPFFS_ROOT;

const APP_DIR: &str = "lb-user";
pub const LOCK_DIR: &str = "/run/lb-user";
/// Pin name of the XDP link inside an instance's pin directory.
pub const LINK_PIN: &str = "link";

/// `/sys/fs/bpf/lb-user`.
pub fn pin_root() -> PathBuf {
    Path::new(BPFFS_ROOT).join(APP_DIR)
}

/// `/sys/fs/bpf/lb-user/<instance>`.
pub fn pin_dir(instance: &str) -> PathBuf {
    pin_root().join(instance)
}

/// Names of the instances that have a pin directory, sorted.
pub fn list() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(pin_root())
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().is_dir())
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    names.sort();
    names
}

/// The held lock of a running instance; released on drop.
#[derive(Debug)]
pub struct InstanceLock {
    _lock: Flock<File>,
}

impl InstanceLock {
    pub fn acquire(instance: &str) -> anyhow::Result<Self> {
        std::fs::create_dir_all(LOCK_DIR).with_context(|| format!("creating {LOCK_DIR}"))?;
        let path = Path::new(LOCK_DIR).join(format!("{instance}.lock"));
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        let mut lock = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => lock,
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => {
                bail!(
                    "instance '{instance}' is already running (lock {} is held)",
                    path.display()
                )
            }
            Err((_, e)) => return Err(e).with_context(|| format!("locking {}", path.display())),
        };
        // The pid is for people; the lock itself is the flock.
        lock.set_len(0).ok();
        writeln!(lock, "{}", std::process::id()).ok();
        Ok(Self { _lock: lock })
    }
}
