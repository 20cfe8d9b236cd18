//! The zones file `lb-user status` reads: each zone-aware VIP's routing
//! state as the last tick planned it (the kernel's zone blocks hold only
//! slot ranges and shares, not zone names).

use std::path::Path;

use lb_common::ZONE_SHARE_SCALE;

use super::runtime::Runtime;
use crate::{
    pool::zones::zone_label,
    surface::status::{ZoneRouting, ZoneStatus, ZonesFile},
};

impl Runtime {
    /// What the zones file should say now.
    fn zones_file(&self) -> ZonesFile {
        let mut file = ZonesFile::default();
        let local = self.fleet.zones.local;
        for vip in self.fleet.zone_aware_vips() {
            let Some(plan) = &vip.zone_plan else {
                continue;
            };
            let backend_zones = vip
                .members
                .iter()
                .filter_map(|&id| self.fleet.member(id))
                .map(|m| (m.addr.to_string(), zone_label(m.zone)))
                .collect();
            let zones = plan
                .blocks
                .iter()
                .map(|b| ZoneStatus {
                    zone: b.label(),
                    // Three decimals: jitter below that does not rewrite the file.
                    share: (f64::from(b.share) / f64::from(ZONE_SHARE_SCALE) * 1000.0).round()
                        / 1000.0,
                    backends: b.members,
                    active: b.active,
                })
                .collect();
            file.vips.insert(
                vip.addr.to_string(),
                ZoneRouting {
                    local_zone: zone_label(local),
                    spill: plan.spill.name().to_string(),
                    reason: plan.reason.clone(),
                    zones,
                    backend_zones,
                },
            );
        }
        file
    }

    /// Rewrites the zones file (atomically) if the routing changed since
    /// the last write. A failed write is logged and retried next tick.
    pub(super) fn write_zones_file(&mut self) {
        let file = self.zones_file();
        if self.zones_written.as_ref() == Some(&file) {
            return;
        }
        if file.vips.is_empty() && self.zones_written.is_none() {
            return;
        }
        match write_atomically(&self.zones_path, &file) {
            Ok(()) => self.zones_written = Some(file),
            Err(e) => tracing::debug!("cannot write {}: {e}", self.zones_path.display()),
        }
    }
}

fn write_atomically(path: &Path, file: &ZonesFile) -> std::io::Result<()> {
    let text = serde_json::to_vec(file).map_err(std::io::Error::other)?;
    crate::kernel::instance::write_private(path, &text)
}
