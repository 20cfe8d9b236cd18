//! Operator commands from the control socket, applied to the running state.

use std::net::SocketAddr;

use anyhow::Context as _;
use tracing::info;

use super::{errors::Stage, runtime::Runtime, startup::Snat};
use crate::{
    kernel::clock::Nanos,
    pool::lifecycle::Admin,
    settings::{
        addr::{BackendAddr, VipAddr, Weight},
        cli::{BackendCommand, ControlCommand},
        config::{Config, VipConfig, check_backend, check_backend_snat},
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
                // Quoted: the error may repeat the peer's text.
                let error = format!("{e:#}");
                info!(command = ?request.command, vip = ?request.vip, backend = ?request.backend, %peer, ?error, "operator command refused");
                return Response::failed(format!("{e:#}"));
            }
        };
        self.state.record(request);
        self.note_override(request);
        self.after_membership_change();
        match self.on_tick(now) {
            Ok(()) => {
                info!(command = ?request.command, vip = ?request.vip, backend = ?request.backend, %peer, "operator command applied");
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
                let v = vip_to_add(self.state.base(), &self.snat, vip, request)?;
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
                check_backend_to_add(&self.snat, &vip, backend.addr)?;
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
                fleet.check_not_removed(&vip, backend.addr)?;
                fleet.set_weight(&vip, backend.addr, weight.get(), now)?
            }
        };
        Ok(id)
    }
}

/// The VIP a `vip-add` request asks for, validated as a configured one
/// would be (no health check, the default in-flight bias) against `base`,
/// the configuration as read, and against `snat`, the pools and ports the
/// kernel has (the interface's address too, which `base` does not list; a
/// reload that changed them left them to a restart).
fn vip_to_add(
    base: &Config,
    snat: &Snat,
    vip: VipAddr,
    request: &Request,
) -> anyhow::Result<VipConfig> {
    let added = AddedVip {
        algorithm: request
            .algorithm
            .clone()
            .unwrap_or_else(|| lb_common::Algorithm::P2cEwma.name().to_string()),
        backends: request.backends.clone(),
    };
    let v = added.config(vip, &base.zones).map_err(anyhow::Error::msg)?;
    let mut alone = base.clone();
    alone.vips = vec![v.clone()];
    alone.validate_vips()?;
    snat.check(&v)?;
    Ok(v)
}

/// A configured backend's rules for `backend add`'s backend (a usable
/// host's address, not the VIP, of its family), and not at an address of
/// `snat`, the pools the kernel has.
fn check_backend_to_add(snat: &Snat, vip: &VipAddr, backend: SocketAddr) -> anyhow::Result<()> {
    check_backend(vip, backend)?;
    check_backend_snat(vip, backend, &snat.addrs())?;
    Ok(())
}

#[cfg(test)]
mod tests {

    use super::*;

    /// A balancer started with VIP 10.0.0.100:80 and no `--snat-ip`,
    /// whose interface's address, 10.0.0.1, is its SNAT address.
    fn running() -> (Config, Snat) {
        let base = Config::of(
            &[
                "--iface",
                "eth0",
                "--vip",
                "10.0.0.100:80",
                "--backend",
                "10.0.0.21:80",
            ],
            "",
        );
        let snat = Snat {
            v4: vec!["10.0.0.1".parse().unwrap()],
            v6: Vec::new(),
            ports: base.snat_ports,
        };
        (base, snat)
    }

    fn vip_add(vip: &str, backends: &[&str]) -> Request {
        Request {
            command: ControlCommand::VipAdd,
            vip: vip.into(),
            backend: String::new(),
            weight: None,
            backends: backends.iter().map(|b| b.to_string()).collect(),
            algorithm: None,
            peer: None,
        }
    }

    fn add_vip(vip: &str, backends: &[&str]) -> anyhow::Result<VipConfig> {
        let (base, snat) = running();
        vip_to_add(&base, &snat, vip.parse().unwrap(), &vip_add(vip, backends))
    }

    #[test]
    fn vip_add_is_held_to_the_snat_rules_against_the_running_pools() {
        let e = add_vip("10.0.0.1:20000", &["10.0.0.22:80"]).unwrap_err();
        assert_eq!(
            format!("{e:#}"),
            "VIP 10.0.0.1:20000/tcp is on SNAT address 10.0.0.1 with its port in the SNAT port \
             range 20000-32767: the balancer would drop every new connection to it as a reply to \
             a SNAT connection that has ended (move the VIP's port out of --snat-ports, or use \
             another --snat-ip)"
        );
        let e = add_vip("10.0.0.101:80", &["10.0.0.22:80", "10.0.0.1:80"]).unwrap_err();
        assert!(
            format!("{e:#}")
                .starts_with("backend 10.0.0.1:80 of VIP 10.0.0.101:80/tcp is at SNAT address"),
            "{e:#}"
        );
        let e = add_vip("10.0.0.101:80", &["127.0.0.1:80"]).unwrap_err();
        assert!(format!("{e:#}").contains("is a loopback address"), "{e:#}");
        assert!(add_vip("10.0.0.1:80", &["10.0.0.22:80"]).is_ok());
    }

    #[test]
    fn vip_add_refuses_a_family_the_running_balancer_has_no_snat_address_for() {
        // Started with IPv4 VIPs only and no --snat-ip6: no IPv6 pool in the
        // kernel, so the data path would drop every SYN to this VIP.
        let e = add_vip("[2001:db8::1]:80", &["[2001:db8::21]:80"]).unwrap_err();
        assert_eq!(
            format!("{e:#}"),
            "VIP [2001:db8::1]:80/tcp is IPv6, and this balancer has no IPv6 SNAT address: it \
             took none at its start (no --snat-ip6, and no IPv6 VIP in the configuration to \
             take the interface's address for), so every new connection to the VIP would be \
             dropped (restart with --snat-ip6, or with an IPv6 VIP in the configuration)"
        );
        // With an IPv6 pool it is taken in.
        let (base, mut snat) = running();
        snat.v6 = vec!["2001:db8::1:1".parse().unwrap()];
        let vip = "[2001:db8::1]:80";
        let request = vip_add(vip, &["[2001:db8::21]:80"]);
        let v6 = vip_to_add(&base, &snat, vip.parse().unwrap(), &request).unwrap();
        // And a SIGHUP's file with such a VIP is refused whole.
        let only_v4 = running().1;
        let mut file = base;
        file.vips.push(v6);
        let reload = only_v4.checked_reload(std::sync::Arc::new(move || Ok(file.clone())));
        let e = reload().unwrap_err().to_string();
        assert!(e.contains("has no IPv6 SNAT address"), "{e}");
    }

    #[test]
    fn backend_add_is_held_to_the_snat_rules_against_the_running_pools() {
        let (_, snat) = running();
        let vip: VipAddr = "10.0.0.100:80".parse().unwrap();
        let add = |b: &str| check_backend_to_add(&snat, &vip, b.parse().unwrap());
        let e = add("10.0.0.1:8080").unwrap_err();
        assert_eq!(
            format!("{e:#}"),
            "backend 10.0.0.1:8080 of VIP 10.0.0.100:80/tcp is at SNAT address 10.0.0.1: the \
             balancer would send it its connections from its own address (use another \
             --snat-ip, or another backend)"
        );
        let e = add("127.0.0.2:80").unwrap_err();
        assert!(format!("{e:#}").contains("is a loopback address"), "{e:#}");
        assert!(add("10.0.0.22:80").is_ok());
    }
}
