//! lastgasp: sees every way a Linux node can shut down, and tells the cluster.
pub mod act;
pub mod agent;
pub mod check;
pub mod config;
pub mod controller;
pub mod decide;
pub mod detect;
pub mod grace;
pub mod http;
pub mod node;
pub mod report;
pub mod signal;
