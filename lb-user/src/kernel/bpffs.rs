//! Making sure pins land in a BPF filesystem that outlives this process and
//! that every later `lb-user` invocation sees.
//!
//! `ip netns exec` gives each command a private mount namespace with a fresh
//! sysfs on /sys, which hides the host's /sys/fs/bpf (checked with iproute2
//! 6.1: inside it /sys/fs/bpf is plain sysfs even when the host has a bpffs
//! there). Pins made there would vanish with the command and be invisible to
//! the next one (`status`, a restarted instance). So, when /sys/fs/bpf is not
//! a bpffs here, the process joins the mount namespace of its nearest
//! ancestor that lives in a different one: the shell or harness that ran
//! `ip netns exec` (PID 1's namespace is not always readable, e.g. in a
//! micro-VM whose init is not dumpable). Only the mount namespace changes;
//! the network namespace stays. If /sys/fs/bpf is still not a bpffs, one is
//! mounted, as bpftool and Cilium do.

use std::{
    ffi::CString,
    fs::File,
    os::{fd::AsRawFd as _, unix::fs::MetadataExt as _},
    path::Path,
};

use anyhow::{Context as _, bail};
use nix::{
    mount::{MsFlags, mount},
    sched::{CloneFlags, setns},
    unistd::fchdir,
};

pub const BPFFS_ROOT: &str = "/sys/fs/bpf";
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

fn is_bpffs(path: &Path) -> bool {
    let Ok(c_path) = CString::new(path.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    // SAFETY: statfs writes into a zeroed struct we own; the path is NUL-terminated.
    unsafe {
        let mut st: libc::statfs = std::mem::zeroed();
        libc::statfs(c_path.as_ptr(), &mut st) == 0 && st.f_type as i64 == BPF_FS_MAGIC
    }
}

/// `(dev, inode)` of a process's mount namespace.
fn mount_ns(pid: &str) -> std::io::Result<(u64, u64)> {
    let meta = std::fs::metadata(format!("/proc/{pid}/ns/mnt"))?;
    Ok((meta.dev(), meta.ino()))
}

/// Parent pid from /proc/PID/stat (the field after the parenthesised command,
/// which may itself contain spaces and parentheses).
fn parent_pid(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after_comm = &stat[stat.rfind(')')? + 1..];
    after_comm.split_whitespace().nth(1)?.parse().ok()
}

/// Joins the mount namespace of the nearest ancestor outside ours if
/// /sys/fs/bpf is hidden here (see the module docs). Must run before any
/// thread is spawned (setns of a mount namespace requires a single-threaded
/// process). Joining sets the working directory to the new namespace's
/// root; it is set back to the directory it was (through a descriptor
/// opened before, as `nsenter -w` does: the same path can name another
/// directory there, `ip netns exec`'s `/etc` say), so that relative paths
/// (`--config`, re-read on SIGHUP; `--state-dir`, read at the start and
/// written while running) name the same files as at the start. The one
/// case it cannot is returned as a warning, to be logged.
pub fn join_host_mount_ns_if_hidden() -> anyhow::Result<Option<String>> {
    if is_bpffs(Path::new(BPFFS_ROOT)) {
        return Ok(None);
    }
    let own = mount_ns("self").context("reading own mount namespace")?;
    // `File::open` opens a directory read-only, and with O_CLOEXEC.
    let cwd = File::open(".");
    let mut pid = std::os::unix::process::parent_id();
    while pid > 1 {
        if mount_ns(&pid.to_string()).is_ok_and(|ns| ns != own) {
            let ns = File::open(format!("/proc/{pid}/ns/mnt"))
                .with_context(|| format!("opening the mount namespace of process {pid}"))?;
            setns(ns, CloneFlags::CLONE_NEWNS).with_context(|| {
                format!("joining the mount namespace of process {pid} to reach its {BPFFS_ROOT}")
            })?;
            let restored = cwd
                .map_err(|e| e.to_string())
                .and_then(|cwd| fchdir(cwd.as_raw_fd()).map_err(|e| e.to_string()));
            return Ok(restored.err().map(|e| {
                format!(
                    "joined the mount namespace of process {pid} to reach its {BPFFS_ROOT}, but \
                     could not keep the working directory ({e}): relative paths (the config file \
                     a SIGHUP re-reads, --state-dir) now start at /"
                )
            }));
        }
        let Some(parent) = parent_pid(pid) else { break };
        pid = parent;
    }
    Ok(None)
}

/// Makes sure /sys/fs/bpf is a bpffs, mounting one if needed.
pub fn ensure_mounted() -> anyhow::Result<()> {
    let root = Path::new(BPFFS_ROOT);
    if is_bpffs(root) {
        return Ok(());
    }
    if !root.is_dir() {
        bail!("{BPFFS_ROOT} does not exist (is sysfs mounted?)");
    }
    mount(
        Some("bpf"),
        root,
        Some("bpf"),
        MsFlags::empty(),
        None::<&str>,
    )
    .with_context(|| format!("mounting a BPF filesystem on {BPFFS_ROOT}"))?;
    tracing::info!("mounted a BPF filesystem on {BPFFS_ROOT}");
    Ok(())
}

/// Whether /sys/fs/bpf is a bpffs (status only reads; it never mounts).
pub fn is_mounted() -> bool {
    is_bpffs(Path::new(BPFFS_ROOT))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_parent_pids() {
        let me = std::process::id();
        assert_eq!(parent_pid(me), Some(std::os::unix::process::parent_id()));
        assert_eq!(
            mount_ns("self").unwrap(),
            mount_ns(&me.to_string()).unwrap()
        );
    }
}
