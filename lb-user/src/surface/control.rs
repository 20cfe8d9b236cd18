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
//! `drain`, `undrain`. `lb-user backend ...` is the client.
//!
//! Who may connect: root, and with `--control-group NAME` the processes
//! whose primary or supplementary groups include NAME. The file system
//! says so first (the socket is 0600 root, or 0660 root:NAME; its
//! directory, shared by every instance, is 0711 root: see
//! `kernel::instance::RUN_DIR_MODE`), then each connection's `SO_PEERCRED`: a peer
//! that got past the file modes but is neither (a process that kept its
//! file-system identity) is answered `permission denied` and dropped.
//! Each connection is bounded: one line of at most [`MAX_LINE`] bytes at a
//! time, [`IDLE_TIMEOUT`] to send the next one, and at most
//! [`MAX_CONNECTIONS`] at once. Every change is logged with its peer's pid
//! and uid.

use std::{
    io::{BufRead as _, BufReader, Write as _},
    os::unix::{fs::PermissionsExt as _, net::UnixStream as StdUnixStream},
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use anyhow::{Context as _, bail};
use serde::{Deserialize, Serialize};
use tokio::{
    io::{
        AsyncBufReadExt, AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt,
        BufReader as TokioBufReader,
    },
    net::{UnixListener, UnixStream},
    sync::{Semaphore, mpsc, oneshot},
    task::JoinHandle,
    time::{sleep, timeout},
};
use tracing::{info, warn};

use lb_common::{Algorithm, MAX_BACKENDS_PER_VIP};

use crate::{
    kernel::instance::{SOCKET_SUFFIX, run_file},
    settings::{cli::ControlCommand, ops::ControlGroup, zone::MAX_ZONE_NAME},
};

/// Longest request line accepted (each line, not the connection): the
/// longest our client sends, a `vip-add` of [`MAX_BACKENDS_PER_VIP`]
/// backends of the longest text each, and a little more (143,670 bytes).
/// Bounded so a client cannot make the daemon buffer without end: at most
/// [`MAX_CONNECTIONS`] such lines at once (2.2 MiB).
pub const MAX_LINE: usize = REQUEST_KEYS
    + MAX_VIP_TEXT
    + MAX_BACKEND_TEXT
    + MAX_ALGORITHM_NAME
    + MAX_BACKENDS_PER_VIP as usize * (MAX_BACKEND_TEXT + r#""","#.len())
    + SLACK;
/// Every key of a [`Request`] as serde_json writes it, with its
/// punctuation, the longest command and weight, and the other values
/// empty.
const REQUEST_KEYS: usize = r#"{"command":"vip-remove","vip":"","backend":"","weight":4294967295,"backends":[],"algorithm":""}"#.len();
/// The longest IPv6 address with a scope id and the longest port: what
/// `SocketAddr` writes for the longest address it parses.
const MAX_SOCKET_ADDR: usize = "[ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff%4294967295]:65535".len();
/// The longest VIP as `VipAddr` writes it.
const MAX_VIP_TEXT: usize = MAX_SOCKET_ADDR + "/tcp".len();
/// The longest backend as `BackendAddr` writes it (weight and zone always
/// fit in JSON as they are: digits, and a zone's `A-Z a-z 0-9 . _ -`).
const MAX_BACKEND_TEXT: usize = MAX_SOCKET_ADDR + "@65535,zone=".len() + MAX_ZONE_NAME;
/// The longest algorithm name.
const MAX_ALGORITHM_NAME: usize = {
    let mut longest = 0;
    let mut i = 0;
    while i < Algorithm::ALL.len() {
        let len = Algorithm::ALL[i].name().len();
        if len > longest {
            longest = len;
        }
        i += 1;
    }
    longest
};
/// Room for what another client may add (spaces, escapes) to a request
/// short of the longest.
const SLACK: usize = 4096;
// The bound: what the connections may hold at once stays a few MiB.
const _: () = assert!(MAX_LINE * MAX_CONNECTIONS < 4 << 20);
/// A connection that sends no complete line for this long is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Most control connections served at once; more are refused.
pub const MAX_CONNECTIONS: usize = 16;
/// How long the client waits for the daemon's answer.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);
/// The socket's mode without `--control-group`: root's alone.
const SOCKET_MODE: u32 = 0o600;
/// The socket's mode with `--control-group`: root and that group.
const GROUP_SOCKET_MODE: u32 = 0o660;
/// Pause after a failed accept (e.g. out of file descriptors).
const ACCEPT_RETRY: Duration = Duration::from_millis(100);

pub fn socket_path(instance: &str) -> PathBuf {
    run_file(instance, SOCKET_SUFFIX)
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Request {
    pub command: ControlCommand,
    pub vip: String,
    /// The backend of a backend command (empty for VIP commands).
    #[serde(default)]
    pub backend: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<u32>,
    /// `vip-add`: the new VIP's backends (`IP:PORT@WEIGHT`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub backends: Vec<String>,
    /// `vip-add`: the new VIP's algorithm.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub algorithm: Option<String>,
    /// Who sent it (set by the daemon from `SO_PEERCRED`, never read from
    /// the wire).
    #[serde(skip)]
    pub peer: Option<Peer>,
}

/// A connected process, as the kernel reports it (`SO_PEERCRED`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peer {
    pub pid: Option<i32>,
    pub uid: u32,
    pub gid: u32,
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.pid {
            Some(pid) => write!(f, "pid={pid} uid={} gid={}", self.uid, self.gid),
            None => write!(f, "pid=? uid={} gid={}", self.uid, self.gid),
        }
    }
}

impl Peer {
    fn of(stream: &UnixStream) -> std::io::Result<Self> {
        let cred = stream.peer_cred()?;
        Ok(Self {
            pid: cred.pid(),
            uid: cred.uid(),
            gid: cred.gid(),
        })
    }

    /// Whether this peer may send commands: root, or a member of `group`
    /// by its primary group or by a supplementary group of its process.
    pub fn allowed(&self, group: Option<&ControlGroup>) -> bool {
        if self.uid == 0 {
            return true;
        }
        let Some(group) = group else {
            return false;
        };
        if self.gid == group.gid {
            return true;
        }
        self.pid
            .and_then(|pid| std::fs::read_to_string(format!("/proc/{pid}/status")).ok())
            .is_some_and(|status| supplementary_groups(&status).contains(&group.gid))
    }
}

/// The `Groups:` line of a /proc/PID/status text.
fn supplementary_groups(status: &str) -> Vec<u32> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("Groups:"))
        .map(|groups| {
            groups
                .split_whitespace()
                .filter_map(|g| g.parse().ok())
                .collect()
        })
        .unwrap_or_default()
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

/// Listens on the instance's socket; requests go to `requests`. New
/// backends are resolved on interface `ifindex` first (see [`resolve_first`]).
pub fn serve(
    instance: &str,
    group: Option<ControlGroup>,
    ifindex: u32,
    requests: mpsc::Sender<Pending>,
) -> anyhow::Result<JoinHandle<()>> {
    let path = socket_path(instance);
    // Its directory, shared by every instance whatever its group, was made
    // when the instance lock was taken (`InstanceLock::acquire`, before the
    // daemon starts): the socket's own mode (and each peer's credentials)
    // decide who may connect.
    // Only this process holds the instance lock, so a file here is stale.
    let _ = std::fs::remove_file(&path);
    let listener =
        UnixListener::bind(&path).with_context(|| format!("binding {}", path.display()))?;
    restrict(&path, group.as_ref())?;
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    Ok(tokio::spawn(async move {
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(e) => {
                    warn!("control socket: accept: {e}");
                    sleep(ACCEPT_RETRY).await;
                    continue;
                }
            };
            let peer = match Peer::of(&stream) {
                Ok(peer) => peer,
                Err(e) => {
                    warn!("control socket: no peer credentials: {e}");
                    continue;
                }
            };
            if !peer.allowed(group.as_ref()) {
                warn!(%peer, "control socket: refused a peer that is neither root nor in the control group");
                tokio::spawn(refuse(
                    stream,
                    "permission denied: only root or the control group may use this socket",
                ));
                continue;
            }
            let Ok(permit) = slots.clone().try_acquire_owned() else {
                warn!(%peer, "control socket: refused a connection over the cap of {MAX_CONNECTIONS}");
                tokio::spawn(refuse(stream, "too many control connections; try again"));
                continue;
            };
            let requests = requests.clone();
            tokio::spawn(async move {
                let (read, write) = stream.into_split();
                connection(read, write, peer, Some(ifindex), requests).await;
                drop(permit);
            });
        }
    }))
}

/// Owner root, and [`SOCKET_MODE`], or [`GROUP_SOCKET_MODE`] with group
/// `group`.
fn restrict(path: &Path, group: Option<&ControlGroup>) -> anyhow::Result<()> {
    let gid = group.map_or(0, |g| g.gid);
    std::os::unix::fs::chown(path, Some(0), Some(gid))
        .with_context(|| format!("setting the owner of {}", path.display()))?;
    let mode = if group.is_some() {
        GROUP_SOCKET_MODE
    } else {
        SOCKET_MODE
    };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("restricting {}", path.display()))
}

/// Answers one error line and closes.
async fn refuse(mut stream: UnixStream, why: &str) {
    let _ = timeout(IDLE_TIMEOUT, reply(&mut stream, &Response::failed(why))).await;
}

async fn reply<W: AsyncWrite + Unpin>(write: &mut W, response: &Response) -> std::io::Result<()> {
    let mut text = serde_json::to_string(response).unwrap_or_default();
    text.push('\n');
    write.write_all(text.as_bytes()).await
}

/// What came of reading one request line.
enum Line {
    Text(Vec<u8>),
    TooLong,
    End,
}

/// Reads one line of at most [`MAX_LINE`] bytes, waiting at most
/// [`IDLE_TIMEOUT`] for it.
async fn read_line<R: AsyncRead + Unpin>(reader: &mut TokioBufReader<R>) -> Line {
    let mut buf = Vec::new();
    let mut limited = (&mut *reader).take(MAX_LINE as u64 + 1);
    match timeout(IDLE_TIMEOUT, limited.read_until(b'\n', &mut buf)).await {
        Ok(Ok(0)) | Ok(Err(_)) | Err(_) => Line::End,
        Ok(Ok(_)) if buf.last() == Some(&b'\n') => {
            buf.pop();
            Line::Text(buf)
        }
        Ok(Ok(_)) if buf.len() > MAX_LINE => Line::TooLong,
        // The last line, without a newline, before the end.
        Ok(Ok(_)) => Line::Text(buf),
    }
}

/// Serves one connection: a request per line, an answer per line.
/// `resolve_on`: the interface new backends are resolved on (`None`: not
/// at all, for tests without one).
async fn connection<R, W>(
    read: R,
    mut write: W,
    peer: Peer,
    resolve_on: Option<u32>,
    requests: mpsc::Sender<Pending>,
) where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut reader = TokioBufReader::new(read);
    loop {
        let line = match read_line(&mut reader).await {
            Line::Text(line) => line,
            Line::TooLong => {
                let why = format!("request line longer than {MAX_LINE} bytes");
                let _ = timeout(IDLE_TIMEOUT, reply(&mut write, &Response::failed(why))).await;
                return;
            }
            Line::End => return,
        };
        let response = match serde_json::from_slice::<Request>(&line) {
            Ok(mut request) => {
                request.peer = Some(peer);
                // Quoted: the text is the peer's, not checked yet.
                info!(%peer, command = ?request.command, vip = ?request.vip, backend = ?request.backend, "control command received");
                match (request.command, resolve_on) {
                    (ControlCommand::Add, Some(ifindex)) => {
                        resolve_first(ifindex, [&request.backend]).await;
                    }
                    (ControlCommand::VipAdd, Some(ifindex)) => {
                        resolve_first(ifindex, &request.backends).await;
                    }
                    _ => {}
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
        match timeout(IDLE_TIMEOUT, reply(&mut write, &response)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                warn!(%peer, "control socket: {e}");
                return;
            }
            Err(_) => return,
        }
    }
}

/// How often [`resolve_first`] looks at the kernel's neighbour table.
const RESOLVE_POLL: Duration = Duration::from_millis(5);

/// Makes the kernel resolve new backends' MACs on interface `ifindex`
/// before they can be selected, so their first flows are not dropped for
/// want of a next hop: returns as soon as every one has a usable neighbour
/// entry (at once for a known address), after probing the others, and at
/// the latest after [`STARTUP_RESOLVE_WAIT`] (an address that never
/// answers is added anyway; its flows wait for ARP like any other).
async fn resolve_first(ifindex: u32, backends: impl IntoIterator<Item = &String>) {
    use crate::kernel::neighbours::{STARTUP_RESOLVE_WAIT, netlink, probe};
    let wanted: Vec<std::net::IpAddr> = backends
        .into_iter()
        .filter_map(|b| b.parse::<crate::settings::addr::BackendAddr>().ok())
        .map(|b| b.addr.ip())
        // No host has these: the command is refused, with no wait.
        .filter(|ip| crate::settings::config::not_a_host(*ip).is_none())
        .collect();
    if wanted.is_empty() {
        return;
    }
    let deadline = tokio::time::Instant::now() + STARTUP_RESOLVE_WAIT;
    let mut probed = false;
    loop {
        let known = tokio::task::spawn_blocking(move || netlink::dump(ifindex)).await;
        let missing: Vec<_> = match known {
            Ok(Ok(known)) => wanted
                .iter()
                .filter(|ip| !known.iter().any(|(k, _)| k == *ip))
                .copied()
                .collect(),
            // No answer from the kernel: probe all and wait it out.
            _ => wanted.clone(),
        };
        if missing.is_empty() {
            return;
        }
        if !probed {
            missing.iter().for_each(|ip| probe(*ip));
            probed = true;
        }
        if tokio::time::Instant::now() >= deadline {
            return;
        }
        sleep(RESOLVE_POLL).await;
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
            command: ControlCommand::Weight,
            vip: "10.0.0.100:80".into(),
            backend: "10.0.0.21:8080".into(),
            weight: Some(3),
            backends: Vec::new(),
            algorithm: None,
            peer: None,
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

    const ROOT_PEER: Peer = Peer {
        pid: None,
        uid: 0,
        gid: 0,
    };

    #[test]
    fn only_root_or_the_control_group_is_allowed() {
        let ops = ControlGroup {
            name: "lbops".into(),
            gid: 4242,
        };
        let user = |uid, gid| Peer {
            pid: None,
            uid,
            gid,
        };
        assert!(ROOT_PEER.allowed(None));
        assert!(!user(65534, 65534).allowed(None));
        assert!(!user(65534, 65534).allowed(Some(&ops)));
        assert!(user(1000, 4242).allowed(Some(&ops)));
        assert!(!user(1000, 4242).allowed(None));
        let status = "Name:\tx\nUid:\t1000\t1000\t1000\t1000\nGroups:\t4 24 4242 \nNgid:\t0\n";
        assert_eq!(supplementary_groups(status), [4, 24, 4242]);
        assert_eq!(supplementary_groups("Groups:\n"), Vec::<u32>::new());
        // This test's own process, by pid: its supplementary groups count.
        let me = Peer {
            pid: Some(std::process::id() as i32),
            uid: 65534,
            gid: 65534,
        };
        let own = supplementary_groups(&std::fs::read_to_string("/proc/self/status").unwrap());
        if let Some(&gid) = own.iter().find(|&&g| g != 65534) {
            let group = ControlGroup {
                name: "mine".into(),
                gid,
            };
            assert!(me.allowed(Some(&group)));
        }
    }

    /// Runs `connection` on one end of a pipe, answering every request
    /// with backend id 1.
    fn serve_pipe() -> tokio::io::DuplexStream {
        let (client, server) = tokio::io::duplex(1 << 20);
        let (tx, mut rx) = mpsc::channel::<Pending>(4);
        tokio::spawn(async move {
            while let Some((_, reply)) = rx.recv().await {
                let _ = reply.send(Response::done(1));
            }
        });
        tokio::spawn(async move {
            let (read, write) = tokio::io::split(server);
            connection(read, write, ROOT_PEER, None, tx).await;
        });
        client
    }

    async fn answer_lines(client: tokio::io::DuplexStream) -> Vec<String> {
        let mut lines = TokioBufReader::new(client).lines();
        let mut out = Vec::new();
        while let Ok(Some(line)) = lines.next_line().await {
            out.push(line);
        }
        out
    }

    const DRAIN: &str = r#"{"command":"drain","vip":"10.0.0.100:80","backend":"10.0.0.21:80"}"#;

    #[tokio::test]
    async fn the_limit_is_per_line_and_a_longer_line_ends_the_connection() {
        let mut client = serve_pipe();
        // Many requests, far more than one line's limit in all.
        let lines = MAX_LINE * 4 / DRAIN.len();
        for _ in 0..lines {
            client
                .write_all(format!("{DRAIN}\n").as_bytes())
                .await
                .unwrap();
        }
        client.write_all(&vec![b' '; MAX_LINE + 1]).await.unwrap();
        client
            .write_all(format!("\n{DRAIN}\n").as_bytes())
            .await
            .unwrap();
        let answers = answer_lines(client).await;
        assert_eq!(answers.len(), lines + 1, "{answers:?}");
        assert!(
            answers[..lines]
                .iter()
                .all(|a| a == r#"{"ok":true,"backend_id":1}"#)
        );
        assert!(
            answers[lines].contains(&format!("longer than {MAX_LINE} bytes")),
            "{}",
            answers[lines]
        );
    }

    /// A `vip-add` of the most backends a VIP may have, each of the
    /// longest text our client writes: IPv6 with a scope id, the highest
    /// port and weight, a zone of the longest name.
    fn longest_vip_add() -> Request {
        use std::net::{Ipv6Addr, SocketAddr, SocketAddrV6};

        use crate::settings::addr::{BackendAddr, VipAddr, Weight};

        // Unique local addresses whose eight groups all have four digits.
        const TOP: u128 = 0xfdff_ffff_ffff_ffff_ffff_ffff_ffff_ffff;
        let zone = "z".repeat(MAX_ZONE_NAME).parse().unwrap();
        let backends: Vec<String> = (0..MAX_BACKENDS_PER_VIP)
            .map(|i| {
                let ip = Ipv6Addr::from(TOP - u128::from(i));
                let addr = SocketAddr::V6(SocketAddrV6::new(ip, u16::MAX, 0, u32::MAX));
                let b = BackendAddr {
                    addr,
                    weight: Weight::new(u64::from(u16::MAX)).unwrap(),
                    zone: Some(zone),
                };
                b.to_string()
            })
            .collect();
        assert!(
            backends.iter().all(|b| b.len() == MAX_BACKEND_TEXT),
            "{}",
            backends[0]
        );
        let vip = VipAddr {
            addr: SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(TOP - 1024),
                u16::MAX,
                0,
                u32::MAX,
            )),
            protocol: crate::settings::addr::Protocol::Tcp,
        };
        assert_eq!(vip.to_string().len(), MAX_VIP_TEXT);
        Request {
            command: ControlCommand::VipAdd,
            vip: vip.to_string(),
            backend: String::new(),
            weight: None,
            backends,
            algorithm: Some(Algorithm::WeightedRoundRobin.name().to_string()),
            peer: None,
        }
    }

    #[tokio::test]
    async fn a_vip_add_of_the_most_backends_of_the_longest_text_is_read_whole() {
        let request = longest_vip_add();
        let line = serde_json::to_string(&request).unwrap();
        assert!(line.len() <= MAX_LINE, "{} > {MAX_LINE}", line.len());
        assert_eq!(MAX_LINE, 143_670, "README's control socket limits say so");
        // Not much more, either: the bound is the point.
        assert!(
            MAX_LINE - line.len() <= SLACK + 256,
            "{MAX_LINE} for {}",
            line.len()
        );
        // The reader takes it whole, and it parses back as sent.
        let (mut client, server) = tokio::io::duplex(1 << 20);
        client
            .write_all(format!("{line}\n").as_bytes())
            .await
            .unwrap();
        drop(client);
        let mut reader = TokioBufReader::new(server);
        let Line::Text(read) = read_line(&mut reader).await else {
            panic!("a {}-byte vip-add was not read as one line", line.len());
        };
        assert_eq!(serde_json::from_slice::<Request>(&read).unwrap(), request);
        // And the connection answers it.
        let mut client = serve_pipe();
        client
            .write_all(format!("{line}\n").as_bytes())
            .await
            .unwrap();
        client.shutdown().await.unwrap();
        assert_eq!(
            answer_lines(client).await,
            [r#"{"ok":true,"backend_id":1}"#]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_connection_is_closed() {
        let mut client = serve_pipe();
        client
            .write_all(format!("{DRAIN}\n").as_bytes())
            .await
            .unwrap();
        let started = tokio::time::Instant::now();
        // Half a line, then nothing.
        client.write_all(b"{\"command\"").await.unwrap();
        let answers = answer_lines(client).await;
        assert_eq!(answers.len(), 1);
        assert_eq!(started.elapsed().as_secs(), IDLE_TIMEOUT.as_secs());
    }
}
