//! Active health checks: one tokio task per checked endpoint, connecting
//! from the balancer host straight to the backend address (not through
//! the VIP). A TCP check passes when the connect completes; an HTTP check
//! sends `GET path` and passes on the expected status. Results go to the
//! event loop, which feeds them to the backend's lifecycle (rise/fall).
//!
//! A server behind several VIPs (a TCP and a UDP service of one host, say)
//! has a backend id in each, but it is one server: the ids that share an
//! address and a check share one task, whose every result goes to each of
//! them (HAProxy's `track`, without having to write it). An HTTP check
//! costs the server a request's service time, and on a pool near its
//! capacity that is not free: in the `stall` benchmark at 85 %, checking
//! each of the two VIPs' ids apart every second (20 checks a second, 1 %
//! of the load) moved least connections' median from 13.4 to 22 ms.
//!
//! Each check is also timed, as a latency probe (issue 13): an HTTP check
//! from the request's last byte to the response's first, what the kernel
//! measures for a user request; a TCP check its connect time, which only
//! shows the backend's kernel answering (a lower bound). The event loop
//! feeds the timing to the latency estimate of a backend users avoid (see
//! [`crate::estimate::latency`]). While the runtime marks a backend as
//! avoided, its HTTP check also runs every `latency_probe` interval, not
//! only every `interval`; those extra checks are [`Purpose::LatencyProbe`]
//! and never count towards rise and fall.
//!
//! While a check's connection is open, the checker says so
//! ([`OnConnection`]; the runtime adds it to the kernel's in-flight count
//! of the backend): an HTTP check occupies the backend like a user request
//! does, and P2C should not send a user to a backend busy answering one.
//! A guard clears the mark when the check ends, times out, panics or is
//! aborted.
//!
//! Each check runs under a supervisor: a check that panics is reported to
//! the checker's `on_panic` and started again one interval later, so a bug
//! in one check neither stops the daemon nor silently ends that backend's
//! checks.

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
    sync::mpsc,
    task::JoinHandle,
    time::{Instant, MissedTickBehavior, interval, sleep, sleep_until, timeout},
};
use tracing::debug;

use crate::{
    estimate::latency::ProbeSample,
    settings::{
        faults::{self, Fault},
        ops::{HealthCheck, HttpCheck},
    },
};

/// Most bytes of a response read looking for the status line.
const MAX_STATUS_LINE: usize = 1024;
/// Each regular check comes `interval × (1 ± CHECK_SPREAD)` after the
/// previous one, at random (HAProxy's `spread-checks`). Without it every
/// backend's check starts at the same instant each interval, since the
/// tasks are spawned together: for an HTTP check that costs the backend a
/// request's service time, the whole pool loses a worker at once.
const CHECK_SPREAD: f64 = 0.25;

/// One check's outcome.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckResult {
    pub backend: u32,
    /// Every id that shares this check (one server behind several VIPs,
    /// ascending, `backend` among them): a timeout is judged against all
    /// their users ([`CheckResult::counted`]).
    pub server: Arc<[u32]>,
    /// The address checked: a result for an id since given to another
    /// backend is ignored.
    pub addr: SocketAddr,
    pub passed: bool,
    pub purpose: Purpose,
    /// What the check measured: `Response` for a passed HTTP check,
    /// `AtLeast` for a TCP connect or a timeout, nothing for a failure.
    pub latency: Option<ProbeSample>,
}

impl CheckResult {
    /// How this regular check counts towards rise and fall, given whether
    /// users' requests to the backend were answered within the check's
    /// wait (`answered_within(wait)`). A check that timed out while they
    /// were counts as [`Counted::Busy`].
    pub fn counted(&self, answered_within: impl FnOnce(Duration) -> bool) -> Counted {
        if self.passed {
            return Counted::Passed;
        }
        match self.latency {
            // A failed check measures only its timeout (`check_once`).
            Some(ProbeSample::AtLeast(wait)) if answered_within(wait) => Counted::Busy,
            _ => Counted::Failed,
        }
    }
}

/// How a regular check counts towards rise and fall.
///
/// An HTTP check's request waits for a worker like a user's. On a backend
/// whose queue is longer than the check's timeout, it times out while the
/// backend goes on answering users. Counted as a failure, two such checks
/// take a busy backend out of service, and its load moves to the others,
/// which is how an overload spreads. (In the `stall` benchmark at 85 %, our
/// round robin's median went from 12.8 to 68 ms that way: the stallers'
/// queues outgrew the 500 ms timeout.) So a timeout counts as a failure
/// only if users got no answer during the check's wait either. A backend
/// that refuses, resets or answers with the wrong status still fails at
/// once; a dead or frozen one answers no one and fails as before.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counted {
    Passed,
    Failed,
    /// Timed out while users' requests were being answered: neither a
    /// pass nor a failure.
    Busy,
}

/// Regular checks of one backend, by how they counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CheckCounts {
    pub passed: u64,
    pub failed: u64,
    pub busy: u64,
}

impl CheckCounts {
    pub fn add(&mut self, counted: Counted) {
        match counted {
            Counted::Passed => self.passed += 1,
            Counted::Failed => self.failed += 1,
            Counted::Busy => self.busy += 1,
        }
    }
}

/// Why a check ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purpose {
    /// The regular check every interval: counts towards rise and fall.
    Health,
    /// An extra check of an avoided backend: only its timing is used.
    LatencyProbe,
}

/// One endpoint's check task: the backend ids it reports to, and the
/// runtime's mark "avoided" (set while any of them is).
struct Task {
    check: HealthCheck,
    /// Ascending, without repeats.
    backends: Arc<[u32]>,
    avoided: Arc<AtomicBool>,
    handle: JoinHandle<()>,
}

/// Told of a check task that panicked: the backend id and the panic's message.
pub type OnPanic = Arc<dyn Fn(u32, &str) + Send + Sync>;

/// Told when a check opens (`true`) and ends (`false`) its connection to
/// backend `id`.
pub type OnConnection = Arc<dyn Fn(u32, bool) + Send + Sync>;

/// Marks backends as holding a check's connection until dropped (every
/// id of the endpoint checked: it occupies the one server behind them).
struct CheckInFlight {
    backends: Arc<[u32]>,
    on_connection: OnConnection,
}

impl CheckInFlight {
    fn start(backends: &Arc<[u32]>, on_connection: &OnConnection) -> Self {
        for &id in backends.iter() {
            on_connection(id, true);
        }
        Self {
            backends: backends.clone(),
            on_connection: on_connection.clone(),
        }
    }
}

impl Drop for CheckInFlight {
    fn drop(&mut self) {
        for &id in self.backends.iter() {
            (self.on_connection)(id, false);
        }
    }
}

/// The running check tasks, one per checked endpoint, by address.
pub struct HealthChecker {
    tasks: HashMap<SocketAddr, Vec<Task>>,
    results: mpsc::Sender<CheckResult>,
    on_panic: OnPanic,
    on_connection: OnConnection,
}

impl HealthChecker {
    pub fn new(
        results: mpsc::Sender<CheckResult>,
        on_panic: OnPanic,
        on_connection: OnConnection,
    ) -> Self {
        Self {
            tasks: HashMap::new(),
            results,
            on_panic,
            on_connection,
        }
    }

    /// Runs exactly the checks in `wanted` (backend id, address, check):
    /// one task per address and check, for all the ids that share them.
    /// Starts new ones, stops the rest; an endpoint whose set of ids
    /// changed is checked by a new task. Linear in the number of backends
    /// (tasks and wanted checks are found by address).
    pub fn sync(&mut self, wanted: Vec<(u32, SocketAddr, HealthCheck)>) {
        let mut wanted = endpoints(wanted);
        // A running task that serves a wanted endpoint keeps running, and
        // the endpoint is taken off the list; what is left starts below.
        self.tasks.retain(|addr, tasks| {
            let mut groups = wanted.get_mut(addr);
            tasks.retain(|task| {
                let served = groups.as_mut().and_then(|groups| {
                    let i = groups.iter().position(|(check, ids)| {
                        *check == task.check && ids[..] == task.backends[..]
                    })?;
                    Some(groups.swap_remove(i))
                });
                if served.is_none() {
                    task.handle.abort();
                }
                served.is_some()
            });
            !tasks.is_empty()
        });
        for (addr, groups) in wanted {
            for (check, ids) in groups {
                let backends: Arc<[u32]> = ids.into();
                let avoided = Arc::new(AtomicBool::new(false));
                let handle = tokio::spawn(supervise(
                    Target {
                        backends: backends.clone(),
                        addr,
                        check: check.clone(),
                        avoided: avoided.clone(),
                        on_connection: self.on_connection.clone(),
                    },
                    self.results.clone(),
                    self.on_panic.clone(),
                ));
                self.tasks.entry(addr).or_default().push(Task {
                    check,
                    backends,
                    avoided,
                    handle,
                });
            }
        }
    }

    /// Marks the backends users avoid: their HTTP checks then also run
    /// every latency probe interval (an endpoint's, while any of its ids
    /// is avoided).
    pub fn set_avoided(&self, avoided: impl Fn(u32) -> bool) {
        for task in self.tasks.values().flatten() {
            let any = task.backends.iter().any(|&id| avoided(id));
            task.avoided.store(any, Ordering::Relaxed);
        }
    }

    /// How many endpoints are being checked.
    pub fn endpoints(&self) -> usize {
        self.tasks.values().map(Vec::len).sum()
    }
}

/// The checks of `wanted` by address: each distinct check of an address
/// with the ids that share it, ascending. (An address has one check in
/// all but unusual configurations, so the inner lists are short.)
fn endpoints(
    wanted: Vec<(u32, SocketAddr, HealthCheck)>,
) -> HashMap<SocketAddr, Vec<(HealthCheck, Vec<u32>)>> {
    let mut by_addr: HashMap<SocketAddr, Vec<(HealthCheck, Vec<u32>)>> = HashMap::new();
    for (id, addr, check) in wanted {
        let groups = by_addr.entry(addr).or_default();
        match groups.iter_mut().find(|(c, _)| *c == check) {
            Some((_, ids)) => ids.push(id),
            None => groups.push((check, vec![id])),
        }
    }
    for (_, ids) in by_addr.values_mut().flatten() {
        ids.sort_unstable();
        ids.dedup();
    }
    by_addr
}

impl Drop for HealthChecker {
    fn drop(&mut self) {
        for task in self.tasks.values().flatten() {
            task.handle.abort();
        }
    }
}

/// What one check task checks, and for which backend ids.
#[derive(Clone)]
struct Target {
    backends: Arc<[u32]>,
    addr: SocketAddr,
    check: HealthCheck,
    avoided: Arc<AtomicBool>,
    on_connection: OnConnection,
}

/// Runs an endpoint's checks; restarts them one interval after a panic
/// (reported under its lowest backend id). Aborting this task aborts the
/// check it runs.
async fn supervise(target: Target, out: mpsc::Sender<CheckResult>, on_panic: OnPanic) {
    let backend = target.backends.first().copied().unwrap_or_default();
    let interval = target.check.interval;
    loop {
        let task = tokio::spawn(run(target.clone(), out.clone()));
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
                sleep(interval).await;
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

/// Checks every interval, and every latency probe interval while the
/// backend is avoided (HTTP only: a connect time cannot bring an estimate
/// down, and only when that is more often than the regular checks).
async fn run(target: Target, out: mpsc::Sender<CheckResult>) {
    let Target {
        backends,
        addr,
        check,
        avoided,
        on_connection,
    } = target;
    let backend = backends.first().copied().unwrap_or_default();
    // The first check at once, then spread (see `CHECK_SPREAD`).
    let mut next_health = Instant::now();
    let probe_every = check
        .latency_probe
        .filter(|p| check.http.is_some() && *p < check.interval);
    let mut probe = interval(probe_every.unwrap_or(check.interval));
    probe.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        let purpose = tokio::select! {
            biased;
            () = sleep_until(next_health) => Purpose::Health,
            _ = probe.tick(), if probe_every.is_some() => Purpose::LatencyProbe,
        };
        if purpose == Purpose::Health {
            next_health = Instant::now() + spread(check.interval, rand::random::<f64>());
        }
        if purpose == Purpose::LatencyProbe && !avoided.load(Ordering::Relaxed) {
            continue;
        }
        if faults::trip(Fault::HealthPanic) {
            panic!("injected fault: health-panic (backend {backend})");
        }
        let in_flight = CheckInFlight::start(&backends, &on_connection);
        let (passed, latency) = check_once(addr, &check).await;
        drop(in_flight);
        // The next extra check comes one probe interval after any check.
        probe.reset();
        debug!(?backends, %addr, passed, ?purpose, ?latency, "health check");
        for &id in backends.iter() {
            let result = CheckResult {
                backend: id,
                server: backends.clone(),
                addr,
                passed,
                purpose,
                latency,
            };
            if out.send(result).await.is_err() {
                return;
            }
        }
    }
}

/// `interval` scaled by `1 - CHECK_SPREAD + 2·CHECK_SPREAD·unit`, for
/// `unit` in `[0, 1)`.
fn spread(interval: Duration, unit: f64) -> Duration {
    interval.mul_f64(1.0 - CHECK_SPREAD + 2.0 * CHECK_SPREAD * unit.clamp(0.0, 1.0))
}

/// One check within the check's timeout: passed, and what it measured (a
/// timeout counts as a latency of at least the timeout).
async fn check_once(addr: SocketAddr, check: &HealthCheck) -> (bool, Option<ProbeSample>) {
    match timeout(check.timeout, probe(addr, check.http.as_ref())).await {
        Ok(Ok(m)) => (m.passed, m.latency),
        Ok(Err(_)) => (false, None),
        Err(_) => (false, Some(ProbeSample::AtLeast(check.timeout))),
    }
}

/// What one check found.
#[derive(Debug)]
struct Measured {
    passed: bool,
    latency: Option<ProbeSample>,
}

/// One check; `passed: false` for a wrong HTTP status (whose timing is
/// not used: a fast error says nothing about how fast the backend serves).
async fn probe(addr: SocketAddr, http: Option<&HttpCheck>) -> std::io::Result<Measured> {
    let started = Instant::now();
    let mut stream = TcpStream::connect(addr).await?;
    let Some(http) = http else {
        return Ok(Measured {
            passed: true,
            latency: Some(ProbeSample::AtLeast(started.elapsed())),
        });
    };
    let request = format!(
        "GET {} HTTP/1.1\r\nHost: {addr}\r\nUser-Agent: lb-user-health\r\nConnection: close\r\n\r\n",
        http.path
    );
    stream.write_all(request.as_bytes()).await?;
    let sent = Instant::now();
    let mut first_byte: Option<Duration> = None;
    let mut buf = Vec::with_capacity(256);
    let mut chunk = [0u8; 256];
    while !buf.contains(&b'\n') && buf.len() < MAX_STATUS_LINE {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        first_byte.get_or_insert_with(|| sent.elapsed());
        buf.extend_from_slice(&chunk[..n]);
    }
    let passed = status_code(&buf) == Some(http.status);
    Ok(Measured {
        passed,
        latency: first_byte.filter(|_| passed).map(ProbeSample::Response),
    })
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

    fn result(passed: bool, latency: Option<ProbeSample>) -> CheckResult {
        CheckResult {
            backend: 3,
            server: Arc::from([3]),
            addr: "10.0.0.3:80".parse().unwrap(),
            passed,
            purpose: Purpose::Health,
            latency,
        }
    }

    #[test]
    fn a_timeout_while_users_are_answered_counts_busy_and_any_other_failure_fails() {
        let timeout = Duration::from_millis(500);
        let timed_out = result(false, Some(ProbeSample::AtLeast(timeout)));
        // Users were answered within the check's own wait: busy.
        let mut asked = None;
        let counted = timed_out.counted(|wait| {
            asked = Some(wait);
            true
        });
        assert_eq!(counted, Counted::Busy);
        assert_eq!(asked, Some(timeout), "asked about the check's wait");
        // Nobody was answered (a dead or frozen backend): a failure.
        assert_eq!(timed_out.counted(|_| false), Counted::Failed);
        // A refused connection or a wrong status fails whatever users see.
        assert_eq!(result(false, None).counted(|_| true), Counted::Failed);
        // A pass is a pass, and a TCP check's connect time is a pass too.
        let fast = Some(ProbeSample::Response(Duration::from_millis(5)));
        assert_eq!(result(true, fast).counted(|_| false), Counted::Passed);
        let connect = Some(ProbeSample::AtLeast(Duration::from_millis(1)));
        assert_eq!(result(true, connect).counted(|_| false), Counted::Passed);
    }

    #[test]
    fn check_counts_add_up_by_kind() {
        let mut counts = CheckCounts::default();
        for c in [
            Counted::Passed,
            Counted::Busy,
            Counted::Failed,
            Counted::Busy,
        ] {
            counts.add(c);
        }
        assert_eq!(
            counts,
            CheckCounts {
                passed: 1,
                failed: 1,
                busy: 2
            }
        );
    }

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
        let tcp = probe(addr, None).await.unwrap();
        assert!(tcp.passed);
        // A connect time only bounds the latency from below.
        assert!(
            matches!(tcp.latency, Some(ProbeSample::AtLeast(_))),
            "{tcp:?}"
        );
        let http = |path: &str| HttpCheck {
            path: path.into(),
            status: 200,
        };
        let ok = probe(addr, Some(&http("/ok"))).await.unwrap();
        assert!(ok.passed);
        assert!(
            matches!(ok.latency, Some(ProbeSample::Response(_))),
            "{ok:?}"
        );
        // A wrong status fails, and its timing is not used.
        let missing = probe(addr, Some(&http("/missing"))).await.unwrap();
        assert!(!missing.passed);
        assert_eq!(missing.latency, None);
        // Nothing listens on port 1 of loopback.
        assert!(probe("127.0.0.1:1".parse().unwrap(), None).await.is_err());
    }

    /// A server answering `/` after `delay`, on a fresh loopback port.
    async fn slow_server(delay: Duration) -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 512];
                    let _ = s.read(&mut buf).await;
                    sleep(delay).await;
                    let _ = s.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await;
                });
            }
        });
        addr
    }

    fn http_check(interval: Duration, latency_probe: Option<Duration>) -> HealthCheck {
        HealthCheck {
            http: Some(HttpCheck {
                path: "/".into(),
                status: 200,
            }),
            interval,
            timeout: Duration::from_millis(500),
            rise: 2,
            fall: 2,
            latency_probe,
        }
    }

    #[tokio::test]
    async fn an_http_check_is_timed_from_request_to_first_byte() {
        let addr = slow_server(Duration::from_millis(40)).await;
        let check = http_check(Duration::from_secs(1), None);
        let (passed, latency) = check_once(addr, &check).await;
        assert!(passed);
        let Some(ProbeSample::Response(latency)) = latency else {
            panic!("{latency:?}");
        };
        // Loose: other builds share this machine.
        assert!(latency >= Duration::from_millis(40), "{latency:?}");
        assert!(latency < Duration::from_millis(400), "{latency:?}");
    }

    #[tokio::test]
    async fn a_check_that_times_out_gives_a_lower_bound_and_fails() {
        let addr = slow_server(Duration::from_secs(5)).await;
        let mut check = http_check(Duration::from_secs(1), None);
        check.timeout = Duration::from_millis(50);
        let (passed, latency) = check_once(addr, &check).await;
        assert!(!passed);
        assert_eq!(
            latency,
            Some(ProbeSample::AtLeast(Duration::from_millis(50)))
        );
    }

    #[tokio::test]
    async fn an_avoided_backend_is_probed_every_probe_interval_and_only_then() {
        let addr = slow_server(Duration::ZERO).await;
        let (tx, mut rx) = mpsc::channel(64);
        let mut checker = HealthChecker::new(tx, Arc::new(|_, _| {}), Arc::new(|_, _| {}));
        let check = http_check(Duration::from_secs(1), Some(Duration::from_millis(50)));
        checker.sync(vec![(3, addr, check)]);
        // Not avoided: only the regular check (the first comes at once).
        sleep(Duration::from_millis(600)).await;
        let mut regular = Vec::new();
        while let Ok(r) = rx.try_recv() {
            regular.push(r.purpose);
        }
        assert_eq!(regular, [Purpose::Health]);
        // Avoided: extra checks about every 50 ms, measuring only.
        checker.set_avoided(|id| id == 3);
        sleep(Duration::from_millis(350)).await;
        checker.set_avoided(|_| false);
        let mut probes = 0;
        while let Ok(r) = rx.try_recv() {
            if r.purpose == Purpose::LatencyProbe {
                probes += 1;
                assert!(r.passed);
                assert!(matches!(r.latency, Some(ProbeSample::Response(_))));
            }
        }
        assert!((2..=8).contains(&probes), "{probes} probes in 350 ms");
    }

    /// Every `(backend, open)` an [`OnConnection`] was told, in order.
    type Marks = Arc<std::sync::Mutex<Vec<(u32, bool)>>>;

    /// What a checker told its [`OnConnection`], in order.
    fn recorder() -> (OnConnection, Marks) {
        let marks = Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = marks.clone();
        let on: OnConnection = Arc::new(move |id, open| {
            sink.lock().expect("marks").push((id, open));
        });
        (on, marks)
    }

    #[tokio::test]
    async fn a_check_counts_as_a_connection_while_it_runs() {
        let addr = slow_server(Duration::from_millis(300)).await;
        let (tx, mut rx) = mpsc::channel(64);
        let (on, marks) = recorder();
        let mut checker = HealthChecker::new(tx, Arc::new(|_, _| {}), on);
        checker.sync(vec![(5, addr, http_check(Duration::from_secs(10), None))]);
        sleep(Duration::from_millis(100)).await;
        assert_eq!(*marks.lock().expect("marks"), [(5, true)]);
        let result = rx.recv().await.expect("a result");
        assert!(result.passed);
        // The mark is cleared before the result is sent.
        assert_eq!(*marks.lock().expect("marks"), [(5, true), (5, false)]);
    }

    #[tokio::test]
    async fn a_check_stopped_halfway_clears_its_mark() {
        let addr = slow_server(Duration::from_secs(5)).await;
        let (tx, _rx) = mpsc::channel(64);
        let (on, marks) = recorder();
        let mut checker = HealthChecker::new(tx, Arc::new(|_, _| {}), on);
        checker.sync(vec![(7, addr, http_check(Duration::from_secs(10), None))]);
        sleep(Duration::from_millis(100)).await;
        assert_eq!(*marks.lock().expect("marks"), [(7, true)]);
        // The backend leaves: its task is aborted in the middle of the check.
        checker.sync(vec![]);
        sleep(Duration::from_millis(100)).await;
        assert_eq!(*marks.lock().expect("marks"), [(7, true), (7, false)]);
    }

    /// A server answering `/` at once, on a fresh loopback port, and the
    /// number of connections it accepted.
    async fn counting_server() -> (SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut buf = [0u8; 512];
                    let _ = s.read(&mut buf).await;
                    let _ = s.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await;
                });
            }
        });
        (addr, accepted)
    }

    #[tokio::test]
    async fn ids_of_one_server_share_one_check_and_each_gets_its_result() {
        let (shared, shared_count) = counting_server().await;
        let (alone, alone_count) = counting_server().await;
        let (tx, mut rx) = mpsc::channel(64);
        let (on, marks) = recorder();
        let mut checker = HealthChecker::new(tx, Arc::new(|_, _| {}), on);
        let check = http_check(Duration::from_secs(10), None);
        // Ids 8 and 3 are one server behind two VIPs; id 5 is another one;
        // id 9 is the first server with another check (its own task).
        let mut other = check.clone();
        other.http = Some(HttpCheck {
            path: "/other".into(),
            status: 200,
        });
        checker.sync(vec![
            (8, shared, check.clone()),
            (5, alone, check.clone()),
            (3, shared, check.clone()),
            (9, shared, other),
        ]);
        assert_eq!(checker.endpoints(), 3);
        // The first checks come at once; the next in 7.5 s or more.
        let mut results = Vec::new();
        while results.len() < 4 {
            let r = tokio::time::timeout(Duration::from_secs(5), rx.recv())
                .await
                .expect("four results in time")
                .expect("a result");
            // Each result names every id of its check: one per VIP the
            // server is behind.
            let want = if matches!(r.backend, 3 | 8) {
                vec![3, 8]
            } else {
                vec![r.backend]
            };
            assert_eq!(
                r.server.to_vec(),
                want,
                "ids sharing id {}'s check",
                r.backend
            );
            results.push((r.backend, r.addr, r.passed));
        }
        results.sort_unstable();
        assert_eq!(
            results,
            [
                (3, shared, true),
                (5, alone, true),
                (8, shared, true),
                (9, shared, true)
            ]
        );
        // One connection for ids 3 and 8 together, one for id 9's check.
        assert_eq!(shared_count.load(Ordering::SeqCst), 2);
        assert_eq!(alone_count.load(Ordering::SeqCst), 1);
        // The shared check counted as a connection of both ids while it ran.
        let marks = marks.lock().expect("marks").clone();
        for id in [3, 8] {
            assert_eq!(
                marks.iter().filter(|m| m.0 == id).collect::<Vec<_>>(),
                [&(id, true), &(id, false)],
                "{marks:?}"
            );
        }
        // The same wanted set keeps the tasks (no new checks)...
        checker.sync(vec![
            (3, shared, check.clone()),
            (8, shared, check.clone()),
            (5, alone, check.clone()),
        ]);
        assert_eq!(checker.endpoints(), 2);
        sleep(Duration::from_millis(200)).await;
        assert_eq!(shared_count.load(Ordering::SeqCst), 2);
        assert_eq!(alone_count.load(Ordering::SeqCst), 1);
        // ...and an endpoint that lost an id is checked by a new task,
        // which reports to the id left only.
        checker.sync(vec![(3, shared, check.clone()), (5, alone, check)]);
        let r = tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .expect("a result in time")
            .expect("a result");
        assert_eq!((r.backend, r.addr), (3, shared));
        sleep(Duration::from_millis(200)).await;
        assert!(rx.try_recv().is_err(), "id 8 is no longer checked");
        assert_eq!(shared_count.load(Ordering::SeqCst), 3);
    }

    #[test]
    fn endpoints_group_ids_by_address_and_check() {
        let a: SocketAddr = "10.0.0.1:80".parse().unwrap();
        let b: SocketAddr = "10.0.0.2:80".parse().unwrap();
        let check = http_check(Duration::from_secs(1), None);
        let mut slower = check.clone();
        slower.interval = Duration::from_secs(5);
        let groups = endpoints(vec![
            (7, a, check.clone()),
            (2, b, check.clone()),
            (4, a, slower.clone()),
            (1, a, check.clone()),
            (1, a, check.clone()),
        ]);
        let mut ids: Vec<(SocketAddr, Duration, Vec<u32>)> = groups
            .into_iter()
            .flat_map(|(addr, checks)| {
                checks
                    .into_iter()
                    .map(move |(c, ids)| (addr, c.interval, ids))
            })
            .collect();
        ids.sort();
        assert_eq!(
            ids,
            [
                (a, Duration::from_secs(1), vec![1, 7]),
                (a, Duration::from_secs(5), vec![4]),
                (b, Duration::from_secs(1), vec![2]),
            ]
        );
    }

    #[test]
    fn checks_are_spread_a_quarter_either_side_of_the_interval() {
        let second = Duration::from_secs(1);
        assert_eq!(spread(second, 0.0), Duration::from_millis(750));
        assert_eq!(spread(second, 0.5), second);
        assert!(spread(second, 0.999_999) < Duration::from_millis(1_250));
        // Out-of-range draws are clamped.
        assert_eq!(spread(second, -3.0), Duration::from_millis(750));
        assert_eq!(spread(second, 7.0), Duration::from_millis(1_250));
        // Two backends' checks drift apart: the draws differ.
        let gaps: std::collections::BTreeSet<Duration> = (0..100)
            .map(|_| spread(second, rand::random::<f64>()))
            .collect();
        assert!(gaps.len() > 90, "{} distinct gaps of 100", gaps.len());
    }
}
