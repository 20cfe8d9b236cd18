//! The neighbour task: keeps NEIGHBOURS equal to the kernel's neighbour
//! entries for the backends, from the neighbour multicast group as changes
//! happen, with a full dump at start, after a change of the backend set,
//! after an overrun of the multicast socket, and every
//! [`RESYNC_INTERVAL`] as a safety net. Once it has written a backend's
//! changed MAC or removed its entry, it zeroes the data path's shared next
//! hops of the backend ids at that address (`BACKEND_HOPS`), so new flows
//! stop using the old MAC at once instead of until the hops age out
//! (`BACKEND_HOP_JIFFIES`). Nothing here blocks the runtime:
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
use crate::kernel::{
    backend_hops::{BackendHops, BackendIds, PinnedHops},
    neighbours::{Applied, NeighbourSync, RESYNC_INTERVAL, netlink, probe},
};

/// How soon a failed dump, map write or subscription is tried again.
const RETRY: Duration = Duration::from_secs(1);
/// A backend whose entry failed or was deleted is probed again (so the
/// kernel resolves it anew) at most this often.
const REPROBE_EVERY: Duration = Duration::from_secs(1);
/// Datagrams read in one go before the task looks at its other inputs.
const DATAGRAMS_PER_WAKE: usize = 64;
/// Far enough to mean "not scheduled".
const NEVER: Duration = Duration::from_secs(24 * 3600);

/// The backends' addresses the task filters on, with the backend ids at
/// each (whose shared next hops it forgets); the runtime sends a new set
/// after every membership change.
pub type BackendAddrs = watch::Sender<BackendIds>;

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
/// `backends`; `hops` is where it forgets the shared next hops of the
/// addresses whose entry changed. Errors are counted as
/// [`Stage::Neighbours`] and retried.
pub fn spawn_neighbour_watch(
    sync: NeighbourSync,
    hops: PinnedHops,
    mut backends: watch::Receiver<BackendIds>,
    errors: ControlErrors,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut sync = sync;
        let mut hops = BackendHops::new(hops, BackendIds::default());
        follow_backends(&mut sync, &mut hops, backends.borrow_and_update().clone());
        // What the start-up dump changed (a re-adopted map's old MACs), now
        // that the ids are known.
        forget_changed_hops(&mut sync, &mut hops, &errors);
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
                    let ids = backends.borrow_and_update().clone();
                    follow_backends(&mut sync, &mut hops, ids);
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
                    // Also after a failed dump: what it wrote before failing.
                    forget_changed_hops(&mut sync, &mut hops, &errors);
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
                    forget_changed_hops(&mut sync, &mut hops, &errors);
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

/// Takes a new backend set: filters on its addresses (probing the new
/// ones) and forgets hops by its ids.
fn follow_backends(sync: &mut NeighbourSync, hops: &mut BackendHops, ids: BackendIds) {
    for ip in sync.set_backends(ids.addrs()) {
        probe(ip);
    }
    hops.set_ids(ids);
}

/// Zeroes the shared next hops of every backend id at the addresses whose
/// MAC the sync changed or whose entry it removed since the last call
/// (after the write: a hop resolved anew then has the new MAC). A failure is
/// counted, never fatal: such a hop ages out by itself within
/// `BACKEND_HOP_JIFFIES`.
fn forget_changed_hops(sync: &mut NeighbourSync, hops: &mut BackendHops, errors: &ControlErrors) {
    let changed = sync.take_changed_addrs();
    if changed.is_empty() {
        return;
    }
    debug!(addrs = ?changed, "forgetting the shared next hops of changed neighbours");
    if let Err(e) = hops.forget(&changed) {
        errors.record(
            Stage::Neighbours,
            &e.context("forgetting the shared next hops of changed neighbours"),
        );
    }
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
