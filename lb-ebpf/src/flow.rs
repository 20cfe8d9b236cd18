//! The flow table: two entries per connection, keyed by the 5-tuple seen on
//! the wire in each direction (see `lb_common::FlowEntry`).
use core::num::{NonZeroU32, NonZeroU64};

use aya_ebpf::{
    bindings::{BPF_ANY, BPF_EXIST, BPF_NOEXIST},
    helpers::bpf_get_smp_processor_id,
};
use lb_common::{
    AF_INET6, DIR_TO_BACKEND, DIR_TO_CLIENT, FLOW_ESTABLISHED, FLOW_F_CLOSED, FLOW_F_TAKEN,
    FLOW_F_TW_SEEN, FLOW_F_TW_TS, FLOW_F_TW_TS_UNKNOWN, FLOW_F_TW_UNACKED, FLOW_SYN_SENT,
    FlowEntry, FlowKey, FlowKeyV4, LbConfig, MAX_SNAT_ADDRS, Reason, SNAT_PORT_TRIES,
    SNAT_REUSE_TRIES, SNAT_STEAL_TRIES, reason,
    time_wait::{TS_ABSENT, TS_PRESENT, TS_UNKNOWN, TimeWaitView, TsOption, accepts_syn},
};

use crate::{
    atomic::{Flags, add_u64},
    backend_hop,
    helpers::jiffies,
    maps::{BACKEND_SNAT_USED, FLOW_KEY4, FLOWS, FLOWS4, SNAT_ADDRS, SNAT_CURSORS},
    packet::{Mac, Packet, load_addr, load_mac, store_mac},
    select::Chosen,
};

/// `-EEXIST` from a `BPF_NOEXIST` insert: the SNAT port is taken.
const EEXIST: i32 = -17;

/// Where the client's frames came from: the next hop back to the client.
/// Interface 0 stands for "none": a plain value rather than an `Option`,
/// whose `None` LLVM passed on with an undefined payload register (the
/// debug build's reply path failed verification with `R1 !read_ok`).
#[derive(Clone, Copy)]
pub struct ReturnPath {
    pub mac: Mac,
    pub ifindex: u32,
}

impl ReturnPath {
    /// No learned return path (towards a backend).
    pub const NONE: Self = Self {
        mac: [0; 6],
        ifindex: 0,
    };

    /// The return path stored in a reply entry (interface 0: none).
    #[inline(always)]
    pub fn of(entry: *const FlowEntry) -> Self {
        // SAFETY: live map value; written only when the entry is created.
        let (mac, ifindex) = unsafe { ((*entry).client_mac, (*entry).client_ifindex) };
        Self { mac, ifindex }
    }
}

/// What an entry says to do with a packet, copied out of the map value so
/// no reference to it is held while other CPUs update its flags.
#[derive(Clone, Copy)]
pub struct Translation {
    pub src: [u32; 4],
    pub dst: [u32; 4],
    /// Network byte order.
    pub sport: u16,
    pub dport: u16,
    pub backend_id: u32,
}

impl Translation {
    #[inline(always)]
    pub fn of(entry: *const FlowEntry) -> Self {
        // SAFETY: `entry` is a live map value; these fields are written only
        // when the entry is created.
        unsafe {
            Self {
                src: (*entry).new_src,
                dst: (*entry).new_dst,
                sport: (*entry).new_sport,
                dport: (*entry).new_dport,
                backend_id: (*entry).backend_id,
            }
        }
    }

    /// [`Translation::of`] an IPv4 entry: only the addresses' first words
    /// are read (the others are zero in an IPv4 entry), so the fast path's
    /// IPv4 function holds two address registers, not eight.
    #[inline(always)]
    pub fn of_ipv4(entry: *const FlowEntry) -> Self {
        // SAFETY: as in `of`.
        unsafe {
            Self {
                src: [(*entry).new_src[0], 0, 0, 0],
                dst: [(*entry).new_dst[0], 0, 0, 0],
                sport: (*entry).new_sport,
                dport: (*entry).new_dport,
                backend_id: (*entry).backend_id,
            }
        }
    }

    /// The key of the rewritten packets seen coming back: the other
    /// direction's entry of the same connection (same family and protocol:
    /// the balancer never translates between IPv4 and IPv6).
    #[inline(always)]
    pub fn opposite_key(&self, pkt: &Packet) -> FlowKey {
        FlowKey::new(
            pkt.family, pkt.proto, self.dst, self.src, self.dport, self.sport,
        )
    }

    /// [`Translation::opposite_key`] for the entry stored under `own`.
    #[inline(always)]
    pub fn opposite_key_of(&self, own: &FlowKey) -> FlowKey {
        FlowKey::new(
            own.family, own.proto, self.dst, self.src, self.dport, self.sport,
        )
    }
}

/// Whether the forward entry `fwd` rewrites client packets into the tuple
/// the backend packet `pkt` answers: its SNAT address and port, towards
/// the backend that sent it. The backend counts: tuples are handed out
/// per backend, so a newer connection of the same client tuple may hold
/// the same SNAT address and port towards another backend, and a late
/// packet of the old backend must not land in it. Reads the fields in
/// place: a copied `Translation` here pushed the debug build's reply path
/// over the 512-byte stack.
#[inline(always)]
pub fn translates_to(fwd: *const FlowEntry, pkt: &Packet) -> bool {
    // SAFETY: live map value; written only when the entry is created.
    unsafe {
        (*fwd).new_sport == pkt.dport
            && (*fwd).new_dport == pkt.sport
            && (*fwd).new_src == pkt.daddr
            && (*fwd).new_dst == pkt.saddr
    }
}

/// The entry under `key` in the flow table of the family `V6` says
/// (IPv6: [`FLOWS`]; IPv4: [`FLOWS4`], under the key packed in 16 bytes,
/// see [`packed`]). Every flow-table operation takes the family as a
/// constant of the code: chosen by the key's family byte on the stack,
/// which the verifier does not track, each operation was a branch it
/// walked both ways, with the rest of the path after each
/// (docs/history/dataplane.md, stop 28). `key` must be of that family.
#[inline(always)]
pub fn lookup<const V6: bool>(key: &FlowKey) -> Option<*mut FlowEntry> {
    if V6 {
        FLOWS.get_ptr_mut(key)
    } else {
        FLOWS4.get_ptr_mut(packed(key)?)
    }
}

/// [`lookup`] with IPv4's packed key on the stack: the fast path's, whose
/// frame has room for it (and which saves the slot's stores), and the
/// sweep's, which must not use the slot at all (see [`remove_on_stack`]).
#[inline(always)]
pub fn lookup_on_stack<const V6: bool>(key: &FlowKey) -> Option<*mut FlowEntry> {
    if V6 {
        lookup::<true>(key)
    } else {
        FLOWS4.get_ptr_mut(&FlowKeyV4::of(key))
    }
}

/// [`remove`] with IPv4's packed key on the stack, for the sweep: it runs
/// from user space (`BPF_PROG_TEST_RUN`) in process context with only
/// migration disabled, so a NIC interrupt on its CPU can run `lb_xdp` in
/// the softirq on the way out, between the sweep's write of the
/// [`FLOW_KEY4`] slot and the helper's read of it. The key the helper
/// then reads is the packet's: the sweep would remove (or find) another
/// connection's entry, and leave the one it claimed in the table for good.
#[inline(always)]
pub fn remove_on_stack<const V6: bool>(key: &FlowKey) -> bool {
    if V6 {
        remove::<true>(key)
    } else {
        FLOWS4.remove(&FlowKeyV4::of(key)).is_ok()
    }
}

/// The IPv4 `key` packed in this CPU's [`FLOW_KEY4`] slot, for a map
/// helper to read from there: the general pipeline's frames are in call
/// chains at the 512-byte stack limit (`lb_xdp`, a family's pipeline,
/// `lb_new_flow`), and 16 more bytes of a packed key in each pushed one
/// over it. Valid until the next call of this function on this CPU; each
/// caller hands it to one helper call at once. Only for programs that run
/// in the softirq with the packet (XDP): the sweep, run from user space,
/// can be interrupted by one and uses [`lookup_on_stack`] and
/// [`remove_on_stack`].
#[inline(always)]
fn packed(key: &FlowKey) -> Option<&'static FlowKeyV4> {
    let slot = FLOW_KEY4.get_ptr_mut(0)?;
    // Read through a pointer LLVM cannot see into: otherwise it keeps
    // these loads for the caller's later uses of the same fields, spilled
    // to the caller's frame (the very stack this slot is there to spare).
    let key = core::hint::black_box(key);
    // SAFETY: this CPU's own copy of a per-CPU map value (XDP runs with
    // preemption off); written field by field (a copy of a whole key from
    // the stack could become a `memcpy` call).
    unsafe {
        (&raw mut (*slot).src).write(key.src[0]);
        (&raw mut (*slot).dst).write(key.dst[0]);
        (&raw mut (*slot).sport).write(key.sport);
        (&raw mut (*slot).dport).write(key.dport);
        (&raw mut (*slot).proto).write(key.proto);
        (&raw mut (*slot)._pad).write(0);
        (&raw mut (*slot)._pad2).write(0);
        Some(&*slot)
    }
}

/// Inserts `entry` under `key` (`BPF_*` `flags`) in the family's table
/// (see [`lookup`]); the helper's error code.
#[allow(
    clippy::needless_borrows_for_generic_args,
    reason = "the 96-byte entry is passed by reference; by value it would be copied on the 512-byte stack"
)]
#[inline(always)]
pub fn insert<const V6: bool>(key: &FlowKey, entry: &FlowEntry, flags: u64) -> Result<(), i32> {
    if V6 {
        FLOWS.insert(key, entry, flags)
    } else {
        let Some(key) = packed(key) else {
            return Err(-1);
        };
        FLOWS4.insert(key, entry, flags)
    }
}

/// Removes the entry under `key` from the family's table (see [`lookup`]);
/// whether there was one.
#[inline(always)]
pub fn remove<const V6: bool>(key: &FlowKey) -> bool {
    if V6 {
        FLOWS.remove(key).is_ok()
    } else {
        packed(key).is_some_and(|key| FLOWS4.remove(key).is_ok())
    }
}

/// Creates both entries of a new connection from the client packet `pkt`
/// (which arrived by `client`) to `backend`, picking a free SNAT tuple: the
/// reply entry claims the tuple, then the forward entry is written.
///
/// `syn`: the SYN's sequence number and timestamp ([`TsOption::UNKNOWN`]
/// for any other packet, and with time-wait reuse off: no backend's
/// TIME_WAIT is then taken to accept it). `how` says where the tuple comes
/// from ([`TupleSource`]); each caller passes a constant. The forward entry
/// starts with the backend's shared next hop cached, if that is fresh
/// ([`backend_hop::fresh`]).
#[inline(always)]
pub fn create<const V6: bool>(
    pkt: &Packet,
    client: ReturnPath,
    cfg: &LbConfig,
    vip_id: u32,
    backend: &Chosen,
    now: u64,
    syn: Syn,
    how: TupleSource,
) -> Result<(), Reason> {
    let snat = Snat::of(cfg, pkt, backend)?;
    // One 96-byte entry, filled as the reply entry and then turned into
    // the forward one: two would not fit the 512-byte stack next to the rest.
    let mut entry = reply_entry(pkt, client, vip_id, backend.id, now);
    let taken_over = match how {
        TupleSource::Claim => claim_snat_tuple::<V6>(pkt, backend, &snat, &mut entry, syn)?,
        TupleSource::TakeOver => {
            take_over_tuple::<V6>(pkt, backend, &snat, &mut entry, syn)?;
            true
        }
    };
    // Looked up only now: a hop found before the claim doubled the states
    // the verifier walked it in (found or not), about 80k instructions.
    if let Some(hop) = backend_hop::fresh(backend, client.ifindex, entry.checked_jiffies) {
        // The forward entry's hop cache (see `nexthop::HopCache`).
        // SAFETY: a live map value and the stack; see `packet::store_mac`.
        unsafe { store_mac(&raw mut entry.client_mac, load_mac(&hop.mac)) };
        entry.client_ifindex = hop.ifindex;
    }
    insert_forward::<V6>(pkt, &entry, taken_over)
}

/// A new connection's first packet as a backend's TIME_WAIT would judge
/// it: the SYN's sequence number (host byte order) and timestamp option.
/// Any other packet, or a SYN while time-wait reuse is off, carries
/// [`TsOption::UNKNOWN`], which `lb_common::time_wait::accepts_syn` never
/// accepts: such a flow only ever takes a tuple whose quarantine is over.
#[derive(Clone, Copy)]
pub struct Syn {
    pub seq: u32,
    pub ts: TsOption,
}

/// Where [`create`] takes the new connection's SNAT tuple from.
#[derive(Clone, Copy)]
pub enum TupleSource {
    /// A free tuple at this CPU's cursor (or the closed one there that
    /// [`may_take_over`] allows), stepping on ([`claim_snat_tuple`]).
    Claim,
    /// For a SYN whose claim found none: a closed tuple among the ones
    /// this CPU handed out longest ago ([`take_over_tuple`]).
    TakeOver,
}

/// Where new flows' source tuples come from: the SNAT pool of the packet's
/// family and the port range, seen as one tuple space per backend of
/// `addrs × span` tuples (the reply key holds the backend, so the same
/// address and port serve every backend at once).
///
/// Allocation is O(1): the space is cut into `cpus` interleaved slices (CPU
/// `c` owns the tuples `c, c + cpus, c + 2·cpus, …`) and each CPU walks its
/// own slice of each backend with a cursor. A tuple the cursor reaches was
/// last handed out by this CPU one full turn ago, so it is free unless its
/// connection is still open or in quarantine; the cursor then steps on, at
/// most `SNAT_PORT_TRIES` times. Only when those are all in use does a CPU
/// take from another CPU's slice (`SNAT_STEAL_TRIES` positions): SYNs are
/// not always spread over CPUs. Every step is a `BPF_NOEXIST` insert into
/// the non-LRU flow table, which never evicts anything, so a CPU that meets
/// a tuple another took just steps on.
struct Snat {
    /// First slot of the family's pool in `SNAT_ADDRS`.
    base: u32,
    port_min: u16,
    /// Ports in the range, 1..=65536. The divisors are `NonZero`, so no
    /// division-by-zero panic path (which the verifier rejects) exists.
    span: NonZeroU32,
    /// Tuples in this CPU's slice.
    slice: NonZeroU64,
    /// Slices (CPUs) and this CPU's slice.
    cpus: u32,
    cpu: u32,
    /// How long a closed connection's tuple stays out of use.
    quarantine_ns: u64,
}

impl Snat {
    /// The configured SNAT pool and range, if they can serve `pkt`'s
    /// family towards `backend`.
    #[inline(always)]
    fn of(cfg: &LbConfig, pkt: &Packet, backend: &Chosen) -> Result<Self, Reason> {
        let (min, max) = (cfg.snat_port_min, cfg.snat_port_max);
        if min > max || backend.family != pkt.family {
            return Err(reason::DROP_BAD_CONFIG);
        }
        let (base, addrs) = if pkt.family == AF_INET6 {
            (MAX_SNAT_ADDRS, u32::from(cfg.snat_v6_count))
        } else {
            (0, u32::from(cfg.snat_v4_count))
        };
        if addrs == 0 || addrs > MAX_SNAT_ADDRS {
            return Err(reason::DROP_BAD_CONFIG);
        }
        let span = NonZeroU32::new(u32::from(max - min) + 1).ok_or(reason::DROP_BAD_CONFIG)?;
        // At most 64 × 65536 = 2^22 tuples: no overflow.
        let total = addrs * span.get();
        let cpus = match NonZeroU32::new(cfg.cpus) {
            Some(cpus) if cpus.get() <= total => cpus,
            _ => NonZeroU32::MIN,
        };
        // SAFETY: helper without arguments.
        let cpu = unsafe { bpf_get_smp_processor_id() } % cpus;
        let slice = NonZeroU64::new(u64::from(total / cpus)).ok_or(reason::DROP_BAD_CONFIG)?;
        Ok(Self {
            base,
            port_min: min,
            span,
            slice,
            cpus: cpus.get(),
            cpu,
            quarantine_ns: cfg.snat_quarantine_ns,
        })
    }

    /// The tuple at position `step` of this CPU's slice: its address's
    /// slot in `SNAT_ADDRS` and its port (network byte order).
    #[inline(always)]
    fn tuple(&self, step: u64) -> (u32, u16) {
        self.tuple_in(self.cpu, step)
    }

    /// The tuple at position `step` of CPU `owner`'s slice (`owner` <
    /// `cpus`).
    #[inline(always)]
    fn tuple_in(&self, owner: u32, step: u64) -> (u32, u16) {
        // owner < cpus and the remainder < slice, so index < cpus × slice ≤ total.
        let index = owner + self.cpus * (step % self.slice) as u32;
        let port = (u32::from(self.port_min) + index % self.span) as u16;
        (self.base + index / self.span, port.to_be())
    }

    /// The tuple of try `i` of a claim: this CPU's slice from its cursor
    /// `start` for [`SNAT_PORT_TRIES`] tries, then the `other` slice from
    /// position `pick` on.
    #[inline(always)]
    fn try_tuple(&self, i: u64, start: u64, other: u32, pick: u32) -> (u32, u16) {
        if i < u64::from(SNAT_PORT_TRIES) {
            self.tuple_in(self.cpu, start.wrapping_add(i))
        } else {
            self.tuple_in(other, u64::from(pick).wrapping_add(i))
        }
    }

    /// Another CPU's slice, chosen by `pick`; this CPU's own with a single
    /// slice (its steal tries then walk it again, harmlessly).
    #[inline(always)]
    fn other_slice(&self, pick: u32) -> u32 {
        // No `%` by a plain integer: its zero check would be a panic path.
        let Some(other) = self
            .cpus
            .checked_sub(1)
            .and_then(|others| pick.checked_rem(others))
        else {
            return self.cpu;
        };
        let owner = self.cpu + 1 + other;
        if owner >= self.cpus {
            owner - self.cpus
        } else {
            owner
        }
    }
}

/// The reply (backend → client) entry of a new connection: it translates
/// the backend's packets back to `VIP → client` and holds the client's
/// return path.
#[inline(always)]
fn reply_entry(
    pkt: &Packet,
    client: ReturnPath,
    vip_id: u32,
    backend_id: u32,
    now: u64,
) -> FlowEntry {
    FlowEntry {
        new_src: pkt.daddr,
        new_dst: pkt.saddr,
        new_sport: pkt.dport,
        new_dport: pkt.sport,
        backend_id,
        vip_id,
        direction: DIR_TO_CLIENT,
        state: if pkt.is_tcp() {
            FLOW_SYN_SENT
        } else {
            FLOW_ESTABLISHED
        },
        created_ns: now,
        last_seen_ns: now,
        // Just checked: the first packets skip the clock (`track`).
        checked_jiffies: jiffies(),
        client_mac: client.mac,
        client_ifindex: client.ifindex,
        ..FlowEntry::default()
    }
}

/// Inserts `entry` (the reply entry) under a free SNAT tuple's key
/// (`backend → SNAT:port`), stepping this CPU's cursor over its slice of the
/// backend's tuples at most `SNAT_PORT_TRIES` times, and on success turns
/// `entry` into the forward entry using that tuple. The tuple at the
/// cursor, if taken, is taken over when [`may_take_over`] allows it for
/// `syn`. Early returns and no tuple copied out keep the frame small: the
/// debug build's `new_flow` frame is at the 512-byte stack limit.
#[allow(
    clippy::needless_borrows_for_generic_args,
    reason = "the 96-byte entry is passed by reference; by value it would be copied on the 512-byte stack"
)]
#[inline(always)]
fn claim_snat_tuple<const V6: bool>(
    pkt: &Packet,
    backend: &Chosen,
    snat: &Snat,
    entry: &mut FlowEntry,
    syn: Syn,
) -> Result<bool, Reason> {
    let cursor = SNAT_CURSORS
        .get_ptr_mut(backend.id)
        .ok_or(reason::DROP_BAD_CONFIG)?;
    // SAFETY: this CPU's own copy of a per-CPU map value (XDP runs with
    // preemption off, so nothing else touches it meanwhile).
    let start = unsafe { *cursor };
    // The other slice (if this CPU's is full) and where in it to start:
    // mixed from the cursor and the client's address and port rather than
    // drawn: no helper call on every new flow for the rare one that steals.
    let pick = ((start as u32) ^ u32::from(pkt.sport) ^ pkt.saddr[0]).wrapping_mul(0x9E37_79B1);
    let other = snat.other_slice(pick);
    // Every try that claims a tuple leaves the loop at one place, so the
    // verifier follows what comes after once rather than once per try; the
    // tuple is found again from its try's number (a plain integer: the
    // frame is at the 512-byte limit).
    let mut claimed = u64::MAX;
    let mut taken_over = false;
    for i in 0..u64::from(SNAT_PORT_TRIES + SNAT_STEAL_TRIES) {
        let (slot, port) = snat.try_tuple(i, start, other, pick);
        let addr = SNAT_ADDRS.get(slot).ok_or(reason::DROP_BAD_CONFIG)?;
        let reverse = FlowKey::new(
            pkt.family,
            pkt.proto,
            backend.addr,
            addr.addr,
            backend.port,
            port,
        );
        // NOEXIST makes the check and the claim one step.
        match insert::<V6>(&reverse, &*entry, u64::from(BPF_NOEXIST)) {
            Ok(()) => {
                snat_used(backend.id, 1);
                claimed = i;
                break;
            }
            // The tuple at the cursor (try 0) is the one this CPU handed
            // out longest ago: if a closed connection holds it and
            // `may_take_over` allows it (its quarantine is over, or the
            // backend's TIME_WAIT accepts this SYN), the new connection
            // takes it over at once. Under load, then, no tuple is held
            // much longer than its quarantine (the sweep, whose passes can
            // be two minutes apart on a large table, frees it only after a
            // second one), and a slice turned over inside the quarantine
            // costs a SYN one failed insert and a lookup here, not every
            // try of the claim and then `take_over_tuple`'s. Only there: a
            // free tuple, the common case, costs one hash operation, and a
            // taken one at most one lookup more.
            Err(EEXIST) if i == 0 => {
                if let Some(held_by) =
                    take_over_held::<V6>(&reverse, entry, snat.quarantine_ns, syn)
                {
                    move_held(held_by, backend.id);
                    claimed = 0;
                    taken_over = true;
                    break;
                }
            }
            Err(EEXIST) => {}
            // Full table (E2BIG) or out of memory.
            Err(_) => return Err(reason::DROP_FLOW_INSERT),
        }
    }
    if claimed == u64::MAX {
        // SAFETY: as above.
        unsafe { *cursor = start.wrapping_add(u64::from(SNAT_PORT_TRIES)) };
        return Err(reason::DROP_SNAT_EXHAUSTED);
    }
    let (slot, port) = snat.try_tuple(claimed, start, other, pick);
    let addr = SNAT_ADDRS.get(slot).ok_or(reason::DROP_BAD_CONFIG)?;
    // Past the claimed tuple; after a steal, past this CPU's full stretch.
    // SAFETY: as above.
    unsafe { *cursor = start.wrapping_add(claimed.min(u64::from(SNAT_PORT_TRIES) - 1) + 1) };
    into_forward_entry(entry, &addr.addr, port, backend);
    Ok(taken_over)
}

/// For a SYN (`syn`) that found no free tuple: takes over one of the
/// first [`SNAT_REUSE_TRIES`] closed tuples from where the failed claim
/// started that [`may_take_over`] allows (its backend's TIME_WAIT accepts
/// this SYN, or its quarantine is over): the new reply
/// entry replaces the closed one under its key (`BPF_EXIST`, after
/// claiming it with `FLOW_F_TAKEN`), and `entry` becomes the forward
/// entry. The count of tuples held moves only if the closed connection
/// was another VIP's (another id of the same backend). Same frame rules
/// as [`claim_snat_tuple`].
#[allow(
    clippy::needless_borrows_for_generic_args,
    reason = "the 96-byte entry is passed by reference; by value it would be copied on the 512-byte stack"
)]
#[inline(always)]
fn take_over_tuple<const V6: bool>(
    pkt: &Packet,
    backend: &Chosen,
    snat: &Snat,
    entry: &mut FlowEntry,
    syn: Syn,
) -> Result<(), Reason> {
    let cursor = SNAT_CURSORS
        .get_ptr_mut(backend.id)
        .ok_or(reason::DROP_BAD_CONFIG)?;
    // From where the failed claim started (it stepped the cursor past its
    // tries): the tuples this CPU handed out longest ago, most likely
    // closed by now. From the stepped cursor, each new flow under load
    // would move it SNAT_PORT_TRIES + 1 positions and soon meet
    // connections still open.
    // SAFETY: this CPU's own copy of a per-CPU map value.
    let start = unsafe { *cursor }.wrapping_sub(u64::from(SNAT_PORT_TRIES));
    let mut taken = u64::MAX;
    // Whose count the tuple leaves: a backend behind two VIPs has an id
    // for each, and the same tuples (the key holds its address).
    let mut held_by = backend.id;
    for i in 0..u64::from(SNAT_REUSE_TRIES) {
        let (slot, port) = snat.tuple(start.wrapping_add(i));
        let addr = SNAT_ADDRS.get(slot).ok_or(reason::DROP_BAD_CONFIG)?;
        let reverse = FlowKey::new(
            pkt.family,
            pkt.proto,
            backend.addr,
            addr.addr,
            backend.port,
            port,
        );
        if let Some(by) = take_over_held::<V6>(&reverse, entry, snat.quarantine_ns, syn) {
            held_by = by;
            taken = i;
            break;
        }
    }
    if taken == u64::MAX {
        return Err(reason::DROP_SNAT_EXHAUSTED);
    }
    let (slot, port) = snat.tuple(start.wrapping_add(taken));
    let addr = SNAT_ADDRS.get(slot).ok_or(reason::DROP_BAD_CONFIG)?;
    // SAFETY: as above.
    unsafe { *cursor = start.wrapping_add(taken + 1) };
    move_held(held_by, backend.id);
    into_forward_entry(entry, &addr.addr, port, backend);
    Ok(())
}

/// Takes over the SNAT tuple held by the reply entry at `reverse` for the
/// new connection's reply entry `entry`, if the held entry is closed and
/// [`may_take_over`] allows it for `syn` at `entry`'s creation time;
/// returns the backend id that held it (whose count the tuple leaves), or
/// `None`. The held connection's forward entry was closed before the reply
/// entry was stamped and leaves `closed_linger_ns` after the close; the
/// sweep removes it as usual. (Nothing is copied out of the entry but its
/// backend: the new-flow frame is at the 512-byte stack limit.)
#[allow(
    clippy::needless_borrows_for_generic_args,
    reason = "the 96-byte entry is passed by reference; by value it would be copied on the 512-byte stack"
)]
#[inline(always)]
fn take_over_held<const V6: bool>(
    reverse: &FlowKey,
    entry: &FlowEntry,
    quarantine_ns: u64,
    syn: Syn,
) -> Option<u32> {
    let held = lookup::<V6>(reverse)?;
    if !may_take_over(held, syn, entry.created_ns, quarantine_ns) {
        return None;
    }
    // SAFETY: live map value; written only when it was created.
    let held_by = unsafe { (*held).backend_id };
    if replace_claimed::<V6>(reverse, held, entry) {
        Some(held_by)
    } else {
        None
    }
}

/// Writes the new reply entry `entry` over `held`, the closed one at
/// `reverse` that the caller claimed (`FLOW_F_TAKEN`); returns whether it
/// did. Claimed but not replaced (the table could not allocate the new
/// value), the claim is given back, so the sweep still frees the tuple.
#[allow(
    clippy::needless_borrows_for_generic_args,
    reason = "the 96-byte entry is passed by reference; by value it would be copied on the 512-byte stack"
)]
#[inline(always)]
fn replace_claimed<const V6: bool>(
    reverse: &FlowKey,
    held: *mut FlowEntry,
    entry: &FlowEntry,
) -> bool {
    if insert::<V6>(reverse, entry, u64::from(BPF_EXIST)).is_ok() {
        return true;
    }
    Flags::of(held).clear(FLOW_F_TAKEN);
    false
}

/// Moves a tuple taken over from a closed connection of backend id
/// `held_by` to `backend_id`'s count of tuples held. The reply key holds
/// the backend's address and port, so the ids differ only for one backend
/// behind two VIPs; when they are the same, nothing moves (two atomic adds
/// on a line every CPU writes, saved on each SYN of a slice turned over).
#[inline(always)]
fn move_held(held_by: u32, backend_id: u32) {
    if held_by != backend_id {
        snat_used(held_by, u64::MAX);
        snat_used(backend_id, 1);
    }
}

/// Adds `delta` (wrapping: `u64::MAX` is −1) to the backend's count of
/// SNAT tuples held.
#[inline(always)]
pub fn snat_used(backend_id: u32, delta: u64) {
    if let Some(used) = BACKEND_SNAT_USED.get_ptr_mut(backend_id) {
        // SAFETY: live, 8-byte aligned map value; every writer is atomic.
        unsafe { add_u64(used, delta) };
    }
}

/// Turns the reply entry into the forward (client → backend) one: it
/// translates the client's packets to `SNAT:port → backend`.
#[inline(always)]
fn into_forward_entry(entry: &mut FlowEntry, addr: &[u32; 4], port: u16, backend: &Chosen) {
    // SAFETY: a live map value (`SNAT_ADDRS`); see `packet::load_addr`.
    entry.new_src = unsafe { load_addr(addr) };
    entry.new_dst = backend.addr;
    entry.new_sport = port;
    entry.new_dport = backend.port;
    entry.direction = DIR_TO_BACKEND;
    // SAFETY: the stack; see `packet::store_mac`.
    unsafe { store_mac(&raw mut entry.client_mac, [0; 6]) };
    entry.client_ifindex = 0;
}

/// Inserts the forward entry under the packet's own key; on failure, the
/// reply entry (and its SNAT port) is released again, so no half of the
/// connection survives alone. A tuple `taken_over` from a closed connection
/// is not released but kept closed, its quarantine started again: the
/// closed entry that kept it from a backend that may still hold it in
/// TIME_WAIT is gone (the new reply entry replaced it), and a free tuple
/// would go to the next SYN with no TIME_WAIT check. (On a full table the
/// replacement succeeds where the forward insert fails: a preallocated
/// map keeps spare elements for updates.)
///
/// Where the key has no entry, only this insert may write it (NOEXIST):
/// two CPUs creating one client tuple at once (the same SYN on two
/// queues) would otherwise both count a connection, the second entry
/// overwriting the first. A closed connection's entry is replaced (ANY)
/// only by whoever claims it first ([`FLOW_F_TAKEN`]), as the sweep claims
/// it before removing it by key: neither then removes or overwrites the
/// new connection's entry the other wrote. Losing that claim, the insert
/// waits for no one: it fails, and the client's SYN comes again.
#[allow(
    clippy::needless_borrows_for_generic_args,
    reason = "the 96-byte entry is passed by reference; by value it would be copied on the 512-byte stack"
)]
#[inline(always)]
fn insert_forward<const V6: bool>(
    pkt: &Packet,
    forward: &FlowEntry,
    taken_over: bool,
) -> Result<(), Reason> {
    let key = pkt.flow_key();
    let inserted = insert::<V6>(key, forward, u64::from(BPF_NOEXIST)).is_ok()
        || replace_closed::<V6>(key, forward);
    if !inserted {
        let reverse = Translation::of(forward).opposite_key(pkt);
        if taken_over {
            // Still counted as held by this backend (`move_held`) until
            // the sweep frees it, as any closed tuple is. No connection
            // was counted open for it, so none is counted closed.
            stamp_closed(lookup::<V6>(&reverse), forward.created_ns);
        } else if remove::<V6>(&reverse) {
            snat_used(forward.backend_id, u64::MAX);
        }
        return Err(reason::DROP_FLOW_INSERT);
    }
    Ok(())
}

/// Replaces the closed connection's forward entry under `key` with
/// `forward`, if it claims it first; whether it did.
#[inline(always)]
fn replace_closed<const V6: bool>(key: &FlowKey, forward: &FlowEntry) -> bool {
    let Some(old) = lookup::<V6>(key) else {
        return false;
    };
    let flags = Flags::of(old);
    if flags.get() & FLOW_F_CLOSED == 0 || flags.set(FLOW_F_TAKEN) & FLOW_F_TAKEN != 0 {
        return false;
    }
    if insert::<V6>(key, forward, u64::from(BPF_ANY)).is_ok() {
        return true;
    }
    // Not replaced (the table is full): the closed entry is the sweep's
    // to remove again.
    flags.clear(FLOW_F_TAKEN);
    false
}

/// Marks a reply entry closed at `now`, starting its SNAT tuple's
/// quarantine (a no-op for `None` or an entry already closed).
#[inline(always)]
pub fn stamp_closed(reply: Option<*mut FlowEntry>, now: u64) {
    let Some(reply) = reply else { return };
    // The time before the flag: whoever sees the entry closed
    // (`flow::may_take_over`, the sweep) then reads the close's time, not
    // the open one's (the flag's atomic OR orders the two stores). Two
    // racing closes both store a time of now.
    if Flags::of(reply).get() & FLOW_F_CLOSED == 0 {
        // SAFETY: live map value.
        unsafe { (*reply).last_seen_ns = now };
        Flags::of(reply).set(FLOW_F_CLOSED);
    }
}

/// Whether a closed tuple `age` ns after its close is past its second
/// quarantine: from then on it is the sweep's to free, by key, and the
/// data path neither takes it over ([`may_take_over`]) nor makes its close
/// time young again (`time_wait`), so the two never decide on one entry.
/// (A subtraction: `saturating_mul(2)` in `may_take_over` took the
/// verifier past its limit.)
#[inline(always)]
pub fn past_second_quarantine(age: u64, quarantine_ns: u64) -> bool {
    age > quarantine_ns && age - quarantine_ns > quarantine_ns
}

/// Whether a new connection whose first packet is `syn` may take over the
/// reply entry `held` at `now`, and if so claims it ([`FLOW_F_TAKEN`],
/// which the sweep's free also takes first, so only one acts on it). It
/// may when the entry is closed and either
/// * it is in its second quarantine after the close: the first keeps the
///   tuple from a backend that may still hold it in TIME_WAIT, and after
///   the second the tuple is the sweep's, which frees it by key (were
///   both to decide on one entry, the sweep, holding the old entry, could
///   remove the new connection's entry written under that key); or
/// * inside its quarantine, the client's last segment was recorded and the
///   backend's TIME_WAIT, if it holds one, would accept `syn` (never for
///   [`TsOption::UNKNOWN`]).
#[inline(always)]
pub fn may_take_over(held: *mut FlowEntry, syn: Syn, now: u64, quarantine_ns: u64) -> bool {
    let flags = Flags::of(held);
    let bits = flags.get();
    if bits & FLOW_F_CLOSED == 0 || bits & FLOW_F_TAKEN != 0 {
        return false;
    }
    // SAFETY: live map value; the close time and the view are written
    // before the flags that publish them.
    let (closed_at, word) = unsafe {
        (
            (&raw const (*held).last_seen_ns).read_volatile(),
            (&raw const (*held).created_ns).read_volatile(),
        )
    };
    let age = now.saturating_sub(closed_at);
    if age > quarantine_ns {
        // Past the second quarantine the tuple is the sweep's.
        if past_second_quarantine(age, quarantine_ns) {
            return false;
        }
    } else {
        // No view, or a FIN's the backend has not acknowledged: it may
        // not be in TIME_WAIT (see `time_wait::note_backend_ack`).
        if bits & FLOW_F_TW_SEEN == 0 || bits & FLOW_F_TW_UNACKED != 0 {
            return false;
        }
        let ts_state = if bits & FLOW_F_TW_TS != 0 {
            TS_PRESENT
        } else if bits & FLOW_F_TW_TS_UNKNOWN != 0 {
            TS_UNKNOWN
        } else {
            TS_ABSENT
        };
        if !accepts_syn(&TimeWaitView::unpack(word, ts_state), syn.seq, syn.ts) {
            return false;
        }
    }
    flags.set(FLOW_F_TAKEN) & FLOW_F_TAKEN == 0
}
