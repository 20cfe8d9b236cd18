//! The network-namespace lab: a reusable harness that builds a small switched
//! network out of namespaces, runs real backend servers and an open-loop load
//! generator in it, and drives the real `lb-user` binary on the balancer host.
//!
//! Everything the lab creates lives in namespaces it names uniquely per run,
//! and is removed when the [`lab::Lab`] is dropped, even when a test panics.

pub mod balance;
pub mod binaries;
pub mod capacity;
pub mod control_bench;
pub mod host_stall;
pub mod http;
pub mod lab;
pub mod loadgen;
pub mod netcounters;
pub mod probe;
pub mod production;
pub mod readme;
pub mod root;
pub mod server;
pub mod status;
pub mod tail;
pub mod trials;
pub mod xdp;

pub use binaries::Binaries;
pub use lab::{Lab, LabBuilder};
