//! Open-loop load generator: requests are launched at a fixed rate whatever
//! happens to the ones already out, and latency is measured from the time a
//! request was *scheduled*, so a stalled server shows up as latency instead of
//! silently slowing the generator down (no coordinated omission).
//!
//! Every request uses a new TCP connection (or a new UDP socket), so every
//! request is a new flow the balancer has to place.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use anyhow::{Context, Result, ensure};
use clap::{Parser, ValueEnum};
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpStream, UdpSocket},
    task::JoinSet,
    time::Instant,
};

use crate::http::{encode_request, parse_response};

/// Histogram range in microseconds: 1 µs to 5 minutes, 3 significant digits.
const HISTOGRAM_MAX_US: u64 = 300_000_000;
const HISTOGRAM_SIGFIG: u8 = 3;
/// Read size while waiting for a response.
const READ_CHUNK: usize = 16 * 1024;
/// Largest UDP reply accepted.
const MAX_DATAGRAM: usize = 65_536;

/// Transport used for each request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    /// One HTTP/1.1 request per new TCP connection (`Connection: close`).
    Tcp,
    /// One datagram per new UDP socket, answered by the backend's echo.
    Udp,
}

/// Command line of `lb-loadgen`, also built by the lab and the demo.
#[derive(Parser, Debug, Clone)]
#[command(name = "lb-loadgen", about = "Open-loop load generator for the lab")]
pub struct LoadConfig {
    /// Address to send requests to (the VIP, or a backend directly).
    #[arg(long)]
    pub target: SocketAddr,
    #[arg(long, value_enum, default_value_t = Protocol::Tcp)]
    pub protocol: Protocol,
    /// Requests per second.
    #[arg(long)]
    pub rate: f64,
    /// How long to keep sending, in seconds.
    #[arg(long)]
    pub duration_s: f64,
    /// Upper bound on the number of requests, whatever rate and duration say.
    #[arg(long, default_value_t = 1_000_000)]
    pub max_requests: u64,
    /// Per-request timeout, from the scheduled send time.
    #[arg(long, default_value_t = 2_000)]
    pub timeout_ms: u64,
    /// Requests allowed in flight at once; a request scheduled while the cap
    /// is reached is not sent and counts as a `concurrency_cap` error.
    #[arg(long, default_value_t = 2_000)]
    pub max_outstanding: usize,
    /// HTTP path to request.
    #[arg(long, default_value = "/")]
    pub path: String,
    /// Request payload size: the HTTP body (echoed back) or the UDP payload.
    #[arg(long, default_value_t = 0)]
    pub payload_bytes: usize,
}

impl LoadConfig {
    /// `rate` requests per second for `duration_s` seconds to `target`, the
    /// way the lab's tests load it: `GET /` without a body, at most 100 000
    /// requests and 2 000 in flight, each with a 5 s timeout.
    pub fn open_loop(target: SocketAddr, protocol: Protocol, rate: f64, duration_s: f64) -> Self {
        Self {
            target,
            protocol,
            rate,
            duration_s,
            max_requests: 100_000,
            timeout_ms: 5_000,
            max_outstanding: 2_000,
            path: "/".into(),
            payload_bytes: 0,
        }
    }

    /// The same load with `bytes` of request payload.
    pub fn with_payload(self, bytes: usize) -> Self {
        Self {
            payload_bytes: bytes,
            ..self
        }
    }

    /// The same load with a per-request timeout of `ms` milliseconds.
    pub fn with_timeout_ms(self, ms: u64) -> Self {
        Self {
            timeout_ms: ms,
            ..self
        }
    }

    /// The command-line arguments that reproduce this configuration.
    pub fn to_args(&self) -> Vec<String> {
        let protocol = match self.protocol {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
        };
        [
            ("--target", self.target.to_string()),
            ("--protocol", protocol.to_string()),
            ("--rate", self.rate.to_string()),
            ("--duration-s", self.duration_s.to_string()),
            ("--max-requests", self.max_requests.to_string()),
            ("--timeout-ms", self.timeout_ms.to_string()),
            ("--max-outstanding", self.max_outstanding.to_string()),
            ("--path", self.path.clone()),
            ("--payload-bytes", self.payload_bytes.to_string()),
        ]
        .into_iter()
        .flat_map(|(flag, value)| [flag.to_string(), value])
        .collect()
    }

    /// Requests the run schedules: rate × duration, capped.
    pub fn total_requests(&self) -> u64 {
        ((self.rate * self.duration_s).ceil() as u64).min(self.max_requests)
    }
}

/// Why a request failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ErrorKind {
    ConcurrencyCap,
    Timeout,
    ConnectRefused,
    Connect,
    Reset,
    Io,
    BadResponse,
    WrongEcho,
}

impl ErrorKind {
    /// Name used as the key in the JSON summary.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ConcurrencyCap => "concurrency_cap",
            Self::Timeout => "timeout",
            Self::ConnectRefused => "connect_refused",
            Self::Connect => "connect",
            Self::Reset => "reset",
            Self::Io => "io",
            Self::BadResponse => "bad_response",
            Self::WrongEcho => "wrong_echo",
        }
    }

    fn from_io(error: &std::io::Error) -> Self {
        use std::io::ErrorKind as Io;
        match error.kind() {
            Io::ConnectionReset | Io::ConnectionAborted | Io::BrokenPipe => Self::Reset,
            _ => Self::Io,
        }
    }
}

/// Latency percentiles in milliseconds.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
    pub mean: f64,
}

/// What a run did, printed as JSON by `lb-loadgen`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Summary {
    /// Requests scheduled (rate × duration, capped).
    pub scheduled: u64,
    /// Requests answered correctly.
    pub completed: u64,
    /// Failed requests by [`ErrorKind`] name.
    pub errors: BTreeMap<String, u64>,
    /// Correct answers by the backend name that served them.
    pub per_backend: BTreeMap<String, u64>,
    /// Latency of completed requests, from their scheduled send time.
    pub latency_ms: Percentiles,
    /// Wall time from the first scheduled send to the last answer.
    pub elapsed_s: f64,
    /// The configured arrival rate.
    pub target_rate: f64,
    /// Every recorded latency as `(microseconds, count)`, so several runs'
    /// histograms can be merged exactly and a whole CDF drawn.
    #[serde(default)]
    pub histogram_us: Vec<(u64, u64)>,
}

impl Summary {
    /// Sum of all errors.
    pub fn error_count(&self) -> u64 {
        self.errors.values().sum()
    }
}

/// Accumulates results while the run is going.
struct Tally {
    latency_us: Histogram<u64>,
    errors: BTreeMap<ErrorKind, u64>,
    per_backend: BTreeMap<String, u64>,
}

impl Tally {
    fn record(&mut self, outcome: Result<(String, Duration), ErrorKind>) {
        match outcome {
            Ok((backend, latency)) => {
                let us = (latency.as_micros() as u64).clamp(1, HISTOGRAM_MAX_US);
                self.latency_us.saturating_record(us);
                *self.per_backend.entry(backend).or_default() += 1;
            }
            Err(kind) => *self.errors.entry(kind).or_default() += 1,
        }
    }

    fn summary(&self, config: &LoadConfig, elapsed: Duration) -> Summary {
        let ms = |us: u64| us as f64 / 1000.0;
        let h = &self.latency_us;
        Summary {
            scheduled: config.total_requests(),
            completed: h.len(),
            errors: self
                .errors
                .iter()
                .map(|(k, v)| (k.as_str().to_string(), *v))
                .collect(),
            per_backend: self.per_backend.clone(),
            latency_ms: Percentiles {
                p50: ms(h.value_at_quantile(0.50)),
                p90: ms(h.value_at_quantile(0.90)),
                p99: ms(h.value_at_quantile(0.99)),
                p999: ms(h.value_at_quantile(0.999)),
                max: ms(h.max()),
                mean: h.mean() / 1000.0,
            },
            elapsed_s: elapsed.as_secs_f64(),
            target_rate: config.rate,
            histogram_us: h
                .iter_recorded()
                .map(|v| (v.value_iterated_to(), v.count_at_value()))
                .collect(),
        }
    }
}

/// What each request task needs.
struct RequestPlan {
    target: SocketAddr,
    protocol: Protocol,
    timeout: Duration,
    /// Complete HTTP request bytes, or the UDP payload.
    request: Vec<u8>,
    /// Body the HTTP response must echo (empty: any body is fine).
    expected_echo: Vec<u8>,
}

/// Runs the configured load and returns its summary.
pub async fn run(config: &LoadConfig) -> Result<Summary> {
    ensure!(
        config.rate > 0.0 && config.rate.is_finite(),
        "--rate must be a positive number"
    );
    ensure!(
        config.duration_s > 0.0 && config.duration_s.is_finite(),
        "--duration-s must be positive"
    );
    ensure!(
        config.max_outstanding > 0,
        "--max-outstanding must be at least 1"
    );
    let payload = payload_pattern(config.payload_bytes);
    let plan = Arc::new(RequestPlan {
        target: config.target,
        protocol: config.protocol,
        timeout: Duration::from_millis(config.timeout_ms),
        request: match config.protocol {
            Protocol::Tcp => {
                let method = if payload.is_empty() { "GET" } else { "POST" };
                encode_request(method, &config.path, &payload, false)
            }
            Protocol::Udp => payload.clone(),
        },
        expected_echo: payload,
    });
    let tally = Arc::new(Mutex::new(Tally {
        latency_us: Histogram::new_with_bounds(1, HISTOGRAM_MAX_US, HISTOGRAM_SIGFIG)
            .context("creating the latency histogram")?,
        errors: BTreeMap::new(),
        per_backend: BTreeMap::new(),
    }));
    let outstanding = Arc::new(AtomicUsize::new(0));
    let mut tasks = JoinSet::new();
    let start = Instant::now();
    for i in 0..config.total_requests() {
        let scheduled = start + Duration::from_secs_f64(i as f64 / config.rate);
        tokio::time::sleep_until(scheduled).await;
        while tasks.try_join_next().is_some() {}
        if outstanding.load(Ordering::Relaxed) >= config.max_outstanding {
            lock(&tally).record(Err(ErrorKind::ConcurrencyCap));
            continue;
        }
        outstanding.fetch_add(1, Ordering::Relaxed);
        let (plan, tally, outstanding) = (plan.clone(), tally.clone(), outstanding.clone());
        tasks.spawn(async move {
            let outcome =
                match tokio::time::timeout_at(scheduled + plan.timeout, one_request(&plan)).await {
                    Ok(Ok(backend)) => Ok((backend, scheduled.elapsed())),
                    Ok(Err(kind)) => Err(kind),
                    Err(_) => Err(ErrorKind::Timeout),
                };
            outstanding.fetch_sub(1, Ordering::Relaxed);
            lock(&tally).record(outcome);
        });
    }
    while tasks.join_next().await.is_some() {}
    let summary = lock(&tally).summary(config, start.elapsed());
    Ok(summary)
}

/// The tally's lock is never held across a panic, so poisoning cannot happen;
/// recovering the guard keeps this total anyway.
fn lock(tally: &Mutex<Tally>) -> std::sync::MutexGuard<'_, Tally> {
    tally
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Deterministic, non-repeating-looking payload so a byte shifted or lost by
/// the NAT shows up as a mismatch.
pub fn payload_pattern(len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(31) ^ (i >> 8)) as u8)
        .collect()
}

/// One request on a fresh connection; returns the name of the backend that answered.
async fn one_request(plan: &RequestPlan) -> Result<String, ErrorKind> {
    match plan.protocol {
        Protocol::Tcp => http_request(plan).await,
        Protocol::Udp => udp_request(plan).await,
    }
}

async fn http_request(plan: &RequestPlan) -> Result<String, ErrorKind> {
    let mut stream = TcpStream::connect(plan.target).await.map_err(|error| {
        if error.kind() == std::io::ErrorKind::ConnectionRefused {
            ErrorKind::ConnectRefused
        } else {
            ErrorKind::Connect
        }
    })?;
    let _ = stream.set_nodelay(true);
    stream
        .write_all(&plan.request)
        .await
        .map_err(|e| ErrorKind::from_io(&e))?;
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; READ_CHUNK];
    let response = loop {
        match parse_response(&buf) {
            Ok(Some((response, _))) => break response,
            Ok(None) => {}
            Err(_) => return Err(ErrorKind::BadResponse),
        }
        let n = stream
            .read(&mut chunk)
            .await
            .map_err(|e| ErrorKind::from_io(&e))?;
        if n == 0 {
            return Err(ErrorKind::BadResponse);
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    if response.status != 200 {
        return Err(ErrorKind::BadResponse);
    }
    if !plan.expected_echo.is_empty() && response.body != plan.expected_echo {
        return Err(ErrorKind::WrongEcho);
    }
    response.backend.ok_or(ErrorKind::BadResponse)
}

async fn udp_request(plan: &RequestPlan) -> Result<String, ErrorKind> {
    let bind: SocketAddr = if plan.target.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    }
    .parse()
    .expect("literal socket address");
    let socket = UdpSocket::bind(bind)
        .await
        .map_err(|e| ErrorKind::from_io(&e))?;
    socket
        .connect(plan.target)
        .await
        .map_err(|_| ErrorKind::Connect)?;
    socket
        .send(&plan.request)
        .await
        .map_err(|e| ErrorKind::from_io(&e))?;
    let mut buf = vec![0u8; MAX_DATAGRAM];
    let n = socket.recv(&mut buf).await.map_err(|error| {
        if error.kind() == std::io::ErrorKind::ConnectionRefused {
            ErrorKind::ConnectRefused
        } else {
            ErrorKind::from_io(&error)
        }
    })?;
    split_udp_reply(&buf[..n], &plan.request)
}

/// Checks a UDP echo (`<name>:<payload>`) and returns the name.
pub fn split_udp_reply(reply: &[u8], payload: &[u8]) -> Result<String, ErrorKind> {
    let colon = reply
        .iter()
        .position(|&b| b == b':')
        .ok_or(ErrorKind::BadResponse)?;
    if &reply[colon + 1..] != payload {
        return Err(ErrorKind::WrongEcho);
    }
    String::from_utf8(reply[..colon].to_vec()).map_err(|_| ErrorKind::BadResponse)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_round_trip_through_the_parser() {
        let config = LoadConfig::parse_from([
            "lb-loadgen",
            "--target",
            "10.0.0.1:80",
            "--rate",
            "250.5",
            "--duration-s",
            "2",
            "--protocol",
            "udp",
            "--payload-bytes",
            "7",
        ]);
        let again = LoadConfig::parse_from(
            std::iter::once("lb-loadgen".to_string()).chain(config.to_args()),
        );
        assert_eq!(again.target, config.target);
        assert_eq!(again.protocol, Protocol::Udp);
        assert_eq!(again.rate, 250.5);
        assert_eq!(again.total_requests(), 501);
        assert_eq!(again.payload_bytes, 7);
    }

    #[test]
    fn udp_replies_are_checked_byte_for_byte() {
        assert_eq!(split_udp_reply(b"be1:abc", b"abc"), Ok("be1".to_string()));
        assert_eq!(
            split_udp_reply(b"be1:abd", b"abc"),
            Err(ErrorKind::WrongEcho)
        );
        assert_eq!(
            split_udp_reply(b"noprefix", b"abc"),
            Err(ErrorKind::BadResponse)
        );
    }

    #[test]
    fn tally_counts_latency_errors_and_backends() {
        let config = LoadConfig::parse_from([
            "lb-loadgen",
            "--target",
            "10.0.0.1:80",
            "--rate",
            "10",
            "--duration-s",
            "1",
        ]);
        let mut tally = Tally {
            latency_us: Histogram::new_with_bounds(1, HISTOGRAM_MAX_US, HISTOGRAM_SIGFIG).unwrap(),
            errors: BTreeMap::new(),
            per_backend: BTreeMap::new(),
        };
        for ms in 1..=100 {
            tally.record(Ok(("be1".into(), Duration::from_millis(ms))));
        }
        tally.record(Err(ErrorKind::Timeout));
        let summary = tally.summary(&config, Duration::from_secs(1));
        assert_eq!(summary.completed, 100);
        assert_eq!(
            summary.histogram_us.iter().map(|(_, n)| n).sum::<u64>(),
            100
        );
        assert_eq!(summary.error_count(), 1);
        assert_eq!(summary.errors["timeout"], 1);
        assert_eq!(summary.per_backend["be1"], 100);
        assert!(
            (summary.latency_ms.p50 - 50.0).abs() < 0.5,
            "{:?}",
            summary.latency_ms
        );
        assert!((summary.latency_ms.max - 100.0).abs() < 0.5);
    }
}
