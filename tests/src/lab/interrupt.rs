//! A benchmark stopped with Ctrl-C or SIGTERM cleans up its labs.
//!
//! The default action of both signals ends the process at once: no lab's
//! `Drop` runs, so its backends, peers and lb-user keep running in
//! namespaces nobody deletes (the next lab's [`super::sweep_stale`] finds
//! them only later). [`clean_up_on_signals`] catches both signals and
//! handles them in a thread of its own, which removes this process's labs
//! ([`super::names::sweep_own`]) and exits as the signal would have
//! (128 + its number).

use std::{
    sync::atomic::{AtomicBool, Ordering},
    thread,
};

use anyhow::{Context, Result};
use signal_hook::{
    consts::{SIGINT, SIGTERM},
    iterator::Signals,
};

use super::names::sweep_own;

/// Set once a signal arrived: the labs' own `Drop`s then leave the
/// cleanup to the sweep instead of racing it.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Whether this process is being stopped by a signal.
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// Ends the process with `result` (0, or 1 after printing the error as
/// `program: error: ...`); while the signal thread is sweeping, waits for
/// it to end the process instead (an error the sweep caused, such as a
/// killed child, would otherwise exit first and leave labs behind).
pub fn exit_with(program: &str, result: Result<()>) -> ! {
    if interrupted() {
        loop {
            thread::park();
        }
    }
    match result {
        Ok(()) => std::process::exit(0),
        Err(error) => {
            eprintln!("{program}: error: {error:#}");
            std::process::exit(1)
        }
    }
}

/// Replaces the default action of SIGINT and SIGTERM with the cleanup, in
/// a thread of its own. (Handlers, unlike a blocked mask, are not inherited
/// across the `exec` of the lab's children, which keep the default action.)
pub fn clean_up_on_signals(program: &'static str) -> Result<()> {
    let mut signals = Signals::new([SIGINT, SIGTERM]).context("handling SIGINT and SIGTERM")?;
    thread::Builder::new()
        .name("lab-cleanup".into())
        .spawn(move || {
            let Some(signal) = signals.forever().next() else {
                return;
            };
            INTERRUPTED.store(true, Ordering::SeqCst);
            let name = if signal == SIGINT {
                "SIGINT"
            } else {
                "SIGTERM"
            };
            eprintln!("{program}: {name}: removing this run's labs");
            match sweep_own() {
                Ok(removed) => eprintln!("{program}: removed {}", removed.join(", ")),
                Err(error) => eprintln!("{program}: cleanup: {error:#}"),
            }
            std::process::exit(128 + signal);
        })
        .context("starting the signal thread")?;
    Ok(())
}
