//! The world the fixture suite and the fuzzer run against: VIPs of every
//! kind (IPv4 and IPv6, TCP and UDP, every algorithm, with no, some and only
//! out-of-service backends), their backends, and a balanced connection
//! ([`Conn`]) with the frames each side sends and must receive.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use lb_common::{
    Algorithm, BACKEND_ACTIVE, BACKEND_DRAINING, BACKEND_EJECTED, IPPROTO_TCP, IPPROTO_UDP,
};

use super::{harness::*, packet::Pkt};

/// A VIP of the world: address, port, protocol.
#[derive(Clone, Copy, Debug)]
pub struct Vip {
    pub addr: IpAddr,
    pub port: u16,
    pub proto: u8,
}

pub const fn v4(port: u16, proto: u8) -> Vip {
    Vip {
        addr: IpAddr::V4(VIP),
        port,
        proto,
    }
}

pub const fn v6(port: u16, proto: u8) -> Vip {
    Vip {
        addr: IpAddr::V6(VIP6),
        port,
        proto,
    }
}

/// Backend ids of the world. IPv4 ids are below [`FIRST_V6_BACKEND`].
pub const FIRST_V6_BACKEND: u32 = 100;
pub const V4_DRAINING: u32 = 10;
pub const V4_EJECTED: u32 = 11;
pub const V6_EJECTED: u32 = 104;

/// The world's VIPs (id, VIP, algorithm, backend ids).
pub const TCP80: Vip = v4(80, IPPROTO_TCP);
pub const UDP53: Vip = v4(53, IPPROTO_UDP);
pub const P2C_MANY: Vip = v4(81, IPPROTO_TCP);
pub const RR_TCP: Vip = v4(82, IPPROTO_TCP);
pub const NO_BACKENDS: Vip = v4(83, IPPROTO_TCP);
pub const SOME_OUT: Vip = v4(84, IPPROTO_TCP);
pub const ALL_OUT: Vip = v4(85, IPPROTO_TCP);
pub const RR_UDP: Vip = v4(86, IPPROTO_UDP);
pub const UDP_SOME_OUT: Vip = v4(54, IPPROTO_UDP);
pub const UDP_NO_BACKENDS: Vip = v4(55, IPPROTO_UDP);
pub const TCP80_6: Vip = v6(80, IPPROTO_TCP);
pub const UDP53_6: Vip = v6(53, IPPROTO_UDP);
pub const P2C_MANY_6: Vip = v6(81, IPPROTO_TCP);
pub const RR_TCP_6: Vip = v6(82, IPPROTO_TCP);
pub const NO_BACKENDS_6: Vip = v6(83, IPPROTO_TCP);
pub const SOME_OUT_6: Vip = v6(84, IPPROTO_TCP);
/// Backends of the many-backend VIPs; the last one is by far the most
/// expensive, so P2C (the better of two distinct) never picks it.
pub const MANY: [u32; 4] = [1, 2, 3, 4];
pub const MANY_6: [u32; 4] = [100, 101, 102, 103];
pub const RR_BACKENDS: [u32; 3] = [5, 6, 7];
pub const RR_BACKENDS_6: [u32; 2] = [101, 102];
/// Algorithm values the control plane may write besides P2C and
/// round-robin; each VIP uses `MANY`, from port [`OTHER_ALGORITHM_PORT`] on.
pub const OTHER_ALGORITHMS: [Algorithm; 4] = [
    Algorithm::WeightedRoundRobin,
    Algorithm::Random,
    Algorithm::LeastConn,
    Algorithm::Maglev,
];
pub const OTHER_ALGORITHM_PORT: u16 = 90;

pub fn backend_ip(id: u32) -> IpAddr {
    if id >= FIRST_V6_BACKEND {
        backend_addr6(id).into()
    } else {
        backend_addr(id).into()
    }
}

pub fn snat_of(addr: IpAddr) -> IpAddr {
    match addr {
        IpAddr::V4(_) => SNAT.into(),
        IpAddr::V6(_) => SNAT6.into(),
    }
}

pub fn client_of(addr: IpAddr) -> IpAddr {
    match addr {
        IpAddr::V4(_) => CLIENT.into(),
        IpAddr::V6(_) => CLIENT6.into(),
    }
}

/// Writes the world into `lb`: config, backends (with neighbours) and VIPs.
pub fn world(lb: &mut Lb) {
    lb.config(true, SNAT_PORT_MIN, SNAT_PORT_MAX);
    for id in 0..10 {
        lb.backend(id, BACKEND_ACTIVE);
    }
    lb.backend(V4_DRAINING, BACKEND_DRAINING);
    lb.backend(V4_EJECTED, BACKEND_EJECTED);
    for id in MANY_6 {
        lb.backend_at(id, backend_ip(id), BACKEND_ACTIVE);
    }
    lb.backend_at(V6_EJECTED, backend_ip(V6_EJECTED), BACKEND_EJECTED);
    for (id, cost) in MANY.iter().zip([10, 20, 30, 1_000_000]) {
        lb.set_cost(*id, cost);
    }
    for (id, cost) in MANY_6.iter().zip([10, 20, 30, 1_000_000]) {
        lb.set_cost(*id, cost);
    }
    let vips: &[(u32, Vip, Algorithm, &[u32])] = &[
        (0, TCP80, Algorithm::P2cEwma, &[0]),
        (1, UDP53, Algorithm::P2cEwma, &[0]),
        (2, P2C_MANY, Algorithm::P2cEwma, &MANY),
        (3, RR_TCP, Algorithm::RoundRobin, &RR_BACKENDS),
        (4, NO_BACKENDS, Algorithm::P2cEwma, &[]),
        (
            5,
            SOME_OUT,
            Algorithm::P2cEwma,
            &[V4_DRAINING, V4_EJECTED, 8],
        ),
        (
            6,
            ALL_OUT,
            Algorithm::RoundRobin,
            &[V4_DRAINING, V4_EJECTED],
        ),
        (7, RR_UDP, Algorithm::RoundRobin, &RR_BACKENDS),
        (8, UDP_SOME_OUT, Algorithm::RoundRobin, &[V4_EJECTED, 9]),
        (9, UDP_NO_BACKENDS, Algorithm::RoundRobin, &[]),
        (20, TCP80_6, Algorithm::P2cEwma, &[100]),
        (21, UDP53_6, Algorithm::P2cEwma, &[100]),
        (22, P2C_MANY_6, Algorithm::P2cEwma, &MANY_6),
        (23, RR_TCP_6, Algorithm::RoundRobin, &RR_BACKENDS_6),
        (24, NO_BACKENDS_6, Algorithm::P2cEwma, &[]),
        (25, SOME_OUT_6, Algorithm::P2cEwma, &[V6_EJECTED, 103]),
    ];
    for (id, vip, algorithm, backends) in vips {
        lb.vip_at(vip.addr, *id, vip.port, vip.proto, *algorithm, 1, backends);
    }
    for (i, algorithm) in OTHER_ALGORITHMS.iter().enumerate() {
        let port = OTHER_ALGORITHM_PORT + i as u16;
        lb.vip_at(
            VIP.into(),
            30 + i as u32,
            port,
            IPPROTO_TCP,
            *algorithm,
            1,
            &MANY,
        );
    }
}

/// A balanced connection as the fixtures saw it created.
#[derive(Clone, Copy, Debug)]
pub struct Conn {
    pub vip: Vip,
    pub client_port: u16,
    pub backend: u32,
    pub snat_port: u16,
}

impl Conn {
    pub fn client(&self) -> (IpAddr, u16) {
        (client_of(self.vip.addr), self.client_port)
    }

    pub fn vip(&self) -> (IpAddr, u16) {
        (self.vip.addr, self.vip.port)
    }

    pub fn snat(&self) -> (IpAddr, u16) {
        (snat_of(self.vip.addr), self.snat_port)
    }

    pub fn backend(&self) -> (IpAddr, u16) {
        (backend_ip(self.backend), BACKEND_PORT)
    }

    /// A client → VIP packet of this connection.
    pub fn client_packet(&self, flags: u8) -> Pkt {
        if self.vip.proto == IPPROTO_UDP {
            Pkt::udp(self.client(), self.vip())
        } else {
            Pkt::tcp(self.client(), self.vip(), flags)
        }
    }

    /// A backend → SNAT packet of this connection.
    pub fn backend_packet(&self, flags: u8) -> Pkt {
        let p = if self.vip.proto == IPPROTO_UDP {
            Pkt::udp(self.backend(), self.snat())
        } else {
            Pkt::tcp(self.backend(), self.snat(), flags)
        };
        p.macs(LB_MAC, backend_mac(self.backend))
    }

    /// `pkt` (from the client) as the balancer must send it to the backend.
    pub fn sent_to_backend(&self, pkt: &Pkt) -> Pkt {
        pkt.rewritten(self.snat(), self.backend(), backend_mac(self.backend))
    }

    /// `pkt` (from the backend) as the balancer must send it to the client.
    pub fn sent_to_client(&self, pkt: &Pkt) -> Pkt {
        pkt.rewritten(self.vip(), self.client(), CLIENT_MAC)
    }
}

/// Hex dump, so a mismatch shows which byte differs.
pub fn hex(bytes: &[u8]) -> String {
    bytes
        .chunks(16)
        .map(|c| {
            c.iter()
                .map(|b| format!("{b:02x}"))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// An address nobody in the world uses, of the same family as `like`.
pub fn stranger(like: IpAddr) -> IpAddr {
    match like {
        IpAddr::V4(_) => Ipv4Addr::new(192, 0, 2, 9).into(),
        IpAddr::V6(_) => Ipv6Addr::new(0x2001, 0xdb8, 9, 0, 0, 0, 0, 9).into(),
    }
}
