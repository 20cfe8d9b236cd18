//! From events to numbers: the latency estimators (a short-memory
//! Peak-EWMA next to a long-memory EWMA) and each backend's load
//! (in-flight, latency, effective weight) and the score the kernel's P2C
//! reads.
//!
//! May use: settings, kernel, ingest.
//! Order: settings → kernel → ingest → estimate → pool → publish → surface → discover → daemon.

pub mod backend_load;
pub mod ewma;
pub mod latency;
pub mod mean;
pub mod peak_ewma;
pub mod refute;
pub mod sample;
#[cfg(test)]
mod testing;

pub use backend_load::WEIGHT_UNITS;
