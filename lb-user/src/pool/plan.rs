//! The map contents a [`Config`] stands for, computed without the kernel.
//!
//! Ids are stable: a VIP or backend that a previous instance left in the
//! pinned maps (the [`Previous`] that startup reads) keeps its id, found by
//! address, whatever the order of the configuration; so after a restart
//! the pinned flow table's `backend_id`s, the kernel's per-backend counters
//! and in-flight counts still name the same servers. Anything new gets the
//! lowest id no one has, a previous backend's id included. On a fresh start
//! that numbers VIPs in config order and backends consecutively across VIPs
//! in the order written. A previous backend the configuration no longer has
//! stays as a draining member of its VIP (see [`Plan::draining`]) until its
//! flows are gone; one whose VIP is gone is cleared with the VIP.

use std::{collections::BTreeSet, net::SocketAddr};

use lb_common::{
    Algorithm, BACKEND_ACTIVE, BACKEND_DOWN, BACKEND_DRAINING, Backend, MAX_BACKENDS_PER_VIP,
    MAX_MAGLEV_TABLES, VIP_F_SOURCE_AFFINITY, VipKey, VipMeta,
};

use crate::{
    kernel::wire,
    settings::addr::Weight,
    settings::config::{Config, VipConfig},
};

#[derive(Clone, Debug, PartialEq)]
pub struct PlannedVip {
    pub key: VipKey,
    pub meta: VipMeta,
    /// Backend ids to write at `VIP_BACKENDS[vip_id * MAX_BACKENDS_PER_VIP ..]`.
    pub slots: Vec<u32>,
    /// Index of the VIP's Maglev table (maglev VIPs only).
    pub maglev_table: Option<u32>,
}

impl PlannedVip {
    /// Index of this VIP's first slot in VIP_BACKENDS.
    pub fn first_slot(&self) -> u32 {
        self.meta.vip_id * MAX_BACKENDS_PER_VIP
    }
}

/// A backend a previous instance served that the configuration no longer
/// has: it keeps its id, draining, in VIP `vip` (an index of the config).
#[derive(Clone, Debug, PartialEq)]
pub struct Leftover {
    pub vip: usize,
    pub id: u32,
    pub addr: SocketAddr,
    pub weight: u32,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub vips: Vec<PlannedVip>,
    /// Indexed by backend id; ids no one has are zero (`in_use == 0`).
    pub backends: Vec<Backend>,
    /// Configured weight per backend id.
    pub weights: Vec<Weight>,
    /// Previous backends that drain until their flows end.
    pub draining: Vec<Leftover>,
    /// Previous backend ids of VIPs that are gone (removed at runtime and
    /// still draining when the previous process stopped, or deleted from
    /// the file): their flows go on (an established flow is translated by
    /// its entry alone), so the ids stay reserved until those end.
    pub orphaned: Vec<u32>,
    /// Backends the previous process had down by their health checks, kept
    /// in their VIP with a health check still: they start down, and come
    /// back by passing their checks (`rise` of them), as they would have
    /// without the restart. Started up, each would take its share of new
    /// connections until its checks failed again (`fall` × the interval).
    pub down: BTreeSet<u32>,
}

/// What a previous instance left in the pinned maps (nothing on a fresh
/// start).
#[derive(Clone, Debug, Default)]
pub struct Previous {
    /// Every VIP: its key, id and Maglev table (if it had one).
    pub vips: Vec<(VipKey, u32, Option<u32>)>,
    /// Every backend in use, by id.
    pub backends: Vec<(u32, Backend)>,
}

/// Ids in use; hands out the lowest free one.
struct Ids(BTreeSet<u32>);

impl Ids {
    fn new(taken: impl IntoIterator<Item = u32>) -> Self {
        Self(taken.into_iter().collect())
    }

    fn take_lowest(&mut self) -> u32 {
        let id = (0..).find(|i| !self.0.contains(i)).unwrap_or(0);
        self.0.insert(id);
        id
    }

    /// The lowest free id below `below` that is not in `avoid`, or else
    /// the lowest free one.
    fn take_lowest_avoiding(&mut self, avoid: &BTreeSet<u32>, below: u32) -> u32 {
        match (0..below).find(|i| !self.0.contains(i) && !avoid.contains(i)) {
            Some(id) => {
                self.0.insert(id);
                id
            }
            None => self.take_lowest(),
        }
    }
}

/// The VIPS key of `v`.
pub fn vip_key(v: &VipConfig) -> VipKey {
    let (addr, family) = wire::ip_to_words(v.vip.addr.ip());
    VipKey {
        addr,
        port: wire::port_to_wire(v.vip.addr.port()),
        proto: v.vip.protocol.ip_proto(),
        family,
    }
}

/// The VIPS value of `v` under id `vip_id`.
pub fn vip_meta(v: &VipConfig, vip_id: u32, backend_count: u32) -> VipMeta {
    VipMeta {
        vip_id,
        backend_count,
        algorithm: v.algorithm as u8,
        inflight_bias: v.inflight_bias,
        p2c_full_scan: v.p2c_full_scan,
        flags: if v.maglev_source_affinity {
            VIP_F_SOURCE_AFFINITY
        } else {
            0
        },
        p2c_saturation: v.p2c_saturation,
    }
}

fn same_server(entry: &Backend, addr: SocketAddr) -> bool {
    let (words, family) = wire::ip_to_words(addr.ip());
    entry.in_use != 0
        && entry.addr == words
        && entry.family == family
        && entry.port == wire::port_to_wire(addr.port())
}

impl Plan {
    /// The plan of a fresh start.
    pub fn new(config: &Config) -> Self {
        Self::adopting(config, &Previous::default())
    }

    /// The plan that keeps the ids of `previous`.
    pub fn adopting(config: &Config, previous: &Previous) -> Self {
        let keys: Vec<VipKey> = config.vips.iter().map(vip_key).collect();
        let old: Vec<Option<&(VipKey, u32, Option<u32>)>> = keys
            .iter()
            .map(|k| previous.vips.iter().find(|(key, ..)| key == k))
            .collect();
        // The ids of VIPs gone since stay taken while their backends' flows
        // (written back under those ids) go on: a new VIP under one of them
        // would take those backends for its own.
        let kept: BTreeSet<u32> = old.iter().flatten().map(|(_, id, _)| *id).collect();
        let gone = previous
            .backends
            .iter()
            .map(|(_, entry)| entry.vip_id)
            .filter(|id| !kept.contains(id));
        let mut vip_ids = Ids::new(kept.iter().copied().chain(gone));
        let is_maglev = |i: usize| config.vips[i].algorithm == Algorithm::Maglev;
        let kept_table = |i: usize| old[i].and_then(|(_, _, t)| *t).filter(|_| is_maglev(i));
        let mut tables = Ids::new((0..keys.len()).filter_map(kept_table));
        // Every table a previous VIP reads now, under a key the
        // configuration dropped or no longer as Maglev: until that VIP has
        // left VIPS its SYNs still hash into it. A new Maglev VIP takes one
        // only when no table is free; the publisher then takes its reader
        // out of VIPS first (`Publisher::write_plan`).
        let read_now: BTreeSet<u32> = previous.vips.iter().filter_map(|(.., t)| *t).collect();
        let vip_id: Vec<u32> = old
            .iter()
            .map(|o| o.map_or_else(|| vip_ids.take_lowest(), |(_, id, _)| *id))
            .collect();
        let maglev_table: Vec<Option<u32>> = (0..keys.len())
            .map(|i| {
                is_maglev(i).then(|| {
                    kept_table(i).unwrap_or_else(|| {
                        tables.take_lowest_avoiding(&read_now, MAX_MAGLEV_TABLES)
                    })
                })
            })
            .collect();

        // Backends: every previous id stays reserved; a configured backend
        // found in its VIP keeps its id.
        let mut ids = Ids::new(previous.backends.iter().map(|(id, _)| *id));
        let mut matched = BTreeSet::new();
        // Kept ids the previous process had down by their health checks.
        let mut was_down = BTreeSet::new();
        let mut chosen: Vec<Vec<u32>> = Vec::with_capacity(keys.len());
        for (i, v) in config.vips.iter().enumerate() {
            let was_served = old[i].is_some();
            let slots = v
                .backends
                .iter()
                .map(|b| {
                    let found = previous.backends.iter().find(|(id, entry)| {
                        was_served
                            && entry.vip_id == vip_id[i]
                            && same_server(entry, b.addr)
                            && !matched.contains(id)
                    });
                    match found {
                        Some((id, entry)) => {
                            matched.insert(*id);
                            if entry.state == BACKEND_DOWN {
                                was_down.insert(*id);
                            }
                            *id
                        }
                        None => ids.take_lowest(),
                    }
                })
                .collect();
            chosen.push(slots);
        }
        let draining: Vec<Leftover> = previous
            .backends
            .iter()
            .filter(|(id, _)| !matched.contains(id))
            .filter_map(|(id, entry)| {
                let vip =
                    (0..keys.len()).find(|&i| old[i].is_some() && vip_id[i] == entry.vip_id)?;
                let port = wire::port_from_wire(entry.port);
                let addr = SocketAddr::new(wire::words_to_ip(entry.addr, entry.family)?, port);
                Some(Leftover {
                    vip,
                    id: *id,
                    addr,
                    weight: entry.weight,
                })
            })
            .collect();
        let orphaned: Vec<u32> = previous
            .backends
            .iter()
            .map(|(id, _)| *id)
            .filter(|id| !matched.contains(id) && !draining.iter().any(|d| d.id == *id))
            .collect();

        let len = chosen
            .iter()
            .flatten()
            .chain(draining.iter().map(|d| &d.id))
            .chain(&orphaned)
            .map(|&id| id as usize + 1)
            .max()
            .unwrap_or(0);
        let mut backends = vec![Backend::default(); len];
        let mut weights = vec![Weight::DEFAULT; len];
        let mut vips = Vec::with_capacity(keys.len());
        let mut down = BTreeSet::new();
        for (i, v) in config.vips.iter().enumerate() {
            for (&id, b) in chosen[i].iter().zip(&v.backends) {
                weights[id as usize] = b.weight;
                let state = if v.health.is_some() && was_down.contains(&id) {
                    down.insert(id);
                    BACKEND_DOWN
                } else {
                    BACKEND_ACTIVE
                };
                backends[id as usize] =
                    wire::backend_entry(b.addr, vip_id[i], b.weight.get(), state);
            }
            vips.push(PlannedVip {
                key: keys[i],
                meta: vip_meta(v, vip_id[i], chosen[i].len() as u32),
                slots: chosen[i].clone(),
                maglev_table: maglev_table[i],
            });
        }
        for d in &draining {
            backends[d.id as usize] =
                wire::backend_entry(d.addr, vip_id[d.vip], d.weight, BACKEND_DRAINING);
        }
        // Written back as they were, draining (in no slot): the next start
        // reads them from the pins as in use and reserves them again. As
        // zeroes, the first restart kept them only in memory, and the
        // second handed them to new backends under the old flows.
        for &id in &orphaned {
            if let Some((_, entry)) = previous.backends.iter().find(|(i, _)| *i == id) {
                backends[id as usize] = Backend {
                    state: BACKEND_DRAINING,
                    ..*entry
                };
            }
        }
        Self {
            vips,
            backends,
            weights,
            draining,
            orphaned,
            down,
        }
    }
}

impl Plan {
    /// Writes backend `addr` of VIP `vip` (a config index) draining: the
    /// kernel refuses it from the first packet on.
    pub fn set_draining(&mut self, vip: usize, addr: SocketAddr) {
        let Some(v) = self.vips.get(vip) else {
            return;
        };
        for &id in &v.slots {
            let entry = &mut self.backends[id as usize];
            if same_server(entry, addr) {
                entry.state = BACKEND_DRAINING;
            }
        }
    }
}

#[cfg(test)]
mod tests {

    use super::*;

    fn plan(argv: &[&str], file: &str) -> Plan {
        Plan::new(&Config::of(argv, file))
    }

    #[test]
    fn the_vips_saturation_threshold_reaches_its_meta() {
        let p = plan(
            &["--iface", "eth0", "--p2c-saturation", "9"],
            r#"
            [[vip]]
            address = "10.0.0.100:80"
            backends = ["10.0.0.21:8080"]
            [[vip]]
            address = "10.0.0.101:80"
            p2c_saturation = 0
            backends = ["10.0.0.22:8080"]
            "#,
        );
        let saturation: Vec<u16> = p.vips.iter().map(|v| v.meta.p2c_saturation).collect();
        assert_eq!(saturation, [9, 0]);
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

    /// The file's VIP comes first, the flags' after it.
    const UDP: usize = 0;
    const TCP: usize = 1;

    fn three_backends(order: [&str; 3]) -> Config {
        let mut argv = vec!["--iface", "eth0", "--vip", "10.0.0.100:80"];
        for b in &order {
            argv.extend(["--backend", b]);
        }
        let file = r#"
            [[vip]]
            address = "10.0.0.100:53/udp"
            algorithm = "maglev"
            backends = ["10.0.0.21:53"]
            "#;
        Config::of(&argv, file)
    }

    /// What `plan` leaves in the maps, as the next instance reads it.
    fn left_by(plan: &Plan) -> Previous {
        Previous {
            vips: plan
                .vips
                .iter()
                .map(|v| (v.key, v.meta.vip_id, v.maglev_table))
                .collect(),
            backends: plan
                .backends
                .iter()
                .enumerate()
                .filter(|(_, b)| b.in_use != 0)
                .map(|(id, b)| (id as u32, *b))
                .collect(),
        }
    }

    fn id_of(plan: &Plan, addr: &str) -> u32 {
        let addr: SocketAddr = addr.parse().unwrap();
        let found = plan.vips[TCP]
            .slots
            .iter()
            .copied()
            .find(|&id| same_server(&plan.backends[id as usize], addr));
        found.unwrap()
    }

    /// A backend down by its health checks when the previous process
    /// stopped starts down (in the kernel and in its lifecycle) and comes
    /// back by passing `rise` checks; without a health check now, nothing
    /// would bring it back, so it starts active.
    #[test]
    fn a_backend_down_before_a_restart_starts_down_while_it_has_a_health_check() {
        use crate::{
            kernel::clock::Nanos,
            pool::{fleet::Fleet, lifecycle::State},
        };
        let with_check = |check: bool| {
            let mut argv = vec!["--iface", "eth0", "--vip", "10.0.0.100:80"];
            argv.extend(["--backend", "10.0.0.21:80", "--backend", "10.0.0.22:80"]);
            if check {
                argv.extend(["--health-check", "tcp", "--health-rise", "2"]);
            }
            Config::of(&argv, "")
        };
        let config = with_check(true);
        let first = Plan::new(&config);
        let mut previous = left_by(&first);
        let down = first.vips[0].slots[1];
        for (id, entry) in &mut previous.backends {
            if *id == down {
                entry.state = BACKEND_DOWN;
            }
        }
        let second = Plan::adopting(&config, &previous);
        assert_eq!(second.down, BTreeSet::from([down]));
        assert_eq!(second.backends[down as usize].state, BACKEND_DOWN);
        let up = first.vips[0].slots[0];
        assert_eq!(second.backends[up as usize].state, BACKEND_ACTIVE);
        let now = Nanos(1_000_000_000);
        let mut fleet = Fleet::new(&config, &second, now);
        let params = fleet.vips[0].params;
        let life = &mut fleet.members[down as usize].as_mut().unwrap().life;
        assert_eq!(life.state(now), State::Down);
        assert!(!life.check_result(true, now, &params), "one pass of two");
        assert!(life.check_result(true, now, &params));
        assert_ne!(life.state(now), State::Down);
        let life = &fleet.members[up as usize].as_ref().unwrap().life;
        assert_ne!(life.state(now), State::Down);

        let unchecked = with_check(false);
        let third = Plan::adopting(&unchecked, &previous);
        assert!(third.down.is_empty());
        assert_eq!(third.backends[down as usize].state, BACKEND_ACTIVE);
    }

    #[test]
    fn a_readopted_plan_keeps_ids_by_address_whatever_the_order() {
        let first = Plan::new(&three_backends([
            "10.0.0.21:80",
            "10.0.0.22:80",
            "10.0.0.23:80",
        ]));
        assert_eq!(first.vips[UDP].slots, [0]);
        assert_eq!(first.vips[TCP].slots, [1, 2, 3]);
        // Reordered, one backend replaced by a new one.
        let second = Plan::adopting(
            &three_backends(["10.0.0.23:80", "10.0.0.24:80", "10.0.0.21:80"]),
            &left_by(&first),
        );
        assert_eq!(id_of(&second, "10.0.0.21:80"), 1);
        assert_eq!(id_of(&second, "10.0.0.23:80"), 3);
        // The new one gets an id nobody had; the old one drains under its own.
        assert_eq!(id_of(&second, "10.0.0.24:80"), 4);
        assert_eq!(
            second.draining,
            [Leftover {
                vip: TCP,
                id: 2,
                addr: "10.0.0.22:80".parse().unwrap(),
                weight: 1
            }]
        );
        assert_eq!(second.backends[2].state, BACKEND_DRAINING);
        assert_eq!(second.vips[UDP].slots, [0]);
        assert_eq!(second.vips[UDP].maglev_table, Some(0));
        assert_eq!(second.vips[TCP].meta.vip_id, 1);
        // The same again: nothing moves.
        let third = Plan::adopting(
            &three_backends(["10.0.0.23:80", "10.0.0.24:80", "10.0.0.21:80"]),
            &left_by(&second),
        );
        assert_eq!(third.vips, second.vips);
    }

    #[test]
    fn vip_ids_are_kept_by_address_and_new_vips_take_free_ones() {
        let first = Plan::new(&three_backends([
            "10.0.0.21:80",
            "10.0.0.22:80",
            "10.0.0.23:80",
        ]));
        let mut previous = left_by(&first);
        // Only the UDP VIP was served before, under id 5.
        previous
            .vips
            .retain(|(k, ..)| k.proto == lb_common::IPPROTO_UDP);
        previous.vips[0].1 = 5;
        previous.backends.retain(|(id, _)| *id == 3);
        previous.backends[0].1 =
            wire::backend_entry("10.0.0.21:53".parse().unwrap(), 5, 1, BACKEND_ACTIVE);
        let plan = Plan::adopting(
            &three_backends(["10.0.0.21:80", "10.0.0.22:80", "10.0.0.23:80"]),
            &previous,
        );
        assert_eq!(plan.vips[UDP].meta.vip_id, 5);
        assert_eq!(plan.vips[UDP].slots, [3]);
        assert_eq!(plan.vips[TCP].meta.vip_id, 0);
        assert_eq!(plan.vips[TCP].slots, [0, 1, 2]);
        assert!(plan.draining.is_empty());
    }

    /// Maglev VIPs on the given ports of 10.0.0.100, one backend each.
    fn maglev_vips(ports: &[u16]) -> Config {
        let file: String = ports
            .iter()
            .map(|p| {
                format!(
                    "[[vip]]\naddress = \"10.0.0.100:{p}\"\nalgorithm = \"maglev\"\n\
                     backends = [\"10.0.0.21:80\"]\n"
                )
            })
            .collect();
        Config::of(&["--iface", "eth0"], &file)
    }

    /// A restart whose file moved a Maglev VIP: the new VIP takes a table
    /// no previous VIP reads, not the dropped VIP's, which that VIP's SYNs
    /// hash into until it leaves VIPS. Only with every table read does it
    /// take the dropped VIP's (and the publisher takes that VIP out first).
    #[test]
    fn a_new_maglev_vip_takes_a_table_no_previous_vip_reads() {
        let seven: Vec<u16> = (81..88).collect();
        let first = Plan::new(&maglev_vips(&seven));
        let tables = |plan: &Plan| -> Vec<Option<u32>> {
            plan.vips.iter().map(|v| v.maglev_table).collect()
        };
        assert_eq!(tables(&first), (0..7).map(Some).collect::<Vec<_>>());
        let mut moved = seven.clone();
        moved[0] = 8081;
        let second = Plan::adopting(&maglev_vips(&moved), &left_by(&first));
        assert_eq!(
            second.vips[0].maglev_table,
            Some(7),
            "{:?}",
            tables(&second)
        );
        assert_eq!(tables(&second)[1..], tables(&first)[1..]);

        let eight: Vec<u16> = (81..89).collect();
        let full = Plan::new(&maglev_vips(&eight));
        let mut moved = eight.clone();
        moved[2] = 8081;
        let third = Plan::adopting(&maglev_vips(&moved), &left_by(&full));
        assert_eq!(third.vips[2].maglev_table, Some(2), "{:?}", tables(&third));
    }
}
