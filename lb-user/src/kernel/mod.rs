//! The kernel side as the control plane holds it: the embedded XDP object
//! and loading its program, attaching (or re-adopting) and upgrading it in
//! place, bpffs pins and the instance lock, the interface, the neighbour
//! table and the backends' shared next hops it invalidates, typed handles
//! to the pinned maps, the wire layout of addresses, the kernel's clock,
//! the kernel sweep and the reserved-ports sysctl.
//!
//! May use: settings.
//! Order: settings → kernel → ingest → estimate → pool → publish → surface → discover → daemon.

pub mod attach;
pub mod backend_hops;
pub mod batch;
pub mod bpffs;
pub mod clock;
pub mod flow_tables;
pub mod iface;
pub mod instance;
pub mod mapped;
pub mod maps;
pub mod neighbours;
pub mod object;
pub mod snat_handover;
pub mod sweep;
pub mod sysctl;
pub mod upgrade;
pub mod wire;
