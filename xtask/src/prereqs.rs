//! Installs what the build and the lab need when it is missing, saying so.
//!
//! - rust-src for the nightly toolchain (`-Z build-std=core`);
//! - bpf-linker 0.13, built from crates.io against nightly's own libLLVM
//!   (feature `llvm-NN` from the major of nightly's LLVM; a folder whose
//!   `lib/libLLVM.so` points at the toolchain's library is handed to its build
//!   as `LLVM_PREFIX`);
//! - iproute2, ethtool, nftables and sysctl (procps) from Debian's packages
//!   for the lab;
//! - protoc and the protobuf well-known types (protobuf-compiler,
//!   libprotobuf-dev), which the etcd-client crate's build needs;
//! - etcd (etcd-server, etcd-client) for the discovery tests, and the
//!   openssl CLI (openssl) that makes their throwaway TLS certificates;
//! - the real clients of the lab tests: ApacheBench (apache2-utils), wrk,
//!   iperf3 and curl.
//!
//! Debian's packages are installed only as root; a normal user is told which
//! packages are missing and the apt-get command that installs them.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context, Result, bail};

pub const BPF_TARGET: &str = "bpfel-unknown-none";
const NIGHTLY: &str = "nightly";
const BPF_LINKER_VERSION: &str = "^0.13";
/// The LLVM majors bpf-linker 0.13 can link (its Cargo.toml's features
/// `llvm-21`, `llvm-22` and `llvm-23`; 0.13.0 is the only 0.13 release so far).
/// The linker must use the LLVM of the nightly that calls it, so nightly's
/// major picks the feature; a major outside this list needs another bpf-linker
/// release (`BPF_LINKER_VERSION`), and a build against it would only fail late.
const BPF_LINKER_LLVM_MAJORS: &[u32] = &[21, 22, 23];
/// The line of `rustc -vV` that names the toolchain's LLVM, e.g. `LLVM version: 22.1.4`.
const RUSTC_LLVM_VERSION_PREFIX: &str = "LLVM version:";
/// (command that proves the tool is there, Debian package that brings it)
const LAB_TOOLS: &[(&str, &str)] = &[
    ("ip", "iproute2"),
    ("ethtool", "ethtool"),
    ("etcd", "etcd-server"),
    ("etcdctl", "etcd-client"),
    ("openssl", "openssl"),
    // A lab test drops a backend's incoming FINs with it (real_clients.rs).
    ("nft", "nftables"),
    // The lab sets namespaces' sysctls (lab/balancer.rs, lab/scale_out.rs).
    ("sysctl", "procps"),
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
    // protoc first: a normal user who lacks it is told so at once, not after
    // bpf-linker's build (about a minute).
    ensure_protoc()?;
    ensure_bpf_linker()
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

/// The major of nightly's LLVM, from `rustc +nightly -vV`.
fn nightly_llvm_major() -> Result<u32> {
    let out = Command::new("rustc")
        .args([&format!("+{NIGHTLY}"), "-vV"])
        .output()
        .context("running rustc +nightly -vV (is rustup installed?)")?;
    if !out.status.success() {
        bail!(
            "the {NIGHTLY} toolchain is missing: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    llvm_major(&text).with_context(|| {
        format!(
            "could not read the LLVM major of the {NIGHTLY} toolchain (no \
             `{RUSTC_LLVM_VERSION_PREFIX} N.x` line in `rustc +{NIGHTLY} -vV`):\n{}",
            text.trim()
        )
    })
}

/// The major of the `LLVM version: 22.1.4` line of `rustc -vV` output.
fn llvm_major(rustc_verbose_version: &str) -> Option<u32> {
    rustc_verbose_version
        .lines()
        .find_map(|line| line.trim().strip_prefix(RUSTC_LLVM_VERSION_PREFIX))?
        .trim()
        .split('.')
        .next()?
        .parse()
        .ok()
}

/// The bpf-linker feature that links LLVM `major`, or why there is none.
fn bpf_linker_llvm_feature(major: u32) -> Result<String> {
    if BPF_LINKER_LLVM_MAJORS.contains(&major) {
        return Ok(format!("llvm-{major}"));
    }
    let supported: Vec<String> = BPF_LINKER_LLVM_MAJORS
        .iter()
        .map(|m| m.to_string())
        .collect();
    bail!(
        "the {NIGHTLY} toolchain uses LLVM {major}, but bpf-linker {BPF_LINKER_VERSION} links only \
         LLVM {} (features llvm-NN); pin a {NIGHTLY} with one of those (rustup toolchain install \
         nightly-YYYY-MM-DD) or move BPF_LINKER_VERSION in xtask/src/prereqs.rs to a bpf-linker \
         that supports LLVM {major}",
        supported.join(", ")
    )
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
    // Before touching the prefix: an LLVM bpf-linker cannot link stops here.
    let feature = bpf_linker_llvm_feature(nightly_llvm_major()?)?;
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
        "xtask: installing bpf-linker {BPF_LINKER_VERSION} ({feature}) from crates.io against {} \
         (about a minute)",
        libllvm.display()
    );
    // `--force`: this path is reached only when the installed linker does not
    // work (or is missing). After a nightly update the installed one still
    // names the old nightly's libLLVM, and without `--force` cargo answers
    // "already installed" and rebuilds nothing, so it would never be repaired.
    let status = Command::new("cargo")
        .args(["install", "--force", "bpf-linker"])
        .args(["--version", BPF_LINKER_VERSION])
        .args(["--no-default-features", "--features", &feature])
        .env("LLVM_PREFIX", &prefix)
        .status()
        .context("running cargo install bpf-linker")?;
    if !status.success() {
        bail!("installing bpf-linker failed (cargo install: {status})");
    }
    if !bpf_linker_works() {
        bail!(
            "bpf-linker was installed but `rustup run {NIGHTLY} bpf-linker --version` still fails"
        );
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
    // A normal user's apt-get fails on its lock with nothing but "apt-get
    // update failed"; say instead what is missing and how to install it.
    if !is_root() {
        bail!("{}", apt_not_root_message(packages));
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

/// The command a normal user runs to install `packages` (what xtask runs as root).
fn apt_command(packages: &[&str]) -> String {
    format!(
        "sudo apt-get update && sudo apt-get install -y --no-install-recommends {}",
        packages.join(" ")
    )
}

/// Why a normal user's run stops when Debian packages are missing.
fn apt_not_root_message(packages: &[&str]) -> String {
    format!(
        "missing Debian packages {}, and only root can install them: run `{}` (or run xtask as root)",
        packages.join(", "),
        apt_command(packages)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `rustc +nightly -vV` as rustup's nightly prints it.
    const NIGHTLY_VV: &str = "rustc 1.97.0-nightly (e50aa6fba 2026-05-19)
binary: rustc
commit-hash: e50aa6fba4e63ab34c72bf9acfd2c307c1155d1a
commit-date: 2026-05-19
host: x86_64-unknown-linux-gnu
release: 1.97.0-nightly
LLVM version: 22.1.4
";
    /// `rustc -vV` of a stable toolchain.
    const STABLE_VV: &str = "rustc 1.95.0 (59807616e 2026-04-14)
binary: rustc
commit-hash: 59807616e1fa2540724bfbac14d7976d7e4a3860
commit-date: 2026-04-14
host: x86_64-unknown-linux-gnu
release: 1.95.0
LLVM version: 22.1.2
";

    #[test]
    fn llvm_major_reads_rustc_verbose_version() {
        assert_eq!(llvm_major(NIGHTLY_VV), Some(22));
        assert_eq!(llvm_major(STABLE_VV), Some(22));
        assert_eq!(
            llvm_major(&NIGHTLY_VV.replace("22.1.4", "23.0.0")),
            Some(23)
        );
        assert_eq!(llvm_major("LLVM version: 21"), Some(21));
    }

    #[test]
    fn llvm_major_is_none_without_a_readable_line() {
        let without: String = NIGHTLY_VV
            .lines()
            .filter(|l| !l.starts_with("LLVM"))
            .collect::<Vec<_>>()
            .join("\n");
        assert_eq!(llvm_major(&without), None);
        assert_eq!(llvm_major(""), None);
        assert_eq!(llvm_major("LLVM version: unknown"), None);
        assert_eq!(llvm_major("LLVM version: "), None);
    }

    #[test]
    fn feature_only_for_majors_bpf_linker_supports() {
        assert_eq!(bpf_linker_llvm_feature(21).unwrap(), "llvm-21");
        assert_eq!(bpf_linker_llvm_feature(22).unwrap(), "llvm-22");
        assert_eq!(bpf_linker_llvm_feature(23).unwrap(), "llvm-23");
        let err = bpf_linker_llvm_feature(24).unwrap_err().to_string();
        assert!(err.contains("LLVM 24"), "{err}");
        assert!(err.contains("21, 22, 23"), "{err}");
        assert!(bpf_linker_llvm_feature(20).is_err());
    }

    #[test]
    fn not_root_message_names_packages_and_command() {
        let msg = apt_not_root_message(&["protobuf-compiler", "libprotobuf-dev"]);
        assert!(
            msg.contains("missing Debian packages protobuf-compiler, libprotobuf-dev"),
            "{msg}"
        );
        assert!(
            msg.contains(
                "sudo apt-get update && sudo apt-get install -y --no-install-recommends \
                 protobuf-compiler libprotobuf-dev"
            ),
            "{msg}"
        );
    }
}
