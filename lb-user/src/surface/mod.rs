//! What operators see and say: the [`control`] socket (runtime backend
//! changes), Prometheus [`metrics`] and `lb-user status` ([`status`]).
//!
//! May use: settings, kernel, ingest, estimate, pool, publish.
//! Order: settings → kernel → ingest → estimate → pool → publish → surface → discover → daemon.

pub mod control;
pub mod metrics;
pub mod status;
