//! `lb-user register`: the backend side. Grants a lease of `--ttl`, puts
//! `<prefix><addr>` = `{"addr","weight","zone"}` under it and keeps the
//! lease alive (every ttl/3). With `--check-http URL`, the key is deleted
//! while the check fails and put again when it passes. Each period also
//! checks that the key is still there under the lease, and puts it again
//! if someone deleted it (or wrote it without the lease) while the lease
//! lives. SIGTERM or SIGINT revokes the lease, so the balancers drain the
//! backend at once. If the lease is lost (etcd down longer than the ttl),
//! a new one is granted.

use std::{net::SocketAddr, time::Duration};

use anyhow::Context as _;
use etcd_client::{Client, GetOptions, PutOptions};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::TcpStream,
    signal::unix::{SignalKind, signal},
    time::{sleep, timeout},
};
use tracing::{info, warn};

use super::{entry::Entry, etcd};
use crate::settings::discovery::EtcdSettings;

/// What to register.
#[derive(Clone, Debug)]
pub struct Registration {
    pub etcd: EtcdSettings,
    pub prefix: String,
    pub entry: Entry,
    pub ttl: Duration,
    /// `http://IP:PORT/path`: registered only while it answers 2xx.
    pub check: Option<(SocketAddr, String)>,
}

impl Registration {
    pub fn key(&self) -> String {
        format!("{}{}", self.prefix, self.entry.addr)
    }
}

/// `http://IP:PORT[/path]` → (address, path).
pub fn parse_check_url(url: &str) -> Result<(SocketAddr, String), String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| format!("check URL '{url}' must start with http://"))?;
    let (host, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let addr: SocketAddr = host
        .parse()
        .map_err(|_| format!("check URL '{url}' must name IP:PORT"))?;
    Ok((addr, path.to_string()))
}

/// One HTTP/1.1 GET; true on a 2xx status within the timeout.
pub async fn http_ok(addr: SocketAddr, path: &str, within: Duration) -> bool {
    let attempt = async {
        let mut s = TcpStream::connect(addr).await?;
        let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await?;
        let mut buf = [0u8; 64];
        let n = s.read(&mut buf).await?;
        let head = String::from_utf8_lossy(&buf[..n]).into_owned();
        Ok::<bool, std::io::Error>(
            head.split_whitespace()
                .nth(1)
                .is_some_and(|code| code.starts_with('2') && code.len() == 3),
        )
    };
    matches!(timeout(within, attempt).await, Ok(Ok(true)))
}

struct Lease {
    id: i64,
    keeper: etcd_client::LeaseKeeper,
    stream: etcd_client::LeaseKeepAliveStream,
}

async fn grant(client: &mut Client, ttl: Duration) -> anyhow::Result<Lease> {
    let secs = ttl.as_secs().max(1) as i64;
    let granted = timeout(etcd::REQUEST_TIMEOUT, client.lease_grant(secs, None))
        .await
        .context("granting a lease timed out")??;
    let (keeper, stream) = client.lease_keep_alive(granted.id()).await?;
    Ok(Lease {
        id: granted.id(),
        keeper,
        stream,
    })
}

async fn put(client: &mut Client, r: &Registration, lease: i64) -> anyhow::Result<()> {
    let value = serde_json::to_string(&r.entry)?;
    timeout(
        etcd::REQUEST_TIMEOUT,
        client.put(r.key(), value, Some(PutOptions::new().with_lease(lease))),
    )
    .await
    .context("put timed out")??;
    Ok(())
}

/// Whether the key is in etcd under lease `lease`.
async fn key_is_ours(client: &mut Client, r: &Registration, lease: i64) -> anyhow::Result<bool> {
    let options = GetOptions::new().with_keys_only();
    let response = timeout(etcd::REQUEST_TIMEOUT, client.get(r.key(), Some(options)))
        .await
        .context("get timed out")??;
    Ok(response.kvs().first().is_some_and(|kv| kv.lease() == lease))
}

/// What one period does with the key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    Put,
    Delete,
    Nothing,
}

/// The period's step: `healthy`, the check passes (or there is none);
/// `registered`, this sidecar put the key under its lease; `ours`, the key
/// is still in etcd under that lease (read only while registered and
/// healthy). A key deleted by someone else while the lease lives would
/// otherwise stay away for good, as would the backend.
fn step(healthy: bool, registered: bool, ours: bool) -> Step {
    match (healthy, registered) {
        (true, false) => Step::Put,
        (true, true) if !ours => Step::Put,
        (false, true) => Step::Delete,
        _ => Step::Nothing,
    }
}

/// Runs until SIGTERM/SIGINT; the lease is revoked on the way out.
pub async fn run(r: Registration) -> anyhow::Result<()> {
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let period = (r.ttl / 3).max(Duration::from_millis(300));
    let mut lease: Option<Lease> = None;
    let mut client: Option<Client> = None;
    let mut registered = false;
    loop {
        let step = async {
            if client.is_none() {
                client = Some(etcd::connect(&r.etcd).await?);
            }
            let c = client.as_mut().expect("set above");
            if lease.is_none() {
                lease = Some(grant(c, r.ttl).await?);
                registered = false;
            }
            let l = lease.as_mut().expect("set above");
            l.keeper.keep_alive().await?;
            match timeout(etcd::REQUEST_TIMEOUT, l.stream.message()).await {
                Ok(Ok(Some(resp))) if resp.ttl() > 0 => {}
                _ => anyhow::bail!("lease {} lost", l.id),
            }
            let healthy = match &r.check {
                Some((addr, path)) => {
                    http_ok(*addr, path, period.min(Duration::from_secs(2))).await
                }
                None => true,
            };
            let id = l.id;
            let ours = healthy && registered && key_is_ours(c, &r, id).await?;
            match step(healthy, registered, ours) {
                Step::Put => {
                    if registered {
                        warn!(key = %r.key(), lease = id, "key gone (or rewritten without the lease) while the lease lives: putting it again");
                    }
                    put(c, &r, id).await?;
                    info!(key = %r.key(), lease = id, "registered");
                    registered = true;
                }
                Step::Delete => {
                    timeout(etcd::REQUEST_TIMEOUT, c.delete(r.key(), None))
                        .await
                        .context("delete timed out")??;
                    warn!(key = %r.key(), "check failed: deregistered");
                    registered = false;
                }
                Step::Nothing => {}
            }
            Ok::<(), anyhow::Error>(())
        };
        let outcome = tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            outcome = step => outcome,
        };
        if let Err(e) = outcome {
            warn!("registration: {e:#}; retrying");
            client = None;
            lease = None;
            registered = false;
        }
        tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            _ = sleep(period) => {}
        }
    }
    if let (Some(c), Some(l)) = (client.as_mut(), lease.as_ref()) {
        match timeout(etcd::REQUEST_TIMEOUT, c.lease_revoke(l.id)).await {
            Ok(Ok(_)) => info!(key = %r.key(), "lease revoked"),
            _ => warn!(key = %r.key(), "could not revoke the lease; it expires within its ttl"),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_deleted_behind_the_sidecars_back_is_put_again() {
        assert_eq!(step(true, true, false), Step::Put);
        assert_eq!(step(true, true, true), Step::Nothing);
        assert_eq!(step(true, false, false), Step::Put);
        assert_eq!(step(false, true, true), Step::Delete);
        assert_eq!(step(false, false, false), Step::Nothing);
    }

    #[test]
    fn check_urls_name_an_address_and_a_path() {
        assert_eq!(
            parse_check_url("http://10.0.0.21:8080/health").unwrap(),
            ("10.0.0.21:8080".parse().unwrap(), "/health".into())
        );
        assert_eq!(parse_check_url("http://10.0.0.21:80").unwrap().1, "/");
        assert!(parse_check_url("https://10.0.0.21:80/").is_err());
        assert!(parse_check_url("http://host:80/").is_err());
    }
}
