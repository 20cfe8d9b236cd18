//! Maglev lookup tables (Eisenbud et al., NSDI 2016), with weights.
//!
//! Each backend has its own permutation of the table's positions, derived
//! from a stable hash of its identity (address and port, never its id or
//! slot, which shift when the configuration changes). Backends take turns
//! claiming their next free preferred position until the table is full.
//! With weights, a backend takes `weight / max weight` turns per round on
//! average, so it ends up with that share of the positions. Because every
//! backend's preferences are fixed, adding or removing one of N backends
//! moves only about 1/N of the positions.
//!
//! Members take their turns in the order of their identity, not of their
//! slots, so balancers that share a membership but added its backends in
//! another order (several instances behind ECMP, fed by one etcd prefix)
//! build the same table: the same positions name the same backends.

/// A backend as Maglev sees it.
#[derive(Clone, Copy, Debug)]
pub struct Member {
    /// Stable identity bytes (e.g. address and port).
    pub key: [u8; 18],
    /// What the table stores for this backend (the backend id).
    pub value: u32,
    pub weight: u32,
}

/// A table of `size` entries (a prime, larger than the member count), each
/// the `value` of a member. Empty when `members` is or all weights are 0.
pub fn build(members: &[Member], size: u32) -> Vec<u32> {
    let max_weight = members.iter().map(|m| m.weight).max().unwrap_or(0);
    if max_weight == 0 {
        return Vec::new();
    }
    let size_u64 = u64::from(size);
    let prefs: Vec<(u64, u64)> = members
        .iter()
        .map(|m| {
            let offset = fnv1a(&m.key, 0x6d61_676c_6576_3031) % size_u64;
            let skip = fnv1a(&m.key, 0x736b_6970_7365_6564) % (size_u64 - 1) + 1;
            (offset, skip)
        })
        .collect();
    // Turns in identity order, whatever the slot order.
    let mut order: Vec<usize> = (0..members.len()).collect();
    order.sort_by_key(|&i| members[i].key);
    let mut next = vec![0u64; members.len()];
    let mut credit = vec![0u64; members.len()];
    let mut table = vec![u32::MAX; size as usize];
    let mut filled = 0u32;
    while filled < size {
        for &i in &order {
            let m = &members[i];
            credit[i] += u64::from(m.weight);
            while credit[i] >= u64::from(max_weight) && filled < size {
                credit[i] -= u64::from(max_weight);
                let (offset, skip) = prefs[i];
                loop {
                    let pos = ((offset + next[i] * skip) % size_u64) as usize;
                    next[i] += 1;
                    if table[pos] == u32::MAX {
                        table[pos] = m.value;
                        filled += 1;
                        break;
                    }
                }
            }
        }
    }
    table
}

/// 64-bit FNV-1a with a seed folded into the offset basis: stable across
/// Rust versions and restarts (unlike `DefaultHasher`), so a restarted
/// balancer builds the same table.
fn fnv1a(bytes: &[u8], seed: u64) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325 ^ seed;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    // FNV's low bits mix poorly; finish with a multiply-xorshift.
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^ (h >> 33)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small prime above 100 × the members used here.
    const SIZE: u32 = 5_003;

    fn member(i: u32, weight: u32) -> Member {
        let mut key = [0u8; 18];
        key[..4].copy_from_slice(&[10, 0, (i >> 8) as u8, i as u8]);
        key[16..].copy_from_slice(&8080u16.to_be_bytes());
        Member {
            key,
            value: i,
            weight,
        }
    }

    fn shares(table: &[u32], n: u32) -> Vec<f64> {
        let mut c = vec![0usize; n as usize];
        for &v in table {
            c[v as usize] += 1;
        }
        c.iter().map(|&x| x as f64 / table.len() as f64).collect()
    }

    #[test]
    fn equal_weights_get_equal_shares() {
        let members: Vec<_> = (0..20).map(|i| member(i, 1)).collect();
        let t = build(&members, SIZE);
        assert_eq!(t.len(), SIZE as usize);
        for s in shares(&t, 20) {
            assert!((s - 0.05).abs() < 0.005, "{s}");
        }
    }

    #[test]
    fn weights_are_respected() {
        let members: Vec<_> = (0..10)
            .map(|i| member(i, if i < 2 { 4 } else { 1 }))
            .collect();
        let s = shares(&build(&members, SIZE), 10);
        // Weights 4,4,1×8 → 4/16 and 1/16.
        for (i, share) in s.iter().enumerate() {
            let want = if i < 2 { 0.25 } else { 0.0625 };
            assert!((share - want).abs() < 0.01, "slot {i}: {share} vs {want}");
        }
    }

    #[test]
    fn removing_one_of_n_moves_about_one_nth() {
        let n = 20;
        let all: Vec<_> = (0..n).map(|i| member(i, 1)).collect();
        let before = build(&all, SIZE);
        let without: Vec<_> = all.iter().copied().filter(|m| m.value != 7).collect();
        let after = build(&without, SIZE);
        let moved = before.iter().zip(&after).filter(|(a, b)| a != b).count();
        let fraction = moved as f64 / f64::from(SIZE);
        // The removed backend's 1/20 must move; Maglev moves little more.
        assert!(fraction >= 1.0 / 20.0 - 0.005, "{fraction}");
        assert!(fraction < 2.0 / 20.0, "{fraction}");
        // Entries of the removed backend are the ones that moved, mostly.
        assert!(after.iter().all(|&v| v != 7));
    }

    #[test]
    fn adding_one_to_n_moves_about_one_over_n_plus_one() {
        let n = 20;
        let before_members: Vec<_> = (0..n).map(|i| member(i, 1)).collect();
        let mut after_members = before_members.clone();
        after_members.insert(5, member(99, 1));
        let before = build(&before_members, SIZE);
        let after = build(&after_members, SIZE);
        let moved = before.iter().zip(&after).filter(|(a, b)| a != b).count();
        let fraction = moved as f64 / f64::from(SIZE);
        assert!(fraction < 2.0 / 21.0, "{fraction}");
        // The newcomer's order in the list does not matter to the others.
        let newcomer = after.iter().filter(|&&v| v == 99).count() as f64 / f64::from(SIZE);
        assert!((newcomer - 1.0 / 21.0).abs() < 0.01, "{newcomer}");
    }

    #[test]
    fn the_table_is_a_pure_function_of_the_members() {
        let members: Vec<_> = (0..5).map(|i| member(i, i + 1)).collect();
        assert_eq!(build(&members, SIZE), build(&members, SIZE));
        assert!(build(&[], SIZE).is_empty());
    }

    #[test]
    fn balancers_with_one_membership_in_another_order_build_the_same_table() {
        // Instance A added backends 0..8 in order; instance B in reverse
        // order with other ids (value = 100 + i): position by position the
        // same backend, whatever its local id.
        let a: Vec<_> = (0..8).map(|i| member(i, 1 + i % 3)).collect();
        let b: Vec<_> = (0..8)
            .rev()
            .map(|i| Member {
                value: 100 + i,
                ..member(i, 1 + i % 3)
            })
            .collect();
        let (ta, tb) = (build(&a, SIZE), build(&b, SIZE));
        assert!(ta.iter().zip(&tb).all(|(x, y)| *y == x + 100));
    }
}
