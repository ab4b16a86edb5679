//! The contracts: every type that crosses a process, a version or a disk
//! (the audit line, the Node's record, the episode and its proof, the
//! signal). The agent, the controller, the VM harness, the tests and the
//! fuzz targets read and write them through these types only; the golden
//! files in `common/golden/` pin their JSON, one per format version.
pub mod audit;
pub mod episode;
pub mod record;
pub mod signal;

#[cfg(test)]
mod golden;
