//! What the data path does with a packet, and the one convention its stages
//! use to say "go on" or "stop here".
//!
//! A [`Verdict`] is an XDP action and the [`crate::reason`] it is counted
//! under: every packet gets exactly one, counted once, where the program
//! returns it.
//!
//! Stages are BPF functions of their own (stack and verifier budget), and a
//! BPF function returns one register, so a stage's result travels as one
//! integer, a [`StageResult`]: either [`StageResult::CONTINUE`] (with an
//! optional 32-bit payload for the next stage), or the verdict that ends
//! the packet's run. This is Katran's `FURTHER_PROCESSING`: the "action" half
//! of the integer holds a value no XDP action has. Global BPF functions
//! (which may return only scalars) use the same integer.
//!
//! Inside one stage, helpers return `Result<Verdict, Reason>` (or
//! `Result<T, Reason>`), where `Err(reason)` drops under `reason`.
use core::ops::ControlFlow;

/// An index of [`crate::reason`]: what a verdict is counted under.
pub type Reason = u32;

/// XDP actions, the values of the kernel's `enum xdp_action` (part of the
/// kernel ABI; lb-ebpf checks them against aya's bindings at compile time).
pub mod action {
    pub const ABORTED: u32 = 0;
    pub const DROP: u32 = 1;
    pub const PASS: u32 = 2;
    pub const TX: u32 = 3;
    pub const REDIRECT: u32 = 4;
}

/// An XDP action and the reason it is counted under.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    pub action: u32,
    pub reason: Reason,
}

impl Verdict {
    #[inline(always)]
    pub const fn new(action: u32, reason: Reason) -> Self {
        Self { action, reason }
    }

    /// Hand the packet to the kernel's stack, unchanged.
    #[inline(always)]
    pub const fn pass(reason: Reason) -> Self {
        Self::new(action::PASS, reason)
    }

    #[inline(always)]
    pub const fn drop(reason: Reason) -> Self {
        Self::new(action::DROP, reason)
    }

    /// Send the (rewritten) frame back out of the interface it came in on.
    #[inline(always)]
    pub const fn tx(reason: Reason) -> Self {
        Self::new(action::TX, reason)
    }

    /// The verdict of a stage's `Result`: `Err(reason)` drops under `reason`.
    #[inline(always)]
    pub const fn of(result: Result<Self, Reason>) -> Self {
        match result {
            Ok(verdict) => verdict,
            Err(reason) => Self::drop(reason),
        }
    }

    /// The integer a BPF function that always decides (the last stages)
    /// returns: the same bits as [`StageResult::verdict`], so there is one
    /// encoding, and a stage that never continues says so in its type.
    #[inline(always)]
    pub const fn into_raw(self) -> u64 {
        StageResult::verdict(self).into_raw()
    }

    /// [`Verdict::into_raw`]'s integer, back as a verdict.
    #[inline(always)]
    pub const fn from_raw(raw: u64) -> Self {
        Self::new((raw >> 32) as u32, raw as u32)
    }
}

/// A stage's result in one `u64`: the high word is an XDP action, or
/// [`CONTINUE`]; the low word is the verdict's reason, or the payload the
/// stage hands to the next one.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StageResult(u64);

/// The high word of a [`StageResult`] that continues: no XDP action has
/// this value (Katran's `FURTHER_PROCESSING`).
pub const CONTINUE: u32 = u32::MAX;

impl StageResult {
    /// Go on to the next stage, with nothing to hand over.
    pub const CONTINUE: Self = Self::proceed(0);

    /// Go on to the next stage, handing it `payload`.
    #[inline(always)]
    pub const fn proceed(payload: u32) -> Self {
        Self(((CONTINUE as u64) << 32) | payload as u64)
    }

    /// Stop: the packet's verdict.
    #[inline(always)]
    pub const fn verdict(verdict: Verdict) -> Self {
        Self(((verdict.action as u64) << 32) | verdict.reason as u64)
    }

    /// Stop with a verdict, or drop under the `Err` reason.
    #[inline(always)]
    pub const fn of(result: Result<Verdict, Reason>) -> Self {
        Self::verdict(Verdict::of(result))
    }

    /// Continue with `payload`, or drop under the `Err` reason.
    #[inline(always)]
    pub const fn proceed_or_drop(result: Result<u32, Reason>) -> Self {
        match result {
            Ok(payload) => Self::proceed(payload),
            Err(reason) => Self::verdict(Verdict::drop(reason)),
        }
    }

    /// Continue, or drop under the `Err` reason.
    #[inline(always)]
    pub const fn continue_or_drop(result: Result<(), Reason>) -> Self {
        match result {
            Ok(()) => Self::CONTINUE,
            Err(reason) => Self::verdict(Verdict::drop(reason)),
        }
    }

    /// The payload to continue with, or the verdict to stop with.
    #[inline(always)]
    pub const fn next(self) -> ControlFlow<Verdict, u32> {
        let (high, low) = ((self.0 >> 32) as u32, self.0 as u32);
        if high == CONTINUE {
            ControlFlow::Continue(low)
        } else {
            ControlFlow::Break(Verdict::new(high, low))
        }
    }

    /// The integer a BPF function returns.
    #[inline(always)]
    pub const fn into_raw(self) -> u64 {
        self.0
    }

    /// A BPF function's returned integer, back as a result.
    #[inline(always)]
    pub const fn from_raw(raw: u64) -> Self {
        Self(raw)
    }
}

/// The payload of a [`StageResult`] that continues; otherwise returns
/// `Ok(verdict)` from the enclosing function (which returns
/// `Result<Verdict, Reason>`). Katran's `if (action >= 0) return action;`.
#[macro_export]
macro_rules! proceed {
    ($stage:expr) => {
        match $crate::StageResult::next($stage) {
            ::core::ops::ControlFlow::Continue(payload) => payload,
            ::core::ops::ControlFlow::Break(verdict) => return Ok(verdict),
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reason;

    const ACTIONS: [u32; 5] = [
        action::ABORTED,
        action::DROP,
        action::PASS,
        action::TX,
        action::REDIRECT,
    ];

    #[test]
    fn every_verdict_round_trips_and_never_continues() {
        for action in ACTIONS {
            for reason in 0..reason::COUNT {
                let v = Verdict::new(action, reason);
                let r = StageResult::verdict(v);
                assert_eq!(r.next(), ControlFlow::Break(v));
                assert_ne!(r, StageResult::CONTINUE);
                assert_eq!(StageResult::from_raw(r.into_raw()), r);
            }
        }
    }

    #[test]
    fn continue_carries_its_payload() {
        for payload in [0, 1, 0xffff, 0x1234_5678, u32::MAX] {
            let r = StageResult::proceed(payload);
            assert_eq!(r.next(), ControlFlow::Continue(payload));
            assert_eq!(StageResult::from_raw(r.into_raw()).next(), r.next());
        }
        assert_eq!(StageResult::CONTINUE.next(), ControlFlow::Continue(0));
    }

    #[test]
    fn errors_drop_under_their_reason() {
        let drop = Verdict::drop(reason::DROP_TRUNCATED);
        assert_eq!(drop.action, action::DROP);
        assert_eq!(Verdict::of(Err(reason::DROP_TRUNCATED)), drop);
        assert_eq!(
            StageResult::of(Err(reason::DROP_TRUNCATED)).next(),
            ControlFlow::Break(drop)
        );
        assert_eq!(
            StageResult::proceed_or_drop(Err(reason::DROP_NO_BACKEND)).next(),
            ControlFlow::Break(Verdict::drop(reason::DROP_NO_BACKEND))
        );
        assert_eq!(
            StageResult::proceed_or_drop(Ok(7)).next(),
            ControlFlow::Continue(7)
        );
        assert_eq!(
            StageResult::continue_or_drop(Err(reason::DROP_FLOW_INSERT)).next(),
            ControlFlow::Break(Verdict::drop(reason::DROP_FLOW_INSERT))
        );
        assert_eq!(StageResult::continue_or_drop(Ok(())), StageResult::CONTINUE);
    }

    #[test]
    fn a_decided_verdict_is_the_same_integer() {
        for action in ACTIONS {
            for reason in 0..reason::COUNT {
                let v = Verdict::new(action, reason);
                assert_eq!(v.into_raw(), StageResult::verdict(v).into_raw());
                assert_eq!(Verdict::from_raw(v.into_raw()), v);
            }
        }
    }

    /// A two-stage pipeline written with [`proceed!`].
    fn pipeline(first: StageResult, second: StageResult) -> Result<Verdict, Reason> {
        let payload = proceed!(first);
        let _ = proceed!(second);
        Ok(Verdict::tx(payload))
    }

    #[test]
    fn proceed_returns_the_first_verdict_or_goes_on() {
        let pass = Verdict::pass(reason::PASS_NOT_IP);
        let drop = Verdict::drop(reason::DROP_TRUNCATED);
        let (go, stop) = (StageResult::proceed(6), StageResult::verdict(pass));
        assert_eq!(pipeline(go, StageResult::CONTINUE), Ok(Verdict::tx(6)));
        assert_eq!(pipeline(stop, StageResult::verdict(drop)), Ok(pass));
        assert_eq!(pipeline(go, StageResult::verdict(drop)), Ok(drop));
    }

    #[test]
    fn ok_verdicts_pass_through() {
        let tx = Verdict::tx(reason::TX_TO_BACKEND);
        assert_eq!(tx.action, action::TX);
        assert_eq!(Verdict::of(Ok(tx)), tx);
        assert_eq!(StageResult::of(Ok(tx)).next(), ControlFlow::Break(tx));
        let pass = Verdict::pass(reason::PASS_NOT_VIP);
        assert_eq!(pass.action, action::PASS);
        assert_eq!(StageResult::verdict(pass).next(), ControlFlow::Break(pass));
    }

    #[test]
    fn the_continue_marker_is_no_xdp_action() {
        assert!(!ACTIONS.contains(&CONTINUE));
    }
}
