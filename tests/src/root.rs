//! The lab needs root (namespaces, veths, XDP). Without it tests skip loudly
//! instead of failing, so a plain `cargo test` as a user stays usable.

/// True when the process runs with effective uid 0.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Returns early from the calling test, with a banner that is hard to miss in
/// the test output, when the process is not root.
#[macro_export]
macro_rules! require_root {
    () => {
        if !$crate::root::is_root() {
            eprintln!();
            eprintln!("************************************************************");
            eprintln!("*** SKIPPED: needs root (network namespaces, veth, XDP) ***");
            eprintln!("************************************************************");
            return;
        }
    };
}
