//! Handing the pool's decisions to the kernel. Pure table builders
//! ([`tables`], with [`maglev`], [`smooth_wrr`] and [`prefix`]) compute a
//! VIP's weight-derived tables ([`zone_tables`] those of a zone-aware VIP,
//! block by block); the writers ([`writers`], [`publisher`])
//! hold their map handles open from startup and write plans, selections,
//! tables and scores in an order the running program can always read
//! ([`swap`]: tables built aside, then the descriptors flipped).
//!
//! May use: settings, kernel, ingest, estimate, pool.
//! Order: settings → kernel → ingest → estimate → pool → publish → surface → discover → daemon.

pub mod maglev;
pub mod prefix;
pub mod publisher;
pub mod relief;
pub mod smooth_wrr;
pub mod swap;
pub mod tables;
pub mod writers;
pub mod zone_tables;
