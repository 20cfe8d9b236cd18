//! Scale-out: a second balancer on the lab's bridge and a router namespace
//! with an ECMP multipath route to the VIP over both balancers, in front of
//! a remote client on its own subnet.
//!
//! ```text
//!   remote client ns (10.215.0.2)
//!        | eth0
//!   router ns: eth1 10.215.0.1 | eth0 10.213.0.1 (on the bridge)
//!        route VIP/32: nexthop via 10.213.0.10, nexthop via 10.213.0.11 (L4 hash)
//!        |
//!   br0 ── balancer (10.213.0.10, lb-user A) ── balancer 2 (10.213.0.11, lb-user B)
//!        └─ backends ...                     (each SNATs to its own address)
//! ```
//!
//! Dropping [`ScaleOut`] detaches the second stub and removes the second
//! instance's pins; the namespaces, and the second instance's files in
//! /run/lb-user, go with the lab.

use std::{
    net::{Ipv4Addr, Ipv6Addr},
    path::PathBuf,
};

use anyhow::Result;

use super::{
    HOST_IFACE, Host, Lab, VIP_ADDR,
    names::{INSTANCE_PREFIX, PIN_ROOT},
    xdp_stub::{XdpStub, attach_pass_stub},
};

pub const SECOND_BALANCER_ADDR: Ipv4Addr = Ipv4Addr::new(10, 213, 0, 11);
const SECOND_BALANCER_ADDR6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x213, 0, 0, 0, 0, 0, 0x11);
pub const ROUTER_ADDR: Ipv4Addr = Ipv4Addr::new(10, 213, 0, 1);
const ROUTER_ADDR6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x213, 0, 0, 0, 0, 0, 0x1);
pub const REMOTE_NET: &str = "10.215.0.0/24";
pub const REMOTE_ROUTER_ADDR: Ipv4Addr = Ipv4Addr::new(10, 215, 0, 1);
pub const REMOTE_CLIENT_ADDR: Ipv4Addr = Ipv4Addr::new(10, 215, 0, 2);

/// The second balancer host, the router and the remote client.
pub struct ScaleOut {
    pub second: Host,
    pub router_ns: String,
    pub remote_client_ns: String,
    stub: Option<XdpStub>,
}

impl ScaleOut {
    /// lb-user's instance name on the second balancer.
    pub fn second_instance(&self) -> String {
        format!("{INSTANCE_PREFIX}{}", self.second.iface)
    }

    pub fn second_pin_dir(&self) -> PathBuf {
        PathBuf::from(PIN_ROOT).join(self.second_instance())
    }

    /// The nexthops of the router's VIP route: `addrs` (withdrawing one
    /// is what BGP does when its session to a dead balancer drops).
    pub fn route_vip_via(&self, lab: &Lab, addrs: &[Ipv4Addr]) -> Result<()> {
        let vip = format!("{VIP_ADDR}/32");
        let mut args = vec!["route".to_string(), "replace".into(), vip];
        if let [one] = addrs {
            args.extend(["via".into(), one.to_string()]);
        } else {
            for a in addrs {
                args.extend(["nexthop".into(), "via".into(), a.to_string()]);
            }
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        lab.ip(&self.router_ns, &args)
    }
}

impl Drop for ScaleOut {
    fn drop(&mut self) {
        self.stub = None;
        let pins = self.second_pin_dir();
        if pins.exists() {
            let _ = std::fs::remove_dir_all(&pins);
        }
    }
}

impl Lab {
    /// Adds the second balancer, the router with the ECMP route, and the
    /// remote client (see the module docs).
    pub fn add_scale_out(&mut self) -> Result<ScaleOut> {
        let id = self.id.clone();
        let second = Host {
            ns: format!("{id}-lb2"),
            iface: format!("{id}c"),
            switch_port: "p-lb2".into(),
            addr: SECOND_BALANCER_ADDR,
            addr6: SECOND_BALANCER_ADDR6,
        };
        super::names::check_ifname(&second.iface)?;
        // Its files in /run/lb-user go with the lab.
        self.instances
            .push(format!("{INSTANCE_PREFIX}{}", second.iface));
        self.connect_host(&second)?;
        self.ip(
            &second.ns,
            &[
                "addr",
                "add",
                &format!("{VIP_ADDR}/32"),
                "dev",
                &second.iface,
            ],
        )?;
        let router = Host {
            ns: format!("{id}-rt"),
            iface: HOST_IFACE.into(),
            switch_port: "p-rt".into(),
            addr: ROUTER_ADDR,
            addr6: ROUTER_ADDR6,
        };
        self.connect_host(&router)?;
        let remote = format!("{id}-rc");
        self.add_namespace(&remote)?;
        self.ip(
            &router.ns,
            &[
                "link", "add", "eth1", "type", "veth", "peer", "name", "eth0", "netns", &remote,
            ],
        )?;
        self.ip(
            &router.ns,
            &[
                "addr",
                "add",
                &format!("{REMOTE_ROUTER_ADDR}/24"),
                "dev",
                "eth1",
            ],
        )?;
        self.ip(&router.ns, &["link", "set", "eth1", "up"])?;
        self.ip(
            &remote,
            &[
                "addr",
                "add",
                &format!("{REMOTE_CLIENT_ADDR}/24"),
                "dev",
                "eth0",
            ],
        )?;
        self.ip(&remote, &["link", "set", "eth0", "up"])?;
        self.ip(
            &remote,
            &[
                "route",
                "add",
                "default",
                "via",
                &REMOTE_ROUTER_ADDR.to_string(),
            ],
        )?;
        // Partial checksums from the remote client's sockets would reach
        // native XDP corrupt (DESIGN.md); the router forwards what it gets.
        self.exec_ok(&remote, &["ethtool", "-K", "eth0", "tx", "off"])?;
        for sysctl in [
            "net.ipv4.ip_forward=1",
            // Hash on ports too, so one client's connections spread.
            "net.ipv4.fib_multipath_hash_policy=1",
            // Skip a nexthop whose neighbour entry failed.
            "net.ipv4.fib_multipath_use_neigh=1",
        ] {
            self.exec_ok(&router.ns, &["sysctl", "-qw", sysctl])?;
        }
        // Both balancers reach the remote client through the router.
        for ns in [self.balancer.ns.clone(), second.ns.clone()] {
            self.ip(
                &ns,
                &["route", "add", REMOTE_NET, "via", &ROUTER_ADDR.to_string()],
            )?;
        }
        let stub = attach_pass_stub(&self.switch_ns, &second.switch_port)?;
        let scale = ScaleOut {
            second,
            router_ns: router.ns,
            remote_client_ns: remote,
            stub: Some(stub),
        };
        scale.route_vip_via(self, &[super::BALANCER_ADDR, SECOND_BALANCER_ADDR])?;
        Ok(scale)
    }
}
