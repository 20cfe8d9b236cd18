//! Running weight sums for weighted random selection: the kernel draws a
//! number below the total and binary-searches the first slot whose running
//! sum exceeds it, so slot `i` is drawn with probability `w_i / Σ w`.

/// `out[i] = weights[0] + … + weights[i]`, saturating at `u32::MAX` (a
/// VIP's 1024 slots of weight ≤ 65535 sum to at most 2^26, far below it).
pub fn running_sums(weights: &[u32]) -> Vec<u32> {
    weights
        .iter()
        .scan(0u32, |sum, &w| {
            *sum = sum.saturating_add(w);
            Some(*sum)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_run_over_the_slots() {
        assert_eq!(running_sums(&[3, 1, 2]), [3, 4, 6]);
        assert!(running_sums(&[]).is_empty());
    }

    #[test]
    fn a_binary_search_over_the_sums_draws_each_slot_by_weight() {
        // The kernel's search, over every possible draw: the number of
        // targets landing on each slot is its weight.
        let weights = [5, 1, 3, 1];
        let sums = running_sums(&weights);
        let mut hits = [0; 4];
        for target in 0..*sums.last().unwrap() {
            hits[sums.partition_point(|&s| s <= target)] += 1;
        }
        assert_eq!(hits, weights);
    }
}
