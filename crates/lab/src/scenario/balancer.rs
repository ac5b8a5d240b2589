//! The emulated cloud load balancer as a scenario names it: its data-path mode, the
//! cloud whose health check it copies (a preset), and the health check's numbers.

use std::time::Duration;

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum LbMode {
    Passthrough,
    NodePort,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum LbPreset {
    Gke,
    AwsNlb,
    Azure,
    Custom,
}

/// Health-check settings in nominal seconds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HealthCheck {
    pub interval_seconds: f64,
    pub timeout_seconds: f64,
    pub healthy_threshold: u32,
    pub unhealthy_threshold: u32,
    /// Time before a new backend starts being probed.
    #[serde(default)]
    pub registration_delay_seconds: f64,
    /// After a node leaves the pool, its established flows are cut after this long
    /// (conntrack entries deleted in the LB; the next packet of such a flow is
    /// treated as new and reset by the node it lands on). 0: flows live until closed.
    #[serde(default)]
    pub drain_timeout_seconds: f64,
}

impl LbPreset {
    /// Public defaults; see docs/lab.md for sources.
    pub fn health_check(self) -> Option<HealthCheck> {
        match self {
            // ingress-gce L4 health check for eTP Local: 3 s, timeout 1 s, healthy 1, unhealthy 2.
            LbPreset::Gke => Some(HealthCheck {
                interval_seconds: 3.0,
                timeout_seconds: 1.0,
                healthy_threshold: 1,
                unhealthy_threshold: 2,
                registration_delay_seconds: 0.0,
                drain_timeout_seconds: 0.0,
            }),
            // AWS NLB target group (TCP/HTTP): 10 s interval, 10 s timeout (capped below the interval here), 2/2.
            LbPreset::AwsNlb => Some(HealthCheck {
                interval_seconds: 10.0,
                timeout_seconds: 6.0,
                healthy_threshold: 2,
                unhealthy_threshold: 2,
                registration_delay_seconds: 0.0,
                drain_timeout_seconds: 0.0,
            }),
            // Azure LB probe: 5 s interval, 2 consecutive failures; one success marks healthy.
            LbPreset::Azure => Some(HealthCheck {
                interval_seconds: 5.0,
                timeout_seconds: 5.0,
                healthy_threshold: 1,
                unhealthy_threshold: 2,
                registration_delay_seconds: 0.0,
                drain_timeout_seconds: 0.0,
            }),
            LbPreset::Custom => None,
        }
    }
}

impl HealthCheck {
    /// The real time between two probe rounds at time scale `scale`.
    pub fn real_interval(&self, scale: f64) -> Duration {
        Duration::from_secs_f64((self.interval_seconds * scale).max(0.0))
            .max(Duration::from_millis(10))
    }

    /// The real time a probe may take at time scale `scale`. A floor of 150 ms: at
    /// small time scales a busy 2-core machine would otherwise turn scheduling delays
    /// into failed probes.
    pub fn real_probe_timeout(&self, scale: f64) -> Duration {
        Duration::from_secs_f64((self.timeout_seconds.min(self.interval_seconds) * scale).max(0.0))
            .max(Duration::from_millis(150))
            .min(self.real_interval(scale))
    }

    /// Longest time (nominal s) between a node starting to fail and the LB
    /// removing it: the failing answers needed, plus one interval of phase, plus a
    /// probe timeout.
    pub fn detection_window_s(&self) -> f64 {
        self.interval_seconds * self.unhealthy_threshold as f64
            + self.timeout_seconds.min(self.interval_seconds)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gke_detection_window_is_seven_seconds() {
        let hc = LbPreset::Gke.health_check().unwrap();
        assert_eq!(hc.detection_window_s(), 7.0);
    }
}
