//! The endpoint warm-up hold (`kproxy_core::warmup`), one table row per rule: a Service's
//! endpoints change step by step (real YAML through manifest → ingest → the incremental
//! planner, `Planner::apply_at` at each step's time), and each step says which endpoints
//! are held and what the Cluster and Local lists hold.

mod common;

use std::time::Duration;

use kproxy_core::plan::{NodePlan, ServicePortPlan};
use kproxy_core::planner::Planner;
use kproxy_core::state::Changes;
use kproxy_core::warmup::{Event, Hold, Moment, ReleaseReason};
use kproxy_core::{ClusterState, PlanConfig};

const NODE: &str = "apiVersion: v1\nkind: Node\nmetadata: {name: node-a}\nstatus: {addresses: [{type: InternalIP, address: 10.200.0.11}]}\n";

/// `kubectl`'s words for one endpoint's conditions.
#[derive(Clone, Copy)]
enum Cond {
    Ready,
    NotReady,
    /// Terminating, still serving (the serving-terminating fallback).
    TermServing,
    /// Terminating, no longer serving.
    TermGone,
}

/// (IP, on this node, conditions)
type Ep = (&'static str, bool, Cond);

struct Step {
    at: u64,
    /// The Service's endpoints now; `None`: unchanged (only the clock moves).
    eps: Option<&'static [Ep]>,
    held: &'static [&'static str],
    /// The Cluster list (IPs); `None`: the port has no Cluster-policy traffic.
    cluster: Option<&'static [&'static str]>,
    local: Option<&'static [&'static str]>,
}

struct Case {
    name: &'static str,
    /// Extra Service spec (type and policies).
    spec: &'static str,
    warmup_ms: u64,
    steps: &'static [Step],
}

fn slice(eps: &[Ep]) -> String {
    let mut s = "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-x, namespace: ns, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{name: p, port: 8080, protocol: TCP}]\nendpoints:\n".to_string();
    if eps.is_empty() {
        s = s.replace("endpoints:\n", "endpoints: []\n");
    }
    for (ip, local, cond) in eps {
        let (ready, serving, terminating) = match cond {
            Cond::Ready => (true, true, false),
            Cond::NotReady => (false, false, false),
            Cond::TermServing => (false, true, true),
            Cond::TermGone => (false, false, true),
        };
        let node = if *local { "node-a" } else { "node-b" };
        s += &format!(
            "- {{addresses: [{ip}], nodeName: {node}, conditions: {{ready: {ready}, serving: {serving}, terminating: {terminating}}}}}\n"
        );
    }
    s
}

fn apply(st: &mut ClusterState, text: &str) {
    common::apply_yaml(st, text);
}

fn service(spec: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: ns}}\nspec:\n  clusterIP: 10.96.0.10\n  ports: [{{name: p, port: 80, protocol: TCP{}}}]\n{spec}",
        if spec.contains("LoadBalancer") {
            ", nodePort: 30080"
        } else {
            ""
        }
    )
}

fn port(p: &NodePlan) -> &ServicePortPlan {
    p.service_ports().next().expect("the Service's port")
}

fn ips(l: &Option<Vec<kproxy_core::model::EndpointAddr>>) -> Option<Vec<String>> {
    l.as_ref()
        .map(|l| l.iter().map(|a| a.ip.to_string()).collect())
}

fn want(l: Option<&[&str]>) -> Option<Vec<String>> {
    l.map(|l| l.iter().map(|s| s.to_string()).collect())
}

fn held(p: &ServicePortPlan) -> Vec<String> {
    p.endpoints
        .iter()
        .filter(|e| e.warmup.is_some())
        .map(|e| e.addr.ip.to_string())
        .collect()
}

/// Runs a case's steps through one planner; returns the planner for further checks.
fn run(case: &Case) -> Planner {
    let cfg = PlanConfig {
        endpoint_warmup: Duration::from_millis(case.warmup_ms),
        ..PlanConfig::default()
    };
    let mut planner = Planner::new("node-a", cfg);
    let mut st = ClusterState::new();
    apply(&mut st, NODE);
    apply(&mut st, &service(case.spec));
    for (i, step) in case.steps.iter().enumerate() {
        if let Some(eps) = step.eps {
            apply(&mut st, &slice(eps));
        }
        let changes = st.take_changes();
        planner.apply_at(&st, changes, Moment(step.at));
        let p = port(planner.plan());
        let at = format!("{}: step {i} (t={})", case.name, step.at);
        assert_eq!(held(p), step.held, "{at}: held");
        assert_eq!(
            ips(&p.cluster_endpoints),
            want(step.cluster),
            "{at}: Cluster"
        );
        assert_eq!(ips(&p.local_endpoints), want(step.local), "{at}: Local");
        for e in p.endpoints.iter().filter_map(|e| e.warmup.as_deref()) {
            assert_eq!(
                e.release,
                e.ready_since.after(Duration::from_millis(case.warmup_ms)),
                "{at}"
            );
        }
    }
    planner
}

const A: &str = "10.244.1.1";
const B: &str = "10.244.1.2";
const C: &str = "10.244.1.3";
const LB_LOCAL: &str = "  type: LoadBalancer\n  externalTrafficPolicy: Local\nstatus: {loadBalancer: {ingress: [{ip: 203.0.113.10}]}}\n";

const CASES: &[Case] = &[
    Case {
        name: "a new endpoint beside a ready one is held until its release, then used",
        spec: "",
        warmup_ms: 1000,
        steps: &[
            Step {
                at: 0,
                eps: Some(&[(A, true, Cond::Ready)]),
                held: &[],
                cluster: Some(&[A]),
                local: None,
            },
            Step {
                at: 500,
                eps: Some(&[(A, true, Cond::Ready), (B, true, Cond::Ready)]),
                held: &[B],
                cluster: Some(&[A]),
                local: None,
            },
            Step {
                at: 1499,
                eps: None,
                held: &[B],
                cluster: Some(&[A]),
                local: None,
            },
            Step {
                at: 1500,
                eps: None,
                held: &[],
                cluster: Some(&[A, B]),
                local: None,
            },
        ],
    },
    Case {
        name: "beside a terminating endpoint that still serves: the fallback is kept while the new one is held",
        spec: "",
        warmup_ms: 1000,
        steps: &[
            Step {
                at: 0,
                eps: Some(&[(A, false, Cond::Ready)]),
                held: &[],
                cluster: Some(&[A]),
                local: None,
            },
            Step {
                at: 100,
                eps: Some(&[(A, false, Cond::TermServing), (B, true, Cond::Ready)]),
                held: &[B],
                cluster: Some(&[A]),
                local: None,
            },
            Step {
                at: 1100,
                eps: None,
                held: &[],
                cluster: Some(&[B]),
                local: None,
            },
        ],
    },
    Case {
        name: "no other usable endpoint (the old one no longer serves): no hold",
        spec: "",
        warmup_ms: 1000,
        steps: &[
            Step {
                at: 0,
                eps: Some(&[(A, false, Cond::Ready)]),
                held: &[],
                cluster: Some(&[A]),
                local: None,
            },
            Step {
                at: 100,
                eps: Some(&[(A, false, Cond::TermGone), (B, true, Cond::Ready)]),
                held: &[],
                cluster: Some(&[B]),
                local: None,
            },
        ],
    },
    Case {
        name: "no other endpoint at all (a scale from zero): no hold, for every new endpoint",
        spec: "",
        warmup_ms: 1000,
        steps: &[
            Step {
                at: 0,
                eps: Some(&[]),
                held: &[],
                cluster: Some(&[]),
                local: None,
            },
            Step {
                at: 100,
                eps: Some(&[(A, true, Cond::Ready), (B, false, Cond::Ready)]),
                held: &[],
                cluster: Some(&[A, B]),
                local: None,
            },
        ],
    },
    Case {
        name: "Local policy, no other local endpoint: no hold (the Local list would be empty)",
        spec: LB_LOCAL,
        warmup_ms: 1000,
        steps: &[
            Step {
                at: 0,
                eps: Some(&[(A, false, Cond::Ready)]),
                held: &[],
                cluster: Some(&[A]),
                local: Some(&[]),
            },
            Step {
                at: 100,
                eps: Some(&[(A, false, Cond::Ready), (B, true, Cond::Ready)]),
                held: &[],
                cluster: Some(&[A, B]),
                local: Some(&[B]),
            },
        ],
    },
    Case {
        name: "Local policy, another local endpoint: held in both lists",
        spec: LB_LOCAL,
        warmup_ms: 1000,
        steps: &[
            Step {
                at: 0,
                eps: Some(&[(A, true, Cond::Ready)]),
                held: &[],
                cluster: Some(&[A]),
                local: Some(&[A]),
            },
            Step {
                at: 100,
                eps: Some(&[(A, true, Cond::Ready), (B, true, Cond::Ready)]),
                held: &[B],
                cluster: Some(&[A]),
                local: Some(&[A]),
            },
            Step {
                at: 1100,
                eps: None,
                held: &[],
                cluster: Some(&[A, B]),
                local: Some(&[A, B]),
            },
        ],
    },
    Case {
        name: "Local policy, the local one terminating and serving: the Local fallback is kept while held",
        spec: LB_LOCAL,
        warmup_ms: 1000,
        steps: &[
            Step {
                at: 0,
                eps: Some(&[(A, true, Cond::Ready), (C, false, Cond::Ready)]),
                held: &[],
                cluster: Some(&[A, C]),
                local: Some(&[A]),
            },
            Step {
                at: 100,
                eps: Some(&[
                    (A, true, Cond::TermServing),
                    (B, true, Cond::Ready),
                    (C, false, Cond::Ready),
                ]),
                held: &[B],
                cluster: Some(&[C]),
                local: Some(&[A]),
            },
            Step {
                at: 1100,
                eps: None,
                held: &[],
                cluster: Some(&[B, C]),
                local: Some(&[B]),
            },
        ],
    },
    Case {
        name: "endpoints present at the first plan (a start, or an adoption after a restart) are never held",
        spec: "",
        warmup_ms: 1000,
        steps: &[
            // A terminating pod that still serves: a hold would not empty the list.
            Step {
                at: 5000,
                eps: Some(&[
                    (A, true, Cond::Ready),
                    (B, false, Cond::Ready),
                    (C, false, Cond::TermServing),
                ]),
                held: &[],
                cluster: Some(&[A, B]),
                local: None,
            },
            Step {
                at: 9000,
                eps: None,
                held: &[],
                cluster: Some(&[A, B]),
                local: None,
            },
        ],
    },
    Case {
        name: "not ready -> ready is held",
        spec: "",
        warmup_ms: 1000,
        steps: &[
            Step {
                at: 0,
                eps: Some(&[(A, true, Cond::Ready), (B, true, Cond::NotReady)]),
                held: &[],
                cluster: Some(&[A]),
                local: None,
            },
            Step {
                at: 200,
                eps: Some(&[(A, true, Cond::Ready), (B, true, Cond::Ready)]),
                held: &[B],
                cluster: Some(&[A]),
                local: None,
            },
            Step {
                at: 1200,
                eps: None,
                held: &[],
                cluster: Some(&[A, B]),
                local: None,
            },
        ],
    },
    Case {
        name: "ready -> not ready, and removal, are immediate; a held endpoint that goes is released at once",
        spec: "",
        warmup_ms: 1000,
        steps: &[
            Step {
                at: 0,
                eps: Some(&[(A, true, Cond::Ready), (B, true, Cond::Ready)]),
                held: &[],
                cluster: Some(&[A, B]),
                local: None,
            },
            Step {
                at: 10,
                eps: Some(&[(A, true, Cond::Ready), (B, true, Cond::NotReady)]),
                held: &[],
                cluster: Some(&[A]),
                local: None,
            },
            Step {
                at: 20,
                eps: Some(&[
                    (A, true, Cond::Ready),
                    (B, true, Cond::Ready),
                    (C, true, Cond::Ready),
                ]),
                held: &[B, C],
                cluster: Some(&[A]),
                local: None,
            },
            Step {
                at: 30,
                eps: Some(&[(A, true, Cond::Ready), (B, true, Cond::Ready)]),
                held: &[B],
                cluster: Some(&[A]),
                local: None,
            },
            Step {
                at: 40,
                eps: Some(&[(A, true, Cond::Ready), (B, true, Cond::NotReady)]),
                held: &[],
                cluster: Some(&[A]),
                local: None,
            },
        ],
    },
    Case {
        name: "the others going while held releases the held one at once; it is not held again",
        spec: "",
        warmup_ms: 1000,
        steps: &[
            Step {
                at: 0,
                eps: Some(&[(A, true, Cond::Ready)]),
                held: &[],
                cluster: Some(&[A]),
                local: None,
            },
            Step {
                at: 100,
                eps: Some(&[(A, true, Cond::Ready), (B, true, Cond::Ready)]),
                held: &[B],
                cluster: Some(&[A]),
                local: None,
            },
            Step {
                at: 200,
                eps: Some(&[(B, true, Cond::Ready)]),
                held: &[],
                cluster: Some(&[B]),
                local: None,
            },
            Step {
                at: 300,
                eps: Some(&[(A, true, Cond::Ready), (B, true, Cond::Ready)]),
                held: &[A],
                cluster: Some(&[B]),
                local: None,
            },
        ],
    },
    Case {
        name: "a warm-up of 0 holds nothing",
        spec: "",
        warmup_ms: 0,
        steps: &[
            Step {
                at: 0,
                eps: Some(&[(A, true, Cond::Ready)]),
                held: &[],
                cluster: Some(&[A]),
                local: None,
            },
            Step {
                at: 100,
                eps: Some(&[(A, true, Cond::Ready), (B, true, Cond::Ready)]),
                held: &[],
                cluster: Some(&[A, B]),
                local: None,
            },
        ],
    },
];

#[test]
fn warmup_holds_table() {
    for case in CASES {
        run(case);
    }
}

/// The plan reports each hold with its release; the planner says when to re-plan, and
/// the events say what began and ended, and why.
#[test]
fn holds_are_reported_with_their_release_and_events() {
    let planner = &mut run(&CASES[0]);
    assert_eq!(planner.next_release(), None, "released at the last step");
    let events = planner.take_warmup_events();
    let hold = Hold {
        ready_since: Moment(500),
        release: Moment(1500),
    };
    let svc = kproxy_core::model::ServiceName::new("ns", "web");
    let ip = B.parse().unwrap();
    assert_eq!(
        events,
        vec![
            Event::Held {
                service: svc.clone(),
                ip,
                hold
            },
            Event::Released {
                service: svc.clone(),
                ip,
                hold,
                reason: ReleaseReason::Elapsed
            },
        ]
    );

    // Stopped before the release: the planner names it.
    let mut steps_case = Case {
        steps: &CASES[0].steps[..2],
        ..clone_case(&CASES[0])
    };
    steps_case.name = "until the hold";
    let mut planner = run(&steps_case);
    assert_eq!(planner.next_release(), Some(Moment(1500)));
    let _ = planner.take_warmup_events();

    // The others go: released because it is needed; it going too is `Gone`.
    let mut planner = run(&CASES[10]);
    let reasons: Vec<ReleaseReason> = planner
        .take_warmup_events()
        .into_iter()
        .filter_map(|e| match e {
            Event::Released { reason, .. } => Some(reason),
            Event::Held { .. } => None,
        })
        .collect();
    assert_eq!(reasons, [ReleaseReason::Needed]);
    let mut planner = run(&CASES[9]);
    let reasons: Vec<(String, ReleaseReason)> = planner
        .take_warmup_events()
        .into_iter()
        .filter_map(|e| match e {
            Event::Released { reason, ip, .. } => Some((ip.to_string(), reason)),
            Event::Held { .. } => None,
        })
        .collect();
    assert_eq!(
        reasons,
        [
            (C.to_string(), ReleaseReason::Gone),
            (B.to_string(), ReleaseReason::Gone)
        ]
    );
}

fn clone_case(c: &Case) -> Case {
    Case {
        name: c.name,
        spec: c.spec,
        warmup_ms: c.warmup_ms,
        steps: c.steps,
    }
}

/// A held endpoint does not count for the health-check node port (it is not ready for
/// new connections yet), and the plan's JSON and `explain` show the hold.
#[test]
fn a_held_endpoint_is_not_counted_by_the_health_check_and_is_shown() {
    let cfg = PlanConfig {
        endpoint_warmup: Duration::from_secs(1),
        ..PlanConfig::default()
    };
    let mut planner = Planner::new("node-a", cfg);
    let mut st = ClusterState::new();
    apply(&mut st, NODE);
    apply(
        &mut st,
        &service(&LB_LOCAL.replace("Local\n", "Local\n  healthCheckNodePort: 32000\n")),
    );
    let count = |p: &Planner| {
        p.plan()
            .health_checks()
            .next()
            .expect("a health check")
            .local_endpoints
    };
    apply(&mut st, &slice(&[(A, true, Cond::Ready)]));
    let changes = st.take_changes();
    planner.apply_at(&st, changes, Moment(0));
    assert_eq!(count(&planner), 1);
    apply(
        &mut st,
        &slice(&[(A, true, Cond::Ready), (B, true, Cond::Ready)]),
    );
    let changes = st.take_changes();
    planner.apply_at(&st, changes, Moment(1_795_892_645_000));
    assert_eq!(count(&planner), 1, "B is held");

    let json = serde_json::to_value(planner.plan()).unwrap();
    let eps = &json["servicePorts"][0]["endpoints"];
    assert_eq!(eps[0].get("warmup"), None, "{eps}");
    assert_eq!(
        eps[1]["warmup"],
        serde_json::json!({"readySince": 1_795_892_645_000u64, "releaseAt": 1_795_892_646_000u64}),
        "{eps}"
    );
    let svc = planner.plan().services.values().next().unwrap();
    let text = kproxy_core::explain::explain_service(planner.plan(), svc);
    assert!(
        text.contains("10.244.1.2:8080 — ready since 2026-11-28T19:04:05.000Z, held for warm-up until 2026-11-28T19:04:06.000Z"),
        "{text}"
    );
    let table = kproxy_core::explain::plan_table(planner.plan());
    assert!(table.contains("HELD FOR WARM-UP"), "{table}");

    planner.apply_at(&st, Changes::default(), Moment(1_795_892_646_000));
    assert_eq!(count(&planner), 2, "released");
}
