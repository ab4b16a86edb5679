//! A faithful Kubernetes API server double (see README.md).
