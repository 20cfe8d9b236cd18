//! Packet-level testing of the XDP program through `BPF_PROG_TEST_RUN`:
//! a frame builder with independent checksums ([`packet`]), the loaded
//! program with its maps ([`harness`]), thread isolation ([`isolate`]) and
//! the world of VIPs and backends the fixtures and the fuzzer share ([`world`]).
//! Used by the packet tests, the fixture suite, the fuzzer and the
//! data-plane benchmark.
pub mod harness;
pub mod isolate;
pub mod packet;
pub mod world;
