//! Upstream's health-check node port table (`service_health.json` in the `conformance`
//! folder of the shared folder beside the repository, or of `KPROXY_SHARED`;
//! docs/conformance.md)
//! through the real path: Kubernetes objects → ingestion → planner → `Health` → real
//! listeners in a private network namespace → real HTTP requests. Each vector runs under
//! both semantics: in a steady state (the plan applied) they must answer identically.
//!
//! Upstream's /healthz and /livez timelines (proxy_healthz.json) drive one `Health` with
//! a manual clock and ask the real `healthzBindAddress` server after every `check` step.
//! They run under upstream semantics only: truthful answers 503 on /healthz before the
//! first apply on purpose (docs/health.md), which the first step of the timeline asks.

mod common;

use kproxy_test_support::conformance;
use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use common::{closed_soon, health_config, in_netns, request, t0};
use kproxy_core::config::NodePortAddressesConfig;
use kproxy_core::ingest::Ownership;
use kproxy_core::manifest::Object;
use kproxy_core::model::IpFamily;
use kproxy_core::{ClusterState, PlanConfig};
use kproxy_health::{Health, HealthConfig, ManualClock, Semantics};
use libtest_mimic::{Arguments, Failed, Trial};
use serde_json::Value;

fn load() -> Vec<Value> {
    load_file("service_health.json", "vectors")
}

fn load_file(file: &str, key: &str) -> Vec<Value> {
    conformance::load(file, key)
}

/// The vector's objects through manifest reading and ingestion, planned for its node.
fn plan_of(v: &Value) -> Result<kproxy_core::NodePlan, Failed> {
    let mut items = vec![v["node"].clone()];
    items.extend(v["services"].as_array().cloned().unwrap_or_default());
    items.extend(v["endpointSlices"].as_array().cloned().unwrap_or_default());
    let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": items});
    let parsed = kproxy_core::manifest::parse("vector.json", &list.to_string());
    if !parsed.errors.is_empty() {
        return Err(format!("vector objects do not parse: {:?}", parsed.errors).into());
    }
    let node_name = v["node"]["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let mut state = ClusterState::new();
    for o in &parsed.objects {
        // Upstream drops slices it cannot use with an error; so does ingestion.
        let res = state.apply(&o.object, &Ownership::default(), &node_name);
        if res.is_err() && !matches!(o.object, Object::EndpointSlice(_)) {
            return Err(format!("ingestion failed: {res:?}").into());
        }
    }
    let mut cfg = PlanConfig::default();
    if let Some(cidrs) = v["nodePortAddresses"].as_array() {
        let cidrs = cidrs
            .iter()
            .filter_map(|c| c.as_str()?.parse().ok())
            .collect();
        cfg.node_port_addresses = NodePortAddressesConfig::Cidrs(cidrs);
        // What the daemon does: node addresses from the interfaces.
        cfg.node_ips = kproxy_health::local_addresses()
            .map_err(|e| e.to_string())?
            .into_iter()
            .map(|a| a.ip)
            .collect();
    }
    Ok(kproxy_core::plan(&state, &node_name, &cfg))
}

async fn run_vector(v: Value, semantics: Semantics) -> Result<(), Failed> {
    let plan = Arc::new(plan_of(&v)?);
    let clock = ManualClock::new(t0());
    let mut registry = prometheus_client::registry::Registry::default();
    let cfg = health_config(None, semantics);
    let health = Health::start_with_clock(cfg, &mut registry, clock.clone())
        .await
        .map_err(|e| e.to_string())?;
    health.plan_computed(&plan);
    health.plan_applied(&plan);
    if v["proxyHealthy"].as_bool() == Some(false) {
        // A change queued and never applied for 2 × syncPeriod.
        health.plan_computed(&plan);
        clock.advance(Duration::from_secs(61));
    }
    health.reconciled().await;
    let listening = health.listening();
    let mut errs = Vec::new();
    for want in v["expect"]["healthChecks"].as_array().into_iter().flatten() {
        let svc = want["service"].as_str().unwrap_or_default();
        let got = listening
            .iter()
            .find(|(name, _)| name.to_string() == svc)
            .map(|(_, l)| l);
        if want["served"].as_bool() == Some(false) {
            if let Some(l) = got {
                errs.push(format!(
                    "{svc}: expected no health check, listening on {:?}",
                    l.addrs
                ));
            }
            continue;
        }
        let Some(l) = got else {
            errs.push(format!("{svc}: expected a health-check server, none"));
            continue;
        };
        let port = want["healthCheckNodePort"].as_u64().unwrap_or_default() as u16;
        if l.port != port {
            errs.push(format!("{svc}: port {} != {port}", l.port));
        }
        let want_listen: BTreeSet<SocketAddr> = want["listen"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|a| a.as_str()?.parse().ok())
            .collect();
        let got_v4: BTreeSet<SocketAddr> =
            l.addrs.iter().copied().filter(|a| a.is_ipv4()).collect();
        if want_listen
            .iter()
            .filter(|a| a.is_ipv4())
            .copied()
            .collect::<BTreeSet<_>>()
            != got_v4
            || !want_listen.iter().all(|a| l.addrs.contains(a))
        {
            errs.push(format!(
                "{svc}: listening on {:?}, expected {want_listen:?}",
                l.addrs
            ));
        }
        // Probe every expected address (0.0.0.0 through loopback), on two paths and
        // two methods: upstream ignores the request.
        for a in &want_listen {
            let target = if a.ip().is_unspecified() {
                SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), a.port())
            } else {
                *a
            };
            for (method, path) in [("GET", "/"), ("POST", "/some/other/path?x=1")] {
                let r = request(target, method, path)
                    .await
                    .map_err(|e| format!("{svc}: {method} {target}{path}: {e}"))?;
                if Some(u64::from(r.status)) != want["status"].as_u64() {
                    errs.push(format!(
                        "{svc} {method} {path}: status {} != {}",
                        r.status, want["status"]
                    ));
                }
                for (h, hv) in want["headers"].as_object().into_iter().flatten() {
                    let got = r.headers.get(&h.to_ascii_lowercase());
                    if got.map(String::as_str) != hv.as_str() {
                        errs.push(format!("{svc}: header {h}: {got:?} != {hv}"));
                    }
                }
                if r.json() != want["body"] {
                    errs.push(format!("{svc}: body {} != {}", r.body, want["body"]));
                }
            }
        }
    }
    // Nothing else is served.
    for (name, l) in &listening {
        let expected = v["expect"]["healthChecks"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|w| {
                w["service"].as_str() == Some(&name.to_string())
                    && w["served"].as_bool() != Some(false)
            });
        if !expected {
            errs.push(format!(
                "{name}: unexpected health-check server on {:?}",
                l.addrs
            ));
        }
    }
    // Served ports close again with the Service gone.
    let ports: Vec<u16> = listening.values().map(|l| l.port).collect();
    let empty = Arc::new(kproxy_core::NodePlan {
        services: Default::default(),
        ..(*plan).clone()
    });
    health.plan_computed(&empty);
    health.plan_applied(&empty);
    health.reconciled().await;
    for p in ports {
        if !closed_soon(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), p)).await {
            errs.push(format!("port {p} still open after its Service was removed"));
        }
    }
    health.shutdown().await;
    if errs.is_empty() {
        Ok(())
    } else {
        Err(errs.join("\n").into())
    }
}

fn family(step: &Value) -> Result<IpFamily, Failed> {
    match step["family"].as_str() {
        Some("IPv4") => Ok(IpFamily::IPv4),
        Some("IPv6") => Ok(IpFamily::IPv6),
        other => Err(format!("step {step}: bad family {other:?}").into()),
    }
}

/// The plan the daemon computes for the Node a `node` step describes (no Services):
/// node eligibility is the planner's decision, not the test's.
fn node_plan(node: &Value) -> Result<Arc<kproxy_core::NodePlan>, Failed> {
    let mut state = ClusterState::new();
    if node["exists"].as_bool() != Some(false) {
        let mut meta = serde_json::json!({"name": "test-node"});
        if node["deleted"].as_bool() == Some(true) {
            meta["deletionTimestamp"] = "2024-01-01T00:00:00Z".into();
        }
        let taints: Vec<Value> = node["taints"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|k| serde_json::json!({"key": k, "effect": "NoSchedule"}))
            .collect();
        let obj = serde_json::json!({
            "apiVersion": "v1", "kind": "Node", "metadata": meta,
            "spec": {"taints": taints},
            "status": {"addresses": [{"type": "InternalIP", "address": "10.0.0.1"}]},
        });
        let parsed = kproxy_core::manifest::parse("node.json", &obj.to_string());
        if !parsed.errors.is_empty() {
            return Err(format!("node does not parse: {:?}", parsed.errors).into());
        }
        for o in &parsed.objects {
            state
                .apply(&o.object, &Ownership::default(), "test-node")
                .map_err(|e| format!("node ingestion: {e:?}"))?;
        }
    }
    Ok(Arc::new(kproxy_core::plan(
        &state,
        "test-node",
        &PlanConfig::default(),
    )))
}

async fn run_timeline(t: Value) -> Result<(), Failed> {
    let timeout = t["healthTimeoutSeconds"]
        .as_f64()
        .ok_or("timeline without healthTimeoutSeconds")?;
    let clock = ManualClock::new(t0());
    let mut registry = prometheus_client::registry::Registry::default();
    let cfg = HealthConfig {
        healthz_bind_address: Some(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0)),
        semantics: Semantics::Upstream,
        // healthTimeout = 2 × syncPeriod.
        sync_period: Duration::from_secs_f64(timeout / 2.0),
        connection_budget: None,
    };
    let health = Health::start_with_clock(cfg, &mut registry, clock.clone())
        .await
        .map_err(|e| e.to_string())?;
    health.reconciled().await;
    let addr = *health
        .healthz_addrs()
        .first()
        .ok_or("healthzBindAddress not bound")?;
    let mut errs = Vec::new();
    for (i, step) in t["steps"].as_array().into_iter().flatten().enumerate() {
        match step["op"].as_str() {
            Some("queued") => health.family_queued(family(step)?),
            Some("updated") => health.family_updated(family(step)?),
            Some("advance") => clock.advance(Duration::from_secs_f64(
                step["seconds"].as_f64().ok_or("advance without seconds")?,
            )),
            // What the daemon does on a Node change: compute the plan, apply it.
            Some("node") => {
                let plan = node_plan(&step["node"])?;
                health.plan_computed(&plan);
                health.plan_applied(&plan);
                health.reconciled().await;
            }
            Some("check") => {
                for probe in ["healthz", "livez"] {
                    let r = request(addr, "GET", &format!("/{probe}"))
                        .await
                        .map_err(|e| format!("GET /{probe}: {e}"))?;
                    let want = step["expect"][probe].as_u64();
                    if Some(u64::from(r.status)) != want {
                        errs.push(format!(
                            "step {i} ({}): /{probe} {} != {}",
                            step["upstreamComment"].as_str().unwrap_or(""),
                            r.status,
                            step["expect"][probe]
                        ));
                    }
                }
            }
            other => return Err(format!("step {i}: unknown op {other:?}").into()),
        }
    }
    health.shutdown().await;
    if errs.is_empty() {
        Ok(())
    } else {
        Err(errs.join("\n").into())
    }
}

fn main() {
    let args = Arguments::from_args();
    // Every trial runs in a network namespace: without root, all are shown ignored.
    let run = kproxy_test_support::root("network namespaces");
    let mut trials = Vec::new();
    for v in load() {
        for semantics in [Semantics::Upstream, Semantics::Truthful] {
            let name = format!(
                "service_health::{}::{}",
                semantics.as_str(),
                conformance::slug(&v)
            );
            let uncertain = v["uncertain"].as_bool().unwrap_or(false);
            let v = v.clone();
            let trial = Trial::test(name, move || in_netns(move || run_vector(v, semantics)));
            trials.push(if uncertain {
                trial.with_kind("uncertain")
            } else {
                trial
            });
        }
    }
    for t in load_file("proxy_healthz.json", "timelines") {
        let name = format!("proxy_healthz::upstream::{}", conformance::slug(&t));
        trials.push(Trial::test(name, move || in_netns(move || run_timeline(t))));
    }
    let trials = trials
        .into_iter()
        .map(|t| t.with_ignored_flag(!run))
        .collect();
    libtest_mimic::run(&args, trials).exit();
}
