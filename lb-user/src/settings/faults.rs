//! Injected control-plane failures, for the fault tests only.
//!
//! The hidden environment variable `LB_USER_FAULTS` names failures that
//! the control plane must survive, each with how many times it happens:
//!
//! ```text
//! LB_USER_FAULTS=score-write=40,neighbours=3,health-panic=2
//! ```
//!
//! - `score-write=N`: the next N score writes fail, as a map update would;
//! - `table-write=N`: the next N writes of a VIP's selection fail;
//! - `neighbours=N`: the next N reads of the neighbour table fail;
//! - `health-panic=N`: the next N health checks panic.
//!
//! Unset (production), every [`trip`] is one atomic load that says no.
//! A malformed value stops the start with one error line, like a bad flag.

use std::sync::{
    OnceLock,
    atomic::{AtomicU64, Ordering},
};

use crate::settings::ConfigError;

/// The environment variable that injects failures.
pub const ENV: &str = "LB_USER_FAULTS";

/// A failure that can be injected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    ScoreWrite,
    TableWrite,
    Neighbours,
    HealthPanic,
}

impl Fault {
    const ALL: [Fault; 4] = [
        Fault::ScoreWrite,
        Fault::TableWrite,
        Fault::Neighbours,
        Fault::HealthPanic,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Fault::ScoreWrite => "score-write",
            Fault::TableWrite => "table-write",
            Fault::Neighbours => "neighbours",
            Fault::HealthPanic => "health-panic",
        }
    }
}

/// How many more times each fault happens, by [`Fault::ALL`] index.
type Budget = [AtomicU64; Fault::ALL.len()];

static BUDGET: OnceLock<Budget> = OnceLock::new();

/// Parses `LB_USER_FAULTS=name=N,...`.
fn parse(text: &str) -> Result<Budget, ConfigError> {
    let budget: Budget = Default::default();
    let bad = |why: String| ConfigError::Ops(format!("invalid {ENV} '{text}': {why}"));
    for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (name, count) = item
            .split_once('=')
            .ok_or_else(|| bad(format!("'{item}' is not NAME=COUNT")))?;
        let index = Fault::ALL
            .iter()
            .position(|f| f.name() == name)
            .ok_or_else(|| bad(format!("unknown fault '{name}'")))?;
        let count: u64 = count
            .parse()
            .map_err(|_| bad(format!("'{count}' is not a count")))?;
        budget[index].store(count, Ordering::Relaxed);
    }
    Ok(budget)
}

/// Reads [`ENV`] once, at start; without it nothing is injected.
pub fn init_from_env() -> Result<(), ConfigError> {
    let budget = match std::env::var(ENV) {
        Ok(text) => parse(&text)?,
        Err(_) => Budget::default(),
    };
    let _ = BUDGET.set(budget);
    Ok(())
}

/// Whether `fault` happens now (and uses up one of its occurrences).
pub fn trip(fault: Fault) -> bool {
    let Some(budget) = BUDGET.get() else {
        return false;
    };
    let index = Fault::ALL.iter().position(|f| *f == fault).unwrap_or(0);
    budget[index]
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |left| {
            left.checked_sub(1)
        })
        .is_ok()
}

/// An error for an injected `fault`, when it happens now.
pub fn check(fault: Fault) -> anyhow::Result<()> {
    if trip(fault) {
        anyhow::bail!("injected fault: {}", fault.name());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_counts_and_refuses_unknown_names() {
        let budget = parse("score-write=2, health-panic=1").unwrap();
        let left: Vec<u64> = budget.iter().map(|b| b.load(Ordering::Relaxed)).collect();
        assert_eq!(left, [2, 0, 0, 1]);
        assert!(parse("").is_ok());
        let err = parse("disk=1").unwrap_err().to_string();
        assert!(err.contains("unknown fault 'disk'"), "{err}");
        assert!(parse("score-write").is_err());
        assert!(parse("score-write=-1").is_err());
    }
}
