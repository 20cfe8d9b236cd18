//! Operator commands from the control socket, applied to the running state.

use anyhow::Context as _;
use tracing::info;

use super::{errors::Stage, runtime::Runtime};
use crate::{
    kernel::clock::Nanos,
    pool::lifecycle::Admin,
    settings::{
        addr::{BackendAddr, VipAddr, Weight},
        cli::{BackendCommand, ControlCommand},
        config::{VipConfig, check_backend},
        state::AddedVip,
    },
    surface::control::{Request, Response},
};

impl Runtime {
    /// Runs one operator command; the kernel has the change when this
    /// returns `ok`. A command that was accepted but whose kernel write
    /// failed is answered with the error, counted, and written by the
    /// next tick (the fleet already has it).
    pub fn on_command(&mut self, request: &Request, now: Nanos) -> Response {
        let peer = request.peer.map(|p| p.to_string()).unwrap_or_default();
        let id = match self.apply_command(request, now) {
            Ok(id) => id,
            Err(e) => {
                info!(command = ?request.command, vip = %request.vip, backend = %request.backend, %peer, "operator command refused: {e:#}");
                return Response::failed(format!("{e:#}"));
            }
        };
        self.state.record(request);
        self.note_override(request);
        self.after_membership_change();
        match self.on_tick(now) {
            Ok(()) => {
                info!(command = ?request.command, vip = %request.vip, backend = %request.backend, %peer, "operator command applied");
                Response::done(id)
            }
            Err(e) => {
                let e =
                    e.context("accepted, but writing it to the kernel failed (retried every tick)");
                self.errors.record(Stage::Command, &e);
                Response::failed(format!("{e:#}"))
            }
        }
    }

    fn apply_command(&mut self, request: &Request, now: Nanos) -> anyhow::Result<u32> {
        let vip: VipAddr = request.vip.parse().context("vip")?;
        let command = match request.command.backend() {
            Some(command) => command,
            None if request.command == ControlCommand::VipAdd => {
                let v = self.vip_to_add(vip, request)?;
                let params = self.state.base().ops.lifecycle_for(None);
                let (vip_id, ids) = self.fleet.add_vip(&v, params, now)?;
                for id in ids {
                    self.loads.reset(id, now);
                }
                self.state.record_vip_added(&v);
                return Ok(vip_id);
            }
            None => {
                self.fleet.check_not_last_vip(&vip)?;
                let vip_id = self.fleet.remove_vip(&vip, now)?;
                self.state.record_vip_removed(&vip);
                return Ok(vip_id);
            }
        };
        let backend: BackendAddr = request.backend.parse().context("backend")?;
        let fleet = &mut self.fleet;
        let id = match command {
            BackendCommand::Add => {
                // A configured backend's rules (a host's address, not the
                // VIP, of its family).
                check_backend(&vip, backend.addr)?;
                // The control socket resolved its MAC already.
                let id = fleet.add(&vip, backend, now)?;
                self.loads.reset(id, now);
                id
            }
            BackendCommand::Remove => {
                fleet.check_not_last(&vip, backend.addr)?;
                fleet.set_admin(&vip, backend.addr, Admin::Removed, now)?
            }
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

    /// The VIP a `vip-add` request asks for, validated as a configured
    /// one would be (no health check, the default in-flight bias).
    fn vip_to_add(&self, vip: VipAddr, request: &Request) -> anyhow::Result<VipConfig> {
        let added = AddedVip {
            algorithm: request
                .algorithm
                .clone()
                .unwrap_or_else(|| lb_common::Algorithm::P2cEwma.name().to_string()),
            backends: request.backends.clone(),
        };
        let v = added
            .config(vip, &self.state.base().zones)
            .map_err(anyhow::Error::msg)?;
        let mut alone = self.state.base().clone();
        alone.vips = vec![v.clone()];
        alone.validate_vips()?;
        Ok(v)
    }
}
