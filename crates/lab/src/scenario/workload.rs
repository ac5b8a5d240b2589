//! The Deployment behind the lab Service as a scenario describes it: its rollout
//! settings, and what each pod does (its profile on SIGTERM, preStop, grace period,
//! readiness probe). All periods are nominal seconds.

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReadinessProbe {
    pub initial_delay_seconds: f64,
    pub period_seconds: f64,
    pub timeout_seconds: f64,
    pub success_threshold: u32,
    pub failure_threshold: u32,
}

/// What every pod of the Deployment looks like.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PodTemplate {
    pub profile: PodProfile,
    pub pre_stop_sleep_seconds: f64,
    pub termination_grace_period_seconds: f64,
    pub readiness_probe: ReadinessProbe,
    /// Real milliseconds (not scaled: the race is with the proxies, which run in real
    /// time) from the container's start to its server listening. The lab's readiness
    /// probe never looks at the port, so with a delay the pod models one without a
    /// readiness probe whose application is slow to bind: Ready before it listens
    /// (issue 49; the `ready-before-listen` matrix row). 0: it listens at once.
    #[serde(default)]
    pub listen_delay_ms: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DeploymentSpec {
    pub replicas: u32,
    pub max_surge: u32,
    pub max_unavailable: u32,
    pub min_ready_seconds: f64,
    /// At most one pod of the Deployment per node (terminating pods included, as
    /// the scheduler sees them until they are gone).
    pub one_pod_per_node: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum PodProfile {
    Graceful,
    FailReadinessOnTerm,
    ExitOnTerm,
}

impl std::fmt::Display for PodProfile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PodProfile::Graceful => "graceful",
            PodProfile::FailReadinessOnTerm => "fail-readiness-on-term",
            PodProfile::ExitOnTerm => "exit-on-term",
        })
    }
}
