//! A real etcd server for the discovery tests, run by the lab in its client
//! namespace on the lab subnet (never on a host address), so the balancer
//! and the backends' `lb-user register` sidecars reach it over the bridge.
//! It is one of the lab's processes: stopped with the lab, also when a test
//! panics; its data folder lives in the lab's log folder.

use std::{
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use super::{CLIENT_ADDR, Lab, ProcessId, netns::POLL_INTERVAL};

pub const ETCD_CLIENT_PORT: u16 = 2379;
const ETCD_PEER_PORT: u16 = 2380;
/// How long etcd may take to answer its health check after a start.
const ETCD_READY_TIMEOUT: Duration = Duration::from_secs(20);

impl Lab {
    /// etcd's client URL inside the lab.
    pub fn etcd_url(&self) -> String {
        format!("http://{CLIENT_ADDR}:{ETCD_CLIENT_PORT}")
    }

    fn etcd_data_dir(&self) -> PathBuf {
        self.log_dir().join("etcd-data")
    }

    /// Starts etcd (again, on the same data folder after a kill) and waits
    /// until it answers. Fails loudly when etcd is not installed or exits.
    pub fn start_etcd(&self) -> Result<ProcessId> {
        self.start_etcd_at(&self.etcd_url())
    }

    /// etcd on the client namespace's loopback only: running, but out of
    /// the balancer's reach (to change and compact what it cannot see).
    pub fn start_etcd_hidden(&self) -> Result<ProcessId> {
        self.start_etcd_at(&format!("http://127.0.0.1:{ETCD_CLIENT_PORT}"))
    }

    fn start_etcd_at(&self, client: &str) -> Result<ProcessId> {
        let etcd = which("etcd").context(
            "etcd is not installed (Debian's etcd-server; `cargo xtask test` installs it)",
        )?;
        let client = client.to_string();
        let peer = format!("http://{CLIENT_ADDR}:{ETCD_PEER_PORT}");
        let data = self.etcd_data_dir();
        let argv: Vec<String> = vec![
            etcd.display().to_string(),
            "--name".into(),
            "lab".into(),
            "--data-dir".into(),
            data.display().to_string(),
            "--listen-client-urls".into(),
            client.clone(),
            "--advertise-client-urls".into(),
            client.clone(),
            "--listen-peer-urls".into(),
            peer.clone(),
            "--initial-advertise-peer-urls".into(),
            peer.clone(),
            "--initial-cluster".into(),
            format!("lab={peer}"),
            "--log-level".into(),
            "warn".into(),
        ];
        let process = self.spawn(&self.client().ns, "etcd", &argv)?;
        let deadline = Instant::now() + ETCD_READY_TIMEOUT;
        loop {
            if let Some(status) = self.exit_status(process)? {
                bail!("etcd exited ({status}): {}", self.stderr(process).trim());
            }
            if self.etcdctl_at(&client, &["endpoint", "health"]).is_ok() {
                return Ok(process);
            }
            if Instant::now() >= deadline {
                bail!(
                    "etcd not healthy after {ETCD_READY_TIMEOUT:?}: {}",
                    self.stderr(process).trim()
                );
            }
            std::thread::sleep(POLL_INTERVAL * 5);
        }
    }

    /// `etcdctl ARGS...` against the lab's etcd; stdout, or an error.
    pub fn etcdctl(&self, args: &[&str]) -> Result<String> {
        self.etcdctl_at(&self.etcd_url(), args)
    }

    /// `etcdctl ARGS...` against the etcd listening at `url`.
    pub fn etcdctl_at(&self, url: &str, args: &[&str]) -> Result<String> {
        let endpoints = format!("--endpoints={url}");
        let mut argv = vec!["etcdctl", "--command-timeout=3s", &endpoints];
        argv.extend_from_slice(args);
        let out = self.exec(&self.client().ns, &argv)?;
        if !out.status.success() {
            bail!(
                "etcdctl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|dir| PathBuf::from(dir).join(name))
        .find(|p| p.is_file())
}
