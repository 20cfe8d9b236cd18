//! The lab needs root (namespaces, veths, XDP). Without it tests skip loudly
//! instead of failing, so a plain `cargo test` as a user stays usable.

/// True when the process runs with effective uid 0.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Set by `cargo xtask test` (as CI runs it): a test that would skip fails instead.
pub const REQUIRE_ROOT_ENV: &str = "LB_TESTS_REQUIRE_ROOT";

/// Writes `text` to the process's stderr directly. libtest captures what
/// `eprintln!` prints in a test and shows it only if the test fails, so a
/// skip banner printed with it would vanish from a passing (skipped) test's
/// output; a write to the stderr handle is not captured.
pub fn write_uncaptured(text: &str) {
    use std::io::Write as _;
    // Nothing to do if stderr is gone.
    let _ = std::io::stderr().lock().write_all(text.as_bytes());
}

/// The banner of a test skipped for want of root.
pub const SKIP_BANNER: &str = "
************************************************************
*** SKIPPED: needs root (network namespaces, veth, XDP) ***
************************************************************
";

/// Returns early from the calling test, with a banner that is hard to miss in
/// the test output ([`SKIP_BANNER`], not captured by libtest: see
/// [`write_uncaptured`]), when the process is not root; panics instead when
/// [`REQUIRE_ROOT_ENV`] is set.
#[macro_export]
macro_rules! require_root {
    () => {
        if !$crate::root::is_root() {
            if std::env::var_os($crate::root::REQUIRE_ROOT_ENV).is_some() {
                panic!("needs root, and LB_TESTS_REQUIRE_ROOT forbids skipping");
            }
            $crate::root::write_uncaptured($crate::root::SKIP_BANNER);
            return;
        }
    };
}
