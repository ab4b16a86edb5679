//! lastgasp: sees every way a Linux node can shut down, and tells the cluster.
pub mod act;
pub mod detect;
pub mod node;
pub mod signal;
