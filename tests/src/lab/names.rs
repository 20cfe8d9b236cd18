//! Unique names for each lab, and the sweep that removes what crashed labs
//! left behind.
//!
//! Namespace names, bpffs pin paths and lb-user's files in [`RUN_DIR`] are
//! global to the machine, so every name starts with `lbl<pid>n<counter>`:
//! the pid keeps concurrent test processes apart, the counter keeps labs of
//! one process apart, and the pid lets a later run tell a dead lab's
//! leftovers from a live lab's.

use std::{
    path::Path,
    process::Command,
    sync::atomic::{AtomicU32, Ordering},
    time::Duration,
};

use anyhow::{Context, Result, ensure};
use nix::{
    sys::signal::{Signal, kill},
    unistd::Pid,
};

use lb_user::kernel::instance::run_file_instance;

use super::netns::run_ok;

/// Prefix of everything a lab names.
pub const LAB_PREFIX: &str = "lbl";
/// Linux limit on interface names (IFNAMSIZ - 1).
pub const MAX_IFNAME_LEN: usize = 15;
/// Where lb-user pins each instance (DESIGN.md).
pub const PIN_ROOT: &str = "/sys/fs/bpf/lb-user";
/// lb-user's default instance name is this prefix plus the interface name.
pub const INSTANCE_PREFIX: &str = "lb-";
/// Where lb-user keeps each instance's lock, control socket and records,
/// as `<instance><suffix>` (lb-user's `kernel::instance::run_file`). They
/// outlive the instance (the lock file on purpose), so a lab removes its
/// instances'.
pub const RUN_DIR: &str = lb_user::kernel::instance::LOCK_DIR;
/// Deadline for `ip` commands used while sweeping.
const SWEEP_COMMAND_TIMEOUT: Duration = Duration::from_secs(20);

static NEXT_LAB: AtomicU32 = AtomicU32::new(1);

/// A fresh lab id for this process, e.g. `lbl4242n3`.
pub fn next_lab_id() -> String {
    let counter = NEXT_LAB.fetch_add(1, Ordering::Relaxed);
    format!("{LAB_PREFIX}{}n{counter}", std::process::id())
}

/// The pid encoded in a lab name, if `name` is one.
pub fn owner_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix(LAB_PREFIX)?;
    let (pid, _) = rest.split_once('n')?;
    pid.parse().ok()
}

/// Checks an interface name fits the kernel's limit.
pub fn check_ifname(name: &str) -> Result<()> {
    ensure!(
        name.len() <= MAX_IFNAME_LEN,
        "interface name {name} is longer than {MAX_IFNAME_LEN} bytes"
    );
    Ok(())
}

/// True for names owned by a process that no longer exists.
fn is_stale(name: &str) -> bool {
    owner_pid(name).is_some_and(|pid| {
        pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists()
    })
}

/// Deletes namespaces, log folders, lb-user pin directories and lb-user's
/// files in [`RUN_DIR`] left by labs whose process died (killed test runs
/// skip `Drop`), and stops what still runs in those namespaces (a killed
/// lab's backends and lb-user outlive it). Returns what it removed.
pub fn sweep_stale() -> Result<Vec<String>> {
    sweep(is_stale)
}

/// What [`sweep_stale`] does, for this process's own labs: the cleanup of
/// a run stopped by a signal, which skips every lab's `Drop`
/// ([`super::interrupt`]).
pub fn sweep_own() -> Result<Vec<String>> {
    sweep(|name| owner_pid(name) == Some(std::process::id()))
}

/// Removes every namespace, log folder, pin directory and lb-user run file
/// whose name (instance name, for the last two, less [`INSTANCE_PREFIX`])
/// `matches`, after killing the processes in each such namespace.
fn sweep(matches: impl Fn(&str) -> bool) -> Result<Vec<String>> {
    let mut removed = Vec::new();
    let mut list = Command::new("ip");
    list.args(["netns", "list"]);
    for line in run_ok(list, SWEEP_COMMAND_TIMEOUT)?.lines() {
        let Some(name) = line.split_whitespace().next() else {
            continue;
        };
        if matches(name) {
            kill_processes_in(name)?;
            let mut delete = Command::new("ip");
            delete.args(["netns", "delete", name]);
            run_ok(delete, SWEEP_COMMAND_TIMEOUT)?;
            removed.push(name.to_string());
        }
    }
    // Log folders a panicking lab kept for debugging.
    if let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) {
        for entry in entries.flatten() {
            if matches(&entry.file_name().to_string_lossy()) {
                std::fs::remove_dir_all(entry.path())?;
                removed.push(entry.path().display().to_string());
            }
        }
    }
    if let Ok(entries) = std::fs::read_dir(PIN_ROOT) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.strip_prefix(INSTANCE_PREFIX).is_some_and(&matches) {
                std::fs::remove_dir_all(entry.path())?;
                removed.push(entry.path().display().to_string());
            }
        }
    }
    // After the kills above: no lb-user of these labs writes them any more.
    if let Ok(entries) = std::fs::read_dir(RUN_DIR) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let lab_instance = run_file_instance(&name)
                .and_then(|instance| instance.strip_prefix(INSTANCE_PREFIX))
                .is_some_and(&matches);
            if lab_instance && remove_if_there(&entry.path())? {
                removed.push(entry.path().display().to_string());
            }
        }
    }
    Ok(removed)
}

/// Removes lb-user's files of `instance` in [`RUN_DIR`] (only those whose
/// whole instance part is `instance`, so another instance whose name starts
/// the same keeps its own); returns what it removed. For an instance that
/// no longer runs: a running one would lose its lock and socket.
pub fn remove_run_files(instance: &str) -> Result<Vec<String>> {
    let mut removed = Vec::new();
    let Ok(entries) = std::fs::read_dir(RUN_DIR) else {
        return Ok(removed);
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if run_file_instance(&name) == Some(instance) && remove_if_there(&entry.path())? {
            removed.push(entry.path().display().to_string());
        }
    }
    Ok(removed)
}

/// Removes the file at `path`; false if it was gone already (another
/// process's sweep may run at the same time).
fn remove_if_there(path: &Path) -> Result<bool> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e).with_context(|| format!("removing {}", path.display())),
    }
}

/// SIGKILL to every process in namespace `ns` (`ip netns pids`): a
/// namespace whose lab is gone has nobody left to stop them gracefully,
/// and deleting its name would leave them running, still attached.
fn kill_processes_in(ns: &str) -> Result<()> {
    let mut pids = Command::new("ip");
    pids.args(["netns", "pids", ns]);
    for pid in run_ok(pids, SWEEP_COMMAND_TIMEOUT)?
        .split_whitespace()
        .filter_map(|pid| pid.parse::<i32>().ok())
    {
        // Gone already (ESRCH) is what was wanted.
        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_encode_the_pid_and_are_unique() {
        let (a, b) = (next_lab_id(), next_lab_id());
        assert_ne!(a, b);
        assert_eq!(owner_pid(&a), Some(std::process::id()));
        assert_eq!(owner_pid(&format!("{a}-be1")), Some(std::process::id()));
        assert_eq!(owner_pid("other-ns"), None);
        assert!(!is_stale(&a), "a lab of this process is never stale");
    }

    /// Every file lb-user names after an instance is known by its suffix,
    /// so the lab and the sweep remove all of them.
    #[test]
    fn run_files_are_told_by_lb_users_own_paths() {
        let instance = "lb-lbl42n1b";
        let paths = [
            lb_user::kernel::instance::lock_path(instance),
            lb_user::surface::control::socket_path(instance),
            lb_user::kernel::sysctl::record_path(instance),
            lb_user::surface::status::zones_path(instance),
            lb_user::surface::status::discovery_path(instance),
        ];
        for path in paths {
            assert_eq!(path.parent(), Some(Path::new(RUN_DIR)), "{path:?}");
            let name = path.file_name().unwrap().to_str().unwrap();
            assert_eq!(run_file_instance(name), Some(instance), "{name}");
            let tmp = format!("{name}{}", lb_user::kernel::instance::TMP_SUFFIX);
            assert_eq!(run_file_instance(&tmp), Some(instance), "{tmp}");
        }
        // Not an instance's: the lock shared by the SNAT records, and
        // whatever else may lie there.
        assert_eq!(run_file_instance(".reserved-ports.lock"), None);
        assert_eq!(run_file_instance(".lock"), None);
        assert_eq!(run_file_instance("lb-lbl42n1b"), None);
        assert_eq!(run_file_instance("notes.txt"), None);
    }
}
