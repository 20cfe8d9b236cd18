//! nginx's smooth weighted round-robin, unrolled into a schedule.
//!
//! Each step every slot gains its weight in "current" credit, the slot with
//! the most credit is chosen and pays back the total. Over one period of
//! `Σ weights` steps each slot is chosen exactly its weight in times, spread
//! out as evenly as the weights allow (weights 5,1,1 give a a b a c a a, not
//! a a a a a b c). The kernel walks the schedule with an atomic cursor.

/// The smooth WRR sequence of slot indexes for `weights` (one per slot),
/// reduced by their common divisor and scaled to at most `max_len` steps.
/// Every slot keeps at least one step, so `max_len` must be at least the
/// number of slots for the shares to stay exact; above it they are
/// approximate. Empty when `weights` is.
pub fn schedule(weights: &[u32], max_len: usize) -> Vec<u32> {
    let reduced = fit(weights, max_len);
    let total: i64 = reduced.iter().map(|&w| i64::from(w)).sum();
    let mut current = vec![0i64; reduced.len()];
    let mut out = Vec::with_capacity(total as usize);
    for _ in 0..total {
        for (c, &w) in current.iter_mut().zip(&reduced) {
            *c += i64::from(w);
        }
        // Ties go to the lowest slot, as in nginx's list walk.
        let (best, _) =
            current.iter().enumerate().fold(
                (0, i64::MIN),
                |acc, (i, &c)| if c > acc.1 { (i, c) } else { acc },
            );
        current[best] -= total;
        out.push(best as u32);
    }
    out
}

/// Weights divided by their gcd, then (if their sum still exceeds
/// `max_len`) scaled into `max_len` keeping every weight at least 1.
fn fit(weights: &[u32], max_len: usize) -> Vec<u32> {
    let g = weights.iter().copied().fold(0, gcd).max(1);
    let reduced: Vec<u64> = weights.iter().map(|&w| u64::from(w / g)).collect();
    let sum: u64 = reduced.iter().sum();
    let n = reduced.len() as u64;
    let max_len = max_len as u64;
    if sum <= max_len || n == 0 {
        return reduced.iter().map(|&w| w as u32).collect();
    }
    // 1 + w × budget / sum ≤ 1 + budget share, so the total stays ≤ max_len.
    let budget = max_len.saturating_sub(n);
    let scaled: Vec<u32> = reduced
        .iter()
        .map(|&w| (1 + w * budget / sum) as u32)
        .collect();
    let g = scaled.iter().copied().fold(0, gcd).max(1);
    scaled.iter().map(|&w| w / g).collect()
}

fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 { a } else { gcd(b, a % b) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(schedule: &[u32], slots: usize) -> Vec<usize> {
        let mut c = vec![0; slots];
        for &s in schedule {
            c[s as usize] += 1;
        }
        c
    }

    #[test]
    fn matches_nginx_sequence_for_5_1_1() {
        assert_eq!(schedule(&[5, 1, 1], 2048), [0, 0, 1, 0, 2, 0, 0]);
    }

    #[test]
    fn each_slot_appears_its_reduced_weight_in_times() {
        let s = schedule(&[6, 3, 9, 3], 2048);
        assert_eq!(s.len(), 7);
        assert_eq!(counts(&s, 4), [2, 1, 3, 1]);
        assert_eq!(schedule(&[1, 1, 1], 2048), [0, 1, 2]);
        assert!(schedule(&[], 2048).is_empty());
    }

    #[test]
    fn no_backend_is_hit_in_bursts() {
        // Weight 3 of 4: never more than 3 in a row; the weight-1 slot
        // appears once per period. With 2:2 they alternate.
        let s = schedule(&[3, 1], 2048);
        assert_eq!(s, [0, 0, 1, 0]);
        assert_eq!(schedule(&[2, 2, 1], 2048), [0, 1, 2, 0, 1]);
    }

    #[test]
    fn large_weights_are_scaled_into_the_cap_keeping_every_slot() {
        let weights: Vec<u32> = (1..=100).map(|i| i * 1000 + 1).collect();
        let s = schedule(&weights, 2048);
        assert!(s.len() <= 2048, "{}", s.len());
        let c = counts(&s, 100);
        assert!(c.iter().all(|&n| n >= 1));
        // Shares stay close to the weights: the heaviest gets ~100× the lightest.
        let ratio = c[99] as f64 / c[0] as f64;
        assert!((20.0..=110.0).contains(&ratio), "{ratio}");
        let s = schedule(&[65535, 1], 2048);
        assert_eq!(counts(&s, 2)[1], 1);
        assert!(s.len() <= 2048);
    }
}
