//! `lb-user`: run the balancer, or show a running one (`lb-user status`).
//! Every failure ends as one line, `lb-user: error: ...`, and exit code 1.

use std::{io::IsTerminal as _, process::ExitCode};

use anyhow::{anyhow, bail};
use clap::{Parser, error::ErrorKind};
use lb_user::{
    bpffs,
    cli::{Cli, Command, RunArgs, StatusArgs},
    config::Config,
    daemon, iface,
    instance::InstanceLock,
    status,
};
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lb-user: error: {}", one_line(&format!("{e:#}")));
            ExitCode::FAILURE
        }
    }
}

/// Multi-line messages (verifier logs, clap usage) folded into one line.
fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn run() -> anyhow::Result<()> {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) => {
            e.print()?;
            return Ok(());
        }
        Err(e) => return Err(anyhow!(clap_message(&e))),
    };
    match cli.command {
        Some(Command::Status(args)) => show_status(args),
        None => run_balancer(cli.run),
    }
}

/// clap's first line without its `error: ` prefix (the rest is usage help).
fn clap_message(e: &clap::Error) -> String {
    let rendered = e.render().to_string();
    let first = rendered.lines().next().unwrap_or("invalid arguments");
    first.trim_start_matches("error: ").to_string()
}

fn require_root() -> anyhow::Result<()> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        bail!("must run as root (loading XDP programs needs CAP_BPF and CAP_NET_ADMIN)");
    }
    Ok(())
}

fn init_tracing(default_level: &str) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}

/// Input first (so bad flags are reported even without privileges), then
/// privileges, then the interface; the kernel is touched only after all of it.
fn run_balancer(args: RunArgs) -> anyhow::Result<()> {
    let config = Config::from_args(args)?;
    require_root()?;
    let ifindex = iface::ifindex(&config.iface)?;
    let snat = daemon::Snat::resolve(&config)?;
    // Still single-threaded here, as joining a mount namespace requires.
    bpffs::join_host_mount_ns_if_hidden()?;
    init_tracing(&config.log_level);
    bpffs::ensure_mounted()?;
    let _lock = InstanceLock::acquire(&config.instance)?;
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(daemon::serve(&config, ifindex, snat))
}

fn show_status(args: StatusArgs) -> anyhow::Result<()> {
    require_root()?;
    bpffs::join_host_mount_ns_if_hidden()?;
    let name = status::resolve_instance(args.instance)?;
    let status = status::read(&name)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&status)?);
    } else {
        print!("{}", status::render_table(&status));
    }
    Ok(())
}
