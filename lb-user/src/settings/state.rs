//! Runtime changes kept across restarts, like HAProxy's server-state-file:
//! `<state_dir>/<instance>.state.json` (default `/var/lib/lb-user/`).
//!
//! Each entry is one backend of one VIP whose runtime state differs from
//! the configuration: drained, removed, added at runtime, or re-weighted.
//! With it is the configuration's own entry for that backend when the
//! change was made (`config`, `"IP:PORT@WEIGHT[,zone=NAME]"`, or null when
//! the file did not have it). A backend added at runtime with a zone keeps
//! it in `zone`. At start, and on SIGHUP, an entry is laid over the
//! configuration only while the configuration still says the same of that
//! backend: an edit of the backend in the file since then wins, and the
//! entry is dropped.
//!
//! Whole VIPs added or removed at runtime (`lb-user vip add|remove`) are
//! kept the same way in `vips`: the VIP as added (algorithm and backends,
//! which later `backend add|remove|weight` commands on it update), or
//! null for a VIP removed at runtime, with the configuration's own
//! definition of that VIP when the change was made. A VIP the file has
//! since defined differently (added, edited or dropped) is the file's.
//!
//! The file is written whole (temporary file, fsync, rename, fsync of the
//! directory), so it is the old or the new state, never half of one. One
//! that cannot be parsed stops the start with one error line naming it (a
//! drained backend silently back in service would be worse); move it away
//! to start from the configuration alone.
//!
//! An entry that reads but breaks a rule is dropped with a warning: the
//! configuration's rules at load ([`RuntimeState::load`]), the SNAT rules
//! against the pools and ports of this start once they are known
//! ([`RuntimeState::drop_snat_refused`]).

use std::{
    net::IpAddr,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

use crate::settings::{
    ConfigError,
    addr::{AddrError, BackendAddr, VipAddr, Weight, refuse_scope_id},
    algorithm::parse_algorithm,
    config::{
        Config, VipConfig, check_backend, check_backend_snat, check_backends, check_limits,
        check_snat, check_snat_family,
    },
    ops::HealthCheck,
    ports::PortRange,
    zone::{ZoneName, ZoneSettings},
};

pub use super::config::DEFAULT_STATE_DIR;
const VERSION: u32 = 1;

/// The state file of `instance` in `dir`.
pub fn path(dir: &Path, instance: &str) -> PathBuf {
    dir.join(format!("{instance}.state.json"))
}

/// A backend's administrative state, as kept.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Admin {
    #[default]
    Active,
    Draining,
    Removed,
}

/// One backend's runtime difference from the configuration.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    /// `IP:PORT/PROTO`.
    pub vip: String,
    /// `IP:PORT`.
    pub backend: String,
    #[serde(default)]
    pub admin: Admin,
    /// A weight set at runtime (or the weight of a backend added at runtime).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<u32>,
    /// The zone of a backend added at runtime (when it differs from the
    /// configuration's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zone: Option<ZoneName>,
    /// The configuration's entry for this backend when the change was made.
    pub config: Option<String>,
}

/// A VIP added at runtime.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AddedVip {
    pub algorithm: String,
    /// `IP:PORT@WEIGHT[,zone=NAME]`, in order.
    pub backends: Vec<String>,
}

/// One whole VIP's runtime difference from the configuration.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VipEntry {
    /// `IP:PORT/PROTO`.
    pub vip: String,
    /// The VIP as added at runtime; null: removed at runtime.
    pub added: Option<AddedVip>,
    /// The configuration's definition of this VIP when the change was made.
    pub config: Option<String>,
}

/// Every runtime difference from the configuration.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuntimeState {
    pub version: u32,
    pub backends: Vec<Entry>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub vips: Vec<VipEntry>,
}

/// The configuration's definition of VIP `vip` (`None`: not there). A
/// discovered VIP's backends are etcd's, not the file's, and change all
/// the time: its definition names its prefix instead of them, so a change
/// made at runtime holds while the file still takes the VIP from there.
fn vip_fingerprint(config: &Config, vip: &VipAddr) -> Option<String> {
    fingerprint_as(config, vip, HealthText::Current)
}

/// Whether `recorded`, a VIP entry's fingerprint, still describes VIP
/// `vip` in `config`: this build's text, or the text a build before
/// latency probes wrote for the same definition (its health check had no
/// `latency_probe` field; an upgrade must not read that as a change and
/// drop the operator's removal or addition).
fn fingerprint_holds(config: &Config, vip: &VipAddr, recorded: Option<&str>) -> bool {
    let now = vip_fingerprint(config, vip);
    now.as_deref() == recorded
        || (recorded.is_some()
            && fingerprint_as(config, vip, HealthText::BeforeLatencyProbes).as_deref() == recorded)
}

/// Which build's words [`fingerprint_as`] gives a health check in.
#[derive(Clone, Copy, PartialEq, Eq)]
enum HealthText {
    Current,
    BeforeLatencyProbes,
}

/// A VIP's health check as its fingerprint writes it: spelled out here,
/// field by field, in the words the derived `Debug` gave when entries were
/// first written, so that a field added to `HealthCheck` later changes no
/// recorded fingerprint (a new field is written only when set, as
/// `zone_aware` and the P2C limits are). `None`: no text in `words`
/// describes this check (an older build could not have written it).
fn health_text(health: Option<&HealthCheck>, words: HealthText) -> Option<String> {
    let Some(h) = health else {
        return Some("None".to_string());
    };
    let http = match &h.http {
        Some(c) => format!(
            "Some(HttpCheck {{ path: {:?}, status: {} }})",
            c.path, c.status
        ),
        None => "None".to_string(),
    };
    // That build had no probes, and its files could not set them: the
    // same file now gets the default (on for an HTTP check, off for TCP).
    // A check with any other probe setting was changed since.
    let probe = match words {
        HealthText::BeforeLatencyProbes => {
            let default = match h.http {
                Some(_) => crate::settings::ops::DEFAULT_LATENCY_PROBE_INTERVAL.every(),
                None => None,
            };
            if h.latency_probe != default {
                return None;
            }
            String::new()
        }
        HealthText::Current => format!(", latency_probe: {:?}", h.latency_probe),
    };
    Some(format!(
        "Some(HealthCheck {{ http: {http}, interval: {:?}, timeout: {:?}, rise: {}, fall: {}{probe} }})",
        h.interval, h.timeout, h.rise, h.fall
    ))
}

/// [`vip_fingerprint`] with its health check in `words`.
fn fingerprint_as(config: &Config, vip: &VipAddr, words: HealthText) -> Option<String> {
    let v = config.vips.iter().find(|v| v.vip == *vip)?;
    let backends = match &v.etcd_prefix {
        Some(prefix) => format!("etcd={prefix}"),
        None => {
            let listed: Vec<String> = v.backends.iter().map(ToString::to_string).collect();
            format!("backends={}", listed.join(","))
        }
    };
    // Only a zone-aware VIP says so, so that the fingerprints of files
    // written before zones existed still match.
    let zone_aware = if v.zone_aware { " zone_aware" } else { "" };
    // Likewise the full-scan limit, only when not the default.
    let full_scan = if v.p2c_full_scan == lb_common::DEFAULT_P2C_FULL_SCAN {
        String::new()
    } else {
        format!(" full_scan={}", v.p2c_full_scan)
    };
    let saturation = if v.p2c_saturation == lb_common::DEFAULT_P2C_SATURATION {
        String::new()
    } else {
        format!(" saturation={}", v.p2c_saturation)
    };
    Some(format!(
        "{} bias={} affinity={}{zone_aware}{full_scan}{saturation} health={} {backends}",
        v.algorithm.name(),
        v.inflight_bias,
        v.maglev_source_affinity,
        health_text(v.health.as_ref(), words)?,
    ))
}

impl AddedVip {
    pub fn of(v: &VipConfig) -> Self {
        Self {
            algorithm: v.algorithm.name().to_string(),
            backends: v.backends.iter().map(ToString::to_string).collect(),
        }
    }

    /// The VIP `vip` this stands for (no health check, default bias,
    /// zone-aware exactly when the balancer has a zone, as in `zones`).
    pub fn config(&self, vip: VipAddr, zones: &ZoneSettings) -> Result<VipConfig, String> {
        let algorithm = parse_algorithm(&self.algorithm)?;
        let backends = self
            .backends
            .iter()
            .map(|b| {
                b.parse::<BackendAddr>()
                    .map_err(|e| format!("backend '{b}': {e}"))
            })
            .collect::<Result<Vec<BackendAddr>, _>>()?;
        // As a configured VIP's (a state file edited by hand must not
        // bring in what the file could not).
        if backends.is_empty() {
            return Err("no backends".into());
        }
        check_backends(&vip, &backends).map_err(|e| e.to_string())?;
        Ok(VipConfig {
            vip,
            algorithm,
            inflight_bias: lb_common::DEFAULT_INFLIGHT_BIAS,
            p2c_full_scan: lb_common::DEFAULT_P2C_FULL_SCAN,
            p2c_saturation: lb_common::DEFAULT_P2C_SATURATION,
            maglev_source_affinity: false,
            zone_aware: zones.local.is_some(),
            backends,
            health: None,
            etcd_prefix: None,
        })
    }
}

/// A runtime change, as [`RuntimeState::record`] keeps it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    /// Added with this weight and zone.
    Add(Weight, Option<ZoneName>),
    Remove,
    Drain,
    Undrain,
    Weight(Weight),
}

/// The configuration's entry for `backend` of `vip` (`None`: not there).
/// For a discovered VIP, whose members and their weights are etcd's and
/// change all the time, the VIP's source ([`discovered_source`]): an
/// operator's drain, weight or removal holds whatever etcd says (README,
/// "Operator overrides win"), for as long as the file takes the VIP from
/// that prefix.
fn fingerprint(config: &Config, vip: &VipAddr, backend: std::net::SocketAddr) -> Option<String> {
    let v = config.vips.iter().find(|v| v.vip == *vip)?;
    if let Some(prefix) = &v.etcd_prefix {
        return Some(discovered_source(prefix));
    }
    let b = v.backends.iter().find(|b| b.addr == backend)?;
    Some(b.to_string())
}

/// The fingerprint of every backend of a VIP discovered under `prefix`.
fn discovered_source(prefix: &str) -> String {
    format!("etcd {prefix}")
}

impl RuntimeState {
    /// The family of each VIP added at runtime (`true`: IPv6), for the
    /// SNAT pools a restart takes (`Snat::resolve`).
    pub fn added_vip_families(&self) -> impl Iterator<Item = bool> + '_ {
        self.vips
            .iter()
            .filter(|e| e.added.is_some())
            .filter_map(|e| e.vip.parse::<VipAddr>().ok())
            .map(|vip| vip.addr.is_ipv6())
    }

    /// Reads the state file (`None` when there is none), with a warning
    /// for each entry it dropped, for the caller to log: it is read before
    /// the log is set up, so that a file that cannot be used stops the
    /// start with one line.
    pub fn load(path: &Path) -> Result<(Option<Self>, Vec<String>), ConfigError> {
        let unreadable = |reason: String| ConfigError::State {
            path: path.display().to_string(),
            reason,
        };
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((None, Vec::new())),
            Err(e) => return Err(unreadable(e.to_string())),
        };
        let mut state: Self = serde_json::from_str(&text).map_err(|e| unreadable(e.to_string()))?;
        if state.version != VERSION {
            return Err(unreadable(format!("unknown version {}", state.version)));
        }
        // What cannot be read is an error; an entry that reads but breaks a
        // rule (one an older build accepted: a multicast backend added at
        // runtime, say) is dropped with a warning, so an upgrade does not
        // refuse to start, nor lose the file's other entries.
        let mut dropped = Vec::new();
        let mut vips = Vec::with_capacity(state.vips.len());
        // A VIP with an IPv6 scope id, which an older build took in: a rule
        // broken, not a file that cannot be read.
        let vip_of = |text: &str, dropped: &mut Vec<String>| match text.parse::<VipAddr>() {
            Ok(vip) => Ok(Some(vip)),
            Err(err @ AddrError::ScopeId(_)) => {
                dropped.push(format!("VIP {text}: {err}"));
                Ok(None)
            }
            Err(err) => Err(unreadable(format!("vip '{text}': {err}"))),
        };
        for e in std::mem::take(&mut state.vips) {
            let Some(vip) = vip_of(&e.vip, &mut dropped)? else {
                continue;
            };
            match &e.added {
                Some(added) => match added.config(vip, &ZoneSettings::default()) {
                    Ok(_) => vips.push(e),
                    Err(err) => dropped.push(format!("VIP {vip} added at runtime: {err}")),
                },
                None => vips.push(e),
            }
        }
        state.vips = vips;
        let mut backends = Vec::with_capacity(state.backends.len());
        for e in std::mem::take(&mut state.backends) {
            let Some(vip) = vip_of(&e.vip, &mut dropped)? else {
                continue;
            };
            let backend = e
                .backend
                .parse::<std::net::SocketAddr>()
                .map_err(|err| unreadable(format!("backend '{}': {err}", e.backend)))?;
            let rules = refuse_scope_id(backend, &e.backend)
                .map_err(|err| err.to_string())
                .and_then(|()| check_backend(&vip, backend).map_err(|err| err.to_string()));
            let weight = e
                .weight
                .map(|w| Weight::new(u64::from(w)).map_err(|err| err.to_string()));
            match rules.and(weight.transpose()) {
                Ok(_) => backends.push(e),
                Err(err) => dropped.push(format!("backend {backend} of VIP {vip}: {err}")),
            }
        }
        state.backends = backends;
        let warnings = dropped
            .into_iter()
            .map(|what| {
                format!(
                    "runtime state {}: dropped an entry the configuration's rules refuse: {what}",
                    path.display()
                )
            })
            .collect();
        Ok((Some(state), warnings))
    }

    /// Drops the entries that break the SNAT rules against the pools
    /// `snat` (both families) and ports `ports` the balancer starts with
    /// (`config::check_snat`): a VIP added at runtime of a family with no
    /// SNAT address in `snat` (`config::check_snat_family`), or on a SNAT
    /// address with its port in `ports`, or with a backend at a SNAT address, and
    /// a backend added or drained at runtime at a SNAT address (a removed
    /// one serves nothing: kept). `vip add` and `backend add` refused them
    /// when they were made, so only other SNAT addresses or ports than
    /// that run's bring them here; installing them would give a VIP that
    /// takes no connection or a backend sent its connections from its own
    /// address. One line per entry dropped, for the caller to warn with;
    /// the rest is kept. (The file keeps them until its next write.)
    pub fn drop_snat_refused(&mut self, snat: &[IpAddr], ports: PortRange) -> Vec<String> {
        let mut dropped = Vec::new();
        self.vips.retain(|e| {
            let (Ok(vip), Some(added)) = (e.vip.parse::<VipAddr>(), &e.added) else {
                return true;
            };
            // What `load` could not read as a VIP is not this check's.
            let Ok(v) = added.config(vip, &ZoneSettings::default()) else {
                return true;
            };
            match check_snat_family(&v.vip, snat).and_then(|()| check_snat(&v, snat, ports)) {
                Ok(()) => true,
                Err(err) => {
                    dropped.push(format!("VIP {vip} added at runtime: {err}"));
                    false
                }
            }
        });
        self.backends.retain(|e| {
            let (Ok(vip), Ok(backend)) = (
                e.vip.parse::<VipAddr>(),
                e.backend.parse::<std::net::SocketAddr>(),
            ) else {
                return true;
            };
            if e.admin == Admin::Removed {
                return true;
            }
            match check_backend_snat(&vip, backend, snat) {
                Ok(()) => true,
                Err(err) => {
                    let what = match e.admin {
                        Admin::Draining => "drained",
                        _ if e.config.is_none() => "added",
                        _ => "re-weighted",
                    };
                    dropped.push(format!("backend {what} at runtime: {err}"));
                    false
                }
            }
        });
        dropped
    }

    /// Writes the whole file atomically: a temporary file beside it,
    /// fsync, rename over it, fsync of the directory.
    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        let mut text = serde_json::to_string_pretty(self).map_err(std::io::Error::other)?;
        text.push('\n');
        crate::settings::private_file::write_durable(path, text.as_bytes())
    }

    /// Lays the entries that still hold over `config` (the configuration
    /// as read): backends added, removed and re-weighted. Returns the
    /// backends to drain (`(vip, backend)`), and drops the entries the
    /// configuration has overtaken, with a note for each.
    pub fn overlay(
        &mut self,
        config: &mut Config,
    ) -> (Vec<(VipAddr, std::net::SocketAddr)>, Vec<String>) {
        let base = config.clone();
        let mut drains = Vec::new();
        let mut notes = Vec::new();
        // Removals are applied after the additions of their kind, so that
        // "never the last VIP, never a VIP's last backend" is judged on
        // what the additions left, whatever the entries' order (a later
        // command on a backend moves its entry to the end).
        let mut vip_removals = Vec::new();
        self.vips.retain(|e| {
            let Ok(vip) = e.vip.parse::<VipAddr>() else {
                return false;
            };
            if !fingerprint_holds(&base, &vip, e.config.as_deref()) {
                notes.push(format!(
                    "VIP {vip}: the configuration changed since it was {} at runtime; the configuration wins",
                    if e.added.is_some() { "added" } else { "removed" }
                ));
                return false;
            }
            let at = config.vips.iter().position(|v| v.vip == vip);
            match (&e.added, at) {
                (Some(added), at) => match added.config(vip, &base.zones) {
                    Ok(v) => {
                        // The file may have grown since: a VIP it no longer
                        // has room for is dropped, not laid over into a
                        // start the kernel's maps would refuse.
                        let others = config.vips.iter().enumerate();
                        let after = others.filter(|&(i, _)| Some(i) != at).map(|(_, o)| o);
                        let footprints = after.chain([&v]).map(VipConfig::footprint);
                        if let Err(err) = check_limits(footprints) {
                            notes.push(format!(
                                "VIP {vip} added at runtime is dropped: with it the configuration would have {err}"
                            ));
                            return false;
                        }
                        match at {
                            Some(i) => config.vips[i] = v,
                            None => config.vips.push(v),
                        }
                    }
                    Err(err) => {
                        notes.push(format!("VIP {vip}: {err}"));
                        return false;
                    }
                },
                (None, Some(_)) => vip_removals.push(vip),
                (None, None) => {}
            }
            true
        });
        for vip in vip_removals {
            match config.vips.iter().position(|v| v.vip == vip) {
                Some(i) if config.vips.len() > 1 => {
                    config.vips.remove(i);
                }
                Some(_) => notes.push(format!(
                    "VIP {vip} was removed at runtime but is the configuration's last: kept"
                )),
                None => {}
            }
        }
        let mut backend_removals = Vec::new();
        self.backends.retain(|e| {
            let (Ok(vip), Ok(addr)) = (
                e.vip.parse::<VipAddr>(),
                e.backend.parse::<std::net::SocketAddr>(),
            ) else {
                return false;
            };
            let now = fingerprint(&base, &vip, addr);
            if now != e.config {
                notes.push(format!(
                    "backend {addr} of VIP {vip}: the configuration changed ({} → {}) since the runtime change; the configuration wins",
                    e.config.as_deref().unwrap_or("absent"),
                    now.as_deref().unwrap_or("absent")
                ));
                return false;
            }
            // The limits with one more backend in this VIP (read only for
            // a backend the entry adds).
            let room = check_limits(config.vips.iter().map(|o| {
                let (backends, maglev) = o.footprint();
                (backends + usize::from(o.vip == vip), maglev)
            }));
            let Some(v) = config.vips.iter_mut().find(|v| v.vip == vip) else {
                notes.push(format!("VIP {vip} is not configured: its runtime changes are dropped"));
                return false;
            };
            let weight = e.weight.and_then(|w| Weight::new(u64::from(w)).ok());
            let at = v.backends.iter().position(|b| b.addr == addr);
            if v.etcd_prefix.is_some() && at.is_none() {
                // Not among the members etcd gave this start: nothing to
                // lay over, and etcd, not the file, would add it. Kept, so
                // the override holds if this start's view (a cache, an
                // etcd mid-update) lacked it.
                return true;
            }
            match (e.admin, at) {
                (Admin::Removed, Some(_)) => backend_removals.push((vip, addr)),
                (Admin::Removed, None) => {}
                (_, None) => {
                    // As for a VIP: the file may have taken the room since.
                    if let Err(err) = room {
                        notes.push(format!(
                            "backend {addr} of VIP {vip} added at runtime is dropped: with it the configuration would have {err}"
                        ));
                        return false;
                    }
                    v.backends.push(BackendAddr {
                        addr,
                        weight: weight.unwrap_or(Weight::DEFAULT),
                        zone: e.zone,
                    });
                }
                (_, Some(i)) => {
                    if let Some(w) = weight {
                        v.backends[i].weight = w;
                    }
                    if e.zone.is_some() {
                        v.backends[i].zone = e.zone;
                    }
                }
            }
            if e.admin == Admin::Draining {
                drains.push((vip, addr));
            }
            true
        });
        for (vip, addr) in backend_removals {
            let Some(v) = config.vips.iter_mut().find(|v| v.vip == vip) else {
                continue;
            };
            match v.backends.iter().position(|b| b.addr == addr) {
                Some(i) if v.backends.len() > 1 => {
                    v.backends.remove(i);
                }
                Some(_) => notes.push(format!(
                    "backend {addr} of VIP {vip} was removed at runtime but is its last: kept"
                )),
                None => {}
            }
        }
        (drains, notes)
    }

    /// Records VIP `v` added at runtime (`config`: the configuration as
    /// read, without this state); replaces what was kept of that VIP.
    pub fn record_vip_added(&mut self, config: &Config, v: &VipConfig) {
        let text = v.vip.to_string();
        self.vips.retain(|e| e.vip != text);
        self.backends.retain(|e| e.vip != text);
        self.vips.push(VipEntry {
            vip: text,
            added: Some(AddedVip::of(v)),
            config: vip_fingerprint(config, &v.vip),
        });
        self.version = VERSION;
    }

    /// Records VIP `vip` removed at runtime: forgets a VIP added at
    /// runtime, or keeps a configured one removed.
    pub fn record_vip_removed(&mut self, config: &Config, vip: &VipAddr) {
        let text = vip.to_string();
        self.vips.retain(|e| e.vip != text);
        self.backends.retain(|e| e.vip != text);
        let configured = vip_fingerprint(config, vip);
        if configured.is_some() {
            self.vips.push(VipEntry {
                vip: text,
                added: None,
                config: configured,
            });
        }
        self.version = VERSION;
    }

    /// Records `change` of `backend` in `vip`; `config` is the
    /// configuration as read (without this state). An entry that no longer
    /// differs from the configuration is dropped.
    pub fn record(
        &mut self,
        config: &Config,
        vip: &VipAddr,
        backend: std::net::SocketAddr,
        change: Change,
    ) {
        let vip_text = vip.to_string();
        self.version = VERSION;
        // A VIP added at runtime keeps its backends in its own entry.
        if let Some(added) = self
            .vips
            .iter_mut()
            .find(|e| e.vip == vip_text)
            .and_then(|e| e.added.as_mut())
        {
            let at = added
                .backends
                .iter()
                .position(|b| b.parse::<BackendAddr>().is_ok_and(|b| b.addr == backend));
            match (change, at) {
                (Change::Add(weight, zone), None) => {
                    added.backends.push(
                        BackendAddr {
                            addr: backend,
                            weight,
                            zone,
                        }
                        .to_string(),
                    );
                    return;
                }
                (Change::Add(weight, zone), Some(i)) => {
                    added.backends[i] = BackendAddr {
                        addr: backend,
                        weight,
                        zone,
                    }
                    .to_string();
                    return;
                }
                (Change::Weight(weight), Some(i)) => {
                    let zone = added.backends[i]
                        .parse::<BackendAddr>()
                        .ok()
                        .and_then(|b| b.zone);
                    added.backends[i] = BackendAddr {
                        addr: backend,
                        weight,
                        zone,
                    }
                    .to_string();
                    return;
                }
                (Change::Remove, Some(i)) if added.backends.len() > 1 => {
                    added.backends.remove(i);
                    self.backends
                        .retain(|e| !(e.vip == vip_text && e.backend == backend.to_string()));
                    return;
                }
                _ => {}
            }
        }
        let backend_text = backend.to_string();
        let configured = fingerprint(config, vip, backend);
        let discovered = config
            .vips
            .iter()
            .any(|v| v.vip == *vip && v.etcd_prefix.is_some());
        let at = self
            .backends
            .iter()
            .position(|e| e.vip == vip_text && e.backend == backend_text);
        let mut entry = match at {
            Some(i) => self.backends.remove(i),
            None => Entry {
                vip: vip_text,
                backend: backend_text,
                admin: Admin::Active,
                weight: None,
                zone: None,
                config: configured.clone(),
            },
        };
        entry.config = configured.clone();
        match change {
            Change::Add(w, zone) => {
                entry.admin = Admin::Active;
                entry.weight = Some(w.get());
                entry.zone = zone;
            }
            Change::Remove => {
                entry.admin = Admin::Removed;
            }
            Change::Drain => entry.admin = Admin::Draining,
            Change::Undrain => {
                entry.admin = Admin::Active;
                // On a discovered VIP undrain clears the weight override
                // too: etcd's weight applies from its next update.
                if discovered {
                    entry.weight = None;
                }
            }
            Change::Weight(w) => entry.weight = Some(w.get()),
        }
        let in_config = configured
            .as_deref()
            .and_then(|c| c.parse::<BackendAddr>().ok());
        if entry.weight == in_config.map(|b| b.weight.get()) {
            entry.weight = None;
        }
        if in_config.is_some_and(|b| b.zone == entry.zone) {
            entry.zone = None;
        }
        let same_as_config = match (&configured, entry.admin) {
            // Not in the file, and removed: nothing to remember.
            (None, Admin::Removed) => true,
            (None, _) => false,
            (Some(_), admin) => {
                admin == Admin::Active && entry.weight.is_none() && entry.zone.is_none()
            }
        };
        if !same_as_config {
            self.backends.push(entry);
        }
        self.version = VERSION;
    }
}

#[cfg(test)]
mod tests {

    use super::*;

    fn config(backends: &[&str]) -> Config {
        let mut argv = vec!["--iface", "eth0", "--vip", "10.0.0.100:80"];
        for b in backends {
            argv.extend(["--backend", b]);
        }
        Config::of(&argv, "")
    }

    fn addr(s: &str) -> std::net::SocketAddr {
        s.parse().unwrap()
    }

    fn backends(c: &Config) -> Vec<String> {
        c.vips[0].backends.iter().map(|b| b.to_string()).collect()
    }

    /// A file that grew to its limits since a VIP or backend was added at
    /// runtime leaves no room for it: the entry is dropped with a note, and
    /// what is laid over still passes the limits (else the start would fail
    /// when the kernel's maps refuse the extra Maglev table or backend).
    #[test]
    fn runtime_additions_the_file_left_no_room_for_are_dropped() {
        let mut base = config(&["10.0.0.21:80"]);
        base.vips[0].algorithm = lb_common::Algorithm::Maglev;
        for i in 1..lb_common::MAX_MAGLEV_TABLES {
            let mut v = base.vips[0].clone();
            v.vip = format!("10.0.0.{}:80", 100 + i).parse().unwrap();
            base.vips.push(v);
        }
        // The first VIP fills up to the per-VIP limit.
        base.vips[0].backends = (0..lb_common::MAX_BACKENDS_PER_VIP)
            .map(|i| {
                format!("10.1.{}.{}:80", i / 200, 1 + i % 200)
                    .parse()
                    .unwrap()
            })
            .collect();
        base.validate_vips().unwrap();
        let mut state = RuntimeState::default();
        let maglev = AddedVip {
            algorithm: "maglev".into(),
            backends: vec!["10.0.0.31:80@1".into()],
        };
        let extra: VipAddr = "10.0.0.200:80".parse().unwrap();
        // Recorded against a file that had room for it.
        let mut smaller = base.clone();
        smaller.vips.pop();
        state.record_vip_added(&smaller, &maglev.config(extra, &base.zones).unwrap());
        let first = base.vips[0].vip;
        state.record(
            &base,
            &first,
            addr("10.0.0.41:80"),
            Change::Add(Weight::DEFAULT, None),
        );
        let mut effective = base.clone();
        let (_, notes) = state.overlay(&mut effective);
        assert_eq!(notes.len(), 2, "{notes:?}");
        assert!(
            notes[0].contains("VIP 10.0.0.200:80/tcp added at runtime is dropped")
                && notes[0].contains("too many VIPs using maglev: 9 (at most 8)"),
            "{notes:?}"
        );
        assert!(
            notes[1].contains("backend 10.0.0.41:80")
                && notes[1].contains("too many backends in one VIP: 1025 (at most 1024)"),
            "{notes:?}"
        );
        assert_eq!(effective, base);
        effective.validate_vips().unwrap();
        // With room, both are laid over.
        let mut roomy = base.clone();
        roomy.vips.pop();
        roomy.vips[0].backends.pop();
        let mut effective = roomy.clone();
        let mut state = RuntimeState::default();
        state.record_vip_added(&roomy, &maglev.config(extra, &base.zones).unwrap());
        state.record(
            &roomy,
            &first,
            addr("10.0.0.41:80"),
            Change::Add(Weight::DEFAULT, None),
        );
        let (_, notes) = state.overlay(&mut effective);
        assert!(notes.is_empty(), "{notes:?}");
        assert_eq!(effective.vips.len(), roomy.vips.len() + 1);
        effective.validate_vips().unwrap();
    }

    /// A VIP removed at runtime stays removed across an upgrade: the
    /// fingerprint recorded by this build, and the one a build before
    /// latency probes recorded (its health check's text had no
    /// `latency_probe`), both still hold for the same file. Before, the
    /// older text read as a change: the VIP came back and the operator's
    /// removal was dropped from the file.
    #[test]
    fn a_vip_removal_recorded_by_an_older_build_holds_after_an_upgrade() {
        let two = |interval: &str| {
            let file = format!(
                "[[vip]]\naddress = \"10.0.0.100:80\"\nbackends = [\"10.0.0.21:80\"]\n\
                 [vip.health]\ncheck = \"http\"\npath = \"/healthz\"\ninterval = \"{interval}\"\n\
                 [[vip]]\naddress = \"10.0.0.101:80\"\nbackends = [\"10.0.0.22:80\"]\n"
            );
            Config::of(&["--iface", "eth0"], &file)
        };
        let base = two("1s");
        let vip = base.vips[0].vip;
        let current = vip_fingerprint(&base, &vip).unwrap();
        // What this build (and the ones since latency probes) wrote, in
        // the derived `Debug`'s words: unchanged.
        assert!(
            current.contains(
                "health=Some(HealthCheck { http: Some(HttpCheck { path: \"/healthz\", status: 200 }), \
                 interval: 1s, timeout: 500ms, rise: 2, fall: 2, latency_probe: Some(250ms) }) \
                 backends=10.0.0.21:80@1"
            ),
            "{current}"
        );
        let older = current.replace(", latency_probe: Some(250ms)", "");
        assert_ne!(older, current);
        for recorded in [current.clone(), older.clone()] {
            let mut state = RuntimeState::default();
            state.record_vip_removed(&base, &vip);
            state.vips[0].config = Some(recorded.clone());
            let mut effective = base.clone();
            let (_, notes) = state.clone().overlay(&mut effective);
            assert!(notes.is_empty(), "{recorded}: {notes:?}");
            assert_eq!(effective.vips.len(), 1, "{recorded}");
            assert_eq!(effective.vips[0].vip, base.vips[1].vip);
        }
        // Probes set other than the default: no build before them wrote
        // that, so the older text does not hold.
        let off = Config::of(
            &["--iface", "eth0"],
            &format!(
                "{}[vip.health]\ncheck = \"http\"\npath = \"/healthz\"\ninterval = \"1s\"\n\
                 latency_probe_interval = \"off\"\n[[vip]]\naddress = \"10.0.0.101:80\"\n\
                 backends = [\"10.0.0.22:80\"]\n",
                "[[vip]]\naddress = \"10.0.0.100:80\"\nbackends = [\"10.0.0.21:80\"]\n"
            ),
        );
        assert!(!fingerprint_holds(&off, &vip, Some(older.as_str())));
        // A file whose check changed since did change the VIP, whichever
        // build wrote the entry.
        for recorded in [current, older] {
            let mut state = RuntimeState::default();
            state.record_vip_removed(&base, &vip);
            state.vips[0].config = Some(recorded);
            let mut effective = two("2s");
            let (_, notes) = state.overlay(&mut effective);
            assert_eq!(notes.len(), 1, "{notes:?}");
            assert_eq!(effective.vips.len(), 2);
        }
    }

    #[test]
    fn vips_added_and_removed_at_runtime_are_laid_over_until_the_file_defines_them() {
        let base = config(&["10.0.0.21:80", "10.0.0.22:80"]);
        let mut state = RuntimeState::default();
        let added = AddedVip {
            algorithm: "maglev".into(),
            backends: vec!["10.0.0.31:80@1".into(), "10.0.0.32:80@2".into()],
        };
        let new_vip: VipAddr = "10.0.0.101:80".parse().unwrap();
        let v = added.config(new_vip, &base.zones).unwrap();
        state.record_vip_added(&base, &v);
        // Backend commands on a runtime VIP change its own entry.
        state.record(
            &base,
            &new_vip,
            addr("10.0.0.33:80"),
            Change::Add(Weight::new(4).unwrap(), None),
        );
        state.record(&base, &new_vip, addr("10.0.0.31:80"), Change::Remove);
        state.record(
            &base,
            &new_vip,
            addr("10.0.0.32:80"),
            Change::Weight(Weight::new(7).unwrap()),
        );
        assert!(state.backends.is_empty(), "{:?}", state.backends);

        let dir = std::env::temp_dir().join(format!("lb-state-vips-{}", std::process::id()));
        let file = path(&dir, "lb-test");
        state.save(&file).unwrap();
        let mut read = RuntimeState::load(&file).unwrap().0.unwrap();
        assert_eq!(read, state);
        let _ = std::fs::remove_dir_all(&dir);

        let mut effective = base.clone();
        let (_, notes) = read.overlay(&mut effective);
        assert!(notes.is_empty(), "{notes:?}");
        assert_eq!(effective.vips.len(), 2);
        let v = &effective.vips[1];
        assert_eq!(v.vip, new_vip);
        assert_eq!(v.algorithm, lb_common::Algorithm::Maglev);
        let got: Vec<String> = v.backends.iter().map(ToString::to_string).collect();
        assert_eq!(got, ["10.0.0.32:80@7", "10.0.0.33:80@4"]);

        // The configured VIP removed at runtime stays removed while the
        // file says the same of it.
        let old_vip = base.vips[0].vip;
        state.record_vip_removed(&base, &old_vip);
        let mut effective = base.clone();
        state.clone().overlay(&mut effective);
        assert_eq!(effective.vips.len(), 1);
        assert_eq!(effective.vips[0].vip, new_vip);

        // The file now defines both: it wins, and the entries go.
        let mut edited = config(&["10.0.0.21:80", "10.0.0.22:80@3"]);
        let mut other = edited.vips[0].clone();
        other.vip = new_vip;
        other.backends.truncate(1);
        edited.vips.push(other);
        let mut effective = edited.clone();
        let (_, notes) = state.overlay(&mut effective);
        assert_eq!(notes.len(), 2, "{notes:?}");
        assert!(state.vips.is_empty());
        assert_eq!(effective.vips, edited.vips);

        // Removing a runtime VIP forgets it.
        let mut state = RuntimeState::default();
        state.record_vip_added(&base, v);
        state.record_vip_removed(&base, &new_vip);
        assert!(state.vips.is_empty());
        // A VIP entry this build cannot serve (an algorithm it does not
        // know: a newer build's file) is dropped, the rest kept.
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(&file, r#"{"version":1,"backends":[],"vips":[{"vip":"10.0.0.9:80","added":{"algorithm":"nope","backends":["10.0.0.31:80"]},"config":null},{"vip":"10.0.0.9:81","added":{"algorithm":"random","backends":["10.0.0.31:80"]},"config":null}]}"#).unwrap();
        let loaded = RuntimeState::load(&file).unwrap().0.unwrap();
        let kept: Vec<&str> = loaded.vips.iter().map(|v| v.vip.as_str()).collect();
        assert_eq!(kept, ["10.0.0.9:81"]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A configuration whose VIP 10.0.0.100:80 takes its backends from
    /// etcd, with `members` as discovery seeded them (`discover::watch::seed`
    /// fills them in before the state is laid over).
    fn discovered(members: &[&str]) -> Config {
        let mut c = Config::of(
            &["--iface", "eth0"],
            "etcd_endpoints = [\"http://127.0.0.1:2379\"]\n\
             [[vip]]\naddress = \"10.0.0.100:80\"\netcd_prefix = \"/lb/web/\"\n\
             [[vip]]\naddress = \"10.0.0.101:80\"\netcd_prefix = \"/lb/api/\"\n",
        );
        c.vips[0].backends = members.iter().map(|b| b.parse().unwrap()).collect();
        c.vips[1].backends = vec!["10.0.0.31:80".parse().unwrap()];
        c
    }

    /// Operator overrides on a discovered VIP hold whatever etcd says
    /// (README, "Operator overrides win"), across restarts and SIGHUPs:
    /// etcd's membership is not the configuration, so its changes do not
    /// overtake them. Before, each entry's fingerprint was the membership
    /// at the time of the command, and the next start or SIGHUP with
    /// another membership dropped the drain, the weight and the VIP's
    /// removal as "the configuration changed".
    #[test]
    fn overrides_on_a_discovered_vip_hold_whatever_its_membership_becomes() {
        let vip: VipAddr = "10.0.0.100:80".parse().unwrap();
        // Started with A; etcd then added C, which the operator drained,
        // and B, which the operator weighted.
        let started = discovered(&["10.0.0.21:80"]);
        let mut state = RuntimeState::default();
        state.record(&started, &vip, addr("10.0.0.23:80"), Change::Drain);
        let five = Weight::new(5).unwrap();
        state.record(&started, &vip, addr("10.0.0.22:80"), Change::Weight(five));
        let api: VipAddr = "10.0.0.101:80".parse().unwrap();
        state.record_vip_removed(&started, &api);
        // Restarted: etcd now has A, B (weight 1) and C, and the API VIP
        // has another member.
        let mut restarted = discovered(&["10.0.0.21:80", "10.0.0.22:80", "10.0.0.23:80"]);
        restarted.vips[1].backends = vec!["10.0.0.32:80".parse().unwrap()];
        let mut effective = restarted.clone();
        let (drains, notes) = state.overlay(&mut effective);
        assert!(notes.is_empty(), "{notes:?}");
        assert_eq!(drains, [(vip, addr("10.0.0.23:80"))]);
        assert_eq!(
            backends(&effective),
            ["10.0.0.21:80@1", "10.0.0.22:80@5", "10.0.0.23:80@1"]
        );
        assert_eq!(effective.vips.len(), 1, "the API VIP stays removed");
        assert_eq!(state.backends.len(), 2);
        assert_eq!(state.vips.len(), 1);
        // A start whose view lacks C (etcd mid-update) adds nothing for it
        // and keeps the drain for the next.
        let mut without_c = discovered(&["10.0.0.21:80", "10.0.0.22:80"]);
        let (drains, notes) = state.overlay(&mut without_c);
        assert!(notes.is_empty(), "{notes:?}");
        assert!(drains.is_empty());
        assert_eq!(backends(&without_c), ["10.0.0.21:80@1", "10.0.0.22:80@5"]);
        assert_eq!(state.backends.len(), 2);
        // Undrain clears both the drain and the weight override (etcd's
        // weight applies again): nothing left to keep.
        state.record(&restarted, &vip, addr("10.0.0.23:80"), Change::Undrain);
        state.record(&restarted, &vip, addr("10.0.0.22:80"), Change::Undrain);
        assert!(state.backends.is_empty(), "{:?}", state.backends);
        // A file that takes the VIPs off etcd (and drops the API VIP)
        // overtakes what was kept for them.
        state.record(&restarted, &vip, addr("10.0.0.23:80"), Change::Drain);
        let mut fixed = config(&["10.0.0.21:80", "10.0.0.23:80"]);
        let (drains, notes) = state.overlay(&mut fixed);
        assert!(drains.is_empty());
        assert_eq!(notes.len(), 2, "{notes:?}");
        assert!(
            notes[1].contains("(etcd /lb/web/ → 10.0.0.23:80@1)"),
            "{}",
            notes[1]
        );
        assert!(state.backends.is_empty() && state.vips.is_empty());
    }

    #[test]
    fn entries_the_snat_rules_now_refuse_are_dropped_and_the_rest_applies() {
        // Saved by a run with other SNAT addresses: each was valid then.
        let base = config(&["10.0.0.21:80"]);
        let vip = base.vips[0].vip;
        let mut state = RuntimeState::default();
        let add = |state: &mut RuntimeState, vip: &str, backends: &[&str]| {
            let added = AddedVip {
                algorithm: "random".into(),
                backends: backends.iter().map(|b| b.to_string()).collect(),
            };
            let v = added.config(vip.parse().unwrap(), &base.zones).unwrap();
            state.record_vip_added(&base, &v);
        };
        add(&mut state, "10.0.0.101:25000", &["10.0.0.31:80"]);
        add(
            &mut state,
            "10.0.0.102:80",
            &["10.0.0.31:80", "10.0.0.5:80"],
        );
        add(&mut state, "10.0.0.103:80", &["10.0.0.31:80"]);
        add(&mut state, "10.0.0.5:80", &["10.0.0.31:80"]);
        // This run has no IPv6 SNAT address (it started with IPv4 VIPs only).
        add(&mut state, "[2001:db8::100]:80", &["[2001:db8::31]:80"]);
        let one = Weight::DEFAULT;
        state.record(&base, &vip, addr("10.0.0.5:80"), Change::Add(one, None));
        state.record(&base, &vip, addr("10.0.0.5:81"), Change::Add(one, None));
        state.record(&base, &vip, addr("10.0.0.5:81"), Change::Drain);
        state.record(&base, &vip, addr("10.0.0.24:80"), Change::Add(one, None));
        state.record(&base, &vip, addr("10.0.0.21:80"), Change::Drain);
        // This run's pools: 10.0.0.101 and 10.0.0.5, the default ports.
        let snat: Vec<IpAddr> = vec!["10.0.0.101".parse().unwrap(), "10.0.0.5".parse().unwrap()];
        let dropped = state.drop_snat_refused(&snat, base.snat_ports);
        assert_eq!(dropped.len(), 5, "{dropped:#?}");
        assert!(
            dropped[0].starts_with(
                "VIP 10.0.0.101:25000/tcp added at runtime: VIP 10.0.0.101:25000/tcp is on SNAT \
                 address 10.0.0.101 with its port in the SNAT port range 20000-32767"
            ),
            "{}",
            dropped[0]
        );
        assert!(
            dropped[1].starts_with(
                "VIP 10.0.0.102:80/tcp added at runtime: backend 10.0.0.5:80 of VIP \
                 10.0.0.102:80/tcp is at SNAT address 10.0.0.5"
            ),
            "{}",
            dropped[1]
        );
        assert!(
            dropped[2].starts_with(
                "VIP [2001:db8::100]:80/tcp added at runtime: VIP [2001:db8::100]:80/tcp is \
                 IPv6, and this balancer has no IPv6 SNAT address"
            ),
            "{}",
            dropped[2]
        );
        assert!(
            dropped[3].starts_with(
                "backend added at runtime: backend 10.0.0.5:80 of VIP 10.0.0.100:80/tcp is at \
                 SNAT address 10.0.0.5"
            ),
            "{}",
            dropped[3]
        );
        assert!(
            dropped[4].starts_with("backend drained at runtime: backend 10.0.0.5:81"),
            "{}",
            dropped[4]
        );
        // A VIP on a SNAT address with its port out of the range stays.
        let vips: Vec<&str> = state.vips.iter().map(|e| e.vip.as_str()).collect();
        assert_eq!(vips, ["10.0.0.103:80/tcp", "10.0.0.5:80/tcp"]);
        let kept: Vec<&str> = state.backends.iter().map(|e| e.backend.as_str()).collect();
        assert_eq!(kept, ["10.0.0.24:80", "10.0.0.21:80"]);
        // What is left applies, and meets the rules.
        let mut effective = base.clone();
        let (drains, notes) = state.overlay(&mut effective);
        assert!(notes.is_empty(), "{notes:?}");
        assert_eq!(drains, [(vip, addr("10.0.0.21:80"))]);
        assert_eq!(backends(&effective), ["10.0.0.21:80@1", "10.0.0.24:80@1"]);
        assert_eq!(effective.vips.len(), 3);
        for v in &effective.vips {
            check_snat(v, &snat, base.snat_ports).unwrap();
        }
        // Against other pools, nothing of what is left is refused.
        assert!(
            state
                .drop_snat_refused(&["10.0.0.9".parse().unwrap()], base.snat_ports)
                .is_empty()
        );
    }

    #[test]
    fn changes_are_laid_over_the_config_while_it_says_the_same() {
        let base = config(&["10.0.0.21:80", "10.0.0.22:80@2", "10.0.0.23:80"]);
        let vip = base.vips[0].vip;
        let mut state = RuntimeState::default();
        state.record(&base, &vip, addr("10.0.0.21:80"), Change::Drain);
        state.record(
            &base,
            &vip,
            addr("10.0.0.22:80"),
            Change::Weight(Weight::new(5).unwrap()),
        );
        state.record(&base, &vip, addr("10.0.0.23:80"), Change::Remove);
        state.record(
            &base,
            &vip,
            addr("10.0.0.24:80"),
            Change::Add(Weight::new(3).unwrap(), None),
        );
        // Added, then removed again: nothing left to remember of it.
        state.record(
            &base,
            &vip,
            addr("10.0.0.25:80"),
            Change::Add(Weight::DEFAULT, None),
        );
        state.record(&base, &vip, addr("10.0.0.25:80"), Change::Remove);
        assert_eq!(state.backends.len(), 4);

        // The saved state is read back the same.
        let dir = std::env::temp_dir().join(format!("lb-state-{}", std::process::id()));
        let file = path(&dir, "lb-test");
        state.save(&file).unwrap();
        let mut loaded = RuntimeState::load(&file).unwrap().0.unwrap();
        assert_eq!(loaded, state);
        std::fs::remove_dir_all(&dir).unwrap();

        let mut effective = base.clone();
        let (drains, notes) = loaded.overlay(&mut effective);
        assert!(notes.is_empty(), "{notes:?}");
        assert_eq!(drains, [(vip, addr("10.0.0.21:80"))]);
        assert_eq!(
            backends(&effective),
            ["10.0.0.21:80@1", "10.0.0.22:80@5", "10.0.0.24:80@3"]
        );

        // The file edits backend 22 and adds 24 itself: the file wins there.
        let edited = config(&[
            "10.0.0.21:80",
            "10.0.0.22:80@7",
            "10.0.0.23:80",
            "10.0.0.24:80",
        ]);
        let mut effective = edited.clone();
        let (drains, notes) = loaded.overlay(&mut effective);
        assert_eq!(notes.len(), 2, "{notes:?}");
        assert_eq!(drains.len(), 1);
        assert_eq!(
            backends(&effective),
            ["10.0.0.21:80@1", "10.0.0.22:80@7", "10.0.0.24:80@1"]
        );
        assert_eq!(loaded.backends.len(), 2);
    }

    #[test]
    fn a_zone_survives_the_state_file() {
        let zone = |z: &str| Some(z.parse::<ZoneName>().unwrap());
        let base = config(&["10.0.0.21:80,zone=a", "10.0.0.22:80"]);
        let vip = base.vips[0].vip;
        let mut state = RuntimeState::default();
        // Added at runtime in zone b; the configured one re-added in its
        // own zone is no change.
        state.record(
            &base,
            &vip,
            addr("10.0.0.23:80"),
            Change::Add(Weight::new(2).unwrap(), zone("b")),
        );
        state.record(
            &base,
            &vip,
            addr("10.0.0.21:80"),
            Change::Add(Weight::DEFAULT, zone("a")),
        );
        // A configured backend without a zone, re-added in zone c.
        state.record(
            &base,
            &vip,
            addr("10.0.0.22:80"),
            Change::Add(Weight::DEFAULT, zone("c")),
        );
        assert_eq!(state.backends.len(), 2, "{:?}", state.backends);
        // A VIP added at runtime keeps its backends' zones, also across a
        // weight change.
        let added = AddedVip {
            algorithm: "random".into(),
            backends: vec!["10.0.0.31:80@1,zone=a".into()],
        };
        let new_vip: VipAddr = "10.0.0.101:80".parse().unwrap();
        state.record_vip_added(&base, &added.config(new_vip, &base.zones).unwrap());
        state.record(
            &base,
            &new_vip,
            addr("10.0.0.31:80"),
            Change::Weight(Weight::new(3).unwrap()),
        );
        state.record(
            &base,
            &new_vip,
            addr("10.0.0.32:80"),
            Change::Add(Weight::DEFAULT, zone("b")),
        );

        let dir = std::env::temp_dir().join(format!("lb-state-zones-{}", std::process::id()));
        let file = path(&dir, "lb-test");
        state.save(&file).unwrap();
        let text = std::fs::read_to_string(&file).unwrap();
        assert!(text.contains(r#""zone": "b""#), "{text}");
        assert!(text.contains("10.0.0.32:80@1,zone=b"), "{text}");
        let mut loaded = RuntimeState::load(&file).unwrap().0.unwrap();
        assert_eq!(loaded, state);
        let _ = std::fs::remove_dir_all(&dir);

        let mut effective = base.clone();
        let (_, notes) = loaded.overlay(&mut effective);
        assert!(notes.is_empty(), "{notes:?}");
        assert_eq!(
            backends(&effective),
            [
                "10.0.0.21:80@1,zone=a",
                "10.0.0.22:80@1,zone=c",
                "10.0.0.23:80@2,zone=b"
            ]
        );
        let got: Vec<String> = effective.vips[1]
            .backends
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(got, ["10.0.0.31:80@3,zone=a", "10.0.0.32:80@1,zone=b"]);

        // The file moves backend 21 to another zone: the file wins there.
        let edited = config(&["10.0.0.21:80,zone=b", "10.0.0.22:80"]);
        let mut effective = edited.clone();
        let (_, notes) = state.clone().overlay(&mut effective);
        assert!(notes.is_empty(), "entry 21 was never kept: {notes:?}");
        assert_eq!(effective.vips[0].backends[0].zone, zone("b"));
        let edited = config(&["10.0.0.21:80", "10.0.0.22:80,zone=d"]);
        let mut effective = edited.clone();
        let (_, notes) = state.overlay(&mut effective);
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert_eq!(effective.vips[0].backends[1].zone, zone("d"));
    }

    #[test]
    fn undoing_a_change_forgets_it() {
        let base = config(&["10.0.0.21:80@2"]);
        let vip = base.vips[0].vip;
        let mut state = RuntimeState::default();
        state.record(&base, &vip, addr("10.0.0.21:80"), Change::Drain);
        state.record(
            &base,
            &vip,
            addr("10.0.0.21:80"),
            Change::Weight(Weight::new(4).unwrap()),
        );
        assert_eq!(state.backends.len(), 1);
        state.record(&base, &vip, addr("10.0.0.21:80"), Change::Undrain);
        state.record(
            &base,
            &vip,
            addr("10.0.0.21:80"),
            Change::Weight(Weight::new(2).unwrap()),
        );
        assert!(state.backends.is_empty(), "{state:?}");
    }

    #[test]
    fn a_corrupt_or_foreign_file_is_refused_with_its_path() {
        let dir = std::env::temp_dir().join(format!("lb-state-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = path(&dir, "x");
        assert_eq!(RuntimeState::load(&file).unwrap(), (None, Vec::new()));
        for (text, why) in [
            ("{\"version\":1,\"backends\":[", "EOF"),
            ("{\"version\":9,\"backends\":[]}", "unknown version 9"),
            (
                "{\"version\":1,\"backends\":[{\"vip\":\"nope\",\"backend\":\"10.0.0.1:1\",\"config\":null}]}",
                "vip 'nope'",
            ),
        ] {
            std::fs::write(&file, text).unwrap();
            let err = RuntimeState::load(&file).unwrap_err().to_string();
            assert!(err.contains(&file.display().to_string()), "{err}");
            assert!(err.contains(why), "{err}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// An entry that breaks the configuration's rules (one an older build
    /// accepted) is dropped at load, with a warning; the file's other
    /// entries stay, and the start goes on (an upgrade must not refuse to
    /// start over it).
    #[test]
    fn a_state_file_is_held_to_the_configurations_rules() {
        let dir = std::env::temp_dir().join(format!("lb-state-rules-{}", std::process::id()));
        let file = path(&dir, "lb-test");
        std::fs::create_dir_all(&dir).unwrap();
        let load = |text: &str| {
            std::fs::write(&file, text).unwrap();
            RuntimeState::load(&file).unwrap().0.unwrap()
        };
        let backend = |vip: &str, backend: &str, weight: u32| {
            format!(
                r#"{{"vip":"{vip}","backend":"{backend}","admin":"active","weight":{weight},"config":null}}"#
            )
        };
        let backends = |entries: &[String]| {
            format!(
                r#"{{"version":{VERSION},"backends":[{}]}}"#,
                entries.join(",")
            )
        };
        let added = |backends: &str| {
            format!(
                r#"{{"version":{VERSION},"backends":[],"vips":[{{"vip":"10.0.0.9:80/tcp","added":{{"algorithm":"random","backends":{backends}}},"config":null}}]}}"#
            )
        };
        let good = backend("10.0.0.100:80", "10.0.0.21:80", 5);
        assert_eq!(
            load(&backends(std::slice::from_ref(&good))).backends.len(),
            1
        );
        assert_eq!(load(&added(r#"["10.0.0.31:80"]"#)).vips.len(), 1);
        for bad in [
            backend("10.0.0.100:80", "10.0.0.22:80", 0),
            backend("10.0.0.100:80", "10.0.0.22:80", 4_000_000_000),
            backend("10.0.0.100:80", "[2001:db8::21]:80", 1),
            backend("10.0.0.100:80", "127.0.0.1:80", 1),
            backend("10.0.0.100:80", "224.0.0.5:80", 1),
            backend("10.0.0.100:80", "10.0.0.100:80", 1),
            // An IPv6 scope id, which builds before stop 66 took in.
            backend("[2001:db8::100]:80", "[2001:db8::21%2]:80", 1),
            backend("[2001:db8::100%2]:80", "[2001:db8::21]:80", 1),
        ] {
            let state = load(&backends(&[good.clone(), bad.clone()]));
            let kept: Vec<&str> = state.backends.iter().map(|e| e.backend.as_str()).collect();
            assert_eq!(kept, ["10.0.0.21:80"], "{bad}");
            // One warning, naming the file and the entry, for the caller
            // to log once the log is set up.
            let (_, warnings) = RuntimeState::load(&file).unwrap();
            assert_eq!(warnings.len(), 1, "{warnings:?}");
            assert!(
                warnings[0].starts_with(&format!("runtime state {}: dropped", file.display())),
                "{warnings:?}"
            );
        }
        assert_eq!(
            RuntimeState::load(&file).map(|(_, w)| w.len()).ok(),
            Some(1)
        );
        for bad in [
            r#"["[2001:db8::21]:80"]"#,
            r#"["127.0.0.1:80"]"#,
            r#"["10.0.0.31:80","10.0.0.31:80"]"#,
            "[]",
            r#"["224.0.0.1:80"]"#,
            r#"["10.0.0.9:80"]"#,
        ] {
            assert!(load(&added(bad)).vips.is_empty(), "{bad}");
        }
        // What cannot be read at all still refuses the start.
        std::fs::write(&file, backends(&[backend("nonsense", "10.0.0.21:80", 1)])).unwrap();
        let err = RuntimeState::load(&file).unwrap_err().to_string();
        assert!(err.contains("move it away"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A removal is judged after the additions, whatever the order of the
    /// entries: a later command on an added backend (or an added VIP)
    /// moves its entry behind the removal's.
    #[test]
    fn a_runtime_removal_survives_a_restart_whatever_the_entry_order() {
        let base = config(&["10.0.0.21:80"]);
        let vip = base.vips[0].vip;
        let mut state = RuntimeState::default();
        state.record(
            &base,
            &vip,
            addr("10.0.0.22:80"),
            Change::Add(Weight::DEFAULT, None),
        );
        state.record(&base, &vip, addr("10.0.0.21:80"), Change::Remove);
        state.record(
            &base,
            &vip,
            addr("10.0.0.22:80"),
            Change::Weight(Weight::new(5).unwrap()),
        );
        let mut effective = base.clone();
        let (_, notes) = state.clone().overlay(&mut effective);
        assert!(notes.is_empty(), "{notes:?}");
        assert_eq!(backends(&effective), ["10.0.0.22:80@5"]);

        // The configured VIP removed, then another one added: only the
        // added one is served after a restart.
        let mut state = RuntimeState::default();
        state.record_vip_removed(&base, &vip);
        let added = AddedVip {
            algorithm: "random".into(),
            backends: vec!["10.0.0.31:80@1".into()],
        };
        let new_vip: VipAddr = "10.0.0.101:80".parse().unwrap();
        state.record_vip_added(&base, &added.config(new_vip, &base.zones).unwrap());
        let mut effective = base.clone();
        let (_, notes) = state.clone().overlay(&mut effective);
        assert!(notes.is_empty(), "{notes:?}");
        let served: Vec<String> = effective.vips.iter().map(|v| v.vip.to_string()).collect();
        assert_eq!(served, ["10.0.0.101:80/tcp"]);

        // The last backend, and the last VIP, are kept, and said so.
        let mut state = RuntimeState::default();
        state.record(&base, &vip, addr("10.0.0.21:80"), Change::Remove);
        let mut effective = base.clone();
        let (_, notes) = state.overlay(&mut effective);
        assert_eq!(backends(&effective), ["10.0.0.21:80@1"]);
        assert!(notes[0].contains("is its last: kept"), "{notes:?}");
    }
}
