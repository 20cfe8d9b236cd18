//! Least-connections relief of a P2C VIP: while the backends it holds far
//! above its pool ([`lb_common::SCORE_FAR_ABOVE`]) are needed to carry the
//! load, the kernel selects the VIP's new flows by least connections.
//!
//! A held backend gets a new flow only once every candidate within the
//! bound is saturated (has [`lb_common::VipMeta::p2c_saturation`] flows in
//! flight), and then only if its score, counted with that many flows on
//! top of its own (`lb_common::p2c::candidate`), is the lowest. While the
//! other backends can carry the load that rarely happens, and the held ones stay nearly idle, which is what the bound is
//! for (`stall` at 70 %: a backend that pauses for 300 ms every 2 s must
//! carry at most one request when a pause begins). When they cannot
//! (`stall` at 85 %: the eight steady backends alone would be at 106 %),
//! every flow a held backend takes comes after the whole pool queued, and
//! the steady backends' latency estimates then measure their own queues,
//! which their in-flight counts already count: ranked on both, a new flow
//! goes to a backend with more in flight but a lower recent latency. Least
//! connections (fewest in flight ÷ weight, ties to the backend whose
//! pending requests have been served longest) is the work-conserving
//! choice there.
//!
//! So the control plane keeps, per P2C VIP small enough for P2C's full scan
//! (`--p2c-full-scan`, 16 by default: least connections scans every slot
//! for each new flow, which P2C then does anyway), the share of its answers that
//! came from backends held at that tick (the kernel's per-tick latency
//! aggregates count them), smoothed over [`SHARE_MEMORY`]. A tick at which
//! every backend had the VIP's `p2c_saturation` flows in flight or more,
//! none of them held ([`PoolQueue::Whole`]), counts as a tick whose answers
//! all came from held backends: the whole pool queues, and P2C's rank of
//! queueing backends is the one least connections replaces. (A held
//! backend is flagged only once its estimate has taken in a pause, and a
//! staller's first pauses are over before it is: its answers alone started
//! relief 4–9 s into a `stall` run at 85 %; the whole pool queues at the
//! first pause, 1.5 s in.) From [`NEEDED_SHARE`] on (with at least
//! [`MIN_HELD_ANSWERS`] held answers in the memory, unless the whole pool
//! queues at that tick), the VIP is relieved:
//! the kernel reads [`lb_common::Algorithm::LeastConn`] in its `VIPS` entry
//! (flagged [`lb_common::VIP_F_P2C_RELIEF`], so `status` still shows P2C).
//! Under least connections the held backends are used whether or not they
//! are needed, so their share says nothing about the load any more. What
//! does is a tick at which every backend, held ones too, has
//! `p2c_saturation` flows in flight or more. So a relief lasts
//! [`RELIEF_FOR`] from its start or from the last such tick, then P2C is
//! back and the share is measured afresh for at least [`MEASURE_FOR`]; it
//! ends sooner if the share falls below [`RESTORE_SHARE`] (the held
//! backends recovered and are held no longer).
//!
//! Measured in the lab: at `stall` 70 % held backends answer 0.1–0.3 % on
//! average (at most 1.9 % over half a second, stop 38), so relief never
//! starts there. Held slow backends (`hetero`, `hetero-20`, `big-slow`,
//! `recover`) answer about 1 % or less at 70 and 85 %. The fewest flows in
//! flight of any backend not held never passed 2 at `stall` 70 % or at
//! `hetero` 85 % under P2C, nor at `stall` 70 % under least connections; at
//! `stall` 85 % it passed 4 at every pause, under either (stop 39).
use std::time::Duration;

use lb_common::{Algorithm, VIP_F_P2C_RELIEF, VipMeta};

use crate::kernel::clock::Nanos;

/// From this share of a VIP's answers coming from held backends on, the
/// VIP is relieved.
pub const NEEDED_SHARE: f64 = 0.05;

/// Fewest held answers over about [`SHARE_MEMORY`] from which their share
/// can start a relief: a share of a few answers is noise (one held answer
/// of three in a VIP's first tick). A tick at which the whole pool queues
/// needs none.
pub const MIN_HELD_ANSWERS: f64 = 10.0;

/// Relief ends early when the share falls below this (the held backends are
/// held no longer, or answer next to nothing).
pub const RESTORE_SHARE: f64 = 0.025;

/// Memory of the share: a time-weighted average over about this long. Half
/// a second: relief starts within a few ticks of the held backends being
/// needed, and a lone tick in which a held backend answered a fifth of the
/// requests (it happens right after a pause is detected) stays below
/// [`NEEDED_SHARE`].
pub const SHARE_MEMORY: Duration = Duration::from_millis(500);

/// Longest relief, from its start or from the last tick at which the whole
/// pool queued, before P2C and a fresh measurement: how long a VIP whose
/// load fell back may keep selecting by least connections.
pub const RELIEF_FOR: Duration = Duration::from_secs(10);

/// After a relief that lasted [`RELIEF_FOR`], the share is measured under
/// P2C for this long, from 0, before relief may start again: the answers of
/// the first ticks are to flows least connections sent (a 10 ms request
/// is answered within a tick or two).
pub const MEASURE_FOR: Duration = Duration::from_millis(500);

/// What one score tick saw of a P2C VIP.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tick {
    /// Answers from backends held at the tick.
    pub held: u64,
    /// All the VIP's answers in the tick.
    pub total: u64,
    /// How far the VIP's pool queued ([`pool_queue`]).
    pub queue: PoolQueue,
}

/// How far a pool queues at a tick, against the VIP's `p2c_saturation`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PoolQueue {
    /// Some backend has fewer flows in flight (or the rule is off).
    #[default]
    Room,
    /// Every backend has that many or more, a held one among them. Under
    /// P2C this says nothing: a held backend (`hetero`'s slow pair, a
    /// degraded backend) may be busy because it is slow, and least
    /// connections would send it its share whatever its speed. Under
    /// relief, where least connections loads held backends like the rest,
    /// it says the pool still needs all of them: the relief is renewed.
    WithHeld,
    /// Every backend has that many or more and none is held: counted as a
    /// tick whose answers all came from held backends, and renews a relief.
    Whole,
}

/// How far `slots` queue: whether every backend has `saturation` flows in
/// flight or more (`inflight`), and whether one of them is held (`held`).
/// [`PoolQueue::Room`] while `saturation` is 0 (the VIP's rule off) or for
/// an empty pool. Stops at the first backend below the threshold, so a pool
/// with room reads one or two counters.
pub fn pool_queue(
    slots: &[u32],
    saturation: u16,
    held: impl Fn(u32) -> bool,
    inflight: impl Fn(u32) -> u64,
) -> PoolQueue {
    if saturation == 0
        || slots.is_empty()
        || slots.iter().any(|&id| inflight(id) < u64::from(saturation))
    {
        PoolQueue::Room
    } else if slots.iter().any(|&id| held(id)) {
        PoolQueue::WithHeld
    } else {
        PoolQueue::Whole
    }
}

/// One P2C VIP's share of answers from held backends, and its relief.
#[derive(Clone, Debug, Default)]
pub struct HeldShare {
    share: f64,
    /// Held answers over about [`SHARE_MEMORY`] (a sum decayed like the
    /// share).
    held_answers: f64,
    last: Option<Nanos>,
    /// While the VIP is relieved: since its relief started, or since the
    /// last tick at which its whole pool queued ([`RELIEF_FOR`] counts from
    /// there).
    relieved_since: Option<Nanos>,
    /// Until when a fresh measurement after a relief runs.
    measuring_until: Option<Nanos>,
}

impl HeldShare {
    /// Adds a tick in which backends held at that tick answered `held` of
    /// the VIP's `total` answers, and its pool queued as far as `queue`. A
    /// tick without answers in a pool with room changes the share by
    /// nothing, but can end a relief that has lasted [`RELIEF_FOR`].
    pub fn observe(&mut self, tick: Tick, now: Nanos) {
        let Tick { held, total, queue } = tick;
        if self.relieved_since.is_some() && queue != PoolQueue::Room {
            self.relieved_since = Some(now);
        }
        if let Some(since) = self.relieved_since
            && now.0.saturating_sub(since.0) >= RELIEF_FOR.as_nanos() as u64
        {
            // Measured afresh, under P2C, from this tick on.
            *self = Self {
                last: Some(now),
                measuring_until: Some(Nanos(now.0 + MEASURE_FOR.as_nanos() as u64)),
                ..Self::default()
            };
            return;
        }
        let held = held.min(total) as f64;
        let tick_share = match total {
            _ if queue == PoolQueue::Whole => 1.0,
            0 => return,
            _ => held / total as f64,
        };
        (self.share, self.held_answers) = match self.last.replace(now) {
            None => (tick_share, held),
            Some(last) => {
                let elapsed = now.0.saturating_sub(last.0) as f64;
                let w = (-elapsed / SHARE_MEMORY.as_nanos() as f64).exp();
                (
                    self.share * w + tick_share * (1.0 - w),
                    self.held_answers * w + held,
                )
            }
        };
        let needed = self.share >= NEEDED_SHARE
            && (queue == PoolQueue::Whole || self.held_answers >= MIN_HELD_ANSWERS);
        self.relieved_since = match self.relieved_since {
            Some(since) if self.share >= RESTORE_SHARE => Some(since),
            Some(_) => None,
            None if needed && !self.measuring(now) => Some(now),
            None => None,
        };
    }

    fn measuring(&self, now: Nanos) -> bool {
        self.measuring_until.is_some_and(|until| now.0 < until.0)
    }

    /// The smoothed share (0 before the first answer, and after a relief).
    pub fn share(&self) -> f64 {
        self.share
    }

    /// Whether the VIP is relieved: selected by least connections.
    pub fn relieved(&self) -> bool {
        self.relieved_since.is_some()
    }
}

/// A VIP's `VIPS` entry, relieved or not: a relieved P2C VIP reads least
/// connections, flagged [`VIP_F_P2C_RELIEF`]. Other VIPs are never relieved.
pub fn relieved_meta(meta: VipMeta, relieved: bool) -> VipMeta {
    if !relieved || Algorithm::from_u8(meta.algorithm) != Some(Algorithm::P2cEwma) {
        return meta;
    }
    VipMeta {
        algorithm: Algorithm::LeastConn as u8,
        flags: meta.flags | VIP_F_P2C_RELIEF,
        ..meta
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TICK: u64 = 50_000_000;

    fn answers(held: u64, total: u64) -> Tick {
        Tick {
            held,
            total,
            queue: PoolQueue::Room,
        }
    }

    fn run(share: &mut HeldShare, from: u64, ticks: u64, held: u64, total: u64) -> u64 {
        for t in 0..ticks {
            share.observe(answers(held, total), Nanos(from + t * TICK));
        }
        from + ticks * TICK
    }

    #[test]
    fn relief_starts_while_held_backends_answer_a_share_and_ends() {
        let mut s = HeldShare::default();
        assert!(!s.relieved());
        // 0.3 % from held backends for 10 s: `stall` at 70 %.
        let t = run(&mut s, 0, 200, 3, 1000);
        assert!((s.share() - 0.003).abs() < 1e-9);
        assert!(!s.relieved());
        // One tick at a fifth (a pause just detected) is not enough.
        let t = run(&mut s, t, 1, 20, 100);
        assert!(!s.relieved(), "share {}", s.share());
        let t = run(&mut s, t, 10, 3, 1000);
        assert!(!s.relieved());
        // 10 %: `stall` at 85 %. Relief within a few ticks.
        let t = run(&mut s, t, 2, 10, 100);
        assert!(!s.relieved(), "a tenth of a second is not enough");
        let t = run(&mut s, t, 6, 10, 100);
        assert!(s.relieved());
        // Between the two shares it lasts...
        let t = run(&mut s, t, 20, 4, 100);
        assert!((s.share() - 0.04).abs() < 5e-3);
        assert!(s.relieved());
        // ...and below the lower one it ends,
        let t = run(&mut s, t, 20, 1, 100);
        assert!(!s.relieved());
        // and then the same share does not start it again.
        run(&mut s, t, 200, 4, 100);
        assert!(!s.relieved());
    }

    #[test]
    fn relief_lasts_at_most_relief_for_then_the_share_is_measured_afresh() {
        let mut s = HeldShare::default();
        // Relieved from the first tick at 15 % (held backends used by
        // least connections).
        let t = run(&mut s, 0, 10, 15, 100);
        assert!(s.relieved());
        let ticks = (RELIEF_FOR.as_nanos() as u64).div_ceil(TICK);
        // Still relieved at the last tick before RELIEF_FOR has passed...
        let t = run(&mut s, t, ticks - 11, 15, 100);
        assert!(s.relieved());
        // ...and at it P2C is back, measured from nothing: under P2C the
        // held backends now answer 0.3 % (the load fell), and relief does
        // not start again.
        let t = run(&mut s, t, 1, 3, 1000);
        assert!(s.relieved(), "4.95 s");
        let t = run(&mut s, t, 1, 3, 1000);
        assert!(!s.relieved());
        assert_eq!(s.share(), 0.0, "the tick that ends a relief is not counted");
        let t = run(&mut s, t, 100, 3, 1000);
        assert!(!s.relieved());
        assert!(s.share() < 0.01, "share {}", s.share());
        // Needed again: relieved again within a few ticks.
        let t = run(&mut s, t, 8, 10, 100);
        assert!(s.relieved());
        // Still needed after RELIEF_FOR: the answers of the first ticks
        // under P2C (to flows least connections sent) cannot start it
        // again before MEASURE_FOR; the share then can.
        let t = run(&mut s, t, ticks, 30, 100);
        assert!(!s.relieved());
        let measure = (MEASURE_FOR.as_nanos() as u64).div_ceil(TICK);
        let t = run(&mut s, t, measure - 2, 30, 100);
        assert!(!s.relieved(), "share {}", s.share());
        assert!(s.share() > NEEDED_SHARE);
        run(&mut s, t, 2, 30, 100);
        assert!(s.relieved());
        // A relief that ends on time ends even in ticks without answers.
        let mut q = HeldShare::default();
        let t = run(&mut q, 0, 10, 15, 100);
        assert!(q.relieved());
        q.observe(answers(0, 0), Nanos(t + RELIEF_FOR.as_nanos() as u64));
        assert!(!q.relieved());
        assert_eq!(q.share(), 0.0);
        // A fresh VIP is not measuring: relieved at its first tick.
        let mut fresh = HeldShare::default();
        fresh.observe(answers(30, 100), Nanos(0));
        assert!(fresh.relieved());
    }

    #[test]
    fn a_relieved_p2c_vip_reads_least_connections_flagged() {
        let p2c = VipMeta {
            vip_id: 3,
            backend_count: 10,
            algorithm: Algorithm::P2cEwma as u8,
            inflight_bias: 2,
            flags: 0,
            p2c_full_scan: 16,
            p2c_saturation: 4,
        };
        assert_eq!(relieved_meta(p2c, false), p2c);
        let relieved = relieved_meta(p2c, true);
        assert_eq!(relieved.algorithm, Algorithm::LeastConn as u8);
        assert_eq!(relieved.flags, VIP_F_P2C_RELIEF);
        assert_eq!(relieved.configured_algorithm(), Some(Algorithm::P2cEwma));
        assert_eq!(
            VipMeta {
                algorithm: p2c.algorithm,
                flags: 0,
                ..relieved
            },
            p2c,
            "nothing else changes"
        );
        // Another algorithm is never relieved; its own flags stay.
        let maglev = VipMeta {
            algorithm: Algorithm::Maglev as u8,
            flags: lb_common::VIP_F_SOURCE_AFFINITY,
            ..p2c
        };
        assert_eq!(relieved_meta(maglev, true), maglev);
        assert_eq!(maglev.configured_algorithm(), Some(Algorithm::Maglev));
    }

    #[test]
    fn a_share_of_a_few_answers_starts_nothing() {
        // A VIP's first ticks at a few requests a second: one held answer
        // of three is a third, but not evidence.
        let mut s = HeldShare::default();
        let t = run(&mut s, 0, 1, 1, 3);
        assert!(s.share() > 0.3);
        assert!(!s.relieved());
        // A held answer every other tick keeps the share above 5 % at
        // 2 answers a tick, and about 5 held answers in the memory.
        let mut t = t;
        for _ in 0..50 {
            t = run(&mut s, t, 1, 1, 2);
            t = run(&mut s, t, 1, 0, 2);
        }
        assert!(s.share() > NEEDED_SHARE, "share {}", s.share());
        assert!(!s.relieved());
        // Ten times the rate: relieved.
        run(&mut s, t, 4, 10, 20);
        assert!(s.relieved());
    }

    #[test]
    fn ticks_without_answers_keep_the_share() {
        let mut s = HeldShare::default();
        s.observe(answers(1, 100), Nanos(0));
        assert_eq!(s.share(), 0.01);
        s.observe(answers(0, 0), Nanos(10_000_000_000));
        assert_eq!(s.share(), 0.01);
        // More held than total (a backend counted twice) is clamped.
        let mut t = HeldShare::default();
        t.observe(answers(9, 4), Nanos(0));
        assert_eq!(t.share(), 1.0);
    }

    #[test]
    fn a_whole_pool_queueing_starts_relief_at_once_and_it_fades_without_held_answers() {
        let mut s = HeldShare::default();
        // `stall` at 70 %: 0.3 % held answers, room in the pool.
        let t = run(&mut s, 0, 200, 3, 1000);
        assert!(!s.relieved());
        // With a held backend among them, a queueing pool starts nothing
        // (`hetero`'s slow pair is busy because it is slow).
        let with_held = Tick {
            held: 0,
            total: 70,
            queue: PoolQueue::WithHeld,
        };
        s.observe(with_held, Nanos(t));
        assert!(!s.relieved(), "share {}", s.share());
        // A staller's first pause: the whole pool queues, none held yet.
        let whole = Tick {
            queue: PoolQueue::Whole,
            ..with_held
        };
        let t = t + TICK;
        s.observe(whole, Nanos(t));
        assert!(s.relieved(), "share {}", s.share());
        // Without held answers after it, relief ends within a second.
        let t = run(&mut s, t + TICK, 10, 0, 100);
        assert!(s.relieved(), "share {}", s.share());
        let t = run(&mut s, t, 10, 0, 100);
        assert!(!s.relieved(), "share {}", s.share());
        // A whole pool queueing counts even without answers (all stuck).
        let stuck = Tick { total: 0, ..whole };
        s.observe(stuck, Nanos(t));
        assert!(s.relieved());
    }

    #[test]
    fn a_relief_lasts_while_the_pool_queues_whole_and_ends_relief_for_after() {
        let mut s = HeldShare::default();
        let t = run(&mut s, 0, 10, 15, 100);
        assert!(s.relieved());
        let limit = RELIEF_FOR.as_nanos() as u64;
        // Held backends among them: every 2 s the whole pool queues (a
        // pause at `stall` 85 % under least connections), for 30 s.
        let with_held = Tick {
            held: 15,
            total: 100,
            queue: PoolQueue::WithHeld,
        };
        let mut t = t;
        for _ in 0..15 {
            s.observe(with_held, Nanos(t));
            t = run(&mut s, t + TICK, 39, 15, 100);
            assert!(s.relieved());
        }
        // Then the load falls: room in the pool, held backends still
        // answering 15 % (they are used by least connections). The relief
        // ends RELIEF_FOR after the last tick that queued whole.
        let last = t - 40 * TICK;
        let t = run(&mut s, t, (last + limit - t) / TICK - 1, 15, 100);
        assert!(s.relieved());
        run(&mut s, t, 2, 15, 100);
        assert!(!s.relieved());
        assert_eq!(s.share(), 0.0);
    }

    #[test]
    fn a_pool_queues_whole_when_every_backend_has_enough_in_flight() {
        let inflight = |id: u32| [5, 4, 9, 0, 4][id as usize];
        let none_held = |_| false;
        let held_3 = |id| id == 3;
        let queue = |slots: &[u32], saturation, held: &dyn Fn(u32) -> bool| {
            pool_queue(slots, saturation, held, inflight)
        };
        assert_eq!(queue(&[0, 1, 2, 4], 4, &none_held), PoolQueue::Whole);
        assert_eq!(queue(&[0, 1, 2, 4], 5, &none_held), PoolQueue::Room);
        assert_eq!(queue(&[0, 1, 2, 3, 4], 4, &none_held), PoolQueue::Room);
        assert_eq!(queue(&[0, 1, 2, 3, 4], 4, &held_3), PoolQueue::Room);
        assert_eq!(queue(&[0, 1, 2, 4], 4, &|id| id == 2), PoolQueue::WithHeld);
        // The rule off, or no backend: room.
        assert_eq!(queue(&[0, 2], 0, &none_held), PoolQueue::Room);
        assert_eq!(queue(&[], 4, &none_held), PoolQueue::Room);
        // Stops at the first backend below the threshold.
        let reads = std::cell::Cell::new(0);
        let counted = |id: u32| {
            reads.set(reads.get() + 1);
            inflight(id)
        };
        assert_eq!(
            pool_queue(&[3, 0, 1, 2, 4], 4, none_held, counted),
            PoolQueue::Room
        );
        assert_eq!(reads.get(), 1);
    }
}
