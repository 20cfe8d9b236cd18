//! The control plane of the balancer, as a library: the `lb-user` binary is a
//! thin CLI over it, and the lab tests load the same embedded object.

/// The compiled XDP object (built by `build.rs`), embedded so the one binary is
/// all a server needs.
pub static EBPF_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lb-ebpf"));
