//! The daemon's background tasks: reconciliation passes, neighbour
//! refreshes and the eBPF log drain.

use tokio::{sync::mpsc, task::JoinHandle, time::sleep};
use tracing::{debug, warn};

use crate::{
    ingest::reconcile::{RECONCILE_INTERVAL, Reconciler, Scan},
    kernel::neighbours::{NeighbourSync, REFRESH_INTERVAL, STARTUP_RESOLVE_WAIT},
};

/// Runs a pass (one kernel sweep) every [`RECONCILE_INTERVAL`] on a
/// blocking thread (the sweep's syscall walks the whole flow table).
pub fn spawn_reconciler(reconciler: Reconciler, results: mpsc::Sender<Scan>) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut reconciler = reconciler;
        loop {
            sleep(RECONCILE_INTERVAL).await;
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
                    if results.send(scan).await.is_err() {
                        return;
                    }
                }
                Err(e) => warn!("reconciliation pass failed: {e:#}"),
            }
        }
    })
}

pub fn spawn_neighbour_refresh(mut neighbours: NeighbourSync) -> JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            sleep(REFRESH_INTERVAL).await;
            neighbours.probe_backends();
            sleep(STARTUP_RESOLVE_WAIT).await;
            if let Err(e) = neighbours.sync(false) {
                warn!("refreshing neighbours: {e:#}");
            }
        }
    })
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
