//! The load balancer in front of the nodes, as the numbers the rules need: how long it
//! takes to notice a node stopped serving, how long it keeps established connections on
//! a node it has taken out, and how long a new node takes to receive traffic. Presets
//! carry the cloud defaults; every number and its source is in docs/lint-rules.md.

use std::collections::BTreeMap;

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

/// Numbers given explicitly on the command line: they win over the preset and over the
/// Service's annotations.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LbOverrides {
    pub interval_seconds: Option<f64>,
    pub unhealthy_threshold: Option<u32>,
    pub timeout_seconds: Option<f64>,
    pub drain_seconds: Option<f64>,
    pub registration_seconds: Option<f64>,
}

impl LbOverrides {
    pub fn apply(&self, lb: &mut LbProfile) {
        if let Some(v) = self.interval_seconds {
            lb.interval_seconds = v;
        }
        if let Some(v) = self.unhealthy_threshold {
            lb.unhealthy_threshold = v;
        }
        if let Some(v) = self.timeout_seconds {
            lb.timeout_seconds = v;
        }
        if let Some(v) = self.drain_seconds {
            lb.drain_seconds = v;
        }
        if let Some(v) = self.registration_seconds {
            lb.registration_seconds = v;
        }
    }
}

/// A Service annotation lint could not use, with why.
#[derive(Clone, Debug, PartialEq)]
pub struct BadAnnotation {
    pub annotation: String,
    pub reason: String,
}

const AWS_INTERVAL: &str = "service.beta.kubernetes.io/aws-load-balancer-healthcheck-interval";
const AWS_TIMEOUT: &str = "service.beta.kubernetes.io/aws-load-balancer-healthcheck-timeout";
const AWS_UNHEALTHY: &str =
    "service.beta.kubernetes.io/aws-load-balancer-healthcheck-unhealthy-threshold";
const AWS_TG_ATTRIBUTES: &str =
    "service.beta.kubernetes.io/aws-load-balancer-target-group-attributes";
const AZURE_INTERVAL: &str = "service.beta.kubernetes.io/azure-load-balancer-health-probe-interval";
const AZURE_PROBES: &str =
    "service.beta.kubernetes.io/azure-load-balancer-health-probe-num-of-probe";

impl LbProfile {
    /// The profile for one Service: this preset's numbers, then the Service annotations the
    /// preset's cloud controller reads (aws-nlb: the health-check and target-group
    /// annotations; azure: the probe annotations), then the command-line flags. Unusable
    /// annotations are returned, not ignored silently.
    pub fn for_service(
        &self,
        annotations: &BTreeMap<String, String>,
        flags: &LbOverrides,
    ) -> (LbProfile, Vec<BadAnnotation>) {
        let mut lb = self.clone();
        let mut bad = Vec::new();
        let mut used = false;
        let mut seconds = |key: &str, bad: &mut Vec<BadAnnotation>| -> Option<f64> {
            let v = annotations.get(key)?;
            match v.trim().parse::<f64>() {
                Ok(s) if s.is_finite() && (0.0..=86_400.0).contains(&s) => {
                    used = true;
                    Some(s)
                }
                _ => {
                    bad.push(BadAnnotation {
                        annotation: key.to_string(),
                        reason: format!("{:?} is not a number of seconds between 0 and 86400", v),
                    });
                    None
                }
            }
        };
        match self.name.as_str() {
            "aws-nlb" => {
                if let Some(v) = seconds(AWS_INTERVAL, &mut bad) {
                    lb.interval_seconds = v;
                }
                if let Some(v) = seconds(AWS_TIMEOUT, &mut bad) {
                    lb.timeout_seconds = v;
                }
                if let Some(v) = seconds(AWS_UNHEALTHY, &mut bad) {
                    lb.unhealthy_threshold = v.max(1.0) as u32;
                }
                // "deregistration_delay.timeout_seconds=120,preserve_client_ip.enabled=true"
                if let Some(attrs) = annotations.get(AWS_TG_ATTRIBUTES) {
                    for kv in attrs.split(',') {
                        if let Some(("deregistration_delay.timeout_seconds", v)) =
                            kv.split_once('=').map(|(k, v)| (k.trim(), v.trim()))
                        {
                            match v.parse::<f64>() {
                                Ok(s) if s.is_finite() && (0.0..=86_400.0).contains(&s) => {
                                    lb.drain_seconds = s;
                                    used = true;
                                }
                                _ => bad.push(BadAnnotation {
                                    annotation: AWS_TG_ATTRIBUTES.to_string(),
                                    reason: format!(
                                        "deregistration_delay.timeout_seconds {:?} is not a number of seconds",
                                        v
                                    ),
                                }),
                            }
                        }
                    }
                }
            }
            "azure" => {
                if let Some(v) = seconds(AZURE_INTERVAL, &mut bad) {
                    lb.interval_seconds = v;
                }
                if let Some(v) = seconds(AZURE_PROBES, &mut bad) {
                    lb.unhealthy_threshold = v.max(1.0) as u32;
                }
            }
            _ => {}
        }
        if used {
            lb.name = format!("{} with Service annotations", self.name);
        }
        flags.apply(&mut lb);
        (lb, bad)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_annotations_then_flags() {
        let a: BTreeMap<String, String> = [
            (AWS_INTERVAL, "5"),
            (AWS_UNHEALTHY, "3"),
            (
                AWS_TG_ATTRIBUTES,
                "preserve_client_ip.enabled=true, deregistration_delay.timeout_seconds=60",
            ),
            (AWS_TIMEOUT, "soon"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let flags = LbOverrides {
            unhealthy_threshold: Some(4),
            ..Default::default()
        };
        let (lb, bad) = LbProfile::aws_nlb().for_service(&a, &flags);
        assert_eq!(
            (
                lb.interval_seconds,
                lb.unhealthy_threshold,
                lb.timeout_seconds,
                lb.drain_seconds
            ),
            (5.0, 4, 6.0, 60.0)
        );
        assert_eq!(lb.name, "aws-nlb with Service annotations");
        assert_eq!(bad.len(), 1);
        assert_eq!(bad[0].annotation, AWS_TIMEOUT);
        // The gke preset does not read AWS annotations.
        let (lb, bad) = LbProfile::gke().for_service(&a, &LbOverrides::default());
        assert_eq!((lb, bad), (LbProfile::gke(), vec![]));
        // Azure: probe interval and count.
        let a: BTreeMap<String, String> = [
            (AZURE_INTERVAL.to_string(), "10".to_string()),
            (AZURE_PROBES.to_string(), "3".to_string()),
        ]
        .into();
        let (lb, _) = LbProfile::azure().for_service(&a, &LbOverrides::default());
        assert_eq!(lb.detection_window(), 30.0);
    }

    #[test]
    fn detection_windows_of_the_presets() {
        // gke: the rolling-update guide's "6 seconds" is interval × threshold; the check's own
        // timeout adds 1 s.
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
