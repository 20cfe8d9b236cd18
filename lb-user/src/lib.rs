//! The control plane of the balancer, as a library: the `lb-user` binary is a
//! thin CLI over it, and the lab tests load the same embedded object.

pub mod addr;
pub mod algorithm;
pub mod backend_load;
pub mod bpffs;
pub mod cli;
pub mod clock;
pub mod config;
pub mod control;
pub mod daemon;
pub mod duration;
pub mod events;
pub mod fleet;
pub mod health;
pub mod iface;
pub mod instance;
pub mod lifecycle;
pub mod loader;
pub mod maps;
pub mod metrics;
pub mod neighbours;
pub mod ops_config;
pub mod outlier;
pub mod peak_ewma;
pub mod plan;
pub mod ports;
pub mod publish;
pub mod reconcile;
pub mod runtime;
pub mod status;
pub mod tables;
pub mod upgrade;
pub mod wire;

/// The compiled XDP object (built by `build.rs`), embedded so the one binary is
/// all a server needs.
pub static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lb-ebpf"));
