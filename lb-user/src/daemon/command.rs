//! Operator commands from the control socket, applied to the running state.

use anyhow::Context as _;
use tracing::info;

use super::runtime::Runtime;
use crate::{
    kernel::clock::Nanos,
    pool::lifecycle::Admin,
    settings::{
        addr::{BackendAddr, VipAddr, Weight},
        cli::BackendCommand,
    },
    surface::control::{Request, Response},
};

impl Runtime {
    /// Runs one operator command; the kernel has the change when this returns.
    pub fn on_command(&mut self, request: &Request, now: Nanos) -> Response {
        let applied = self.apply_command(request, now).and_then(|id| {
            self.after_membership_change();
            self.on_tick(now)?;
            Ok(id)
        });
        match applied {
            Ok(id) => {
                self.note_override(request);
                info!(command = ?request.command, vip = %request.vip, backend = %request.backend, "operator command applied");
                Response::done(id)
            }
            Err(e) => Response::failed(format!("{e:#}")),
        }
    }

    fn apply_command(&mut self, request: &Request, now: Nanos) -> anyhow::Result<u32> {
        let vip: VipAddr = request.vip.parse().context("vip")?;
        let backend: BackendAddr = request.backend.parse().context("backend")?;
        let fleet = &mut self.fleet;
        let id = match request.command {
            BackendCommand::Add => {
                // The control socket resolved its MAC already.
                let id = fleet.add(&vip, backend, now)?;
                self.loads.reset(id, self.fresh_load.clone());
                id
            }
            BackendCommand::Remove => fleet.set_admin(&vip, backend.addr, Admin::Removed, now)?,
            BackendCommand::Drain => fleet.set_admin(&vip, backend.addr, Admin::Draining, now)?,
            BackendCommand::Undrain => fleet.set_admin(&vip, backend.addr, Admin::Active, now)?,
            BackendCommand::Weight => {
                let weight = request
                    .weight
                    .ok_or_else(|| anyhow::anyhow!("weight needs a weight"))?;
                let weight = Weight::new(u64::from(weight))?;
                fleet.set_weight(&vip, backend.addr, weight.get(), now)?
            }
        };
        Ok(id)
    }
}
