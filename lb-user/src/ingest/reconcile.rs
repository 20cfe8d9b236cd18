//! Periodic reconciliation of the flow table with the in-flight counters.
//!
//! The kernel counts a flow opened when it is created and closed when it
//! sees FIN/RST (atomically, once, marked by `FLOW_F_CLOSED`). Flows that end
//! silently never reach `closed`: UDP "connections", peers that vanish, SYNs
//! nobody answers, and entries the LRU evicts. Left alone, in-flight would only
//! grow (the drift Cilium and loxilb hit with least-connections). So, every
//! pass:
//!
//! 1. read every backend's `opened`/`closed` counters first;
//! 2. scan the forward (`DIR_TO_BACKEND`) entries: expire the ones idle
//!    longer than their protocol's timeout and TCP flows whose SYN got no
//!    SYN-ACK within the SYN timeout (counted as refused), deleting both
//!    directions; count the unclosed survivors per backend;
//! 3. write `correction = max(0, (opened - closed) - live)`, so that
//!    `inflight = opened - closed - correction` equals the live flows.
//!
//! Reading counters before the scan means a flow opened during the scan can
//! be counted twice until the next pass; it can never make in-flight
//! negative, and the next pass (about a second later) corrects it.

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use anyhow::Context as _;
use lb_common::{
    BackendConns, DIR_TO_BACKEND, FLOW_F_CLOSED, FLOW_F_SYNACK_SEEN, FLOW_SYN_SENT, FlowEntry,
    FlowKey, IPPROTO_TCP, IPPROTO_UDP,
};
use tracing::warn;

use crate::{
    kernel::clock::{Clock, Nanos},
    kernel::maps::{self, Conns, Corrections, Flows},
};

/// How often a pass runs.
pub const RECONCILE_INTERVAL: Duration = Duration::from_secs(1);
/// How long a flow counted closed (FIN/RST seen) stays in the table so late
/// segments of the close are still translated: Linux's TIME_WAIT length.
pub const CLOSED_FLOW_LINGER: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    pub tcp_idle: Duration,
    pub udp_idle: Duration,
    pub syn: Duration,
}

/// What to do with one forward flow entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Still open: counts towards its backend's in-flight.
    Live,
    /// Closed by the kernel and not yet past its linger time.
    KeepClosed,
    /// Idle past its timeout: delete, count as closed (idle).
    ExpireIdle,
    /// SYN never answered: delete, count as refused.
    ExpireSyn,
    /// Closed long ago: delete (already counted).
    Purge,
}

pub fn judge(key: &FlowKey, entry: &FlowEntry, now: Nanos, t: &Timeouts) -> Verdict {
    let idle = now.since(Nanos(entry.last_seen_ns));
    if entry.flags & FLOW_F_CLOSED != 0 {
        return if idle > CLOSED_FLOW_LINGER {
            Verdict::Purge
        } else {
            Verdict::KeepClosed
        };
    }
    let syn_unanswered = key.proto == IPPROTO_TCP
        && entry.state == FLOW_SYN_SENT
        && entry.flags & FLOW_F_SYNACK_SEEN == 0;
    if syn_unanswered && now.since(Nanos(entry.created_ns)) > t.syn {
        return Verdict::ExpireSyn;
    }
    let idle_timeout = match key.proto {
        IPPROTO_UDP => t.udp_idle,
        _ => t.tcp_idle,
    };
    if idle > idle_timeout {
        Verdict::ExpireIdle
    } else {
        Verdict::Live
    }
}

/// The key of the reply direction of a forward entry.
pub fn reverse_key(key: &FlowKey, entry: &FlowEntry) -> FlowKey {
    FlowKey {
        src: entry.new_dst,
        dst: entry.new_src,
        sport: entry.new_dport,
        dport: entry.new_sport,
        proto: key.proto,
        family: key.family,
        _pad: [0; 2],
    }
}

/// Correction that makes `opened - closed - correction` equal `live`.
pub fn correction(conns: BackendConns, live: u64) -> u64 {
    conns
        .opened
        .saturating_sub(conns.closed)
        .saturating_sub(live)
}

/// Flows gone from the table unclosed, beyond those this pass expired:
/// the growth of the corrections minus this pass's own expirations.
pub fn vanished(correction_growth: u64, scan: &Scan) -> u64 {
    correction_growth.saturating_sub((scan.expired_idle.len() + scan.expired_syn.len()) as u64)
}

/// Outcome of scanning the flow table.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Scan {
    /// Unclosed, unexpired forward flows per backend id.
    pub live: Vec<u64>,
    /// Keys to delete (both directions of each flow).
    pub delete: Vec<FlowKey>,
    /// Backend id of each flow expired as idle.
    pub expired_idle: Vec<u32>,
    /// Backend id of each flow whose SYN went unanswered.
    pub expired_syn: Vec<u32>,
    /// Unclosed flows that left the table without this pass expiring them:
    /// evicted by the LRU (set by [`Reconciler::pass`]). Approximate: a
    /// flow closing during the pass can count once here and be corrected
    /// back by the next pass.
    pub vanished: u64,
    /// Entries seen in the table (both directions).
    pub entries: u64,
}

/// Classifies every forward entry; pure, so it is tested without a kernel.
pub fn scan(
    entries: impl IntoIterator<Item = (FlowKey, FlowEntry)>,
    backend_count: usize,
    now: Nanos,
    timeouts: &Timeouts,
) -> Scan {
    let mut out = Scan {
        live: vec![0; backend_count],
        ..Scan::default()
    };
    for (key, entry) in entries {
        out.entries += 1;
        if entry.direction != DIR_TO_BACKEND {
            continue;
        }
        let backend = entry.backend_id;
        let verdict = judge(&key, &entry, now, timeouts);
        match verdict {
            Verdict::Live => {
                if let Some(n) = out.live.get_mut(backend as usize) {
                    *n += 1;
                }
                continue;
            }
            Verdict::KeepClosed => continue,
            Verdict::ExpireIdle => out.expired_idle.push(backend),
            Verdict::ExpireSyn => out.expired_syn.push(backend),
            Verdict::Purge => {}
        }
        out.delete.push(key);
        out.delete.push(reverse_key(&key, &entry));
    }
    out
}

/// Owns its own handles on the pinned maps so a pass can run on a
/// blocking thread without holding up the event loop.
pub struct Reconciler<C> {
    flows: Flows,
    conns: Conns,
    corrections: Corrections,
    /// Length of the backend id space; grows when backends are added at runtime.
    backend_count: Arc<AtomicUsize>,
    timeouts: Timeouts,
    clock: C,
}

impl<C: Clock> Reconciler<C> {
    pub fn open(
        pin_dir: &std::path::Path,
        backend_count: Arc<AtomicUsize>,
        timeouts: Timeouts,
        clock: C,
    ) -> anyhow::Result<Self> {
        Ok(Self {
            flows: maps::flows(pin_dir)?,
            conns: maps::conns(pin_dir)?,
            corrections: maps::corrections(pin_dir)?,
            backend_count,
            timeouts,
            clock,
        })
    }

    /// One pass; returns what was expired so the caller can account for it.
    pub fn pass(&mut self) -> anyhow::Result<Scan> {
        let backend_count = self.backend_count.load(Ordering::Relaxed);
        let counters = (0..backend_count as u32)
            .map(|id| self.conns.get(&id, 0))
            .collect::<Result<Vec<_>, _>>()
            .context("reading BACKEND_CONNS")?;
        let now = self.clock.now();
        // Entries can vanish under the iterator (LRU, the kernel); a failed
        // step just ends this pass's view early.
        let entries = self.flows.iter().map_while(Result::ok);
        let scan = scan(entries, backend_count, now, &self.timeouts);
        for key in &scan.delete {
            // Already gone (evicted, or a reverse entry never inserted) is fine.
            let _ = self.flows.remove(key);
        }
        let mut scan = scan;
        let mut grown = 0u64;
        for (id, (conns, live)) in counters.iter().zip(&scan.live).enumerate() {
            let id = id as u32;
            let value = correction(*conns, *live);
            let old = self
                .corrections
                .get(&id, 0)
                .context("reading BACKEND_CORRECTION")?;
            grown += value.saturating_sub(old);
            if old != value
                && let Err(e) = self.corrections.set(id, value, 0)
            {
                warn!("writing BACKEND_CORRECTION[{id}]: {e}");
            }
        }
        scan.vanished = vanished(grown, &scan);
        Ok(scan)
    }
}

#[cfg(test)]
mod tests {
    use lb_common::{DIR_TO_CLIENT, FLOW_ESTABLISHED};

    use super::*;

    const T: Timeouts = Timeouts {
        tcp_idle: Duration::from_secs(300),
        udp_idle: Duration::from_secs(30),
        syn: Duration::from_secs(3),
    };
    const SEC: u64 = 1_000_000_000;

    fn key(proto: u8, sport: u16) -> FlowKey {
        FlowKey {
            src: [1, 0, 0, 0],
            dst: [2, 0, 0, 0],
            sport,
            dport: 80,
            proto,
            family: 4,
            _pad: [0; 2],
        }
    }

    fn entry(backend_id: u32, state: u8, flags: u32, created: u64, last_seen: u64) -> FlowEntry {
        FlowEntry {
            new_src: [3, 0, 0, 0],
            new_dst: [4, 0, 0, 0],
            new_sport: 20_000,
            new_dport: 8080,
            backend_id,
            direction: DIR_TO_BACKEND,
            state,
            flags,
            created_ns: created,
            last_seen_ns: last_seen,
            ..Default::default()
        }
    }

    #[test]
    fn correction_is_what_makes_inflight_match_the_table() {
        let conns = BackendConns {
            opened: 10,
            closed: 3,
        };
        assert_eq!(correction(conns, 7), 0);
        assert_eq!(correction(conns, 4), 3);
        assert_eq!(conns.inflight(correction(conns, 4)), 4);
        // More live flows than counted (opened during the scan): no negative.
        assert_eq!(correction(conns, 9), 0);
        // Closed ahead of opened (torn read): no underflow.
        assert_eq!(
            correction(
                BackendConns {
                    opened: 1,
                    closed: 2
                },
                0
            ),
            0
        );
    }

    #[test]
    fn vanished_flows_exclude_the_ones_expired_on_purpose() {
        let scan = Scan {
            expired_idle: vec![0, 1],
            expired_syn: vec![2],
            ..Scan::default()
        };
        assert_eq!(vanished(10, &scan), 7);
        assert_eq!(vanished(2, &scan), 0);
    }

    #[test]
    fn judges_timeouts_per_protocol() {
        let now = Nanos(1000 * SEC);
        let tcp = key(IPPROTO_TCP, 1);
        let udp = key(IPPROTO_UDP, 1);
        let fresh = entry(0, FLOW_ESTABLISHED, 0, 0, now.0 - 10 * SEC);
        assert_eq!(judge(&tcp, &fresh, now, &T), Verdict::Live);
        assert_eq!(judge(&udp, &fresh, now, &T), Verdict::Live);
        let idle_40s = entry(0, FLOW_ESTABLISHED, 0, 0, now.0 - 40 * SEC);
        assert_eq!(judge(&tcp, &idle_40s, now, &T), Verdict::Live);
        assert_eq!(judge(&udp, &idle_40s, now, &T), Verdict::ExpireIdle);
        let idle_301s = entry(0, FLOW_ESTABLISHED, 0, 0, now.0 - 301 * SEC);
        assert_eq!(judge(&tcp, &idle_301s, now, &T), Verdict::ExpireIdle);
    }

    #[test]
    fn unanswered_syns_expire_after_the_syn_timeout() {
        let now = Nanos(1000 * SEC);
        let tcp = key(IPPROTO_TCP, 1);
        let young = entry(0, FLOW_SYN_SENT, 0, now.0 - 2 * SEC, now.0);
        assert_eq!(judge(&tcp, &young, now, &T), Verdict::Live);
        let old = entry(0, FLOW_SYN_SENT, 0, now.0 - 4 * SEC, now.0);
        assert_eq!(judge(&tcp, &old, now, &T), Verdict::ExpireSyn);
        let answered = entry(0, FLOW_SYN_SENT, FLOW_F_SYNACK_SEEN, now.0 - 4 * SEC, now.0);
        assert_eq!(judge(&tcp, &answered, now, &T), Verdict::Live);
    }

    #[test]
    fn closed_flows_linger_then_go_without_being_counted_again() {
        let now = Nanos(1000 * SEC);
        let tcp = key(IPPROTO_TCP, 1);
        let recent = entry(0, FLOW_ESTABLISHED, FLOW_F_CLOSED, 0, now.0 - SEC);
        assert_eq!(judge(&tcp, &recent, now, &T), Verdict::KeepClosed);
        let old = entry(0, FLOW_ESTABLISHED, FLOW_F_CLOSED, 0, now.0 - 61 * SEC);
        assert_eq!(judge(&tcp, &old, now, &T), Verdict::Purge);
    }

    #[test]
    fn scan_counts_live_flows_and_deletes_both_directions() {
        let now = Nanos(1000 * SEC);
        let live = entry(1, FLOW_ESTABLISHED, 0, 0, now.0);
        let idle = entry(0, FLOW_ESTABLISHED, 0, 0, now.0 - 400 * SEC);
        let syn = entry(1, FLOW_SYN_SENT, 0, now.0 - 5 * SEC, now.0);
        let reply = FlowEntry {
            direction: DIR_TO_CLIENT,
            ..live
        };
        let closed = entry(0, FLOW_ESTABLISHED, FLOW_F_CLOSED, 0, now.0);
        let s = scan(
            [
                (key(IPPROTO_TCP, 1), live),
                (key(IPPROTO_TCP, 2), idle),
                (key(IPPROTO_TCP, 3), syn),
                (key(IPPROTO_TCP, 4), reply),
                (key(IPPROTO_TCP, 5), closed),
                (
                    key(IPPROTO_TCP, 6),
                    entry(99, FLOW_ESTABLISHED, 0, 0, now.0),
                ),
            ],
            2,
            now,
            &T,
        );
        assert_eq!(s.live, [0, 1]);
        assert_eq!(s.expired_idle, [0]);
        assert_eq!(s.expired_syn, [1]);
        let reverse = FlowKey {
            src: [4, 0, 0, 0],
            dst: [3, 0, 0, 0],
            sport: 8080,
            dport: 20_000,
            ..key(IPPROTO_TCP, 0)
        };
        assert_eq!(
            s.delete,
            [key(IPPROTO_TCP, 2), reverse, key(IPPROTO_TCP, 3), reverse]
        );
    }
}
