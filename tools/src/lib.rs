//! The harnesses behind the `gpu-pager` program, outside the library so that library
//! consumers (the C library, the Python wheel) never compile them:
//!
//! - [`stress`]: a long randomized soak of the pager with data verification and fault
//!   injection;
//! - [`bench`](mod@bench): the release/resume latency table, every figure next to a limit measured in
//!   the same run.

pub mod bench;
pub mod stress;
