//! The neighbour task: keeps NEIGHBOURS equal to the kernel's neighbour
//! entries for the backends, from the neighbour multicast group as changes
//! happen, with a full dump at start, after a change of the backend set,
//! after an overrun of the multicast socket, and every
//! [`RESYNC_INTERVAL`] as a safety net. Nothing here blocks the runtime:
//! the multicast socket is non-blocking (polled through [`AsyncFd`]), one
//! change is one map write, and the dump runs on a blocking thread.

use std::{collections::HashMap, net::IpAddr, time::Duration};

use netlink_sys::Socket;
use tokio::{
    io::unix::AsyncFd,
    sync::watch,
    task::JoinHandle,
    time::{Instant, sleep_until},
};
use tracing::{debug, warn};

use super::errors::{ControlErrors, Stage};
use crate::kernel::neighbours::{Applied, NeighbourSync, RESYNC_INTERVAL, netlink, probe};

/// How soon a failed dump, map write or subscription is tried again.
const RETRY: Duration = Duration::from_secs(1);
/// A backend whose entry failed or was deleted is probed again (so the
/// kernel resolves it anew) at most this often.
const REPROBE_EVERY: Duration = Duration::from_secs(1);
/// Datagrams read in one go before the task looks at its other inputs.
const DATAGRAMS_PER_WAKE: usize = 64;
/// Far enough to mean "not scheduled".
const NEVER: Duration = Duration::from_secs(24 * 3600);

/// The backends' addresses the task filters on; the runtime sends a new
/// list after every membership change.
pub type BackendAddrs = watch::Sender<Vec<IpAddr>>;

enum Wake {
    Resync,
    Backends,
    Events,
    Resubscribe,
    Broken(std::io::Error),
    Stop,
}

/// What reading the multicast socket came to.
#[derive(Debug, Default)]
struct Drained {
    /// Changes may have been missed (an overrun, a datagram that did not
    /// parse, a failed write): dump again.
    resync: bool,
    /// The socket failed: open a new one.
    broken: bool,
}

/// Runs the neighbour task until the runtime drops the sender of
/// `backends`. Errors are counted as [`Stage::Neighbours`] and retried.
pub fn spawn_neighbour_watch(
    sync: NeighbourSync,
    mut backends: watch::Receiver<Vec<IpAddr>>,
    errors: ControlErrors,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut sync = sync;
        let mut events: Option<AsyncFd<Socket>> = None;
        // The first dump (right after subscribing) covers what changed
        // since the start-up sync.
        let mut resync_at = Instant::now();
        let mut resubscribe_at = Instant::now();
        let mut reprobed: HashMap<IpAddr, Instant> = HashMap::new();
        let mut buf = Vec::with_capacity(netlink::DATAGRAM_MAX);
        loop {
            if events.is_none() && Instant::now() >= resubscribe_at {
                match netlink::subscribe().and_then(|socket| {
                    // SAFETY: the socket owns its descriptor, which stays open
                    // for as long as the AsyncFd that owns the socket lives.
                    unsafe {
                        AsyncFd::register_with_interest(socket, tokio::io::Interest::READABLE)
                    }
                    .map_err(|e| anyhow::anyhow!("polling the netlink socket: {e}"))
                }) {
                    Ok(fd) => {
                        events = Some(fd);
                        // Changes made while unsubscribed are in the dump.
                        resync_at = Instant::now();
                    }
                    Err(e) => {
                        resubscribe_at = Instant::now() + RETRY;
                        errors.record(
                            Stage::Neighbours,
                            &e.context(
                                "subscribing to neighbour changes (the periodic dump goes on)",
                            ),
                        );
                    }
                }
            }
            let wake_resubscribe = if events.is_none() {
                resubscribe_at
            } else {
                Instant::now() + NEVER
            };
            let wake = tokio::select! {
                _ = sleep_until(resync_at) => Wake::Resync,
                changed = backends.changed() => if changed.is_ok() { Wake::Backends } else { Wake::Stop },
                ready = readable(events.as_ref()) => match ready {
                    Ok(()) => Wake::Events,
                    Err(e) => Wake::Broken(e),
                },
                _ = sleep_until(wake_resubscribe) => Wake::Resubscribe,
            };
            match wake {
                Wake::Stop => return,
                Wake::Broken(e) => {
                    errors.record(
                        Stage::Neighbours,
                        &anyhow::Error::from(e).context("polling neighbour changes"),
                    );
                    events = None;
                    resubscribe_at = Instant::now() + RETRY;
                }
                Wake::Resubscribe => {}
                Wake::Backends => {
                    let list = backends.borrow_and_update().clone();
                    for ip in sync.set_backends(list) {
                        probe(ip);
                    }
                    // An added backend that is already resolved sends no
                    // change, and a removed one's entry must go.
                    resync_at = Instant::now();
                }
                Wake::Resync => {
                    sync.probe_backends();
                    let joined = tokio::task::spawn_blocking(move || {
                        let outcome = sync.sync(false);
                        (sync, outcome)
                    })
                    .await;
                    let Ok((back, outcome)) = joined else {
                        // The sync panicked and took the map handle with it.
                        errors.record(
                            Stage::Neighbours,
                            &anyhow::anyhow!(
                                "the neighbour dump panicked; neighbours are no longer refreshed"
                            ),
                        );
                        return;
                    };
                    sync = back;
                    resync_at = Instant::now()
                        + if outcome.is_ok() {
                            RESYNC_INTERVAL
                        } else {
                            RETRY
                        };
                    errors.check(Stage::Neighbours, outcome);
                }
                Wake::Events => {
                    let Some(fd) = events.as_ref() else { continue };
                    let drained = drain(fd, &mut buf, &mut sync, &mut reprobed, &errors).await;
                    if drained.resync {
                        resync_at = resync_at.min(Instant::now());
                    }
                    if drained.broken {
                        events = None;
                        resubscribe_at = Instant::now() + RETRY;
                    }
                }
            }
        }
    })
}

/// Waits until the socket (if any) is readable; never, without one.
async fn readable(fd: Option<&AsyncFd<Socket>>) -> std::io::Result<()> {
    match fd {
        Some(fd) => fd.readable().await.map(|_| ()),
        None => std::future::pending().await,
    }
}

/// Reads every pending datagram of the multicast socket and applies it.
async fn drain(
    fd: &AsyncFd<Socket>,
    buf: &mut Vec<u8>,
    sync: &mut NeighbourSync,
    reprobed: &mut HashMap<IpAddr, Instant>,
    errors: &ControlErrors,
) -> Drained {
    let mut drained = Drained::default();
    let Ok(mut guard) = fd.readable().await else {
        drained.broken = true;
        return drained;
    };
    for _ in 0..DATAGRAMS_PER_WAKE {
        buf.clear();
        let read = match guard.try_io(|inner| inner.get_ref().recv(buf, 0)) {
            Ok(read) => read,
            // Would block: everything pending was read.
            Err(_) => return drained,
        };
        match read {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                // The kernel dropped changes: read the whole table again.
                warn!("neighbour changes overran the socket buffer; dumping the table again");
                drained.resync = true;
                continue;
            }
            Err(e) => {
                errors.record(
                    Stage::Neighbours,
                    &anyhow::Error::from(e).context("reading neighbour changes"),
                );
                drained.broken = true;
                drained.resync = true;
                return drained;
            }
        }
        let mut changes = Vec::new();
        if let Err(e) = netlink::parse(buf, sync.ifindex(), &mut changes) {
            errors.record(
                Stage::Neighbours,
                &e.context("a neighbour change did not parse"),
            );
            drained.resync = true;
        }
        for change in changes {
            match sync.apply(change) {
                Ok(Applied::Removed) => {
                    let crate::kernel::neighbours::Change::Lost(ip) = change else {
                        continue;
                    };
                    let now = Instant::now();
                    if reprobed
                        .get(&ip)
                        .is_none_or(|at| now.duration_since(*at) >= REPROBE_EVERY)
                    {
                        reprobed.insert(ip, now);
                        probe(ip);
                    }
                }
                Ok(applied) => debug!(?change, ?applied, "neighbour change"),
                Err(e) => {
                    errors.record(Stage::Neighbours, &e.context("applying a neighbour change"));
                    drained.resync = true;
                }
            }
        }
        reprobed.retain(|ip, _| sync.is_backend(ip));
    }
    // More are pending (the socket stays readable): the task reads them
    // after the other inputs had their turn.
    drained
}
