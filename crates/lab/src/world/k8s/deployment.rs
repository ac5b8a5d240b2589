//! The lab's Deployment on the real API server: the object as the scenario describes
//! it (kcm's Deployment controller reads its rollout fields; the lab kubelet runs its
//! container, probe and preStop), applied per revision, and kcm's word on whether a
//! rollout is complete.

use k8s_openapi::api::apps::v1::Deployment;
use kube::api::{Api, Patch, PatchParams};
use serde_json::{Value, json};

use super::{FIELD_MANAGER, api_err};
use crate::LabError;
use crate::scenario::service::{POD_PORT, SERVICE_NAME, SERVICE_NAMESPACE};
use crate::scenario::workload::{DeploymentSpec, PodTemplate};

/// The pod template annotation naming the lab revision (copied onto every pod).
pub const REVISION_ANNOTATION: &str = "kproxy-lab/revision";

/// The Deployment as the lab's configuration describes it. Only the rollout fields
/// drive anything (kcm's Deployment controller); the container, probe and preStop
/// are what the lab kubelet runs, in nominal seconds (the lab runs them on its
/// time scale). minReadySeconds is real: the controller reads it.
pub fn deployment_object(
    d: &DeploymentSpec,
    t: &PodTemplate,
    revision: u32,
    time_scale: f64,
) -> Value {
    let secs = |v: f64| v.ceil().max(0.0) as i64;
    let at_least_one = |v: f64| secs(v).max(1);
    let p = &t.readiness_probe;
    let mut container = json!({
        "name": "web", "image": format!("kproxy-lab/web:{revision}"),
        "ports": [{"containerPort": POD_PORT}],
        "readinessProbe": {
            "httpGet": {"path": "/", "port": POD_PORT},
            "initialDelaySeconds": secs(p.initial_delay_seconds),
            "periodSeconds": at_least_one(p.period_seconds),
            "timeoutSeconds": at_least_one(p.timeout_seconds),
            "successThreshold": p.success_threshold.max(1),
            "failureThreshold": p.failure_threshold.max(1)
        }
    });
    if t.pre_stop_sleep_seconds > 0.0 {
        container["lifecycle"] =
            json!({"preStop": {"sleep": {"seconds": at_least_one(t.pre_stop_sleep_seconds)}}});
    }
    let mut pod_spec = json!({
        "terminationGracePeriodSeconds": secs(t.termination_grace_period_seconds),
        "containers": [container]
    });
    if d.one_pod_per_node {
        pod_spec["affinity"] = json!({"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": {"app": SERVICE_NAME}}, "topologyKey": "kubernetes.io/hostname"}]}});
    }
    let min_ready = if d.min_ready_seconds > 0.0 {
        (d.min_ready_seconds * time_scale).ceil() as i64
    } else {
        0
    };
    json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": SERVICE_NAME, "namespace": SERVICE_NAMESPACE},
        "spec": {
            "replicas": d.replicas,
            "minReadySeconds": min_ready,
            "revisionHistoryLimit": 2,
            "selector": {"matchLabels": {"app": SERVICE_NAME}},
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxSurge": d.max_surge, "maxUnavailable": d.max_unavailable}},
            "template": {
                "metadata": {"labels": {"app": SERVICE_NAME},
                             "annotations": {REVISION_ANNOTATION: revision.to_string()}},
                "spec": pod_spec
            }
        }
    })
}

/// Create the Deployment (revision 1) or roll it to `revision`.
pub async fn apply_deployment(
    client: &kube::Client,
    d: &DeploymentSpec,
    t: &PodTemplate,
    revision: u32,
    time_scale: f64,
) -> Result<(), LabError> {
    let api: Api<Deployment> = Api::namespaced(client.clone(), SERVICE_NAMESPACE);
    api.patch(
        SERVICE_NAME,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(deployment_object(d, t, revision, time_scale)),
    )
    .await
    .map_err(api_err(format!("apply deployment revision {revision}")))?;
    Ok(())
}

/// Whether kcm reports the rollout complete: the controller saw the latest spec,
/// every replica is updated and available, and no other replica is left.
pub fn deployment_complete(dep: &Deployment, replicas: u32) -> bool {
    let (Some(status), Some(generation)) = (dep.status.as_ref(), dep.metadata.generation) else {
        return false;
    };
    let r = replicas as i32;
    status.observed_generation.unwrap_or(0) >= generation
        && status.updated_replicas.unwrap_or(0) == r
        && status.available_replicas.unwrap_or(0) == r
        && status.replicas.unwrap_or(0) == r
}

pub async fn get_deployment(client: &kube::Client) -> Result<Option<Deployment>, LabError> {
    let api: Api<Deployment> = Api::namespaced(client.clone(), SERVICE_NAMESPACE);
    api.get_opt(SERVICE_NAME)
        .await
        .map_err(api_err("get deployment"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deployment_carries_the_rollout_parameters() {
        let d = DeploymentSpec {
            replicas: 3,
            max_surge: 1,
            max_unavailable: 0,
            min_ready_seconds: 5.0,
            one_pod_per_node: true,
        };
        let t = crate::scenario::rollout::RolloutConfig::default().pod;
        let v = deployment_object(&d, &t, 2, 0.1);
        assert_eq!(v["spec"]["strategy"]["rollingUpdate"]["maxSurge"], 1);
        assert_eq!(v["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"], 0);
        assert_eq!(
            v["spec"]["minReadySeconds"], 1,
            "5 nominal s at scale 0.1, rounded up"
        );
        assert_eq!(
            v["spec"]["template"]["metadata"]["annotations"][REVISION_ANNOTATION],
            "2"
        );
        assert!(v["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"].is_object());
        let dep: Deployment = serde_json::from_value(v).expect("a valid apps/v1 Deployment");
        assert_eq!(dep.spec.map(|s| s.replicas), Some(Some(3)));
    }
}
