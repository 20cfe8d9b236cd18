//! Control-plane errors that must not stop the balancer: each is logged
//! (at most once per [`LOG_EVERY`] per stage, with how many were left
//! unlogged), counted per stage for `lb_control_errors_total{stage}`, and
//! the work is retried by the next tick, refresh or check. Shared by the
//! event loop and the background tasks.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use tracing::warn;

/// Shortest time between two logged errors of one stage.
pub const LOG_EVERY: Duration = Duration::from_secs(5);

/// Where in the control plane an error happened (the metric's label).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Stage {
    /// Score and selection writes (the score tick).
    Tick,
    /// Reading kernel events.
    Events,
    /// Applying a reconciliation pass.
    Scan,
    /// Applying a health-check result.
    Health,
    /// A health-check task that panicked (restarted).
    HealthTask,
    /// Writing an operator command's change to the kernel.
    Command,
    /// Applying a SIGHUP reload.
    Reload,
    /// Refreshing the neighbour map.
    Neighbours,
    /// Saving the runtime state file.
    State,
    /// Applying an etcd discovery update.
    Discovery,
}

impl Stage {
    pub const ALL: [Stage; 10] = [
        Stage::Tick,
        Stage::Events,
        Stage::Scan,
        Stage::Health,
        Stage::HealthTask,
        Stage::Command,
        Stage::Reload,
        Stage::Neighbours,
        Stage::State,
        Stage::Discovery,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Stage::Tick => "tick",
            Stage::Events => "events",
            Stage::Scan => "scan",
            Stage::Health => "health",
            Stage::HealthTask => "health_task",
            Stage::Command => "command",
            Stage::Reload => "reload",
            Stage::Neighbours => "neighbours",
            Stage::State => "state",
            Stage::Discovery => "discovery",
        }
    }
}

#[derive(Debug, Default)]
struct Count {
    total: u64,
    last_logged: Option<Instant>,
    unlogged: u64,
}

/// The error counts of every stage; clones share them.
#[derive(Clone, Debug, Default)]
pub struct ControlErrors {
    counts: Arc<Mutex<BTreeMap<Stage, Count>>>,
}

impl ControlErrors {
    /// Counts an error of `stage` and logs it unless one of the same stage
    /// was logged less than [`LOG_EVERY`] ago.
    pub fn record(&self, stage: Stage, error: &anyhow::Error) {
        self.record_at(stage, error, Instant::now());
    }

    fn record_at(&self, stage: Stage, error: &anyhow::Error, now: Instant) -> bool {
        let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        let count = counts.entry(stage).or_default();
        count.total += 1;
        let due = count
            .last_logged
            .is_none_or(|at| now.duration_since(at) >= LOG_EVERY);
        if !due {
            count.unlogged += 1;
            return false;
        }
        warn!(
            stage = stage.name(),
            suppressed = count.unlogged,
            "control-plane error (retried; the data path keeps running): {error:#}"
        );
        count.last_logged = Some(now);
        count.unlogged = 0;
        true
    }

    /// Counts an error of `stage` that the caller logged itself: one that
    /// an operator's action caused and that must always say why (a
    /// SIGHUP's configuration that does not read), so never rate-limited.
    pub fn count(&self, stage: Stage) {
        let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        counts.entry(stage).or_default().total += 1;
    }

    /// Errors so far per stage, every stage listed.
    pub fn totals(&self) -> Vec<(&'static str, u64)> {
        let counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        Stage::ALL
            .iter()
            .map(|s| (s.name(), counts.get(s).map_or(0, |c| c.total)))
            .collect()
    }

    /// Runs the outcome of `stage`'s handler through [`Self::record`].
    pub fn check(&self, stage: Stage, outcome: anyhow::Result<()>) {
        if let Err(e) = outcome {
            self.record(stage, &e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_every_error_and_logs_one_per_interval_per_stage() {
        let errors = ControlErrors::default();
        let e = anyhow::anyhow!("map write failed");
        let t0 = Instant::now();
        assert!(errors.record_at(Stage::Tick, &e, t0));
        assert!(!errors.record_at(Stage::Tick, &e, t0 + Duration::from_secs(1)));
        assert!(errors.record_at(Stage::Neighbours, &e, t0 + Duration::from_secs(1)));
        assert!(errors.record_at(Stage::Tick, &e, t0 + LOG_EVERY));
        let totals = errors.totals();
        assert_eq!(totals.len(), Stage::ALL.len());
        assert!(totals.contains(&("tick", 3)));
        assert!(totals.contains(&("neighbours", 1)));
        assert!(totals.contains(&("reload", 0)));
        let shared = errors.clone();
        shared.check(Stage::Reload, Err(e));
        shared.check(Stage::Reload, Ok(()));
        assert!(errors.totals().contains(&("reload", 1)));
    }
}
