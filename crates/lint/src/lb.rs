//! The load balancer in front of the nodes, as the numbers the rules need: how long it
//! takes to notice a node stopped serving, how long it keeps established connections on
//! a node it has taken out, and how long a new node takes to receive traffic. Presets
//! carry the cloud defaults; every number and its source is in docs/lint-rules.md.

use serde::Serialize;

/// A load balancer's timing, in seconds.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LbProfile {
    /// `gke`, `aws-nlb`, `azure` or `custom`.
    pub name: String,
    /// Seconds between two health checks of a node.
    pub interval_seconds: f64,
    /// Consecutive failed checks before the node is taken out.
    pub unhealthy_threshold: u32,
    /// Seconds one health check may take before it counts as failed.
    pub timeout_seconds: f64,
    /// Seconds the load balancer keeps forwarding established connections to a node it
    /// has taken out (connection draining / deregistration delay).
    pub drain_seconds: f64,
    /// Seconds from a node getting its first endpoint until the load balancer sends it
    /// traffic (registration plus the healthy threshold).
    pub registration_seconds: f64,
}

impl LbProfile {
    /// How long the load balancer keeps sending new connections to a node whose health
    /// check started failing: interval × unhealthy threshold + timeout.
    pub fn detection_window(&self) -> f64 {
        self.interval_seconds * f64::from(self.unhealthy_threshold) + self.timeout_seconds
    }

    /// Google Cloud passthrough Network Load Balancer as GKE programs it for an
    /// `externalTrafficPolicy: Local` Service (ingress-gce `healthchecksl4`).
    pub fn gke() -> Self {
        LbProfile {
            name: "gke".into(),
            interval_seconds: 3.0,
            unhealthy_threshold: 2,
            timeout_seconds: 1.0,
            drain_seconds: 30.0,
            registration_seconds: 15.0,
        }
    }

    /// AWS Network Load Balancer from the AWS Load Balancer Controller, instance targets,
    /// `externalTrafficPolicy: Local` defaults.
    pub fn aws_nlb() -> Self {
        LbProfile {
            name: "aws-nlb".into(),
            interval_seconds: 10.0,
            unhealthy_threshold: 2,
            timeout_seconds: 6.0,
            drain_seconds: 300.0,
            registration_seconds: 120.0,
        }
    }

    /// Azure Standard Load Balancer from cloud-provider-azure defaults.
    pub fn azure() -> Self {
        LbProfile {
            name: "azure".into(),
            interval_seconds: 5.0,
            unhealthy_threshold: 2,
            timeout_seconds: 0.0,
            drain_seconds: 0.0,
            registration_seconds: 30.0,
        }
    }

    /// A preset by its command-line name.
    pub fn preset(name: &str) -> Option<Self> {
        match name {
            "gke" => Some(Self::gke()),
            "aws-nlb" => Some(Self::aws_nlb()),
            "azure" => Some(Self::azure()),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detection_windows_of_the_presets() {
        // gke: seed 2's "6 seconds" is interval × threshold; the check's own timeout adds 1 s.
        for (lb, window) in [
            (LbProfile::gke(), 7.0),
            (LbProfile::aws_nlb(), 26.0),
            (LbProfile::azure(), 10.0),
        ] {
            assert_eq!(lb.detection_window(), window, "{}", lb.name);
            assert_eq!(LbProfile::preset(&lb.name), Some(lb));
        }
        assert_eq!(LbProfile::preset("custom"), None);
    }
}
