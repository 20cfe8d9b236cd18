//! Types shared by the XDP program (`lb-ebpf`) and the control plane (`lb-user`).
//!
//! Every type that crosses the kernel/user boundary is `#[repr(C)]`, has its
//! padding spelled out as named fields (so both sides agree byte for byte and
//! no uninitialised padding reaches a map key), and carries a compile-time
//! size check. Addresses are stored as four `u32` words holding the bytes in
//! network order, exactly as they sit in the packet: an IPv4 address uses word
//! 0 and leaves words 1..3 zero, with `family` telling the two apart. Ports
//! are stored in network byte order too, so the data path never swaps bytes.
#![cfg_attr(not(test), no_std)]

pub mod arith;
pub mod hash;
pub mod maps;
pub mod p2c;
pub mod time_wait;
pub mod verdict;

pub use maps::*;
pub use verdict::{Reason, StageResult, Verdict, action};

/// Address family tags used in keys and values.
pub const AF_INET: u8 = 4;
pub const AF_INET6: u8 = 6;

/// IP protocol numbers the balancer handles.
pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;

/// Limits. They size the maps, so both sides must agree.
pub const MAX_VIPS: u32 = 256;
/// Backend ids are global (shared across VIPs) and index the backend arrays.
pub const MAX_BACKENDS: u32 = 4096;
/// Slots per VIP in [`VIP_BACKENDS_MAP`]; the slot array is `MAX_VIPS * MAX_BACKENDS_PER_VIP`.
pub const MAX_BACKENDS_PER_VIP: u32 = 1024;
/// Default number of flow-table entries (both directions share the table).
pub const DEFAULT_FLOW_TABLE_SIZE: u32 = 262_144;
/// Ring buffer size in bytes (a power of two, a multiple of the page size).
pub const EVENTS_RING_BYTES: u32 = 1 << 20;
/// Steps a CPU's SNAT cursor may take past tuples still in use (by a
/// long-lived connection, or in quarantine) before refusing a flow. Each
/// step is a `BPF_NOEXIST` insert into the (non-LRU) flow table, which
/// never evicts anything. The first step also takes over the closed tuple
/// at the cursor when its quarantine is over or the backend's TIME_WAIT
/// accepts the SYN (`time_wait`), so a slice turned over inside the
/// quarantine does not cost every step.
pub const SNAT_PORT_TRIES: u32 = 8;
/// When a CPU's own SNAT slice has nothing free within [`SNAT_PORT_TRIES`],
/// the positions of another CPU's slice it tries before refusing the flow
/// (consecutive, from a random one). SYNs that all land on one CPU (one
/// busy receive queue, a veth) would otherwise reach only 1/N of the tuples.
pub const SNAT_STEAL_TRIES: u32 = 4;
/// When no tuple is free within those steps, the tuples in quarantine from
/// the cursor on that a new SYN may take over because the backend's
/// TIME_WAIT would accept it ([`time_wait`]). About half qualify: Linux
/// clients give each connection a random timestamp offset and initial
/// sequence number, so whether a SYN is "newer" than the last connection
/// on the tuple is a coin toss (seen in the lab: a second connection from
/// the same client had a lower TSval and a lower sequence number, and was
/// accepted because the TSval was newer modulo 2^32). With 16, 1 or 2 of
/// 3,000 of ApacheBench's SYNs on 256 ports found none (fewer fit
/// candidates than 16 coin tosses would give; not explained); with 32,
/// none in the runs since. Each try is one lookup, and only SYNs that
/// found no free tuple make them.
pub const SNAT_REUSE_TRIES: u32 = 32;
/// Addresses per family in a SNAT pool.
pub const MAX_SNAT_ADDRS: u32 = 64;
/// Defaults for the kernel sweep (see [`LbConfig`]): how long a closed
/// forward entry keeps translating late segments, and how long a freed SNAT
/// tuple stays reserved after the close (Linux's 60 s TIME_WAIT on the
/// backend, plus 5 s slack).
pub const DEFAULT_CLOSED_LINGER_NS: u64 = 10_000_000_000;
pub const DEFAULT_SNAT_QUARANTINE_NS: u64 = 65_000_000_000;
/// Default SNAT source-port range, below Linux's default ephemeral range
/// (32768..=60999) so the balancer host's own connections never collide.
pub const DEFAULT_SNAT_PORT_MIN: u16 = 20_000;
pub const DEFAULT_SNAT_PORT_MAX: u16 = 32_767;

/// Exponent `b` of P2C's in-flight term `(inflight+1)^b`: the default, and the
/// range the CLI, the config file and the data path all accept (the data path
/// reads 0 as "unset", meaning the default, and clamps above the maximum).
pub const DEFAULT_INFLIGHT_BIAS: u8 = 2;
pub const MIN_INFLIGHT_BIAS: u8 = 1;
pub const MAX_INFLIGHT_BIAS: u8 = 3;
/// P2C's full-scan limit (`--p2c-full-scan`): a VIP (or zone) with at most
/// this many backends in its block has every one compared for a new flow
/// when a random pair's winner is busy or far above the pool
/// (`p2c::scans_all`, `p2c::settles_scan`); 0 turns it off.
pub const DEFAULT_P2C_FULL_SCAN: u16 = 16;
/// Default [`VipMeta::p2c_saturation`] (`--p2c-saturation`).
pub const DEFAULT_P2C_SATURATION: u16 = p2c::SATURATED_INFLIGHT as u16;

/// Length of one half of each VIP's smooth weighted round-robin schedule
/// block in [`VIP_SCHEDULE_MAP`] (4 bytes a slot, two halves a VIP: 4 MiB
/// for all VIPs). Weights whose reduced sum exceeds it are scaled down to fit.
pub const WRR_SCHEDULE_LEN: u32 = 2048;
/// Copies of each VIP's schedule and weight-prefix blocks: the kernel reads
/// the half its descriptor names ([`VipTables::half`], or
/// [`VipZones::half`] for a zone-aware VIP) while the control plane writes
/// the other one, then flips the descriptor (see [`VipTables`]).
pub const TABLE_HALVES: u32 = 2;
const _: () = assert!(TABLE_HALVES.is_power_of_two());

/// The half a descriptor's `half` field names: masked, so a corrupt value
/// still names one of the VIP's own halves.
#[inline(always)]
pub const fn table_half(half: u32) -> u32 {
    half & (TABLE_HALVES - 1)
}

/// The run of VIP `vip_id`'s half `half` among all VIPs' halves: half `h`
/// of VIP `v` is run `v * TABLE_HALVES + h` of each halved table map. For
/// `vip_id < MAX_VIPS` (the data path checks it once per new flow and then
/// computes without a branch; a larger id would wrap, which the maps'
/// own bounds checks still contain).
#[inline(always)]
pub const fn table_run(vip_id: u32, half: u32) -> u32 {
    vip_id
        .wrapping_mul(TABLE_HALVES)
        .wrapping_add(table_half(half))
}

/// Index in [`VIP_SCHEDULE_MAP`] of the first entry of half `half` of VIP
/// `vip_id`'s schedule block: run [`table_run`] of [`WRR_SCHEDULE_LEN`]
/// entries (`None` for a VIP id past [`MAX_VIPS`]).
#[inline(always)]
pub const fn schedule_base(vip_id: u32, half: u32) -> Option<u32> {
    if vip_id >= MAX_VIPS {
        return None;
    }
    Some(table_run(vip_id, half) * WRR_SCHEDULE_LEN)
}

/// Index in [`VIP_WEIGHT_PREFIX_MAP`] of the running sum of slot 0 in half
/// `half` of VIP `vip_id`'s prefix block: run [`table_run`] of
/// [`MAX_BACKENDS_PER_VIP`] sums (`None` for a VIP id past [`MAX_VIPS`]).
#[inline(always)]
pub const fn prefix_base(vip_id: u32, half: u32) -> Option<u32> {
    if vip_id >= MAX_VIPS {
        return None;
    }
    Some(table_run(vip_id, half) * MAX_BACKENDS_PER_VIP)
}
const _: () = assert!(
    (MAX_VIPS as u64) * (TABLE_HALVES as u64) * (WRR_SCHEDULE_LEN as u64) <= u32::MAX as u64
);

/// Entries of one Maglev lookup table: a prime above 100 × the backends it
/// serves (so up to 655 backends keep Maglev's balance guarantee).
pub const MAGLEV_TABLE_SIZE: u32 = 65_537;
/// Maglev tables in [`MAGLEV_MAP`] (4 bytes an entry: 2 MiB), so at most this
/// many VIPs use the `maglev` algorithm.
pub const MAX_MAGLEV_TABLES: u32 = 8;

/// Zone blocks of one VIP ([`VipZones::zones`]). A VIP whose backends span
/// more zones keeps the first `MAX_ZONES - 1` in failover order and lumps
/// the rest into the last block.
pub const MAX_ZONES: u32 = 8;
/// Fragmented datagrams whose first fragment's ports are remembered at
/// once (an LRU: the oldest datagram's entry goes first; its later
/// fragments then pass to the host, which drops an incomplete datagram).
pub const MAX_FRAGMENTED_DATAGRAMS: u32 = 8192;
/// [`ZoneBlock::cum_share`] is out of this: the kernel draws 16 random bits.
pub const ZONE_SHARE_SCALE: u32 = 1 << 16;
/// Entries of one zone's Maglev table while a Maglev VIP routes by zone:
/// zone block `i` uses entries `i * ZONE_MAGLEV_SIZE ..` of the VIP's table
/// (a prime; `MAX_ZONES` of them fit in [`MAGLEV_TABLE_SIZE`]), so up to 81
/// backends per zone keep Maglev's balance guarantee.
pub const ZONE_MAGLEV_SIZE: u32 = 8191;
const _: () = assert!(MAX_ZONES * ZONE_MAGLEV_SIZE <= MAGLEV_TABLE_SIZE);

/// Names of the maps, used by the loader, the pin directory and `status`.
pub const VIPS_MAP: &str = "VIPS";
pub const VIP_BACKENDS_MAP: &str = "VIP_BACKENDS";
pub const VIP_STATE_MAP: &str = "VIP_STATE";
pub const BACKENDS_MAP: &str = "BACKENDS";
pub const BACKEND_SCORES_MAP: &str = "BACKEND_SCORES";
pub const BACKEND_CONNS_MAP: &str = "BACKEND_CONNS";
pub const BACKEND_CORRECTION_MAP: &str = "BACKEND_CORRECTION";
pub const BACKEND_STATS_MAP: &str = "BACKEND_STATS";
/// The flow tables: IPv6's (40-byte [`FlowKey`]s; before issue 9's
/// compact keys, both families') and IPv4's ([`FlowKeyV4`]).
pub const FLOWS_MAP: &str = "FLOWS";
pub const FLOWS4_MAP: &str = "FLOWS4";
pub const NEIGHBOURS_MAP: &str = "NEIGHBOURS";
pub const CONFIG_MAP: &str = "CONFIG";
pub const REASON_STATS_MAP: &str = "REASON_STATS";
pub const EVENTS_MAP: &str = "EVENTS";
pub const VIP_TABLES_MAP: &str = "VIP_TABLES";
pub const VIP_SCHEDULE_MAP: &str = "VIP_SCHEDULE";
pub const VIP_WEIGHT_PREFIX_MAP: &str = "VIP_WEIGHT_PREFIX";
pub const MAGLEV_MAP: &str = "MAGLEV";
pub const BACKEND_PROGRESS_MAP: &str = "BACKEND_PROGRESS";
pub const BACKEND_PENDING_MAP: &str = "BACKEND_PENDING";
pub const NEW_FLOW_LIMIT_MAP: &str = "NEW_FLOW_LIMIT";
pub const NEW_FLOW_BUCKETS_MAP: &str = "NEW_FLOW_BUCKETS";
pub const SNAT_ADDRS_MAP: &str = "SNAT_ADDRS";
pub const SNAT_ADDR_INDEX_MAP: &str = "SNAT_ADDR_INDEX";
pub const SNAT_CURSORS_MAP: &str = "SNAT_CURSORS";
pub const BACKEND_SNAT_USED_MAP: &str = "BACKEND_SNAT_USED";
pub const SWEEP_STATS_MAP: &str = "SWEEP_STATS";
pub const BACKEND_LATENCY_MAP: &str = "BACKEND_LATENCY";
pub const LATENCY_EPOCH_MAP: &str = "LATENCY_EPOCH";
pub const VIP_ZONES_MAP: &str = "VIP_ZONES";
pub const FRAGMENTS_MAP: &str = "FRAGMENTS";
/// Per CPU and backend: TCP connections the backend accepted (its
/// SYN-ACK seen), which end a run of refused connections in outlier
/// detection however many answers its older connections give.
pub const BACKEND_HANDSHAKES_MAP: &str = "BACKEND_HANDSHAKES";
/// Per CPU: each backend's last resolved next hop (a cache the data path
/// keeps; pinned so that the control plane can forget a backend's hops
/// when its neighbour entry changes or goes).
pub const BACKEND_HOPS_MAP: &str = "BACKEND_HOPS";
/// The one-entry benchmark floor's reply ways (`[claim, client]` words; see
/// lb-ebpf's `floor.rs`); only the benchmark sizes and reads it.
pub const FLOOR_REPLY_WAYS_MAP: &str = "FLOOR_REPLY_WAYS";
/// The claim word's bit of a taken way in [`FLOOR_REPLY_WAYS_MAP`].
pub const FLOOR_WAY_CLAIMED: u64 = 1 << 63;
/// The flow ways of two benchmark floors (lb-ebpf's `floor.rs`: the
/// established lookup as a way, the new flow with no hash entry): one way
/// a slot, at a hash of the key the program computes. One slot unless the
/// loader sizes it; the benchmark sizes it to [`FLOOR_FLOW_WAYS`].
pub const FLOOR_FLOW_WAYS_MAP: &str = "FLOOR_FLOW_WAYS";
/// Slots of [`FLOOR_FLOW_WAYS_MAP`] when the benchmark sizes it (a power
/// of two: the floor masks its hash with it).
pub const FLOOR_FLOW_WAYS: u32 = 1 << 18;
const _: () = assert!(FLOOR_FLOW_WAYS.is_power_of_two());
/// Calls of an empty BPF function that lb-ebpf's `xdp_calls_bench` makes
/// before its MAC swap: the benchmark's measure of one call and return.
pub const CALIBRATION_CALLS: u32 = 4;
/// The kernel sweep: an XDP-typed program the control plane runs with
/// `BPF_PROG_TEST_RUN` once a second; it walks the flow table with
/// `bpf_for_each_map_elem` (see lb-ebpf's `sweep.rs`).
pub const SWEEP_PROGRAM: &str = "lb_sweep";
/// First byte of the frame `lb_sweep` is run with: a light pass, which
/// skips the pair checks (each open entry's lookup of its other direction,
/// the search for lone entries) and only expires, frees and counts. Any
/// other first byte runs a full pass.
pub const SWEEP_LIGHT: u8 = 1;
/// Name of the XDP program function in the object.
pub const XDP_PROGRAM: &str = "lb_xdp";

/// Every map the program defines, in the order `status` prints them.
pub const ALL_MAPS: &[&str] = &[
    VIPS_MAP,
    VIP_BACKENDS_MAP,
    VIP_STATE_MAP,
    BACKENDS_MAP,
    BACKEND_SCORES_MAP,
    BACKEND_CONNS_MAP,
    BACKEND_CORRECTION_MAP,
    BACKEND_STATS_MAP,
    FLOWS_MAP,
    FLOWS4_MAP,
    NEIGHBOURS_MAP,
    CONFIG_MAP,
    REASON_STATS_MAP,
    EVENTS_MAP,
    VIP_TABLES_MAP,
    VIP_SCHEDULE_MAP,
    VIP_WEIGHT_PREFIX_MAP,
    MAGLEV_MAP,
    BACKEND_PROGRESS_MAP,
    BACKEND_PENDING_MAP,
    NEW_FLOW_LIMIT_MAP,
    NEW_FLOW_BUCKETS_MAP,
    SNAT_ADDRS_MAP,
    SNAT_ADDR_INDEX_MAP,
    SNAT_CURSORS_MAP,
    BACKEND_SNAT_USED_MAP,
    SWEEP_STATS_MAP,
    BACKEND_LATENCY_MAP,
    LATENCY_EPOCH_MAP,
    VIP_ZONES_MAP,
    FRAGMENTS_MAP,
    BACKEND_HOPS_MAP,
    BACKEND_HANDSHAKES_MAP,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn halves_tile_the_table_maps_without_overlap() {
        // Every (VIP, half) run starts one run after the previous one, and
        // the last VIP's second half ends exactly at the map's end.
        let mut next = 0;
        for vip in 0..MAX_VIPS {
            for half in 0..TABLE_HALVES {
                assert_eq!(schedule_base(vip, half), Some(next * WRR_SCHEDULE_LEN));
                assert_eq!(prefix_base(vip, half), Some(next * MAX_BACKENDS_PER_VIP));
                next += 1;
            }
        }
        assert_eq!(next, MAX_VIPS * TABLE_HALVES);
    }

    #[test]
    fn a_corrupt_half_stays_inside_the_vips_runs_and_ids_past_max_vips_have_none() {
        assert_eq!(schedule_base(3, 7), schedule_base(3, 1));
        assert_eq!(prefix_base(3, 2), prefix_base(3, 0));
        assert_eq!(schedule_base(MAX_VIPS, 0), None);
        assert_eq!(prefix_base(u32::MAX / 2, 1), None);
    }
}
