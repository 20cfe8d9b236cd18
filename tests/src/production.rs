//! Everything the test kit takes from the control plane (`lb-user`), in one
//! place: the eBPF object it embeds, its list of algorithms, and its pure
//! table builders and table writer. Tests import these from here, so a move
//! inside lb-user is a change to this file only. (Map names and layouts come
//! from `lb_common`, which the kernel and the control plane share.)
pub use lb_user::{
    EBPF_OBJECT,
    algorithm::ALL as ALGORITHMS,
    tables::{SlotBackend, VipTableSet, write_tables},
};
