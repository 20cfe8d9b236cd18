//! Every map of the program. Names match the `*_MAP` constants in lb-common.
use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LruHashMap, PerCpuArray, RingBuf},
};
use lb_common::{time_wait::TsOption, *};

use crate::packet::Packet;

#[map(name = "VIPS")]
pub static VIPS: HashMap<VipKey, VipMeta> = HashMap::with_max_entries(MAX_VIPS, 0);
#[map(name = "VIP_BACKENDS")]
pub static VIP_BACKENDS: Array<u32> = Array::with_max_entries(MAX_VIPS * MAX_BACKENDS_PER_VIP, 0);
#[map(name = "VIP_STATE")]
pub static VIP_STATE: Array<VipState> = Array::with_max_entries(MAX_VIPS, 0);
#[map(name = "BACKENDS")]
pub static BACKENDS: Array<Backend> = Array::with_max_entries(MAX_BACKENDS, 0);
#[map(name = "BACKEND_SCORES")]
pub static BACKEND_SCORES: Array<BackendScore> = Array::with_max_entries(MAX_BACKENDS, 0);
#[map(name = "BACKEND_CONNS")]
pub static BACKEND_CONNS: Array<BackendConns> = Array::with_max_entries(MAX_BACKENDS, 0);
#[map(name = "BACKEND_CORRECTION")]
pub static BACKEND_CORRECTION: Array<u64> = Array::with_max_entries(MAX_BACKENDS, 0);
#[map(name = "BACKEND_STATS")]
pub static BACKEND_STATS: PerCpuArray<BackendStats> =
    PerCpuArray::with_max_entries(MAX_BACKENDS, 0);
/// Resized at load time by the control plane (`--flow-table-size`). A
/// plain hash: the kernel's LRU evicts before it checks `BPF_NOEXIST` and
/// removes one direction of a connection without the other; here entries
/// leave only through `sweep` (or an insert's own rollback).
/// IPv6's flow table; IPv4's is [`FLOWS4`] (see `flow::lookup`).
#[map(name = "FLOWS")]
pub static FLOWS: HashMap<FlowKey, FlowEntry> =
    HashMap::with_max_entries(DEFAULT_FLOW_TABLE_SIZE, 0);
/// This CPU's packed IPv4 flow key on its way to a map helper (see
/// `flow::packed`): not on the stack, which the general pipeline's call
/// chains use up.
#[map(name = "FLOW_KEY4")]
pub static FLOW_KEY4: PerCpuArray<FlowKeyV4> = PerCpuArray::with_max_entries(1, 0);
/// IPv4's flow table, under 16-byte keys; sized and kept like [`FLOWS`].
#[map(name = "FLOWS4")]
pub static FLOWS4: HashMap<FlowKeyV4, FlowEntry> =
    HashMap::with_max_entries(DEFAULT_FLOW_TABLE_SIZE, 0);
/// First fragments' ports by datagram (see `lb_common::FragKey`); an LRU,
/// as an entry is useful only for the few milliseconds a datagram's
/// fragments take to arrive.
#[map(name = "FRAGMENTS")]
pub static FRAGMENTS: LruHashMap<FragKey, FragPorts> =
    LruHashMap::with_max_entries(MAX_FRAGMENTED_DATAGRAMS, 0);
#[map(name = "NEIGHBOURS")]
pub static NEIGHBOURS: HashMap<IpKey, Neighbour> = HashMap::with_max_entries(MAX_BACKENDS, 0);
/// Per CPU and backend: the next hop a flow to the backend last resolved
/// (`backend_hop`), which the next new flows take without a FIB lookup
/// while it is fresh. Written only by the data path.
#[map(name = "BACKEND_HOPS")]
pub static BACKEND_HOPS: PerCpuArray<BackendHop> = PerCpuArray::with_max_entries(MAX_BACKENDS, 0);
/// Requests pending per backend and their start times' sum (see
/// `lb_common::BackendPending`, `progress::request_started`).
#[map(name = "BACKEND_PENDING")]
pub static BACKEND_PENDING: Array<BackendPending> = Array::with_max_entries(MAX_BACKENDS, 0);
#[map(name = "CONFIG")]
pub static CONFIG: Array<LbConfig> = Array::with_max_entries(1, 0);
#[map(name = "REASON_STATS")]
pub static REASON_STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(reason::COUNT, 0);
#[map(name = "EVENTS")]
pub static EVENTS: RingBuf = RingBuf::with_byte_size(EVENTS_RING_BYTES, 0);
#[map(name = "VIP_TABLES")]
pub static VIP_TABLES: Array<VipTables> = Array::with_max_entries(MAX_VIPS, 0);
/// Two halves per VIP (`TABLE_HALVES`): one read, one written aside.
#[map(name = "VIP_SCHEDULE")]
pub static VIP_SCHEDULE: Array<u32> =
    Array::with_max_entries(MAX_VIPS * TABLE_HALVES * WRR_SCHEDULE_LEN, 0);
/// Two halves per VIP, like `VIP_SCHEDULE`.
#[map(name = "VIP_WEIGHT_PREFIX")]
pub static VIP_WEIGHT_PREFIX: Array<u32> =
    Array::with_max_entries(MAX_VIPS * TABLE_HALVES * MAX_BACKENDS_PER_VIP, 0);
/// Memory-mappable (`BPF_F_MMAPABLE`): the control plane writes a 65,537
/// entry table aside with plain stores, not 65,537 map updates.
#[map(name = "MAGLEV")]
pub static MAGLEV: Array<u32> = Array::with_max_entries(
    MAX_MAGLEV_TABLES * MAGLEV_TABLE_SIZE,
    aya_ebpf::bindings::BPF_F_MMAPABLE,
);
#[map(name = "BACKEND_PROGRESS")]
pub static BACKEND_PROGRESS: Array<BackendProgress> = Array::with_max_entries(MAX_BACKENDS, 0);
/// Per CPU: the best candidate so far of a P2C full scan
/// (`select::p2c`), scratch space of one new flow's pick.
#[map(name = "P2C_SCAN_BEST")]
pub static P2C_SCAN_BEST: PerCpuArray<ScanBest> = PerCpuArray::with_max_entries(1, 0);

/// [`P2C_SCAN_BEST`]'s value: the best `lb_common::p2c::rank` so far and
/// its backend, and the random pair's winner so far (`u32::MAX` ids: none).
#[repr(C)]
pub struct ScanBest {
    pub rank: u64,
    pub id: u32,
    pub pair_id: u32,
    pub pair_cost: u64,
    pub pair_score: u64,
    /// The best's pending requests' summed service so far (the tie-break).
    pub served: u64,
    /// The pair winner's `Candidate::weight`.
    pub pair_weight: u32,
    /// Slots seen so far that tie with the best (its rank and service):
    /// each replaces it with probability 1/ties (reservoir sampling).
    pub ties: u32,
}

impl ScanBest {
    /// Before a scan: nothing found.
    pub const EMPTY: Self = Self {
        rank: u64::MAX,
        id: u32::MAX,
        pair_id: u32::MAX,
        pair_cost: 0,
        pair_score: 0,
        served: 0,
        pair_weight: 0,
        ties: 0,
    };
}

/// Least connections' scan: the best slot's pending requests' summed
/// service so far, per CPU. In map memory rather than in the scan's state
/// on the stack: the verifier checks a `bpf_loop` body until its state
/// repeats, and a tracked value there cost about 200k more instructions
/// (the same reason as `P2C_SCAN_BEST`).
#[map(name = "LEAST_CONN_SCAN")]
pub static LEAST_CONN_SCAN: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);
#[map(name = "NEW_FLOW_LIMIT")]
pub static NEW_FLOW_LIMIT: Array<NewFlowLimit> = Array::with_max_entries(1, 0);
#[map(name = "NEW_FLOW_BUCKETS")]
pub static NEW_FLOW_BUCKETS: PerCpuArray<TokenBucket> = PerCpuArray::with_max_entries(1, 0);
#[map(name = "SNAT_ADDRS")]
pub static SNAT_ADDRS: Array<SnatAddr> = Array::with_max_entries(2 * MAX_SNAT_ADDRS, 0);
/// Pool address → its slot in `SNAT_ADDRS`; only its presence is used.
#[map(name = "SNAT_ADDR_INDEX")]
pub static SNAT_ADDR_INDEX: HashMap<IpKey, u32> = HashMap::with_max_entries(2 * MAX_SNAT_ADDRS, 0);

/// Whether `addr` (of `family`) and `port` (network byte order) name a
/// SNAT tuple: a pool address, a port in the SNAT range. The port test
/// comes first, so other traffic costs no lookup. Both stages that ask
/// (the pipeline for a packet of no flow, the parser for a malformed one)
/// call it inline, each from a BPF function of its own.
#[inline(always)]
pub fn is_snat_tuple(addr: [u32; 4], family: u8, port: u16, cfg: &LbConfig) -> bool {
    let port = u16::from_be(port);
    if port < cfg.snat_port_min || port > cfg.snat_port_max {
        return false;
    }
    let key = IpKey {
        addr,
        family,
        _pad: [0; 3],
    };
    // SAFETY: read-only presence test.
    unsafe { SNAT_ADDR_INDEX.get(&key) }.is_some()
}

/// Per CPU and backend: the next position in the CPU's slice of the
/// backend's SNAT tuple space.
#[map(name = "SNAT_CURSORS")]
pub static SNAT_CURSORS: PerCpuArray<u64> = PerCpuArray::with_max_entries(MAX_BACKENDS, 0);
/// Per backend: SNAT tuples held (open, closed or quarantined reply
/// entries), advanced atomically.
#[map(name = "BACKEND_SNAT_USED")]
pub static BACKEND_SNAT_USED: Array<u64> = Array::with_max_entries(MAX_BACKENDS, 0);
#[map(name = "SWEEP_STATS")]
pub static SWEEP_STATS: Array<SweepStats> = Array::with_max_entries(1, 0);
#[map(name = "BACKEND_LATENCY")]
pub static BACKEND_LATENCY: PerCpuArray<LatencyAgg> =
    PerCpuArray::with_max_entries(MAX_BACKENDS, 0);
/// Per CPU and backend: TCP connections accepted (the SYN-ACK seen).
#[map(name = "BACKEND_HANDSHAKES")]
pub static BACKEND_HANDSHAKES: PerCpuArray<u64> = PerCpuArray::with_max_entries(MAX_BACKENDS, 0);
/// Written by the control plane at every score tick.
#[map(name = "LATENCY_EPOCH")]
pub static LATENCY_EPOCH: Array<u64> = Array::with_max_entries(1, 0);
/// Zone blocks of zone-aware VIPs, keyed by `vip_id` (a hash, so each
/// update swaps the whole value). Written by the control plane.
#[map(name = "VIP_ZONES")]
pub static VIP_ZONES: HashMap<u32, VipZones> = HashMap::with_max_entries(MAX_VIPS, 0);
/// One slot per CPU: the clock of the new flow this CPU is creating, read
/// once by the backend pick (the global `select::lb_pick_backend`, which
/// returns a single register) and read by the stages after it (the flow's
/// creation, the first packet's tracking), so a new flow reads the clock
/// once (`helpers::packet_clock`).
#[map(name = "PACKET_CLOCK")]
pub static PACKET_CLOCK: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);
/// One slot per CPU: the parsed packet (and the pick) handed to the global
/// functions of `time_wait`, which take scalars and the context only.
#[map(name = "PACKET_HANDOVER")]
pub static PACKET_HANDOVER: PerCpuArray<Handover> = PerCpuArray::with_max_entries(1, 0);

/// Value of [`PACKET_HANDOVER`]: what `time_wait::record_client_close` and
/// `time_wait::take_over` hand their global functions.
#[derive(Clone, Copy)]
pub struct Handover {
    pub pkt: Packet,
    /// `select::Picked`'s payload (for `time_wait::take_over`).
    pub picked: u32,
    /// The segment's sequence number and timestamp, written by
    /// `time_wait::lb_read_seq_and_timestamp`.
    pub seq: u32,
    pub ts: TsOption,
}
