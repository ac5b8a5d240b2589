//! The rollout scenario's parameters: defaults from the rolling-update guide
//! (seed 2, summed up in docs/lint-rules.md), a YAML file
//! (`--config FILE`, same field names as below, camelCase), and validation.

use serde::{Deserialize, Serialize};

use crate::LabError;
use crate::scenario::balancer::{HealthCheck, LbMode, LbPreset};
use crate::scenario::load::LoadSpec;
use crate::scenario::workload::{DeploymentSpec, PodProfile, PodTemplate, ReadinessProbe};

/// The most nodes a lab cluster has: the address plan gives each node one address in
/// 10.200.0.0/24 and a /24 of pod addresses (10.244.N.0/24).
pub const MAX_NODES: usize = 200;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LoadBalancerSpec {
    pub preset: LbPreset,
    pub mode: LbMode,
    /// Required with preset `custom`; overrides the preset otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_check: Option<HealthCheck>,
}

impl LoadBalancerSpec {
    pub fn effective_health_check(&self) -> Result<HealthCheck, LabError> {
        self.health_check
            .or_else(|| self.preset.health_check())
            .ok_or_else(|| {
                LabError::Invalid("load balancer preset `custom` needs healthCheck settings".into())
            })
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct RolloutConfig {
    pub nodes: usize,
    pub deployment: DeploymentSpec,
    pub pod: PodTemplate,
    pub load_balancer: LoadBalancerSpec,
    pub load: LoadSpec,
    /// Nominal seconds from a pod change to every node's kproxy seeing it.
    pub propagation_delay_seconds: f64,
    /// Real time = nominal time × this.
    pub time_scale: f64,
    pub publish_not_ready_addresses: bool,
    /// Nominal seconds of load before the rollout starts.
    pub warmup_seconds: f64,
    /// Nominal seconds of load after the rollout completes and the LB pool is full again.
    pub settle_seconds: f64,
    /// Seed for the random choices the lab makes (probe phases); both behaviours of
    /// `--compare` use the same one.
    pub seed: u64,
}

impl Default for RolloutConfig {
    fn default() -> Self {
        RolloutConfig {
            nodes: 3,
            deployment: DeploymentSpec {
                replicas: 3,
                // One pod per node and 3 nodes: a surge pod could not be scheduled,
                // so the rollout goes one node at a time (maxUnavailable 1).
                max_surge: 0,
                max_unavailable: 1,
                min_ready_seconds: 0.0,
                one_pod_per_node: true,
            },
            pod: PodTemplate {
                profile: PodProfile::Graceful,
                pre_stop_sleep_seconds: 10.0,
                termination_grace_period_seconds: 30.0,
                readiness_probe: ReadinessProbe {
                    initial_delay_seconds: 20.0,
                    period_seconds: 10.0,
                    timeout_seconds: 1.0,
                    success_threshold: 1,
                    failure_threshold: 3,
                },
                listen_delay_ms: 0,
            },
            load_balancer: LoadBalancerSpec {
                preset: LbPreset::Gke,
                mode: LbMode::Passthrough,
                health_check: None,
            },
            load: LoadSpec::default(),
            propagation_delay_seconds: 0.5,
            time_scale: 0.1,
            publish_not_ready_addresses: false,
            warmup_seconds: 3.0,
            settle_seconds: 8.0,
            seed: 1,
        }
    }
}

impl RolloutConfig {
    pub fn from_yaml(text: &str) -> Result<RolloutConfig, LabError> {
        serde_saphyr::from_str(text).map_err(|e| LabError::Invalid(format!("config: {e}")))
    }

    pub fn validate(&self) -> Result<(), LabError> {
        let bad = |m: String| Err(LabError::Invalid(m));
        if self.nodes == 0 || self.nodes > MAX_NODES {
            return bad(format!("nodes must be 1..={}", MAX_NODES));
        }
        let d = &self.deployment;
        if d.replicas == 0 || d.replicas > 200 {
            return bad("replicas must be 1..=200".into());
        }
        if d.max_surge == 0 && d.max_unavailable == 0 {
            return bad("maxSurge and maxUnavailable cannot both be 0 (the Deployment would never progress)".into());
        }
        if d.one_pod_per_node && d.replicas as usize > self.nodes {
            return bad(format!(
                "{} replicas cannot run one per node on {} nodes",
                d.replicas, self.nodes
            ));
        }
        if d.one_pod_per_node && d.max_unavailable == 0 && d.replicas as usize == self.nodes {
            return bad("one pod per node on every node with maxUnavailable 0: the surge pod can never be scheduled".into());
        }
        if !(self.time_scale > 0.0 && self.time_scale <= 10.0) {
            return bad("timeScale must be in (0, 10]".into());
        }
        let nums = [
            self.pod.pre_stop_sleep_seconds,
            self.pod.termination_grace_period_seconds,
            self.pod.readiness_probe.initial_delay_seconds,
            self.propagation_delay_seconds,
            self.warmup_seconds,
            self.settle_seconds,
            d.min_ready_seconds,
        ];
        if nums
            .iter()
            .any(|v| !v.is_finite() || *v < 0.0 || *v > 3600.0)
        {
            return bad("durations must be between 0 and 3600 seconds".into());
        }
        if self.pod.listen_delay_ms > 60_000 {
            return bad("pod.listenDelayMs must be at most 60000".into());
        }
        if self.pod.readiness_probe.period_seconds.is_nan()
            || self.pod.readiness_probe.period_seconds <= 0.0
        {
            return bad("readinessProbe.periodSeconds must be > 0".into());
        }
        let hc = self.load_balancer.effective_health_check()?;
        if !(hc.interval_seconds > 0.0 && hc.timeout_seconds > 0.0)
            || hc.healthy_threshold == 0
            || hc.unhealthy_threshold == 0
        {
            return bad("health check interval/timeout must be > 0 and thresholds >= 1".into());
        }
        let l = &self.load;
        if !(l.new_connection_rate >= 0.0 && l.new_connection_rate <= 5000.0)
            || l.keepalive_connections > 500
        {
            return bad(
                "load: newConnectionRate must be 0..=5000 and keepaliveConnections <= 500".into(),
            );
        }
        if l.new_connection_rate == 0.0 && l.keepalive_connections == 0 {
            return bad("load: no traffic configured".into());
        }
        Ok(())
    }

    /// Seed 2's inequality for `fail-readiness-on-term` pods:
    /// preStop + period × (failureThreshold − 1) ≥ terminationGracePeriodSeconds.
    pub fn seed2_inequality_holds(&self) -> bool {
        let p = &self.pod;
        p.pre_stop_sleep_seconds
            + p.readiness_probe.period_seconds
                * (p.readiness_probe.failure_threshold.saturating_sub(1)) as f64
            >= p.termination_grace_period_seconds
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_follow_seed_2() {
        let c = RolloutConfig::default();
        c.validate().unwrap();
        assert!(c.seed2_inequality_holds(), "10 + 10*2 >= 30");
        assert_eq!(
            c.load_balancer
                .effective_health_check()
                .unwrap()
                .interval_seconds,
            3.0
        );
    }

    #[test]
    fn yaml_overrides_some_fields() {
        let c = RolloutConfig::from_yaml(
            "nodes: 4\npod:\n  profile: fail-readiness-on-term\n  preStopSleepSeconds: 5\n  terminationGracePeriodSeconds: 60\n  readinessProbe: {initialDelaySeconds: 1, periodSeconds: 2, timeoutSeconds: 1, successThreshold: 1, failureThreshold: 3}\nloadBalancer: {preset: custom, mode: node-port, healthCheck: {intervalSeconds: 2, timeoutSeconds: 1, healthyThreshold: 1, unhealthyThreshold: 3}}\n",
        )
        .unwrap();
        assert_eq!(c.nodes, 4);
        assert_eq!(c.pod.profile, PodProfile::FailReadinessOnTerm);
        assert!(!c.seed2_inequality_holds());
        assert_eq!(c.load_balancer.mode, LbMode::NodePort);
        c.validate().unwrap();
        assert_eq!(c.deployment.replicas, 3, "unset fields keep defaults");
    }

    #[test]
    fn invalid_configs_are_rejected() {
        type Mutation = Box<dyn Fn(&mut RolloutConfig)>;
        let table: Vec<(&str, Mutation)> = vec![
            ("no nodes", Box::new(|c| c.nodes = 0)),
            (
                "stuck deployment",
                Box::new(|c| c.deployment.max_unavailable = 0),
            ),
            (
                "too many replicas for anti-affinity",
                Box::new(|c| c.deployment.replicas = 4),
            ),
            (
                "custom without values",
                Box::new(|c| c.load_balancer.preset = LbPreset::Custom),
            ),
            ("negative scale", Box::new(|c| c.time_scale = -1.0)),
            (
                "no traffic",
                Box::new(|c| {
                    c.load.new_connection_rate = 0.0;
                    c.load.keepalive_connections = 0;
                }),
            ),
        ];
        for (what, f) in table {
            let mut c = RolloutConfig::default();
            f(&mut c);
            assert!(c.validate().is_err(), "{what} should be rejected");
        }
        assert!(RolloutConfig::from_yaml("bogus: 1\n").is_err());
    }
}
