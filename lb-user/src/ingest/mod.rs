//! What the kernel tells the control plane: failure events from the ring
//! buffer ([`events`]), latency aggregated in the kernel ([`latency`]) and
//! the per-second kernel sweep with its counters ([`reconcile`]).
//!
//! May use: settings, kernel.
//! Order: settings → kernel → ingest → estimate → pool → publish → surface → discover → daemon.

pub mod events;
pub mod latency;
pub mod reconcile;
