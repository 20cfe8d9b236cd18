#![no_std]
#![no_main]

mod maps;

use aya_ebpf::{bindings::xdp_action, macros::xdp, programs::XdpContext};

#[xdp]
pub fn lb_xdp(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_PASS
}

/// Does nothing but pass. Labs attach it to the peer of a veth that runs
/// `lb_xdp` in native mode: a native XDP_TX on veth is dropped unless the
/// peer has an XDP program of its own (DESIGN.md, "XDP_TX on veth").
#[xdp]
pub fn xdp_pass_stub(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_PASS
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
