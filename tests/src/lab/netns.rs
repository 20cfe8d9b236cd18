//! Running code and commands inside a named network namespace.
//!
//! Two ways in, for two needs:
//! - [`netns_exec`] uses `ip netns exec`, the usual tool. It also gives the
//!   child a private mount namespace with a fresh `/sys` for that netns, which
//!   is right for servers and tools.
//! - [`setns_command`] only switches the network namespace (`setns` in the
//!   child before `exec`). `lb-user` needs this: it pins its maps and link
//!   under `/sys/fs/bpf`, and under `ip netns exec` that path would be a
//!   private mount that disappears with the process, so a restarted `lb-user`
//!   or `lb-user status` could never find the pins.
//! - [`in_netns`] runs a closure on a thread that joined the namespace;
//!   sockets it creates stay in that namespace when handed back to any thread.

use std::{
    ffi::OsStr,
    fs::File,
    io::Read,
    os::{fd::AsRawFd, unix::process::CommandExt},
    path::PathBuf,
    process::{Command, Output, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use nix::sched::{CloneFlags, setns};

/// How often a waiting caller checks whether a child has exited.
pub const POLL_INTERVAL: Duration = Duration::from_millis(10);

/// Where `ip netns` keeps the handle of a named namespace.
pub fn netns_path(ns: &str) -> PathBuf {
    PathBuf::from("/run/netns").join(ns)
}

/// `ip netns exec NS PROGRAM ARGS...`, not yet spawned.
pub fn netns_exec<S: AsRef<OsStr>>(ns: &str, argv: &[S]) -> Command {
    let mut command = Command::new("ip");
    command.args(["netns", "exec", ns]).args(argv);
    command
}

/// `PROGRAM` that enters the network namespace `ns` (only that namespace)
/// right before `exec`.
pub fn setns_command(ns: &str, program: impl AsRef<OsStr>) -> Result<Command> {
    let handle = File::open(netns_path(ns)).with_context(|| format!("opening namespace {ns}"))?;
    let mut command = Command::new(program);
    // SAFETY: the closure only makes the async-signal-safe setns(2) call on a
    // descriptor owned by the closure, as pre_exec requires.
    unsafe {
        command.pre_exec(move || {
            if libc::setns(handle.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok(command)
}

/// Runs `f` on a fresh thread that has joined network namespace `ns`.
/// Panics in `f` propagate to the caller.
pub fn in_netns<T, F>(ns: &str, f: F) -> Result<T>
where
    T: Send,
    F: FnOnce() -> Result<T> + Send,
{
    let handle = File::open(netns_path(ns)).with_context(|| format!("opening namespace {ns}"))?;
    std::thread::scope(|scope| {
        let worker = scope.spawn(move || {
            setns(&handle, CloneFlags::CLONE_NEWNET)
                .with_context(|| format!("entering namespace {ns}"))?;
            f()
        });
        worker
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

/// Runs a command to completion with a deadline, capturing its output; a
/// command still running at the deadline is killed and reported as an error.
pub fn output_with_timeout(mut command: Command, timeout: Duration) -> Result<Output> {
    let description = format!("{command:?}");
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("spawning {description}"))?;
    let stdout = drain_in_background(child.stdout.take());
    let stderr = drain_in_background(child.stderr.take());
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("{description} did not finish within {timeout:?}");
        }
        std::thread::sleep(POLL_INTERVAL);
    };
    Ok(Output {
        status,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    })
}

/// Like [`output_with_timeout`], but a non-zero exit is an error carrying stderr;
/// returns stdout as text.
pub fn run_ok(command: Command, timeout: Duration) -> Result<String> {
    let description = format!("{command:?}");
    let output = output_with_timeout(command, timeout)?;
    if !output.status.success() {
        bail!(
            "{description} failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Reads a pipe to its end on a helper thread, so a chatty child never blocks.
fn drain_in_background(
    pipe: Option<impl Read + Send + 'static>,
) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        if let Some(mut pipe) = pipe {
            let _ = pipe.read_to_end(&mut bytes);
        }
        bytes
    })
}
