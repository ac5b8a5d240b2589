//! The Kubernetes API source: watchers for Services, EndpointSlices and this Node.
//! Under construction (issue 5).
