//! Why a burst of failed requests happened, in plain words: what each node looked
//! like at the burst (its pool membership, its pods' lifecycles), what the control
//! plane had published, what the chaos or the node drain did. Pure functions over a
//! run's events.

use std::collections::BTreeMap;

use super::{RunResult, nominal};
use crate::scenario::run::Behaviour;
use crate::world::loadgen::RequestRecord;
use crate::world::timeline::EventKind;

/// Per node, what the events say at time `t_ms`.
#[derive(Debug, Default, Clone)]
struct NodeView {
    in_pool: bool,
    live_pods: Vec<String>,
    terminating: Vec<(String, f64)>,
    sigtermed: Vec<(String, f64)>,
    ready: Vec<String>,
    pool_removed_at: Option<f64>,
}

fn node_views(r: &RunResult, t_ms: f64) -> BTreeMap<String, NodeView> {
    let mut views: BTreeMap<String, NodeView> = r
        .nodes
        .iter()
        .map(|n| {
            (
                n.clone(),
                NodeView {
                    in_pool: true,
                    ..Default::default()
                },
            )
        })
        .collect();
    for e in r.events.iter().filter(|e| e.t_ms <= t_ms) {
        match (&e.kind, &e.node, &e.pod) {
            (EventKind::PodCreated, Some(n), Some(p)) => {
                if let Some(v) = views.get_mut(n) {
                    v.live_pods.push(p.clone());
                }
            }
            (EventKind::PodTerminating, Some(n), Some(p)) => {
                if let Some(v) = views.get_mut(n) {
                    v.terminating.push((p.clone(), e.t_ms));
                }
            }
            (EventKind::PodSigterm, Some(n), Some(p)) => {
                if let Some(v) = views.get_mut(n) {
                    v.sigtermed.push((p.clone(), e.t_ms));
                }
            }
            (EventKind::PodReady, Some(n), Some(p)) => {
                if let Some(v) = views.get_mut(n) {
                    v.ready.push(p.clone());
                }
            }
            (EventKind::PodNotReady, Some(n), Some(p)) => {
                if let Some(v) = views.get_mut(n) {
                    v.ready.retain(|x| x != p);
                }
            }
            (EventKind::PodExited | EventKind::PodKilled, Some(n), Some(p)) => {
                if let Some(v) = views.get_mut(n) {
                    v.live_pods.retain(|x| x != p);
                    v.ready.retain(|x| x != p);
                    v.terminating.retain(|(x, _)| x != p);
                    v.sigtermed.retain(|(x, _)| x != p);
                }
            }
            (EventKind::LbPool, _, _) => {
                for (name, v) in views.iter_mut() {
                    let now_in = pool_contains(&e.detail, name);
                    if v.in_pool && !now_in {
                        v.pool_removed_at = Some(e.t_ms);
                    }
                    v.in_pool = now_in;
                }
            }
            _ => {}
        }
    }
    views
}

pub(super) fn pool_contains(detail: &str, node: &str) -> bool {
    detail.split([' ', ',', '(', ')']).any(|w| w == node)
}

/// When did the LB take `node` out of the pool after `t_ms`?
fn pool_removal_after(r: &RunResult, node: &str, t_ms: f64) -> Option<f64> {
    r.events
        .iter()
        .filter(|e| {
            e.kind == EventKind::LbPool && e.t_ms >= t_ms && !pool_contains(&e.detail, node)
        })
        .map(|e| e.t_ms)
        .next()
}

/// The cause of a burst starting at `start_ms`, in plain words.
pub fn explain_burst(
    r: &RunResult,
    start_ms: f64,
    end_ms: f64,
    records: &[&RequestRecord],
) -> String {
    let views = node_views(r, start_ms);
    let mut causes = drain_causes(r, start_ms, end_ms, records);
    let flushed = flush_window(r, start_ms);
    if let Some(flush) = &flushed {
        causes.push(flush_cause(r, flush));
    }
    // Per-node pod checks are about eTP Local (a node without a serving local pod
    // drops); with a drain the Service is eTP Cluster and any node forwards.
    for (node, v) in views.iter().filter(|_| r.drain.is_none()) {
        if !v.in_pool || flushed.as_ref().is_some_and(|(n, _, _)| n == node) {
            continue;
        }
        causes.extend(node_cause(r, node, v, start_ms));
    }
    if causes.is_empty() {
        causes.push(other_cause(r, start_ms, end_ms, records));
    }
    causes.join("; ")
}

/// A flushed ruleset (`flush_window`'s node and times) in words.
fn flush_cause(
    r: &RunResult,
    (node, flushed_at, repaired_at): &(String, f64, Option<f64>),
) -> String {
    let repaired = match repaired_at {
        Some(t) => format!(
            "restored them {:.0} ms after the flush was recorded",
            t - flushed_at
        ),
        None => "had not restored them".to_string(),
    };
    format!(
        "another process flushed {node}'s nftables ruleset at {:.2} s and kproxy {repaired}: new connections that reached {node} in between found no rule",
        nominal(r, *flushed_at)
    )
}

/// Why `node`, in the load balancer's pool at the burst, dropped new connections (none:
/// it had a ready pod that was not terminating).
fn node_cause(r: &RunResult, node: &str, v: &NodeView, start_ms: f64) -> Option<String> {
    let all_terminating = !v.live_pods.is_empty()
        && v.live_pods
            .iter()
            .all(|p| v.terminating.iter().any(|(x, _)| x == p));
    if all_terminating {
        let since = v
            .terminating
            .iter()
            .map(|(_, t)| *t)
            .fold(f64::MIN, f64::max);
        let removed = pool_removal_after(r, node, start_ms);
        let window = match removed {
            Some(t) => format!("for {:.1} s", nominal(r, t - since)),
            None => "until the end of the run".to_string(),
        };
        let all_sigtermed = v
            .live_pods
            .iter()
            .all(|p| v.sigtermed.iter().any(|(x, _)| x == p));
        let none_serving = !v.live_pods.iter().any(|p| v.ready.contains(p));
        let unpublished: Vec<&str> = v
            .terminating
            .iter()
            .filter(|(p, t)| !termination_published(r, node, p, *t, start_ms))
            .map(|(p, _)| p.as_str())
            .collect();
        if !unpublished.is_empty() {
            return Some(format!(
                "{node} kept receiving new connections {window} after its last pod became terminating, and no EndpointSlice change had shown {} terminating by then (the EndpointSlice controller had not published it): no proxy could turn {node}'s health check to 503",
                unpublished.join(", ")
            ));
        } else if none_serving {
            return Some(format!(
                "{node} kept receiving new connections {window} after its last pod became terminating, and that pod's readiness had already failed ({}): terminating and not serving, it was no endpoint while still alive, so {node} dropped new connections (the rule: preStop + readiness period × (failureThreshold − 1) must cover terminationGracePeriodSeconds)",
                v.live_pods.join(", ")
            ));
        } else if all_sigtermed {
            return Some(format!(
                "{node} kept receiving new connections {window} after its last pod became terminating, and its pods had already got SIGTERM (preStop ended) and stopped accepting: the preStop sleep is shorter than the time the load balancer needed to take {node} out"
            ));
        } else if r.behaviour == Behaviour::Pre126 {
            return Some(format!(
                "{node} kept receiving new connections {window} after its last pod became terminating; with pre-1.26 behaviour a terminating pod is no endpoint, so no serving endpoint remained on {node} and its rules dropped them while the load balancer still thought {node} healthy"
            ));
        } else {
            return Some(format!(
                "{node} kept receiving new connections {window} after its last pod became terminating (failover to the serving-terminating pod did not catch them)"
            ));
        }
    } else if !v
        .live_pods
        .iter()
        .any(|p| v.ready.contains(p) && !v.terminating.iter().any(|(x, _)| x == p))
    {
        let until = match pool_removal_after(r, node, start_ms) {
            Some(t) => format!(
                "until the load balancer took it out at {:.1} s",
                nominal(r, t)
            ),
            None => "while the load balancer kept it in the pool".to_string(),
        };
        let pods = if v.live_pods.is_empty() {
            "no pod at all (the old one had exited)".to_string()
        } else {
            format!("no ready pod ({} not ready yet)", v.live_pods.join(", "))
        };
        return Some(format!(
            "{node} had {pods} and still received new connections {until}"
        ));
    }
    None
}

/// The cause of a burst that no node drain, flush or node explains: the load
/// balancer's drain timeout, a SIGKILL, a pod's process ending under keep-alive
/// connections, or none found.
fn other_cause(r: &RunResult, start_ms: f64, end_ms: f64, records: &[&RequestRecord]) -> String {
    let drained: Vec<String> = r
        .events
        .iter()
        // Cut flows fail on their next request: look back a few nominal seconds.
        .filter(|e| {
            e.kind == EventKind::LbDrained
                && e.t_ms >= start_ms - 3000.0 * r.time_scale
                && e.t_ms <= end_ms
        })
        .filter_map(|e| e.node.clone())
        .collect();
    if !drained.is_empty() {
        return format!(
            "the load balancer's drain timeout cut established connections to {} while their pods were still serving",
            drained.join(", ")
        );
    }
    // Kills and resets inside the burst.
    let killed: Vec<String> = r
        .events
        .iter()
        .filter(|e| e.kind == EventKind::PodKilled && e.t_ms >= start_ms - 50.0 && e.t_ms <= end_ms)
        .filter_map(|e| e.pod.clone())
        .collect();
    if !killed.is_empty() {
        return format!(
            "pod(s) {} were killed (SIGKILL at the end of the grace period) with connections open",
            killed.join(", ")
        );
    }
    // Keep-alive requests on a connection whose pod had just exited (an
    // `exit-on-term` pod ends at SIGTERM and its open connections die with it).
    let mut exited: Vec<String> = records
        .iter()
        .filter_map(|x| x.conn_pod.as_ref())
        .filter(|p| {
            r.events.iter().any(|e| {
                matches!(e.kind, EventKind::PodExited | EventKind::PodKilled)
                    && e.pod.as_ref() == Some(*p)
                    && e.t_ms >= start_ms - 3000.0 * r.time_scale
                    && e.t_ms <= end_ms + 1000.0 * r.time_scale
            })
        })
        .cloned()
        .collect();
    exited.sort();
    exited.dedup();
    if !exited.is_empty() {
        return format!(
            "keep-alive connections to {} failed when that pod's process ended (at SIGTERM or SIGKILL) with the connections still open: the application closed no connection before exiting",
            exited.join(", ")
        );
    }
    let kinds: Vec<&str> = records.iter().map(|r| r.outcome.as_str()).collect();
    format!(
        "no cause found in the timeline ({}); possibly machine noise",
        kinds.first().copied().unwrap_or("?")
    )
}

/// Whether an EndpointSlice change between `since` (the pod's termination) and `t_ms`
/// showed `pod` of `node` no longer ready (terminating, or gone).
fn termination_published(r: &RunResult, node: &str, pod: &str, since: f64, t_ms: f64) -> bool {
    let ready = format!("{pod}@{node}:R");
    r.events.iter().any(|e| {
        e.kind == EventKind::SlicePublished
            && e.t_ms >= since
            && e.t_ms <= t_ms
            && !e.detail.contains(&ready)
    })
}

/// A ruleset flush a burst starting at `t_ms` falls into: the node, when it was
/// recorded, and when that node's kproxy reported the repair (if it did). The flush is
/// recorded once `nft` returned, so the window opens a little before it.
fn flush_window(r: &RunResult, t_ms: f64) -> Option<(String, f64, Option<f64>)> {
    let slack = 100.0;
    r.events
        .iter()
        .filter(|e| e.kind == EventKind::RulesetFlushed && e.t_ms - slack <= t_ms)
        .filter_map(|e| Some((e.node.clone()?, e.t_ms)))
        .map(|(node, at)| {
            let repaired = r
                .events
                .iter()
                .find(|e| {
                    e.kind == EventKind::Note
                        && e.node.as_deref() == Some(node.as_str())
                        && e.t_ms >= at - slack
                        && e.detail.contains("kernel_repaired")
                })
                .map(|e| e.t_ms);
            (node, at, repaired)
        })
        .rfind(|(_, _, repaired)| repaired.is_none_or(|t| t_ms <= t + slack))
}

/// The first event of `kind` for `node`.
fn first_event(r: &RunResult, kind: EventKind, node: &str) -> Option<f64> {
    r.events
        .iter()
        .find(|e| e.kind == kind && e.node.as_deref() == Some(node))
        .map(|e| e.t_ms)
}

/// Causes of a burst in a node-drain run that reaches the drained node's deletion:
/// new connections the load balancer still sent to the deleted node (and why its
/// health check had not taken it out), and keep-alive connections established
/// through it.
fn drain_causes(
    r: &RunResult,
    start_ms: f64,
    end_ms: f64,
    records: &[&RequestRecord],
) -> Vec<String> {
    let Some((by, node)) = r
        .drain
        .and_then(|d| Some((d.by, r.nodes.get(d.node.wrapping_sub(1))?)))
    else {
        return Vec::new();
    };
    let (Some(tainted), Some(deleted)) = (
        first_event(r, EventKind::NodeTainted, node),
        first_event(r, EventKind::NodeDeleted, node),
    ) else {
        return Vec::new();
    };
    // A request in flight when the node went fails at once or at its timeout; look
    // back one nominal second for requests started just before.
    if end_ms < deleted - 1000.0 * r.time_scale {
        return Vec::new();
    }
    let mut causes = Vec::new();
    // A keep-alive request on a fresh connection (the first, or after a failure) is a
    // new connection to the load balancer too.
    let kept_failed = records.iter().filter(|x| x.reused).count();
    let new_failed = records.len() - kept_failed;
    let in_pool_at_deletion = node_views(r, deleted).get(node).is_some_and(|v| v.in_pool);
    if new_failed > 0 && in_pool_at_deletion {
        let removed = match pool_removal_after(r, node, deleted) {
            Some(t) => format!("until it took {node} out at {:.1} s", nominal(r, t)),
            None => "until the end of the run".to_string(),
        };
        let failing_since = r
            .events
            .iter()
            .find(|e| {
                e.kind == EventKind::HealthAnswer
                    && e.node.as_deref() == Some(node.as_str())
                    && e.t_ms >= tainted
                    && e.t_ms <= deleted
                    // An answer (503): a probe that got none in time under load is
                    // no sign of the drain.
                    && e.detail.contains("fails (answered")
            })
            .map(|e| e.t_ms);
        let why = match failing_since {
            None => format!(
                "its /healthz (10256) kept answering 200 for the {:.1} s from {} to the deletion: with pre-1.26 behaviour it does not affect /healthz, so the load balancer learned of the node only when it stopped answering",
                nominal(r, deleted - tainted),
                by.words()
            ),
            Some(t) => format!(
                "its /healthz had answered 503 ({}) from {:.1} s, but the node was deleted {:.1} s after it, before the load balancer's detection window ({:.1} s) ran out",
                by.words(),
                nominal(r, t),
                nominal(r, deleted - tainted),
                r.health_check.detection_window_s()
            ),
        };
        causes.push(format!(
            "{node} was deleted at {:.1} s (kproxy stopped, link cut) while the load balancer still sent it new connections, {removed}: {why}",
            nominal(r, deleted)
        ));
    }
    if kept_failed > 0 && start_ms <= deleted + 3000.0 * r.time_scale {
        causes.push(format!(
            "{kept_failed} request(s) on keep-alive connections that the load balancer had established through {node} (a flow stays on the node it was first sent to) failed when {node} was deleted at {:.1} s: an established connection cannot leave a node that vanishes, whatever the proxy does; the client must reconnect",
            nominal(r, deleted)
        ));
    }
    causes
}
