pub mod audit;
pub mod courier;
pub mod kube;
pub mod metrics;
