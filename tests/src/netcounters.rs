//! Where a lab's packets were lost, from the kernel's own counters: a
//! snapshot before a run and one after, and what moved in between.
//!
//! - `nstat` in every namespace of the lab: SYN retransmits, listen queue
//!   overflows, TIME_WAIT and PAWS rejections, resets, reassembly failures
//!   ([`NSTAT_COUNTERS`]);
//! - every interface's drop and error counters: `ip -s link` (rx/tx
//!   dropped, errors) and, for veths, `ethtool -S` (XDP drops, `xdp_xmit`
//!   errors, peer ring overruns);
//! - `/proc/net/softnet_stat`, host-wide: packets a CPU's backlog queue
//!   dropped (`net.core.netdev_max_backlog` exceeded) and NAPI budgets
//!   squeezed. Not per namespace: other work on the host shows up too.
//!
//! Issue 9 asks every bench run to report SYN retransmits, and the 1 s tail
//! (a SYN lost somewhere and retransmitted a second later) to be explained
//! with these counters rather than guessed at.
use std::collections::BTreeMap;

use anyhow::{Context as _, Result};
use serde::{Deserialize, Serialize};

use crate::Lab;

/// The `nstat` counters that name a way a connection can lose a packet or
/// be turned away (the rest are traffic volume).
pub const NSTAT_COUNTERS: &[&str] = &[
    "TcpExtTCPSynRetrans",
    "TcpRetransSegs",
    "TcpExtListenOverflows",
    "TcpExtListenDrops",
    "TcpExtTCPReqQFullDrop",
    "TcpExtSyncookiesSent",
    "TcpExtTW",
    "TcpExtTWRecycled",
    "TcpExtTWKilled",
    "TcpExtPAWSTimewait",
    // TIME_WAIT table full (`tcp_max_tw_buckets`): a close skips TIME_WAIT,
    // and a late segment of that connection draws an RST.
    "TcpExtTCPTimeWaitOverflow",
    "TcpExtPAWSEstab",
    "TcpExtTCPACKSkippedTimeWait",
    "TcpExtTCPChallengeACK",
    "TcpExtTCPSYNChallenge",
    "TcpAttemptFails",
    "TcpEstabResets",
    "TcpOutRsts",
    "TcpExtTCPBacklogDrop",
    "TcpInErrs",
    "UdpRcvbufErrors",
    "UdpNoPorts",
    "IpReasmFails",
    "Ip6ReasmFails",
];

/// Counters of one moment, keyed by where they were read.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    /// "namespace counter" → value.
    pub counters: BTreeMap<String, u64>,
}

/// What moved between two snapshots: only counters that grew.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Delta {
    pub grew: BTreeMap<String, u64>,
}

impl Snapshot {
    /// Reads every namespace of `lab` and the host's softnet counters.
    pub fn take(lab: &Lab) -> Result<Self> {
        let mut counters = BTreeMap::new();
        for ns in lab.namespaces() {
            let short = short_name(ns);
            let argv: Vec<&str> = ["nstat", "-asz"]
                .into_iter()
                .chain(NSTAT_COUNTERS.iter().copied())
                .collect();
            let text = lab.exec_ok(ns, &argv)?;
            for (name, value) in parse_nstat(&text) {
                counters.insert(format!("{short} {name}"), value);
            }
            let links = lab.exec_ok(ns, &["ip", "-j", "-s", "link", "show"])?;
            for (name, value) in
                parse_ip_link_stats(&links).with_context(|| format!("`ip -s link` in {ns}"))?
            {
                counters.insert(format!("{short} {name}"), value);
            }
            for ifname in veths(&links)? {
                // A veth without ethtool statistics (old kernel) is skipped:
                // `ip -s link` above still counts its drops.
                let Ok(out) = lab.exec(ns, &["ethtool", "-S", &ifname]) else {
                    continue;
                };
                if !out.status.success() {
                    continue;
                }
                for (name, value) in parse_ethtool_drops(&String::from_utf8_lossy(&out.stdout)) {
                    counters.insert(format!("{short} {ifname} {name}"), value);
                }
            }
        }
        let softnet = std::fs::read_to_string("/proc/net/softnet_stat")
            .context("reading /proc/net/softnet_stat")?;
        for (name, value) in parse_softnet(&softnet) {
            counters.insert(format!("host softnet {name}"), value);
        }
        Ok(Self { counters })
    }

    /// Counters that grew from `self` to `later` (a counter that appeared
    /// counts from 0).
    pub fn delta(&self, later: &Snapshot) -> Delta {
        let grew = later
            .counters
            .iter()
            .filter_map(|(name, &after)| {
                let before = self.counters.get(name).copied().unwrap_or(0);
                (after > before).then(|| (name.clone(), after - before))
            })
            .collect();
        Delta { grew }
    }
}

impl Delta {
    /// Sum of the counters whose full name (`ns [ifname] counter`) and
    /// counter name (the last word) `keep` takes.
    fn sum_where(&self, keep: impl Fn(&str, &str) -> bool) -> u64 {
        self.grew
            .iter()
            .filter(|(name, _)| keep(name, name.rsplit(' ').next().unwrap_or(name)))
            .map(|(_, v)| v)
            .sum()
    }

    /// Sum of one counter over every namespace (e.g. `TcpExtTCPSynRetrans`).
    pub fn total(&self, counter: &str) -> u64 {
        self.sum_where(|_, c| c == counter)
    }

    /// Sum of one counter in the namespaces whose short name starts with
    /// `role` (`cl` the client, `lb` the balancer, `be` the backends, `sw`
    /// the switch), e.g. `("cl", "TcpExtTCPSynRetrans")`.
    pub fn in_role(&self, role: &str, counter: &str) -> u64 {
        self.sum_where(|name, c| name.starts_with(role) && c == counter)
    }

    /// Sum of the counters whose name (after the namespace and interface)
    /// ends with `suffix`, e.g. `_xdp_tx_errors` for every queue's.
    pub fn ending_with(&self, suffix: &str) -> u64 {
        self.sum_where(|_, c| c.ends_with(suffix))
    }

    /// Frames lost in the lab's plumbing rather than by a program's verdict:
    /// XDP_TX frames a veth could not queue on its peer (`xdp_tx_errors`,
    /// the peer's ring full), and the host's softnet backlog drops. Empty
    /// when none moved.
    pub fn plumbing_losses(&self) -> String {
        let mut lost = Vec::new();
        let tx_errors = self.ending_with("_xdp_tx_errors");
        if tx_errors > 0 {
            lost.push(format!("{tx_errors} XDP_TX frames a veth could not queue"));
        }
        let backlog = self.grew.get("host softnet dropped").copied().unwrap_or(0);
        if backlog > 0 {
            lost.push(format!("{backlog} softnet backlog drops"));
        }
        lost.join(", ")
    }

    /// One line: `name +n, ...`, or "nothing" when no counter moved.
    pub fn summary(&self) -> String {
        if self.grew.is_empty() {
            return "nothing".into();
        }
        self.grew
            .iter()
            .map(|(name, v)| format!("{name} +{v}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The namespace's `TcpExtTCPSynRetrans`: SYNs it sent again (each one a
/// connection that waited at least a second).
pub fn syn_retransmits(lab: &Lab, ns: &str) -> Result<u64> {
    let text = lab.exec_ok(ns, &["nstat", "-asz", "TcpExtTCPSynRetrans"])?;
    parse_nstat(&text)
        .get("TcpExtTCPSynRetrans")
        .copied()
        .with_context(|| format!("no TcpExtTCPSynRetrans in nstat's output: {text}"))
}

/// A lab namespace without its per-run prefix: `lbl1234n0-cl` → `cl`
/// (the part after the last '-').
fn short_name(ns: &str) -> &str {
    ns.rsplit('-').next().unwrap_or(ns)
}

/// Parses `nstat -a` output into counter → value.
pub fn parse_nstat(text: &str) -> BTreeMap<String, u64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let mut fields = l.split_whitespace();
            let name = fields.next()?;
            let value = fields.next()?.parse().ok()?;
            Some((name.to_string(), value))
        })
        .collect()
}

#[derive(Deserialize)]
struct Link {
    ifname: String,
    #[serde(default)]
    linkinfo: Option<LinkInfo>,
    #[serde(default)]
    stats64: Option<Stats64>,
}

#[derive(Deserialize)]
struct LinkInfo {
    #[serde(default)]
    info_kind: Option<String>,
}

#[derive(Deserialize)]
struct Stats64 {
    rx: Dir,
    tx: Dir,
}

#[derive(Deserialize)]
struct Dir {
    #[serde(default)]
    errors: u64,
    #[serde(default)]
    dropped: u64,
}

/// `ip -j -s link show`: per interface, `rx_dropped`, `rx_errors`,
/// `tx_dropped`, `tx_errors` (as "ifname rx_dropped").
pub fn parse_ip_link_stats(json: &str) -> Result<Vec<(String, u64)>> {
    let links: Vec<Link> = serde_json::from_str(json).context("parsing `ip -j -s link`")?;
    Ok(links
        .into_iter()
        .filter_map(|l| Some((l.ifname, l.stats64?)))
        .flat_map(|(ifname, s)| {
            [
                ("rx_dropped", s.rx.dropped),
                ("rx_errors", s.rx.errors),
                ("tx_dropped", s.tx.dropped),
                ("tx_errors", s.tx.errors),
            ]
            .map(|(what, v)| (format!("{ifname} {what}"), v))
        })
        .collect())
}

/// The veths among `ip -j -d link` / `ip -j -s link` output. `ip -s` does
/// not print the link kind, so a name is taken as a veth when ethtool
/// answers for it; this keeps to interfaces that are not loopback.
fn veths(json: &str) -> Result<Vec<String>> {
    let links: Vec<Link> = serde_json::from_str(json).context("parsing `ip -j link`")?;
    Ok(links
        .into_iter()
        .filter(|l| l.ifname != "lo")
        .filter(|l| {
            l.linkinfo
                .as_ref()
                .and_then(|i| i.info_kind.as_deref())
                .is_none_or(|k| k == "veth")
        })
        .map(|l| l.ifname)
        .collect())
}

/// `ethtool -S`: the statistics that count a packet lost (names with
/// `drop`, `err` or `full`), e.g. veth's `rx_queue_0_xdp_drops`,
/// `peer_tq_xdp_xmit_err`.
pub fn parse_ethtool_drops(text: &str) -> Vec<(String, u64)> {
    text.lines()
        .filter_map(|l| {
            let (name, value) = l.trim().split_once(':')?;
            let name = name.trim();
            let lossy = ["drop", "err", "full"].iter().any(|w| name.contains(w));
            let value = value.trim().parse().ok()?;
            lossy.then(|| (name.to_string(), value))
        })
        .collect()
}

/// `/proc/net/softnet_stat` summed over CPUs: `dropped` (column 2, the
/// backlog queue was full) and `time_squeeze` (column 3). Hexadecimal.
pub fn parse_softnet(text: &str) -> Vec<(String, u64)> {
    let mut dropped = 0u64;
    let mut squeezed = 0u64;
    for line in text.lines() {
        let cols: Vec<u64> = line
            .split_whitespace()
            .filter_map(|c| u64::from_str_radix(c, 16).ok())
            .collect();
        if cols.len() >= 3 {
            dropped += cols[1];
            squeezed += cols[2];
        }
    }
    vec![
        ("dropped".into(), dropped),
        ("time_squeeze".into(), squeezed),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nstat_lines_become_counters_and_the_header_is_skipped() {
        let text =
            "#kernel\nTcpExtTCPSynRetrans            7                  0.0\nTcpOutRsts 12 0.0\n";
        let c = parse_nstat(text);
        assert_eq!(c.get("TcpExtTCPSynRetrans"), Some(&7));
        assert_eq!(c.get("TcpOutRsts"), Some(&12));
        assert_eq!(c.len(), 2);
    }

    #[test]
    fn softnet_columns_are_hex_and_summed_over_cpus() {
        let text = "02fa0af6 0001c470 000003b0 00000000\n035ff610 000260cb 000003be 00000000\n";
        let v = parse_softnet(text);
        assert_eq!(v[0], ("dropped".into(), 0x1c470 + 0x260cb));
        assert_eq!(v[1], ("time_squeeze".into(), 0x3b0 + 0x3be));
    }

    #[test]
    fn ethtool_keeps_only_what_counts_a_loss() {
        let text = "NIC statistics:\n     peer_ifindex: 7\n     rx_queue_0_xdp_packets: 100\n     rx_queue_0_xdp_drops: 3\n     tx_queue_0_xdp_xmit_err: 1\n     rx_queue_0_xdp_tx_full: 0\n";
        let v = parse_ethtool_drops(text);
        assert_eq!(
            v,
            vec![
                ("rx_queue_0_xdp_drops".to_string(), 3),
                ("tx_queue_0_xdp_xmit_err".to_string(), 1),
                ("rx_queue_0_xdp_tx_full".to_string(), 0),
            ]
        );
    }

    #[test]
    fn ip_link_stats_give_drops_and_errors_per_interface() {
        let json = r#"[{"ifindex":1,"ifname":"lo","stats64":{"rx":{"bytes":0,"packets":0,"errors":0,"dropped":0},"tx":{"bytes":0,"packets":0,"errors":0,"dropped":0}}},
{"ifindex":5,"ifname":"veth0","linkinfo":{"info_kind":"veth"},"stats64":{"rx":{"errors":1,"dropped":4},"tx":{"errors":0,"dropped":9}}}]"#;
        let v = parse_ip_link_stats(json).unwrap();
        assert!(v.contains(&("veth0 rx_dropped".into(), 4)));
        assert!(v.contains(&("veth0 tx_dropped".into(), 9)));
        assert!(v.contains(&("veth0 rx_errors".into(), 1)));
        assert_eq!(veths(json).unwrap(), vec!["veth0".to_string()]);
    }

    #[test]
    fn a_delta_keeps_what_grew_and_sums_by_counter_and_role() {
        let before = Snapshot {
            counters: [
                ("cl TcpExtTCPSynRetrans".to_string(), 5),
                ("be0 TcpExtListenDrops".to_string(), 2),
                ("host softnet dropped".to_string(), 100),
            ]
            .into(),
        };
        let after = Snapshot {
            counters: [
                ("cl TcpExtTCPSynRetrans".to_string(), 8),
                ("be0 TcpExtListenDrops".to_string(), 2),
                ("be1 TcpExtTCPSynRetrans".to_string(), 1),
                ("host softnet dropped".to_string(), 130),
            ]
            .into(),
        };
        let d = before.delta(&after);
        assert_eq!(d.grew.len(), 3, "{d:?}");
        assert_eq!(d.total("TcpExtTCPSynRetrans"), 4);
        assert_eq!(d.in_role("cl", "TcpExtTCPSynRetrans"), 3);
        assert_eq!(d.total("dropped"), 30);
        assert_eq!(d.total("TcpExtListenDrops"), 0);
        assert!(d.summary().contains("host softnet dropped +30"));
        assert_eq!(Delta::default().summary(), "nothing");
    }
}
