//! The map contents a [`Config`] stands for, computed without the kernel.
//!
//! Ids are assigned in config order: VIP `i` of the config is vip id `i`, and
//! backends are numbered consecutively across VIPs in the order written. The
//! same configuration therefore always gets the same ids, so after a restart
//! the pinned flow table's `backend_id`s still name the same servers.

use lb_common::{
    Algorithm, BACKEND_ACTIVE, Backend, MAX_BACKENDS_PER_VIP, VIP_F_SOURCE_AFFINITY, VipKey,
    VipMeta,
};

use crate::{kernel::wire, settings::addr::Weight, settings::config::Config};

#[derive(Clone, Debug, PartialEq)]
pub struct PlannedVip {
    pub key: VipKey,
    pub meta: VipMeta,
    /// Backend ids to write at `VIP_BACKENDS[vip_id * MAX_BACKENDS_PER_VIP ..]`.
    pub slots: Vec<u32>,
    /// Index of the VIP's Maglev table (maglev VIPs only, numbered in order).
    pub maglev_table: Option<u32>,
}

impl PlannedVip {
    /// Index of this VIP's first slot in VIP_BACKENDS.
    pub fn first_slot(&self) -> u32 {
        self.meta.vip_id * MAX_BACKENDS_PER_VIP
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub vips: Vec<PlannedVip>,
    /// Indexed by backend id.
    pub backends: Vec<Backend>,
    /// Configured weight per backend id.
    pub weights: Vec<Weight>,
}

impl Plan {
    pub fn new(config: &Config) -> Self {
        let mut vips = Vec::with_capacity(config.vips.len());
        let mut backends = Vec::new();
        let mut weights = Vec::new();
        let mut maglev_tables = 0..;
        for (vip_id, v) in config.vips.iter().enumerate() {
            let vip_id = vip_id as u32;
            let (addr, family) = wire::ip_to_words(v.vip.addr.ip());
            let mut slots = Vec::with_capacity(v.backends.len());
            for b in &v.backends {
                slots.push(backends.len() as u32);
                weights.push(b.weight);
                backends.push(wire::backend_entry(
                    b.addr,
                    vip_id,
                    b.weight.get(),
                    BACKEND_ACTIVE,
                ));
            }
            vips.push(PlannedVip {
                key: VipKey {
                    addr,
                    port: wire::port_to_wire(v.vip.addr.port()),
                    proto: v.vip.protocol.ip_proto(),
                    family,
                },
                meta: VipMeta {
                    vip_id,
                    backend_count: slots.len() as u32,
                    algorithm: v.algorithm as u8,
                    inflight_bias: v.inflight_bias,
                    flags: if v.maglev_source_affinity {
                        VIP_F_SOURCE_AFFINITY
                    } else {
                        0
                    },
                    _pad: 0,
                },
                slots,
                maglev_table: (v.algorithm == Algorithm::Maglev)
                    .then(|| maglev_tables.next())
                    .flatten(),
            });
        }
        Self {
            vips,
            backends,
            weights,
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::{settings::cli::Cli, settings::config::FileConfig};

    fn plan(argv: &[&str], file: &str) -> Plan {
        let mut full = vec!["lb-user"];
        full.extend_from_slice(argv);
        let args = Cli::try_parse_from(full).unwrap().run;
        let file = FileConfig::parse(file, std::path::Path::new("t.toml")).unwrap();
        Plan::new(&Config::merge(args, file).unwrap())
    }

    #[test]
    fn ids_follow_config_order_across_vips() {
        let p = plan(
            &[
                "--iface",
                "eth0",
                "--vip",
                "10.0.0.101:53/udp",
                "--backend",
                "10.0.0.23:53@3",
            ],
            r#"
            algorithm = "round-robin"
            [[vip]]
            address = "10.0.0.100:80"
            backends = ["10.0.0.21:8080", "10.0.0.22:8080@2"]
            "#,
        );
        assert_eq!(p.vips.len(), 2);
        assert_eq!(p.vips[0].slots, [0, 1]);
        assert_eq!(p.vips[1].slots, [2]);
        assert_eq!(p.vips[1].meta.vip_id, 1);
        assert_eq!(p.vips[1].first_slot(), MAX_BACKENDS_PER_VIP);
        assert_eq!(p.vips[1].key.proto, lb_common::IPPROTO_UDP);
        assert_eq!(
            p.vips[0].meta.algorithm,
            lb_common::Algorithm::RoundRobin as u8
        );
        assert_eq!(p.vips[0].meta.backend_count, 2);
        assert_eq!(p.backends[1].weight, 2);
        assert_eq!(p.backends[2].vip_id, 1);
        assert_eq!(p.backends[2].in_use, 1);
        assert_eq!(
            wire::socket_addr(p.backends[2].addr, p.backends[2].family, p.backends[2].port),
            Some("10.0.0.23:53".parse().unwrap())
        );
        assert_eq!(
            p.weights.iter().map(|w| w.get()).collect::<Vec<_>>(),
            [1, 2, 3]
        );
    }

    #[test]
    fn the_same_config_always_gets_the_same_plan() {
        let argv = [
            "--iface",
            "eth0",
            "--vip",
            "10.0.0.100:80",
            "--backend",
            "10.0.0.21:80",
            "--backend",
            "10.0.0.22:80",
        ];
        assert_eq!(plan(&argv, ""), plan(&argv, ""));
    }
}
