//! The XDP_PASS stub on the switch-side peer of the balancer's veth.
//!
//! A native XDP_TX on a veth is silently dropped unless the peer veth runs an
//! XDP program of its own (DESIGN.md, "XDP_TX on veth"), so the lab loads
//! `xdp_pass_stub` from the embedded object and attaches it in driver mode.

use anyhow::{Context, Result};
use aya::{
    Ebpf, EbpfLoader,
    programs::{Xdp, XdpMode},
};
use lb_common::{FLOWS_MAP, FLOWS4_MAP};

use super::netns::in_netns;

/// Name of the stub program in `lb_user::EBPF_OBJECT`.
pub const STUB_PROGRAM: &str = "xdp_pass_stub";
/// The stub never touches the flow table; loading it with the default size
/// would only reserve memory for nothing.
const STUB_FLOW_ENTRIES: u32 = 64;

/// Keeps the stub attached: dropping it detaches the program.
pub struct XdpStub {
    _ebpf: Ebpf,
}

/// Loads the stub and attaches it to `iface` in namespace `ns`. aya resolves
/// the interface by name in the caller's namespace, so this runs on a thread
/// that joined `ns`; the link stays bound to that interface afterwards.
pub fn attach_pass_stub(ns: &str, iface: &str) -> Result<XdpStub> {
    in_netns(ns, || {
        let mut ebpf = EbpfLoader::new()
            .map_max_entries(FLOWS_MAP, STUB_FLOW_ENTRIES)
            .map_max_entries(FLOWS4_MAP, STUB_FLOW_ENTRIES)
            .load(crate::production::EBPF_OBJECT)
            .context("loading the embedded eBPF object")?;
        let program: &mut Xdp = ebpf
            .program_mut(STUB_PROGRAM)
            .with_context(|| format!("no program {STUB_PROGRAM} in the eBPF object"))?
            .try_into()?;
        program
            .load()
            .with_context(|| format!("loading {STUB_PROGRAM}"))?;
        program
            .attach(iface, XdpMode::Driver)
            .with_context(|| format!("attaching {STUB_PROGRAM} to {iface} in {ns}"))?;
        Ok(XdpStub { _ebpf: ebpf })
    })
}
