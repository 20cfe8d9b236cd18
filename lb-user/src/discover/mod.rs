//! Discovery: backends (and their weights and zones) from etcd v3 keys
//! under a prefix per VIP, and the `register` sidecar that puts a
//! backend's key there under a lease.
//!
//! - [`entry`]: one key's JSON value, parsed and checked (pure);
//! - [`view`]: a prefix's keys at a revision, changed by watch events (pure);
//! - [`plan`]: the difference between the running pool and the wanted
//!   backends, with the removal cap and operator overrides (pure);
//! - [`cache`]: the last known backends per VIP, persisted atomically, so a
//!   restart while etcd is down still serves;
//! - [`etcd`]: connecting with TLS and a user;
//! - [`watch`]: snapshot at revision R, watch from R+1, reconnect with
//!   backoff, re-read on compaction; fail static;
//! - [`state`]: what the running balancer keeps between updates
//!   (overrides, zones, revisions);
//! - [`register`]: grant a lease, put the key, keep it alive, follow an
//!   HTTP check, revoke on SIGTERM.
//!
//! May use: settings, kernel (to probe a new backend's next hop before it
//! can be selected) and surface (the file `lb-user status` reads). The
//! daemon applies what the watch reports.
//! Order: settings → kernel → ingest → estimate → pool → publish → surface → discover → daemon.

pub mod cache;
pub mod entry;
pub mod etcd;
pub mod plan;
pub mod register;
pub mod state;
pub mod view;
pub mod watch;
