//! Flow events from the kernel's ring buffer ([`lb_common::EVENTS_MAP`]),
//! drained asynchronously with tokio's `AsyncFd` (the ring buffer's fd
//! becomes readable when the program submits a record).

use std::{mem::size_of, time::Duration};

use anyhow::Context as _;
use aya::maps::{MapData, RingBuf};
use lb_common::{
    CLOSE_BACKEND_RST, CLOSE_FIN, CLOSE_IDLE, CLOSE_RST, EVENT_CLOSED, EVENT_OPENED, EVENT_REFUSED,
    EVENT_RESPONDED, FlowEvent,
};
use tokio::io::{Interest, unix::AsyncFd};

/// Why a flow ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CloseReason {
    Fin,
    /// An RST from the client (or one the kernel cannot attribute).
    Rst,
    /// The backend reset an established connection.
    BackendRst,
    Idle,
    /// A reason code this build does not know (newer kernel program).
    Other(u8),
}

/// A decoded [`FlowEvent`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    Opened { backend: u32 },
    Responded { backend: u32, latency: Duration },
    Closed { backend: u32, reason: CloseReason },
    Refused { backend: u32 },
}

impl Event {
    /// Decodes one ring-buffer record; `None` for a short record or an
    /// unknown kind (skipped rather than misread).
    pub fn decode(record: &[u8]) -> Option<Self> {
        if record.len() < size_of::<FlowEvent>() {
            return None;
        }
        // SAFETY: the record holds at least size_of::<FlowEvent>() bytes and
        // FlowEvent is plain old data; read_unaligned copes with any alignment.
        let raw: FlowEvent = unsafe { record.as_ptr().cast::<FlowEvent>().read_unaligned() };
        let backend = raw.backend_id;
        Some(match raw.kind {
            EVENT_OPENED => Self::Opened { backend },
            EVENT_RESPONDED => Self::Responded {
                backend,
                latency: Duration::from_nanos(raw.value_ns),
            },
            EVENT_CLOSED => Self::Closed {
                backend,
                reason: match raw.reason {
                    CLOSE_FIN => CloseReason::Fin,
                    CLOSE_RST => CloseReason::Rst,
                    CLOSE_BACKEND_RST => CloseReason::BackendRst,
                    CLOSE_IDLE => CloseReason::Idle,
                    other => CloseReason::Other(other),
                },
            },
            EVENT_REFUSED => Self::Refused { backend },
            _ => return None,
        })
    }
}

/// The ring buffer, registered with tokio's reactor.
pub struct EventStream {
    ring: AsyncFd<RingBuf<MapData>>,
}

impl EventStream {
    pub fn new(ring: RingBuf<MapData>) -> anyhow::Result<Self> {
        // SAFETY: the RingBuf owns its map fd, which stays open and unchanged
        // until the AsyncFd (and with it the RingBuf) is dropped.
        let ring = unsafe { AsyncFd::register_with_interest(ring, Interest::READABLE) }
            .map_err(std::io::Error::from)
            .context("registering the event ring buffer with tokio")?;
        Ok(Self { ring })
    }

    /// Waits until records are available, then appends every decodable one
    /// to `out`. Cancel-safe: records are only consumed after readiness.
    pub async fn next_batch(&mut self, out: &mut Vec<Event>) -> anyhow::Result<()> {
        let mut guard = self
            .ring
            .readable_mut()
            .await
            .context("waiting for the event ring buffer")?;
        let ring = guard.get_inner_mut();
        while let Some(record) = ring.next() {
            out.extend(Event::decode(&record));
        }
        guard.clear_ready();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(event: FlowEvent) -> Vec<u8> {
        // SAFETY: FlowEvent is repr(C) plain old data with explicit padding.
        let bytes = unsafe {
            std::slice::from_raw_parts(
                (&event as *const FlowEvent).cast::<u8>(),
                size_of::<FlowEvent>(),
            )
        };
        bytes.to_vec()
    }

    #[test]
    fn decodes_each_kind() {
        let base = FlowEvent {
            backend_id: 7,
            ..Default::default()
        };
        let opened = FlowEvent {
            kind: EVENT_OPENED,
            ..base
        };
        assert_eq!(
            Event::decode(&record(opened)),
            Some(Event::Opened { backend: 7 })
        );
        let responded = FlowEvent {
            kind: EVENT_RESPONDED,
            value_ns: 1_500,
            ..base
        };
        assert_eq!(
            Event::decode(&record(responded)),
            Some(Event::Responded {
                backend: 7,
                latency: Duration::from_nanos(1_500)
            })
        );
        let closed = FlowEvent {
            kind: EVENT_CLOSED,
            reason: CLOSE_RST,
            ..base
        };
        assert_eq!(
            Event::decode(&record(closed)),
            Some(Event::Closed {
                backend: 7,
                reason: CloseReason::Rst
            })
        );
        let refused = FlowEvent {
            kind: EVENT_REFUSED,
            ..base
        };
        assert_eq!(
            Event::decode(&record(refused)),
            Some(Event::Refused { backend: 7 })
        );
    }

    #[test]
    fn skips_short_records_and_unknown_kinds() {
        let opened = record(FlowEvent {
            kind: EVENT_OPENED,
            ..Default::default()
        });
        assert_eq!(Event::decode(&opened[..opened.len() - 1]), None);
        let unknown = record(FlowEvent {
            kind: 99,
            ..Default::default()
        });
        assert_eq!(Event::decode(&unknown), None);
    }
}
