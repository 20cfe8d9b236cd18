//! The XDP program loaded into the kernel with fresh maps, driven with
//! `BPF_PROG_TEST_RUN`: map setters for the state a case needs, one-frame
//! runs, and readers for the counters, events and flow table it leaves.
use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap, MapData, PerCpuArray, PerCpuValues, RingBuf},
    programs::{ProgramError, TestRun, TestRunOptions, Xdp},
    util::nr_cpus,
};
use lb_common::{
    AF_INET, AF_INET6, Algorithm, BACKEND_ACTIVE, Backend, BackendConns, BackendHop,
    BackendPending, BackendProgress, BackendScore, CONFIG_F_READY, CONFIG_F_TIME_WAIT_REUSE,
    DEFAULT_CLOSED_LINGER_NS, DEFAULT_SNAT_QUARANTINE_NS, FlowEntry, FlowEvent, FlowKey, FlowKeyV4,
    IPPROTO_TCP, IPPROTO_UDP, IpKey, LatencyAgg, LbConfig, MAX_BACKENDS_PER_VIP, MAX_SNAT_ADDRS,
    Neighbour, SnatAddr, SweepStats, VipKey, VipMeta, reason,
};

use super::packet::{Pkt, TCP_SYN};

pub const XDP_ABORTED: u32 = 0;
pub const XDP_DROP: u32 = 1;
pub const XDP_PASS: u32 = 2;
pub const XDP_TX: u32 = 3;
pub const XDP_REDIRECT: u32 = 4;

/// Small, so the flow table stays cheap to create for every case.
pub const FLOW_TABLE_SIZE: u32 = 1024;

// The standard topology every case starts from.
pub use super::packet::{CLIENT_MAC, LB_MAC};
pub const VIP: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 100);
pub const SNAT: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 5);
pub const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 7);
pub const VIP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x100);
pub const SNAT6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x5);
pub const CLIENT6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 2, 0, 0, 0, 0x7);
pub const CLIENT_PORT: u16 = 40_000;
pub const HTTP: u16 = 80;
pub const DNS: u16 = 53;
pub const BACKEND_PORT: u16 = 8080;
pub const SNAT_PORT_MIN: u16 = 20_000;
pub const SNAT_PORT_MAX: u16 = 29_999;
/// The sweep's timeouts the harness configures (the CLI's defaults).
pub const TCP_IDLE_NS: u64 = 300_000_000_000;
pub const UDP_IDLE_NS: u64 = 30_000_000_000;
pub const SYN_TIMEOUT_NS: u64 = 3_000_000_000;

/// The kernel sweep's timeouts, as `LbConfig` carries them.
#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    pub tcp_idle_ns: u64,
    pub udp_idle_ns: u64,
    pub syn_timeout_ns: u64,
    pub closed_linger_ns: u64,
    pub snat_quarantine_ns: u64,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            tcp_idle_ns: TCP_IDLE_NS,
            udp_idle_ns: UDP_IDLE_NS,
            syn_timeout_ns: SYN_TIMEOUT_NS,
            closed_linger_ns: DEFAULT_CLOSED_LINGER_NS,
            snat_quarantine_ns: DEFAULT_SNAT_QUARANTINE_NS,
        }
    }
}

impl Timeouts {
    /// Every timeout 0: the next sweep ends every flow and frees every tuple.
    pub const ZERO: Self = Self {
        tcp_idle_ns: 0,
        udp_idle_ns: 0,
        syn_timeout_ns: 0,
        closed_linger_ns: 0,
        snat_quarantine_ns: 0,
    };
}

/// IPv4 address of backend `id`: 10.1.0.1 upwards.
pub fn backend_addr(id: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 1, 0, 1)) + id)
}

/// IPv6 address of backend `id`: 2001:db8:1::1 upwards.
pub fn backend_addr6(id: u32) -> Ipv6Addr {
    Ipv6Addr::from(u128::from(Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 1)) + u128::from(id))
}

pub fn backend_mac(id: u32) -> [u8; 6] {
    let [_, _, hi, lo] = id.to_be_bytes();
    [0x02, 0, 0, 1, hi, lo]
}

/// An address as the kernel's maps hold it: 16 bytes in packet order
/// (IPv4 in the first four, the rest zero) read as four `u32`s in memory
/// order, and its family tag.
pub fn words(addr: IpAddr) -> ([u32; 4], u8) {
    let mut bytes = [0u8; 16];
    let family = match addr {
        IpAddr::V4(a) => {
            bytes[..4].copy_from_slice(&a.octets());
            AF_INET
        }
        IpAddr::V6(a) => {
            bytes = a.octets();
            AF_INET6
        }
    };
    // SAFETY: [u8; 16] and [u32; 4] have the same size, and any bits are valid.
    (
        unsafe { std::mem::transmute::<[u8; 16], [u32; 4]>(bytes) },
        family,
    )
}

/// The address stored in map words of `family` (the inverse of [`words`]).
pub fn addr_of(words: [u32; 4], family: u8) -> IpAddr {
    // SAFETY: [u32; 4] and [u8; 16] have the same size, and any bytes are valid.
    let bytes = unsafe { std::mem::transmute::<[u32; 4], [u8; 16]>(words) };
    if family == AF_INET6 {
        IpAddr::from(bytes)
    } else {
        IpAddr::from([bytes[0], bytes[1], bytes[2], bytes[3]])
    }
}

/// The flow-table key of a packet `src -> dst` of `proto`.
pub fn key<A: Into<IpAddr>>(proto: u8, src: (A, u16), dst: (A, u16)) -> FlowKey {
    let (s, family) = words(src.0.into());
    let (d, _) = words(dst.0.into());
    FlowKey::new(family, proto, s, d, src.1.to_be(), dst.1.to_be())
}

/// The `NEIGHBOURS` key of an address.
fn ip_key(addr: IpAddr) -> IpKey {
    let (addr, family) = words(addr);
    IpKey {
        addr,
        family,
        _pad: [0; 3],
    }
}

pub fn kinds(events: &[FlowEvent]) -> Vec<u8> {
    events.iter().map(|e| e.kind).collect()
}

/// One loaded copy of the program with its own maps.
pub struct Lb {
    ebpf: Ebpf,
    events: RingBuf<MapData>,
}

impl Lb {
    /// Loads the embedded release object (fresh maps) through the verifier.
    pub fn new() -> Self {
        Self::load(crate::production::EBPF_OBJECT, FLOW_TABLE_SIZE)
    }

    /// Loads `object` with a flow table of `flow_table_size` entries.
    pub fn load(object: &[u8], flow_table_size: u32) -> Self {
        Self::load_sized(object, flow_table_size, &[])
    }

    /// [`Lb::load`], with other maps resized too (`(name, max entries)`).
    pub fn load_sized(object: &[u8], flow_table_size: u32, sizes: &[(&str, u32)]) -> Self {
        let mut loader = EbpfLoader::new();
        loader.map_max_entries(lb_common::FLOWS_MAP, flow_table_size);
        loader.map_max_entries(lb_common::FLOWS4_MAP, flow_table_size);
        for &(name, entries) in sizes {
            loader.map_max_entries(name, entries);
        }
        let mut ebpf = loader
            .load(object)
            .expect("parse and create maps of the eBPF object");
        let prog: &mut Xdp = ebpf
            .program_mut(lb_common::XDP_PROGRAM)
            .expect("lb_xdp in object")
            .try_into()
            .expect("lb_xdp is XDP");
        match prog.load() {
            Ok(()) => {}
            Err(ProgramError::LoadError {
                io_error,
                verifier_log,
            }) => panic!("the verifier rejected lb_xdp: {io_error}\n{verifier_log}"),
            Err(e) => panic!("loading lb_xdp: {e}"),
        }
        let sweep: &mut Xdp = ebpf
            .program_mut(lb_common::SWEEP_PROGRAM)
            .expect("lb_sweep in object")
            .try_into()
            .expect("lb_sweep is XDP");
        match sweep.load() {
            Ok(()) => {}
            Err(ProgramError::LoadError {
                io_error,
                verifier_log,
            }) => panic!("the verifier rejected lb_sweep: {io_error}\n{verifier_log}"),
            Err(e) => panic!("loading lb_sweep: {e}"),
        }
        let events = RingBuf::try_from(ebpf.take_map(lb_common::EVENTS_MAP).expect("EVENTS"))
            .expect("EVENTS is a ring buffer");
        Self { ebpf, events }
    }

    /// One TCP VIP (p2c, id 0) and one UDP VIP (id 1), both on backend 0;
    /// config ready. Clients have no neighbour entry: replies use the
    /// return path learned from the client's frame.
    pub fn standard() -> Self {
        Self::standard_sized(&[])
    }

    /// [`Lb::standard`], with other maps resized (see [`Lb::load_sized`]).
    pub fn standard_sized(sizes: &[(&str, u32)]) -> Self {
        let mut lb = Self::load_sized(crate::production::EBPF_OBJECT, FLOW_TABLE_SIZE, sizes);
        lb.config(true, SNAT_PORT_MIN, SNAT_PORT_MAX);
        lb.backend(0, BACKEND_ACTIVE);
        lb.vip(0, HTTP, IPPROTO_TCP, Algorithm::P2cEwma, 0, &[0]);
        lb.vip(1, DNS, IPPROTO_UDP, Algorithm::P2cEwma, 0, &[0]);
        lb
    }

    /// The number of instructions the verifier processed, the program's
    /// size in bytes after verification, and its JIT-compiled size.
    pub fn verifier_counts(&self) -> (Option<u32>, u32, u32) {
        let info = self.program().info().expect("program info");
        (
            info.verified_instruction_count(),
            info.size_translated().unwrap_or(0),
            info.size_jitted(),
        )
    }

    pub fn verified_instructions(&self) -> Option<u32> {
        self.verifier_counts().0
    }

    fn program(&self) -> &Xdp {
        self.named_program(lb_common::XDP_PROGRAM)
    }

    fn named_program(&self, name: &str) -> &Xdp {
        self.ebpf
            .program(name)
            .unwrap_or_else(|| panic!("{name} in object"))
            .try_into()
            .expect("XDP")
    }

    /// Loads another XDP program of the object (a benchmark baseline).
    pub fn load_program(&mut self, name: &str) {
        let prog: &mut Xdp = self
            .ebpf
            .program_mut(name)
            .unwrap_or_else(|| panic!("{name} in object"))
            .try_into()
            .expect("XDP");
        prog.load()
            .unwrap_or_else(|e| panic!("loading {name}: {e}"));
    }

    /// Ready (or not) with the one-address pools `SNAT`/`SNAT6`, the port
    /// range and the default timeouts, on one CPU slice.
    pub fn config(&mut self, ready: bool, port_min: u16, port_max: u16) {
        self.snat_pools(&[SNAT.into()], &[SNAT6.into()]);
        let mut cfg = self.current_config();
        cfg.snat_port_min = port_min;
        cfg.snat_port_max = port_max;
        cfg.flags = if ready { CONFIG_F_READY } else { 0 };
        cfg.ifindex = 1;
        cfg.cpus = 1;
        self.write_config(cfg);
        self.timeouts(Timeouts::default());
    }

    fn current_config(&self) -> LbConfig {
        Array::<_, LbConfig>::try_from(self.ebpf.map(lb_common::CONFIG_MAP).expect("CONFIG"))
            .expect("array")
            .get(&0, 0)
            .expect("CONFIG")
    }

    fn write_config(&mut self, cfg: LbConfig) {
        self.array::<LbConfig>(lb_common::CONFIG_MAP)
            .set(0, cfg, 0)
            .expect("set CONFIG");
    }

    /// The sweep's timeouts.
    pub fn timeouts(&mut self, t: Timeouts) {
        let mut cfg = self.current_config();
        cfg.tcp_idle_ns = t.tcp_idle_ns;
        cfg.udp_idle_ns = t.udp_idle_ns;
        cfg.syn_timeout_ns = t.syn_timeout_ns;
        cfg.closed_linger_ns = t.closed_linger_ns;
        cfg.snat_quarantine_ns = t.snat_quarantine_ns;
        self.write_config(cfg);
    }

    /// Whether a SYN may take over a SNAT tuple in quarantine that the
    /// backend's TIME_WAIT accepts (`CONFIG_F_TIME_WAIT_REUSE`; off after
    /// [`Lb::config`]).
    pub fn time_wait_reuse(&mut self, on: bool) {
        let mut cfg = self.current_config();
        if on {
            cfg.flags |= CONFIG_F_TIME_WAIT_REUSE;
        } else {
            cfg.flags &= !CONFIG_F_TIME_WAIT_REUSE;
        }
        self.write_config(cfg);
    }

    /// Number of CPU slices of the SNAT tuple space.
    pub fn cpus(&mut self, cpus: u32) {
        let mut cfg = self.current_config();
        cfg.cpus = cpus;
        self.write_config(cfg);
    }

    /// The SNAT pools (at most `MAX_SNAT_ADDRS` each).
    pub fn snat_pools(&mut self, v4: &[IpAddr], v6: &[IpAddr]) {
        let mut cfg = self.current_config();
        for (base, pool) in [(0, v4), (MAX_SNAT_ADDRS, v6)] {
            for (i, addr) in pool.iter().enumerate() {
                let slot = base + i as u32;
                self.array::<SnatAddr>(lb_common::SNAT_ADDRS_MAP)
                    .set(
                        slot,
                        SnatAddr {
                            addr: words(*addr).0,
                        },
                        0,
                    )
                    .expect("set SNAT_ADDRS");
                let mut index: HashMap<_, IpKey, u32> = HashMap::try_from(
                    self.ebpf
                        .map_mut(lb_common::SNAT_ADDR_INDEX_MAP)
                        .expect("SNAT_ADDR_INDEX"),
                )
                .expect("hash");
                index
                    .insert(ip_key(*addr), slot, 0)
                    .expect("set SNAT_ADDR_INDEX");
            }
        }
        cfg.snat_v4 = v4.first().map_or([0; 4], |a| words(*a).0);
        cfg.snat_v6 = v6.first().map_or([0; 4], |a| words(*a).0);
        cfg.snat_v4_count = v4.len() as u16;
        cfg.snat_v6_count = v6.len() as u16;
        self.write_config(cfg);
    }

    /// Runs one kernel sweep (`lb_sweep`) and returns its counters.
    /// One full pass of the kernel sweep.
    pub fn sweep(&self) -> SweepStats {
        let (action, _, _) = self.run_program(lb_common::SWEEP_PROGRAM, &[0u8; 64], 1);
        assert_eq!(action, XDP_PASS, "lb_sweep ran");
        self.sweep_stats()
    }

    /// One light pass of the kernel sweep (no pair checks).
    pub fn sweep_light(&self) -> SweepStats {
        let mut frame = [0u8; 64];
        frame[0] = lb_common::SWEEP_LIGHT;
        let (action, _, _) = self.run_program(lb_common::SWEEP_PROGRAM, &frame, 1);
        assert_eq!(action, XDP_PASS, "lb_sweep ran");
        self.sweep_stats()
    }

    pub fn sweep_stats(&self) -> SweepStats {
        Array::<_, SweepStats>::try_from(
            self.ebpf
                .map(lb_common::SWEEP_STATS_MAP)
                .expect("SWEEP_STATS"),
        )
        .expect("array")
        .get(&0, 0)
        .expect("SWEEP_STATS")
    }

    /// Backend `id`'s progress stamps (last answer, last request).
    pub fn progress(&self, id: u32) -> BackendProgress {
        Array::<_, BackendProgress>::try_from(
            self.ebpf
                .map(lb_common::BACKEND_PROGRESS_MAP)
                .expect("BACKEND_PROGRESS"),
        )
        .expect("array")
        .get(&id, 0)
        .expect("BACKEND_PROGRESS")
    }

    /// Backend `id`'s pending requests (count and summed start times).
    pub fn pending(&self, id: u32) -> BackendPending {
        Array::<_, BackendPending>::try_from(
            self.ebpf
                .map(lb_common::BACKEND_PENDING_MAP)
                .expect("BACKEND_PENDING"),
        )
        .expect("array")
        .get(&id, 0)
        .expect("BACKEND_PENDING")
    }

    /// Writes backend `id`'s pending requests.
    pub fn set_pending(&mut self, id: u32, pending: BackendPending) {
        Array::<_, BackendPending>::try_from(
            self.ebpf
                .map_mut(lb_common::BACKEND_PENDING_MAP)
                .expect("BACKEND_PENDING"),
        )
        .expect("array")
        .set(id, pending, 0)
        .expect("BACKEND_PENDING");
    }

    /// Writes backend `id`'s progress stamps.
    pub fn set_progress(&mut self, id: u32, progress: BackendProgress) {
        Array::<_, BackendProgress>::try_from(
            self.ebpf
                .map_mut(lb_common::BACKEND_PROGRESS_MAP)
                .expect("BACKEND_PROGRESS"),
        )
        .expect("array")
        .set(id, progress, 0)
        .expect("BACKEND_PROGRESS");
    }

    /// Connections backend `id` accepted (SYN-ACKs counted), summed over
    /// CPUs.
    pub fn handshakes(&self, id: u32) -> u64 {
        self.per_cpu_values::<u64>(lb_common::BACKEND_HANDSHAKES_MAP, id)
            .iter()
            .sum()
    }

    /// Backend `id`'s latency aggregate, summed over CPUs (the peak: the
    /// largest of the current epoch).
    pub fn latency(&self, id: u32) -> LatencyAgg {
        let epoch = self.latency_epoch();
        self.per_cpu_values::<LatencyAgg>(lb_common::BACKEND_LATENCY_MAP, id)
            .iter()
            .fold(LatencyAgg::default(), |a, c| LatencyAgg {
                sum_ns: a.sum_ns + c.sum_ns,
                count: a.count + c.count,
                peak_ns: if c.peak_epoch == epoch {
                    a.peak_ns.max(c.peak_ns)
                } else {
                    a.peak_ns
                },
                peak_epoch: epoch,
            })
    }

    pub fn latency_epoch(&self) -> u64 {
        Array::<_, u64>::try_from(
            self.ebpf
                .map(lb_common::LATENCY_EPOCH_MAP)
                .expect("LATENCY_EPOCH"),
        )
        .expect("array")
        .get(&0, 0)
        .expect("LATENCY_EPOCH")
    }

    /// Starts a new latency epoch, as the control plane does at each tick.
    pub fn next_latency_epoch(&mut self) {
        let next = self.latency_epoch() + 1;
        self.array::<u64>(lb_common::LATENCY_EPOCH_MAP)
            .set(0, next, 0)
            .expect("set LATENCY_EPOCH");
    }

    /// SNAT tuples backend `id` holds.
    pub fn snat_used(&self, id: u32) -> u64 {
        Array::<_, u64>::try_from(
            self.ebpf
                .map(lb_common::BACKEND_SNAT_USED_MAP)
                .expect("BACKEND_SNAT_USED"),
        )
        .expect("array")
        .get(&id, 0)
        .expect("BACKEND_SNAT_USED")
    }

    /// Where the test CPU's SNAT cursor over backend `id`'s tuples stands:
    /// it steps past each tuple a new flow's reply entry claimed.
    pub fn snat_cursor(&self, id: u32) -> u64 {
        self.per_cpu_value(lb_common::SNAT_CURSORS_MAP, id)
    }

    /// IPv4 backend `id` at `backend_addr(id)`:8080, with a neighbour entry on the ingress interface.
    pub fn backend(&mut self, id: u32, state: u8) {
        self.backend_at(id, backend_addr(id).into(), state);
    }

    /// Backend `id` at `addr`:8080 with a neighbour entry (MAC `backend_mac(id)`).
    pub fn backend_at(&mut self, id: u32, addr: IpAddr, state: u8) {
        let (addr_words, family) = words(addr);
        let b = Backend {
            addr: addr_words,
            port: BACKEND_PORT.to_be(),
            family,
            state,
            weight: 1,
            in_use: 1,
            ..Backend::default()
        };
        self.array::<Backend>(lb_common::BACKENDS_MAP)
            .set(id, b, 0)
            .expect("set BACKENDS");
        self.neighbour(addr, backend_mac(id), 0);
    }

    fn neighbours(&mut self) -> HashMap<&mut MapData, IpKey, Neighbour> {
        HashMap::try_from(
            self.ebpf
                .map_mut(lb_common::NEIGHBOURS_MAP)
                .expect("NEIGHBOURS"),
        )
        .expect("hash")
    }

    /// Sets the neighbour entry of `addr`. Replacing one also forgets the
    /// backends' shared next hops, as if `BACKEND_HOP_JIFFIES` had passed
    /// (new flows take a changed neighbour within that time; see
    /// [`Lb::set_neighbour_keeping_hops`]).
    pub fn neighbour<A: Into<IpAddr>>(&mut self, addr: A, mac: [u8; 6], ifindex: u32) {
        let addr = addr.into();
        let replaced = self.neighbours().get(&ip_key(addr), 0).is_ok();
        self.set_neighbour_keeping_hops(addr, mac, ifindex);
        if replaced {
            self.forget_backend_hops();
        }
    }

    /// Sets a neighbour entry and leaves the shared next hops as they are.
    pub fn set_neighbour_keeping_hops<A: Into<IpAddr>>(
        &mut self,
        addr: A,
        mac: [u8; 6],
        ifindex: u32,
    ) {
        let key = ip_key(addr.into());
        let n = Neighbour {
            mac,
            _pad: [0; 2],
            ifindex,
        };
        self.neighbours()
            .insert(key, n, 0)
            .expect("insert neighbour");
    }

    /// Removes the neighbour entry of `addr` and forgets the shared next
    /// hops (see [`Lb::neighbour`]).
    pub fn remove_neighbour<A: Into<IpAddr>>(&mut self, addr: A) {
        let key = ip_key(addr.into());
        self.neighbours().remove(&key).expect("remove neighbour");
        self.forget_backend_hops();
    }

    fn backend_hops(&mut self) -> PerCpuArray<&mut MapData, BackendHop> {
        PerCpuArray::try_from(
            self.ebpf
                .map_mut(lb_common::BACKEND_HOPS_MAP)
                .expect("BACKEND_HOPS"),
        )
        .expect("per-CPU array")
    }

    /// Backend `id`'s shared next hop on the CPU packet tests run on.
    pub fn backend_hop(&self, id: u32) -> BackendHop {
        self.per_cpu_value(lb_common::BACKEND_HOPS_MAP, id)
    }

    /// Sets backend `id`'s shared next hop on the test CPU (the other CPUs'
    /// are cleared).
    pub fn set_backend_hop(&mut self, id: u32, hop: BackendHop) {
        let mut values = vec![BackendHop::default(); nr_cpus().expect("CPU count")];
        values[super::isolate::TEST_CPU] = hop;
        let values = PerCpuValues::try_from(values).expect("per-CPU values");
        self.backend_hops()
            .set(id, values, 0)
            .expect("set BACKEND_HOPS");
    }

    /// Clears every backend's shared next hop on every CPU.
    pub fn forget_backend_hops(&mut self) {
        let cpus = nr_cpus().expect("CPU count");
        let mut hops = self.backend_hops();
        for id in 0..lb_common::MAX_BACKENDS {
            let values =
                PerCpuValues::try_from(vec![BackendHop::default(); cpus]).expect("per-CPU values");
            hops.set(id, values, 0).expect("clear BACKEND_HOPS");
        }
    }

    /// VIP `VIP:port/proto` with id `vip_id` over the backend ids `backends`.
    pub fn vip(
        &mut self,
        vip_id: u32,
        port: u16,
        proto: u8,
        algorithm: Algorithm,
        bias: u8,
        backends: &[u32],
    ) {
        self.vip_at(VIP.into(), vip_id, port, proto, algorithm, bias, backends);
    }

    /// Rewrites the meta of the TCP VIP `VIP:port` with `edit`.
    pub fn edit_vip(&mut self, port: u16, edit: impl FnOnce(&mut VipMeta)) {
        let (addr, family) = words(VIP.into());
        let key = VipKey {
            addr,
            port: port.to_be(),
            proto: lb_common::IPPROTO_TCP,
            family,
        };
        let mut vips: HashMap<_, VipKey, VipMeta> =
            HashMap::try_from(self.ebpf.map_mut(lb_common::VIPS_MAP).expect("VIPS")).expect("hash");
        let mut meta = vips.get(&key, 0).expect("VIP");
        edit(&mut meta);
        vips.insert(key, meta, 0).expect("VIP");
    }

    /// VIP `addr:port/proto` with id `vip_id` over the backend ids `backends`.
    #[allow(
        clippy::too_many_arguments,
        reason = "mirrors the map fields one to one"
    )]
    pub fn vip_at(
        &mut self,
        addr: IpAddr,
        vip_id: u32,
        port: u16,
        proto: u8,
        algorithm: Algorithm,
        bias: u8,
        backends: &[u32],
    ) {
        let mut slots = self.array::<u32>(lb_common::VIP_BACKENDS_MAP);
        for (slot, id) in backends.iter().enumerate() {
            slots
                .set(vip_id * MAX_BACKENDS_PER_VIP + slot as u32, id, 0)
                .expect("set slot");
        }
        let mut map: HashMap<_, VipKey, VipMeta> =
            HashMap::try_from(self.ebpf.map_mut(lb_common::VIPS_MAP).expect("VIPS")).expect("hash");
        let (addr, family) = words(addr);
        let key = VipKey {
            addr,
            port: port.to_be(),
            proto,
            family,
        };
        let meta = VipMeta {
            vip_id,
            backend_count: backends.len() as u32,
            algorithm: algorithm as u8,
            inflight_bias: bias,
            p2c_saturation: lb_common::DEFAULT_P2C_SATURATION,
            ..VipMeta::default()
        };
        map.insert(key, meta, 0).expect("insert VIP");
    }

    pub fn set_cost(&mut self, id: u32, cost: u64) {
        self.set_score(
            id,
            BackendScore {
                ewma_ns: cost,
                cost,
                weight: 1,
                ..BackendScore::default()
            },
        );
    }

    pub fn set_score(&mut self, id: u32, score: BackendScore) {
        self.array::<BackendScore>(lb_common::BACKEND_SCORES_MAP)
            .set(id, score, 0)
            .expect("set score");
    }

    /// Backend `id`'s score as the map holds it.
    pub fn score(&self, id: u32) -> BackendScore {
        self.array_value(lb_common::BACKEND_SCORES_MAP, id)
    }

    /// The test CPU's copy of entry `index` of the per-CPU array map `name`.
    pub fn per_cpu_value<T: aya::Pod>(&self, name: &str, index: u32) -> T {
        self.per_cpu_values(name, index)[super::isolate::TEST_CPU]
    }

    /// Every CPU's copy of entry `index` of the per-CPU array map `name`.
    pub fn per_cpu_values<T: aya::Pod>(&self, name: &str, index: u32) -> Vec<T> {
        let map: PerCpuArray<_, T> =
            PerCpuArray::try_from(self.ebpf.map(name).expect("map exists")).expect("per-CPU array");
        map.get(&index, 0)
            .unwrap_or_else(|e| panic!("{name}[{index}]: {e}"))
            .iter()
            .copied()
            .collect()
    }

    /// Sets entry `index` of the per-CPU array map `name` to `value` on the
    /// test CPU (the other CPUs' are cleared).
    pub fn set_per_cpu_value<T: aya::Pod + Default>(&mut self, name: &str, index: u32, value: T) {
        let mut values: Vec<T> = (0..nr_cpus().expect("CPU count"))
            .map(|_| T::default())
            .collect();
        values[super::isolate::TEST_CPU] = value;
        let values = PerCpuValues::try_from(values).expect("per-CPU values");
        let mut map: PerCpuArray<_, T> =
            PerCpuArray::try_from(self.ebpf.map_mut(name).expect("map exists"))
                .expect("per-CPU array");
        map.set(index, values, 0)
            .unwrap_or_else(|e| panic!("set {name}[{index}]: {e}"));
    }

    /// Entry `index` of the array map `name`.
    pub fn array_value<T: aya::Pod>(&self, name: &str, index: u32) -> T {
        let map: Array<_, T> =
            Array::try_from(self.ebpf.map(name).expect("map exists")).expect("array map");
        map.get(&index, 0)
            .unwrap_or_else(|e| panic!("{name}[{index}]: {e}"))
    }

    pub fn set_opened(&mut self, id: u32, opened: u64) {
        let conns = BackendConns { opened, closed: 0 };
        self.array::<BackendConns>(lb_common::BACKEND_CONNS_MAP)
            .set(id, conns, 0)
            .expect("set conns");
    }

    pub fn set_correction(&mut self, id: u32, correction: u64) {
        self.array::<u64>(lb_common::BACKEND_CORRECTION_MAP)
            .set(id, correction, 0)
            .expect("set correction");
    }

    pub fn array<T: aya::Pod>(&mut self, name: &str) -> Array<&mut MapData, T> {
        Array::try_from(self.ebpf.map_mut(name).expect("map exists")).expect("array map")
    }

    /// Any map by name, for map types without a typed helper here.
    pub fn map_mut(&mut self, name: &str) -> &mut aya::maps::Map {
        self.ebpf.map_mut(name).expect("map exists")
    }

    pub fn conns(&self, id: u32) -> BackendConns {
        self.array_value(lb_common::BACKEND_CONNS_MAP, id)
    }

    /// Runs one frame: the XDP action and the frame as the program left it.
    pub fn run(&self, frame: &[u8]) -> (u32, Vec<u8>) {
        let (action, out, _) = self.run_repeat(frame, 1);
        (action, out)
    }

    /// Runs one frame `repeat` times in the kernel: the action, the output
    /// frame and the kernel's mean duration per run in nanoseconds.
    pub fn run_repeat(&self, frame: &[u8], repeat: u32) -> (u32, Vec<u8>, u32) {
        self.run_program(lb_common::XDP_PROGRAM, frame, repeat)
    }

    /// [`Lb::run_repeat`] for the loaded program `name`.
    pub fn run_program(&self, name: &str, frame: &[u8], repeat: u32) -> (u32, Vec<u8>, u32) {
        let mut out = vec![0u8; frame.len() + 64];
        let mut opts = TestRunOptions::new();
        opts.data_in = Some(frame);
        opts.data_out = Some(&mut out);
        opts.repeat = repeat;
        let result = self
            .named_program(name)
            .test_run(opts)
            .expect("BPF_PROG_TEST_RUN");
        out.truncate(result.data_size_out as usize);
        (result.return_value, out, result.duration.as_nanos() as u32)
    }

    /// Runs `pkt` and asserts it comes out as `expected` with `action`.
    pub fn expect(&self, pkt: &Pkt, action: u32, expected: &Pkt) {
        let (got, out) = self.run(&pkt.build());
        assert_eq!(got, action, "XDP action for {pkt:?}: {:?}", self.reasons());
        assert_eq!(out, expected.build(), "output frame for {pkt:?}");
    }

    /// Runs `frame` and asserts it is passed untouched.
    pub fn expect_pass(&self, frame: &[u8]) {
        let (got, out) = self.run(frame);
        assert_eq!(got, XDP_PASS, "{:?}", self.reasons());
        assert_eq!(out, frame, "a passed frame must be unchanged");
    }

    /// Every reason counter (summed over CPUs), indexed by reason.
    pub fn reason_counts(&self) -> Vec<u64> {
        let map: PerCpuArray<_, u64> = PerCpuArray::try_from(
            self.ebpf
                .map(lb_common::REASON_STATS_MAP)
                .expect("REASON_STATS"),
        )
        .expect("percpu");
        (0..reason::COUNT)
            .map(|r| map.get(&r, 0).expect("counter").iter().sum::<u64>())
            .collect()
    }

    /// All reason counters as name → count for the non-zero ones.
    pub fn reasons(&self) -> BTreeMap<&'static str, u64> {
        self.reason_counts()
            .into_iter()
            .enumerate()
            .filter(|(_, n)| *n > 0)
            .map(|(r, n)| (reason::NAMES[r], n))
            .collect()
    }

    pub fn reason(&self, r: u32) -> u64 {
        self.reason_counts()[r as usize]
    }

    pub fn events(&mut self) -> Vec<FlowEvent> {
        let mut events = Vec::new();
        while let Some(item) = self.events.next() {
            assert_eq!(item.len(), size_of::<FlowEvent>());
            // SAFETY: the length was checked; FlowEvent is plain integers.
            events.push(unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<FlowEvent>()) });
        }
        events
    }

    fn flows(&self) -> HashMap<&MapData, FlowKey, FlowEntry> {
        HashMap::try_from(self.ebpf.map(lb_common::FLOWS_MAP).expect("FLOWS")).expect("hash")
    }

    /// IPv4's flow table (16-byte keys).
    fn flows4(&self) -> HashMap<&MapData, FlowKeyV4, FlowEntry> {
        HashMap::try_from(self.ebpf.map(lb_common::FLOWS4_MAP).expect("FLOWS4")).expect("hash")
    }

    /// The entry under `key`, in its family's table.
    pub fn flow(&self, key: &FlowKey) -> Option<FlowEntry> {
        if key.family == AF_INET {
            self.flows4().get(&FlowKeyV4::of(key), 0).ok()
        } else {
            self.flows().get(key, 0).ok()
        }
    }

    /// `FLOWS` (IPv6's table, and where older builds kept both families'),
    /// writable.
    fn flows_mut(&mut self) -> HashMap<&mut MapData, FlowKey, FlowEntry> {
        HashMap::try_from(self.ebpf.map_mut(lb_common::FLOWS_MAP).expect("FLOWS")).expect("hash")
    }

    /// `FLOWS4`, writable.
    fn flows4_mut(&mut self) -> HashMap<&mut MapData, FlowKeyV4, FlowEntry> {
        HashMap::try_from(self.ebpf.map_mut(lb_common::FLOWS4_MAP).expect("FLOWS4")).expect("hash")
    }

    /// Overwrites one entry (to age it, say).
    pub fn set_flow(&mut self, key: &FlowKey, entry: FlowEntry) {
        let written = if key.family == AF_INET {
            self.flows4_mut().insert(FlowKeyV4::of(key), entry, 0)
        } else {
            self.flows_mut().insert(key, entry, 0)
        };
        written.expect("set flow entry");
    }

    /// Removes one entry behind the program's back (to make an orphan).
    pub fn remove_flow(&mut self, key: &FlowKey) {
        let removed = if key.family == AF_INET {
            self.flows4_mut().remove(&FlowKeyV4::of(key))
        } else {
            self.flows_mut().remove(key)
        };
        removed.expect("remove flow entry");
    }

    /// Writes `entry` in `FLOWS` under the 40-byte `key`, whatever its
    /// family: where a build before IPv4's own table (`FLOWS4`) kept it.
    pub fn set_legacy_flow(&mut self, key: &FlowKey, entry: FlowEntry) {
        self.flows_mut()
            .insert(key, entry, 0)
            .expect("set legacy flow entry");
    }

    /// IPv4 entries in `FLOWS` (see [`Lb::set_legacy_flow`]).
    pub fn legacy_ipv4_flow_count(&self) -> usize {
        self.flows()
            .keys()
            .filter_map(Result::ok)
            .filter(|k| k.family == AF_INET)
            .count()
    }

    /// Pins both flow tables in a directory of their own under the BPF
    /// file system, as a running instance's pin directory holds them
    /// (removed when the returned value is dropped).
    pub fn pin_flow_tables(&self) -> PinnedFlowTables {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::path::PathBuf::from(format!(
            "/sys/fs/bpf/lb-tests-flows-{}-{n}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).expect("create a pin directory");
        let pinned = PinnedFlowTables { dir };
        for name in [lb_common::FLOWS_MAP, lb_common::FLOWS4_MAP] {
            self.ebpf
                .map(name)
                .expect("flow table")
                .pin(pinned.dir.join(name))
                .expect("pin a flow table");
        }
        pinned
    }

    /// Every flow entry of both tables, with its key.
    pub fn all_flows(&self) -> Vec<(FlowKey, FlowEntry)> {
        let mut all: Vec<_> = self
            .flows()
            .iter()
            .map(|r| r.expect("flow entry"))
            .collect();
        all.extend(
            self.flows4()
                .iter()
                .map(|r| r.expect("flow entry"))
                .map(|(k, e)| (k.widen(), e)),
        );
        all
    }

    /// Removes every entry of both flow tables whose key is not in `keep`,
    /// behind the program's back (the dataplane benchmark puts the tables
    /// back to one state before each new-flow case); how many it removed.
    pub fn remove_flows_except(&mut self, keep: &[FlowKey]) -> usize {
        let mut gone: Vec<FlowKey> = self.flows().keys().map(|k| k.expect("flow key")).collect();
        gone.extend(self.flows4().keys().map(|k| k.expect("flow key").widen()));
        gone.retain(|key| !keep.contains(key));
        for key in &gone {
            self.remove_flow(key);
        }
        gone.len()
    }

    /// Entries in both flow tables.
    pub fn flow_count(&self) -> usize {
        self.flows().keys().count() + self.flows4().keys().count()
    }

    /// The forward entry of the IPv4 client's connection from `client_port`.
    pub fn forward_entry(&self, proto: u8, vip_port: u16, client_port: u16) -> FlowEntry {
        self.flow(&key(proto, (CLIENT, client_port), (VIP, vip_port)))
            .expect("forward flow entry")
    }

    /// Sends a SYN from `client_port` and returns the backend id it went to.
    pub fn syn(&self, client_port: u16) -> u32 {
        let (action, _) = self.run(&Pkt::tcp((CLIENT, client_port), (VIP, HTTP), TCP_SYN).build());
        assert_eq!(
            action,
            XDP_TX,
            "SYN from port {client_port}: {:?}",
            self.reasons()
        );
        self.forward_entry(IPPROTO_TCP, HTTP, client_port)
            .backend_id
    }
}

impl Default for Lb {
    fn default() -> Self {
        Self::new()
    }
}

/// A TCP segment from IPv4 backend `id` to the SNAT address, as the backend sends it.
pub fn from_backend(id: u32, snat_port: u16, flags: u8) -> Pkt {
    Pkt::tcp((backend_addr(id), BACKEND_PORT), (SNAT, snat_port), flags)
        .macs(LB_MAC, backend_mac(id))
}

/// A pin directory holding both flow tables ([`Lb::pin_flow_tables`]).
pub struct PinnedFlowTables {
    dir: std::path::PathBuf,
}

impl PinnedFlowTables {
    pub fn path(&self) -> &std::path::Path {
        &self.dir
    }
}

impl Drop for PinnedFlowTables {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
