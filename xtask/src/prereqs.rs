//! Installs what the build and the lab need when it is missing, saying so.
//!
//! - rust-src for the nightly toolchain (`-Z build-std=core`);
//! - bpf-linker 0.13, built from crates.io against nightly's own libLLVM 22
//!   (a folder whose `lib/libLLVM.so` points at the toolchain's library is
//!   handed to its build as `LLVM_PREFIX`);
//! - iproute2, ethtool and nftables from Debian's packages for the lab;
//! - protoc and the protobuf well-known types (protobuf-compiler,
//!   libprotobuf-dev), which the etcd-client crate's build needs;
//! - etcd (etcd-server, etcd-client) for the discovery tests, and the
//!   openssl CLI (openssl) that makes their throwaway TLS certificates;
//! - the real clients of the lab tests: ApacheBench (apache2-utils), wrk,
//!   iperf3 and curl.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context, Result, bail};

pub const BPF_TARGET: &str = "bpfel-unknown-none";
const NIGHTLY: &str = "nightly";
const BPF_LINKER_VERSION: &str = "^0.13";
const BPF_LINKER_LLVM_FEATURE: &str = "llvm-22";
/// (command that proves the tool is there, Debian package that brings it)
const LAB_TOOLS: &[(&str, &str)] = &[
    ("ip", "iproute2"),
    ("ethtool", "ethtool"),
    ("etcd", "etcd-server"),
    ("etcdctl", "etcd-client"),
    ("openssl", "openssl"),
    // A lab test drops a backend's incoming FINs with it (real_clients.rs).
    ("nft", "nftables"),
    // Real clients of the lab tests (tests/tests/real_clients.rs).
    ("ab", "apache2-utils"),
    ("wrk", "wrk"),
    ("iperf3", "iperf3"),
    ("curl", "curl"),
];
/// What etcd-client's build script runs, and the imports its protos need.
const PROTOC: &str = "protoc";
const PROTOBUF_INCLUDE: &str = "/usr/include/google/protobuf/descriptor.proto";

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

pub fn ensure_ebpf_toolchain() -> Result<()> {
    ensure_rust_src()?;
    ensure_bpf_linker()?;
    ensure_protoc()
}

/// lb-user links etcd-client, whose build compiles etcd's protos.
fn ensure_protoc() -> Result<()> {
    let mut missing = Vec::new();
    if !have(PROTOC) {
        missing.push("protobuf-compiler");
    }
    if !Path::new(PROTOBUF_INCLUDE).exists() {
        missing.push("libprotobuf-dev");
    }
    apt_install(&missing)
}

fn ensure_rust_src() -> Result<()> {
    let sysroot = nightly_sysroot()?;
    let core = sysroot.join("lib/rustlib/src/rust/library/core/Cargo.toml");
    if core.exists() {
        return Ok(());
    }
    println!(
        "xtask: installing rust-src for the {NIGHTLY} toolchain (needed by -Z build-std=core)"
    );
    let status = Command::new("rustup")
        .args(["component", "add", "rust-src", "--toolchain", NIGHTLY])
        .status()
        .context("running rustup")?;
    if !status.success() {
        bail!(
            "rustup could not install rust-src for {NIGHTLY}; on Debian, the packages rustc-web, \
             rust-web-src and llvm-22-dev are a matching set (RUSTC_BOOTSTRAP=1 allows -Z build-std)"
        );
    }
    Ok(())
}

fn nightly_sysroot() -> Result<PathBuf> {
    let out = Command::new("rustc")
        .args([&format!("+{NIGHTLY}"), "--print", "sysroot"])
        .output()
        .context("running rustc +nightly (is rustup installed?)")?;
    if !out.status.success() {
        bail!(
            "the {NIGHTLY} toolchain is missing: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

fn bpf_linker_works() -> bool {
    // rustup puts the toolchain's lib folder on the library path of what it
    // runs, which is how the linker finds libLLVM when rustc calls it.
    Command::new("rustup")
        .args(["run", NIGHTLY, "bpf-linker", "--version"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

fn ensure_bpf_linker() -> Result<()> {
    if bpf_linker_works() {
        return Ok(());
    }
    let sysroot = nightly_sysroot()?;
    let libllvm = find_libllvm(&sysroot.join("lib"))?;
    let prefix = llvm_prefix_dir()?;
    let lib = prefix.join("lib");
    fs::create_dir_all(&lib).with_context(|| format!("creating {}", lib.display()))?;
    // Both names: `libLLVM.so` for the build, the versioned soname for the
    // loader (bpf-linker's RUNPATH points here).
    for name in [
        "libLLVM.so".to_string(),
        libllvm
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned(),
    ] {
        let link = lib.join(name);
        let _ = fs::remove_file(&link);
        std::os::unix::fs::symlink(&libllvm, &link)
            .with_context(|| format!("linking {}", link.display()))?;
    }
    println!(
        "xtask: installing bpf-linker {BPF_LINKER_VERSION} from crates.io against {} (about a minute)",
        libllvm.display()
    );
    let status = Command::new("cargo")
        .args(["install", "bpf-linker", "--version", BPF_LINKER_VERSION])
        .args([
            "--no-default-features",
            "--features",
            BPF_LINKER_LLVM_FEATURE,
        ])
        .env("LLVM_PREFIX", &prefix)
        .status()
        .context("running cargo install bpf-linker")?;
    if !status.success() || !bpf_linker_works() {
        bail!("installing bpf-linker failed");
    }
    Ok(())
}

/// The nightly toolchain's own LLVM, e.g. `libLLVM.so.22.1-rust-1.97.0-nightly`.
fn find_libllvm(libdir: &Path) -> Result<PathBuf> {
    let entries = fs::read_dir(libdir).with_context(|| format!("reading {}", libdir.display()))?;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with("libLLVM.so.") && name.contains("-rust-") {
            return Ok(entry.path());
        }
    }
    bail!("no libLLVM.so.*-rust-* in {}", libdir.display())
}

/// A stable folder (bpf-linker keeps pointing at it after the install).
fn llvm_prefix_dir() -> Result<PathBuf> {
    let base = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .context("neither CARGO_HOME nor HOME is set")?;
    Ok(base.join("lb-bpf-linker-llvm"))
}

fn have(cmd: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {cmd}")])
        .stdout(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// Installs the lab's system tools from Debian's packages when missing.
pub fn ensure_lab_tools() -> Result<()> {
    let missing: Vec<&str> = LAB_TOOLS
        .iter()
        .filter(|(cmd, _)| !have(cmd))
        .map(|(_, pkg)| *pkg)
        .collect();
    apt_install(&missing)
}

pub fn apt_install(packages: &[&str]) -> Result<()> {
    if packages.is_empty() {
        return Ok(());
    }
    println!(
        "xtask: installing {} from Debian's packages",
        packages.join(", ")
    );
    let update = Command::new("apt-get")
        .args(["update", "-q"])
        .status()
        .context("running apt-get update")?;
    if !update.success() {
        bail!("apt-get update failed");
    }
    let status = Command::new("apt-get")
        .args(["install", "-y", "-q", "--no-install-recommends"])
        .args(packages)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status()
        .context("running apt-get install")?;
    if !status.success() {
        bail!("apt-get install {} failed", packages.join(" "));
    }
    Ok(())
}
