//! The per-packet functions of the eBPF object call no `memmove`, `memset`
//! or `memcpy`.
//!
//! LLVM turns a copy between two pointers it cannot tell apart (a map value
//! into a flow entry, a MAC into the frame) and a small unaligned clear into
//! calls of these functions, which bpf-linker provides as BPF functions that
//! loop over the bytes: a call, a return (about 10 ns each on a machine with
//! return thunks) and the loop, on every packet. `packet::load_mac`,
//! `load_addr` and `store_mac` keep such copies in registers. Nothing in the
//! compiler says when a new copy slips back in; this test does, by reading
//! the release object's relocations.
use std::collections::BTreeSet;

use object::{Object, ObjectSection, ObjectSymbol, RelocationTarget, SymbolKind};

/// The byte-loop functions bpf-linker links in.
const BYTE_LOOPS: [&str; 3] = ["memmove", "memset", "memcpy"];

/// Functions every packet, or every new flow, runs through: the program, the
/// fast path, the general pipeline of each family and its parser, the pick
/// and the flow's creation. (Their Rust names, as they appear in the
/// mangled symbols.)
const PER_PACKET: [&str; 8] = [
    "lb_xdp",
    "send_established",
    "send_established_ipv6",
    "lb_general_v4",
    "lb_general_v6",
    "parse_into",
    "lb_pick_backend",
    "lb_new_flow",
];

/// Every function of `object` that calls one of [`BYTE_LOOPS`], by symbol name.
fn functions_calling_byte_loops(object: &object::File) -> BTreeSet<String> {
    let mut callers = BTreeSet::new();
    for section in object.sections() {
        let functions: Vec<_> = object
            .symbols()
            .filter(|s| s.kind() == SymbolKind::Text && s.section_index() == Some(section.index()))
            .filter_map(|s| Some((s.address(), s.size(), s.name().ok()?.to_string())))
            .collect();
        for (offset, relocation) in section.relocations() {
            let RelocationTarget::Symbol(target) = relocation.target() else {
                continue;
            };
            let Ok(target) = object.symbol_by_index(target) else {
                continue;
            };
            if !BYTE_LOOPS.contains(&target.name().unwrap_or_default()) {
                continue;
            }
            let caller = functions
                .iter()
                .find(|(start, size, _)| (*start..start + size).contains(&offset))
                .map_or_else(
                    || format!("{}+{offset:#x}", section.name().unwrap_or("?")),
                    |f| f.2.clone(),
                );
            callers.insert(caller);
        }
    }
    callers
}

/// Whether the (possibly mangled) symbol `symbol` names the Rust function
/// `name`, or an instance of it if it is generic: v0 mangling writes each
/// identifier as its length then its bytes, and an instance's const
/// arguments after it, each starting with `K`.
fn names(symbol: &str, name: &str) -> bool {
    let ident = format!("{}{name}", name.len());
    symbol == name || symbol.ends_with(&ident) || symbol.contains(&format!("{ident}K"))
}

#[test]
fn per_packet_functions_call_no_byte_loops() {
    let object =
        object::File::parse(lb_lab::production::EBPF_OBJECT).expect("parse the eBPF object");
    let callers = functions_calling_byte_loops(&object);
    // The search itself works: the object does call them somewhere (rare
    // paths such as an event's padding), so an empty set would mean the
    // relocations were not read.
    assert!(
        !callers.is_empty(),
        "no relocation to {BYTE_LOOPS:?} found at all"
    );
    let hot: Vec<_> = callers
        .iter()
        .filter(|caller| PER_PACKET.iter().any(|name| names(caller, name)))
        .collect();
    assert!(
        hot.is_empty(),
        "per-packet functions call a byte-loop memmove/memset/memcpy: {hot:?} (every caller: {callers:?})"
    );
    // Each per-packet function is in the object under the name looked for.
    for name in PER_PACKET {
        assert!(
            object
                .symbols()
                .any(|s| s.kind() == SymbolKind::Text && s.name().is_ok_and(|n| names(n, name))),
            "no function {name} in the object"
        );
    }
}
