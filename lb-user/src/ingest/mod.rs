//! What the kernel tells the control plane: flow events from the ring
//! buffer ([`events`]) and the periodic flow-table scan that expires idle
//! flows and corrects in-flight counts ([`reconcile`]).
//!
//! May use: settings, kernel.
//! Order: settings → kernel → ingest → estimate → pool → publish → surface → discover → daemon.

pub mod events;
pub mod reconcile;
