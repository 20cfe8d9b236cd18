//! Child processes a lab started, so it can signal, wait for and finally
//! stop every one of them, even when the test that started them panics.

use std::{
    fs::File,
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    sync::{Mutex, MutexGuard},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use nix::{sys::signal::Signal, unistd::Pid};

use super::netns::POLL_INTERVAL;

/// How long a process gets to exit after SIGTERM during cleanup.
const STOP_GRACE: Duration = Duration::from_secs(3);

/// Handle of a process started by the lab.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessId(usize);

struct Tracked {
    label: String,
    child: Child,
    /// Set once the child has been reaped, so its pid is never signalled again.
    exit: Option<ExitStatus>,
}

impl Tracked {
    /// The exit status, reaping the child if it has just exited.
    fn poll(&mut self) -> Result<Option<ExitStatus>> {
        if self.exit.is_none() {
            self.exit = self
                .child
                .try_wait()
                .with_context(|| format!("waiting for {}", self.label))?;
        }
        Ok(self.exit)
    }
}

/// Every process of one lab; output goes to files in the lab's log folder.
pub struct Processes {
    log_dir: PathBuf,
    children: Mutex<Vec<Tracked>>,
}

impl Processes {
    pub fn new(log_dir: PathBuf) -> Self {
        Self {
            log_dir,
            children: Mutex::new(Vec::new()),
        }
    }

    pub fn log_dir(&self) -> &Path {
        &self.log_dir
    }

    fn children(&self) -> MutexGuard<'_, Vec<Tracked>> {
        // Nothing panics while holding the lock; recover the data regardless.
        self.children
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn log_path(&self, index: usize, label: &str, stream: &str) -> PathBuf {
        self.log_dir.join(format!("{index:02}-{label}.{stream}"))
    }

    /// Starts `command` with stdout and stderr sent to log files.
    pub fn spawn(&self, label: &str, mut command: Command) -> Result<ProcessId> {
        let mut children = self.children();
        let index = children.len();
        let stdout = File::create(self.log_path(index, label, "out"))?;
        let stderr = File::create(self.log_path(index, label, "err"))?;
        let child = command
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .with_context(|| format!("starting {label}: {command:?}"))?;
        children.push(Tracked {
            label: label.to_string(),
            child,
            exit: None,
        });
        Ok(ProcessId(index))
    }

    /// The exit status if the process has exited.
    pub fn exit_status(&self, id: ProcessId) -> Result<Option<ExitStatus>> {
        self.children()[id.0].poll()
    }

    /// Sends `signal` unless the process has already exited.
    pub fn signal(&self, id: ProcessId, signal: Signal) -> Result<()> {
        let mut children = self.children();
        let tracked = &mut children[id.0];
        if tracked.poll()?.is_none() {
            // Not reaped yet, so the pid still belongs to our child.
            nix::sys::signal::kill(Pid::from_raw(tracked.child.id() as i32), signal)
                .with_context(|| format!("sending {signal} to {}", tracked.label))?;
        }
        Ok(())
    }

    /// Waits for the process to exit, failing after `timeout`.
    pub fn wait(&self, id: ProcessId, timeout: Duration) -> Result<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.exit_status(id)? {
                return Ok(status);
            }
            if Instant::now() >= deadline {
                bail!(
                    "{} still running after {timeout:?}",
                    self.children()[id.0].label
                );
            }
            std::thread::sleep(POLL_INTERVAL);
        }
    }

    /// What the process wrote to stdout so far.
    pub fn stdout(&self, id: ProcessId) -> String {
        self.read_log(id, "out")
    }

    /// What the process wrote to stderr so far.
    pub fn stderr(&self, id: ProcessId) -> String {
        self.read_log(id, "err")
    }

    fn read_log(&self, id: ProcessId, stream: &str) -> String {
        let label = self.children()[id.0].label.clone();
        std::fs::read_to_string(self.log_path(id.0, &label, stream)).unwrap_or_default()
    }

    /// SIGTERM to every running process, then SIGKILL to those still running
    /// after a grace period; reaps all of them.
    pub fn stop_all(&self) {
        let mut children = self.children();
        for tracked in children.iter_mut() {
            if let Ok(None) = tracked.poll() {
                let _ = nix::sys::signal::kill(
                    Pid::from_raw(tracked.child.id() as i32),
                    Signal::SIGTERM,
                );
            }
        }
        let deadline = Instant::now() + STOP_GRACE;
        while Instant::now() < deadline && children.iter_mut().any(|t| matches!(t.poll(), Ok(None)))
        {
            std::thread::sleep(POLL_INTERVAL);
        }
        for tracked in children.iter_mut() {
            if let Ok(None) = tracked.poll() {
                let _ = tracked.child.kill();
                tracked.exit = tracked.child.wait().ok();
            }
        }
    }
}
