//! The rules: a pure function from the parsed objects, the load balancer profile and the
//! proxy's programming time to findings. Each rule is arithmetic on values already in the
//! user's manifests; docs/lint-rules.md gives each rule's reasoning and sources.
//!
//! A workload is checked once per LoadBalancer Service that selects its pods (same
//! namespace, Service selector ⊆ pod template labels), because `externalTrafficPolicy:
//! Local` and `Cluster` put different load balancers in front of the same pods: with
//! Local the load balancer health-checks each node for local endpoints, so a node whose
//! last pod terminates must be taken out by the load balancer before that pod stops
//! serving; with Cluster every node forwards to every endpoint and only the proxies on
//! the nodes have to catch up.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1 as corev1;
use k8s_openapi::api::policy::v1 as policyv1;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kproxy_core::manifest::Location;
use kproxy_core::model::{ServiceType, TrafficPolicy};
use serde::Serialize;

use crate::input::{
    At, Inventory, Strategy, Workload, WorkloadKind, WorkloadRef, namespace_of, namespace_str,
};
use crate::lb::{LbOverrides, LbProfile};

/// How bad a finding is. Errors fail `kproxy lint` (exit 1); warnings fail it only with
/// `--deny-warnings`; notes never do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Error,
    Warning,
    Note,
}

impl Severity {
    pub fn as_str(self) -> &'static str {
        match self {
            Severity::Error => "error",
            Severity::Warning => "warning",
            Severity::Note => "note",
        }
    }
}

/// One rule of the catalogue (for SARIF's `tool.driver.rules` and the docs).
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Rule {
    pub id: &'static str,
    /// The most severe level the rule reports.
    pub severity: Severity,
    pub summary: &'static str,
}

pub const MANIFEST_INVALID: &str = "manifest-invalid";
pub const READINESS_PROBE_MISSING: &str = "readiness-probe-missing";
pub const PRESTOP_SHORTER_THAN_LB_DETECTION: &str = "prestop-shorter-than-lb-detection";
pub const PRESTOP_DURATION_UNKNOWN: &str = "prestop-duration-unknown";
pub const READINESS_FAILS_BEFORE_KILL: &str = "readiness-fails-before-kill";
pub const TERMINATION_GRACE_VS_LB_DRAIN: &str = "termination-grace-vs-lb-drain";
pub const READY_BEFORE_LB_REGISTRATION: &str = "ready-before-lb-registration";
pub const ETP_LOCAL_NO_SURGE: &str = "etp-local-no-surge";
pub const ROLLOUT_MAX_UNAVAILABLE: &str = "rollout-max-unavailable";
pub const PDB_MISSING: &str = "pdb-missing";
pub const PDB_ALLOWS_ALL_DOWN: &str = "pdb-allows-all-down";

pub const RULES: &[Rule] = &[
    Rule {
        id: MANIFEST_INVALID,
        severity: Severity::Error,
        summary: "An object could not be read; it was not checked.",
    },
    Rule {
        id: READINESS_PROBE_MISSING,
        severity: Severity::Error,
        summary: "A load-balanced container has no readiness probe: its pod is Ready before it serves.",
    },
    Rule {
        id: PRESTOP_SHORTER_THAN_LB_DETECTION,
        severity: Severity::Error,
        summary: "The preStop delay ends before the load balancer (Local) or the proxies (Cluster) stop sending new connections.",
    },
    Rule {
        id: PRESTOP_DURATION_UNKNOWN,
        severity: Severity::Note,
        summary: "The preStop hook's duration cannot be read; the rules that need it were skipped.",
    },
    Rule {
        id: READINESS_FAILS_BEFORE_KILL,
        severity: Severity::Warning,
        summary: "Readiness fails at SIGTERM and the pod turns not-ready before it is killed: on per-packet dataplanes, established connections still arriving are blackholed.",
    },
    Rule {
        id: TERMINATION_GRACE_VS_LB_DRAIN,
        severity: Severity::Error,
        summary: "terminationGracePeriodSeconds leaves too little time after preStop for the load balancer's connection draining.",
    },
    Rule {
        id: READY_BEFORE_LB_REGISTRATION,
        severity: Severity::Error,
        summary: "New pods become Ready before the load balancer can send their node traffic.",
    },
    Rule {
        id: ETP_LOCAL_NO_SURGE,
        severity: Severity::Warning,
        summary: "externalTrafficPolicy Local without surge: a rollout takes nodes out of the load balancer's pool one by one.",
    },
    Rule {
        id: ROLLOUT_MAX_UNAVAILABLE,
        severity: Severity::Error,
        summary: "The rollout strategy allows every pod to be unavailable at once.",
    },
    Rule {
        id: PDB_MISSING,
        severity: Severity::Warning,
        summary: "No PodDisruptionBudget protects the load-balanced pods from evictions.",
    },
    Rule {
        id: PDB_ALLOWS_ALL_DOWN,
        severity: Severity::Warning,
        summary: "The PodDisruptionBudget allows every pod to be evicted at once.",
    },
];

/// What the rules are checked against.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Options {
    /// The preset (or custom) profile; each Service may refine it with annotations.
    pub lb: LbProfile,
    /// The numbers given as flags: they win over Service annotations.
    pub lb_flags: LbOverrides,
    /// Seconds from an endpoint change until every node's proxy has reprogrammed its rules
    /// (and, with Local, until the node's health check answers for it).
    pub proxy_programming_seconds: f64,
    /// Nodes that can run the workload; `None` when unknown.
    pub nodes: Option<usize>,
}

/// One rule violation.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Finding {
    pub rule: &'static str,
    pub severity: Severity,
    pub location: Location,
    /// `Kind namespace/name` of the object (escaped for display).
    pub object: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workload: Option<WorkloadRef>,
    /// `namespace/name` of the LoadBalancer Service the finding is about.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub external_traffic_policy: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
    /// The numbers that break the rule, by name (seconds unless the name says otherwise).
    pub numbers: BTreeMap<&'static str, f64>,
    pub message: String,
    pub fix: String,
    /// 1-based line the object's document starts on, when known (set by the caller from
    /// `Inventory::line_of`; the rules do not know lines).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub line: Option<usize>,
}

/// Annotation that declares whether the pod's readiness probe starts failing at SIGTERM
/// (`"true"`/`"false"`); overrides the known-image list.
pub const ANNOTATION_READINESS_FAILS_ON_SIGTERM: &str = "lint.kproxy.io/readiness-fails-on-sigterm";
/// Annotation that declares the preStop hook's duration in seconds when lint cannot read
/// it from the hook (an `exec` of some program other than `sleep`).
pub const ANNOTATION_PRESTOP_SECONDS: &str = "lint.kproxy.io/prestop-seconds";

/// Images whose readiness probe fails as soon as the process gets SIGTERM (ingress-nginx
/// issue #13689, cited by seed 2, summed up in docs/lint-rules.md).
const READINESS_FAILS_ON_SIGTERM_IMAGES: &[&str] =
    &["ingress-nginx/controller", "nginx-ingress-controller"];

/// Why a rollout without surge matters even when the preStop delay is right.
const NO_SURGE_RISK: &str = "no request is lost only if the preStop delay outlasts the load balancer's detection window every time, and the pool is one node short for each step of the rollout";

/// Kubernetes' default `terminationGracePeriodSeconds`.
const DEFAULT_TERMINATION_GRACE: f64 = 30.0;

/// Whether the Service's `spec.type` is LoadBalancer, read as kproxy reads it.
fn is_load_balancer(s: &corev1::Service) -> bool {
    let t = s.spec.as_ref().and_then(|s| s.type_.as_deref());
    ServiceType::parse(t) == Ok(ServiceType::LoadBalancer)
}

/// Checks every workload behind a LoadBalancer Service, plus the unreadable objects.
/// Findings come out grouped by workload, in input order.
pub fn lint(inv: &Inventory, opts: &Options) -> Vec<Finding> {
    let mut out: Vec<Finding> = inv
        .errors
        .iter()
        .map(|e| Finding {
            rule: MANIFEST_INVALID,
            severity: Severity::Error,
            location: e.location.clone(),
            object: e.what.clone(),
            workload: None,
            service: None,
            external_traffic_policy: None,
            container: None,
            numbers: BTreeMap::new(),
            message: format!("{}: {}", e.field, e.reason),
            fix: "Fix the field so that the object matches its Kubernetes schema; until then it is not checked.".into(),
            line: None,
        })
        .collect();
    for s in &inv.services {
        if !is_load_balancer(&s.object) {
            continue;
        }
        for bad in service_lb(s, opts).1 {
            let name = s.object.metadata.name.as_deref().unwrap_or("");
            out.push(Finding {
                rule: MANIFEST_INVALID,
                severity: Severity::Error,
                location: s.location.clone(),
                object: format!(
                    "Service {}/{}",
                    namespace_of(&s.object.metadata).escape_debug(),
                    name.escape_debug()
                ),
                workload: None,
                service: None,
                external_traffic_policy: None,
                container: None,
                numbers: BTreeMap::new(),
                message: format!(".metadata.annotations[{:?}]: {}", bad.annotation, bad.reason),
                fix: format!(
                    "Fix the annotation (the {} load balancer controller reads it), or pass the number with an --lb-* flag.",
                    opts.lb.name
                ),
                line: None,
            });
        }
    }
    let index = Index::new(inv);
    for w in &inv.workloads {
        let services = index.services_for(w);
        if services.is_empty() {
            continue;
        }
        let mut c = Checker {
            w,
            opts,
            lb: opts.lb.clone(),
            out: &mut out,
        };
        for s in &services {
            c.service(s);
        }
        c.disruption_budget(index.pdbs_in(&w.id.namespace));
    }
    out
}

/// LoadBalancer Services and PodDisruptionBudgets by namespace, so that matching costs
/// the objects of one namespace per workload, not all of them.
struct Index<'a> {
    services: BTreeMap<&'a str, Vec<&'a At<corev1::Service>>>,
    pdbs: BTreeMap<&'a str, Vec<&'a At<policyv1::PodDisruptionBudget>>>,
}

impl<'a> Index<'a> {
    fn new(inv: &'a Inventory) -> Self {
        let mut services: BTreeMap<&str, Vec<_>> = BTreeMap::new();
        for s in &inv.services {
            if is_load_balancer(&s.object) {
                services
                    .entry(namespace_str(&s.object.metadata))
                    .or_default()
                    .push(s);
            }
        }
        let mut pdbs: BTreeMap<&str, Vec<_>> = BTreeMap::new();
        for p in &inv.pdbs {
            pdbs.entry(namespace_str(&p.object.metadata))
                .or_default()
                .push(p);
        }
        Index { services, pdbs }
    }

    fn services_for(&self, w: &Workload) -> Vec<&'a At<corev1::Service>> {
        self.services
            .get(w.id.namespace.as_str())
            .map(|v| v.iter().copied().filter(|s| selects(s, w)).collect())
            .unwrap_or_default()
    }

    fn pdbs_in(&self, namespace: &str) -> &[&'a At<policyv1::PodDisruptionBudget>] {
        self.pdbs.get(namespace).map_or(&[], Vec::as_slice)
    }
}

/// How many workloads sit behind some LoadBalancer Service (the ones `lint` checks).
pub fn workloads_behind_load_balancers(inv: &Inventory) -> usize {
    let index = Index::new(inv);
    inv.workloads
        .iter()
        .filter(|w| !index.services_for(w).is_empty())
        .count()
}

/// When no workload sits behind a LoadBalancer Service, what lint reads and what the
/// input held instead: a report of "0 workload(s) checked" alone reads as a pass.
pub fn nothing_checked_hint(inv: &Inventory) -> Option<String> {
    if workloads_behind_load_balancers(inv) > 0 {
        return None;
    }
    let lbs = inv
        .services
        .iter()
        .filter(|s| is_load_balancer(&s.object))
        .count();
    let held = format!(
        "the input held {} workload(s), {} Service(s) ({lbs} of type LoadBalancer) and {} PodDisruptionBudget(s)",
        inv.workloads.len(),
        inv.services.len(),
        inv.pdbs.len()
    );
    let why = match (inv.workloads.len(), lbs) {
        (0, _) => "no workload at all",
        (_, 0) => "no LoadBalancer Service",
        _ => "no LoadBalancer Service selects a workload's pods in its namespace",
    };
    Some(format!(
        "hint: nothing was checked ({why}): kproxy lint reads the Deployments, StatefulSets and DaemonSets (apps/v1) that a LoadBalancer Service (v1) selects, with their PodDisruptionBudgets (policy/v1); {held}. Give it the manifests you apply for those workloads (as in examples/lint); Services and EndpointSlices alone, as `kproxy plan` reads, hold no workload"
    ))
}

/// The load balancer in front of one Service, and its unusable annotations.
fn service_lb(
    s: &At<corev1::Service>,
    opts: &Options,
) -> (LbProfile, Vec<crate::lb::BadAnnotation>) {
    let annotations = s.object.metadata.annotations.clone().unwrap_or_default();
    opts.lb.for_service(&annotations, &opts.lb_flags)
}

/// Whether a LoadBalancer Service selects this workload's pods.
fn selects(s: &At<corev1::Service>, w: &Workload) -> bool {
    let Some(spec) = &s.object.spec else {
        return false;
    };
    if !is_load_balancer(&s.object) || namespace_str(&s.object.metadata) != w.id.namespace {
        return false;
    }
    // A Service without a selector has hand-managed endpoints: no workload is behind it.
    let Some(selector) = spec.selector.as_ref().filter(|s| !s.is_empty()) else {
        return false;
    };
    let labels = w.labels();
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

struct Checker<'a> {
    w: &'a Workload,
    opts: &'a Options,
    /// The load balancer of the Service being checked (preset, annotations, flags).
    lb: LbProfile,
    out: &'a mut Vec<Finding>,
}

/// What a finding is about, beyond the workload.
#[derive(Default)]
struct About<'s> {
    service: Option<String>,
    policy: Option<TrafficPolicy>,
    container: Option<&'s str>,
}

/// The preStop delay of a container, in seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
enum PreStop {
    Seconds(f64),
    Unknown,
}

impl Checker<'_> {
    fn push(
        &mut self,
        rule: &'static str,
        severity: Severity,
        about: &About,
        numbers: &[(&'static str, f64)],
        message: String,
        fix: String,
    ) {
        self.out.push(Finding {
            rule,
            severity,
            location: self.w.id.location.clone(),
            object: self.w.id.to_string(),
            workload: Some(self.w.id.clone()),
            service: about.service.clone(),
            external_traffic_policy: about.policy.map(TrafficPolicy::as_str),
            container: about.container.map(str::to_string),
            numbers: numbers.iter().copied().collect(),
            message,
            fix,
            line: None,
        });
    }

    fn pod_spec(&self) -> Option<&corev1::PodSpec> {
        self.w.template.spec.as_ref()
    }

    fn termination_grace(&self) -> f64 {
        self.pod_spec()
            .and_then(|s| s.termination_grace_period_seconds)
            .map_or(DEFAULT_TERMINATION_GRACE, |t| t as f64)
    }

    fn service(&mut self, s: &At<corev1::Service>) {
        self.lb = service_lb(s, self.opts).0;
        let spec = s.object.spec.as_ref();
        // An unknown policy counts as Cluster, as kproxy's planner counts it.
        let policy = TrafficPolicy::parse(spec.and_then(|s| s.external_traffic_policy.as_deref()))
            .unwrap_or_default();
        let service = format!(
            "{}/{}",
            namespace_of(&s.object.metadata).escape_debug(),
            s.object
                .metadata
                .name
                .as_deref()
                .unwrap_or("")
                .escape_debug()
        );
        let w = self.w; // a copy of the reference: the containers borrow the workload, not the checker
        let containers = serving_containers(w.template.spec.as_ref(), spec);
        for c in &containers {
            let about = About {
                service: Some(service.clone()),
                policy: Some(policy),
                container: Some(&c.name),
            };
            self.container(c, policy, &about);
        }
        let about = About {
            service: Some(service),
            policy: Some(policy),
            container: None,
        };
        if policy == TrafficPolicy::Local {
            self.ready_before_registration(&about);
            self.no_surge(&about);
        }
        self.max_unavailable(&about);
    }

    /// Container-level rules: readiness probe, preStop, SIGTERM readiness, grace period.
    fn container(&mut self, c: &corev1::Container, policy: TrafficPolicy, about: &About) {
        self.readiness_probe_present(c, about);
        let Some(pre_stop) = self.pre_stop_seconds(c, about) else {
            return;
        };
        let grace = self.termination_grace();
        self.pre_stop_covers_detection(c, policy, about, pre_stop);
        if policy == TrafficPolicy::Local {
            self.readiness_holds_until_kill(c, about, pre_stop, grace);
        }
        self.grace_covers_drain(c, policy, about, pre_stop, grace);
    }

    /// A container without a readinessProbe is Ready before it listens: the cause of the
    /// refused new connections of a rolling update on real nodes (issue 49), which the
    /// message names so an operator reading a refused connection finds it.
    fn readiness_probe_present(&mut self, c: &corev1::Container, about: &About) {
        if c.readiness_probe.is_none() {
            self.push(
                READINESS_PROBE_MISSING,
                Severity::Error,
                about,
                &[],
                format!(
                    "container {} has no readinessProbe: the pod is Ready, and receives load-balanced traffic, as soon as the container starts, before the application listens; every proxy programs a new endpoint within milliseconds to a second of the EndpointSlice change, so during a rollout new connections race the server's bind and are refused (measured: servers listening 68-463 ms after Ready on loaded nodes)",
                    c.name.escape_debug()
                ),
                "Add a readinessProbe that passes only when the application serves (e.g. an HTTP GET on its health path). kproxy run's --endpoint-warmup (default 1s) hides the race while other endpoints serve; a probe closes it, including a scale from zero.".into(),
            );
        }
    }

    /// The preStop duration, or `None` (with a note) when lint cannot read it: the rules
    /// that depend on it are then skipped.
    fn pre_stop_seconds(&mut self, c: &corev1::Container, about: &About) -> Option<f64> {
        match self.pre_stop(c) {
            PreStop::Seconds(s) => Some(s),
            PreStop::Unknown => {
                self.push(
                    PRESTOP_DURATION_UNKNOWN,
                    Severity::Note,
                    about,
                    &[],
                    format!(
                        "container {}'s preStop hook is not a sleep lint can read; the preStop, SIGTERM-readiness and grace-period rules were skipped",
                        c.name.escape_debug()
                    ),
                    format!("Use `lifecycle.preStop.sleep.seconds`, or declare the hook's duration with the pod annotation {ANNOTATION_PRESTOP_SECONDS}: \"<seconds>\"."),
                );
                None
            }
        }
    }

    /// preStop must outlast the time until nobody sends the pod new connections.
    fn pre_stop_covers_detection(
        &mut self,
        c: &corev1::Container,
        policy: TrafficPolicy,
        about: &About,
        pre_stop: f64,
    ) {
        let programming = self.opts.proxy_programming_seconds;
        let lb = self.lb.clone();
        let (required, severity, why) = match policy {
            TrafficPolicy::Local => (
                lb.detection_window() + programming,
                Severity::Error,
                format!(
                    "with externalTrafficPolicy Local the load balancer keeps sending new connections to the node until its health check has failed ({} × {} + {} = {} s on {}), and the node's health check only fails once the proxy has seen the pod terminating ({} s)",
                    num(lb.interval_seconds),
                    lb.unhealthy_threshold,
                    num(lb.timeout_seconds),
                    num(lb.detection_window()),
                    lb.name,
                    num(programming)
                ),
            ),
            TrafficPolicy::Cluster => (
                programming,
                Severity::Warning,
                format!(
                    "with externalTrafficPolicy Cluster every node's proxy keeps sending new connections to the pod until it has removed the endpoint ({} s)",
                    num(programming)
                ),
            ),
        };
        if pre_stop < required {
            let mut numbers = vec![
                ("preStopSeconds", pre_stop),
                ("requiredSeconds", required),
                ("proxyProgrammingSeconds", programming),
            ];
            if policy == TrafficPolicy::Local {
                numbers.push(("lbDetectionWindowSeconds", lb.detection_window()));
            }
            self.push(
                PRESTOP_SHORTER_THAN_LB_DETECTION,
                severity,
                about,
                &numbers,
                format!(
                    "container {} stops at SIGTERM after a preStop of {} s, but {}: new connections arriving in the last {} s are refused or lost",
                    c.name.escape_debug(),
                    num(pre_stop),
                    why,
                    num(required - pre_stop)
                ),
                format!("Set lifecycle.preStop.sleep.seconds to at least {} (and terminationGracePeriodSeconds above it).", num(required.ceil())),
            );
        }
    }

    /// eTP Local: readiness failing at SIGTERM must not turn the pod not-ready before it is
    /// killed.
    fn readiness_holds_until_kill(
        &mut self,
        c: &corev1::Container,
        about: &About,
        pre_stop: f64,
        grace: f64,
    ) {
        // Seed 2: readiness that fails at SIGTERM must not turn the pod not-ready before it
        // is killed, or the node (Local) keeps receiving packets for a pod no proxy forwards to.
        if let (Some(probe), Some(reason)) =
            (&c.readiness_probe, self.readiness_fails_on_sigterm(c))
        {
            let period = probe.period_seconds.unwrap_or(10).max(1) as f64;
            let failures = probe.failure_threshold.unwrap_or(3).max(1) as f64;
            let not_ready_at = pre_stop + period * (failures - 1.0);
            if not_ready_at < grace {
                self.push(
                    READINESS_FAILS_BEFORE_KILL,
                    // A warning: conntrack-based proxies (kproxy, kube-proxy iptables and
                    // nftables) keep established flows to a not-ready endpoint, and the
                    // rollout lab measures no loss; per-packet dataplanes drop them.
                    Severity::Warning,
                    about,
                    &[
                        ("preStopSeconds", pre_stop),
                        ("readinessPeriodSeconds", period),
                        ("readinessFailureThreshold", failures),
                        ("notReadyAfterSeconds", not_ready_at),
                        ("terminationGracePeriodSeconds", grace),
                    ],
                    format!(
                        "container {}'s readiness fails at SIGTERM ({reason}); the pod can be marked not ready {} s after termination starts (preStop {} + period {} × (failureThreshold {} − 1)), {} s before it is killed at terminationGracePeriodSeconds {}: in that gap the load balancer still forwards established connections to the node, which has no serving endpoint; dataplanes that look every packet up (eBPF ones such as GKE Dataplane V2) drop them, conntrack-based proxies (kproxy, kube-proxy iptables/nftables) keep them",
                        c.name.escape_debug(),
                        num(not_ready_at),
                        num(pre_stop),
                        num(period),
                        num(failures),
                        num(grace - not_ready_at),
                        num(grace)
                    ),
                    format!(
                        "Make preStop + periodSeconds × (failureThreshold − 1) ≥ terminationGracePeriodSeconds: lower terminationGracePeriodSeconds to {}, or raise periodSeconds/failureThreshold.",
                        num(not_ready_at)
                    ),
                );
            }
        }
    }

    /// The grace period must cover preStop and the load balancer's connection draining.
    fn grace_covers_drain(
        &mut self,
        c: &corev1::Container,
        policy: TrafficPolicy,
        about: &About,
        pre_stop: f64,
        grace: f64,
    ) {
        let lb = self.lb.clone();
        let drain = if policy == TrafficPolicy::Local {
            lb.drain_seconds
        } else {
            0.0
        };
        if grace <= pre_stop {
            self.push(
                TERMINATION_GRACE_VS_LB_DRAIN,
                Severity::Error,
                about,
                &[("terminationGracePeriodSeconds", grace), ("preStopSeconds", pre_stop)],
                format!(
                    "terminationGracePeriodSeconds {} is not longer than container {}'s preStop of {} s: the kubelet kills the container (after at most 2 s more) before it can finish its in-flight requests",
                    num(grace),
                    c.name.escape_debug(),
                    num(pre_stop)
                ),
                format!("Set terminationGracePeriodSeconds to at least {}.", num(pre_stop + drain.max(1.0))),
            );
        } else if grace < pre_stop + drain {
            let mut fix = format!(
                "Set terminationGracePeriodSeconds to at least {} so the application can keep serving established connections until the load balancer stops forwarding them",
                num(pre_stop + drain)
            );
            if self.readiness_fails_on_sigterm(c).is_some() {
                fix.push_str(" (its readiness fails at SIGTERM: raise periodSeconds × (failureThreshold − 1) with it)");
            }
            fix.push_str(", or make sure the application closes its connections within the remaining time after SIGTERM.");
            self.push(
                TERMINATION_GRACE_VS_LB_DRAIN,
                Severity::Warning,
                about,
                &[
                    ("terminationGracePeriodSeconds", grace),
                    ("preStopSeconds", pre_stop),
                    ("lbDrainSeconds", drain),
                    ("requiredSeconds", pre_stop + drain),
                ],
                format!(
                    "the load balancer ({}) keeps forwarding established connections to the node for {} s after taking it out, but container {} is killed {} s after SIGTERM (terminationGracePeriodSeconds {} − preStop {}): connections still open then are cut unless the application closed them itself",
                    lb.name,
                    num(drain),
                    c.name.escape_debug(),
                    num(grace - pre_stop),
                    num(grace),
                    num(pre_stop)
                ),
                fix,
            );
        }
    }

    /// Seed 2: a new pod must not become Ready (letting the rollout remove an old one)
    /// before the load balancer sends its node traffic.
    fn ready_before_registration(&mut self, about: &About) {
        let Some(spec) = self.pod_spec() else { return };
        if spec.readiness_gates.as_ref().is_some_and(|g| !g.is_empty()) {
            return; // the gate is what waits for the load balancer
        }
        let ready_at = spec
            .containers
            .iter()
            .filter_map(|c| c.readiness_probe.as_ref())
            .map(|p| {
                let initial = p.initial_delay_seconds.unwrap_or(0).max(0) as f64;
                let period = p.period_seconds.unwrap_or(10).max(1) as f64;
                initial + period * (p.success_threshold.unwrap_or(1).max(1) as f64 - 1.0)
            })
            .fold(0.0, f64::max);
        let registration = self.lb.registration_seconds;
        if ready_at >= registration {
            return;
        }
        let min_ready = f64::from(self.w.min_ready_seconds.max(0));
        let numbers = [
            ("readyAfterSeconds", ready_at),
            ("minReadySeconds", min_ready),
            ("lbRegistrationSeconds", registration),
        ];
        let fix = format!(
            "Delay readiness until the node can receive traffic: readinessProbe.initialDelaySeconds ≥ {} (GKE's zero-downtime rolling-update guide uses 20), or a readiness gate that waits for the load balancer.",
            num(registration.ceil())
        );
        if ready_at + min_ready >= registration {
            self.push(
                READY_BEFORE_LB_REGISTRATION,
                Severity::Warning,
                about,
                &numbers,
                format!(
                    "new pods are Ready {} s after starting, before the load balancer ({}) sends their node traffic ({} s); minReadySeconds {} covers rolling updates but not pods recreated after evictions (node drains, autoscaling)",
                    num(ready_at),
                    self.lb.name,
                    num(registration),
                    num(min_ready)
                ),
                fix,
            );
        } else {
            self.push(
                READY_BEFORE_LB_REGISTRATION,
                Severity::Error,
                about,
                &numbers,
                format!(
                    "new pods are Ready {} s after starting, but the load balancer ({}) sends a newly serving node traffic only after about {} s: the rollout removes old pods while the new ones receive nothing, reducing capacity, or leaving the load balancer no healthy node at all",
                    num(ready_at),
                    self.lb.name,
                    num(registration)
                ),
                fix,
            );
        }
    }

    /// With Local, a rollout without surge takes a node's only pod away before its
    /// replacement is Ready.
    fn no_surge(&mut self, about: &About) {
        let Strategy::RollingUpdate { max_surge, .. } = &self.w.strategy else {
            return;
        };
        match self.w.id.kind {
            WorkloadKind::DaemonSet => {
                // DaemonSet maxSurge scales with the node count; only "zero" matters here.
                let surge = max_surge.as_ref().map_or(0, |s| match s {
                    IntOrString::Int(i) => *i,
                    IntOrString::String(s) => percent(s).map_or(1, |p| p.min(1)),
                });
                if surge <= 0 {
                    self.push(
                        ETP_LOCAL_NO_SURGE,
                        Severity::Warning,
                        about,
                        &[("maxSurge", surge as f64)],
                        format!("a DaemonSet rolling update with maxSurge 0 deletes each node's pod before starting its replacement: with externalTrafficPolicy Local every node in turn leaves the load balancer's pool; {NO_SURGE_RISK}"),
                        "Set updateStrategy.rollingUpdate.maxSurge to 1 (or a percentage) and maxUnavailable to 0.".into(),
                    );
                }
            }
            WorkloadKind::Deployment | WorkloadKind::StatefulSet => {
                let replicas = self.w.replicas.unwrap_or(1);
                let surge = match (self.w.id.kind, max_surge) {
                    (WorkloadKind::StatefulSet, _) => 0, // StatefulSets never surge
                    (_, None) => {
                        scaled(&IntOrString::String("25%".into()), replicas, true).unwrap_or(1)
                    }
                    (_, Some(s)) => match scaled(s, replicas, true) {
                        Some(s) => s,
                        None => return self.bad_int_or_string("maxSurge", s, about),
                    },
                };
                if surge > 0 {
                    return;
                }
                let what = if self.w.id.kind == WorkloadKind::StatefulSet {
                    "a StatefulSet rolling update deletes each pod before creating its replacement"
                } else {
                    "a rolling update with maxSurge 0 deletes old pods before their replacements are Ready"
                };
                let fix = if self.w.id.kind == WorkloadKind::StatefulSet {
                    "Run more replicas than nodes, or put the pods in a Deployment/DaemonSet that can surge."
                } else {
                    "Set strategy.rollingUpdate.maxSurge ≥ 1 (and maxUnavailable 0)."
                };
                match self.opts.nodes {
                    Some(nodes) if replicas as usize > nodes => {}
                    Some(nodes) => self.push(
                        ETP_LOCAL_NO_SURGE,
                        Severity::Warning,
                        about,
                        &[("replicas", replicas as f64), ("nodes", nodes as f64), ("maxSurge", 0.0)],
                        format!(
                            "{what}; with {replicas} replicas on {nodes} nodes a node can hold a single pod, so with externalTrafficPolicy Local it leaves the load balancer's pool; {NO_SURGE_RISK}"
                        ),
                        fix.into(),
                    ),
                    None => self.push(
                        ETP_LOCAL_NO_SURGE,
                        Severity::Warning,
                        about,
                        &[("replicas", replicas as f64), ("maxSurge", 0.0)],
                        format!(
                            "{what}; if a node holds a single pod (replicas ≤ nodes; pass --nodes to know), with externalTrafficPolicy Local it leaves the load balancer's pool; {NO_SURGE_RISK}"
                        ),
                        fix.into(),
                    ),
                }
            }
        }
    }

    /// A strategy that may take every pod down at once.
    fn max_unavailable(&mut self, about: &About) {
        let Some(replicas) = self.w.replicas else {
            return;
        };
        let fix = "Use a RollingUpdate with maxUnavailable below replicas (ideally 0, with maxSurge ≥ 1), and run at least 2 replicas.";
        let unavailable = match &self.w.strategy {
            Strategy::OnDelete => return,
            Strategy::Recreate => {
                return self.push(
                    ROLLOUT_MAX_UNAVAILABLE,
                    Severity::Error,
                    about,
                    &[("replicas", replicas as f64)],
                    "strategy Recreate deletes every pod before starting new ones: the Service has no endpoints during each rollout".into(),
                    fix.into(),
                );
            }
            Strategy::RollingUpdate {
                max_surge,
                max_unavailable,
            } => {
                let default = if self.w.id.kind == WorkloadKind::StatefulSet {
                    IntOrString::Int(1)
                } else {
                    IntOrString::String("25%".into())
                };
                let u = max_unavailable.as_ref().unwrap_or(&default);
                let Some(mut unavailable) = scaled(u, replicas, false) else {
                    return self.bad_int_or_string("maxUnavailable", u, about);
                };
                // The Deployment controller never lets both be zero (ResolveFenceposts).
                if self.w.id.kind == WorkloadKind::Deployment && unavailable == 0 {
                    let s = max_surge
                        .clone()
                        .unwrap_or(IntOrString::String("25%".into()));
                    if scaled(&s, replicas, true) == Some(0) {
                        unavailable = 1;
                    }
                }
                if self.w.id.kind == WorkloadKind::StatefulSet {
                    unavailable = unavailable.max(1);
                }
                unavailable
            }
        };
        if unavailable >= replicas {
            self.push(
                ROLLOUT_MAX_UNAVAILABLE,
                Severity::Error,
                about,
                &[("replicas", replicas as f64), ("maxUnavailable", unavailable as f64)],
                format!("the rollout may take {unavailable} of {replicas} pods down at once: the Service can be left with no ready endpoint"),
                fix.into(),
            );
        }
    }

    fn bad_int_or_string(&mut self, field: &str, v: &IntOrString, about: &About) {
        let IntOrString::String(s) = v else { return };
        self.push(
            MANIFEST_INVALID,
            Severity::Error,
            about,
            &[],
            format!("{field} {:?} is neither an integer nor a percentage", s),
            format!("Write {field} as an integer or as \"N%\"."),
        );
    }

    /// Workload-level: some PodDisruptionBudget must protect the pods from evictions.
    fn disruption_budget(&mut self, pdbs: &[&At<policyv1::PodDisruptionBudget>]) {
        let labels = self.w.labels();
        let about = About::default();
        let matching: Vec<&At<policyv1::PodDisruptionBudget>> = pdbs
            .iter()
            .copied()
            .filter(|p| {
                p.object
                    .spec
                    .as_ref()
                    .and_then(|s| s.selector.as_ref())
                    .is_some_and(|s| selector_matches(s, labels))
            })
            .collect();
        if matching.is_empty() {
            self.push(
                PDB_MISSING,
                Severity::Warning,
                &about,
                &[],
                "no PodDisruptionBudget selects these pods: a node drain or autoscaler may evict all of them at once, with no rollout settings to protect the traffic".into(),
                "Add a PodDisruptionBudget with maxUnavailable: 1 (or minAvailable ≥ 1) selecting the pods.".into(),
            );
            return;
        }
        for p in matching {
            let Some(spec) = &p.object.spec else { continue };
            let all_down = match (&spec.min_available, &spec.max_unavailable) {
                (Some(min), _) => scaled(min, self.w.replicas.unwrap_or(100), true) == Some(0),
                (None, Some(max)) => match (max, self.w.replicas) {
                    (IntOrString::String(s), _) => percent(s).is_some_and(|p| p >= 100),
                    (IntOrString::Int(i), Some(r)) => *i >= r,
                    (IntOrString::Int(_), None) => false,
                },
                // Neither set: the API server defaults minAvailable to 1.
                (None, None) => false,
            };
            if all_down {
                let name = p
                    .object
                    .metadata
                    .name
                    .as_deref()
                    .unwrap_or("")
                    .escape_debug()
                    .to_string();
                self.push(
                    PDB_ALLOWS_ALL_DOWN,
                    Severity::Warning,
                    &about,
                    &self
                        .w
                        .replicas
                        .map(|r| vec![("replicas", f64::from(r))])
                        .unwrap_or_default(),
                    format!("PodDisruptionBudget {name} allows every pod to be evicted at once"),
                    "Set maxUnavailable: 1 (or minAvailable ≥ 1).".into(),
                );
            }
        }
    }

    fn readiness_fails_on_sigterm(&self, c: &corev1::Container) -> Option<String> {
        match self
            .w
            .annotations
            .get(ANNOTATION_READINESS_FAILS_ON_SIGTERM)
            .map(|s| s.trim())
        {
            Some("true") => {
                return Some(format!(
                    "annotation {ANNOTATION_READINESS_FAILS_ON_SIGTERM}"
                ));
            }
            Some("false") => return None,
            _ => {}
        }
        let image = c.image.as_deref().unwrap_or("");
        READINESS_FAILS_ON_SIGTERM_IMAGES
            .iter()
            .find(|known| image.contains(*known))
            .map(|known| format!("image {known}, ingress-nginx issue #13689"))
    }

    fn pre_stop(&self, c: &corev1::Container) -> PreStop {
        let Some(handler) = c.lifecycle.as_ref().and_then(|l| l.pre_stop.as_ref()) else {
            return PreStop::Seconds(0.0);
        };
        if let Some(sleep) = &handler.sleep {
            return PreStop::Seconds(sleep.seconds.max(0) as f64);
        }
        if let Some(s) = self
            .w
            .annotations
            .get(ANNOTATION_PRESTOP_SECONDS)
            .and_then(|s| s.trim().parse::<f64>().ok())
            && s.is_finite()
            && s >= 0.0
        {
            return PreStop::Seconds(s);
        }
        match handler.exec.as_ref().and_then(|e| e.command.as_deref()) {
            Some(argv) => exec_sleep_seconds(argv).map_or(PreStop::Unknown, PreStop::Seconds),
            // An httpGet/tcpSocket hook takes as long as the application makes it take.
            None => PreStop::Unknown,
        }
    }
}

/// The containers that serve the Service's ports (targetPort by number or name); all
/// containers when none match (the port may be unnamed in the pod).
fn serving_containers<'a>(
    pod: Option<&'a corev1::PodSpec>,
    svc: Option<&corev1::ServiceSpec>,
) -> Vec<&'a corev1::Container> {
    let Some(pod) = pod else { return Vec::new() };
    let targets: Vec<IntOrString> = svc
        .and_then(|s| s.ports.as_ref())
        .map(|ports| {
            ports
                .iter()
                .map(|p| p.target_port.clone().unwrap_or(IntOrString::Int(p.port)))
                .collect()
        })
        .unwrap_or_default();
    let serves = |c: &corev1::Container| {
        c.ports.as_ref().is_some_and(|ports| {
            ports.iter().any(|p| {
                targets.iter().any(|t| match t {
                    IntOrString::Int(n) => *n == p.container_port,
                    IntOrString::String(name) => p.name.as_deref() == Some(name.as_str()),
                })
            })
        })
    };
    let matched: Vec<&corev1::Container> = pod.containers.iter().filter(|c| serves(c)).collect();
    if matched.is_empty() {
        pod.containers.iter().collect()
    } else {
        matched
    }
}

/// `sleep N`, `/bin/sleep N`, or `sh -c "sleep N"` as an exec preStop hook.
fn exec_sleep_seconds(argv: &[String]) -> Option<f64> {
    let is = |s: &str, name: &str| s == name || s.ends_with(&format!("/{name}"));
    let seconds = |s: &str| {
        let s = s.trim();
        let s = s.strip_suffix('s').unwrap_or(s);
        s.parse::<f64>().ok().filter(|v| v.is_finite() && *v >= 0.0)
    };
    match argv {
        [cmd, n] if is(cmd, "sleep") => seconds(n),
        [shell, flag, script] if (is(shell, "sh") || is(shell, "bash")) && flag == "-c" => {
            match script.split_whitespace().collect::<Vec<_>>().as_slice() {
                [cmd, n] if is(cmd, "sleep") => seconds(n),
                _ => None,
            }
        }
        _ => None,
    }
}

/// `"25%"` → 25.
fn percent(s: &str) -> Option<i32> {
    s.strip_suffix('%')?.parse::<i32>().ok().filter(|p| *p >= 0)
}

/// An IntOrString scaled against `total` as Kubernetes does (percentages round up for
/// maxSurge and minAvailable, down for maxUnavailable); `None` when it is neither.
fn scaled(v: &IntOrString, total: i32, round_up: bool) -> Option<i32> {
    match v {
        IntOrString::Int(i) => Some(*i),
        IntOrString::String(s) => {
            let p = i64::from(percent(s)?);
            let t = i64::from(total.max(0));
            let v = if round_up {
                (p * t + 99) / 100
            } else {
                p * t / 100
            };
            Some(v.min(i64::from(i32::MAX)) as i32)
        }
    }
}

/// Kubernetes label-selector semantics (matchLabels AND matchExpressions).
fn selector_matches(s: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    let labels_ok = s
        .match_labels
        .as_ref()
        .is_none_or(|m| m.iter().all(|(k, v)| labels.get(k) == Some(v)));
    let exprs_ok = s.match_expressions.as_ref().is_none_or(|es| {
        es.iter().all(|e| {
            let values = e.values.as_deref().unwrap_or(&[]);
            let value = labels.get(&e.key);
            match e.operator.as_str() {
                "In" => value.is_some_and(|v| values.contains(v)),
                "NotIn" => value.is_none_or(|v| !values.contains(v)),
                "Exists" => value.is_some(),
                "DoesNotExist" => value.is_none(),
                _ => false,
            }
        })
    });
    labels_ok && exprs_ok
}

/// A number for messages: integers without a fraction.
pub fn num(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        format!("{v}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exec_sleep_forms() {
        let v =
            |a: &[&str]| exec_sleep_seconds(&a.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        for (argv, want) in [
            (&["sleep", "10"][..], Some(10.0)),
            (&["/bin/sleep", "5s"][..], Some(5.0)),
            (&["/bin/sh", "-c", "sleep 15"][..], Some(15.0)),
            (&["sh", "-c", "sleep 1; kill 1"][..], None),
            (&["/wait-shutdown"][..], None),
            (&["sleep", "-1"][..], None),
            (&["sleep", "inf"][..], None),
        ] {
            assert_eq!(v(argv), want, "{argv:?}");
        }
    }

    #[test]
    fn int_or_string_scaling() {
        let s = |x: &str| IntOrString::String(x.into());
        for (v, total, up, want) in [
            (s("25%"), 1, true, Some(1)),
            (s("25%"), 1, false, Some(0)),
            (s("25%"), 4, false, Some(1)),
            (s("50%"), 3, true, Some(2)),
            (s("0%"), 3, true, Some(0)),
            (IntOrString::Int(2), 3, false, Some(2)),
            (s("two"), 3, false, None),
        ] {
            assert_eq!(scaled(&v, total, up), want, "{v:?} of {total}");
        }
    }

    #[test]
    fn label_selectors() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;
        let labels: BTreeMap<String, String> = [("app".to_string(), "web".to_string())].into();
        let req = |op: &str, vals: &[&str]| LabelSelector {
            match_expressions: Some(vec![LabelSelectorRequirement {
                key: "app".into(),
                operator: op.into(),
                values: Some(vals.iter().map(|s| s.to_string()).collect()),
            }]),
            match_labels: None,
        };
        assert!(
            selector_matches(&LabelSelector::default(), &labels),
            "empty selector selects all"
        );
        assert!(selector_matches(&req("In", &["web", "x"]), &labels));
        assert!(!selector_matches(&req("NotIn", &["web"]), &labels));
        assert!(selector_matches(&req("Exists", &[]), &labels));
        assert!(!selector_matches(&req("DoesNotExist", &[]), &labels));
        assert!(!selector_matches(&req("Bogus", &[]), &labels));
    }
}
