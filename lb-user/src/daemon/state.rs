//! Keeps the runtime state file (see `settings::state`) in step with the
//! operator's changes: the event loop records each change in memory and
//! hands the new state to a writer task, which saves it on a blocking
//! thread (temporary file, fsync, rename). A failed save is counted
//! (`stage="state"`) and tried again a second later.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use tokio::{sync::watch, task::JoinHandle, time::sleep};
use tracing::{info, warn};

use super::errors::{ControlErrors, Stage};
use crate::{
    settings::{
        addr::{BackendAddr, VipAddr, Weight},
        cli::BackendCommand,
        config::Config,
        state::{Admin, Change, Entry, RuntimeState},
    },
    surface::control::Request,
};

/// Pause before a failed save is tried again.
const SAVE_RETRY: Duration = Duration::from_secs(1);

/// The configuration as read, the runtime changes laid over it, and the
/// channel to the writer.
pub struct StateKeeper {
    base: Config,
    state: RuntimeState,
    saves: watch::Sender<RuntimeState>,
    /// What the file has (see [`SavedState`]).
    saved: SavedState,
}

/// What a configuration becomes with the runtime state laid over it.
pub struct Effective {
    pub config: Config,
    /// Backends the state keeps drained.
    pub drains: Vec<(VipAddr, SocketAddr)>,
}

impl StateKeeper {
    /// Lays `state` over `base`; the keeper, the effective configuration,
    /// and the receiver of the states to save.
    pub fn new(
        base: &Config,
        state: RuntimeState,
    ) -> (Self, Effective, watch::Receiver<RuntimeState>) {
        let (saves, rx) = watch::channel(state.clone());
        let mut keeper = Self {
            base: base.clone(),
            saved: Arc::new(Mutex::new(SavedFile {
                state: state.clone(),
                stopped: false,
            })),
            state,
            saves,
        };
        let effective = keeper.lay_over(base);
        (keeper, effective, rx)
    }

    fn lay_over(&mut self, base: &Config) -> Effective {
        let before = self.state.clone();
        let mut config = base.clone();
        let (drains, notes) = self.state.overlay(&mut config);
        for note in notes {
            warn!("runtime state: {note}");
        }
        if !self.state.backends.is_empty() {
            info!(
                changes = self.state.backends.len(),
                drained = drains.len(),
                "runtime changes laid over the configuration"
            );
        }
        if self.state != before {
            self.saves.send_replace(self.state.clone());
        }
        Effective { config, drains }
    }

    /// The backends of discovered VIPs whose weight an operator set
    /// (`backend weight`, kept in the state file): that weight overrides
    /// etcd's until `undrain` (README, "Operator overrides win"), across
    /// restarts as well.
    pub fn discovered_weight_overrides(&self) -> Vec<(VipAddr, SocketAddr)> {
        self.kept()
            .filter(|(_, _, e)| e.weight.is_some() && e.admin != Admin::Removed)
            .filter(|(vip, _, _)| {
                self.base
                    .vips
                    .iter()
                    .any(|v| v.vip == *vip && v.etcd_prefix.is_some())
            })
            .map(|(vip, addr, _)| (vip, addr))
            .collect()
    }

    /// Whether the configuration as it runs discovers VIP `vip` from etcd
    /// prefix `prefix`: the file as last read gives it that prefix (a
    /// reload keeps a running VIP's prefix, `config::keep_discovery`), and
    /// no VIP added at runtime took its address. The reload that drops a
    /// VIP ends its watch, but an update the watch sent just before may
    /// still be queued, and a VIP removed at runtime keeps its watch, so
    /// an update can come for an address the file (or `vip add`) has
    /// since given to a static VIP: it is not that VIP's.
    pub fn discovers(&self, vip: &VipAddr, prefix: &str) -> bool {
        let added_at_runtime = self
            .state
            .vips
            .iter()
            .any(|e| e.added.is_some() && e.vip.parse::<VipAddr>().is_ok_and(|v| v == *vip));
        !added_at_runtime
            && self
                .base
                .vips
                .iter()
                .any(|v| v.vip == *vip && v.etcd_prefix.as_deref() == Some(prefix))
    }

    /// The state's backend entries, with their VIP and address read
    /// (`load` dropped the entries whose addresses do not read).
    fn kept(&self) -> impl Iterator<Item = (VipAddr, SocketAddr, &Entry)> {
        self.state
            .backends
            .iter()
            .filter_map(|e| Some((e.vip.parse().ok()?, e.backend.parse().ok()?, e)))
    }

    /// What the state keeps for `backend` of `vip`: drained or not, and a
    /// weight set at runtime (`None`: nothing kept). For a discovered
    /// member that etcd adds (again), so an operator's drain and weight
    /// hold as they would after a restart.
    pub fn kept_for(&self, vip: &VipAddr, backend: SocketAddr) -> Option<(bool, Option<u32>)> {
        self.kept()
            .find(|(v, a, e)| v == vip && *a == backend && e.admin != Admin::Removed)
            .map(|(_, _, e)| (e.admin == Admin::Draining, e.weight))
    }

    /// The backends the state keeps drained (`(vip, backend)`), as they
    /// stand in the state, before a reload lays it over the new file.
    pub fn kept_drains(&self) -> Vec<(VipAddr, SocketAddr)> {
        self.kept()
            .filter(|(_, _, e)| e.admin == Admin::Draining)
            .map(|(vip, addr, _)| (vip, addr))
            .collect()
    }

    /// The configuration as last read (without the runtime changes).
    pub fn base(&self) -> &Config {
        &self.base
    }

    /// A reloaded configuration (SIGHUP) with the changes that still hold.
    pub fn reload(&mut self, base: &Config) -> Effective {
        self.base = base.clone();
        self.lay_over(base)
    }

    /// The record of what the file has, for [`spawn_writer`].
    pub fn saved(&self) -> SavedState {
        self.saved.clone()
    }

    /// At a stop, after the writer task was stopped: writes the latest
    /// state to `path` if the file does not have it yet (the writer was
    /// between tries after a failed save, or the stop came right after a
    /// command). An operator's change is then lost only if this write
    /// fails too, which is logged as an error.
    pub fn save_unsaved(&self, path: &Path) {
        let mut last = self.saved.lock().unwrap_or_else(PoisonError::into_inner);
        last.stopped = true;
        if last.state == self.state {
            return;
        }
        match self.state.save(path) {
            Ok(()) => {
                last.state = self.state.clone();
                info!(file = %path.display(), "saved the latest runtime changes at the stop");
            }
            Err(e) => tracing::error!(
                file = %path.display(),
                "the latest runtime changes could not be saved at the stop: the next start \
                 will not have them: {e}"
            ),
        }
    }

    /// Records VIP `v` added at runtime and hands the state to the writer.
    pub fn record_vip_added(&mut self, v: &crate::settings::config::VipConfig) {
        self.state.record_vip_added(&self.base, v);
        self.saves.send_replace(self.state.clone());
    }

    /// Records VIP `vip` removed at runtime and hands the state to the writer.
    pub fn record_vip_removed(&mut self, vip: &VipAddr) {
        self.state.record_vip_removed(&self.base, vip);
        self.saves.send_replace(self.state.clone());
    }

    /// Records an applied operator command and hands the state to the writer.
    pub fn record(&mut self, request: &Request) {
        let (Ok(vip), Ok(backend)) = (
            request.vip.parse::<VipAddr>(),
            request.backend.parse::<BackendAddr>(),
        ) else {
            return;
        };
        let weight = request.weight.and_then(|w| Weight::new(u64::from(w)).ok());
        let Some(command) = request.command.backend() else {
            return;
        };
        let change = match command {
            BackendCommand::Add => Change::Add(backend.weight, backend.zone),
            BackendCommand::Remove => Change::Remove,
            BackendCommand::Drain => Change::Drain,
            BackendCommand::Undrain => Change::Undrain,
            BackendCommand::Weight => match weight {
                Some(w) => Change::Weight(w),
                None => return,
            },
        };
        self.state.record(&self.base, &vip, backend.addr, change);
        self.saves.send_replace(self.state.clone());
    }
}

/// The state last written to the file, held while a write runs: the
/// writer task and the stop's last save ([`StateKeeper::save_unsaved`])
/// never write at once (they share one temporary file name), and the stop
/// knows whether the latest state reached the file.
pub type SavedState = Arc<Mutex<SavedFile>>;

/// What the file has, and whether the stop wrote it last.
#[derive(Debug, Default)]
pub struct SavedFile {
    state: RuntimeState,
    /// Set by the stop's save: a writer's save that was queued on a
    /// blocking thread before the stop (its task aborted, the thread not)
    /// and runs after it would write an older state over the latest.
    stopped: bool,
}

/// Saves every new state to `path`, the latest one first (states that
/// arrive while a save runs are coalesced), and records it in `saved`.
pub fn spawn_writer(
    path: PathBuf,
    mut states: watch::Receiver<RuntimeState>,
    saved: SavedState,
    errors: ControlErrors,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut pending = false;
        loop {
            if !pending && states.changed().await.is_err() {
                return;
            }
            let state = states.borrow_and_update().clone();
            let target = path.clone();
            let record = saved.clone();
            let saved = tokio::task::spawn_blocking(move || {
                let mut last = record.lock().unwrap_or_else(PoisonError::into_inner);
                if last.stopped {
                    return Ok(());
                }
                state.save(&target)?;
                last.state = state;
                Ok::<(), std::io::Error>(())
            })
            .await;
            let outcome = match saved {
                Ok(result) => result.map_err(anyhow::Error::from),
                Err(e) => Err(anyhow::anyhow!("{e}")),
            };
            pending = outcome.is_err();
            errors.check(
                Stage::State,
                outcome.map_err(|e| e.context(format!("saving {}", path.display()))),
            );
            if pending {
                sleep(SAVE_RETRY).await;
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The static VIP 10.0.0.200:80 (backend 10.0.0.41:80), etcd at
    /// 127.0.0.1:2379, and the file's `vips` (TOML).
    fn with_etcd(vips: &str) -> Config {
        Config::of(
            &[
                "--iface",
                "eth0",
                "--vip",
                "10.0.0.200:80",
                "--backend",
                "10.0.0.41:80",
            ],
            &format!("etcd_endpoints = [\"http://127.0.0.1:2379\"]\n{vips}"),
        )
    }

    /// A change the writer task had not saved when the stop came (its save
    /// failed and waits for a retry, or it was still queued) is written
    /// by the stop; one the file has is not written again.
    #[tokio::test]
    async fn the_stop_saves_a_change_the_writer_had_not() {
        let base = with_etcd("");
        let dir = std::env::temp_dir().join(format!("lb-keeper-stop-{}", std::process::id()));
        let path = crate::settings::state::path(&dir, "t");
        let (mut keeper, _, _states) = StateKeeper::new(&base, RuntimeState::default());
        // Nothing changed: nothing written.
        keeper.save_unsaved(&path);
        assert!(!path.exists());
        let vip: VipAddr = "10.0.0.200:80".parse().unwrap();
        keeper.record_vip_removed(&vip);
        keeper.save_unsaved(&path);
        let (read, _) = RuntimeState::load(&path).unwrap();
        assert_eq!(read.as_ref(), Some(&keeper.state));
        // Saved: a second stop leaves the file alone.
        std::fs::remove_file(&path).unwrap();
        keeper.save_unsaved(&path);
        let written_again = path.exists();
        assert!(!written_again);
        // A writer whose save was queued before the stop and runs after it
        // writes nothing over what the stop wrote.
        let (mut keeper, _, _states) = StateKeeper::new(&base, RuntimeState::default());
        keeper.record_vip_removed(&vip);
        keeper.save_unsaved(&path);
        let latest = std::fs::read(&path).unwrap();
        let older = RuntimeState::default();
        let (tx, rx) = watch::channel(older.clone());
        let writer = spawn_writer(path.clone(), rx, keeper.saved(), ControlErrors::default());
        tx.send_replace(older);
        tokio::time::sleep(Duration::from_millis(200)).await;
        writer.abort();
        let after = std::fs::read(&path).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(after, latest, "an older state was written over the stop's");
    }

    /// A weight an operator set on a discovered backend is an override
    /// after a restart too: the runtime seeds discovery's overrides from
    /// the state file, so etcd's next update does not put etcd's weight
    /// back while the state file still says the operator's.
    #[test]
    fn a_kept_weight_on_a_discovered_backend_is_an_override_again_after_a_restart() {
        let mut base =
            with_etcd("[[vip]]\naddress = \"10.0.0.100:80\"\netcd_prefix = \"/lb/web/\"\n");
        let web = base
            .vips
            .iter_mut()
            .find(|v| v.etcd_prefix.is_some())
            .unwrap();
        web.backends = vec![
            "10.0.0.21:80".parse().unwrap(),
            "10.0.0.22:80".parse().unwrap(),
        ];
        let request = |command, vip: &str, backend: &str, weight| Request {
            command,
            vip: vip.into(),
            backend: backend.into(),
            weight,
            backends: Vec::new(),
            algorithm: None,
            peer: None,
        };
        use crate::settings::cli::ControlCommand;
        let (mut keeper, _, _) = StateKeeper::new(&base, RuntimeState::default());
        keeper.record(&request(
            ControlCommand::Weight,
            "10.0.0.100:80",
            "10.0.0.22:80",
            Some(5),
        ));
        keeper.record(&request(
            ControlCommand::Drain,
            "10.0.0.100:80",
            "10.0.0.21:80",
            None,
        ));
        // A static VIP's weight is the file's business, not discovery's.
        keeper.record(&request(
            ControlCommand::Weight,
            "10.0.0.200:80",
            "10.0.0.41:80",
            Some(3),
        ));
        let saved = keeper.state.clone();
        // The restart: the same file, the state as saved.
        let (restarted, effective, _) = StateKeeper::new(&base, saved);
        assert_eq!(
            restarted.discovered_weight_overrides(),
            [(
                "10.0.0.100:80".parse::<VipAddr>().unwrap(),
                "10.0.0.22:80".parse::<SocketAddr>().unwrap()
            )]
        );
        let web = effective
            .config
            .vips
            .iter()
            .find(|v| v.etcd_prefix.is_some())
            .unwrap();
        assert_eq!(web.backends[1].weight.get(), 5);
    }

    /// A discovered VIP's watch runs from the start on, whatever a reload
    /// does to its VIP: once SIGHUP drops the VIP and a later one (or `vip
    /// add`) puts a static VIP at its address, the watch's updates are no
    /// longer that VIP's (`Runtime::apply_wanted` ignores them). Before,
    /// they added and removed the static VIP's backends against the file.
    #[test]
    fn a_static_vip_at_a_discovered_vips_address_is_not_discovered() {
        let file = |web: &str| {
            let mut config = with_etcd(web);
            // As `discover::watch::seed` fills it in.
            for v in config.vips.iter_mut().filter(|v| v.etcd_prefix.is_some()) {
                v.backends = vec!["10.0.0.21:80".parse().unwrap()];
            }
            config
        };
        let discovered = "[[vip]]\naddress = \"10.0.0.100:80\"\netcd_prefix = \"/lb/web/\"\n";
        let web: VipAddr = "10.0.0.100:80".parse().unwrap();
        let (mut keeper, _, _) = StateKeeper::new(&file(discovered), RuntimeState::default());
        assert!(keeper.discovers(&web, "/lb/web/"));
        assert!(!keeper.discovers(&web, "/lb/api/"), "another prefix");
        let static_vip: VipAddr = "10.0.0.200:80".parse().unwrap();
        assert!(!keeper.discovers(&static_vip, "/lb/web/"));
        // A SIGHUP as `Runtime::on_reload` applies it.
        let sighup = |keeper: &mut StateKeeper, file: &Config| {
            let (held, _) = crate::settings::config::held_reload(keeper.base(), file).unwrap();
            keeper.reload(&held);
        };
        let before = keeper.base().clone();
        sighup(&mut keeper, &file(""));
        assert!(!keeper.discovers(&web, "/lb/web/"), "removed from the file");
        sighup(
            &mut keeper,
            &file("[[vip]]\naddress = \"10.0.0.100:80\"\nbackends = [\"10.0.0.31:80\"]\n"),
        );
        assert!(keeper.base().vips.iter().any(|v| v.vip == web));
        assert!(!keeper.discovers(&web, "/lb/web/"), "static now");
        // Discovered again: set up at the start only, so not taken before
        // a restart (`config::keep_discovery`), and not the watch's.
        sighup(&mut keeper, &file(discovered));
        assert!(!keeper.discovers(&web, "/lb/web/"));
        // The same through the control socket: removed, then added back
        // static (the state file keeps both).
        let (mut keeper, _, _) = StateKeeper::new(&before, RuntimeState::default());
        keeper.record_vip_removed(&web);
        assert!(
            keeper.discovers(&web, "/lb/web/"),
            "the fleet's removal says it"
        );
        let mut added = before.vips.iter().find(|v| v.vip == web).unwrap().clone();
        added.etcd_prefix = None;
        keeper.record_vip_added(&added);
        assert!(!keeper.discovers(&web, "/lb/web/"), "added back static");
    }
}
