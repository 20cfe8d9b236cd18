//! Project tasks: `cargo xtask build-ebpf | build | test | demo | bench`.
//!
//! Every task first makes sure the machine has what the eBPF build needs
//! (rust-src for nightly, bpf-linker built against nightly's own libLLVM) and,
//! for the lab, the system tools (iproute2, ethtool). It installs what is
//! missing and says what it does, so a fresh machine needs nothing by hand.
//! Debian's packages need root: a normal user is told which are missing and
//! how to install them, and the tasks that need root say so before building.

mod prereqs;

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "Build, test and demo tasks of the XDP load balancer")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Build lb-ebpf for bpfel-unknown-none (installs rust-src and bpf-linker if missing).
    BuildEbpf {
        /// Build the debug profile instead of release.
        #[arg(long)]
        debug: bool,
    },
    /// Build everything (the eBPF object is embedded in lb-user), release profile.
    Build,
    /// Run every test: unit tests, packet tests and the namespace lab (root).
    Test {
        /// Extra arguments passed to `cargo test` (after `--`).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Build a lab with one slow backend and compare P2C+EWMA with round-robin live (root).
    Demo,
    /// Benchmarks (root): `dataplane` (ns per packet through BPF_PROG_TEST_RUN),
    /// `balance` (the lab with real servers, against HAProxy, nginx and nftables)
    /// `control` (lb-user's own cost against issue 10's targets), `capacity`
    /// (new connections/s to one backend through 4 SNAT addresses, issue 9)
    /// or `tail` (where a 1 s SYN retransmit comes from, with ApacheBench).
    Bench {
        #[arg(value_enum)]
        suite: BenchSuite,
        /// Extra arguments for the benchmark binary.
        #[arg(last = true)]
        args: Vec<String>,
    },
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum BenchSuite {
    Dataplane,
    Balance,
    Control,
    Capacity,
    Tail,
}

impl BenchSuite {
    /// The binary of the `tests` crate that runs the suite.
    const fn binary(self) -> &'static str {
        match self {
            Self::Dataplane => "lb-bench-dataplane",
            Self::Balance => "lb-bench-balance",
            Self::Control => "lb-bench-control",
            Self::Capacity => "lb-bench-capacity",
            Self::Tail => "lb-bench-tail",
        }
    }
}

fn main() {
    if let Err(e) = run(Cli::parse()) {
        eprintln!("xtask: error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    let root = workspace_root();
    match cli.task {
        Task::BuildEbpf { debug } => {
            prereqs::ensure_ebpf_toolchain()?;
            let object = build_ebpf(&root, !debug)?;
            println!("xtask: eBPF object: {}", object.display());
        }
        Task::Build => {
            prereqs::ensure_ebpf_toolchain()?;
            cargo(&root, &["build", "--release"])?;
            println!(
                "xtask: built {}",
                target_dir(&root).join("release/lb-user").display()
            );
        }
        Task::Test { args } => {
            let privileged = prereqs::is_root();
            // Said first, so a normal user reads it even when the toolchain
            // step stops on a missing Debian package it cannot install.
            if !privileged {
                eprintln!(
                    "xtask: WARNING: not root: the packet and lab tests will SKIP. Run as root \
                     (sudo cargo xtask test) to run them."
                );
            }
            prereqs::ensure_ebpf_toolchain()?;
            if privileged {
                prereqs::ensure_lab_tools()?;
            }
            // Binaries the lab drives (lb-user, lb-backend, lb-loadgen) are built
            // first so the tests find them next to their own executables.
            cargo(&root, &["build", "--bins"])?;
            // The eBPF object also loads in a debug build (verifier budget):
            // tests/tests/verifier.rs loads it from this path.
            let debug_object = build_ebpf(&root, false)?;
            let mut test = vec!["test".to_string(), "--no-fail-fast".to_string()];
            test.push("--".into());
            // The lab tests build namespaces and measure latency: one at a time.
            test.push("--test-threads=1".into());
            test.extend(args);
            let test: Vec<&str> = test.iter().map(String::as_str).collect();
            cargo_env(
                &root,
                &test,
                privileged,
                &[(DEBUG_OBJECT_ENV, &debug_object)],
            )?;
        }
        Task::Demo => run_lab_binary(&root, "lb-demo", &[])?,
        Task::Bench { suite, args } => run_lab_binary(&root, suite.binary(), &args)?,
    }
    Ok(())
}

/// Builds the release binaries and runs one of the lab's programs as root.
fn run_lab_binary(root: &Path, name: &str, args: &[String]) -> Result<()> {
    // Before the toolchain: a normal user would otherwise wait for bpf-linker's
    // build (about a minute) only to be refused.
    if !prereqs::is_root() {
        bail!("{name} builds network namespaces and attaches XDP: run it as root");
    }
    prereqs::ensure_ebpf_toolchain()?;
    prereqs::ensure_lab_tools()?;
    cargo(root, &["build", "--release", "--bins"])?;
    let release = target_dir(root).join("release");
    let status = Command::new(release.join(name))
        .args(args)
        .env("LB_USER_BIN", release.join("lb-user"))
        .status()
        .with_context(|| format!("running {name}"))?;
    if !status.success() {
        bail!("{name} failed ({status})");
    }
    Ok(())
}

/// Builds lb-ebpf with the flags aya-build uses, into `target/bpfel-unknown-none`.
fn build_ebpf(root: &Path, release: bool) -> Result<PathBuf> {
    let mut cmd = Command::new("cargo");
    cmd.current_dir(root)
        .args(["+nightly", "build", "-p", "lb-ebpf", "--target"])
        .arg(prereqs::BPF_TARGET)
        .args(["-Z", "build-std=core"])
        .env(
            "CARGO_ENCODED_RUSTFLAGS",
            [
                "--cfg=bpf_target_arch=\"x86_64\"",
                "-Cdebuginfo=2",
                "-Clink-arg=--btf",
            ]
            .join("\x1f"),
        );
    if release {
        cmd.arg("--release");
    } else {
        // Debug assertions put panic paths into the debug object (also into
        // the memcpy/memset that build-std compiles), ending functions in a
        // call to the panic handler; the verifier rejects those. An env
        // profile setting reaches the build-std crates, a manifest override
        // does not.
        cmd.env("CARGO_PROFILE_DEV_DEBUG_ASSERTIONS", "false");
    }
    run_cmd(&mut cmd)?;
    let profile = if release { "release" } else { "debug" };
    Ok(target_dir(root)
        .join(prereqs::BPF_TARGET)
        .join(profile)
        .join("lb-ebpf"))
}

/// Environment variable naming the debug eBPF object for the tests.
const DEBUG_OBJECT_ENV: &str = "LB_EBPF_DEBUG_OBJECT";

fn cargo(root: &Path, args: &[&str]) -> Result<()> {
    cargo_env(root, args, false, &[])
}

/// Runs cargo on the stable toolchain with `envs` set; `require_privileged`
/// makes the tests fail instead of skipping when they lack root.
fn cargo_env(
    root: &Path,
    args: &[&str],
    require_privileged: bool,
    envs: &[(&str, &Path)],
) -> Result<()> {
    let mut cmd = Command::new("cargo");
    cmd.current_dir(root).args(args).envs(envs.iter().copied());
    if require_privileged {
        cmd.env("LB_TESTS_REQUIRE_ROOT", "1");
    }
    run_cmd(&mut cmd)
}

fn run_cmd(cmd: &mut Command) -> Result<()> {
    let shown = format!("{cmd:?}");
    let status = cmd
        .status()
        .with_context(|| format!("could not start {shown}"))?;
    if !status.success() {
        bail!("{shown} failed ({status})");
    }
    Ok(())
}

/// Where cargo puts its output (`CARGO_TARGET_DIR` or `<root>/target`).
fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"))
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}
