//! Builds lb-ebpf for the BPF target (nightly, `-Z build-std=core`, bpf-linker)
//! and leaves the object in OUT_DIR, where `src/ebpf.rs` embeds it. The host
//! build never compiles lb-ebpf for the host.
fn main() -> anyhow::Result<()> {
    let package = aya_build::Package {
        name: "lb-ebpf",
        root_dir: concat!(env!("CARGO_MANIFEST_DIR"), "/../lb-ebpf"),
        ..Default::default()
    };
    println!("cargo:rerun-if-changed=../lb-common/src");
    aya_build::build_ebpf([package], aya_build::Toolchain::default()).map_err(|e| {
        anyhow::anyhow!(
            "building the eBPF program failed ({e:#}); `cargo xtask build-ebpf` installs \
             rust-src and bpf-linker if they are missing"
        )
    })
}
