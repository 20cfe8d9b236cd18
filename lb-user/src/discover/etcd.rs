//! Connecting to etcd with the configured endpoints, TLS and user.

use std::time::Duration;

use anyhow::Context as _;
use etcd_client::{Certificate, Client, ConnectOptions, Identity, TlsOptions};

use crate::settings::discovery::EtcdSettings;

/// A connection attempt gives up after this long.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// HTTP/2 pings every this long find a dead server (or a cut path) within
/// this plus [`KEEP_ALIVE_TIMEOUT`]; a killed server is seen at once (reset).
/// Generous, so a busy event loop (a thousand backends published at once)
/// is not taken for a dead server.
pub const KEEP_ALIVE: Duration = Duration::from_secs(3);
pub const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(5);
/// A unary request (get, put, grant) gives up after this long.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(3);

/// The connection's options. Every request requires a leader: a member
/// cut off from the cluster's quorum then refuses requests and ends
/// watches ("no leader") instead of keeping them open and silent, so a
/// watch reconnects (to another endpoint when there are several) and a
/// register sidecar's keep-alive fails over, rather than trusting a member
/// that no longer hears of changes.
pub fn options(settings: &EtcdSettings) -> anyhow::Result<ConnectOptions> {
    let mut options = ConnectOptions::new()
        .with_connect_timeout(CONNECT_TIMEOUT)
        .with_keep_alive(KEEP_ALIVE, KEEP_ALIVE_TIMEOUT)
        .with_keep_alive_while_idle(true)
        .with_require_leader(true);
    if let Some((user, password)) = &settings.user {
        options = options.with_user(user.clone(), password.clone());
    }
    let tls_wanted = settings.ca.is_some()
        || settings.identity.is_some()
        || settings.endpoints.iter().any(|e| e.starts_with("https://"));
    if tls_wanted {
        let mut tls = TlsOptions::new();
        if let Some(ca) = &settings.ca {
            let pem = std::fs::read(ca).with_context(|| format!("reading {}", ca.display()))?;
            tls = tls.ca_certificate(Certificate::from_pem(pem));
        }
        if let Some((cert, key)) = &settings.identity {
            let cert_pem =
                std::fs::read(cert).with_context(|| format!("reading {}", cert.display()))?;
            let key_pem =
                std::fs::read(key).with_context(|| format!("reading {}", key.display()))?;
            tls = tls.identity(Identity::from_pem(cert_pem, key_pem));
        }
        options = options.with_tls(tls);
    }
    Ok(options)
}

/// A client, or why not (within [`CONNECT_TIMEOUT`] and a request timeout).
pub async fn connect(settings: &EtcdSettings) -> anyhow::Result<Client> {
    let options = options(settings)?;
    let endpoints = settings.endpoints.clone();
    tokio::time::timeout(
        CONNECT_TIMEOUT + REQUEST_TIMEOUT,
        Client::connect(endpoints, Some(options)),
    )
    .await
    .context("connecting to etcd timed out")?
    .context("connecting to etcd")
}

/// Whether `error` is etcd refusing the client (wrong user or password, no
/// user while authentication is on, no permission) rather than etcd being
/// out of reach: the gRPC codes etcd answers those with.
pub fn is_rejection(error: &anyhow::Error) -> bool {
    // tonic::Code's values (the gRPC status codes).
    const INVALID_ARGUMENT: i32 = 3;
    const PERMISSION_DENIED: i32 = 7;
    const UNAUTHENTICATED: i32 = 16;
    error.chain().any(|cause| {
        matches!(
            cause.downcast_ref::<etcd_client::Error>(),
            Some(etcd_client::Error::GRpcStatus(status))
                if matches!(status.code() as i32, INVALID_ARGUMENT | PERMISSION_DENIED | UNAUTHENTICATED)
        )
    })
}
