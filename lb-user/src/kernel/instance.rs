//! Where an instance keeps its state, and the lock that makes it unique.
//!
//! * Pins: `/sys/fs/bpf/lb-user/<instance>/` holds every map (by its name in
//!   lb_common) and the XDP link (`link`).
//! * Lock: `/run/lb-user/<instance>.lock`, held with `flock` for the life of
//!   the process. The kernel drops it when the process dies, even by
//!   SIGKILL, so a crashed instance never blocks its successor, while a live
//!   one makes a second start fail cleanly. The file itself is left in place:
//!   unlinking a lock file races with a starter that already opened it.
//! * `/run/lb-user` ([`LOCK_DIR`]) is shared by every instance: root's, mode
//!   [`RUN_DIR_MODE`] (others may pass through it, not list it), so each
//!   instance's control socket decides by its own mode and group who may
//!   connect. The files beside the sockets are root's alone
//!   ([`write_private`]).

use std::{
    fs::{File, OpenOptions},
    io::Write as _,
    os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _},
    path::{Path, PathBuf},
};

use anyhow::{Context as _, bail};
use nix::fcntl::{Flock, FlockArg};

use crate::kernel::bpffs::BPFFS_ROOT;

const APP_DIR: &str = "lb-user";
pub const LOCK_DIR: &str = "/run/lb-user";
/// [`LOCK_DIR`]'s mode: root's, searchable by all. An instance with
/// `--control-group` needs its group to reach its socket through the
/// directory, and instances with other groups (or none) share it; a mode
/// per instance would have the last one started lock out the others.
pub const RUN_DIR_MODE: u32 = 0o711;
/// Mode of the files in [`LOCK_DIR`] other than the sockets.
pub use crate::settings::private_file::PRIVATE_FILE_MODE as RUN_FILE_MODE;
/// How [`LOCK_DIR`]'s files (and the state directory's) are written.
pub use crate::settings::private_file::{TMP_SUFFIX, write_durable, write_private};
/// Pin name of the XDP link inside an instance's pin directory.
pub const LINK_PIN: &str = "link";

/// The ends of the names of an instance's files in [`LOCK_DIR`], each
/// `<instance><suffix>` ([`run_file`]): its lock ([`lock_path`]).
pub const LOCK_SUFFIX: &str = ".lock";
/// Its control socket (`surface::control::socket_path`).
pub const SOCKET_SUFFIX: &str = ".sock";
/// Its record of the ports it reserved (`kernel::sysctl::record_path`).
pub const RESERVED_PORTS_SUFFIX: &str = ".reserved-ports";
/// Its zones (`surface::status::zones_path`).
pub const ZONES_SUFFIX: &str = ".zones.json";
/// Its discovery status (`surface::status::discovery_path`).
pub const DISCOVERY_SUFFIX: &str = ".discovery.json";
/// Every file lb-user names after an instance in [`LOCK_DIR`]: the only
/// suffixes [`run_file`] is called with.
pub const RUN_FILE_SUFFIXES: [&str; 5] = [
    LOCK_SUFFIX,
    SOCKET_SUFFIX,
    RESERVED_PORTS_SUFFIX,
    ZONES_SUFFIX,
    DISCOVERY_SUFFIX,
];

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

/// `/run/lb-user/<instance><suffix>`, `suffix` one of
/// [`RUN_FILE_SUFFIXES`].
pub fn run_file(instance: &str, suffix: &str) -> PathBuf {
    debug_assert!(RUN_FILE_SUFFIXES.contains(&suffix), "{suffix}");
    Path::new(LOCK_DIR).join(format!("{instance}{suffix}"))
}

/// `/run/lb-user/<instance>.lock`.
pub fn lock_path(instance: &str) -> PathBuf {
    run_file(instance, LOCK_SUFFIX)
}

/// The instance whose file in [`LOCK_DIR`] is called `name`, if lb-user
/// named it ([`run_file`]: the whole instance name and one of
/// [`RUN_FILE_SUFFIXES`], maybe followed by [`TMP_SUFFIX`]). So instance
/// `x` does not own `x.prod.sock`, instance `x.prod`'s socket. A hidden
/// file is no instance's (`.reserved-ports.lock` is shared by all).
pub fn run_file_instance(name: &str) -> Option<&str> {
    if name.starts_with('.') {
        return None;
    }
    let name = name.strip_suffix(TMP_SUFFIX).unwrap_or(name);
    RUN_FILE_SUFFIXES
        .iter()
        .find_map(|suffix| name.strip_suffix(suffix))
        .filter(|instance| !instance.is_empty())
}

/// Creates [`LOCK_DIR`] if need be and gives it to root with
/// [`RUN_DIR_MODE`], whatever an earlier start (or version) left.
pub fn ensure_run_dir() -> anyhow::Result<()> {
    let dir = Path::new(LOCK_DIR);
    std::fs::create_dir_all(dir).with_context(|| format!("creating {LOCK_DIR}"))?;
    std::os::unix::fs::chown(dir, Some(0), Some(0))
        .with_context(|| format!("setting the owner of {LOCK_DIR}"))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(RUN_DIR_MODE))
        .with_context(|| format!("setting the mode of {LOCK_DIR}"))
}

/// Whether `instance` runs: the pid its lock file names is alive. (Not by
/// trying its lock, which for that instant would make a start of that
/// instance fail as "already running".) A reused pid counts as running,
/// which errs on the side of keeping ports reserved.
pub fn is_running(instance: &str) -> bool {
    let path = lock_path(instance);
    let Some(pid) = std::fs::read_to_string(&path)
        .ok()
        .and_then(|text| text.trim().parse::<i32>().ok())
        .filter(|&pid| pid > 0)
    else {
        return false;
    };
    match nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None) {
        Ok(()) => true,
        Err(e) => e != nix::errno::Errno::ESRCH,
    }
}

/// The held lock of a running instance; released on drop.
#[derive(Debug)]
pub struct InstanceLock {
    _lock: Flock<File>,
}

impl InstanceLock {
    pub fn acquire(instance: &str) -> anyhow::Result<Self> {
        ensure_run_dir()?;
        let path = lock_path(instance);
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(RUN_FILE_MODE)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        // A lock file left by an earlier version may be readable by all.
        file.set_permissions(std::fs::Permissions::from_mode(RUN_FILE_MODE))
            .with_context(|| format!("restricting {}", path.display()))?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_files_belong_to_the_whole_instance_name() {
        for suffix in RUN_FILE_SUFFIXES {
            let path = run_file("x", suffix);
            assert_eq!(path.parent(), Some(Path::new(LOCK_DIR)));
            let name = path.file_name().unwrap().to_str().unwrap();
            assert_eq!(run_file_instance(name), Some("x"), "{name}");
            // Left by a kill mid-write: still the instance's.
            let tmp = format!("{name}{TMP_SUFFIX}");
            assert_eq!(run_file_instance(&tmp), Some("x"), "{tmp}");
            // Instance `x.prod`'s files are not `x`'s.
            let longer = format!("x.prod{suffix}");
            assert_eq!(run_file_instance(&longer), Some("x.prod"), "{longer}");
        }
        assert_eq!(run_file_instance("x.prod.sock.tmp"), Some("x.prod"));
        // Hidden files are nobody's: the lock the SNAT records share, and
        // a suffix alone.
        assert_eq!(run_file_instance(".reserved-ports.lock"), None);
        assert_eq!(run_file_instance(".lock"), None);
        assert_eq!(run_file_instance(".x.sock"), None);
        // Not a name lb-user gives.
        assert_eq!(run_file_instance("x"), None);
        assert_eq!(run_file_instance("x.state.json"), None);
        assert_eq!(run_file_instance("notes.txt"), None);
        assert_eq!(run_file_instance("x.tmp"), None);
    }
}
