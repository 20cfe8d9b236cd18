//! Packet access: bounds-checked pointers into the frame, and the parsed
//! packet ([`Packet`]) every later stage works from.
//!
//! Every read and write of packet memory goes through [`ptr_at`], which
//! checks the whole object against `data_end` first: the verifier rejects
//! any packet access it cannot prove in bounds (and slicing, aya #100), and
//! a failed check is also how truncated frames are found.
use core::mem::{align_of, size_of};

use aya_ebpf::programs::XdpContext;
use lb_common::{AF_INET6, FlowKey, IPPROTO_TCP};

use crate::wire::{TCP_ACK, TCP_SYN};

pub type Mac = [u8; 6];

/// Reads the MAC at `src` (packet or map memory) into registers, a byte
/// at a time. A plain read whose value is then written to the frame is
/// merged by LLVM into one copy between two pointers it cannot tell apart,
/// which it emits as a call to `memmove`: a BPF function of its own that
/// loops over the bytes (a call, a loop and a return on every packet).
/// Volatile loads cannot be merged into that copy.
///
/// # Safety
/// `src` must be valid for reading 6 bytes (bounds-checked packet memory
/// or a live map value).
#[inline(always)]
pub unsafe fn load_mac(src: *const Mac) -> Mac {
    let src = src.cast::<u8>();
    // SAFETY: the caller's guarantee covers all 6 bytes.
    unsafe {
        [
            src.read_volatile(),
            src.add(1).read_volatile(),
            src.add(2).read_volatile(),
            src.add(3).read_volatile(),
            src.add(4).read_volatile(),
            src.add(5).read_volatile(),
        ]
    }
}

/// Writes `mac` to `dst` (a map value or the stack) a byte at a time: a
/// plain six-byte store to a pointer LLVM does not know the alignment of
/// is emitted as a call to the `memset`/`memmove` BPF function (see
/// [`load_mac`]).
///
/// # Safety
/// `dst` must be valid for writing 6 bytes.
#[inline(always)]
pub unsafe fn store_mac(dst: *mut Mac, mac: Mac) {
    let dst = dst.cast::<u8>();
    // SAFETY: the caller's guarantee covers all 6 bytes.
    unsafe {
        for (i, byte) in mac.into_iter().enumerate() {
            dst.add(i).write_volatile(byte);
        }
    }
}

/// Reads the address at `src` (map memory) into registers, a word at a
/// time, for the reason [`load_mac`] gives: copied from a map value into a
/// flow entry, it became a call to `memmove` with a 16-byte loop.
///
/// # Safety
/// `src` must be valid for reading 16 bytes, aligned to 4.
#[inline(always)]
pub unsafe fn load_addr(src: *const [u32; 4]) -> [u32; 4] {
    let src = src.cast::<u32>();
    // SAFETY: the caller's guarantee covers all four words.
    unsafe {
        [
            src.read_volatile(),
            src.add(1).read_volatile(),
            src.add(2).read_volatile(),
            src.add(3).read_volatile(),
        ]
    }
}

/// Word access to packet memory: one load or store instruction for a
/// 16- or 32-bit field at any offset.
///
/// Header fields sit at even offsets that are often not multiples of 4 (an
/// IPv4 address is 26 bytes into the frame). `read_unaligned` and
/// `write_unaligned` have defined behaviour there, but the BPF target
/// declares no misaligned access, so LLVM splits them into byte loads,
/// shifts and ors: a 5-tuple and a NAT rewrite became about 150
/// instructions on every packet. The kernel itself accepts a word access
/// to packet memory at any offset (on architectures with efficient
/// unaligned access; elsewhere, and under `BPF_F_STRICT_ALIGNMENT`, it
/// checks alignment as if the frame started 2 bytes in, `NET_IP_ALIGN`,
/// which makes every IP and TCP/UDP field used here aligned). A plain
/// `read()` of a misaligned pointer would be undefined behaviour in Rust, so
/// each access is one instruction of inline assembly, whose behaviour is
/// the instruction's. Values are in memory byte order, as with
/// `read_unaligned` on this little-endian target.
pub mod word {
    use core::arch::asm;

    /// # Safety
    /// `p` must be bounds-checked packet memory valid for 2 bytes.
    #[inline(always)]
    pub unsafe fn read16(p: *const u16) -> u16 {
        let v: u64;
        // SAFETY: the caller's guarantee; the instruction only reads.
        unsafe {
            asm!("{v} = *(u16 *)({p} + 0)", p = in(reg) p, v = lateout(reg) v,
                options(nostack, readonly, preserves_flags));
        }
        v as u16
    }

    /// # Safety
    /// `p` must be bounds-checked packet memory valid for 4 bytes.
    #[inline(always)]
    pub unsafe fn read32(p: *const u32) -> u32 {
        let v: u64;
        // SAFETY: the caller's guarantee; the instruction only reads.
        unsafe {
            asm!("{v} = *(u32 *)({p} + 0)", p = in(reg) p, v = lateout(reg) v,
                options(nostack, readonly, preserves_flags));
        }
        v as u32
    }

    /// # Safety
    /// `p` must be bounds-checked, writable packet memory valid for 2 bytes.
    #[inline(always)]
    pub unsafe fn write16(p: *mut u16, v: u16) {
        // SAFETY: the caller's guarantee.
        unsafe {
            asm!("*(u16 *)({p} + 0) = {v}", p = in(reg) p, v = in(reg) u64::from(v),
                options(nostack, preserves_flags));
        }
    }

    /// # Safety
    /// `p` must be bounds-checked, writable packet memory valid for 4 bytes.
    #[inline(always)]
    pub unsafe fn write32(p: *mut u32, v: u32) {
        // SAFETY: the caller's guarantee.
        unsafe {
            asm!("*(u32 *)({p} + 0) = {v}", p = in(reg) p, v = in(reg) u64::from(v),
                options(nostack, preserves_flags));
        }
    }
}

/// Call first in every `#[inline(never)]` function that takes the context.
/// A volatile load through the context pointer stops LLVM's argument
/// promotion from passing the loaded `data`/`data_end` fields instead of the
/// pointer: the verifier sees such values as 32-bit scalars after the call
/// and rejects using them as packet pointers. The field read is `data`: the
/// verifier turns it into one load, where `ingress_ifindex` takes three
/// dependent ones (`xdp_buff` → `rxq` → `dev` → `ifindex`).
#[inline(always)]
pub fn keep_ctx_pointer(ctx: &XdpContext) {
    // SAFETY: the context pointer the kernel passed is valid for the whole run.
    let _ = unsafe { core::ptr::read_volatile(&raw const (*ctx.ctx).data) };
}

/// Returns a pointer to a `T` at `offset` from the start of the frame, or
/// `None` if any byte of it lies beyond `data_end`.
#[inline(always)]
pub fn ptr_at<T>(ctx: &XdpContext, offset: usize) -> Option<*mut T> {
    let start = ctx.data();
    let end = ctx.data_end();
    if start + offset + size_of::<T>() > end {
        return None;
    }
    Some((start + offset) as *mut T)
}

/// Swaps the frame's Ethernet addresses (the cheapest useful XDP_TX);
/// false if the frame is shorter than an Ethernet header's addresses.
#[inline(always)]
pub fn swap_macs(ctx: &XdpContext) -> bool {
    let (Some(dst), Some(src)) = (
        ptr_at::<Mac>(ctx, crate::wire::ETH_DST_OFF),
        ptr_at::<Mac>(ctx, crate::wire::ETH_SRC_OFF),
    ) else {
        return false;
    };
    // Through registers: `core::ptr::swap` between two packet pointers
    // compiles to calls of the `memmove` BPF function (see [`load_mac`]).
    // SAFETY: both 6-byte fields were bounds-checked; [u8; 6] has alignment 1.
    unsafe {
        let (d, s) = (load_mac(dst), load_mac(src));
        dst.write(s);
        src.write(d);
    }
    true
}

/// Reads `N` consecutive 32-bit words (memory byte order) at `offset`,
/// bounds-checked, with one load instruction each (see [`word`]).
#[inline(always)]
pub fn load_words<const N: usize>(ctx: &XdpContext, offset: usize) -> Option<[u32; N]> {
    let at = ptr_at::<[u32; N]>(ctx, offset)?.cast::<u32>();
    let mut words = [0; N];
    for (i, w) in words.iter_mut().enumerate() {
        // SAFETY: `ptr_at` proved all `N` words are inside the frame.
        *w = unsafe { word::read32(at.add(i)) };
    }
    Some(words)
}

/// Reads a `T` (any alignment) at `offset`, bounds-checked.
#[inline(always)]
pub fn load<T: Copy>(ctx: &XdpContext, offset: usize) -> Option<T> {
    // SAFETY: `ptr_at` proved the `size_of::<T>()` bytes are inside the frame.
    ptr_at::<T>(ctx, offset).map(|p| unsafe { p.read_unaligned() })
}

/// A whole datagram.
pub const FRAG_NONE: u8 = 0;
/// The first fragment of a datagram: it carries the TCP/UDP header.
pub const FRAG_FIRST: u8 = 1;
/// A later fragment: no TCP/UDP header. `parse::parse_into` gives it the
/// ports its datagram's first fragment left in `FRAGMENTS` (or passes it
/// when there are none), `tcp_flags` is 0, and `l4` is where its payload
/// starts (never rewritten).
pub const FRAG_LATER: u8 = 2;

/// A parsed IPv4 or IPv6 TCP or UDP packet, with its 5-tuple in wire byte
/// order. For an ICMP error about a flow, the quoted packet's reverse
/// 5-tuple (see `parse::icmp`).
///
/// Its first 40 bytes are the packet's [`FlowKey`], field for field (see
/// [`Packet::flow_key`]): the flow lookup reads the key where the parser
/// wrote it, instead of a copy built with narrow stores on the stack.
#[derive(Clone, Copy)]
#[repr(C)]
pub struct Packet {
    /// Addresses as the `u32` words whose memory bytes are the address bytes
    /// (IPv4: word 0, the rest zero).
    pub saddr: [u32; 4],
    pub daddr: [u32; 4],
    /// Ports in network byte order.
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    /// `AF_INET` or `AF_INET6`.
    pub family: u8,
    /// Zero: the key's padding ([`FlowKey::_pad`]).
    pub key_pad: [u8; 2],
    /// Offset of the IP header.
    pub l3: usize,
    /// Offset of the TCP/UDP (or ICMP) header.
    pub l4: usize,
    /// `wire::TCP_*` bits; 0 for UDP.
    pub tcp_flags: u8,
    /// [`FRAG_NONE`], [`FRAG_FIRST`] or [`FRAG_LATER`].
    pub frag: u8,
    /// The datagram's identification when `frag` is not [`FRAG_NONE`]
    /// (see `lb_common::FragKey::id`).
    pub frag_id: u32,
    /// L4 payload bytes according to the IP length field. For an ICMP
    /// error: the length of the quoted IP header.
    pub payload_len: u32,
    /// Whole frame length, for byte counters.
    pub frame_len: u32,
}

// `Packet::flow_key`'s cast: the key's fields at the key's offsets.
const _: () = {
    use core::mem::offset_of;
    assert!(offset_of!(Packet, saddr) == offset_of!(FlowKey, src));
    assert!(offset_of!(Packet, daddr) == offset_of!(FlowKey, dst));
    assert!(offset_of!(Packet, sport) == offset_of!(FlowKey, sport));
    assert!(offset_of!(Packet, dport) == offset_of!(FlowKey, dport));
    assert!(offset_of!(Packet, proto) == offset_of!(FlowKey, proto));
    assert!(offset_of!(Packet, family) == offset_of!(FlowKey, family));
    assert!(offset_of!(Packet, key_pad) == offset_of!(FlowKey, _pad));
    assert!(size_of::<FlowKey>() == offset_of!(Packet, key_pad) + 2);
    assert!(align_of::<Packet>() >= align_of::<FlowKey>());
};

impl Packet {
    /// The packet's flow key as received (its first 40 bytes; see the
    /// layout assertions above).
    #[inline(always)]
    pub fn flow_key(&self) -> &FlowKey {
        // SAFETY: `Packet` is `repr(C)` and starts with `FlowKey`'s fields
        // at `FlowKey`'s offsets with no padding between them (asserted
        // above), its alignment is at least `FlowKey`'s, and every field of
        // `FlowKey` is a plain integer.
        unsafe { &*(self as *const Self).cast::<FlowKey>() }
    }

    pub const fn is_v6(&self) -> bool {
        self.family == AF_INET6
    }

    pub const fn is_tcp(&self) -> bool {
        self.proto == IPPROTO_TCP
    }

    pub const fn has(&self, flag: u8) -> bool {
        self.tcp_flags & flag != 0
    }

    /// A connection opener: SYN without ACK.
    pub const fn is_syn(&self) -> bool {
        self.has(TCP_SYN) && !self.has(TCP_ACK)
    }
}
