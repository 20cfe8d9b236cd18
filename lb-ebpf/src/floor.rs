//! Benchmark floors of a new connection: what a full-NAT balancer with a
//! hash flow table pays per new flow before it does anything of its own.
//!
//! `lb-bench-dataplane` runs them next to `lb_xdp`'s new-flow cases, on the
//! same IPv4 table, `FLOWS4`, through the same operations (its own client
//! addresses, so no key meets another case's). Each parses an IPv4 TCP/UDP frame with no options, looks its
//! 5-tuple up (a miss for every new client), inserts the forward entry, of
//! a flow's size, keeps the reply direction its way ([`Reply`]: not at all,
//! as a second entry under its own key, as `lb_xdp` keeps it, or as a way),
//! swaps the MACs and sends the frame back. No backend choice, no SNAT
//! claim, no rewrite, no counters. The control plane never loads them.
//!
//! A third floor, `xdp_floor_one_entry_way`, measures the layout that
//! would keep one hash entry per connection: the forward entry, and the
//! reply direction as a 16-byte way in an array indexed by the SNAT tuple,
//! claimed with an atomic OR at a per-CPU cursor that walks the array in
//! order (as the SNAT claim's cursor walks a CPU's slice of tuples).
//!
//! Two more floors measure an established packet's flow lookup:
//! `xdp_floor_established_hash` finds the frame's entry in `FLOWS4`, as
//! `lb_xdp`'s fast path does, and `xdp_floor_established_way` finds its key
//! in a way of an array, at a slot the program hashes the key to itself. The array
//! lookup is inlined by the verifier, where the hash map's is a call into
//! the kernel that makes three more (hash, bucket walk, compare), and every
//! return pays the machine's return mitigation (see `xdp_calls_bench`).
//! `xdp_floor_two_ways` is the new-flow floor of such a table: no hash
//! entry at all, the forward direction a way at its key's slot, the reply
//! direction a way at the cursor.
use aya_ebpf::{
    bindings::xdp_action,
    macros::{map, xdp},
    maps::{Array, PerCpuArray},
    programs::XdpContext,
};
use lb_common::{AF_INET, FLOOR_FLOW_WAYS, FLOOR_WAY_CLAIMED, FlowEntry, FlowKey};

use crate::{
    atomic::fetch_or_u64,
    flow::{insert, lookup_on_stack},
    packet,
    wire::{ETH_LEN, ETH_P_IPV4, ETH_TYPE_OFF, IPV4_MIN_LEN, IPV4_PROTO_OFF, IPV4_SADDR_OFF},
};

/// The one-entry floor's reply ways: `[claim, client]`, the claim word's
/// top bit set by the claim ([`FLOOR_WAY_CLAIMED`]), the client word the client's
/// address and ports. One way unless the loader sizes it (the benchmark
/// does; the control plane never uses it).
#[map(name = "FLOOR_REPLY_WAYS")]
pub static FLOOR_REPLY_WAYS: Array<[u64; 2]> = Array::with_max_entries(1, 0);
/// The flow ways of `xdp_floor_established_way` and `xdp_floor_two_ways`:
/// a key's five words, its state word, then the rest of 128 bytes (what a
/// way holding the entry too would take). One
/// slot unless the loader sizes it to [`FLOOR_FLOW_WAYS`].
#[map(name = "FLOOR_FLOW_WAYS")]
pub static FLOOR_FLOW_WAYS_ARRAY: Array<[u64; FLOW_WAY_WORDS]> = Array::with_max_entries(1, 0);
/// A flow way's 64-bit words: 128 bytes, two cache lines.
const FLOW_WAY_WORDS: usize = 16;
/// A `FlowKey` as 64-bit words.
const KEY_WORDS: usize = size_of::<FlowKey>() / size_of::<u64>();
const _: () = assert!(KEY_WORDS * size_of::<u64>() == size_of::<FlowKey>());
/// A flow way's state word: [`FLOOR_WAY_CLAIMED`] once taken.
const WAY_STATE_WORD: usize = KEY_WORDS;
/// The multiplier and seed of the floor's key hash (splitmix64's). A real
/// table would seed it at random at load, so that clients cannot choose
/// tuples that collide.
const HASH_MULTIPLIER: u64 = 0xbf58_476d_1ce4_e5b9;
const HASH_SEED: u64 = 0x9e37_79b9_7f4a_7c15;

/// Per CPU: the next way the one-entry floor claims.
#[map(name = "FLOOR_WAY_CURSOR")]
pub static FLOOR_WAY_CURSOR: PerCpuArray<u32> = PerCpuArray::with_max_entries(1, 0);

/// Ways a claim tries before it gives up (taken ones are stepped over).
const WAY_TRIES: u32 = 4;
/// Slots a forward way's claim probes, from its key's on.
const FLOW_WAY_TRIES: u32 = 8;

/// Version 4, a 20-byte header: the first byte of an IPv4 header without options.
const IPV4_NO_OPTIONS: u8 = 0x45;

/// How a floor keeps a connection's reply direction.
enum Reply {
    /// Not at all: the least a balancer with one hash entry pays.
    Nothing,
    /// As a hash entry of its own, as `lb_xdp` keeps it.
    Entry,
    /// As a claimed way (see the module documentation).
    Way,
}

/// The least a balancer with one hash entry per connection pays per new flow.
#[xdp]
pub fn xdp_floor_one_entry(ctx: XdpContext) -> u32 {
    new_flow_floor(&ctx, Reply::Nothing)
}

/// The same with an entry per direction, as `lb_xdp` keeps a connection.
#[xdp]
pub fn xdp_floor_two_entries(ctx: XdpContext) -> u32 {
    new_flow_floor(&ctx, Reply::Entry)
}

/// One hash entry, and the reply direction as a claimed way.
#[xdp]
pub fn xdp_floor_one_entry_way(ctx: XdpContext) -> u32 {
    new_flow_floor(&ctx, Reply::Way)
}

/// The least an established packet's flow lookup costs with `lb_xdp`'s
/// hash table: the frame's entry found in `FLOWS4` (a miss does not send).
#[xdp]
pub fn xdp_floor_established_hash(ctx: XdpContext) -> u32 {
    let Some(key) = ipv4_key(&ctx) else {
        return xdp_action::XDP_PASS;
    };
    if lookup_on_stack::<false>(&key).is_none() {
        return xdp_action::XDP_PASS;
    }
    swap_and_send(&ctx)
}

/// The same lookup as a way of an array at a slot the program hashes the
/// key to. A slot that holds another key takes this one (the first run
/// fills it), so every later run of the same frame is a hit.
#[xdp]
pub fn xdp_floor_established_way(ctx: XdpContext) -> u32 {
    let Some(key) = ipv4_key(&ctx) else {
        return xdp_action::XDP_PASS;
    };
    let words = key_words(key);
    let Some(way) = FLOOR_FLOW_WAYS_ARRAY.get_ptr_mut(flow_slot(&words)) else {
        return xdp_action::XDP_PASS;
    };
    // SAFETY: a live array value; the benchmark runs one frame at a time.
    let way = unsafe { &mut *way };
    if !holds(way, &words) {
        write_key(way, &words);
        way[WAY_STATE_WORD] = FLOOR_WAY_CLAIMED;
    }
    swap_and_send(&ctx)
}

/// A new flow with no hash entry at all: the forward direction as a way
/// at its key's slot (or one of the next [`FLOW_WAY_TRIES`] - 1, claimed
/// with an atomic OR of its state word), the reply direction as a way at
/// the cursor, as in `xdp_floor_one_entry_way`.
#[xdp]
pub fn xdp_floor_two_ways(ctx: XdpContext) -> u32 {
    let Some(key) = ipv4_key(&ctx) else {
        return xdp_action::XDP_PASS;
    };
    let words = key_words(key);
    let first = flow_slot(&words);
    for i in 0..FLOW_WAY_TRIES {
        let Some(way) = FLOOR_FLOW_WAYS_ARRAY.get_ptr_mut((first + i) & (FLOOR_FLOW_WAYS - 1))
        else {
            return xdp_action::XDP_PASS;
        };
        // SAFETY: a live, 8-byte aligned array value.
        if holds(unsafe { &*way }, &words) {
            return swap_and_send(&ctx);
        }
        // SAFETY: as above; the claim is atomic.
        let old = unsafe { fetch_or_u64(&raw mut (*way)[WAY_STATE_WORD], FLOOR_WAY_CLAIMED) };
        if old & FLOOR_WAY_CLAIMED == 0 {
            // SAFETY: as above; this CPU owns the way it claimed.
            write_key(unsafe { &mut *way }, &words);
            if !claim_way(client_word(&key)) {
                return xdp_action::XDP_ABORTED;
            }
            return swap_and_send(&ctx);
        }
    }
    xdp_action::XDP_ABORTED
}

/// `key` as 64-bit words.
#[inline(always)]
fn key_words(key: FlowKey) -> [u64; KEY_WORDS] {
    // SAFETY: `FlowKey` is `repr(C)`, 40 bytes of plain integers (its
    // padding is a field), the size of `KEY_WORDS` words (asserted).
    unsafe { core::mem::transmute(key) }
}

/// The slot of [`FLOOR_FLOW_WAYS_ARRAY`] a key's words hash to.
#[inline(always)]
fn flow_slot(words: &[u64; KEY_WORDS]) -> u32 {
    let mut hash = HASH_SEED;
    for word in words {
        hash = (hash ^ word).wrapping_mul(HASH_MULTIPLIER);
        hash ^= hash >> 31;
    }
    (hash as u32) & (FLOOR_FLOW_WAYS - 1)
}

/// Whether `way` holds the key `words` (word by word: a slice comparison
/// would compile to a call of the `bcmp` BPF function).
#[inline(always)]
fn holds(way: &[u64; FLOW_WAY_WORDS], words: &[u64; KEY_WORDS]) -> bool {
    (0..KEY_WORDS).fold(0, |diff, i| diff | (way[i] ^ words[i])) == 0
}

/// Writes the key `words` into `way` (word by word: a slice copy would
/// compile to a call of the `memcpy` BPF function).
#[inline(always)]
fn write_key(way: &mut [u64; FLOW_WAY_WORDS], words: &[u64; KEY_WORDS]) {
    for i in 0..KEY_WORDS {
        way[i] = words[i];
    }
}

/// What the reply ways keep of the client: its address and both ports.
#[inline(always)]
fn client_word(key: &FlowKey) -> u64 {
    (u64::from(key.src[0]) << 32) | (u64::from(key.sport) << 16) | u64::from(key.dport)
}

/// Swaps the MACs and sends the frame back (XDP_PASS if it is too short).
#[inline(always)]
fn swap_and_send(ctx: &XdpContext) -> u32 {
    if packet::swap_macs(ctx) {
        xdp_action::XDP_TX
    } else {
        xdp_action::XDP_PASS
    }
}

/// Claims the first free way from this CPU's cursor on (wrapping at the
/// array's end) for `client`, and moves the cursor past it.
#[inline(always)]
fn claim_way(client: u64) -> bool {
    let Some(cursor) = FLOOR_WAY_CURSOR.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: this CPU's own copy of a per-CPU map value.
    let mut at = unsafe { *cursor };
    for _ in 0..WAY_TRIES {
        let way = match FLOOR_REPLY_WAYS.get_ptr_mut(at) {
            Some(way) => way,
            None => {
                at = 0;
                match FLOOR_REPLY_WAYS.get_ptr_mut(0) {
                    Some(way) => way,
                    None => return false,
                }
            }
        };
        at = at.wrapping_add(1);
        // SAFETY: a live, 8-byte aligned array value; the claim is atomic.
        let old = unsafe { fetch_or_u64(&raw mut (*way)[0], FLOOR_WAY_CLAIMED) };
        if old & FLOOR_WAY_CLAIMED == 0 {
            // SAFETY: as above; this CPU owns the way it claimed.
            unsafe {
                (*way)[1] = client;
                *cursor = at;
            }
            return true;
        }
    }
    // SAFETY: as above.
    unsafe { *cursor = at };
    false
}

/// A floor: the forward entry for a new client, the `reply` direction
/// kept its way (each caller passes a constant), the MACs swapped.
#[inline(always)]
fn new_flow_floor(ctx: &XdpContext, reply: Reply) -> u32 {
    let Some(key) = ipv4_key(ctx) else {
        return xdp_action::XDP_PASS;
    };
    if lookup_on_stack::<false>(&key).is_none() {
        let entry = FlowEntry::default();
        if insert::<false>(&key, &entry, 0).is_err() {
            return xdp_action::XDP_ABORTED;
        }
        let kept = match reply {
            Reply::Nothing => true,
            // The reply direction's key: another bucket, as in `lb_xdp`.
            Reply::Entry => insert::<false>(
                &FlowKey::new(
                    key.family, key.proto, key.dst, key.src, key.dport, key.sport,
                ),
                &entry,
                0,
            )
            .is_ok(),
            Reply::Way => claim_way(client_word(&key)),
        };
        if !kept {
            return xdp_action::XDP_ABORTED;
        }
    }
    swap_and_send(ctx)
}

/// The 5-tuple of an IPv4 frame without options, bounds-checked.
#[inline(always)]
fn ipv4_key(ctx: &XdpContext) -> Option<FlowKey> {
    let ether_type: u16 = packet::load(ctx, ETH_TYPE_OFF)?;
    let version_ihl: u8 = packet::load(ctx, ETH_LEN)?;
    if u16::from_be(ether_type) != ETH_P_IPV4 || version_ihl != IPV4_NO_OPTIONS {
        return None;
    }
    let [src, dst] = packet::load_words::<2>(ctx, ETH_LEN + IPV4_SADDR_OFF)?;
    let proto: u8 = packet::load(ctx, ETH_LEN + IPV4_PROTO_OFF)?;
    let [ports] = packet::load_words::<1>(ctx, ETH_LEN + IPV4_MIN_LEN)?;
    // Memory byte order: the source port is the first two bytes.
    let (sport, dport) = (ports as u16, (ports >> 16) as u16);
    Some(FlowKey::new(
        AF_INET,
        proto,
        [src, 0, 0, 0],
        [dst, 0, 0, 0],
        sport,
        dport,
    ))
}
