//! The lab needs root (namespaces, veths, XDP). Without it tests skip loudly
//! instead of failing, so a plain `cargo test` as a user stays usable. Under
//! `cargo xtask test` (the README's and CI's test command) a skip is a
//! failure: xtask sets [`REQUIRE_ROOT_ENV`] and the macro panics instead.

/// Set by `cargo xtask test`: privileged tests must run, never skip.
pub const REQUIRE_ROOT_ENV: &str = "LB_TESTS_REQUIRE_ROOT";

/// True when skipping is not allowed (see [`REQUIRE_ROOT_ENV`]).
pub fn skips_forbidden() -> bool {
    std::env::var_os(REQUIRE_ROOT_ENV).is_some_and(|v| !v.is_empty() && v != "0")
}

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
            if $crate::root::skips_forbidden() {
                panic!(
                    "needs root, and {} forbids skipping: run the tests as root",
                    $crate::root::REQUIRE_ROOT_ENV
                );
            }
            eprintln!();
            eprintln!("************************************************************");
            eprintln!("*** SKIPPED: needs root (network namespaces, veth, XDP) ***");
            eprintln!("************************************************************");
            return;
        }
    };
}
