//! The 1 s tail experiment (`cargo xtask bench tail`, issue 9): where does a
//! connection that waits a second for its SYN to be answered come from?
//!
//! A SYN retransmit a second later means the first SYN, or its SYN-ACK,
//! was lost or refused somewhere. The experiment runs ApacheBench (a real
//! client: HTTP/1.0, a new connection per request, the server closes first,
//! so every backend socket ends in TIME_WAIT) through the VIP in five cases
//! that differ in one thing each, and reads the kernel's loss counters of
//! every namespace before and after ([`crate::netcounters`]):
//!
//! - **quarantine past TIME_WAIT**: the default quarantine (a closed
//!   connection's tuple is reused only 65 s after its close, longer than
//!   the backend's 60 s TIME_WAIT) over ports 1024-64511, enough for every
//!   connection of the run (the default range, 12,768 ports per backend
//!   and 6,384 per CPU, would run out and drop SYNs: `drop_snat_exhausted`);
//! - **reuse inside TIME_WAIT**: 16,000 ports with a 2 s quarantine, so a
//!   tuple goes back to the backend while it still holds the last one in
//!   TIME_WAIT. Linux takes a SYN for a tuple in TIME_WAIT as a new
//!   connection only if its sequence number is above the old one's, or its
//!   TCP timestamp is newer; else the backend answers with an ACK for the
//!   old connection, the client resets, and retransmits its SYN a second
//!   later;
//! - the same two **with the client's TCP timestamps off**, which leaves the
//!   sequence number (random per client tuple) as the only test;
//! - **time-wait reuse**: the narrow range with the default quarantine and
//!   `--snat-time-wait-reuse on` (the first four run with it off): a tuple
//!   goes back in use inside TIME_WAIT only to a SYN that TIME_WAIT
//!   accepts (`lb_common::time_wait`).
//!
//! If TIME_WAIT is the cause, the tail grows in the reuse cases; a loss on
//! the veths or in a CPU's backlog queue shows in every case alike.
use std::{
    collections::BTreeMap,
    fmt::Write as _,
    net::{Ipv4Addr, SocketAddr},
};

use anyhow::{Context as _, Result, ensure};
use nix::sys::signal::Signal;
use serde::{Deserialize, Serialize};

use crate::{
    Binaries, Lab,
    control_bench::scrape,
    lab::{Algorithm, BackendSpec, BalancerSpec, Protocol, VipSpec},
    netcounters::{Delta, Snapshot},
};

/// A connection that took this long has waited for a SYN retransmit.
pub const TAIL_MS: f64 = 1_000.0;
/// Longest one ab run may take (a run whose every SYN waits a second
/// takes about requests ÷ concurrency seconds).
const AB_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);
/// ab's concurrency.
const CONCURRENCY: u32 = 64;
/// Backends behind the VIP (no service time, enough workers never to queue).
const BACKENDS: usize = 3;
const BACKEND_WORKERS: u32 = 256;
/// SNAT addresses are taken from here, a fresh one per case, so no case
/// meets the TIME_WAIT of another.
const FIRST_SNAT_OCTET: u8 = 120;
// (120 + 100 cases stays below the broadcast .255.)
/// The narrowed range of the reuse cases and its quarantine.
const NARROW_PORTS: &str = "20000-35999";
/// The wide range of the other cases (the capacity bench's), so that no
/// case runs out of tuples: 63,488 ports per backend, half a CPU's slice.
const WIDE_PORTS: &str = "1024-64511";
/// The balancer namespace's own ephemeral ports (metrics scrapes), above
/// the reserved SNAT range.
const BALANCER_EPHEMERAL_PORTS: &str = "64512 65535";
const NARROW_QUARANTINE: &str = "2s";

/// One case of the experiment.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Case {
    pub name: String,
    /// `--snat-ports` and `--snat-quarantine`, when not the defaults.
    pub snat_ports: Option<String>,
    pub snat_quarantine: Option<String>,
    /// `net.ipv4.tcp_timestamps` in the client's namespace.
    pub client_timestamps: bool,
    /// `--snat-time-wait-reuse` (runs from before it existed read as off).
    #[serde(default)]
    pub time_wait_reuse: bool,
}

impl Case {
    pub fn all() -> Vec<Case> {
        // The first four without time-wait reuse: they compare the
        // quarantine alone against blind reuse.
        let case = |name: &str, narrow: bool, client_timestamps| Case {
            name: name.into(),
            snat_ports: Some(if narrow { NARROW_PORTS } else { WIDE_PORTS }.into()),
            snat_quarantine: narrow.then(|| NARROW_QUARANTINE.into()),
            client_timestamps,
            time_wait_reuse: false,
        };
        vec![
            case("quarantine past TIME_WAIT", false, true),
            case("reuse inside TIME_WAIT", true, true),
            case(
                "quarantine past TIME_WAIT, client without timestamps",
                false,
                false,
            ),
            case(
                "reuse inside TIME_WAIT, client without timestamps",
                true,
                false,
            ),
            // The narrow range with the default quarantine, which alone
            // would run out of tuples: a tuple goes back in use inside
            // TIME_WAIT only to a SYN that TIME_WAIT accepts.
            Case {
                name: "time-wait reuse (RFC 6191), quarantine past TIME_WAIT".into(),
                snat_ports: Some(NARROW_PORTS.into()),
                snat_quarantine: None,
                client_timestamps: true,
                time_wait_reuse: true,
            },
        ]
    }
}

/// What one case measured.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Outcome {
    pub case: Case,
    pub requests: u64,
    pub failed: u64,
    /// Requests that took [`TAIL_MS`] or more from connect to the end.
    pub tail: u64,
    pub connect_max_ms: f64,
    pub total_max_ms: f64,
    /// The kernel's loss counters that moved, every namespace.
    pub counters: Delta,
    /// lb-user's drop reasons that moved.
    pub drops: BTreeMap<String, u64>,
}

impl Outcome {
    pub fn syn_retransmits(&self) -> u64 {
        self.counters.in_role("cl", "TcpExtTCPSynRetrans")
    }
}

/// Runs `cases` with `requests` connections each (in `rounds` ab runs).
pub fn run(
    binaries: &Binaries,
    cases: &[Case],
    requests: u32,
    rounds: u32,
) -> Result<Vec<Outcome>> {
    ensure!(
        requests >= rounds && rounds > 0,
        "at least one request a round"
    );
    let lab = Lab::builder(binaries.clone())
        .backends(BACKENDS, BackendSpec::new(0, BACKEND_WORKERS))
        .build()
        .context("building the lab")?;
    let mut outcomes = Vec::new();
    ensure!(
        cases.len() <= 100,
        "at most 100 cases (one SNAT address each)"
    );
    for (i, case) in cases.iter().enumerate() {
        eprintln!("bench tail: {} ...", case.name);
        let snat = Ipv4Addr::new(10, 213, 0, FIRST_SNAT_OCTET + i as u8);
        let outcome = run_case(&lab, case, snat, requests, rounds)?;
        eprintln!(
            "bench tail:   {} requests, {} failed, {} ≥ {TAIL_MS} ms, {} SYN retransmits; lb-user drops {:?}; {}",
            outcome.requests,
            outcome.failed,
            outcome.tail,
            outcome.syn_retransmits(),
            outcome.drops,
            outcome.counters.summary()
        );
        outcomes.push(outcome);
    }
    Ok(outcomes)
}

fn run_case(lab: &Lab, case: &Case, snat: Ipv4Addr, requests: u32, rounds: u32) -> Result<Outcome> {
    let client = lab.client().ns.clone();
    let timestamps = if case.client_timestamps { "1" } else { "0" };
    lab.exec_ok(
        &client,
        &[
            "sysctl",
            "-qw",
            &format!("net.ipv4.tcp_timestamps={timestamps}"),
        ],
    )?;
    lab.set_balancer_ephemeral_ports(BALANCER_EPHEMERAL_PORTS)?;
    let iface = lab.balancer().iface.clone();
    lab.ip(
        &lab.balancer().ns,
        &["addr", "add", &format!("{snat}/32"), "dev", &iface],
    )?;
    let mut extra = vec!["--snat-ip".to_string(), snat.to_string()];
    if let Some(ports) = &case.snat_ports {
        extra.extend(["--snat-ports".into(), ports.clone()]);
    }
    if let Some(q) = &case.snat_quarantine {
        extra.extend(["--snat-quarantine".into(), q.clone()]);
    }
    let reuse = if case.time_wait_reuse { "on" } else { "off" };
    extra.extend(["--snat-time-wait-reuse".into(), reuse.into()]);
    let backends = lab.backends().iter().map(|b| (b.addr(), 1)).collect();
    let mut spec = BalancerSpec::one_vip(
        VipSpec::new(lab.tcp_vip(), Protocol::Tcp, backends),
        Algorithm::P2cEwma,
        &[],
    );
    spec.extra_args = extra;
    lab.restoring_reserved_ports(|| {
        let process = lab.start_balancer(&spec)?;
        let result = measure(lab, case, lab.tcp_vip(), requests, rounds);
        let stopped = lab.stop_balancer(process, Signal::SIGTERM);
        let outcome = result?;
        let status = stopped?;
        ensure!(status.success(), "lb-user stopped with {status}");
        Ok(outcome)
    })
}

fn measure(lab: &Lab, case: &Case, vip: SocketAddr, requests: u32, rounds: u32) -> Result<Outcome> {
    let drops_before = drops(lab)?;
    let before = Snapshot::take(lab)?;
    let url = format!("http://{vip}/");
    let per_round = requests / rounds;
    let mut total = AbRun::default();
    for round in 0..rounds {
        let gnuplot = lab
            .log_dir()
            .join(format!("ab-{}-{round}.tsv", slug(&case.name)));
        let report = lab.exec_ok_within(
            &lab.client().ns,
            &[
                "ab",
                "-q",
                "-r",
                "-n",
                &per_round.to_string(),
                "-c",
                &CONCURRENCY.to_string(),
                "-s",
                "10",
                "-g",
                &gnuplot.display().to_string(),
                &url,
            ],
            AB_TIMEOUT,
        )?;
        let tsv = std::fs::read_to_string(&gnuplot)
            .with_context(|| format!("reading {}", gnuplot.display()))?;
        total.add(&AbRun::parse(&report, &tsv)?);
    }
    let counters = before.delta(&Snapshot::take(lab)?);
    let after = drops(lab)?;
    let drops = after
        .into_iter()
        .filter_map(|(r, v)| {
            let grew = v.saturating_sub(drops_before.get(&r).copied().unwrap_or(0));
            (grew > 0).then_some((r, grew))
        })
        .collect();
    Ok(Outcome {
        case: case.clone(),
        requests: total.complete,
        failed: total.failed,
        tail: total.tail,
        connect_max_ms: total.connect_max_ms,
        total_max_ms: total.total_max_ms,
        counters,
        drops,
    })
}

fn slug(name: &str) -> String {
    name.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect()
}

fn drops(lab: &Lab) -> Result<BTreeMap<String, u64>> {
    let samples = scrape::parse(&lab.scrape_metrics()?);
    Ok(samples
        .iter()
        .filter(|s| s.name == "lb_packets_total")
        .filter_map(|s| {
            let r = s.labels.get("reason")?;
            r.starts_with("drop_").then(|| (r.clone(), s.value as u64))
        })
        .collect())
}

/// One or more ab runs: its report's counts and its gnuplot file's
/// per-request times.
#[derive(Debug, Default, PartialEq)]
pub struct AbRun {
    pub complete: u64,
    pub failed: u64,
    pub tail: u64,
    pub connect_max_ms: f64,
    pub total_max_ms: f64,
}

impl AbRun {
    /// `report` is ab's standard output; `tsv` its `-g` file (a header,
    /// then `starttime seconds ctime dtime ttime wait` per request, tab
    /// separated, times in ms).
    pub fn parse(report: &str, tsv: &str) -> Result<Self> {
        let field = |label: &str| -> Result<u64> {
            report
                .lines()
                .find_map(|l| l.trim_start().strip_prefix(label))
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|v| v.parse().ok())
                .with_context(|| format!("no `{label}` in ab's report:\n{report}"))
        };
        let mut run = AbRun {
            complete: field("Complete requests:")?,
            failed: field("Failed requests:")?,
            ..AbRun::default()
        };
        for line in tsv.lines().skip(1) {
            let cols: Vec<&str> = line.split('\t').collect();
            let [.., ctime, _dtime, ttime, _wait] = cols.as_slice() else {
                continue;
            };
            let (Ok(ctime), Ok(ttime)) = (ctime.trim().parse::<f64>(), ttime.trim().parse::<f64>())
            else {
                continue;
            };
            run.connect_max_ms = run.connect_max_ms.max(ctime);
            run.total_max_ms = run.total_max_ms.max(ttime);
            if ttime >= TAIL_MS {
                run.tail += 1;
            }
        }
        Ok(run)
    }

    fn add(&mut self, other: &AbRun) {
        self.complete += other.complete;
        self.failed += other.failed;
        self.tail += other.tail;
        self.connect_max_ms = self.connect_max_ms.max(other.connect_max_ms);
        self.total_max_ms = self.total_max_ms.max(other.total_max_ms);
    }
}

/// The counters worth a column of their own; the rest go to the last one.
const COLUMNS: &[(&str, &str)] = &[
    ("cl", "TcpExtTCPSynRetrans"),
    ("cl", "TcpOutRsts"),
    ("be", "TcpExtPAWSTimewait"),
    ("be", "TcpExtTW"),
    ("be", "TcpExtListenDrops"),
    ("host", "dropped"),
];

/// The markdown report.
pub fn markdown(outcomes: &[Outcome], machine: &str) -> String {
    let mut md = String::new();
    let _ = writeln!(
        md,
        "# The 1 s tail (`cargo xtask bench tail`)\n\n\
         ApacheBench (`ab -c {CONCURRENCY}`, HTTP/1.0, a new connection per request, the \
         server closes first) through one VIP to {BACKENDS} backends, one fresh SNAT address \
         per case. \"≥ 1 s\" counts requests that took {TAIL_MS} ms or more (a SYN \
         retransmitted); the counters are deltas of `nstat` in the client (cl) and backend (be) \
         namespaces and of `/proc/net/softnet_stat` (host). Machine: {machine}.\n"
    );
    md.push_str("| Case | SNAT ports | Quarantine | Client timestamps | Requests | Failed | ≥ 1 s | Max connect ms |");
    for (role, name) in COLUMNS {
        let _ = write!(md, " {role} {name} |");
    }
    md.push_str(" lb-user drops | Other counters |\n|---|---|---|---|--:|--:|--:|--:|");
    for _ in COLUMNS {
        md.push_str("--:|");
    }
    md.push_str("---|---|\n");
    for o in outcomes {
        let _ = write!(
            md,
            "| {} | {} | {} | {} | {} | {} | {} | {:.0} |",
            o.case.name,
            o.case.snat_ports.as_deref().unwrap_or("default"),
            o.case.snat_quarantine.as_deref().unwrap_or("default"),
            if o.case.client_timestamps {
                "on"
            } else {
                "off"
            },
            o.requests,
            o.failed,
            o.tail,
            o.connect_max_ms,
        );
        for (role, name) in COLUMNS {
            let _ = write!(md, " {} |", o.counters.in_role(role, name));
        }
        let drops = if o.drops.is_empty() {
            "0".to_string()
        } else {
            o.drops
                .iter()
                .map(|(r, v)| format!("{r} {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let others: Vec<String> = o
            .counters
            .grew
            .iter()
            .filter(|(name, _)| {
                !COLUMNS
                    .iter()
                    .any(|(role, c)| name.starts_with(role) && name.rsplit(' ').next() == Some(*c))
            })
            .map(|(name, v)| format!("{name} +{v}"))
            .collect();
        let _ = writeln!(
            md,
            " {drops} | {} |",
            if others.is_empty() {
                "–".into()
            } else {
                others.join(", ")
            }
        );
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    const REPORT: &str =
        "Concurrency Level:      64\nComplete requests:      3\nFailed requests:        1\n";
    const TSV: &str = "starttime\tseconds\tctime\tdtime\tttime\twait\n\
        Tue Dec 01 16:00:00 2026\t1796140800\t1\t5\t6\t5\n\
        Tue Dec 01 16:00:00 2026\t1796140800\t1003\t4\t1007\t4\n\
        Tue Dec 01 16:00:00 2026\t1796140800\t0\t2\t2\t2\n";

    #[test]
    fn ab_report_and_gnuplot_file_give_counts_and_the_tail() {
        let run = AbRun::parse(REPORT, TSV).unwrap();
        assert_eq!(
            run,
            AbRun {
                complete: 3,
                failed: 1,
                tail: 1,
                connect_max_ms: 1003.0,
                total_max_ms: 1007.0,
            }
        );
        assert!(AbRun::parse("garbage", TSV).is_err());
    }

    #[test]
    fn the_cases_differ_in_one_thing_each() {
        let cases = Case::all();
        assert_eq!(cases.len(), 5);
        assert!(cases[..4].iter().all(|c| !c.time_wait_reuse));
        assert!(cases[4].time_wait_reuse && cases[4].snat_quarantine.is_none());
        assert_eq!(cases[4].snat_ports.as_deref(), Some(NARROW_PORTS));
        let narrow = |c: &Case| c.snat_quarantine.is_some();
        assert!(!narrow(&cases[0]) && cases[0].client_timestamps);
        assert!(narrow(&cases[1]) && cases[1].client_timestamps);
        assert!(!narrow(&cases[2]) && !cases[2].client_timestamps);
        assert!(narrow(&cases[3]) && !cases[3].client_timestamps);
        assert_eq!(cases[0].snat_ports.as_deref(), Some(WIDE_PORTS));
        assert_eq!(cases[1].snat_ports.as_deref(), Some(NARROW_PORTS));
    }

    #[test]
    fn the_report_has_a_row_per_case_with_its_counters() {
        let counters = Delta {
            grew: [
                ("cl TcpExtTCPSynRetrans".to_string(), 7),
                ("be2 TcpExtPAWSTimewait".to_string(), 3),
                ("be3 TcpExtPAWSTimewait".to_string(), 4),
                ("sw p-lb tx_dropped".to_string(), 1),
            ]
            .into(),
        };
        let outcome = Outcome {
            case: Case::all()[3].clone(),
            requests: 100,
            failed: 0,
            tail: 7,
            connect_max_ms: 1003.0,
            total_max_ms: 1010.0,
            counters,
            drops: BTreeMap::new(),
        };
        assert_eq!(outcome.syn_retransmits(), 7);
        let md = markdown(&[outcome], "test");
        let row = md
            .lines()
            .find(|l| l.starts_with("| reuse inside TIME_WAIT, client without"))
            .unwrap();
        assert!(
            row.contains("| 100 | 0 | 7 | 1003 | 7 | 0 | 7 | 0 | 0 | 0 |"),
            "{row}"
        );
        assert!(row.contains("sw p-lb tx_dropped +1"), "{row}");
    }
}
