//! Which backends serve: the initial [`plan`] of ids a configuration stands
//! for, the [`fleet`] of VIPs and members, each backend's [`lifecycle`]
//! (admin state, health, ejection, slow start), passive [`outlier`]
//! detection and active [`health`] checks.
//!
//! May use: settings, kernel, ingest, estimate.
//! Order: settings → kernel → ingest → estimate → pool → publish → surface → discover → daemon.

pub mod fleet;
pub mod health;
pub mod lifecycle;
pub mod outlier;
pub mod plan;
pub mod zones;
