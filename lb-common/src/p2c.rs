//! The decision arithmetic of the power-of-two-choices balancer, as pure
//! functions: the XDP program (lb-ebpf `select::p2c`) feeds them map
//! values and `bpf_get_prandom_u32`, the host tests feed them chosen values
//! and a seeded draw.
//!
//! A candidate's score is `cost × (inflight + 1)^bias`, where `cost` is the
//! control plane's Peak-EWMA latency per unit of weight
//! ([`crate::BackendScore::cost`]) and `inflight` the live in-kernel count,
//! with two additions for the tail:
//!
//! - **Stall age** ([`stall_scaled`]). While a request to a backend is
//!   outstanding, the time since its last answer is a lower bound on the
//!   age of its oldest unanswered request. When that age exceeds the EWMA (and at least
//!   [`STALL_FLOOR_NS`]), the cost is scaled by `age / max(ewma, floor)`: a
//!   paused server's cost climbs while it is stuck, instead of waiting for a
//!   latency sample it cannot produce. A backend whose clients keep
//!   sending unanswered (one-way traffic) keeps an age of at most
//!   [`STALL_AGE_CAP_NS`], so such backends score alike and by load.
//! - **Bounded re-draws** (Finagle's maxEffort, [`choose`]). A candidate
//!   whose latency ([`unweighted_cost`]: its cost with the weight taken
//!   back out) is more than [`REDRAW_FACTOR`] × the VIP's median of the
//!   same (written by the control plane) is "far above the pool": it loses to
//!   any candidate within that bound, unless that one is saturated (the
//!   VIP's `p2c_saturation` flows in flight, by default
//!   [`SATURATED_INFLIGHT`]: then the scores decide), and
//!   if a pair's winner is still far above, up to [`MAX_REDRAWS`] more pairs
//!   are drawn. With 2 slow backends of 10, both draws of a pair are slow
//!   2.2 % of the time; after two re-draws, 0.001 %. The in-flight term
//!   still balances among the backends within the bound.
//!
//! Everything here runs in the kernel: no panics (checked or saturating
//! arithmetic, no indexing), no division by a value that can be zero, and
//! loops only over constant bounds.
use core::num::NonZeroU32;

use crate::{DEFAULT_INFLIGHT_BIAS, MAX_INFLIGHT_BIAS, SCORE_FAR_ABOVE, arith::saturating_mul};

/// Pairs drawn before giving up on finding any in-service backend (the
/// caller then scans).
pub const ROUNDS: u32 = 4;
/// A winner costing more than this many times the VIP's median is redrawn.
pub const REDRAW_FACTOR: u64 = 3;
/// Extra pairs drawn at most for one new flow.
pub const MAX_REDRAWS: u32 = 2;
/// A gap without progress shorter than this is ordinary queueing, not a
/// stall, whatever the EWMA says.
pub const STALL_FLOOR_NS: u64 = 10_000_000;
/// The stall age a backend keeps at most while a client of it keeps
/// sending with its request unanswered
/// ([`crate::BackendProgress::clock_while_sending`]): one-way traffic. So
/// the backends of a service that never answers score alike and by load.
///
/// Why: a service that never answers its clients' payloads (syslog or
/// statsd over UDP, an upload the server only acknowledges) keeps every
/// backend's clock running from its first request for good. Uncapped,
/// those ages told its backends apart by when each was first sent a
/// request: a backend added an hour after the others (a second against an
/// hour) took every new flow until its squared in-flight term caught up,
/// at about 60 times their flows in flight. Capped, every such backend
/// carries about the same factor (×1,000 over the floor) and the in-flight
/// term decides, as it does for answered traffic. The clients of a paused
/// server wait for their answers and send nothing more, and a new request
/// does not cap, so a paused server's age keeps growing, as before.
///
/// Kept where the clock is, not in [`stall_scaled`]: a cap there (a branch
/// or a mask) took the XDP program from 570k instructions verified to
/// 890k, running through every pair P2C draws.
pub const STALL_AGE_CAP_NS: u64 = 10_000_000_000;
/// The default saturation threshold ([`crate::VipMeta::p2c_saturation`],
/// `--p2c-saturation`): a candidate within the re-draw bound with this many
/// flows in flight or more is saturated. It counts as far above the bound
/// ([`candidate`] sets its cost to `u64::MAX`), so it loses its precedence
/// over candidates far above, and the two are compared by score.
///
/// Why: the bound keeps a slow backend out "whatever the in-flight counts",
/// which is right while the backends within it can carry the load, and
/// wrong once they cannot. `stall` at 85 % is that case: the eight steady
/// backends alone are at 106 %, and after each pause a staller's estimate
/// is far above the bound, so every new flow went to the steady eight,
/// their queues grew for a second or more until the pool's median (and so
/// the bound) had risen to a third of the staller's estimate, and only
/// then was the staller used again: a median of 45–80 ms. With 4 in
/// flight (2 queued behind 2 busy workers) the steady backends score
/// `cost × 25` under the default squared term, so an idle staller whose
/// estimate is up to 25× theirs takes the next flow, and the queues stop
/// growing at about two requests (one the control plane holds counts the
/// threshold's flows as its own, see [`candidate`], so it takes the flow
/// while its held cost is below theirs). Below that, at the loads the pool
/// can carry, the bound still decides as before.
pub const SATURATED_INFLIGHT: u64 = 4;

/// A candidate backend with the cost the re-draw bound compares (its
/// stall-adjusted [latency](unweighted_cost): the cost per weight times
/// the weight; `u64::MAX` when [saturated](SATURATED_INFLIGHT) or held by
/// the control plane ([`SCORE_FAR_ABOVE`]), so that the bound counts it as
/// far above), its weight, and its score (from the cost per weight). Only
/// the id: the caller looks the address up once, for the winner (which
/// keeps candidates small on the 512-byte BPF stack).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Candidate {
    pub id: u32,
    /// [`crate::BackendScore::weight`], for [`settles_scan`]'s idle test.
    /// It fills the space after `id`, so a candidate stays 24 bytes.
    pub weight: u32,
    pub cost: u64,
    pub score: u64,
}

/// A backend's load at packet time, as [`candidate`] scores it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Load {
    /// [`crate::BackendScore::cost`]; 0 (no score written yet) counts as 1,
    /// so the in-flight term still spreads a burst of flows.
    pub cost: u64,
    /// [`crate::BackendScore::ewma_ns`].
    pub ewma_ns: u64,
    /// [`crate::BackendScore::weight`]: the effective weight `cost` was
    /// divided by (0, no score written yet, counts as 1).
    pub weight: u32,
    /// Connections open to the backend ([`crate::BackendConns::inflight`]).
    pub inflight: u64,
    /// Where the backend's stall age counts from
    /// ([`crate::BackendProgress::stall_clock`]): its last answer while a
    /// request is outstanding, else 0 (no stall). Only read while flows are
    /// in flight: the caller may leave it 0 otherwise (the kernel then
    /// skips a map lookup).
    pub last_progress_ns: u64,
    /// [`crate::BackendScore::flags`]; bit [`SCORE_FAR_ABOVE`] set when the
    /// control plane holds the backend far above the bound.
    pub held: u32,
    /// The VIP's saturation threshold ([`crate::VipMeta::p2c_saturation`],
    /// default [`SATURATED_INFLIGHT`]): with this many flows in flight or
    /// more the backend counts as far above; 0: never.
    pub saturation: u64,
}

/// The exponent of the in-flight term for a VIP's configured value: 0 means
/// unset (the default), values above the maximum are clamped.
#[inline(always)]
pub const fn inflight_bias(configured: u8) -> u8 {
    match configured {
        0 => DEFAULT_INFLIGHT_BIAS,
        b if b > MAX_INFLIGHT_BIAS => MAX_INFLIGHT_BIAS,
        b => b,
    }
}

/// The re-draw bound for a VIP whose median [unweighted
/// cost](unweighted_cost) is `reference_cost`
/// ([`crate::VipTables::reference_cost`]); 0 (no reference yet) disables
/// re-draws.
#[inline(always)]
pub const fn redraw_bound(reference_cost: u64) -> u64 {
    saturating_mul(reference_cost, REDRAW_FACTOR)
}

/// What the re-draw bound compares for a backend: its `cost` (latency per
/// unit of weight, [`crate::BackendScore::cost`]) times its effective
/// `weight` (0 counts as 1, as the control plane's division does), so its
/// latency in cost units (`ewma_ns × WEIGHT_SCALE`, up to the division's
/// rounding). `u64::MAX` for a cost of [`UNWEIGHTED_COST_BITS`] bits or
/// more, or a weight of [`UNWEIGHTED_WEIGHT_BITS`] bits or more.
///
/// The bound is for a backend far *slower* than its pool, and weight is
/// not speed. Compared per weight, a backend of weight 1 among backends of
/// weight 4 answering as fast cost 4× their median: far above the bound,
/// so at light load it lost every pair to a backend within the bound: it
/// took a flow only when the others were saturated or its own estimate
/// had decayed below the bound (5.4 % of the flows in the lab, with fixed
/// scores none), where its weight asks for a ninth of them among two of
/// weight 4 (a canary at weight 1 next to weight 100 cost 100× the median). Weight still counts where it should, in the
/// score.
///
/// Without a branch, as [`candidate`]'s other terms: a saturating
/// multiply here (a division and two branches) took the release object
/// from 614,644 verified instructions to 920,361 and the debug one past
/// the limit. The split into bits keeps the plain product exact.
#[inline(always)]
pub const fn unweighted_cost(cost: u64, weight: u32) -> u64 {
    let weight = weight as u64;
    // 1 for weight 0, else 0 (weights are below 2^32).
    let weight = weight.wrapping_add(weight.wrapping_sub(1) >> 63);
    // The top bit set when the value has at least that many bits: the
    // subtraction wraps below them, the value's own top bit above 2^63.
    let cost_big = (COST_BELOW.wrapping_sub(cost) | cost) >> 63;
    let weight_big = WEIGHT_BELOW.wrapping_sub(weight) >> 63;
    let big = (cost_big | weight_big).wrapping_neg();
    (cost & COST_BELOW).wrapping_mul(weight & WEIGHT_BELOW) | big
}

/// Effective weights are below 2^23 (the control plane's 65,535 × 100
/// weight units); [`unweighted_cost`] counts a larger one as saturating.
pub const UNWEIGHTED_WEIGHT_BITS: u32 = 23;
/// Costs below 2^41 (an estimate of about 36 minutes at weight 1) multiply
/// by such a weight without overflow; [`unweighted_cost`] counts a larger
/// one as saturating.
pub const UNWEIGHTED_COST_BITS: u32 = 64 - UNWEIGHTED_WEIGHT_BITS;
const WEIGHT_BELOW: u64 = (1 << UNWEIGHTED_WEIGHT_BITS) - 1;
const COST_BELOW: u64 = (1 << UNWEIGHTED_COST_BITS) - 1;

/// Whether a block of `count` slots is scanned whole instead of drawing
/// pairs: `count <= full_scan_limit` (the VIP's `p2c_full_scan`; 0 never).
///
/// With few backends, each with few workers, two random candidates are
/// both busy often enough to queue a request behind another while a third
/// backend sits idle; comparing all of them (d = n choices) removes that
/// at a cost linear in the block's size, which is why it has a limit.
///
/// The scan's best is taken only when a random pair's winner does not
/// [settle](settles_scan) the pick: at light load every backend is idle,
/// in-flight counts do not tell them apart, and the scan's best would be
/// nearly always the one backend whose estimate is lowest by a hair; P2C's
/// random pair spreads the flows.
#[inline(always)]
pub const fn scans_all(count: NonZeroU32, full_scan_limit: u16) -> bool {
    count.get() <= full_scan_limit as u32
}

/// Whether a pair's winner `c` is taken without scanning a block that
/// [`scans_all`]: it has no flow in flight and is within the re-draw
/// bound. No backend can beat an idle one by its in-flight term, so the
/// scan could only find one idle with a lower estimate, and preferring
/// that one is what concentrates a quiet pool on a single backend. A busy
/// winner (both of the pair are busy) or one far above the pool is what
/// the scan is for: a third backend may be idle.
///
/// Idle is read from the score: the in-flight exponent is at least
/// [`crate::MIN_INFLIGHT_BIAS`] (1), so the score is the cost per weight
/// (its [unweighted](unweighted_cost) product the candidate's cost)
/// exactly when nothing is in flight (or both saturate, a cost far above
/// any bound). Not a field of [`Candidate`]: a flag there is a constant
/// on either side of [`candidate`]'s in-flight branch, and the verifier,
/// unable to merge the two sides, walked 120,000 more instructions (a
/// `bool` also gave `Option<Candidate>` a niche whose `None` left the
/// other fields undefined, which the debug pick copied).
#[inline(always)]
pub const fn settles_scan(c: &Candidate, bound: u64) -> bool {
    !c.far_above(bound) && unweighted_cost(c.score, c.weight) == c.cost
}

/// `cost` scaled by the stall age `now - last_progress_ns` when that age
/// exceeds `max(ewma_ns, STALL_FLOOR_NS)`; unchanged otherwise, and when no
/// progress was ever recorded (`last_progress_ns == 0`); `u64::MAX` where
/// `cost × age` does not fit in u64. Only meaningful
/// while the backend has flows in flight. (One-way traffic's age is capped
/// where the clock is kept, [`crate::BackendProgress::clock_while_sending`].)
#[inline(always)]
pub const fn stall_scaled(cost: u64, ewma_ns: u64, last_progress_ns: u64, now: u64) -> u64 {
    let age = now.saturating_sub(last_progress_ns);
    let threshold = if ewma_ns > STALL_FLOOR_NS {
        ewma_ns
    } else {
        STALL_FLOOR_NS
    };
    if last_progress_ns == 0 || age <= threshold {
        return cost;
    }
    // A product past u64 is a stall beyond any score: the top cost, never
    // the saturated product divided back down below `cost`.
    let product = saturating_mul(cost, age);
    if product == u64::MAX {
        return u64::MAX;
    }
    match product.checked_div(threshold) {
        Some(scaled) => scaled,
        None => cost,
    }
}

/// `cost × (inflight + 1)^bias`, saturating.
#[inline(always)]
pub fn score(cost: u64, inflight: u64, bias: u8) -> u64 {
    let factor = inflight.saturating_add(1);
    let mut total = cost;
    for _ in 0..bias {
        total = saturating_mul(total, factor);
    }
    total
}

/// Scores backend `id`: its cost (at least 1, stall-scaled while it has
/// flows in flight) times the in-flight term.
///
/// A backend the control plane holds far above its pool
/// ([`SCORE_FAR_ABOVE`]) adds the VIP's saturation threshold to its own
/// flows in the in-flight term: an idle held backend scores
/// `cost × (saturation + 1)^bias`, as a steady one with that many flows in
/// flight would. It loses to every candidate within the bound as before;
/// what changes is the comparison once those are saturated too. Counted as
/// idle, a held backend 10× slower than the pool (`hetero`'s slow pair,
/// 100 ms against 10 ms) beat every steady backend with 4 flows in flight
/// whose estimate, which measures its queue as well, was above 4 ms
/// (`cost × 25` against the held one's 100): a burst after the machine
/// stalled for tens of milliseconds sent it flows that took 100 ms each,
/// where the steady queues would have served them in about 25. Counted as
/// saturated, it takes a flow once the steady backends' estimates pass its
/// own, or their queues grow deeper than its in-flight term: when the pool
/// needs it.
#[inline(always)]
pub fn candidate(id: u32, load: Load, bias: u8, now: u64) -> Candidate {
    let mut cost = if load.cost == 0 { 1 } else { load.cost };
    if load.inflight > 0 {
        cost = stall_scaled(cost, load.ewma_ns, load.last_progress_ns, now);
    }
    // Held by the control plane (SCORE_FAR_ABOVE, bit 0): far above, and
    // scored with the saturation threshold's flows on top of its own (see
    // above); multiplied in, not branched on, for the verifier (below).
    let held_bit = u64::from(load.held & SCORE_FAR_ABOVE);
    let score = score(
        cost,
        load.inflight
            .saturating_add(held_bit.wrapping_mul(load.saturation)),
        bias,
    );
    // Saturated: counted as far above any bound (see SATURATED_INFLIGHT);
    // the score keeps the real cost, so it still competes on score.
    // Without a branch: an `if` here doubled the verifier's paths through
    // every pair drawn (four rounds and two re-draws, unrolled) and took
    // the program past the 1M-instruction limit. `(S - 1) - inflight`
    // wraps, setting the top bit, exactly when inflight >= S (for counts
    // and thresholds below 2^63; opened - closed never reaches that).
    // The same for `saturation - 1`, masked off when the threshold is 0.
    let on = 0u64.wrapping_sub(load.saturation) >> 63;
    let saturated = (load.saturation.wrapping_sub(1).wrapping_sub(load.inflight) >> 63) & on;
    let far = saturated | held_bit;
    Candidate {
        id,
        weight: load.weight,
        cost: unweighted_cost(cost, load.weight) | far.wrapping_neg(),
        score,
    }
}

impl Candidate {
    /// Whether the cost (the [unweighted](unweighted_cost) one) exceeds
    /// the re-draw bound (never when it is 0).
    #[inline(always)]
    pub const fn far_above(&self, bound: u64) -> bool {
        bound != 0 && self.cost > bound
    }

    /// A candidate within the bound beats one far above it whatever their
    /// scores; otherwise the lower score wins (a tie does not beat). A
    /// [saturated](SATURATED_INFLIGHT) or held candidate counts as far
    /// above.
    #[inline(always)]
    pub const fn beats(&self, other: &Self, bound: u64) -> bool {
        match (self.far_above(bound), other.far_above(bound)) {
            (false, true) => true,
            (true, false) => false,
            _ => self.score < other.score,
        }
    }
}

/// Scores from this one on all [rank](rank) alike (a score that large is
/// a backend saturated beyond any comparison).
pub const RANK_SCORE_MAX: u64 = (1 << 63) - 1;

/// Significant bits of a score that a full scan compares
/// ([`coarse_score`]): scores within 1/8 to 1/4 of each other tie.
pub const RANK_SCORE_BITS: u32 = 3;

/// `score` with all but its [`RANK_SCORE_BITS`] leading significant bits
/// cleared. A full scan compares every backend, so with exact scores the
/// single lowest estimate among idle backends would take every new flow
/// (two equally fast backends never have equal estimates); coarse scores
/// make near-equal backends tie (unless they straddle a bucket's edge),
/// and ties go to the first of the scan,
/// which starts at a random slot. Differences that matter stay apart: a
/// 2× slower backend, or one more flow in flight ((n+2)² ÷ (n+1)² ≥ 1.27
/// up to 7 in flight).
#[inline(always)]
pub const fn coarse_score(score: u64) -> u64 {
    let width = 64 - score.leading_zeros();
    if width <= RANK_SCORE_BITS {
        return score;
    }
    let dropped = width - RANK_SCORE_BITS;
    (score >> dropped) << dropped
}

/// `c`'s place in a full scan, lower first, as one integer so that the
/// kernel's scan keeps one comparison per slot: a candidate within `bound`
/// ranks before every one far above it (a saturated one counts as far
/// above), and among either kind the lower
/// [coarse](coarse_score) score first. For scores up to
/// [`RANK_SCORE_MAX`], `rank(a) < rank(b)` implies that `a`
/// [beats](Candidate::beats) `b`, and `a` beating `b` implies
/// `rank(a) <= rank(b)`.
#[inline(always)]
pub const fn rank(c: &Candidate, bound: u64) -> u64 {
    let score = coarse_score(if c.score > RANK_SCORE_MAX {
        RANK_SCORE_MAX
    } else {
        c.score
    });
    if c.far_above(bound) {
        score | (1 << 63)
    } else {
        score
    }
}

/// The better of a pair (either may be out of service): `second` wins only
/// if it [beats](Candidate::beats) `first`, so a tie goes to `first`.
#[inline(always)]
pub const fn winner(
    first: Option<Candidate>,
    second: Option<Candidate>,
    bound: u64,
) -> Option<Candidate> {
    match (first, second) {
        (Some(a), Some(b)) => Some(if b.beats(&a, bound) { b } else { a }),
        (Some(only), None) | (None, Some(only)) => Some(only),
        (None, None) => None,
    }
}

/// The slots a pair is drawn from: at least two.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slots {
    count: NonZeroU32,
    /// `count - 1`, the slots left for the second draw.
    others: NonZeroU32,
}

impl Slots {
    /// `None` with a single slot (no pair to draw).
    #[inline(always)]
    pub const fn new(count: NonZeroU32) -> Option<Self> {
        match NonZeroU32::new(count.get().wrapping_sub(1)) {
            Some(others) => Some(Self { count, others }),
            None => None,
        }
    }

    /// Two distinct slots from two random values: the first is
    /// `r1 mod count`, the second is drawn among the other `count - 1`
    /// slots and skips over the first, so the two differ without a retry
    /// loop and each ordered pair is (up to the modulo's bias, below 2^-22
    /// for 1024 slots) equally likely. Linkerd's `gen_pair`.
    #[inline(always)]
    pub fn gen_pair(&self, r1: u32, r2: u32) -> (u32, u32) {
        // Remainders by a `NonZeroU32`: no division-by-zero check to panic.
        let first = r1 % self.count;
        let second = r2 % self.others;
        // second < others < u32::MAX, so the increment cannot wrap.
        let second = if second >= first {
            second.wrapping_add(1)
        } else {
            second
        };
        (first, second)
    }
}

/// The P2C decision with re-draws. `draw_pair` draws a fresh pair and
/// returns its [`winner`] (`None` when both were out of service). Up to
/// [`ROUNDS`] pairs are drawn until one yields a candidate; while that
/// candidate is [far above](Candidate::far_above) the bound, up to
/// [`MAX_REDRAWS`] more pairs are drawn, and a pair's winner replaces it if
/// it [beats](Candidate::beats) it. `None`: every round came back empty.
#[inline(always)]
pub fn choose(bound: u64, mut draw_pair: impl FnMut() -> Option<Candidate>) -> Option<Candidate> {
    let mut best = None;
    for _ in 0..ROUNDS {
        best = draw_pair();
        if best.is_some() {
            break;
        }
    }
    let mut best = best?;
    for _ in 0..MAX_REDRAWS {
        if !best.far_above(bound) {
            break;
        }
        if let Some(other) = draw_pair()
            && other.beats(&best, bound)
        {
            best = other;
        }
    }
    Some(best)
}

#[cfg(test)]
mod tests;
