//! The control plane of the balancer, as a library: the `lb-user` binary is a
//! thin CLI over it, and the lab tests load the same embedded object.
//!
//! The folders follow the data's path, and each may use only the folders
//! before it in this list (checked by `tests/layering.rs`):
//!
//! 1. [`settings`]: flags, the config file, operations settings, defaults;
//! 2. [`kernel`]: the XDP object, its attachment and pins, typed maps, clock;
//! 3. [`ingest`]: what the kernel reports (ring-buffer events, flow-table scans);
//! 4. [`estimate`]: Peak-EWMA latency and each backend's load and score;
//! 5. [`pool`]: the backends' fleet, lifecycles, outlier detection, health checks;
//! 6. [`publish`]: the tables the kernel selects from, and the writers of them;
//! 7. [`surface`]: what operators see and say (control socket, metrics, status);
//! 8. [`discover`]: backends and weights from etcd, and the `register` sidecar;
//! 9. [`daemon`]: startup in named steps and the event loop that routes to handlers.

pub mod settings;

pub mod kernel;

pub mod ingest;

pub mod estimate;

pub mod pool;

pub mod publish;

pub mod surface;

pub mod discover;

pub mod daemon;

pub use kernel::object::EBPF_OBJECT;
