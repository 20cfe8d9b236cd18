//! Host tests of the P2C arithmetic: examples, properties (proptest), and
//! the decision run end to end over a simulated pool with a seeded draw.
use core::num::NonZeroU32;

use proptest::prelude::*;

use super::*;

fn n(count: u32) -> NonZeroU32 {
    NonZeroU32::new(count).expect("non-zero count")
}

/// A candidate of weight 1 (its cost is what the bound compares).
fn cand(id: u32, cost: u64, score: u64) -> Candidate {
    Candidate {
        id,
        weight: 1,
        cost,
        score,
    }
}

/// A small deterministic generator (SplitMix64), the tests' stand-in for
/// `bpf_get_prandom_u32`.
struct Draw(u64);

impl Draw {
    fn next(&mut self) -> u32 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)) as u32
    }
}

// ---- bias, bound, score ----

#[test]
fn bias_defaults_and_clamps() {
    assert_eq!(inflight_bias(0), crate::DEFAULT_INFLIGHT_BIAS);
    for b in crate::MIN_INFLIGHT_BIAS..=crate::MAX_INFLIGHT_BIAS {
        assert_eq!(inflight_bias(b), b);
    }
    assert_eq!(
        inflight_bias(crate::MAX_INFLIGHT_BIAS + 1),
        crate::MAX_INFLIGHT_BIAS
    );
    assert_eq!(inflight_bias(u8::MAX), crate::MAX_INFLIGHT_BIAS);
}

#[test]
fn redraw_bound_is_three_times_the_median_and_zero_disables() {
    assert_eq!(redraw_bound(0), 0);
    assert_eq!(redraw_bound(1_000), 3_000);
    assert_eq!(redraw_bound(u64::MAX / 2), u64::MAX);
    assert!(!cand(0, u64::MAX, 0).far_above(0));
}

#[test]
fn score_is_cost_times_inflight_plus_one_to_the_bias() {
    assert_eq!(score(7, 0, 2), 7);
    assert_eq!(score(7, 3, 0), 7);
    assert_eq!(score(7, 3, 1), 28);
    assert_eq!(score(7, 3, 2), 112);
    assert_eq!(score(7, 3, 3), 448);
    assert_eq!(score(u64::MAX / 2, 1, 2), u64::MAX);
    assert_eq!(score(5, u64::MAX, 1), u64::MAX);
}

#[test]
fn the_bound_compares_latency_not_cost_per_weight() {
    assert_eq!(unweighted_cost(7, 0), 7, "no weight written counts as 1");
    assert_eq!(unweighted_cost(7, 100), 700);
    assert_eq!(unweighted_cost(u64::MAX / 2, 3), u64::MAX);
    let at = |cost, weight| {
        let load = Load {
            cost,
            weight,
            ..Load::default()
        };
        candidate(0, load, 2, 0)
    };
    // Weight 1 next to weight 4, as fast: the same latency, so the same
    // cost against the bound (the median's), and within it.
    let (light, heavy) = (at(400, 1), at(100, 4));
    assert_eq!((light.cost, heavy.cost), (400, 400));
    let bound = redraw_bound(400);
    assert!(!light.far_above(bound) && !heavy.far_above(bound));
    // The weight still counts in the score: idle, the heavier one wins.
    assert!(heavy.beats(&light, bound));
    assert!(settles_scan(&light, bound));
    // Weight 4 and 4x slower: far above.
    assert!(at(400, 4).far_above(bound));
}

#[test]
fn candidate_counts_an_unwritten_cost_as_one() {
    assert_eq!(
        candidate(9, Load::default(), 2, 0),
        Candidate {
            weight: 0,
            ..cand(9, 1, 1)
        }
    );
    let busy = Load {
        inflight: 1,
        ..Load::default()
    };
    assert_eq!(
        candidate(9, busy, 2, 0),
        Candidate {
            weight: 0,
            ..cand(9, 1, 4)
        }
    );
}

#[test]
fn a_stall_counts_only_with_flows_in_flight() {
    let idle = Load {
        cost: 100,
        ewma_ns: 1,
        weight: 0,
        inflight: 0,
        last_progress_ns: 1,
        held: 0,
        saturation: 0,
    };
    assert_eq!(candidate(1, idle, 2, 1 << 40).cost, 100);
    let busy = Load {
        inflight: 1,
        ..idle
    };
    let c = candidate(1, busy, 2, 1 << 40);
    assert!(c.cost > 100, "a long stall raises the cost");
    assert_eq!(c.score, c.cost * 4);
}

// ---- stall scaling ----

#[test]
fn stall_scaling_examples() {
    let floor = STALL_FLOOR_NS;
    // No progress recorded: unchanged.
    assert_eq!(stall_scaled(50, 0, 0, 100 * floor), 50);
    // Within the floor (or the EWMA): unchanged.
    assert_eq!(stall_scaled(50, 0, floor, 2 * floor), 50);
    assert_eq!(stall_scaled(50, 4 * floor, floor, 4 * floor), 50);
    // Beyond: scaled by age / threshold.
    assert_eq!(stall_scaled(50, 0, floor, 5 * floor), 200);
    assert_eq!(stall_scaled(50, 2 * floor, floor, 9 * floor), 200);
    // A clock behind the progress stamp is no stall.
    assert_eq!(stall_scaled(50, 0, 10 * floor, floor), 50);
    // Saturates instead of wrapping.
    assert_eq!(stall_scaled(u64::MAX, 0, 1, u64::MAX), u64::MAX);
}

// ---- the pair's winner ----

#[test]
fn lower_score_wins_and_a_tie_goes_to_the_first() {
    let (a, b) = (cand(1, 10, 40), cand(2, 10, 30));
    assert_eq!(winner(Some(a), Some(b), 0), Some(b));
    assert_eq!(winner(Some(b), Some(a), 0), Some(b));
    let tie = cand(3, 10, 40);
    assert_eq!(winner(Some(a), Some(tie), 0), Some(a));
    assert_eq!(winner(Some(tie), Some(a), 0), Some(tie));
    assert_eq!(winner(Some(a), None, 0), Some(a));
    assert_eq!(winner(None, Some(b), 0), Some(b));
    assert_eq!(winner(None, None, 0), None);
}

#[test]
fn within_the_bound_beats_far_above_whatever_the_scores() {
    let bound = 300;
    let slow_idle = cand(1, 1_000, 1_000);
    let fast_busy = cand(2, 100, 100 * 1_000);
    assert!(fast_busy.beats(&slow_idle, bound));
    assert!(!slow_idle.beats(&fast_busy, bound));
    assert_eq!(
        winner(Some(slow_idle), Some(fast_busy), bound),
        Some(fast_busy)
    );
    // Without a bound, the scores decide.
    assert_eq!(winner(Some(slow_idle), Some(fast_busy), 0), Some(slow_idle));
}

#[test]
fn a_saturated_candidate_within_the_bound_meets_far_above_on_scores() {
    let bound = 300;
    // A staller just after its pause, idle, against a steady backend with
    // two requests queued behind its two workers.
    let staller = cand(1, 1_000, 1_000);
    let steady = |inflight| {
        candidate(
            2,
            Load {
                cost: 100,
                inflight,
                saturation: SATURATED_INFLIGHT,
                ..Load::default()
            },
            inflight_bias(0),
            0,
        )
    };
    let below = steady(SATURATED_INFLIGHT - 1);
    assert_eq!((below.cost, below.score), (100, 1_600));
    assert!(below.beats(&staller, bound));
    let at = steady(SATURATED_INFLIGHT);
    assert_eq!((at.cost, at.score), (u64::MAX, 2_500));
    assert!(at.far_above(bound));
    assert!(staller.beats(&at, bound));
    assert_eq!(winner(Some(at), Some(staller), bound), Some(staller));
    assert!(rank(&staller, bound) < rank(&at, bound));
    // A staller still in its pause (stall-scaled far beyond) stays out.
    let paused = cand(1, 100_000, 100_000);
    assert!(at.beats(&paused, bound));
    assert!(rank(&at, bound) < rank(&paused, bound));
    // An unsaturated one still ranks before the saturated one, and is not
    // redrawn; a saturated winner is (a third backend may have room).
    assert!(rank(&below, bound) < rank(&at, bound));
    assert_eq!(
        replay(bound, &[Some(below), Some(staller)]),
        (Some(below), 1)
    );
    assert_eq!(replay(bound, &[Some(at), Some(below)]), (Some(below), 2));
    // Without a bound the scores decide, saturated or not.
    assert!(below.beats(&at, 0) && staller.beats(&below, 0));
}

#[test]
fn the_saturation_threshold_is_the_vips_and_zero_turns_it_off() {
    let at = |inflight, saturation| {
        candidate(
            1,
            Load {
                cost: 100,
                inflight,
                saturation,
                ..Load::default()
            },
            inflight_bias(0),
            0,
        )
        .cost
    };
    for inflight in [0, 1, 3, 4, 1_000, 1 << 40] {
        assert_eq!(at(inflight, 0), 100, "off at {inflight}");
    }
    assert_eq!(at(7, 8), 100);
    assert_eq!(at(8, 8), u64::MAX);
    assert_eq!(at(0, 1), 100);
    assert_eq!(at(1, 1), u64::MAX);
    assert_eq!(at(u64::from(u16::MAX), u64::from(u16::MAX)), u64::MAX);
}

#[test]
fn a_held_backend_is_far_above_at_any_cost_and_scores_its_own() {
    let bound = 300;
    let load = Load {
        cost: 100,
        inflight: 1,
        held: SCORE_FAR_ABOVE,
        saturation: SATURATED_INFLIGHT,
        ..Load::default()
    };
    let held = candidate(1, load, inflight_bias(0), 0);
    // Its one flow in flight and the threshold's 4 on top: 100 × (1 + 4 + 1)².
    assert_eq!((held.cost, held.score), (u64::MAX, 3600));
    assert!(held.far_above(bound));
    // Behind an unsaturated backend within the bound, even a busier one...
    let steady = candidate(
        2,
        Load {
            cost: 100,
            inflight: SATURATED_INFLIGHT - 1,
            saturation: SATURATED_INFLIGHT,
            ..Load::default()
        },
        inflight_bias(0),
        0,
    );
    assert!(steady.beats(&held, bound));
    // Against a saturated one, by score, its own counted with the
    // threshold's flows on top: behind one as costly at 4 in flight
    // (2500), ahead of one twice as costly (5000).
    let saturated_at = |cost| {
        candidate(
            3,
            Load {
                cost,
                inflight: SATURATED_INFLIGHT,
                saturation: SATURATED_INFLIGHT,
                ..Load::default()
            },
            inflight_bias(0),
            0,
        )
    };
    assert!(saturated_at(100).beats(&held, bound));
    assert!(held.beats(&saturated_at(200), bound));
    // Other flag bits are not the hold.
    let other = candidate(
        4,
        Load {
            held: !SCORE_FAR_ABOVE,
            ..load
        },
        inflight_bias(0),
        0,
    );
    assert_eq!(other.cost, 100);
}

// ---- the draw of a pair ----

#[test]
fn a_single_slot_has_no_pair() {
    assert_eq!(Slots::new(n(1)), None);
    assert!(Slots::new(n(2)).is_some());
}

/// The pair drawn from `count` slots (at least two).
fn gen_pair(count: NonZeroU32, r1: u32, r2: u32) -> Option<(u32, u32)> {
    Slots::new(count).map(|slots| slots.gen_pair(r1, r2))
}

#[test]
fn every_ordered_pair_comes_from_exactly_one_pair_of_residues() {
    // r1 over 0..count and r2 over 0..count-1 map one to one onto the
    // count × (count-1) ordered pairs of distinct slots: the draw is
    // exactly uniform before the modulo's bias.
    for count in 2..=12u32 {
        let mut seen = vec![0u32; (count * count) as usize];
        for r1 in 0..count {
            for r2 in 0..count - 1 {
                let (a, b) = gen_pair(n(count), r1, r2).expect("two slots or more");
                assert_ne!(a, b);
                seen[(a * count + b) as usize] += 1;
            }
        }
        for a in 0..count {
            for b in 0..count {
                let expected = u32::from(a != b);
                assert_eq!(
                    seen[(a * count + b) as usize],
                    expected,
                    "count {count}: ({a}, {b})"
                );
            }
        }
    }
}

/// Pearson's chi-square statistic of `observed` against equal expectations.
fn chi_square(observed: &[u64]) -> f64 {
    let total: u64 = observed.iter().sum();
    let expected = total as f64 / observed.len() as f64;
    observed
        .iter()
        .map(|&o| {
            let d = o as f64 - expected;
            d * d / expected
        })
        .sum()
}

#[test]
fn random_pairs_are_uniform_over_the_slots() {
    // Chi-square against the uniform distribution, for the ordered pairs
    // and for each slot's share of the draws. The critical values are far
    // in the tail (p < 1e-6); the draw is seeded, so the test is stable.
    let mut draw = Draw(0x5eed);
    for (count, pairs_critical, slots_critical) in [
        (2u32, 40.0, 40.0),
        (3, 45.0, 45.0),
        (10, 180.0, 60.0),
        (33, 1_300.0, 100.0),
    ] {
        let draws = 200_000u64;
        let mut pairs = vec![0u64; (count * count) as usize];
        let mut slots = vec![0u64; count as usize];
        for _ in 0..draws {
            let (a, b) = gen_pair(n(count), draw.next(), draw.next()).expect("pair");
            pairs[(a * count + b) as usize] += 1;
            slots[a as usize] += 1;
            slots[b as usize] += 1;
        }
        let distinct: Vec<u64> = (0..count * count)
            .filter(|i| i / count != i % count)
            .map(|i| pairs[i as usize])
            .collect();
        let chi = chi_square(&distinct);
        assert!(
            chi < pairs_critical,
            "count {count}: pairs chi-square {chi}"
        );
        let chi = chi_square(&slots);
        assert!(
            chi < slots_critical,
            "count {count}: slots chi-square {chi}"
        );
        // And every slot within 5 % of its share.
        let share = 2.0 * draws as f64 / f64::from(count);
        for (slot, &hits) in slots.iter().enumerate() {
            let off = (hits as f64 - share).abs() / share;
            assert!(
                off < 0.05,
                "count {count}: slot {slot} drawn {hits} times, expected {share}"
            );
        }
    }
}

// ---- the decision with re-draws ----

/// Replays `pairs` as the successive pairs' winners, counting the draws.
fn replay(bound: u64, pairs: &[Option<Candidate>]) -> (Option<Candidate>, usize) {
    let mut next = 0;
    let chosen = choose(bound, || {
        let pair = pairs.get(next).copied().flatten();
        next += 1;
        pair
    });
    (chosen, next)
}

#[test]
fn empty_rounds_give_up_after_the_limit() {
    let (chosen, draws) = replay(0, &[None; 8]);
    assert_eq!((chosen, draws), (None, ROUNDS as usize));
    let late = [None, None, None, Some(cand(4, 1, 1))];
    assert_eq!(replay(0, &late), (Some(cand(4, 1, 1)), 4));
}

#[test]
fn a_winner_within_the_bound_is_kept_without_redraws() {
    let pairs = [Some(cand(1, 100, 900)), Some(cand(2, 1, 1))];
    assert_eq!(replay(300, &pairs), (Some(cand(1, 100, 900)), 1));
}

#[test]
fn a_winner_far_above_is_redrawn_at_most_twice() {
    let slow = Some(cand(1, 1_000, 1_000));
    let slower = Some(cand(2, 2_000, 2_000));
    let fast = Some(cand(3, 100, 10_000));
    assert_eq!(replay(300, &[slow, fast]), (fast, 2));
    assert_eq!(replay(300, &[slow, None, fast]), (fast, 3));
    assert_eq!(replay(300, &[slow, slower, slower, fast]), (slow, 3));
    // Among candidates all far above, the lower score wins.
    let slowish = Some(cand(4, 900, 900));
    assert_eq!(replay(300, &[slow, slowish, None]), (slowish, 3));
}

fn arb_candidate() -> impl Strategy<Value = Candidate> {
    (any::<u32>(), 0u64..10_000, 0u64..1_000_000)
        .prop_map(|(id, cost, score)| cand(id, cost, score))
}

proptest! {
    #[test]
    fn far_above_never_beats_within_bound(
        far in arb_candidate(), near in arb_candidate(), bound in 1u64..5_000,
    ) {
        let far = Candidate { cost: bound.saturating_add(1 + far.cost), ..far };
        let near = Candidate { cost: near.cost % (bound + 1), ..near };
        prop_assert!(!far.beats(&near, bound));
        prop_assert!(near.beats(&far, bound));
        prop_assert_eq!(winner(Some(far), Some(near), bound), Some(near));
        prop_assert_eq!(winner(Some(near), Some(far), bound), Some(near));
    }

    #[test]
    fn the_winner_is_consistent(a in arb_candidate(), b in arb_candidate(), bound in 0u64..20_000) {
        // Never both beat each other; the winner is one of the two, and
        // does not depend on the order unless the two tie.
        prop_assert!(!(a.beats(&b, bound) && b.beats(&a, bound)));
        prop_assert!(!a.beats(&a, bound));
        let w = winner(Some(a), Some(b), bound).expect("two candidates");
        prop_assert!(w == a || w == b);
        let tie = !a.beats(&b, bound) && !b.beats(&a, bound);
        if !tie {
            prop_assert_eq!(winner(Some(b), Some(a), bound), Some(w));
        } else {
            prop_assert_eq!(w, a);
        }
        // With both on the same side of the bound, the lower score wins.
        if a.far_above(bound) == b.far_above(bound) && a.score != b.score {
            prop_assert_eq!(w.score, a.score.min(b.score));
        }
    }

    #[test]
    fn pairs_are_distinct_and_in_range(count in 1u32..=4096, r1: u32, r2: u32) {
        match gen_pair(n(count), r1, r2) {
            None => prop_assert_eq!(count, 1),
            Some((a, b)) => {
                prop_assert!(a < count && b < count);
                prop_assert_ne!(a, b);
            }
        }
    }

    #[test]
    fn stall_scaling_is_monotone_in_the_age(
        cost in 1u64.., ewma: u64, since in 1u64..1 << 62,
        age in 0u64..1 << 62, more: u64,
    ) {
        let now = since + age;
        let scaled = stall_scaled(cost, ewma, since, now);
        let later = stall_scaled(cost, ewma, since, now.saturating_add(more));
        prop_assert!(scaled >= cost, "stalls never lower the cost");
        prop_assert!(later >= scaled, "{} then {}", scaled, later);
    }

    #[test]
    fn stall_scaling_is_monotone_in_the_cost(
        cost in 1u64..1 << 63, extra in 0u64..1 << 63, ewma: u64, since: u64,
        age: u64,
    ) {
        let now = since.saturating_add(age);
        prop_assert!(stall_scaled(cost + extra, ewma, since, now) >= stall_scaled(cost, ewma, since, now));
    }

    #[test]
    fn score_is_monotone(cost: u64, inflight in 0u64..1 << 20, bias in 0u8..=3) {
        let s = score(cost, inflight, bias);
        prop_assert!(s >= cost);
        prop_assert!(score(cost, inflight + 1, bias) >= s);
        if bias < 3 {
            prop_assert!(score(cost, inflight, bias + 1) >= s);
        }
    }

    #[test]
    fn redraws_keep_a_winner_within_the_bound(
        pairs in proptest::collection::vec(proptest::option::of(arb_candidate()), 0..10),
        bound in 0u64..10_000,
    ) {
        let (chosen, draws) = replay(bound, &pairs);
        prop_assert!(draws <= (ROUNDS + MAX_REDRAWS) as usize);
        let drawn: Vec<Candidate> = pairs.iter().take(draws).flatten().copied().collect();
        match chosen {
            None => {
                prop_assert_eq!(draws, ROUNDS as usize);
                prop_assert!(drawn.is_empty());
            }
            Some(c) => {
                prop_assert!(drawn.contains(&c));
                // A winner far above the pool means every pair drawn was.
                if c.far_above(bound) {
                    prop_assert!(drawn.iter().all(|d| d.far_above(bound)));
                }
            }
        }
    }
}

/// The whole decision over a simulated pool: 10 backends, `slow` of them
/// far above the median, all idle.
fn simulate(slow: u32, picks: u32) -> u32 {
    let costs: Vec<u64> = (0..10)
        .map(|i| if i < slow { 10_000 } else { 100 })
        .collect();
    let bound = redraw_bound(100);
    let count = n(10);
    let mut draw = Draw(42);
    let bias = inflight_bias(0);
    let mut slow_picks = 0;
    for _ in 0..picks {
        let mut draw_pair = || {
            let (a, b) = gen_pair(count, draw.next(), draw.next())?;
            let score_of = |slot: u32| {
                let load = Load {
                    cost: costs[slot as usize],
                    ..Load::default()
                };
                Some(candidate(slot, load, bias, 0))
            };
            winner(score_of(a), score_of(b), bound)
        };
        let chosen = choose(bound, &mut draw_pair).expect("all in service");
        slow_picks += u32::from(chosen.id < slow);
    }
    slow_picks
}

#[test]
fn one_slow_backend_of_ten_is_never_picked() {
    // Two distinct slots can never both be the one slow backend.
    assert_eq!(simulate(1, 50_000), 0);
}

#[test]
fn two_slow_backends_of_ten_are_picked_after_three_slow_pairs_only() {
    // A slow pick needs three slow pairs in a row: (2/90)^3, about 1e-5.
    let slow = simulate(2, 100_000);
    assert!(slow <= 10, "{slow} slow picks of 100000");
}

/// Where `cost × age` overflows u64, a stalled backend costs the most, not
/// the saturated product divided back down (which was below `cost`: a 1 s
/// EWMA at weight 1, stalled past 1 s, looked cheaper than before its stall).
#[test]
fn a_stall_whose_product_overflows_costs_the_most() {
    let (ewma, cost) = (1_000_000_000, 100_000_000_000);
    assert_eq!(stall_scaled(cost, ewma, 1, 1 + 2 * ewma), u64::MAX);
    assert_eq!(stall_scaled(cost, ewma, 1, 1 + ewma / 2), cost);
}

/// A queueing run over 10 equal backends of 2 workers each (service time
/// 10 ms, Poisson arrivals at 70 % of capacity): the share of requests
/// that had to wait for a worker while the pick was made by `pick`, which
/// gets each backend's in-flight count and a draw.
fn waiting_share(pick: impl Fn(&[u64], &mut Draw) -> u32) -> f64 {
    const SERVICE_US: u64 = 10_000;
    const REQUESTS: u32 = 50_000;
    let rate_per_us = 0.7 * 10.0 * 2.0 / SERVICE_US as f64;
    let mut draw = Draw(7);
    // Per backend: its two workers' free times, and its requests' ends.
    let mut workers = [[0u64; 2]; 10];
    let mut ends: Vec<Vec<u64>> = vec![Vec::new(); 10];
    let (mut now, mut waited) = (0u64, 0u32);
    for _ in 0..REQUESTS {
        let u = (f64::from(draw.next()) + 1.0) / 4_294_967_297.0;
        now += (-u.ln() / rate_per_us) as u64;
        for e in &mut ends {
            e.retain(|&end| end > now);
        }
        let inflight: Vec<u64> = ends.iter().map(|e| e.len() as u64).collect();
        let b = pick(&inflight, &mut draw) as usize;
        let w = &mut workers[b];
        let first_free = usize::from(w[1] < w[0]);
        let start = now.max(w[first_free]);
        waited += u32::from(start > now);
        w[first_free] = start + SERVICE_US;
        ends[b].push(start + SERVICE_US);
    }
    f64::from(waited) / f64::from(REQUESTS)
}

fn scored_pool(inflight: &[u64]) -> impl Iterator<Item = Candidate> + '_ {
    let load = |i: u64| Load {
        cost: 100,
        inflight: i,
        ..Load::default()
    };
    (0u32..)
        .zip(inflight)
        .map(move |(id, &i)| candidate(id, load(i), inflight_bias(0), 0))
}

#[test]
fn a_full_scan_queues_far_fewer_requests_than_pairs_on_a_small_pool() {
    let count = n(10);
    assert!(scans_all(count, 10) && scans_all(count, 16));
    assert!(!scans_all(count, 9) && !scans_all(count, 0));
    let pairs = waiting_share(|inflight, draw| {
        let mut draw_pair = || {
            let (a, b) = gen_pair(count, draw.next(), draw.next())?;
            let pool: Vec<Candidate> = scored_pool(inflight).collect();
            winner(Some(pool[a as usize]), Some(pool[b as usize]), 0)
        };
        choose(0, &mut draw_pair).expect("all in service").id
    });
    let full = waiting_share(|inflight, draw| {
        // The kernel's fold: from a random slot on, each candidate against
        // the best so far with `winner`.
        let start = draw.next() % 10;
        let pool: Vec<Candidate> = scored_pool(inflight).collect();
        (0..10)
            .map(|step| pool[((start + step) % 10) as usize])
            .fold(None, |best, c| winner(best, Some(c), 0))
            .expect("all in service")
            .id
    });
    // The kernel's rule: one pair first; its winner is kept if it
    // settles (idle, within the bound), else every backend is compared.
    let pair_then_scan = waiting_share(|inflight, draw| {
        let pool: Vec<Candidate> = scored_pool(inflight).collect();
        let (a, b) = gen_pair(count, draw.next(), draw.next()).expect("two slots");
        let first =
            winner(Some(pool[a as usize]), Some(pool[b as usize]), 0).expect("all in service");
        if settles_scan(&first, 0) {
            return first.id;
        }
        let start = draw.next() % 10;
        (0..10)
            .map(|step| pool[((start + step) % 10) as usize])
            .fold(None, |best, c| winner(best, Some(c), 0))
            .expect("all in service")
            .id
    });
    println!(
        "waited for a worker: pairs {pairs:.4}, full scan {full:.4}, \
         pair then scan {pair_then_scan:.4}"
    );
    // At 70 % load, pairs often hold two busy backends while another idles.
    assert!(pairs > 0.05, "pairs {pairs}");
    assert!(full < pairs / 3.0, "pairs {pairs}, full scan {full}");
    // An idle winner is as good as the scan's pick for queueing: the rule
    // keeps the scan's gain.
    assert!(
        pair_then_scan < pairs / 3.0,
        "pairs {pairs}, pair then scan {pair_then_scan}"
    );
}

/// A quiet pool of three equal backends whose estimates differ by a few
/// percent (as after a light run): every backend is idle at each pick. A
/// scan of all three hands every flow to the lowest estimate; the rule
/// ([`settles_scan`]) keeps P2C's pair, which spreads them.
#[test]
fn a_quiet_small_pool_keeps_the_pairs_spread() {
    let count = n(3);
    // Different coarse buckets, as the lab's three backends had.
    let costs = [8_000_000u64, 10_500_000, 12_000_000];
    assert!(coarse_score(costs[0]) < coarse_score(costs[1]));
    let pool: Vec<Candidate> = (0u32..)
        .zip(costs)
        .map(|(id, cost)| {
            candidate(
                id,
                Load {
                    cost,
                    ..Load::default()
                },
                2,
                0,
            )
        })
        .collect();
    let bound = redraw_bound(costs[1]);
    let mut draw = Draw(11);
    let mut picks = [0u32; 3];
    let mut scanned = 0;
    for _ in 0..3_000 {
        let (a, b) = gen_pair(count, draw.next(), draw.next()).expect("two slots");
        let first =
            winner(Some(pool[a as usize]), Some(pool[b as usize]), bound).expect("all in service");
        let chosen = if settles_scan(&first, bound) {
            first
        } else {
            scanned += 1;
            pool.iter()
                .fold(None, |best, c| {
                    let better = best.is_none_or(|b: Candidate| rank(c, bound) < rank(&b, bound));
                    if better { Some(*c) } else { best }
                })
                .expect("all in service")
        };
        picks[chosen.id as usize] += 1;
    }
    assert_eq!(scanned, 0, "an idle pool never scans");
    // Pairs: the lowest wins 2/3 of picks, the middle 1/3.
    assert!((1_800..2_200).contains(&picks[0]), "{picks:?}");
    assert!((800..1_200).contains(&picks[1]), "{picks:?}");
    // A busy winner scans: one flow in flight on each of the pair.
    let busy = candidate(
        0,
        Load {
            cost: costs[0],
            inflight: 1,
            ..Load::default()
        },
        2,
        0,
    );
    assert!(!settles_scan(&busy, bound));
    // Idle is `score == cost`: true only because every bias is at least 1.
    assert!((0..=u8::MAX).all(|b| inflight_bias(b) >= 1));
    // So does an idle one far above the pool.
    let far = candidate(
        2,
        Load {
            cost: bound + 1,
            ..Load::default()
        },
        2,
        0,
    );
    assert!(!settles_scan(&far, bound));
}

proptest! {
    #[test]
    fn ranks_order_candidates_as_beats_does(
        a in arb_candidate(), b in arb_candidate(), bound in 0u64..10_000,
    ) {
        prop_assume!(a.score <= RANK_SCORE_MAX && b.score <= RANK_SCORE_MAX);
        if rank(&a, bound) < rank(&b, bound) {
            prop_assert!(a.beats(&b, bound));
        }
        if a.beats(&b, bound) {
            prop_assert!(rank(&a, bound) <= rank(&b, bound));
        }
    }

    #[test]
    fn unweighted_cost_is_the_exact_product_or_saturates(cost: u64, weight: u32) {
        let got = unweighted_cost(cost, weight);
        let w = u64::from(weight.max(1));
        if cost < 1 << UNWEIGHTED_COST_BITS && w < 1 << UNWEIGHTED_WEIGHT_BITS {
            prop_assert_eq!(got, cost * w);
        } else {
            prop_assert_eq!(got, u64::MAX);
        }
    }

    #[test]
    fn unweighted_cost_at_the_edges(shift in 0u32..64, weight in 0u32..1 << 23) {
        let cost = 1u64 << shift;
        let want = if shift < UNWEIGHTED_COST_BITS { cost * u64::from(weight.max(1)) } else { u64::MAX };
        prop_assert_eq!(unweighted_cost(cost, weight), want);
        prop_assert_eq!(unweighted_cost(u64::MAX - u64::from(weight), weight), u64::MAX);
    }

    #[test]
    fn coarse_scores_keep_order_and_lose_under_a_quarter(score: u64, other: u64) {
        let c = coarse_score(score);
        prop_assert!(c <= score);
        // At most 1/4 of the value is dropped (3 significant bits kept).
        prop_assert!(score - c <= score / 4);
        if score <= other {
            prop_assert!(coarse_score(score) <= coarse_score(other));
        }
    }
}

#[test]
fn coarse_scores_tie_near_equal_backends_and_keep_real_differences_apart() {
    let cost = 9_000_000; // a 9 ms backend
    // Estimates 5 % apart in one bucket ([2^23, 1.25 × 2^23)) tie (two on
    // either side of a bucket's edge do not: the tie is a tolerance, not a
    // guarantee); 2× apart, or one more flow in flight, never tie.
    assert_eq!(coarse_score(cost), coarse_score(cost * 105 / 100));
    assert!(coarse_score(cost) < coarse_score(cost * 2));
    for n in 0..8 {
        assert!(
            coarse_score(score(cost, n, 2)) < coarse_score(score(cost, n + 1, 2)),
            "{n} in flight"
        );
    }
    assert_eq!(coarse_score(0), 0);
    assert_eq!(coarse_score(7), 7);
}

#[test]
fn a_saturated_score_still_ranks_within_its_kind() {
    let huge = cand(1, 10, u64::MAX);
    let far = cand(2, 1_000_000, 1_000_000);
    assert_eq!(rank(&huge, 100), coarse_score(RANK_SCORE_MAX));
    assert!(rank(&huge, 100) < rank(&far, 100), "within the bound first");
}

#[test]
fn an_idle_held_backend_scores_as_a_saturated_one() {
    // `hetero`: a slow backend held at 10× the pool's cost, idle, against
    // a steady one saturated with 4 flows in flight. The steady one keeps
    // the flow while its estimate stays below the held one's; the held
    // one takes it once the steady estimate (which measures its queue)
    // passes it. Counted as idle, the held one took it from a steady
    // estimate of 4 on.
    let bound = 30;
    let load = |cost, inflight, held| Load {
        cost,
        inflight,
        held,
        saturation: SATURATED_INFLIGHT,
        ..Load::default()
    };
    let held = candidate(1, load(100, 0, SCORE_FAR_ABOVE), inflight_bias(0), 0);
    assert_eq!(held.score, 100 * 25);
    for steady_cost in [5, 10, 40, 99] {
        let steady = candidate(
            2,
            load(steady_cost, SATURATED_INFLIGHT, 0),
            inflight_bias(0),
            0,
        );
        assert!(steady.beats(&held, bound), "steady at {steady_cost}");
        // A full scan ranks on coarse scores: 99 × 25 ties with 100 × 25.
        assert!(
            rank(&steady, bound) <= rank(&held, bound),
            "steady at {steady_cost}"
        );
    }
    let queued = candidate(2, load(120, SATURATED_INFLIGHT, 0), inflight_bias(0), 0);
    assert!(held.beats(&queued, bound));
    // A deeper queue counts too: at 9 in flight a steady estimate of 30
    // scores 3000.
    let deep = candidate(2, load(30, 9, 0), inflight_bias(0), 0);
    assert!(held.beats(&deep, bound));
    // With saturation off (0) nothing is added: the held one scores its own.
    let off = candidate(
        1,
        Load {
            saturation: 0,
            ..load(100, 0, SCORE_FAR_ABOVE)
        },
        inflight_bias(0),
        0,
    );
    assert_eq!((off.cost, off.score), (u64::MAX, 100));
}
