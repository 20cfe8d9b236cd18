//! Keeps the runtime state file (see `settings::state`) in step with the
//! operator's changes: the event loop records each change in memory and
//! hands the new state to a writer task, which saves it on a blocking
//! thread (temporary file, fsync, rename). A failed save is counted
//! (`stage="state"`) and tried again a second later.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use tokio::{sync::watch, task::JoinHandle, time::sleep};
use tracing::{info, warn};

use super::errors::{ControlErrors, Stage};
use crate::{
    settings::{
        addr::{BackendAddr, VipAddr, Weight},
        cli::BackendCommand,
        config::Config,
        state::{Change, RuntimeState},
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

    /// The configuration as last read (without the runtime changes).
    pub fn base(&self) -> &Config {
        &self.base
    }

    /// A reloaded configuration (SIGHUP) with the changes that still hold.
    pub fn reload(&mut self, base: &Config) -> Effective {
        self.base = base.clone();
        self.lay_over(base)
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

/// Saves every new state to `path`, the latest one first (states that
/// arrive while a save runs are coalesced).
pub fn spawn_writer(
    path: PathBuf,
    mut states: watch::Receiver<RuntimeState>,
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
            let saved = tokio::task::spawn_blocking(move || state.save(&target)).await;
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
