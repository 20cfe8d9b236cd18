//! Next hop of a rewritten packet: MAC addresses and the egress interface.
//!
//! The kernel FIB is asked first (`bpf_fib_lookup` with the ingress
//! interface, as a forwarded packet would be routed; it answers only where
//! IP forwarding is enabled on that interface). Without a complete answer
//! the control plane's `NEIGHBOURS` map gives the MAC and interface, and for
//! replies, which go to clients the control plane does not know, the return
//! path learned from the client's first frame does. Packets of known
//! flows, in both directions, use the answer their flow entry cached
//! instead, resolved again once a second. A new flow starts with the hop
//! a flow to its backend last resolved on this CPU, while that is fresh
//! (`backend_hop`).
use core::mem::{MaybeUninit, align_of, size_of};

use aya_ebpf::{
    EbpfContext,
    bindings::{BPF_FIB_LKUP_RET_SUCCESS, bpf_fib_lookup},
    helpers::generated::{bpf_fib_lookup as fib_lookup, bpf_redirect},
    programs::XdpContext,
};
use lb_common::{FlowEntry, IpKey, Reason, Verdict, reason};

use crate::{
    backend_hop,
    flow::{ReturnPath, Translation},
    maps::NEIGHBOURS,
    packet::{Mac, Packet, keep_ctx_pointer, load_mac, ptr_at},
    wire::{ETH_DST_OFF, ETH_SRC_OFF},
};

/// `AF_INET` and `AF_INET6` as the kernel's FIB lookup expects them (not lb-common's tags).
const FIB_AF_INET: u8 = 2;
const FIB_AF_INET6: u8 = 10;

/// Where the frame goes next.
struct Hop {
    dmac: Mac,
    smac: Mac,
    ifindex: u32,
}

/// Sets the MACs for the rewritten packet `to.src -> to.dst` and returns
/// the verdict that sends the frame: XDP_TX on the ingress interface
/// (counted as `tx_reason`), else a redirect. `learned` is the last resort
/// (if its interface is not 0).
#[inline(always)]
pub fn forward(
    ctx: &XdpContext,
    pkt: &Packet,
    to: &Translation,
    tx_reason: Reason,
    learned: ReturnPath,
) -> Result<Verdict, Reason> {
    let ingress = ctx.ingress_ifindex() as u32;
    let macs = MacFields::of(ctx)?;
    let hop =
        resolve(ctx, pkt, to, ingress, macs.our_mac(), learned).ok_or(reason::DROP_NO_NEIGHBOUR)?;
    macs.address(hop.dmac, hop.smac);
    Ok(send(hop.ifindex, ingress, tx_reason))
}

/// The frame's two MAC address fields, bounds-checked.
struct MacFields {
    dst: *mut Mac,
    src: *mut Mac,
}

impl MacFields {
    #[inline(always)]
    fn of(ctx: &XdpContext) -> Result<Self, Reason> {
        Ok(Self {
            dst: ptr_at::<Mac>(ctx, ETH_DST_OFF).ok_or(reason::DROP_TRUNCATED)?,
            src: ptr_at::<Mac>(ctx, ETH_SRC_OFF).ok_or(reason::DROP_TRUNCATED)?,
        })
    }

    /// Our MAC: the frame's destination (it reached this interface).
    #[inline(always)]
    fn our_mac(&self) -> Mac {
        // SAFETY: bounds-checked in `of`.
        unsafe { load_mac(self.dst) }
    }

    /// Addresses the frame from `smac` to `dmac`.
    #[inline(always)]
    fn address(&self, dmac: Mac, smac: Mac) {
        // SAFETY: bounds-checked in `of`; [u8; 6] has alignment 1.
        unsafe {
            self.dst.write(dmac);
            self.src.write(smac);
        }
    }
}

/// The next hop to `to.dst`: the FIB's, the neighbour map's, or `learned`
/// (if its interface is not 0). `our_mac` is the frame's destination.
#[inline(always)]
fn resolve(
    ctx: &XdpContext,
    pkt: &Packet,
    to: &Translation,
    ingress: u32,
    our_mac: Mac,
    learned: ReturnPath,
) -> Option<Hop> {
    fib(ctx, pkt, to, ingress)
        .or_else(|| neighbour(pkt.family, to.dst, our_mac, ingress))
        .or_else(|| {
            (learned.ifindex != 0).then_some(Hop {
                dmac: learned.mac,
                smac: our_mac,
                ifindex: learned.ifindex,
            })
        })
}

/// The verdict that sends the frame out of `ifindex`: XDP_TX (counted as
/// `tx_reason`) on the ingress interface, else a redirect.
#[inline(always)]
fn send(ifindex: u32, ingress: u32, tx_reason: Reason) -> Verdict {
    if ifindex == ingress {
        return Verdict::tx(tx_reason);
    }
    // SAFETY: plain helper call; it only records the target for the driver.
    let action = unsafe { bpf_redirect(ifindex, 0) };
    Verdict::new(action as u32, reason::REDIRECT)
}

/// Where a flow entry caches its next hop: the fields of the MAC and of
/// the interface (0: nothing cached). A forward entry uses its
/// `client_mac`/`client_ifindex` (unused otherwise there); a reply entry,
/// whose `client_*` fields hold the learned return path, uses
/// `hop_ifindex` and the first six bytes of `request_ns`.
struct HopCache {
    mac: *mut Mac,
    ifindex: *mut u32,
}

impl HopCache {
    #[inline(always)]
    fn of_forward(fwd: *mut FlowEntry) -> Self {
        // SAFETY: only computes field addresses.
        unsafe {
            Self {
                mac: &raw mut (*fwd).client_mac,
                ifindex: &raw mut (*fwd).client_ifindex,
            }
        }
    }

    #[inline(always)]
    fn of_reply(rev: *mut FlowEntry) -> Self {
        Self {
            mac: reply_hop_mac(rev),
            // SAFETY: only computes the field address.
            ifindex: unsafe { &raw mut (*rev).hop_ifindex },
        }
    }

    /// The cached interface, read once: a refresh drops the hop
    /// (interface 0) before it resolves again, and stores the MAC before
    /// the interface, so a hop seen cached has its MAC.
    #[inline(always)]
    fn ifindex(&self) -> u32 {
        // SAFETY: live map value; a racing refresh stores the same kind of
        // values.
        unsafe { self.ifindex.read_volatile() }
    }
}

/// Whether a hop cached on interface `cached` (0: none) serves a frame
/// that came in on `ingress`: only a hop out of the interface the frame
/// arrived on is sent with `XDP_TX`.
#[inline(always)]
const fn serves_ingress(cached: u32, ingress: u32) -> bool {
    cached != 0 && cached == ingress
}

/// [`forward`] for a packet towards the backend of the forward entry
/// `fwd`, with the next hop resolved per flow rather than per packet (see
/// [`forward_cached`]). `track::touch` drops the cached hop once a second,
/// so a changed neighbour is picked up within about a second.
#[inline(always)]
pub fn forward_to_backend(
    ctx: &XdpContext,
    pkt: &Packet,
    to: &Translation,
    fwd: *mut FlowEntry,
) -> Result<Verdict, Reason> {
    let cache = HopCache::of_forward(fwd);
    forward_cached(
        ctx,
        pkt,
        to,
        &cache,
        false,
        ReturnPath::NONE,
        reason::TX_TO_BACKEND,
        true,
    )
}

/// [`forward`] for a packet towards the client of the reply entry `rev`,
/// with the next hop resolved per flow rather than per packet (see
/// [`forward_cached`]); the learned return path (`client_mac`/
/// `client_ifindex`) is the last resort. `refresh` (the reply entry's
/// once-a-second refresh is due, `track::reply_refresh_due`) resolves it
/// again and replaces or drops the cached one, so a changed neighbour is
/// picked up within about a second.
#[inline(always)]
pub fn forward_to_client(
    ctx: &XdpContext,
    pkt: &Packet,
    to: &Translation,
    rev: *mut FlowEntry,
    refresh: bool,
) -> Result<Verdict, Reason> {
    let cache = HopCache::of_reply(rev);
    forward_cached(
        ctx,
        pkt,
        to,
        &cache,
        refresh,
        ReturnPath::of(rev),
        reason::TX_TO_CLIENT,
        false,
    )
}

/// [`forward`] with the next hop kept in the flow entry (`cache`): the
/// answer of `bpf_fib_lookup`, the neighbour map or `learned` is cached
/// when the frame goes back out of the ingress interface, and later
/// packets use it without a lookup until it is dropped (`refresh`: resolved
/// again now). `shared` (towards a backend): a resolved hop is also kept
/// as the backend's shared one for the next new flows
/// (`backend_hop::remember`). Each caller passes constant `refresh` kinds,
/// reasons and `shared`, so each BPF function keeps only its own half.
#[inline(always)]
fn forward_cached(
    ctx: &XdpContext,
    pkt: &Packet,
    to: &Translation,
    cache: &HopCache,
    refresh: bool,
    learned: ReturnPath,
    tx_reason: Reason,
    shared: bool,
) -> Result<Verdict, Reason> {
    let ingress = ctx.ingress_ifindex() as u32;
    let cached_ifindex = cache.ifindex();
    let macs = MacFields::of(ctx)?;
    let our_mac = macs.our_mac();
    // The cached and the resolved hop meet before the frame is written, so
    // the verifier walks the rest of the path once for both (two copies of
    // it cost about 46k instructions of the 1M budget in the reply path).
    let hop = if !refresh && serves_ingress(cached_ifindex, ingress) {
        Hop {
            // SAFETY: live map value.
            dmac: unsafe { load_mac(cache.mac) },
            smac: our_mac,
            ifindex: ingress,
        }
    } else {
        if refresh && cached_ifindex != 0 {
            // Dropped first: whatever the answer now (a redirect, or none),
            // the cached hop is stale.
            // SAFETY: live map value.
            unsafe { cache.ifindex.write_volatile(0) };
        }
        let hop =
            resolve(ctx, pkt, to, ingress, our_mac, learned).ok_or(reason::DROP_NO_NEIGHBOUR)?;
        if hop.ifindex == ingress {
            // Sent back out of the ingress interface: remember the hop. The
            // MAC is stored before the interface that marks it valid.
            // SAFETY: live map value.
            unsafe {
                cache.mac.write_volatile(hop.dmac);
                cache.ifindex.write_volatile(ingress);
            }
            if shared {
                backend_hop::remember(to.backend_id, &to.dst, hop.dmac, ingress);
            }
        }
        hop
    };
    macs.address(hop.dmac, hop.smac);
    Ok(send(hop.ifindex, ingress, tx_reason))
}

/// Where `entry` (a forward entry towards its backend, a reply entry
/// towards its client) caches its next hop's MAC, if the hop is cached
/// for the ingress interface `ingress`: the hop an established flow's
/// bulk packet takes without resolving (`fast_path`). Checked before
/// anything is written, so a packet without one goes the general way
/// untouched; the MAC itself is read only when it is written
/// ([`send_back`]), so it is not held in registers across the rewrite.
#[inline(always)]
pub fn cached_on_ingress(
    entry: *mut FlowEntry,
    to_backend: bool,
    ingress: u32,
) -> Option<*const Mac> {
    let cache = if to_backend {
        HopCache::of_forward(entry)
    } else {
        HopCache::of_reply(entry)
    };
    serves_ingress(cache.ifindex(), ingress).then_some(cache.mac.cast_const())
}

/// Sends the frame back out of its ingress interface to the MAC at
/// `dmac` (a live map value, [`cached_on_ingress`]), from the MAC it was
/// addressed to: the verdict `XDP_TX` under `tx_reason`.
#[inline(always)]
pub fn send_back(ctx: &XdpContext, dmac: *const Mac, tx_reason: Reason) -> Result<Verdict, Reason> {
    let macs = MacFields::of(ctx)?;
    // SAFETY: `dmac` is the caller's live map value.
    macs.address(unsafe { load_mac(dmac) }, macs.our_mac());
    Ok(Verdict::tx(tx_reason))
}

// A reply entry's cached MAC lives in the first six bytes of its
// `request_ns` (see `lb_common::FlowEntry::request_ns`).
const _: () = assert!(size_of::<Mac>() <= size_of::<u64>());

/// Where a reply entry keeps its cached next hop's MAC.
#[inline(always)]
fn reply_hop_mac(rev: *mut FlowEntry) -> *mut Mac {
    // SAFETY: only computes the field address; `Mac` has alignment 1 and
    // fits the 8-byte field.
    unsafe { (&raw mut (*rev).request_ns).cast::<Mac>() }
}

/// [`forward`] as a BPF function of its own, for callers whose stack frame
/// cannot also hold the FIB lookup's parameters (ICMP translation): the
/// verdict (a drop, if the frame cannot be sent).
#[inline(always)]
pub fn forward_out_of_line(
    ctx: &XdpContext,
    pkt: &Packet,
    to: &Translation,
    tx_reason: Reason,
    learned: ReturnPath,
) -> Verdict {
    Verdict::from_raw(forward_call(
        XdpContext::new(ctx.ctx),
        pkt,
        to,
        tx_reason,
        &learned,
    ))
}

/// Returns [`Verdict::into_raw`]'s integer.
#[inline(never)]
fn forward_call(
    ctx: XdpContext,
    pkt: &Packet,
    to: &Translation,
    tx_reason: Reason,
    learned: &ReturnPath,
) -> u64 {
    keep_ctx_pointer(&ctx);
    Verdict::of(forward(&ctx, pkt, to, tx_reason, *learned)).into_raw()
}

/// A complete FIB answer (route and resolved neighbour), if any.
#[inline(always)]
fn fib(ctx: &XdpContext, pkt: &Packet, to: &Translation, ingress: u32) -> Option<Hop> {
    let mut storage = MaybeUninit::uninit();
    let params = zeroed_fib_params(&mut storage);
    params.l4_protocol = pkt.proto;
    params.ifindex = ingress;
    if pkt.is_v6() {
        params.family = FIB_AF_INET6;
        params.__bindgen_anon_3.ipv6_src = to.src;
        params.__bindgen_anon_4.ipv6_dst = to.dst;
    } else {
        params.family = FIB_AF_INET;
        params.__bindgen_anon_3.ipv4_src = to.src[0];
        params.__bindgen_anon_4.ipv4_dst = to.dst[0];
    }
    // SAFETY: `params` is a valid, fully initialised struct on our stack.
    let rc = unsafe {
        fib_lookup(
            ctx.as_ptr(),
            &mut *params,
            size_of::<bpf_fib_lookup>() as i32,
            0,
        )
    };
    if rc != BPF_FIB_LKUP_RET_SUCCESS as i64 {
        return None;
    }
    Some(Hop {
        dmac: params.dmac,
        smac: params.smac,
        ifindex: params.ifindex,
    })
}

/// FIB lookup parameters in `storage`, all zero; the caller sets the
/// fields the lookup reads (its unions make a struct literal awkward).
/// Zeroed in place a 32-bit word at a time: `MaybeUninit::zeroed()`
/// compiled to a call of the `memset` BPF function, a byte loop of 64
/// rounds, on the first packet of every flow in each direction and at
/// every refresh. Volatile stores cannot be merged back into that call,
/// and in place because a zeroed value returned and copied was zeroed by a
/// `memset` call again.
#[inline(always)]
fn zeroed_fib_params(storage: &mut MaybeUninit<bpf_fib_lookup>) -> &mut bpf_fib_lookup {
    const WORDS: usize = size_of::<bpf_fib_lookup>() / size_of::<u32>();
    const _: () = assert!(WORDS * size_of::<u32>() == size_of::<bpf_fib_lookup>());
    const _: () = assert!(align_of::<bpf_fib_lookup>() >= align_of::<u32>());
    let words = storage.as_mut_ptr().cast::<u32>();
    for i in 0..WORDS {
        // SAFETY: `i` < WORDS, inside the local; 4-byte aligned (asserted).
        unsafe { words.add(i).write_volatile(0) };
    }
    // SAFETY: every byte was written; all-zero is a valid `bpf_fib_lookup`
    // (integers and unions of integers).
    unsafe { storage.assume_init_mut() }
}

/// The control plane's neighbour entry for `dst`; the frame keeps our MAC
/// (its original destination) as the source. Interface 0 means ingress.
#[inline(always)]
fn neighbour(family: u8, dst: [u32; 4], our_mac: Mac, ingress: u32) -> Option<Hop> {
    let key = IpKey {
        addr: dst,
        family,
        _pad: [0; 3],
    };
    // SAFETY: read-only copy of a hash map value.
    let n = unsafe { NEIGHBOURS.get(key) }?;
    Some(Hop {
        dmac: n.mac,
        smac: our_mac,
        ifindex: if n.ifindex == 0 { ingress } else { n.ifindex },
    })
}
