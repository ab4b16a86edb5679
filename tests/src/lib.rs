//! Shared helpers for the integration tests and benchmarks.
pub mod bus;
pub mod controlplane;
pub mod doccmd;
pub mod nodes;
pub mod nodesim;
pub mod recovery;
pub mod render;
pub mod sizing;
pub mod support;
pub mod zone;
