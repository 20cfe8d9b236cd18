//! Runtime changes to a running instance over a Unix socket,
//! `/run/lb-user/<instance>.sock`, one JSON object per line each way:
//!
//! ```text
//! → {"command":"drain","vip":"10.0.0.100:80/tcp","backend":"10.0.0.21:8080"}
//! ← {"ok":true,"backend_id":0}
//! → {"command":"weight","vip":"10.0.0.100:80","backend":"10.0.0.21:8080","weight":3}
//! ← {"ok":false,"error":"VIP 10.0.0.100:80/tcp has no backend 10.0.0.21:8080"}
//! ```
//!
//! Commands: `add` (backend may carry `@WEIGHT`), `remove`, `weight`,
//! `drain`, `undrain`. The socket is only reachable by root (mode 0600).
//! `lb-user backend ...` is the client.

use std::{
    io::{BufRead as _, BufReader, Write as _},
    os::unix::{fs::PermissionsExt as _, net::UnixStream as StdUnixStream},
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context as _, bail};
use serde::{Deserialize, Serialize};
use tokio::{
    io::{AsyncBufReadExt, AsyncWriteExt, BufReader as TokioBufReader},
    net::UnixListener,
    sync::{mpsc, oneshot},
    task::JoinHandle,
};
use tracing::warn;

use crate::{kernel::instance::LOCK_DIR, settings::cli::BackendCommand};

/// Longest request line accepted.
const MAX_LINE: usize = 4096;
/// How long the client waits for the daemon's answer.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);

pub fn socket_path(instance: &str) -> PathBuf {
    Path::new(LOCK_DIR).join(format!("{instance}.sock"))
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Request {
    pub command: BackendCommand,
    pub vip: String,
    pub backend: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<u32>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Response {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend_id: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Response {
    pub fn done(backend_id: u32) -> Self {
        Self {
            ok: true,
            backend_id: Some(backend_id),
            error: None,
        }
    }

    pub fn failed(error: impl ToString) -> Self {
        Self {
            ok: false,
            backend_id: None,
            error: Some(error.to_string()),
        }
    }
}

/// A request with the channel its answer goes back on.
pub type Pending = (Request, oneshot::Sender<Response>);

/// Listens on the instance's socket; requests go to `requests`.
pub fn serve(instance: &str, requests: mpsc::Sender<Pending>) -> anyhow::Result<JoinHandle<()>> {
    let path = socket_path(instance);
    // Only this process holds the instance lock, so a file here is stale.
    let _ = std::fs::remove_file(&path);
    let listener =
        UnixListener::bind(&path).with_context(|| format!("binding {}", path.display()))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("restricting {}", path.display()))?;
    Ok(tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(connection(stream, requests.clone()));
        }
    }))
}

async fn connection(stream: tokio::net::UnixStream, requests: mpsc::Sender<Pending>) {
    let (read, mut write) = stream.into_split();
    let mut lines = TokioBufReader::new(read.take_limit()).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let response = match serde_json::from_str::<Request>(&line) {
            Ok(request) => {
                if request.command == BackendCommand::Add {
                    resolve_first(&request.backend).await;
                }
                let (tx, rx) = oneshot::channel();
                if requests.send((request, tx)).await.is_err() {
                    return;
                }
                rx.await
                    .unwrap_or_else(|_| Response::failed("the daemon is shutting down"))
            }
            Err(e) => Response::failed(format!("bad request: {e}")),
        };
        let mut text = serde_json::to_string(&response).unwrap_or_default();
        text.push('\n');
        if let Err(e) = write.write_all(text.as_bytes()).await {
            warn!("control socket: {e}");
            return;
        }
    }
}

/// Makes the kernel resolve a new backend's MAC before it can be selected,
/// so its first flows are not dropped for want of a next hop.
async fn resolve_first(backend: &str) {
    if let Ok(b) = backend.parse::<crate::settings::addr::BackendAddr>() {
        crate::kernel::neighbours::probe(b.addr.ip());
        tokio::time::sleep(crate::kernel::neighbours::STARTUP_RESOLVE_WAIT).await;
    }
}

trait TakeLimit: Sized {
    fn take_limit(self) -> tokio::io::Take<Self>;
}

impl<R: tokio::io::AsyncRead> TakeLimit for R {
    /// Bounds what one connection can make the daemon buffer.
    fn take_limit(self) -> tokio::io::Take<Self> {
        tokio::io::AsyncReadExt::take(self, (MAX_LINE * 64) as u64)
    }
}

/// Removes the socket file on a clean stop.
pub fn remove_socket(instance: &str) {
    let _ = std::fs::remove_file(socket_path(instance));
}

/// Sends one request to a running instance and returns its answer.
pub fn send(instance: &str, request: &Request) -> anyhow::Result<Response> {
    let path = socket_path(instance);
    let mut stream = StdUnixStream::connect(&path).with_context(|| {
        format!(
            "instance '{instance}' is not running or has no control socket ({})",
            path.display()
        )
    })?;
    stream.set_read_timeout(Some(CLIENT_TIMEOUT))?;
    let mut line = serde_json::to_string(request)?;
    line.push('\n');
    stream.write_all(line.as_bytes())?;
    let mut answer = String::new();
    BufReader::new(&stream)
        .read_line(&mut answer)
        .context("reading the daemon's answer")?;
    if answer.is_empty() {
        bail!("the daemon closed the control socket without answering");
    }
    serde_json::from_str(&answer).context("parsing the daemon's answer")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_and_unknown_fields_are_refused() {
        let r = Request {
            command: BackendCommand::Weight,
            vip: "10.0.0.100:80".into(),
            backend: "10.0.0.21:8080".into(),
            weight: Some(3),
        };
        let text = serde_json::to_string(&r).unwrap();
        assert_eq!(
            text,
            r#"{"command":"weight","vip":"10.0.0.100:80","backend":"10.0.0.21:8080","weight":3}"#
        );
        assert_eq!(serde_json::from_str::<Request>(&text).unwrap(), r);
        assert!(
            serde_json::from_str::<Request>(r#"{"command":"drain","vip":"a","backend":"b","x":1}"#)
                .is_err()
        );
        assert_eq!(
            serde_json::to_string(&Response::failed("no")).unwrap(),
            r#"{"ok":false,"error":"no"}"#
        );
    }
}
