//! Map keys, map values and ring-buffer events.

/// Compile-time size check: a layout change on one side only fails the build.
macro_rules! assert_size {
    ($t:ty, $n:expr) => {
        const _: () = assert!(core::mem::size_of::<$t>() == $n);
    };
}

/// Implements `aya::Pod` for the user-space side only.
macro_rules! pod {
    ($($t:ty),+ $(,)?) => {
        $(
            #[cfg(feature = "user")]
            // SAFETY: every type listed is `#[repr(C)]`, `Copy`, made only of
            // integers and integer arrays, with all padding as explicit fields.
            unsafe impl aya::Pod for $t {}
        )+
    };
}

/// Balancing algorithm of a VIP (stored in [`VipMeta::algorithm`]).
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Power of two choices over `ewma × (inflight+1)^bias ÷ weight`.
    P2cEwma = 0,
    RoundRobin = 1,
    WeightedRoundRobin = 2,
    Random = 3,
    LeastConn = 4,
    Maglev = 5,
}

impl Algorithm {
    /// Every algorithm, in the order of their values.
    pub const ALL: [Self; 6] = [
        Self::P2cEwma,
        Self::RoundRobin,
        Self::WeightedRoundRobin,
        Self::Random,
        Self::LeastConn,
        Self::Maglev,
    ];

    pub const fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            0 => Self::P2cEwma,
            1 => Self::RoundRobin,
            2 => Self::WeightedRoundRobin,
            3 => Self::Random,
            4 => Self::LeastConn,
            5 => Self::Maglev,
            _ => return None,
        })
    }

    /// The name used on the command line and in config files.
    pub const fn name(self) -> &'static str {
        match self {
            Self::P2cEwma => "p2c-ewma",
            Self::RoundRobin => "round-robin",
            Self::WeightedRoundRobin => "weighted-round-robin",
            Self::Random => "random",
            Self::LeastConn => "least-conn",
            Self::Maglev => "maglev",
        }
    }
}

/// Key of [`crate::VIPS_MAP`]: the service address, port and protocol.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct VipKey {
    /// Address bytes in network order; IPv4 uses word 0 only.
    pub addr: [u32; 4],
    /// Port in network byte order.
    pub port: u16,
    pub proto: u8,
    /// [`crate::AF_INET`] or [`crate::AF_INET6`].
    pub family: u8,
}
assert_size!(VipKey, 20);

/// Value of [`crate::VIPS_MAP`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VipMeta {
    /// Index of the VIP's slot block in [`crate::VIP_BACKENDS_MAP`] and of its
    /// [`VipState`].
    pub vip_id: u32,
    /// Number of selectable backends in the VIP's slot block (0 = refuse).
    pub backend_count: u32,
    /// An [`Algorithm`] as `u8`.
    pub algorithm: u8,
    /// Exponent `b` of the in-flight term `(inflight+1)^b` (1..=3).
    pub inflight_bias: u8,
    pub flags: u16,
    /// P2C compares every backend of the block instead of two random ones
    /// while the block has at most this many slots (0: always two).
    pub p2c_full_scan: u16,
    /// P2C counts a backend within the re-draw bound with this many flows
    /// in flight or more as saturated (`crate::p2c::SATURATED_INFLIGHT`);
    /// 0: never. (Was padding: a VIP written by an older control plane
    /// reads 0, the rule off, as before it existed.)
    pub p2c_saturation: u16,
}
assert_size!(VipMeta, 16);

impl VipMeta {
    /// The VIP's configured algorithm: P2C for a VIP the control plane
    /// relieves with least connections ([`VIP_F_P2C_RELIEF`]), otherwise
    /// the one the kernel runs.
    pub const fn configured_algorithm(&self) -> Option<Algorithm> {
        if self.flags & VIP_F_P2C_RELIEF != 0 {
            Some(Algorithm::P2cEwma)
        } else {
            Algorithm::from_u8(self.algorithm)
        }
    }
}

/// [`VipMeta::flags`]: Maglev hashes only the client address, so one client
/// always reaches the same backend (source-IP affinity).
pub const VIP_F_SOURCE_AFFINITY: u16 = 1;

/// [`VipMeta::flags`]: a P2C VIP that the control plane relieves with least
/// connections while the backends it holds far above the pool are needed
/// (`lb_user::publish::relief`): [`VipMeta::algorithm`] then reads
/// [`Algorithm::LeastConn`], which is what the kernel runs; the flag only
/// tells readers of the map (`lb-user status`) that the VIP is P2C.
pub const VIP_F_P2C_RELIEF: u16 = 2;

/// Per-VIP weight-derived tables written by the control plane (array
/// [`crate::VIP_TABLES_MAP`] indexed by `vip_id`). The tables themselves are
/// pure functions of the VIP's slot backend ids and effective weights, and
/// are rebuilt whenever either changes:
/// - `VIP_SCHEDULE[schedule_base(vip_id, half) ..][..schedule_len[half]]`:
///   slot indexes in nginx smooth weighted round-robin order;
/// - `VIP_WEIGHT_PREFIX[prefix_base(vip_id, half) ..][..backend_count]`:
///   running sums of the slots' weights (weighted random);
/// - `MAGLEV[maglev_table * MAGLEV_TABLE_SIZE ..][..MAGLEV_TABLE_SIZE]`:
///   backend ids (Maglev consistent hashing).
///
/// No table is ever rewritten while the kernel may read it. Each VIP has
/// [`crate::TABLE_HALVES`] copies of its schedule and prefix blocks
/// ([`crate::schedule_base`], [`crate::prefix_base`]); the kernel reads the
/// one `half` names. The control plane writes the other half completely,
/// then (if the new schedule's length differs) stores that length in the
/// other half's `schedule_len` entry, which no reader looks at, and last
/// rewrites the descriptor with only `half` changed (and `maglev_table`,
/// itself switched to a table written aside). So a reader sees the old
/// half with its own length, or the new half with its own length, never a
/// mix, whatever order the kernel copies the descriptor's bytes in.
///
/// A zone-aware VIP (a [`VipZones`] entry with `count` in
/// `1..=MAX_ZONES`) reads the half its zone descriptor names instead: the
/// zone descriptor carries the blocks' schedule runs, so the two change in
/// one (atomic) hash update.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VipTables {
    /// Entries in each half's schedule run (0 = no schedule); the kernel
    /// reads `schedule_len[half]`.
    pub schedule_len: [u32; crate::TABLE_HALVES as usize],
    /// Index of the VIP's Maglev table; meaningful when `has_maglev != 0`.
    pub maglev_table: u32,
    pub has_maglev: u32,
    /// The half of the schedule and prefix blocks the kernel reads (masked
    /// with [`crate::table_half`]).
    pub half: u32,
    pub _pad: u32,
    /// P2C: the median [unweighted cost](crate::p2c::unweighted_cost) of
    /// the VIP's backends ([`BackendScore::cost`] × its weight: their
    /// latency), which the control plane refreshes with the scores (0 =
    /// none yet). A P2C pick whose unweighted cost is far above it is drawn
    /// again (bounded).
    pub reference_cost: u64,
}
assert_size!(VipTables, 32);

impl VipTables {
    /// The schedule length of the half the kernel reads.
    pub const fn live_schedule_len(&self) -> u32 {
        self.schedule_len[crate::table_half(self.half) as usize]
    }
}

/// One zone of a zone-aware VIP ([`VipZones::zones`]): a contiguous run
/// of the VIP's slot block, the share of new connections it gets, and its
/// own part of the VIP's weight-derived tables. The VIP's algorithm runs
/// inside the block exactly as it runs over a whole slot block otherwise:
/// - slots `first_slot .. first_slot + slot_count`;
/// - weighted random: `VIP_WEIGHT_PREFIX` holds running sums that restart
///   at `first_slot` (in the half [`VipZones::half`] names);
/// - smooth WRR: schedule entries `schedule_first .. + schedule_len` of the
///   VIP's schedule block (in the half [`VipZones::half`] names), holding
///   slot indexes of this block *relative to `first_slot`* (0 is the
///   block's first slot);
/// - Maglev: entries `index * ZONE_MAGLEV_SIZE ..` of the VIP's table.
///
/// The kernel checks every block it draws: one that is empty or reaches
/// past the VIP's `backend_count` (or `MAX_BACKENDS_PER_VIP`) is skipped
/// for a scan of the whole slot block; a schedule run past
/// `WRR_SCHEDULE_LEN` is ignored (round-robin inside the block). A block
/// without an in-service backend also falls back to the whole slot block.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ZoneBlock {
    pub first_slot: u32,
    pub slot_count: u32,
    /// Cumulative share of new connections through this block, out of
    /// [`crate::ZONE_SHARE_SCALE`]: a draw `r` goes to the first block
    /// whose `cum_share > r` (the last block takes what is left).
    pub cum_share: u32,
    pub schedule_first: u32,
    pub schedule_len: u32,
    pub _pad: u32,
    /// P2C: the median [unweighted cost](crate::p2c::unweighted_cost) of
    /// the block's backends (the re-draw bound's reference inside the zone;
    /// 0 = none).
    pub reference_cost: u64,
}
assert_size!(ZoneBlock, 32);

/// Value of [`crate::VIP_ZONES_MAP`] (a hash keyed by `vip_id`, so an update
/// replaces the whole value at once and the kernel never reads half of
/// one). No entry, or `count == 0`: the VIP selects over its whole slot
/// block (zone-unaware, or the zone panic: no zone qualifies).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VipZones {
    /// Blocks in use (at most [`crate::MAX_ZONES`]).
    pub count: u32,
    /// The half of the VIP's schedule and prefix blocks the zone blocks
    /// read (see [`VipTables`]; masked with [`crate::table_half`]): written
    /// completely before this descriptor names it.
    pub half: u32,
    pub zones: [ZoneBlock; crate::MAX_ZONES as usize],
}
assert_size!(VipZones, 8 + 32 * crate::MAX_ZONES as usize);

/// Per-VIP mutable kernel state (array indexed by `vip_id`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VipState {
    /// Round-robin cursor, advanced atomically.
    pub rr_cursor: u64,
}
assert_size!(VipState, 8);

/// Backend state, stored in [`Backend::state`].
pub const BACKEND_ACTIVE: u8 = 0;
/// Keeps its established flows, gets no new ones.
pub const BACKEND_DRAINING: u8 = 1;
/// Removed from selection by outlier detection.
pub const BACKEND_EJECTED: u8 = 2;
/// Removed from selection by its failed health checks. (Before it had a
/// value of its own, such a backend was written as [`BACKEND_EJECTED`];
/// the data path selects only [`BACKEND_ACTIVE`] backends, so both read
/// alike there.)
pub const BACKEND_DOWN: u8 = 3;

/// Value of [`crate::BACKENDS_MAP`] (array indexed by backend id).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Backend {
    pub addr: [u32; 4],
    /// Port in network byte order.
    pub port: u16,
    pub family: u8,
    /// [`BACKEND_ACTIVE`], [`BACKEND_DRAINING`], [`BACKEND_EJECTED`] or
    /// [`BACKEND_DOWN`].
    pub state: u8,
    pub vip_id: u32,
    /// Configured weight (the effective weight used for scoring is in
    /// [`BackendScore::weight`]).
    pub weight: u32,
    /// Non-zero when the slot holds a configured backend.
    pub in_use: u32,
}
assert_size!(Backend, 32);

/// Fixed-point scale of [`BackendScore::cost`]: `cost = ewma_ns * WEIGHT_SCALE / weight`.
pub const WEIGHT_SCALE: u64 = 100;

/// [`BackendScore::flags`]: the backend's estimate is far above its
/// block's P2C re-draw bound (`3 ×` the median cost), and the control plane
/// published it **held**: the kernel counts it far above whatever the
/// bound, while `cost` comes from its recent and long memory of *mean*
/// latency instead of its peak (`ewma_ns` stays the estimate): the figure
/// it competes with once the backends within the bound are saturated
/// (`crate::p2c`'s `SATURATED_INFLIGHT`). A staller's peak memory holds its pause (250–300
/// ms) while its expected latency is a tenth of that; competing on the
/// peak left it nearly idle while the others queued.
pub const SCORE_FAR_ABOVE: u32 = 1;

/// Value of [`crate::BACKEND_SCORES_MAP`], written by the control plane.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendScore {
    /// Peak-EWMA latency estimate in nanoseconds.
    pub ewma_ns: u64,
    /// `ewma_ns * WEIGHT_SCALE / weight`, at least 1; the kernel multiplies it by
    /// `(inflight+1)^bias`.
    pub cost: u64,
    /// Effective weight (after slow start) used for `cost`.
    pub weight: u32,
    /// [`SCORE_FAR_ABOVE`] or 0. (Was padding: a program of an older build
    /// reads the same layout and ignores it.)
    pub flags: u32,
    /// Monotonic time (ns) of the write.
    pub updated_ns: u64,
}
assert_size!(BackendScore, 32);

/// Value of [`crate::BACKEND_CONNS_MAP`]: monotonic counters the kernel advances
/// with atomic adds. In-flight = opened - closed + correction, where the
/// correction ([`crate::BACKEND_CORRECTION_MAP`], a `u64` per backend) is
/// owned by the control plane: the connections it holds open to the backend
/// itself (health checks and latency probes), which occupy the backend like a
/// user's but never pass through the data path. (The kernel counts every end
/// of a user flow itself, eviction and idle expiry included, so nothing needs
/// subtracting.)
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendConns {
    pub opened: u64,
    pub closed: u64,
}
assert_size!(BackendConns, 16);

impl BackendConns {
    /// Connections currently open, the control plane's own included.
    pub const fn inflight(&self, correction: u64) -> u64 {
        self.opened
            .saturating_sub(self.closed)
            .saturating_add(correction)
    }
}

/// Value of [`crate::BACKEND_PENDING_MAP`] (array indexed by backend id):
/// the requests sent to the backend and not answered yet, and the sum of
/// their start times (`bpf_ktime_get_ns`), both advanced with atomic adds.
/// Together they give how long the pending requests have been served
/// ([`BackendPending::served_ns`]): between two backends with the same
/// count in flight, the one whose requests are further along frees a
/// worker sooner.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendPending {
    pub requests: u64,
    pub started_sum_ns: u64,
}
assert_size!(BackendPending, 16);

/// [`BackendPending::served_ns`] above this is not a sum of request ages
/// (about 146 years) but a count that went wrong: read as 0.
pub const PENDING_SERVED_MAX_NS: u64 = 1 << 62;

impl BackendPending {
    /// The pending requests' ages summed at `now`: `requests × now −
    /// started_sum_ns`. Computed modulo 2^64, which is exact whenever the
    /// true sum fits, even though `requests × now` alone may not; a result
    /// above [`PENDING_SERVED_MAX_NS`] (a start in the future, a torn pair
    /// of reads) counts as 0.
    #[inline(always)]
    pub const fn served_ns(&self, now: u64) -> u64 {
        let served = self
            .requests
            .wrapping_mul(now)
            .wrapping_sub(self.started_sum_ns);
        if self.requests == 0 || served > PENDING_SERVED_MAX_NS {
            0
        } else {
            served
        }
    }
}

/// Value of [`crate::BACKEND_PROGRESS_MAP`] (array indexed by backend id):
/// when the backend last answered a request and was last sent one
/// (`bpf_ktime_get_ns`). While its last request is not older than its last
/// answer, a request is outstanding, and `now - answered_ns` bounds the age
/// of the oldest unanswered one from below: a stalled server's age keeps
/// growing while its latency samples (which need an answer) say nothing.
///
/// Requests, not open flows: an open connection with nothing asked of it
/// (an idle keep-alive connection, a UDP flow already answered) waits for
/// nothing, and counting its silence as a stall excluded healthy backends
/// (the one answering most recently then took nearly every new flow).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendProgress {
    /// The last answer (a response's first payload after a request), or
    /// the request that found nothing outstanding: the clock of the oldest
    /// unanswered request starts there. 0: never.
    pub answered_ns: u64,
    /// The last request (a client payload that raised a flow's pending bit).
    pub requested_ns: u64,
}
assert_size!(BackendProgress, 16);

impl BackendProgress {
    /// Whether a request may be outstanding: one was sent, and none was
    /// answered after it.
    pub const fn awaiting(&self) -> bool {
        self.requested_ns != 0 && self.requested_ns >= self.answered_ns
    }

    /// The stamp stall ages count from while a request is outstanding
    /// (`p2c::Load::last_progress_ns`); 0 when none is.
    pub const fn stall_clock(&self) -> u64 {
        if self.awaiting() { self.answered_ns } else { 0 }
    }

    /// The `answered_ns` a new request sent at `now` leaves: `now` when
    /// none was outstanding (a quiet spell is no stall), else the same.
    pub const fn clock_on_request(&self, now: u64) -> u64 {
        if self.awaiting() {
            self.answered_ns
        } else {
            now
        }
    }

    /// The `answered_ns` that a client still sending at `now`, while its
    /// own request waits, leaves: the clock moved up to
    /// [`crate::p2c::STALL_AGE_CAP_NS`] before `now` if it was older,
    /// else the same. A client that keeps sending with nothing answered is
    /// one-way traffic (syslog, statsd, an upload only acknowledged), and
    /// its backend keeps the capped age; a client waiting on a paused
    /// server sends nothing more (TCP's window closes too), and a new
    /// request ([`BackendProgress::clock_on_request`]) moves nothing, so
    /// a paused server ages on.
    pub const fn clock_while_sending(&self, now: u64) -> u64 {
        if self.awaiting() && now.saturating_sub(self.answered_ns) > crate::p2c::STALL_AGE_CAP_NS {
            now - crate::p2c::STALL_AGE_CAP_NS
        } else {
            self.answered_ns
        }
    }
}

/// Value of [`crate::BACKEND_STATS_MAP`] (per-CPU array indexed by backend id).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendStats {
    pub packets_to_backend: u64,
    pub bytes_to_backend: u64,
    pub packets_from_backend: u64,
    pub bytes_from_backend: u64,
}
assert_size!(BackendStats, 32);

/// Key of [`crate::FLOWS_MAP`], IPv6's flow table (and the form every
/// flow key takes in the program before IPv4's is packed into a
/// [`FlowKeyV4`]): a 5-tuple as seen on the wire.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FlowKey {
    pub src: [u32; 4],
    pub dst: [u32; 4],
    /// Ports in network byte order.
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    pub family: u8,
    pub _pad: [u8; 2],
}
assert_size!(FlowKey, 40);

impl FlowKey {
    /// A 5-tuple key (IPv4 addresses in word 0, the rest zero; ports in
    /// network byte order).
    #[inline(always)]
    pub const fn new(
        family: u8,
        proto: u8,
        src: [u32; 4],
        dst: [u32; 4],
        sport: u16,
        dport: u16,
    ) -> Self {
        Self {
            src,
            dst,
            sport,
            dport,
            proto,
            family,
            _pad: [0; 2],
        }
    }
}

/// Key of [`crate::FLOWS4_MAP`], IPv4's flow table: the 5-tuple of
/// [`FlowKey`] in 16 bytes. The kernel hashes and compares a whole key on
/// every lookup, so the 24 bytes IPv4 leaves zero in a [`FlowKey`] cost
/// time on every packet (about 12 ns of an established packet's 30 ns
/// lookup on the VM of issue 9's stop 56).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FlowKeyV4 {
    pub src: u32,
    pub dst: u32,
    /// Ports in network byte order.
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    /// Padding, as two fields: a three-byte array of zeros became a
    /// `memset` call in the program.
    pub _pad: u8,
    pub _pad2: u16,
}
assert_size!(FlowKeyV4, 16);

impl FlowKeyV4 {
    /// The IPv4 `key` (addresses in word 0) in 16 bytes.
    #[inline(always)]
    pub const fn of(key: &FlowKey) -> Self {
        Self {
            src: key.src[0],
            dst: key.dst[0],
            sport: key.sport,
            dport: key.dport,
            proto: key.proto,
            _pad: 0,
            _pad2: 0,
        }
    }

    /// The [`FlowKey`] this key stands for.
    pub const fn widen(&self) -> FlowKey {
        FlowKey::new(
            crate::AF_INET,
            self.proto,
            [self.src, 0, 0, 0],
            [self.dst, 0, 0, 0],
            self.sport,
            self.dport,
        )
    }
}

/// [`FlowEntry::direction`]: client → VIP, rewritten towards the backend.
pub const DIR_TO_BACKEND: u8 = 0;
/// [`FlowEntry::direction`]: backend → SNAT address, rewritten towards the client.
pub const DIR_TO_CLIENT: u8 = 1;

/// TCP tracking states in [`FlowEntry::state`] (UDP flows are `ESTABLISHED`).
pub const FLOW_SYN_SENT: u8 = 1;
pub const FLOW_ESTABLISHED: u8 = 2;
pub const FLOW_CLOSING: u8 = 3;

/// [`FlowEntry::flags`]: the close was counted (set with an atomic OR, so a
/// flow is counted closed exactly once).
pub const FLOW_F_CLOSED: u32 = 1;
/// A client payload is waiting for the backend's first payload. Set in the
/// forward entry (with `request_ns`), and mirrored into the reply entry by
/// the CPU that set it there, so the reply path knows without looking the
/// forward entry up that a backend payload is a latency sample (see
/// lb-ebpf's `track::reply_needs_state`).
pub const FLOW_F_REQUEST_PENDING: u32 = 2;
/// The backend answered the SYN.
pub const FLOW_F_SYNACK_SEEN: u32 = 4;
/// The client sent a FIN. A TCP connection is closed once both FIN flags
/// are set (or on an RST), so a half-closed transfer stays in flight.
pub const FLOW_F_FIN_CLIENT: u32 = 8;
/// The backend sent a FIN.
pub const FLOW_F_FIN_BACKEND: u32 = 16;
/// Reply entries: the client's FIN was seen, and `created_ns` holds what
/// the backend's TIME_WAIT for this tuple expects
/// ([`crate::time_wait::TimeWaitView`]); with [`FLOW_F_TW_TS`] or
/// [`FLOW_F_TW_TS_UNKNOWN`], the state of its timestamp.
pub const FLOW_F_TW_SEEN: u32 = 32;
/// The client's FIN carried a timestamp (its TSval is in `created_ns`).
pub const FLOW_F_TW_TS: u32 = 64;
/// The client's FIN had options in a layout the data path does not know.
pub const FLOW_F_TW_TS_UNKNOWN: u32 = 128;
/// Entries of closed connections: one decider has claimed the entry; set
/// with an atomic OR, so only one acts on it. Reply entries: a new SYN
/// taking the tuple over, or the data path or the sweep freeing it.
/// Forward entries: a new SYN of the same client tuple replacing it, or
/// the sweep removing it.
pub const FLOW_F_TAKEN: u32 = 256;
/// Forward entries: the client's FIN came first (before the backend's):
/// the backend goes through LAST_ACK and ends with no TIME_WAIT, unless
/// the two FINs crossed, when it ends in TIME_WAIT after the client's ACK
/// of its FIN. Either way the client's last ACK is what the backend saw
/// last from it.
pub const FLOW_F_CLIENT_CLOSED_FIRST: u32 = 512;
/// Forward entries: the pending request is counted in its backend's
/// [`BackendPending`]. Set by the CPU that raised the request, cleared by
/// the one that takes it out again (answer or close): the two always pair,
/// and a request raised before the count existed (a program upgraded in
/// place) is never taken out of it.
pub const FLOW_F_PENDING_COUNTED: u32 = 1024;
/// Reply entries: the view in `created_ns` was recorded from a client FIN
/// that the backend has not acknowledged yet. Set with the view; cleared
/// when a backend segment acknowledges exactly the view's `rcv_nxt`. Until
/// then the tuple is not taken over inside its quarantine: a backend that
/// lost the FIN is still in FIN_WAIT2, not TIME_WAIT, and answers a new
/// SYN on the tuple with an ACK of the old connection (see
/// [`crate::time_wait`]).
pub const FLOW_F_TW_UNACKED: u32 = 2048;

/// Value of [`crate::FLOWS_MAP`] (a plain hash, not an LRU: nothing is
/// evicted behind the program's back; the kernel sweep, `lb_sweep`, removes
/// entries). Each connection has two entries: one keyed
/// by the client's 5-tuple ([`DIR_TO_BACKEND`]) and one keyed by the backend's
/// reply 5-tuple ([`DIR_TO_CLIENT`]). The fields give the rewrite to apply.
/// Connection state (flags, timestamps) lives in the `DIR_TO_BACKEND` entry;
/// the reply side finds it by swapping its rewrite fields into a key, only
/// for the packets that need it (see lb-ebpf's `track::reply_needs_state`).
///
/// Some fields mean different things in the two directions (the layout
/// stays 96 bytes, so a restarted or upgraded instance keeps adopting the
/// pinned table; entries written before these meanings existed read as
/// "nothing cached").
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowEntry {
    pub new_src: [u32; 4],
    pub new_dst: [u32; 4],
    pub new_sport: u16,
    pub new_dport: u16,
    pub backend_id: u32,
    pub vip_id: u32,
    pub direction: u8,
    pub state: u8,
    /// The IPv4 header checksum's change from this entry's key to its
    /// translation: the folded one's complement sum `~m + m'` over the
    /// address words (RFC 1624), which is the same for every packet of the
    /// flow, since each arrives with the key's addresses and leaves with
    /// the translation's. 0: not known yet. The general path stores it
    /// after the first whole datagram it translates by the entry (lb-ebpf's
    /// `nat::learn_deltas`); the fast path takes only entries that have it
    /// (with [`FlowEntry::csum_l4`]) and applies it without recomputing.
    /// Entries written before it existed read 0 and learn it at their next
    /// general packet. Unused (0) in IPv6 entries.
    pub csum_ip: u16,
    pub flags: u32,
    /// The low 32 bits of `jiffies` when a packet last compared the clock
    /// with `last_seen_ns` (lb-ebpf's `track::refresh_check_due`): bulk
    /// packets skip the clock until enough jiffies passed. Shares an 8-byte
    /// word with `flags`, whose atomic updates leave it alone. 0 in entries
    /// written before it existed (checked at the next packet).
    pub checked_jiffies: u32,
    /// Forward entries: when the connection was created. Reply entries:
    /// the same until the client's FIN, then what the backend's TIME_WAIT
    /// for the tuple expects ([`FLOW_F_TW_SEEN`],
    /// [`crate::time_wait::TimeWaitView::packed`]).
    pub created_ns: u64,
    /// Last activity (refreshed at most once a second): of the connection
    /// in a forward entry (both directions refresh it; the sweep's idle
    /// expiry reads it), of the backend's packets in a reply entry (each
    /// refresh there also refreshes the forward entry, so the forward
    /// entry's lags the backend's last packet by under two seconds). Once
    /// [`FLOW_F_CLOSED`] is set it is the time of the close and no longer
    /// moves: a closed forward entry lingers `closed_linger_ns` from it, and
    /// a closed reply entry keeps its SNAT tuple quarantined
    /// `snat_quarantine_ns` from it.
    pub last_seen_ns: u64,
    /// [`DIR_TO_BACKEND`] entries: time of the client payload awaiting a
    /// response (0 = none). [`DIR_TO_CLIENT`] entries: the MAC of the next
    /// hop towards the client that the data path cached, in the field's
    /// first six bytes (memory order; see [`FlowEntry::reply_hop`]), valid
    /// while `hop_ifindex` is not 0.
    pub request_ns: u64,
    /// [`DIR_TO_CLIENT`] entries: the source MAC of the client's frames and
    /// the interface they arrived on, learned when the flow is created. The
    /// reply goes there when neither `bpf_fib_lookup` nor the neighbour map
    /// knows the client (clients are not known to the control plane).
    /// [`DIR_TO_BACKEND`] entries: the next hop towards the backend (MAC and
    /// interface, 0 = none) cached by the data path when it sends the frame
    /// back out of the ingress interface, dropped once a second.
    pub client_mac: [u8; 6],
    /// The TCP/UDP checksum's change from the key to the translation, over
    /// the addresses (the pseudo header) and the ports, kept like
    /// [`FlowEntry::csum_ip`] (0: not known yet). A fold is 0 only when
    /// every term is: every old word 0xffff and every new one 0, which no
    /// translation does (such an entry would just stay on the general path).
    pub csum_l4: u16,
    pub client_ifindex: u32,
    /// [`DIR_TO_CLIENT`] entries: the interface of the next hop towards the
    /// client cached by the data path (0 = none; its MAC is in
    /// `request_ns`), set when the frame went back out of the ingress
    /// interface and dropped once a second, like a forward entry's.
    /// [`DIR_TO_BACKEND`] entries: 0.
    pub hop_ifindex: u32,
}
assert_size!(FlowEntry, 96);

impl FlowEntry {
    /// A [`DIR_TO_CLIENT`] entry's cached next hop towards the client: its
    /// MAC and interface (interface 0: none cached).
    pub const fn reply_hop(&self) -> ([u8; 6], u32) {
        let b = self.request_ns.to_ne_bytes();
        ([b[0], b[1], b[2], b[3], b[4], b[5]], self.hop_ifindex)
    }
}

/// Key of [`crate::FRAGMENTS_MAP`]: one fragmented datagram as it arrives
/// (before translation), as RFC 791 and RFC 8200 identify it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FragKey {
    pub src: [u32; 4],
    pub dst: [u32; 4],
    /// The IPv4 identification (16 bits) or the IPv6 fragment header's
    /// identification, in network byte order as a `u32` of memory bytes.
    pub id: u32,
    pub proto: u8,
    pub family: u8,
    pub _pad: [u8; 2],
}
assert_size!(FragKey, 40);

/// Value of [`crate::FRAGMENTS_MAP`]: the ports of the datagram's first
/// fragment (network byte order), which its later fragments lack. With
/// them a later fragment finds its flow entry and gets the same
/// translation.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FragPorts {
    pub sport: u16,
    pub dport: u16,
}
assert_size!(FragPorts, 4);

/// Key of [`crate::NEIGHBOURS_MAP`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct IpKey {
    pub addr: [u32; 4],
    pub family: u8,
    pub _pad: [u8; 3],
}
assert_size!(IpKey, 20);

/// Value of [`crate::NEIGHBOURS_MAP`]: a next hop the control plane resolved,
/// used when `bpf_fib_lookup` has no neighbour entry.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Neighbour {
    pub mac: [u8; 6],
    pub _pad: [u8; 2],
    pub ifindex: u32,
}
assert_size!(Neighbour, 12);

/// Value of [`crate::BACKEND_HOPS_MAP`] (per CPU, indexed by backend id):
/// the next hop a flow to the backend last resolved on this CPU, so new
/// flows within `BACKEND_HOP_JIFFIES` of it skip the FIB lookup. Written
/// by the data path; the control plane only zeroes a backend's values (on
/// every CPU) when the backend's neighbour entry changes or goes, so new
/// flows do not keep the old MAC. `ifindex` 0 holds nothing.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendHop {
    /// The backend address the hop was resolved for (an id can be reused).
    pub dst: [u32; 4],
    pub mac: [u8; 6],
    pub _pad: [u8; 2],
    /// The interface the frames left by: always the ingress one (XDP_TX).
    pub ifindex: u32,
    /// `bpf_jiffies64` (low 32 bits) at the resolution.
    pub jiffies: u32,
}
assert_size!(BackendHop, 32);

/// How many jiffies a [`BackendHop`] serves new flows before the next one
/// resolves it again: 100 ms at HZ=1000, 400 ms at HZ=250, so a changed
/// neighbour reaches new flows within the second that a flow's own cached
/// hop takes.
pub const BACKEND_HOP_JIFFIES: u32 = 100;

/// [`LbConfig::flags`]: configuration has been written and the program may balance.
pub const CONFIG_F_READY: u32 = 1;
/// A new SYN may take over a SNAT tuple in quarantine when the backend's
/// TIME_WAIT would accept it (`--snat-time-wait-reuse`, see
/// [`crate::time_wait`]).
pub const CONFIG_F_TIME_WAIT_REUSE: u32 = 2;

/// Single entry of [`crate::CONFIG_MAP`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LbConfig {
    /// SNAT source address for IPv4 flows (word 0).
    pub snat_v4: [u32; 4],
    /// SNAT source address for IPv6 flows.
    pub snat_v6: [u32; 4],
    /// SNAT port range, host byte order, inclusive.
    pub snat_port_min: u16,
    pub snat_port_max: u16,
    pub flags: u32,
    /// Interface the program is attached to.
    pub ifindex: u32,
    /// Addresses in the IPv4 and IPv6 SNAT pools ([`crate::SNAT_ADDRS_MAP`]
    /// slots `0..v4_count` and `MAX_SNAT_ADDRS..MAX_SNAT_ADDRS+v6_count`).
    /// `snat_v4`/`snat_v6` above are each pool's first address.
    pub snat_v4_count: u16,
    pub snat_v6_count: u16,
    /// Possible CPUs: the SNAT tuple space of a backend is split into this
    /// many interleaved slices, one per CPU (0 counts as 1).
    pub cpus: u32,
    pub _pad: u32,
    /// Idle timeouts the kernel sweep applies to open flows.
    pub tcp_idle_ns: u64,
    pub udp_idle_ns: u64,
    /// A TCP SYN without SYN-ACK for this long is closed as refused.
    pub syn_timeout_ns: u64,
    /// A closed forward entry stays this long after the close, so late
    /// segments of the close are still translated.
    pub closed_linger_ns: u64,
    /// A freed SNAT tuple (closed reply entry) stays reserved this long
    /// after the close: the backend's TIME_WAIT plus slack.
    pub snat_quarantine_ns: u64,
}
assert_size!(LbConfig, 96);

/// Value of [`crate::SNAT_ADDRS_MAP`]: one SNAT pool address (network byte
/// order words, IPv4 in word 0).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SnatAddr {
    pub addr: [u32; 4],
}
assert_size!(SnatAddr, 16);

/// Value of [`crate::SWEEP_STATS_MAP`] (one entry, written only by the
/// sweep program, which the control plane runs one pass at a time).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SweepStats {
    /// Sweeps run.
    pub runs: u64,
    /// Entries (both directions) the last sweep walked.
    pub entries: u64,
    /// Open flows closed for idleness, and UDP flows closed because their
    /// backend is down (monotonic).
    pub expired_idle: u64,
    /// TCP flows closed because the SYN got no SYN-ACK in time.
    pub expired_syn: u64,
    /// Lone entries found (a reply whose forward entry is gone or belongs to
    /// another connection, or a forward entry without its reply); each is
    /// closed, and its SNAT tuple quarantined and then freed.
    pub orphans: u64,
    /// Entries removed (closed ones past their linger or quarantine, and
    /// expired ones).
    pub removed: u64,
    /// SNAT tuples freed after their quarantine.
    pub snat_freed: u64,
    /// Time the last sweep ran.
    pub last_run_ns: u64,
}
assert_size!(SweepStats, 64);

/// Single entry of [`crate::NEW_FLOW_LIMIT_MAP`]: the cap on new flows,
/// per CPU (each CPU has its own token bucket, so no atomics are needed).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NewFlowLimit {
    /// New flows per second each CPU may create (0: no cap).
    pub rate_per_cpu: u32,
    /// Bucket depth: flows a CPU may create at once after a quiet spell.
    pub burst: u32,
}
assert_size!(NewFlowLimit, 8);

/// Value of [`crate::NEW_FLOW_BUCKETS_MAP`] (per-CPU): a token bucket.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TokenBucket {
    /// Tokens × 10^9 (one flow costs 10^9), so refills need no division.
    pub nano_tokens: u64,
    /// Time of the last refill (`bpf_ktime_get_ns`).
    pub last_ns: u64,
}
assert_size!(TokenBucket, 16);

/// Value of [`crate::BACKEND_LATENCY_MAP`] (per-CPU array indexed by backend
/// id): latency samples (client payload → the backend's first payload
/// after it) aggregated in the kernel instead of one ring event each. `sum`
/// and `count` only grow; `peak` is the largest sample of epoch
/// `peak_epoch` (the control plane advances [`crate::LATENCY_EPOCH_MAP`] at
/// every score tick, so each tick's peak still feeds Peak-EWMA's jump).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LatencyAgg {
    pub sum_ns: u64,
    pub count: u64,
    pub peak_ns: u64,
    pub peak_epoch: u64,
}
assert_size!(LatencyAgg, 32);

/// Ring-buffer event kinds ([`FlowEvent::kind`]). The data path sends
/// only what needs a reaction from the control plane: [`EVENT_REFUSED`]
/// (an RST to the SYN, or no SYN-ACK within the SYN timeout) and
/// [`EVENT_CLOSED`] with [`CLOSE_BACKEND_RST`]. Opens and closes are kernel
/// counters ([`BackendConns`]), latency samples are aggregated
/// ([`LatencyAgg`]); `EVENT_OPENED` and `EVENT_RESPONDED` stay defined
/// for decoding but are no longer sent.
pub const EVENT_OPENED: u8 = 1;
/// `value_ns` is the latency from a client payload to the backend's first payload after it.
pub const EVENT_RESPONDED: u8 = 2;
pub const EVENT_CLOSED: u8 = 3;
/// An RST answered the SYN.
pub const EVENT_REFUSED: u8 = 4;

/// [`FlowEvent::reason`] for `EVENT_CLOSED`.
pub const CLOSE_FIN: u8 = 1;
pub const CLOSE_RST: u8 = 2;
pub const CLOSE_IDLE: u8 = 3;
/// The backend reset an established connection (an outlier signal; an RST
/// from the client stays [`CLOSE_RST`]).
pub const CLOSE_BACKEND_RST: u8 = 4;

/// One flow state change, sent on [`crate::EVENTS_MAP`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowEvent {
    /// Monotonic time of the event (`bpf_ktime_get_ns`).
    pub timestamp_ns: u64,
    /// Latency sample for `EVENT_RESPONDED`, otherwise 0.
    pub value_ns: u64,
    pub backend_id: u32,
    pub vip_id: u32,
    pub kind: u8,
    pub reason: u8,
    pub _pad: [u8; 6],
}
assert_size!(FlowEvent, 32);

/// Indexes of [`crate::REASON_STATS_MAP`], a per-CPU array of `u64` counters:
/// every verdict the program gives is counted under exactly one reason.
pub mod reason {
    /// Not IPv4/IPv6 (ARP, LLDP, ...).
    pub const PASS_NOT_IP: u32 = 0;
    /// IP, but neither TCP nor UDP.
    pub const PASS_NOT_L4: u32 = 1;
    /// TCP/UDP that is neither VIP traffic nor a reply of a balanced flow.
    pub const PASS_NOT_VIP: u32 = 2;
    /// IPv4 or IPv6 fragment (only the first fragment carries ports).
    pub const PASS_FRAGMENT: u32 = 3;
    /// IPv6 with more extension headers than the data path walks
    /// (`MAX_IPV6_EXT_HEADERS` in lb-ebpf).
    pub const PASS_IPV6_EXT_LIMIT: u32 = 4;
    /// Rewritten and sent back out of the same interface.
    pub const TX_TO_BACKEND: u32 = 5;
    pub const TX_TO_CLIENT: u32 = 6;
    /// Rewritten and redirected to another interface.
    pub const REDIRECT: u32 = 7;
    /// Frame shorter than the headers it claims.
    pub const DROP_TRUNCATED: u32 = 8;
    /// Bad IHL, TCP data offset or IP version.
    pub const DROP_BAD_HEADER: u32 = 9;
    /// VIP with no selectable backend.
    pub const DROP_NO_BACKEND: u32 = 10;
    /// No free SNAT tuple after [`crate::SNAT_PORT_TRIES`] steps of the
    /// CPU's cursor.
    pub const DROP_SNAT_EXHAUSTED: u32 = 11;
    /// No next-hop MAC for the destination.
    pub const DROP_NO_NEIGHBOUR: u32 = 12;
    /// The flow table refused an insert (full: it is a plain hash, so a
    /// full table refuses new flows instead of evicting live ones).
    pub const DROP_FLOW_INSERT: u32 = 13;
    /// TCP packet other than SYN to a VIP with no flow.
    pub const DROP_NO_FLOW: u32 = 14;
    /// Configuration missing or inconsistent (e.g. a slot pointing nowhere).
    pub const DROP_BAD_CONFIG: u32 = 15;
    /// TTL expired: handed to the kernel so it can send ICMP time exceeded.
    pub const PASS_TTL_EXPIRED: u32 = 16;
    /// Ring-buffer reservation failed (event lost, packet still forwarded).
    pub const EVENT_LOST: u32 = 17;
    /// A new flow refused by the new-connection rate cap
    /// ([`crate::NEW_FLOW_LIMIT_MAP`]), so a SYN flood cannot churn the
    /// flow table.
    pub const DROP_NEW_FLOW_RATE: u32 = 18;
    /// ICMP that is not an error about a balanced flow: echo to a VIP (the
    /// kernel answers it, the VIP being an address of the interface), other
    /// types, and errors quoting a packet of no flow.
    pub const PASS_ICMP: u32 = 19;
    /// A TCP/UDP packet to a SNAT pool address, port in the SNAT range,
    /// with no flow (a backend's late reply after the flow ended, or a
    /// stray): dropped, so it never reaches the host's sockets (which would
    /// answer it with an RST). Also a late reply of a closed connection
    /// whose client tuple a newer connection took: it would land in that
    /// one. (Counted here rather than under a reason of its own so that the
    /// reason counters keep their length, which a live upgrade requires.)
    pub const DROP_SNAT_NO_FLOW: u32 = 20;
    /// Number of reasons (size of the map).
    pub const COUNT: u32 = 21;

    /// Names used by `status` and metrics, indexed by reason.
    pub const NAMES: [&str; COUNT as usize] = [
        "pass_not_ip",
        "pass_not_l4",
        "pass_not_vip",
        "pass_fragment",
        "pass_ipv6_ext_limit",
        "tx_to_backend",
        "tx_to_client",
        "redirect",
        "drop_truncated",
        "drop_bad_header",
        "drop_no_backend",
        "drop_snat_exhausted",
        "drop_no_neighbour",
        "drop_flow_insert",
        "drop_no_flow",
        "drop_bad_config",
        "pass_ttl_expired",
        "event_lost",
        "drop_new_flow_rate",
        "pass_icmp",
        "drop_snat_no_flow",
    ];
}

pod!(
    VipKey,
    VipMeta,
    VipState,
    VipTables,
    Backend,
    BackendScore,
    BackendConns,
    BackendProgress,
    BackendPending,
    BackendStats,
    FlowKey,
    FlowKeyV4,
    FragKey,
    FragPorts,
    FlowEntry,
    IpKey,
    Neighbour,
    BackendHop,
    LbConfig,
    FlowEvent,
    NewFlowLimit,
    TokenBucket,
    SnatAddr,
    SweepStats,
    LatencyAgg,
    ZoneBlock,
    VipZones,
);

#[cfg(test)]
mod pending_tests {
    use super::*;

    #[test]
    fn served_is_the_sum_of_the_pending_ages_even_where_the_product_overflows() {
        // Two requests started 3 ms and 9 ms before `now`, on a clock far
        // enough along that requests × now does not fit in 64 bits.
        let now = u64::MAX / 2 + 12_345;
        let pending = BackendPending {
            requests: 2,
            started_sum_ns: (now - 3_000_000).wrapping_add(now - 9_000_000),
        };
        assert_eq!(pending.served_ns(now), 12_000_000);
    }

    #[test]
    fn nothing_pending_or_a_count_gone_wrong_serves_nothing() {
        assert_eq!(BackendPending::default().served_ns(1_000), 0);
        // Starts after `now` (the count lost a request's end): negative.
        let ahead = BackendPending {
            requests: 1,
            started_sum_ns: 2_000,
        };
        assert_eq!(ahead.served_ns(1_000), 0);
        // A sum with no requests left (a start taken out twice).
        let stale = BackendPending {
            requests: 0,
            started_sum_ns: 5,
        };
        assert_eq!(stale.served_ns(1_000), 0);
    }
}

#[cfg(test)]
mod progress_tests {
    use super::BackendProgress;
    use crate::p2c::STALL_AGE_CAP_NS;

    const SEC: u64 = 1_000_000_000;

    #[test]
    fn a_request_starts_or_keeps_the_stall_clock_and_a_sender_caps_it() {
        let now = 4_000 * SEC;
        // Nothing outstanding: a request starts the clock now; a sender
        // (whose request an answer already cleared) moves nothing.
        let answered = BackendProgress {
            answered_ns: now - 5 * SEC,
            requested_ns: now - 6 * SEC,
        };
        assert_eq!(answered.clock_on_request(now), now);
        assert_eq!(answered.clock_while_sending(now), now - 5 * SEC);
        assert_eq!(BackendProgress::default().clock_on_request(now), now);
        // Outstanding for less than the cap: kept by both.
        let waiting = BackendProgress {
            answered_ns: now - 3 * SEC,
            requested_ns: now - SEC,
        };
        assert_eq!(waiting.clock_on_request(now), now - 3 * SEC);
        assert_eq!(waiting.clock_while_sending(now), now - 3 * SEC);
        // Never answered for an hour: a new request keeps the hour (a
        // paused server); a client still sending moves it up to the cap
        // (one-way traffic).
        let one_way = BackendProgress {
            answered_ns: now - 3_600 * SEC,
            requested_ns: now - SEC,
        };
        assert_eq!(one_way.clock_on_request(now), now - 3_600 * SEC);
        assert_eq!(one_way.clock_while_sending(now), now - STALL_AGE_CAP_NS);
        let at_cap = BackendProgress {
            answered_ns: now - STALL_AGE_CAP_NS,
            requested_ns: now - SEC,
        };
        assert_eq!(at_cap.clock_while_sending(now), now - STALL_AGE_CAP_NS);
    }
}
