//! Active health checks: one tokio task per checked backend, connecting
//! from the balancer host straight to the backend address (not through
//! the VIP). A TCP check passes when the connect completes; an HTTP check
//! sends `GET path` and passes on the expected status. Results go to the
//! event loop, which feeds them to the backend's lifecycle (rise/fall).
//!
//! Each check runs under a supervisor: a check that panics is reported to
//! the checker's `on_panic` and started again one interval later, so a bug
//! in one check neither stops the daemon nor silently ends that backend's
//! checks.

use std::{collections::HashMap, net::SocketAddr, sync::Arc};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
    sync::mpsc,
    task::JoinHandle,
    time::{MissedTickBehavior, interval, sleep, timeout},
};
use tracing::debug;

use crate::settings::{
    faults::{self, Fault},
    ops::{HealthCheck, HttpCheck},
};

/// Most bytes of a response read looking for the status line.
const MAX_STATUS_LINE: usize = 1024;

/// One check's outcome.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckResult {
    pub backend: u32,
    /// The address checked: a result for an id since given to another
    /// backend is ignored.
    pub addr: SocketAddr,
    pub passed: bool,
}

/// Told of a check task that panicked: the backend id and the panic's message.
pub type OnPanic = Arc<dyn Fn(u32, &str) + Send + Sync>;

/// The running check tasks, by backend id.
pub struct HealthChecker {
    tasks: HashMap<u32, (SocketAddr, HealthCheck, JoinHandle<()>)>,
    results: mpsc::Sender<CheckResult>,
    on_panic: OnPanic,
}

impl HealthChecker {
    pub fn new(results: mpsc::Sender<CheckResult>, on_panic: OnPanic) -> Self {
        Self {
            tasks: HashMap::new(),
            results,
            on_panic,
        }
    }

    /// Runs exactly the checks in `wanted`: starts new ones, stops the rest.
    pub fn sync(&mut self, wanted: Vec<(u32, SocketAddr, HealthCheck)>) {
        self.tasks.retain(|id, (addr, check, task)| {
            let keep = wanted
                .iter()
                .any(|(i, a, c)| i == id && a == addr && c == check);
            if !keep {
                task.abort();
            }
            keep
        });
        for (id, addr, check) in wanted {
            if self.tasks.contains_key(&id) {
                continue;
            }
            let task = tokio::spawn(supervise(
                id,
                addr,
                check.clone(),
                self.results.clone(),
                self.on_panic.clone(),
            ));
            self.tasks.insert(id, (addr, check, task));
        }
    }
}

impl Drop for HealthChecker {
    fn drop(&mut self) {
        for (_, _, task) in self.tasks.values() {
            task.abort();
        }
    }
}

/// Runs backend `backend`'s checks; restarts them one interval after a
/// panic. Aborting this task aborts the check it runs.
async fn supervise(
    backend: u32,
    addr: SocketAddr,
    check: HealthCheck,
    out: mpsc::Sender<CheckResult>,
    on_panic: OnPanic,
) {
    loop {
        let task = tokio::spawn(run(backend, addr, check.clone(), out.clone()));
        let abort = task.abort_handle();
        let _abort_on_drop = AbortOnDrop(abort);
        match task.await {
            Err(e) if e.is_panic() => {
                let payload = e.into_panic();
                let message = payload
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "(no message)".into());
                on_panic(backend, &message);
                sleep(check.interval).await;
            }
            // The results channel closed (shutdown), or an abort.
            _ => return,
        }
    }
}

/// Aborts the running check when its supervisor is aborted.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn run(backend: u32, addr: SocketAddr, check: HealthCheck, out: mpsc::Sender<CheckResult>) {
    let mut tick = interval(check.interval);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if faults::trip(Fault::HealthPanic) {
            panic!("injected fault: health-panic (backend {backend})");
        }
        let passed = matches!(
            timeout(check.timeout, probe(addr, check.http.as_ref())).await,
            Ok(Ok(true))
        );
        debug!(backend, %addr, passed, "health check");
        if out
            .send(CheckResult {
                backend,
                addr,
                passed,
            })
            .await
            .is_err()
        {
            return;
        }
    }
}

/// One check; `Ok(false)` for a wrong HTTP status.
async fn probe(addr: SocketAddr, http: Option<&HttpCheck>) -> std::io::Result<bool> {
    let mut stream = TcpStream::connect(addr).await?;
    let Some(http) = http else {
        return Ok(true);
    };
    let request = format!(
        "GET {} HTTP/1.1\r\nHost: {addr}\r\nUser-Agent: lb-user-health\r\nConnection: close\r\n\r\n",
        http.path
    );
    stream.write_all(request.as_bytes()).await?;
    let mut buf = Vec::with_capacity(256);
    let mut chunk = [0u8; 256];
    while !buf.contains(&b'\n') && buf.len() < MAX_STATUS_LINE {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    Ok(status_code(&buf) == Some(http.status))
}

/// The status code of an HTTP/1.x status line.
fn status_code(response: &[u8]) -> Option<u16> {
    let line = response.split(|&b| b == b'\n').next()?;
    let line = std::str::from_utf8(line).ok()?;
    let mut parts = line.split_whitespace();
    parts.next().filter(|v| v.starts_with("HTTP/1."))?;
    parts.next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_status_lines() {
        assert_eq!(status_code(b"HTTP/1.1 200 OK\r\n"), Some(200));
        assert_eq!(status_code(b"HTTP/1.0 503 Busy\r\nx"), Some(503));
        assert_eq!(status_code(b"SSH-2.0\r\n"), None);
        assert_eq!(status_code(b""), None);
    }

    #[tokio::test]
    async fn tcp_and_http_checks_against_a_local_server() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let mut buf = [0u8; 512];
                let n = s.read(&mut buf).await.unwrap_or(0);
                let ok = buf[..n].starts_with(b"GET /ok ");
                let reply: &[u8] = if ok {
                    b"HTTP/1.1 200 OK\r\n\r\n"
                } else {
                    b"HTTP/1.1 404 No\r\n\r\n"
                };
                let _ = s.write_all(reply).await;
            }
        });
        assert!(probe(addr, None).await.unwrap());
        let http = |path: &str| HttpCheck {
            path: path.into(),
            status: 200,
        };
        assert!(probe(addr, Some(&http("/ok"))).await.unwrap());
        assert!(!probe(addr, Some(&http("/missing"))).await.unwrap());
        // Nothing listens on port 1 of loopback.
        assert!(probe("127.0.0.1:1".parse().unwrap(), None).await.is_err());
    }
}
