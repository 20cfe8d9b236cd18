//! Watching each discovered VIP's prefix.
//!
//! At startup ([`seed`]) every prefix is read at one revision R and the
//! VIPs' backends are filled in from it; if etcd cannot be reached, from
//! the cache of the last known backends. etcd refusing the balancer's
//! credentials at startup is a configuration error, not an outage: the
//! start fails (see [`etcd::is_rejection`]). Then one task per VIP
//! ([`Watcher::spawn`]) watches from R+1. A broken stream is reconnected
//! with backoff and resumes from the last revision seen (changes read
//! before the break are reported first: the resumed watch starts after
//! them, so they would never come again). A compacted revision, or a
//! store whose revision went back below the view's (etcd wiped or
//! restored from a backup), makes it read the prefix again and report the
//! new whole set, which the daemon diffs against the pool. Losing etcd
//! reports nothing: the pool stays as it is (fail static).

use std::{
    collections::HashSet,
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering},
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context as _, anyhow};
use etcd_client::{Client, EventType, GetOptions, WatchOptions};
use tokio::{sync::mpsc, task::JoinHandle, time::sleep};
use tracing::{info, warn};

use super::{
    cache::{self, Cache, CachedVip},
    entry::Entry,
    etcd,
    view::{PrefixView, Skipped},
};
use crate::{
    kernel::neighbours::{self, STARTUP_RESOLVE_WAIT},
    settings::{addr::VipAddr, config::Config, discovery::EtcdSettings},
    surface::status::{DiscoveredVip, DiscoveryFile, discovery_path},
};

/// Reconnect backoff: doubling from the first to the last.
const BACKOFF_FIRST: Duration = Duration::from_millis(100);
const BACKOFF_LAST: Duration = Duration::from_secs(2);
/// Events arriving this close together are applied as one update.
const BATCH_QUIET: Duration = Duration::from_millis(20);
/// An update waits for more events at most this long.
const BATCH_MAX: Duration = Duration::from_millis(200);

/// The whole wanted set of one VIP after a change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Update {
    /// The VIP, by its address: its index in the running fleet moves as
    /// VIPs are added at runtime and removed ones are freed, and the
    /// runtime state file can leave out a VIP before it at the start.
    pub vip: VipAddr,
    /// The etcd prefix the watch follows: the update is the VIP's only
    /// while the configuration still discovers it from there (the reload
    /// that drops the VIP ends its watch, but an update sent just before
    /// may still be queued; a VIP added at runtime at its address is
    /// static).
    pub prefix: String,
    pub revision: i64,
    pub wanted: Vec<Entry>,
}

/// What metrics and status show of discovery; shared with the tasks.
#[derive(Debug, Default)]
pub struct DiscoveryStatus {
    /// Per discovered VIP (config index, connected, revision).
    pub vips: Vec<VipStatus>,
    /// Where `lb-user status` reads the VIPs' sources and revisions.
    pub file: Option<PathBuf>,
    /// Updates reported to the daemon.
    pub updates_applied: AtomicU64,
    /// Keys or values skipped as invalid.
    pub updates_invalid: AtomicU64,
    /// Full re-reads after a compaction or a reconnect from the cache.
    pub resyncs: AtomicU64,
    /// Unix time in milliseconds of the last update (0: none yet).
    pub last_update_ms: AtomicU64,
    /// Held while the file is built and written: every VIP's watch task
    /// publishes, and the file has one temporary name beside it, which two
    /// writers at once would truncate under each other (and the later
    /// state could be renamed over by the earlier).
    pub publishing: std::sync::Mutex<()>,
}

#[derive(Debug, Default)]
pub struct VipStatus {
    pub vip: usize,
    /// `IP:PORT/proto`.
    pub name: String,
    pub prefix: String,
    pub connected: AtomicBool,
    pub revision: AtomicI64,
    /// Its watch ended (a reload dropped the VIP): no longer shown.
    pub ended: AtomicBool,
}

impl DiscoveryStatus {
    /// The VIPs whose watch runs.
    fn running(&self) -> impl Iterator<Item = &VipStatus> {
        self.vips
            .iter()
            .filter(|v| !v.ended.load(Ordering::Relaxed))
    }

    /// Whether every running watch is connected (an ended one is not
    /// waited for: with all ended, nothing is down).
    pub fn connected(&self) -> bool {
        !self.vips.is_empty() && self.running().all(|v| v.connected.load(Ordering::Relaxed))
    }

    /// The highest revision applied, ended watches' included (it never
    /// goes back).
    pub fn revision(&self) -> i64 {
        self.vips
            .iter()
            .map(|v| v.revision.load(Ordering::Relaxed))
            .max()
            .unwrap_or(0)
    }

    /// Marks the watch of VIP `name` (`IP:PORT/proto`) on `prefix` ended:
    /// metrics and `lb-user status` leave it out from now on.
    pub fn end(&self, name: &str, prefix: &str) {
        for v in &self.vips {
            if v.name == name && v.prefix == prefix {
                v.ended.store(true, Ordering::Relaxed);
            }
        }
        self.publish();
    }

    /// Seconds since the last update, `None` before the first.
    pub fn seconds_since_update(&self) -> Option<f64> {
        let last = self.last_update_ms.load(Ordering::Relaxed);
        (last > 0).then(|| now_ms().saturating_sub(last) as f64 / 1000.0)
    }

    fn touched(&self) {
        self.last_update_ms.store(now_ms(), Ordering::Relaxed);
    }

    /// Rewrites the file `lb-user status` reads (source and revision).
    fn publish(&self) {
        let Some(path) = self.file.as_ref() else {
            return;
        };
        // A panicked writer left nothing half-done that matters here: the
        // file is rebuilt whole.
        let _one_writer = self
            .publishing
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut file = DiscoveryFile::default();
        for v in self.running() {
            file.vips.insert(
                v.name.clone(),
                DiscoveredVip {
                    prefix: v.prefix.clone(),
                    revision: v.revision.load(Ordering::Relaxed),
                    connected: v.connected.load(Ordering::Relaxed),
                },
            );
        }
        let written = serde_json::to_vec(&file)
            .map_err(std::io::Error::other)
            .and_then(|text| crate::kernel::instance::write_private(path, &text));
        if let Err(e) = written {
            tracing::debug!("cannot write {}: {e}", path.display());
        }
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn log_skipped(status: &DiscoveryStatus, skipped: &[Skipped]) {
    for s in skipped {
        status.updates_invalid.fetch_add(1, Ordering::Relaxed);
        let key = super::entry::shown(&s.key);
        warn!(%key, "discovery: skipping key: {}", s.reason);
    }
}

/// Reads `last`'s prefix at `revision` (0: the current one); a key whose
/// value is now bad keeps its value in `last` (see [`PrefixView::reread`]).
async fn read_prefix(
    client: &mut Client,
    last: &PrefixView,
    revision: i64,
) -> anyhow::Result<(PrefixView, Vec<Skipped>)> {
    let mut options = GetOptions::new().with_prefix();
    if revision > 0 {
        options = options.with_revision(revision);
    }
    let response = tokio::time::timeout(
        etcd::REQUEST_TIMEOUT,
        client.get(last.prefix.as_str(), Some(options)),
    )
    .await
    .context("reading the prefix timed out")??;
    let revision = response
        .header()
        .map(|h| h.revision())
        .ok_or_else(|| anyhow!("etcd sent no revision"))?;
    let kvs = response
        .kvs()
        .iter()
        .map(|kv| (kv.key().to_vec(), kv.value().to_vec()));
    Ok(last.reread(revision, kvs))
}

/// Everything the watch tasks need, from [`seed`].
pub struct Watcher {
    settings: EtcdSettings,
    views: Vec<(usize, PrefixView, bool)>,
    cache_path: PathBuf,
    cache: Arc<Mutex<Cache>>,
    /// Every configured VIP's address, by its index in the configuration
    /// as read (what `views` index).
    vip_addrs: Vec<VipAddr>,
    pub status: Arc<DiscoveryStatus>,
}

/// Fills in the backends of every VIP with an etcd prefix, from etcd (one
/// revision for all) or else from the cache. `None` when no VIP has one.
/// `snat` holds the SNAT addresses the kernel gets (both families): a key
/// naming a backend at one is skipped, then and in every later update
/// (see [`PrefixView::put`]).
pub async fn seed(config: &mut Config, snat: &[IpAddr]) -> anyhow::Result<Option<Watcher>> {
    let Some(settings) = config.discovery.etcd.clone() else {
        return Ok(None);
    };
    let discovered: Vec<usize> = (0..config.vips.len())
        .filter(|&i| config.vips[i].etcd_prefix.is_some())
        .collect();
    if discovered.is_empty() {
        return Ok(None);
    }
    let cache_path = cache::path(&config.state_dir, &config.instance);
    let cached = match Cache::load(&cache_path) {
        Ok(c) => c.unwrap_or_default(),
        Err(e) => {
            warn!("discovery cache unusable, ignoring it: {e:#}");
            Cache::default()
        }
    };
    let read = read_all(&settings, config, snat, &discovered, &cached).await;
    let mut views = Vec::new();
    let mut cache = Cache::default();
    let status_vips = discovered
        .iter()
        .map(|&i| VipStatus {
            vip: i,
            name: config.vips[i].vip.to_string(),
            prefix: config.vips[i].etcd_prefix.clone().unwrap_or_default(),
            ..VipStatus::default()
        })
        .collect();
    let status_file = discovery_path(&config.instance);
    let _ = std::fs::remove_file(&status_file);
    let status = Arc::new(DiscoveryStatus {
        vips: status_vips,
        file: Some(status_file),
        ..DiscoveryStatus::default()
    });
    match read {
        Ok(read) => {
            for (i, (view, skipped)) in discovered.iter().copied().zip(read) {
                log_skipped(&status, &skipped);
                // Fail static at the start too: a prefix etcd holds no
                // valid backend under (keys deleted, leases expired in an
                // outage, a bad bulk write) does not empty a pool at
                // runtime (`discover::state`, the removal cap), so it does
                // not stop a restart that has the last backends cached.
                let v = &config.vips[i];
                if view.wanted().is_empty()
                    && let Some(cached_view) = cached_view(&cached, v, snat, &status)?
                    && !cached_view.wanted().is_empty()
                {
                    warn!(
                        vip = %v.vip,
                        prefix = %view.prefix,
                        revision = view.revision,
                        cached = cached_view.wanted().len(),
                        "etcd holds no valid backend under the prefix: serving the cached \
                         backends (fail static); the watch then applies the empty prefix as \
                         at runtime, under the removal cap, never removing the last backend"
                    );
                    views.push((i, cached_view, true));
                } else {
                    views.push((i, view, false));
                }
            }
        }
        Err(e) if etcd::is_rejection(&e) => {
            // Not an outage: etcd answered and said no. Wrong credentials
            // never heal by themselves, so starting from the cache would
            // only hide them behind an ever staler pool.
            return Err(e.context(
                "etcd rejected the balancer (check --etcd-user/--etcd-password and the user's \
                 read permission on the prefix); not starting from the cache",
            ));
        }
        Err(e) => {
            if cached.vips.is_empty() {
                return Err(e.context("etcd unreachable at startup and no cached backends"));
            }
            warn!("etcd unreachable at startup, serving the cached backends: {e:#}");
            for &i in &discovered {
                let v = &config.vips[i];
                let view = match cached_view(&cached, v, snat, &status)? {
                    Some(view) => view,
                    None => {
                        PrefixView::new(v.etcd_prefix.as_deref().unwrap_or_default(), v.vip, snat)
                    }
                };
                views.push((i, view, true));
            }
        }
    }
    for (i, view, _) in &views {
        let v = &mut config.vips[*i];
        let wanted = view.wanted();
        if wanted.is_empty() {
            anyhow::bail!(
                "VIP {}: no valid backend under etcd prefix {} (and none cached)",
                v.vip,
                view.prefix
            );
        }
        v.backends = wanted.iter().map(Entry::backend).collect();
        cache.vips.insert(
            v.vip.to_string(),
            CachedVip {
                prefix: view.prefix.clone(),
                revision: view.revision,
                backends: wanted,
                keys: view.keys().clone(),
            },
        );
        info!(vip = %v.vip, prefix = %view.prefix, revision = view.revision, backends = v.backends.len(), "discovered backends");
    }
    for (s, (_, view, _)) in status.vips.iter().zip(&views) {
        s.revision.store(view.revision, Ordering::Relaxed);
    }
    if let Err(e) = cache.store(&cache_path) {
        warn!("cannot write the discovery cache: {e:#}");
    }
    status.publish();
    Ok(Some(Watcher {
        settings,
        views,
        cache_path,
        cache: Arc::new(Mutex::new(cache)),
        vip_addrs: config.vips.iter().map(|v| v.vip).collect(),
        status,
    }))
}

/// VIP `v`'s backends as the cache has them for its prefix (`None`: the
/// cache has none for it), with what the rules now refuse of them logged
/// in `status`.
fn cached_view(
    cached: &Cache,
    v: &crate::settings::config::VipConfig,
    snat: &[IpAddr],
    status: &DiscoveryStatus,
) -> anyhow::Result<Option<PrefixView>> {
    let prefix = v.etcd_prefix.clone().unwrap_or_default();
    let Some(c) = cached
        .vips
        .get(&v.vip.to_string())
        .filter(|c| c.prefix == prefix)
    else {
        return Ok(None);
    };
    if c.keys.is_empty() {
        // A cache from before keys were kept: its backends under keys of
        // their own.
        let mut view = PrefixView::new(&prefix, v.vip, snat);
        view.revision = c.revision;
        for e in &c.backends {
            let value = serde_json::to_vec(e)?;
            let key = format!("{prefix}cache/{}", e.addr);
            if let Err(s) = view.put(key.as_bytes(), &value) {
                log_skipped(status, &[s]);
            }
        }
        return Ok(Some(view));
    }
    let (view, skipped) = PrefixView::cached(&prefix, v.vip, snat, c.revision, &c.keys);
    // Cached values the rules now refuse (a backend at a SNAT address
    // given since, say): said, as a bad etcd value is.
    log_skipped(status, &skipped);
    Ok(Some(view))
}

/// Reads every discovered VIP's prefix at one revision. A key whose value
/// is bad keeps its value in `cached`, the last run's keys, if it has one
/// there for the same prefix.
async fn read_all(
    settings: &EtcdSettings,
    config: &Config,
    snat: &[IpAddr],
    discovered: &[usize],
    cached: &Cache,
) -> anyhow::Result<Vec<(PrefixView, Vec<Skipped>)>> {
    let mut client = etcd::connect(settings).await?;
    let mut revision = 0;
    let mut out = Vec::new();
    for &i in discovered {
        let v = &config.vips[i];
        let prefix = v.etcd_prefix.as_deref().unwrap_or_default();
        let last = cached
            .vips
            .get(&v.vip.to_string())
            .filter(|c| c.prefix == prefix)
            .map_or_else(
                || PrefixView::new(prefix, v.vip, snat),
                // What the rules now refuse of the cache is only a last
                // good value: etcd's own value for the key is read next.
                |c| PrefixView::cached(prefix, v.vip, snat, c.revision, &c.keys).0,
            );
        let read = read_prefix(&mut client, &last, revision).await?;
        revision = read.0.revision;
        out.push(read);
    }
    Ok(out)
}

impl Watcher {
    /// One task per discovered VIP, sending its updates to `updates`:
    /// each with its VIP and prefix, so a reload that drops the VIP ends
    /// it ([`crate::discover::state::DiscoveryState::end_watches`]).
    pub fn spawn(self, updates: mpsc::Sender<Update>) -> Vec<(VipAddr, String, JoinHandle<()>)> {
        let Watcher {
            settings,
            views,
            cache_path,
            cache,
            vip_addrs,
            status,
        } = self;
        views
            .into_iter()
            .enumerate()
            .map(|(n, (vip, view, from_cache))| {
                let task = VipWatch {
                    settings: settings.clone(),
                    vip: vip_addrs[vip],
                    name: vip_addrs[vip].to_string(),
                    slot: n,
                    sent: view.wanted().iter().map(|e| e.addr).collect(),
                    probe: neighbours::probe,
                    view,
                    resync: from_cache,
                    cache_path: cache_path.clone(),
                    cache: cache.clone(),
                    status: status.clone(),
                    updates: updates.clone(),
                };
                let prefix = task.view.prefix.clone();
                (task.vip, prefix, tokio::spawn(task.run()))
            })
            .collect()
    }
}

struct VipWatch {
    settings: EtcdSettings,
    vip: VipAddr,
    name: String,
    /// Index in `status.vips`.
    slot: usize,
    view: PrefixView,
    /// Addresses in the last update sent (new ones are probed first).
    sent: HashSet<SocketAddr>,
    /// How a new backend's next hop is probed: `neighbours::probe` (tests:
    /// not at all, so their backends send nothing to the network).
    probe: fn(IpAddr),
    /// Read the whole prefix again before watching (after a compaction,
    /// or when the view came from the cache).
    resync: bool,
    cache_path: PathBuf,
    cache: Arc<Mutex<Cache>>,
    status: Arc<DiscoveryStatus>,
    updates: mpsc::Sender<Update>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Ended {
    /// The stream broke: reconnect and resume.
    Broken(String),
    /// The revision was compacted: read again.
    Compacted(i64),
    /// etcd's store is at this revision, below the view's: its data was
    /// wiped or restored from a backup. A watch from the view's revision
    /// would wait, silent, for revisions the store reaches only with other
    /// writes: read again.
    Rewound(i64),
    /// The daemon is gone.
    Closed,
}

fn stream_ended() -> Ended {
    Ended::Broken("the watch stream ended".into())
}

/// Whether `message` ends the watch of a view at `view_revision`, and how.
fn ending(message: &Message, view_revision: i64) -> Option<Ended> {
    if message.compact_revision > 0 {
        return Some(Ended::Compacted(message.compact_revision));
    }
    if message.canceled {
        let reason = format!("watch canceled: {}", message.cancel_reason);
        return Some(Ended::Broken(reason));
    }
    // A new watch's first answer carries the store's current revision.
    if let Some(revision) = message
        .revision
        .filter(|&r| message.created && r < view_revision)
    {
        return Some(Ended::Rewound(revision));
    }
    None
}

/// What the watch reads of one etcd watch response. Its own type, so that
/// a test can feed the watch loop (etcd_client's responses cannot be made
/// outside that crate).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Message {
    /// The store's revision when etcd sent it (the header's).
    revision: Option<i64>,
    created: bool,
    canceled: bool,
    cancel_reason: String,
    compact_revision: i64,
    events: Vec<KeyEvent>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct KeyEvent {
    key: Vec<u8>,
    /// The value put; `None` for a delete (or an expired lease).
    value: Option<Vec<u8>>,
    mod_revision: i64,
}

impl From<&etcd_client::WatchResponse> for Message {
    fn from(response: &etcd_client::WatchResponse) -> Self {
        let events = response
            .events()
            .iter()
            .filter_map(|event| {
                let kv = event.kv()?;
                let value = match event.event_type() {
                    EventType::Put => Some(kv.value().to_vec()),
                    EventType::Delete => None,
                };
                Some(KeyEvent {
                    key: kv.key().to_vec(),
                    value,
                    mod_revision: kv.mod_revision(),
                })
            })
            .collect();
        Self {
            revision: response.header().map(|h| h.revision()),
            created: response.created(),
            canceled: response.canceled(),
            cancel_reason: response.cancel_reason().to_string(),
            compact_revision: response.compact_revision(),
            events,
        }
    }
}

/// Where the watch loop reads its messages: etcd's stream, or a test's.
trait Messages {
    /// The next message; `Ok(None)` once the stream ended.
    async fn next_message(&mut self) -> Result<Option<Message>, String>;
}

impl Messages for etcd_client::WatchStream {
    async fn next_message(&mut self) -> Result<Option<Message>, String> {
        match self.message().await {
            Ok(response) => Ok(response.as_ref().map(Message::from)),
            Err(e) => Err(e.to_string()),
        }
    }
}

impl VipWatch {
    fn set_connected(&self, up: bool) {
        let was = self.status.vips[self.slot]
            .connected
            .swap(up, Ordering::Relaxed);
        if was != up {
            self.status.publish();
        }
    }

    async fn run(mut self) {
        let mut backoff = BACKOFF_FIRST;
        loop {
            let ended = match self.connect_and_watch().await {
                Ok(ended) => ended,
                Err(e) => Ended::Broken(format!("{e:#}")),
            };
            self.set_connected(false);
            match ended {
                Ended::Closed => return,
                Ended::Compacted(at) => {
                    warn!(vip = %self.name, compacted = at, revision = self.view.revision, "discovery: revision compacted, reading the prefix again");
                    self.resync = true;
                    backoff = BACKOFF_FIRST;
                    continue;
                }
                Ended::Rewound(at) => {
                    warn!(vip = %self.name, store = at, revision = self.view.revision, retry_in = ?backoff, "discovery: etcd's revision went back (its data wiped or restored), reading the prefix again");
                    self.resync = true;
                }
                Ended::Broken(why) => {
                    warn!(vip = %self.name, revision = self.view.revision, retry_in = ?backoff, "discovery: etcd watch lost, keeping the last known backends: {why}");
                }
            }
            sleep(backoff).await;
            backoff = (backoff * 2).min(BACKOFF_LAST);
        }
    }

    async fn connect_and_watch(&mut self) -> anyhow::Result<Ended> {
        let mut client = etcd::connect(&self.settings).await?;
        if self.resync {
            let (view, skipped) = read_prefix(&mut client, &self.view, 0).await?;
            log_skipped(&self.status, &skipped);
            self.status.resyncs.fetch_add(1, Ordering::Relaxed);
            self.view = view;
            self.resync = false;
            if !self.send().await {
                return Ok(Ended::Closed);
            }
        }
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(self.view.revision + 1)
            .with_progress_notify();
        let mut stream = client
            .watch(self.view.prefix.as_str(), Some(options))
            .await
            .context("starting the watch")?;
        self.set_connected(true);
        info!(vip = %self.name, from = self.view.revision + 1, "discovery: watching");
        Ok(self.follow(&mut stream).await)
    }

    /// Applies the stream's messages in batches, reporting the wanted set
    /// after each batch that changed the view, until the stream ends; what
    /// ended it. A batch cut short by the end is reported too: its events
    /// advanced the view's revision, which the next watch starts after.
    async fn follow(&mut self, stream: &mut impl Messages) -> Ended {
        loop {
            let first = match stream.next_message().await {
                Ok(Some(m)) => m,
                Ok(None) => return stream_ended(),
                Err(e) => return Ended::Broken(e),
            };
            let (changed, ended) = self.batch(first, stream).await;
            if changed && !self.send().await {
                return Ended::Closed;
            }
            if let Some(ended) = ended {
                return ended;
            }
        }
    }

    /// Applies `first` and the messages that follow it within the batch
    /// window: whether the view changed, and what ended the stream if it
    /// ended meanwhile.
    async fn batch(&mut self, first: Message, stream: &mut impl Messages) -> (bool, Option<Ended>) {
        let mut changed = false;
        let mut next = Some(first);
        let started = tokio::time::Instant::now();
        while let Some(message) = next.take() {
            if let Some(ended) = ending(&message, self.view.revision) {
                return (changed, Some(ended));
            }
            changed |= self.apply(&message);
            if started.elapsed() < BATCH_MAX
                && let Ok(more) = tokio::time::timeout(BATCH_QUIET, stream.next_message()).await
            {
                match more {
                    Ok(Some(m)) => next = Some(m),
                    Ok(None) => return (changed, Some(stream_ended())),
                    Err(e) => return (changed, Some(Ended::Broken(e))),
                }
            }
        }
        (changed, None)
    }

    /// Applies one message's events; true if any changed the view. One
    /// that changed nothing (a progress notification, only skipped values,
    /// deletes of keys that named no backend) is seen up to its revision,
    /// but sends no update, counts none applied and writes no cache.
    fn apply(&mut self, message: &Message) -> bool {
        if message.events.is_empty() && message.created {
            return false;
        }
        let mut changed = false;
        for event in &message.events {
            self.view.revision = self.view.revision.max(event.mod_revision);
            match &event.value {
                Some(value) => match self.view.put(&event.key, value) {
                    Ok(()) => changed = true,
                    Err(s) => log_skipped(&self.status, &[s]),
                },
                None => changed |= self.view.delete(&event.key),
            }
        }
        // A progress notification: everything up to its revision is seen.
        if message.events.is_empty()
            && let Some(revision) = message.revision
        {
            self.view.revision = self.view.revision.max(revision);
        }
        if !changed {
            self.status.vips[self.slot]
                .revision
                .store(self.view.revision, Ordering::Relaxed);
        }
        changed
    }

    /// Probes new backends' next hops, then reports the whole wanted set
    /// and persists it. False if the daemon is gone.
    async fn send(&mut self) -> bool {
        let wanted = self.view.wanted();
        let fresh: Vec<SocketAddr> = wanted
            .iter()
            .map(|e| e.addr)
            .filter(|a| !self.sent.contains(a))
            .collect();
        if !fresh.is_empty() {
            for a in &fresh {
                (self.probe)(a.ip());
            }
            sleep(STARTUP_RESOLVE_WAIT).await;
        }
        self.sent = wanted.iter().map(|e| e.addr).collect();
        self.status.vips[self.slot]
            .revision
            .store(self.view.revision, Ordering::Relaxed);
        self.status.updates_applied.fetch_add(1, Ordering::Relaxed);
        self.status.touched();
        // An empty set is never cached: a restart serves the last real one.
        // Written (and fsynced) on a blocking thread, never on the event
        // loop, which a slow disk would otherwise hold (score ticks, ring
        // reads, control commands); awaited, so this VIP's writes keep
        // their order, and the lock keeps two VIPs' writes apart.
        if !wanted.is_empty() {
            let entry = CachedVip {
                prefix: self.view.prefix.clone(),
                revision: self.view.revision,
                backends: wanted.clone(),
                keys: self.view.keys().clone(),
            };
            let (cache, path, name) = (
                Arc::clone(&self.cache),
                self.cache_path.clone(),
                self.name.clone(),
            );
            let stored = tokio::task::spawn_blocking(move || {
                let mut cache = cache.lock().unwrap_or_else(|p| p.into_inner());
                cache.vips.insert(name, entry);
                cache.store(&path)
            })
            .await;
            match stored {
                Ok(Ok(())) => {}
                Ok(Err(e)) => warn!("cannot write the discovery cache: {e:#}"),
                Err(e) => warn!("cannot write the discovery cache: {e}"),
            }
        }
        self.status.publish();
        let update = Update {
            vip: self.vip,
            prefix: self.view.prefix.clone(),
            revision: self.view.revision,
            wanted,
        };
        self.updates.send(update).await.is_ok()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use super::*;

    const PREFIX: &str = "/lb/test/";

    /// Messages a test lists; the stream ends after the last.
    struct Script(VecDeque<Result<Message, String>>);

    impl Messages for Script {
        async fn next_message(&mut self) -> Result<Option<Message>, String> {
            self.0.pop_front().transpose()
        }
    }

    fn value(addr: &str) -> Vec<u8> {
        format!(r#"{{"addr":"{addr}"}}"#).into_bytes()
    }

    fn put(key: &str, addr: &str, revision: i64) -> Message {
        Message {
            revision: Some(revision),
            events: vec![KeyEvent {
                key: format!("{PREFIX}{key}").into_bytes(),
                value: Some(value(addr)),
                mod_revision: revision,
            }],
            ..Message::default()
        }
    }

    /// A watch task of VIP 10.0.0.100:80 whose view (and last update) has
    /// backend 10.0.0.21:80 at revision 10, reporting to the receiver. It
    /// probes no new backend's next hop (nothing goes to the network).
    fn watch(name: &str) -> (VipWatch, mpsc::Receiver<Update>) {
        let vip: VipAddr = "10.0.0.100:80".parse().unwrap();
        let (view, skipped) = PrefixView::snapshot(
            PREFIX,
            vip,
            &[],
            10,
            [(b"/lb/test/a".to_vec(), value("10.0.0.21:80"))],
        );
        assert!(skipped.is_empty());
        let dir = std::env::temp_dir().join(format!("lb-watch-{name}-{}", std::process::id()));
        let (tx, rx) = mpsc::channel(8);
        let task = VipWatch {
            settings: EtcdSettings {
                endpoints: Vec::new(),
                ca: None,
                identity: None,
                user: None,
            },
            vip,
            name: vip.to_string(),
            slot: 0,
            sent: view.wanted().iter().map(|e| e.addr).collect(),
            probe: |_| {},
            view,
            resync: false,
            cache_path: cache::path(&dir, "test"),
            cache: Arc::default(),
            status: Arc::new(DiscoveryStatus {
                vips: vec![VipStatus::default()],
                ..DiscoveryStatus::default()
            }),
            updates: tx,
        };
        (task, rx)
    }

    fn addrs(update: &Update) -> Vec<String> {
        update.wanted.iter().map(|e| e.addr.to_string()).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn a_change_is_reported_when_the_stream_breaks_within_its_batch() {
        let (mut task, mut rx) = watch("broken");
        let mut stream = Script(VecDeque::from([
            Ok(put("x", "10.0.0.22:80", 11)),
            Err("connection reset".to_string()),
        ]));
        let ended = task.follow(&mut stream).await;
        assert_eq!(ended, Ended::Broken("connection reset".into()));
        // The reconnect resumes at revision 12: revision 11 must be out.
        assert_eq!(task.view.revision, 11);
        let update = rx.try_recv().expect("the change before the break is sent");
        assert_eq!(update.revision, 11);
        assert_eq!(addrs(&update), ["10.0.0.21:80", "10.0.0.22:80"]);
        let _ = std::fs::remove_dir_all(task.cache_path.parent().unwrap());
    }

    #[tokio::test(start_paused = true)]
    async fn a_change_is_reported_when_the_watch_is_canceled_or_ends_within_its_batch() {
        let (mut task, mut rx) = watch("canceled");
        let canceled = Message {
            canceled: true,
            cancel_reason: "etcdserver: no leader".into(),
            ..Message::default()
        };
        let mut stream = Script(VecDeque::from([
            Ok(put("x", "10.0.0.22:80", 11)),
            Ok(canceled),
        ]));
        let ended = task.follow(&mut stream).await;
        assert_eq!(
            ended,
            Ended::Broken("watch canceled: etcdserver: no leader".into())
        );
        assert_eq!(
            addrs(&rx.try_recv().unwrap()),
            ["10.0.0.21:80", "10.0.0.22:80"]
        );
        let mut stream = Script(VecDeque::from([Ok(put("y", "10.0.0.23:80", 12))]));
        assert_eq!(task.follow(&mut stream).await, stream_ended());
        assert_eq!(rx.try_recv().unwrap().revision, 12);
        assert!(rx.try_recv().is_err(), "one update per batch");
        let _ = std::fs::remove_dir_all(task.cache_path.parent().unwrap());
    }

    fn created(revision: i64) -> Message {
        Message {
            revision: Some(revision),
            created: true,
            ..Message::default()
        }
    }

    #[test]
    fn a_new_watch_on_a_store_behind_the_view_reads_the_prefix_again() {
        assert_eq!(ending(&created(5), 10), Some(Ended::Rewound(5)));
        assert_eq!(ending(&created(10), 10), None, "nothing new since");
        assert_eq!(ending(&created(12), 10), None);
        // Only the creation says where the store is: a progress
        // notification behind the view (a lagging member) is no rewind.
        let progress = Message {
            revision: Some(5),
            ..Message::default()
        };
        assert_eq!(ending(&progress, 10), None);
        let compacted = Message {
            compact_revision: 7,
            ..created(5)
        };
        assert_eq!(ending(&compacted, 10), Some(Ended::Compacted(7)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_rewound_store_ends_the_watch_before_any_event() {
        let (mut task, mut rx) = watch("rewound");
        let mut stream = Script(VecDeque::from([
            Ok(created(3)),
            Ok(put("x", "10.0.0.22:80", 4)),
        ]));
        assert_eq!(task.follow(&mut stream).await, Ended::Rewound(3));
        assert_eq!(task.view.revision, 10);
        assert!(rx.try_recv().is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn events_close_together_are_one_update() {
        let (mut task, mut rx) = watch("quiet");
        let mut stream = Script(VecDeque::from([
            Ok(created(10)),
            Ok(put("x", "10.0.0.22:80", 11)),
            Ok(put("y", "10.0.0.23:80", 12)),
        ]));
        assert_eq!(task.follow(&mut stream).await, stream_ended());
        let update = rx.try_recv().unwrap();
        assert_eq!((update.revision, update.wanted.len()), (12, 3));
        assert!(rx.try_recv().is_err());
        let _ = std::fs::remove_dir_all(task.cache_path.parent().unwrap());
    }

    /// Writes that change no backend (a bad value, a delete of a key that
    /// named none) send no update and count none applied; the revision
    /// they reach is seen all the same.
    #[tokio::test(start_paused = true)]
    async fn writes_that_change_no_backend_send_no_update() {
        let (mut task, mut rx) = watch("unchanged");
        let bad = Message {
            revision: Some(11),
            events: vec![KeyEvent {
                key: format!("{PREFIX}x").into_bytes(),
                value: Some(br#"{"addr":"10.0.0.22:80","weight":0}"#.to_vec()),
                mod_revision: 11,
            }],
            ..Message::default()
        };
        let gone = Message {
            revision: Some(12),
            events: vec![KeyEvent {
                key: format!("{PREFIX}never-there").into_bytes(),
                value: None,
                mod_revision: 12,
            }],
            ..Message::default()
        };
        let mut stream = Script(VecDeque::from([Ok(bad), Ok(gone)]));
        assert_eq!(task.follow(&mut stream).await, stream_ended());
        assert!(rx.try_recv().is_err(), "an update that changed nothing");
        assert_eq!(task.status.updates_applied.load(Ordering::Relaxed), 0);
        assert_eq!(task.status.updates_invalid.load(Ordering::Relaxed), 1);
        assert_eq!(task.view.revision, 12);
        assert_eq!(task.status.vips[0].revision.load(Ordering::Relaxed), 12);
        // A real change is sent, at its revision.
        let mut stream = Script(VecDeque::from([Ok(put("y", "10.0.0.23:80", 13))]));
        assert_eq!(task.follow(&mut stream).await, stream_ended());
        assert_eq!(rx.try_recv().unwrap().revision, 13);
        assert_eq!(task.status.updates_applied.load(Ordering::Relaxed), 1);
        let _ = std::fs::remove_dir_all(task.cache_path.parent().unwrap());
    }

    /// Every VIP's watch task publishes the status file, on worker
    /// threads of their own: a reader must only ever find a whole file
    /// (`lb-user status` parses it), whichever writers overlap.
    #[test]
    fn writers_at_once_never_leave_a_torn_status_file() {
        let dir = std::env::temp_dir().join(format!("lb-watch-publish-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("x.discovery.json");
        let vips = (0..64)
            .map(|i| VipStatus {
                vip: i,
                name: format!("10.0.{}.{}:80/tcp", i / 200, i % 200 + 1),
                prefix: format!("/lb/some-longer-service-name-{i}/"),
                ..VipStatus::default()
            })
            .collect();
        let status = Arc::new(DiscoveryStatus {
            vips,
            file: Some(path.clone()),
            ..DiscoveryStatus::default()
        });
        status.publish();
        let done = Arc::new(AtomicBool::new(false));
        let writers: Vec<_> = (0..4)
            .map(|w| {
                let status = status.clone();
                std::thread::spawn(move || {
                    for round in 0..300 {
                        status.vips[w].revision.store(round, Ordering::Relaxed);
                        status.publish();
                    }
                })
            })
            .collect();
        let reader = {
            let (done, path) = (done.clone(), path.clone());
            std::thread::spawn(move || {
                let mut torn = 0;
                let mut reads = 0;
                while !done.load(Ordering::Relaxed) {
                    if let Ok(text) = std::fs::read(&path) {
                        reads += 1;
                        let file: Result<DiscoveryFile, _> = serde_json::from_slice(&text);
                        if file.map_or(true, |f| f.vips.len() != 64) {
                            torn += 1;
                        }
                    }
                }
                (torn, reads)
            })
        };
        for w in writers {
            w.join().unwrap();
        }
        done.store(true, Ordering::Relaxed);
        let (torn, reads) = reader.join().unwrap();
        let last: DiscoveryFile = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(reads > 0, "the reader never found the file");
        assert_eq!(torn, 0, "{torn} of {reads} reads found a torn file");
        // The last write of each writer is what the file ends with.
        for w in 0..4 {
            assert_eq!(last.vips[&status.vips[w].name].revision, 299);
        }
    }
}
