pub mod audit;
pub mod kube;
pub mod metrics;
