//! A P2C VIP's saturation threshold as the kernel reads it
//! ([`lb_common::VipMeta::p2c_saturation`]): the configured one, halved
//! while the VIP's held backends carry a real share of its answers.
//!
//! A backend held far above its pool ([`lb_common::SCORE_FAR_ABOVE`]) gets
//! a new flow only once every candidate within the bound is saturated (has
//! the threshold's count of flows in flight). With the default 4 on the lab's
//! two-worker backends, that is two requests queued behind every steady
//! backend before a held one is used. While the steady backends can carry
//! the load, that rarely happens and the held ones stay nearly idle, which
//! is what the bound is for. When they cannot (`stall` at 85 %: the eight
//! steady backends alone would be at 106 %), the held ones are needed for
//! about a sixth of the flows, and every one of those flows waits for the
//! steady backends' queues to reach the threshold first, so the whole pool
//! runs two deep.
//!
//! So the control plane watches the share of the VIP's answers that came
//! from backends it held at that tick, smoothed over [`SHARE_MEMORY`].
//! From [`NEEDED_SHARE`] on, the VIP's threshold is halved (4 → 2: every
//! worker busy, no queue yet), until the share falls below
//! [`RESTORE_SHARE`]. Measured in the lab (stop 37): at `stall` 70 % the
//! held stallers answer 0.1–0.3 % (they answer about 5 % in all, nearly
//! all of it while not held), so the rule stays off there and the 70 %
//! tail, which needs a staller to carry at most one request when a pause
//! begins, is kept; at 85 % their share under the full threshold climbs
//! past 5 % within about five seconds, and with half of it stays at
//! 13–16 %. Held slow backends (`hetero`, `hetero-20`, `degrade`) answer
//! about 1 % or less.
use std::time::Duration;

use crate::kernel::clock::Nanos;

/// From this share of a VIP's answers coming from held backends on, its
/// saturation threshold is halved.
pub const NEEDED_SHARE: f64 = 0.05;

/// Once halved, the threshold is restored only when the share falls below
/// this: with half the threshold the held backends answer more, so without
/// the gap the rule would flip back and forth at the edge.
pub const RESTORE_SHARE: f64 = 0.025;

/// Memory of the share: a time-weighted average over about this long.
pub const SHARE_MEMORY: Duration = Duration::from_secs(2);

/// One P2C VIP's share of answers from held backends.
#[derive(Clone, Debug, Default)]
pub struct HeldShare {
    share: f64,
    last: Option<Nanos>,
    halved: bool,
}

impl HeldShare {
    /// Adds a tick in which backends held at that tick answered `held` of
    /// the VIP's `total` answers. A tick without answers changes nothing.
    pub fn observe(&mut self, held: u64, total: u64, now: Nanos) {
        if total == 0 {
            return;
        }
        let tick_share = held.min(total) as f64 / total as f64;
        self.share = match self.last.replace(now) {
            None => tick_share,
            Some(last) => {
                let elapsed = now.0.saturating_sub(last.0) as f64;
                let w = (-elapsed / SHARE_MEMORY.as_nanos() as f64).exp();
                self.share * w + tick_share * (1.0 - w)
            }
        };
        self.halved = if self.halved {
            self.share >= RESTORE_SHARE
        } else {
            self.share >= NEEDED_SHARE
        };
    }

    /// The smoothed share (0 before the first answer).
    pub fn share(&self) -> f64 {
        self.share
    }

    /// The threshold to publish for a VIP configured with `configured`
    /// (0, the rule off, and 1 stay as they are).
    pub fn saturation(&self, configured: u16) -> u16 {
        if configured > 1 && self.halved {
            configured / 2
        } else {
            configured
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TICK: u64 = 50_000_000;

    fn run(share: &mut HeldShare, from: u64, ticks: u64, held: u64, total: u64) -> u64 {
        for t in 0..ticks {
            share.observe(held, total, Nanos(from + t * TICK));
        }
        from + ticks * TICK
    }

    #[test]
    fn the_threshold_halves_while_held_backends_answer_a_share_and_comes_back() {
        let mut s = HeldShare::default();
        assert_eq!(s.saturation(4), 4);
        // 0.3 % from held backends for 10 s: `stall` at 70 %.
        let t = run(&mut s, 0, 200, 3, 1000);
        assert!((s.share() - 0.003).abs() < 1e-9);
        assert_eq!(s.saturation(4), 4);
        // 12 %: `stall` at 85 %. Within a second or so the threshold halves.
        let t = run(&mut s, t, 4, 12, 100);
        assert_eq!(s.saturation(4), 4, "a fifth of a second is not enough");
        let t = run(&mut s, t, 20, 12, 100);
        assert_eq!(s.saturation(4), 2);
        assert_eq!(s.saturation(9), 4);
        // Off and 1 stay.
        assert_eq!(s.saturation(0), 0);
        assert_eq!(s.saturation(1), 1);
        // Between the two shares it stays halved...
        let t = run(&mut s, t, 200, 4, 100);
        assert!((s.share() - 0.04).abs() < 1e-3);
        assert_eq!(s.saturation(4), 2);
        // ...and below the lower one it is restored,
        let t = run(&mut s, t, 200, 1, 100);
        assert_eq!(s.saturation(4), 4);
        // and then the same share does not halve it again.
        run(&mut s, t, 200, 4, 100);
        assert_eq!(s.saturation(4), 4);
    }

    #[test]
    fn ticks_without_answers_keep_the_share() {
        let mut s = HeldShare::default();
        s.observe(1, 4, Nanos(0));
        assert_eq!(s.share(), 0.25);
        s.observe(0, 0, Nanos(10_000_000_000));
        assert_eq!(s.share(), 0.25);
        // More held than total (a backend counted twice) is clamped.
        let mut t = HeldShare::default();
        t.observe(9, 4, Nanos(0));
        assert_eq!(t.share(), 1.0);
    }
}
