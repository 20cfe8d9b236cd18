//! The daemon's background tasks: reconciliation passes, SIGHUP reloads
//! and the eBPF log drain (the neighbour task is in `neighbours.rs`).
//! Whatever blocks (file reads, map walks) runs on a blocking thread, never
//! on the event loop's.

use std::sync::Arc;

use tokio::{signal::unix::Signal, sync::mpsc, task::JoinHandle, time::sleep};
use tracing::{debug, info, warn};

use super::errors::{ControlErrors, Stage};
use crate::{
    ingest::reconcile::{MIN_PASS_INTERVAL, Reconciler, Scan, pass_interval},
    kernel::neighbours::{self, STARTUP_RESOLVE_WAIT},
    settings::config::Config,
};

/// Re-reads the configuration (the file and the flags) on SIGHUP.
pub type Reload = Arc<dyn Fn() -> anyhow::Result<Config> + Send + Sync>;

/// Runs passes (one kernel sweep each) on a blocking thread (the sweep's
/// syscall walks the whole flow table), each one [`pass_interval`] after
/// the previous one: every second while passes are cheap.
/// A failed pass is counted and logged (rate-limited) as a `scan` control
/// error, and the next one runs on schedule.
pub fn spawn_reconciler(
    reconciler: Reconciler,
    results: mpsc::Sender<Scan>,
    errors: ControlErrors,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut reconciler = reconciler;
        let mut next = MIN_PASS_INTERVAL;
        loop {
            sleep(next).await;
            let joined = tokio::task::spawn_blocking(move || {
                let outcome = reconciler.pass();
                (reconciler, outcome)
            })
            .await;
            let Ok((back, outcome)) = joined else {
                warn!("reconciliation thread failed; flow accounting stops");
                return;
            };
            reconciler = back;
            match outcome {
                Ok(scan) => {
                    next = pass_interval(scan.cpu);
                    if results.send(scan).await.is_err() {
                        return;
                    }
                }
                Err(e) => errors.record(Stage::Scan, &e.context("reconciliation pass")),
            }
        }
    })
}

/// On every SIGHUP: re-reads the configuration ([`reread`]), probes its
/// backends and gives the kernel time to resolve them, then hands it to
/// the event loop.
pub fn spawn_reloader(
    reload: Reload,
    mut hangup: Signal,
    out: mpsc::Sender<Config>,
    errors: ControlErrors,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        while hangup.recv().await.is_some() {
            info!("SIGHUP received: re-reading the configuration");
            let Some(config) = reread(&reload, &errors).await else {
                continue;
            };
            for v in &config.vips {
                for b in &v.backends {
                    neighbours::probe(b.addr.ip());
                }
            }
            sleep(STARTUP_RESOLVE_WAIT).await;
            if out.send(config).await.is_err() {
                return;
            }
        }
    })
}

/// Re-reads the configuration on a blocking thread. One that cannot be
/// read, parsed or validated is a `reload` control error: counted, logged
/// (every time: each is an operator's SIGHUP, and the one line that says
/// why it did nothing) and `None`, so the running one is kept.
async fn reread(reload: &Reload, errors: &ControlErrors) -> Option<Config> {
    let reload = reload.clone();
    match tokio::task::spawn_blocking(move || reload()).await {
        Ok(Ok(config)) => Some(config),
        Ok(Err(e)) => {
            warn!("SIGHUP: keeping the running configuration: {e:#}");
            errors.count(Stage::Reload);
            None
        }
        Err(e) => {
            let e = anyhow::anyhow!("reading the configuration failed: {e}");
            errors.record(Stage::Reload, &e);
            None
        }
    }
}

/// Forwards the program's aya-log records (if it has any) to tracing.
pub fn spawn_ebpf_log_drain(program_id: u32) -> Option<JoinHandle<()>> {
    let logger = match aya_log::EbpfLogger::init_from_id(program_id) {
        Ok(logger) => logger,
        Err(e) => {
            debug!("no eBPF log channel: {e}");
            return None;
        }
    };
    // SAFETY: the logger owns its ring-buffer fd for as long as the AsyncFd lives.
    let mut fd = match unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(logger, tokio::io::Interest::READABLE)
    } {
        Ok(fd) => fd,
        Err(e) => {
            warn!("cannot poll eBPF logs: {e}");
            return None;
        }
    };
    Some(tokio::spawn(async move {
        while let Ok(mut guard) = fd.readable_mut().await {
            guard.get_inner_mut().flush();
            guard.clear_ready();
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reload_count(errors: &ControlErrors) -> u64 {
        errors
            .totals()
            .into_iter()
            .find(|(stage, _)| *stage == "reload")
            .map_or(0, |(_, n)| n)
    }

    #[tokio::test]
    async fn a_configuration_that_does_not_read_is_a_counted_reload_error() {
        let errors = ControlErrors::default();
        let failing: Reload = Arc::new(|| anyhow::bail!("invalid config file lb.toml: line 3"));
        assert_eq!(reread(&failing, &errors).await, None);
        assert_eq!(reread(&failing, &errors).await, None);
        assert_eq!(reload_count(&errors), 2, "each SIGHUP counts");
        let panicking: Reload = Arc::new(|| panic!("reader panicked"));
        assert_eq!(reread(&panicking, &errors).await, None);
        assert_eq!(reload_count(&errors), 3);
    }
}
