//! A real etcd server for the discovery tests, run by the lab in its client
//! namespace on the lab subnet (never on a host address), so the balancer
//! and the backends' `lb-user register` sidecars reach it over the bridge.
//! It is one of the lab's processes: stopped with the lab, also when a test
//! panics; its data folder lives in the lab's log folder.
//!
//! [`Lab::start_etcd_tls`] runs it on an https URL with a throwaway CA and
//! certificates ([`EtcdTls`], made by the openssl CLI in the log folder),
//! optionally requiring client certificates.

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

    /// etcd's https client URL inside the lab.
    pub fn etcd_tls_url(&self) -> String {
        format!("https://{CLIENT_ADDR}:{ETCD_CLIENT_PORT}")
    }

    /// A throwaway CA, a server certificate for etcd's lab address (IP SAN)
    /// and a client certificate, made with the openssl CLI in the log folder.
    pub fn make_etcd_tls(&self) -> Result<EtcdTls> {
        let dir = self.log_dir().join("etcd-tls");
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let tls = EtcdTls {
            ca: dir.join("ca.pem"),
            server_cert: dir.join("server.pem"),
            server_key: dir.join("server.key"),
            client_cert: dir.join("client.pem"),
            client_key: dir.join("client.key"),
        };
        let ca_key = dir.join("ca.key");
        let p = |p: &PathBuf| p.display().to_string();
        openssl(&[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=lb-lab-ca",
            "-keyout",
            &p(&ca_key),
            "-out",
            &p(&tls.ca),
        ])?;
        let sign = |name: &str, cert: &PathBuf, key: &PathBuf, ext: &str| -> Result<()> {
            let csr = dir.join(format!("{name}.csr"));
            let ext_file = dir.join(format!("{name}.ext"));
            std::fs::write(&ext_file, ext)?;
            openssl(&[
                "req",
                "-new",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-subj",
                &format!("/CN=lb-lab-{name}"),
                "-keyout",
                &p(key),
                "-out",
                &p(&csr),
            ])?;
            openssl(&[
                "x509",
                "-req",
                "-in",
                &p(&csr),
                "-CA",
                &p(&tls.ca),
                "-CAkey",
                &p(&ca_key),
                "-CAcreateserial",
                "-days",
                "2",
                "-extfile",
                &p(&ext_file),
                "-out",
                &p(cert),
            ])
        };
        // etcd's own gateway dials its gRPC port with the server certificate,
        // so it is a client certificate too.
        sign(
            "server",
            &tls.server_cert,
            &tls.server_key,
            &format!(
                "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\n\
                 extendedKeyUsage=serverAuth,clientAuth\n\
                 subjectAltName=IP:{CLIENT_ADDR},IP:127.0.0.1\n"
            ),
        )?;
        sign(
            "client",
            &tls.client_cert,
            &tls.client_key,
            "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=clientAuth\n",
        )?;
        Ok(tls)
    }

    /// etcd on [`Lab::etcd_tls_url`] with `tls`'s server certificate; with
    /// `client_cert_auth`, it also requires a client certificate signed by
    /// `tls.ca`.
    pub fn start_etcd_tls(&self, tls: &EtcdTls, client_cert_auth: bool) -> Result<ProcessId> {
        let mut server = vec![
            "--cert-file".to_string(),
            tls.server_cert.display().to_string(),
            "--key-file".into(),
            tls.server_key.display().to_string(),
        ];
        if client_cert_auth {
            server.extend([
                "--client-cert-auth".to_string(),
                "--trusted-ca-file".into(),
                tls.ca.display().to_string(),
            ]);
        }
        self.start_etcd_with(&self.etcd_tls_url(), &server, &tls.etcdctl_flags())
    }

    fn start_etcd_at(&self, client: &str) -> Result<ProcessId> {
        self.start_etcd_with(client, &[], &[])
    }

    /// etcd serving clients at `client`, with `server` flags added; the
    /// health check runs etcdctl with `ctl` flags.
    fn start_etcd_with(
        &self,
        client: &str,
        server: &[String],
        ctl: &[String],
    ) -> Result<ProcessId> {
        let etcd = which("etcd").context(
            "etcd is not installed (Debian's etcd-server; `cargo xtask test` installs it)",
        )?;
        let client = client.to_string();
        let peer = format!("http://{CLIENT_ADDR}:{ETCD_PEER_PORT}");
        let data = self.etcd_data_dir();
        let mut argv: Vec<String> = vec![
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
        argv.extend_from_slice(server);
        let ctl: Vec<&str> = ctl.iter().map(String::as_str).collect();
        let process = self.spawn(&self.client().ns, "etcd", &argv)?;
        let deadline = Instant::now() + ETCD_READY_TIMEOUT;
        loop {
            if let Some(status) = self.exit_status(process)? {
                bail!("etcd exited ({status}): {}", self.stderr(process).trim());
            }
            if self
                .etcdctl_with(&client, &ctl, &["endpoint", "health"])
                .is_ok()
            {
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
        self.etcdctl_with(url, &[], args)
    }

    /// `etcdctl FLAGS... ARGS...` against the etcd listening at `url` (flags
    /// such as `--user root:PW` or [`EtcdTls::etcdctl_flags`]).
    pub fn etcdctl_with(&self, url: &str, flags: &[&str], args: &[&str]) -> Result<String> {
        let endpoints = format!("--endpoints={url}");
        let mut argv = vec!["etcdctl", "--command-timeout=3s", &endpoints];
        argv.extend_from_slice(flags);
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

/// The files of [`Lab::make_etcd_tls`] (PEM; keys unencrypted).
#[derive(Clone, Debug)]
pub struct EtcdTls {
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

impl EtcdTls {
    /// etcdctl's flags to trust the CA and present the client certificate.
    pub fn etcdctl_flags(&self) -> Vec<String> {
        vec![
            format!("--cacert={}", self.ca.display()),
            format!("--cert={}", self.client_cert.display()),
            format!("--key={}", self.client_key.display()),
        ]
    }
}

/// `openssl ARGS...`, or an error with its stderr.
fn openssl(args: &[&str]) -> Result<()> {
    let openssl = which("openssl")
        .context("openssl is not installed (Debian's openssl; `cargo xtask test` installs it)")?;
    let out = std::process::Command::new(openssl)
        .args(args)
        .output()
        .context("running openssl")?;
    if !out.status.success() {
        bail!(
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|dir| PathBuf::from(dir).join(name))
        .find(|p| p.is_file())
}
