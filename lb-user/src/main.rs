//! `lb-user`: run the balancer, or show a running one (`lb-user status`).
//! Every failure ends as one line, `lb-user: error: ...`, and exit code 1.

use std::{io::IsTerminal as _, process::ExitCode, sync::Arc};

use anyhow::{anyhow, bail};
use clap::{Parser, error::ErrorKind};
use lb_user::{
    daemon, discover,
    kernel::{bpffs, iface, instance::InstanceLock, sysctl},
    settings::{
        cli::{
            BackendArgs, BackendCommand, Cli, Command, ControlCommand, RunArgs, StatusArgs,
            VipArgs, VipCommand,
        },
        config::Config,
        discovery::RegisterArgs,
        faults, one_line,
        state::{self, RuntimeState},
    },
    surface::{control, status},
};
use std::io::Write as _;

use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Not eprintln!: it panics when stderr is gone.
            let _ = writeln!(
                std::io::stderr(),
                "lb-user: error: {}",
                one_line(&format!("{e:#}"))
            );
            ExitCode::FAILURE
        }
    }
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
        Some(Command::Backend(args)) => change_backend(args),
        Some(Command::Register(args)) => register(args),
        Some(Command::Vip(args)) => change_vip(args),
        None => run_balancer(cli.run),
    }
}

/// clap's first line without its `error: ` prefix (the rest is usage help).
fn clap_message(e: &clap::Error) -> String {
    let rendered = e.render().to_string();
    // The message may span lines (a list of missing arguments); what
    // follows its blank line (usage, "For more information") is dropped.
    let message = rendered.split("\n\n").next().unwrap_or_default();
    let message = one_line(message);
    let message = message.trim_start_matches("error: ");
    if message.is_empty() {
        "invalid arguments".to_string()
    } else {
        message.to_string()
    }
}

/// The instance a control command goes to. Root finds it as `status`
/// does (joining the host's mount namespace to see its pins if needed).
/// Anyone else may be a member of the socket's `--control-group`, whom the
/// daemon lets in: it names the instance (listing instances reads the pins,
/// which are root's), and the daemon's credential check decides.
fn control_instance(requested: Option<String>) -> anyhow::Result<String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        bpffs::join_host_mount_ns_if_hidden()?;
        return status::resolve_instance(requested);
    }
    match requested {
        Some(name) => status::resolve_instance(Some(name)),
        None => bail!(
            "not root: name the instance with --instance NAME (listing the running instances \
             needs root; a member of the control socket's --control-group may send commands)"
        ),
    }
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
        // A closed stderr (a supervisor that went away) must not turn every
        // later log line into a panic that would skip the clean detach.
        .log_internal_errors(false)
        .init();
}

/// A panic in a task (a health check, say) is survived by the daemon: it
/// is logged as one error line instead of the default multi-line report.
fn log_panics() {
    std::panic::set_hook(Box::new(|info| {
        let at = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        let message = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_default();
        tracing::error!("panic{at}: {message}");
    }));
}

/// Input first (so bad flags are reported even without privileges), then
/// privileges, then the interface; the kernel is touched only after all of it.
fn run_balancer(args: RunArgs) -> anyhow::Result<()> {
    faults::init_from_env()?;
    let mut config = Config::from_args(args.clone())?;
    let password_flag = args.discovery.etcd_password.is_some();
    let reload: daemon::Reload =
        Arc::new(move || Config::from_args(args.clone()).map_err(anyhow::Error::from));
    require_root()?;
    let state_path = state::path(&config.state_dir, &config.instance);
    let (runtime_state, state_warnings) = RuntimeState::load(&state_path)?;
    let mut runtime_state = runtime_state.unwrap_or_default();
    let ifindex = iface::ifindex(&config.iface)?;
    let snat = daemon::startup::Snat::resolve(&config, &runtime_state)?;
    // Before anything is attached or adopted: a refused range leaves a
    // running instance as it is.
    sysctl::check_snat_ports(config.snat_ports, &config.instance)?;
    // Still single-threaded here, as joining a mount namespace requires.
    let joined = bpffs::join_host_mount_ns_if_hidden()?;
    init_tracing(&config.log_level);
    log_panics();
    if let Some(warning) = joined {
        tracing::warn!("{warning}");
    }
    warn_password_flag(password_flag);
    for warning in config.warnings() {
        tracing::warn!("{warning}");
    }
    snat.warn_unassigned();
    for warning in state_warnings {
        tracing::warn!("{warning}");
    }
    snat.drop_refused_state(&mut runtime_state, &state_path);
    bpffs::ensure_mounted()?;
    let _lock = InstanceLock::acquire(&config.instance)?;
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(async {
            // Backends of etcd-discovered VIPs: etcd, else the cache.
            let discovery = discover::watch::seed(&mut config, &snat.addrs()).await?;
            daemon::serve(&config, runtime_state, reload, ifindex, snat, discovery).await
        })
}

/// `--etcd-password` puts the password in the process list, where every
/// local user can read it: said once at start, with the way out.
fn warn_password_flag(given: bool) {
    if given {
        tracing::warn!(
            "--etcd-password is visible to every local user in the process list; \
             use --etcd-password-file FILE (or etcd_password_file in the config file)"
        );
    }
}

/// The backend-side sidecar: a leased key in etcd while this runs.
fn register(args: RegisterArgs) -> anyhow::Result<()> {
    let etcd = args.etcd()?;
    let check = match &args.check_http {
        Some(url) => Some(discover::register::parse_check_url(url).map_err(|e| anyhow!(e))?),
        None => None,
    };
    let entry = discover::entry::Entry {
        addr: args.addr,
        weight: args.weight,
        zone: args.zone()?,
    };
    init_tracing(&args.log_level);
    warn_password_flag(args.etcd_password.is_some());
    let registration = discover::register::Registration {
        etcd,
        prefix: args.prefix,
        entry,
        ttl: args.ttl,
        check,
    };
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(discover::register::run(registration))
}

fn show_status(args: StatusArgs) -> anyhow::Result<()> {
    require_root()?;
    bpffs::join_host_mount_ns_if_hidden()?;
    let name = status::resolve_instance(args.instance)?;
    let status = status::read(&name)?;
    if args.json {
        print_out(&format!("{}\n", serde_json::to_string_pretty(&status)?))
    } else {
        print_out(&status::render_table(&status))
    }
}

/// Writes `text` to stdout. A reader that went away (`lb-user status |
/// head -1`) is not an error; `print!` would panic there.
fn print_out(text: &str) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        result => result.map_err(|e| anyhow!("writing to stdout: {e}")),
    }
}

/// Adds or removes a whole VIP through the control socket.
fn change_vip(args: VipArgs) -> anyhow::Result<()> {
    let command = match args.action {
        VipCommand::Add if args.backends.is_empty() => {
            bail!("vip add needs at least one --backend IP:PORT[@WEIGHT]")
        }
        VipCommand::Add => ControlCommand::VipAdd,
        VipCommand::Remove if !args.backends.is_empty() || args.algorithm.is_some() => {
            bail!("vip remove takes only --vip (and --instance)")
        }
        VipCommand::Remove => ControlCommand::VipRemove,
    };
    let instance = control_instance(args.instance)?;
    let request = control::Request {
        command,
        vip: args.vip.to_string(),
        backend: String::new(),
        weight: None,
        backends: args.backends.iter().map(ToString::to_string).collect(),
        algorithm: args.algorithm.map(|a| a.name().to_string()),
        peer: None,
    };
    let response = control::send(&instance, &request)?;
    match (response.ok, response.error) {
        (true, _) => {
            let what = match args.action {
                VipCommand::Add => "added",
                VipCommand::Remove => "removed (draining its flows)",
            };
            print_out(&format!(
                "VIP {}: {what} (VIP id {})\n",
                args.vip,
                response.backend_id.unwrap_or_default()
            ))
        }
        (false, error) => bail!("{}", error.unwrap_or_else(|| "refused".into())),
    }
}

/// Sends one command to the running instance's control socket.
fn change_backend(args: BackendArgs) -> anyhow::Result<()> {
    match args.action {
        BackendCommand::Weight if args.weight.is_none() => bail!("backend weight needs --weight N"),
        BackendCommand::Weight => {}
        _ if args.weight.is_some() => bail!(
            "--weight goes with backend weight only (backend add takes the weight as --backend \
             IP:PORT@WEIGHT)"
        ),
        _ => {}
    }
    if args.action != BackendCommand::Add
        && (args.backend.weight != lb_user::settings::addr::Weight::DEFAULT
            || args.backend.zone.is_some())
    {
        bail!(
            "backend {}: --backend takes IP:PORT only (@WEIGHT and zone= go with backend add)",
            format!("{:?}", args.action).to_lowercase()
        );
    }
    let instance = control_instance(args.instance)?;
    let request = control::Request {
        command: args.action.into(),
        vip: args.vip.to_string(),
        backend: args.backend.to_string(),
        weight: args.weight,
        backends: Vec::new(),
        algorithm: None,
        peer: None,
    };
    let response = control::send(&instance, &request)?;
    match (response.ok, response.error) {
        (true, _) => print_out(&format!(
            "{:?} {} in {}: done (backend id {})\n",
            args.action,
            args.backend.addr,
            args.vip,
            response.backend_id.unwrap_or_default()
        )),
        (false, error) => bail!("{}", error.unwrap_or_else(|| "refused".into())),
    }
}
