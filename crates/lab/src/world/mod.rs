//! The lab's world: what a run builds and drives. The network of namespaces
//! (`netns`, `fabric`), the pods' servers (`pod`), the kubelet and Deployment
//! controller emulation (`cluster`), the emulated control plane that publishes to each
//! node's kproxy (`controlplane`) or the real one of a k8s-lab instance (`k8s`), the
//! real kproxy daemon per node (`kproxyd`), the emulated cloud load balancer (`lb`),
//! the load generator (`loadgen`), and the run's clock and event timeline
//! (`timeline`).
//!
//! Each part takes its settings in the words of `scenario` and records what happens on the
//! timeline; none of them knows which run drives it.

pub mod cluster;
pub mod controlplane;
pub mod fabric;
pub mod k8s;
pub mod kproxyd;
pub mod lb;
pub mod loadgen;
pub mod netns;
pub mod pod;
pub mod timeline;
