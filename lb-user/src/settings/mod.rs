//! What the balancer is asked to do: command-line flags, the TOML file,
//! the operations settings (health, ejection, slow start, metrics), their
//! defaults and validation, and the text forms they share (addresses, port
//! ranges, durations, algorithm names). Errors here are one-line
//! [`ConfigError`]s reported before the kernel is touched.
//!
//! May use: no other folder (it comes first).
//! Order: settings → kernel → ingest → estimate → pool → publish → surface → discover → daemon.

pub mod addr;
pub mod algorithm;
pub mod cli;
pub mod config;
pub mod discovery;
pub mod duration;
pub mod error;
pub mod faults;
pub mod ops;
pub mod ports;
pub mod private_file;
pub mod state;
pub mod written;
pub mod zone;

pub use error::{ConfigError, one_line};

/// The log levels `--log-level` takes (the balancer's and the register
/// sidecar's).
pub const LOG_LEVELS: [&str; 5] = ["error", "warn", "info", "debug", "trace"];
