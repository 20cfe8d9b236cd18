//! Integer arithmetic the BPF target can run.

/// `a × b`, or `u64::MAX` on overflow. `u64::saturating_mul` needs a 128-bit
/// multiply (`__multi3`), which BPF cannot call, and LLVM turns the usual
/// `b > u64::MAX / a` test back into one. Testing against `u64::MAX - 1`
/// is exact too (`a × b ≥ MAX` exactly when `b > (MAX - 1) / a`) and stays a
/// plain division.
#[inline(always)]
pub const fn saturating_mul(a: u64, b: u64) -> u64 {
    if a != 0 && b > (u64::MAX - 1) / a {
        u64::MAX
    } else {
        // Cannot wrap (checked above); `wrapping_mul` keeps an overflow
        // check, and its panic path, out of debug builds of the kernel.
        a.wrapping_mul(b)
    }
}

#[cfg(test)]
mod tests {
    use super::saturating_mul;
    use proptest::prelude::*;

    #[test]
    fn edges() {
        assert_eq!(saturating_mul(0, u64::MAX), 0);
        assert_eq!(saturating_mul(u64::MAX, 0), 0);
        assert_eq!(saturating_mul(1, u64::MAX), u64::MAX);
        assert_eq!(saturating_mul(u64::MAX, 2), u64::MAX);
        assert_eq!(saturating_mul(1 << 32, 1 << 31), 1 << 63);
        assert_eq!(saturating_mul(1 << 32, 1 << 32), u64::MAX);
    }

    proptest! {
        #[test]
        fn equals_the_standard_saturating_mul(a: u64, b: u64) {
            prop_assert_eq!(saturating_mul(a, b), a.saturating_mul(b));
        }

        #[test]
        fn equals_it_near_the_boundary(a in 1u64..=u64::MAX, d in -2i64..=2) {
            // b around MAX / a, where the overflow test decides.
            let b = (u64::MAX / a).saturating_add_signed(d);
            prop_assert_eq!(saturating_mul(a, b), a.saturating_mul(b));
        }
    }
}
