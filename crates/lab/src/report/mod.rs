//! Turning a run's raw records and events into what a person reads: the summary
//! (counts by kind, longest outage, failures per phase), failure bursts with their
//! cause in plain words, the run's anomalies (the lab running late, every node failing
//! a health check at once), the event timeline, and the JSON document. Pure
//! functions; all times shown are nominal (real time divided by the time scale).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;
use serde_json::{Value, json};

use crate::loadgen::{Outcome, RequestRecord};
use crate::scenario::RunResult;
use crate::timeline::{Event, EventKind};

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Burst {
    pub start_s: f64,
    pub end_s: f64,
    pub failed: usize,
    pub kinds: BTreeMap<String, usize>,
    pub cause: String,
}

/// Something a run shows that no setting explains: the lab itself ran late (a preStop
/// longer than configured, a stalled runtime), or every node failed a health check in
/// the same probe round after passing.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Anomaly {
    /// Nominal seconds since the run started.
    pub at_s: f64,
    pub what: String,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Summary {
    pub behaviour: String,
    /// `emulated` or `k8s-lab`.
    pub control_plane: String,
    pub run: usize,
    pub sent: usize,
    pub ok: usize,
    pub failed: usize,
    pub failed_by_kind: BTreeMap<String, usize>,
    /// Longest span (nominal s) from the first to the last failure of a burst with
    /// no success in between.
    pub longest_outage_s: f64,
    pub failed_before_rollout: usize,
    pub failed_during_rollout: usize,
    pub failed_after_rollout: usize,
    pub bursts: Vec<Burst>,
    pub anomalies: Vec<Anomaly>,
}

/// The behaviour, with the control plane when it is not the embedded emulation.
fn label(m: &Summary) -> String {
    label_of(&m.behaviour, &m.control_plane)
}

fn label_of(behaviour: &str, control_plane: &str) -> String {
    if control_plane == "emulated" {
        behaviour.to_string()
    } else {
        format!("{behaviour}/{control_plane}")
    }
}

fn nominal(r: &RunResult, ms: f64) -> f64 {
    ms / 1000.0 / r.time_scale
}

/// Group failures into bursts: failures closer than `gap_s` nominal seconds.
pub fn bursts_of(
    records: &[RequestRecord],
    scale: f64,
    gap_s: f64,
) -> Vec<(f64, f64, Vec<&RequestRecord>)> {
    let mut fails: Vec<&RequestRecord> = records.iter().filter(|r| !r.outcome.is_ok()).collect();
    fails.sort_by(|a, b| a.start_ms.total_cmp(&b.start_ms));
    let gap_ms = gap_s * 1000.0 * scale;
    let mut out: Vec<(f64, f64, Vec<&RequestRecord>)> = Vec::new();
    for f in fails {
        match out.last_mut() {
            // Bursts span the start times of their failed requests (a timed-out
            // request ends long after the cause is gone).
            Some((_, end, v)) if f.start_ms - *end <= gap_ms => {
                *end = end.max(f.start_ms);
                v.push(f);
            }
            _ => out.push((f.start_ms, f.start_ms, vec![f])),
        }
    }
    out
}

/// Longest stretch (real ms) where every request that started failed.
fn longest_outage_ms(records: &[RequestRecord]) -> f64 {
    let mut v: Vec<&RequestRecord> = records.iter().collect();
    v.sort_by(|a, b| a.start_ms.total_cmp(&b.start_ms));
    let (mut best, mut cur_start) = (0.0f64, None::<f64>);
    let mut cur_end = 0.0;
    for r in v {
        if r.outcome.is_ok() {
            if let Some(s) = cur_start.take() {
                best = best.max(cur_end - s);
            }
        } else {
            if cur_start.is_none() {
                cur_start = Some(r.start_ms);
            }
            cur_end = r.start_ms;
        }
    }
    if let Some(s) = cur_start {
        best = best.max(cur_end - s);
    }
    best
}

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

fn pool_contains(detail: &str, node: &str) -> bool {
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
    if let Some((node, flushed_at, repaired_at)) = &flushed {
        let repaired = match repaired_at {
            Some(t) => format!(
                "restored them {:.0} ms after the flush was recorded",
                t - flushed_at
            ),
            None => "had not restored them".to_string(),
        };
        causes.push(format!(
            "another process flushed {node}'s nftables ruleset at {:.2} s and kproxy {repaired}: new connections that reached {node} in between found no rule",
            nominal(r, *flushed_at)
        ));
    }
    // Per-node pod checks are about eTP Local (a node without a serving local pod
    // drops); with a drain the Service is eTP Cluster and any node forwards.
    for (node, v) in views.iter().filter(|_| r.drain.is_none()) {
        if !v.in_pool || flushed.as_ref().is_some_and(|(n, _, _)| n == node) {
            continue;
        }
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
                causes.push(format!(
                    "{node} kept receiving new connections {window} after its last pod became terminating, and no EndpointSlice change had shown {} terminating by then (the EndpointSlice controller had not published it): no proxy could turn {node}'s health check to 503",
                    unpublished.join(", ")
                ));
            } else if none_serving {
                causes.push(format!(
                    "{node} kept receiving new connections {window} after its last pod became terminating, and that pod's readiness had already failed ({}): terminating and not serving, it was no endpoint while still alive, so {node} dropped new connections (the rule: preStop + readiness period × (failureThreshold − 1) must cover terminationGracePeriodSeconds)",
                    v.live_pods.join(", ")
                ));
            } else if all_sigtermed {
                causes.push(format!(
                    "{node} kept receiving new connections {window} after its last pod became terminating, and its pods had already got SIGTERM (preStop ended) and stopped accepting: the preStop sleep is shorter than the time the load balancer needed to take {node} out"
                ));
            } else if r.behaviour == crate::scenario::Behaviour::Pre126 {
                causes.push(format!(
                    "{node} kept receiving new connections {window} after its last pod became terminating; with pre-1.26 behaviour a terminating pod is no endpoint, so no serving endpoint remained on {node} and its rules dropped them while the load balancer still thought {node} healthy"
                ));
            } else {
                causes.push(format!(
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
            causes.push(format!(
                "{node} had {pods} and still received new connections {until}"
            ));
        }
    }
    if causes.is_empty() {
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
            causes.push(format!(
                "the load balancer's drain timeout cut established connections to {} while their pods were still serving",
                drained.join(", ")
            ));
        }
    }
    if causes.is_empty() {
        // Kills and resets inside the burst.
        let killed: Vec<String> = r
            .events
            .iter()
            .filter(|e| {
                e.kind == EventKind::PodKilled && e.t_ms >= start_ms - 50.0 && e.t_ms <= end_ms
            })
            .filter_map(|e| e.pod.clone())
            .collect();
        if !killed.is_empty() {
            causes.push(format!("pod(s) {} were killed (SIGKILL at the end of the grace period) with connections open", killed.join(", ")));
        }
    }
    if causes.is_empty() {
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
            causes.push(format!(
                "keep-alive connections to {} failed when that pod's process ended (at SIGTERM or SIGKILL) with the connections still open: the application closed no connection before exiting",
                exited.join(", ")
            ));
        }
    }
    if causes.is_empty() {
        let kinds: Vec<&str> = records.iter().map(|r| r.outcome.as_str()).collect();
        causes.push(format!(
            "no cause found in the timeline ({}); possibly machine noise",
            kinds.first().copied().unwrap_or("?")
        ));
    }
    causes.join("; ")
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
    let Some(node) = r.drain.and_then(|d| r.nodes.get(d.node.wrapping_sub(1))) else {
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
                    && e.detail.contains("fails")
            })
            .map(|e| e.t_ms);
        let why = match failing_since {
            None => format!(
                "its /healthz (10256) kept answering 200 for the {:.1} s from the ToBeDeletedByClusterAutoscaler taint to the deletion: with pre-KEP-3836 behaviour the taint does not affect /healthz, so the load balancer learned of the node only when it stopped answering",
                nominal(r, deleted - tainted)
            ),
            Some(t) => format!(
                "its /healthz had answered 503 (the taint) from {:.1} s, but the node was deleted {:.1} s after the taint, before the load balancer's detection window ({:.1} s) ran out",
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

/// The run's anomalies, in time order: every `LabLate` event, and every probe round in
/// which all nodes (two or more) turned from passing to failing their health check.
/// Probes of one round are sent together and answered within the probe timeout, so
/// answers within one interval of each other belong to one round.
pub fn anomalies(r: &RunResult) -> Vec<Anomaly> {
    let mut out: Vec<Anomaly> = r
        .events
        .iter()
        .filter(|e| e.kind == EventKind::LabLate)
        .map(|e| Anomaly {
            at_s: nominal(r, e.t_ms),
            what: match (&e.node, &e.pod) {
                (Some(n), Some(p)) => format!("{p} on {n}: {}", e.detail),
                _ => e.detail.clone(),
            },
        })
        .collect();
    let round_ms = r.health_check.interval_seconds * 1000.0 * r.time_scale;
    let mut passing: BTreeMap<&str, bool> = BTreeMap::new();
    // (time, node) of each passes → fails turn.
    let mut turns: Vec<(f64, &str)> = Vec::new();
    for e in r
        .events
        .iter()
        .filter(|e| e.kind == EventKind::HealthAnswer)
    {
        let Some(node) = e.node.as_deref() else {
            continue;
        };
        let passes = e.detail.contains("passes");
        if !passes && passing.get(node) == Some(&true) {
            turns.push((e.t_ms, node));
        }
        passing.insert(node, passes);
    }
    let mut i = 0;
    while i < turns.len() {
        let start = turns[i].0;
        let round: Vec<&(f64, &str)> = turns[i..]
            .iter()
            .take_while(|(t, _)| *t - start < round_ms)
            .collect();
        let mut nodes: Vec<&str> = round.iter().map(|(_, n)| *n).collect();
        nodes.sort();
        nodes.dedup();
        if r.nodes.len() >= 2 && nodes.len() == r.nodes.len() {
            let hc = &r.health_check;
            out.push(Anomaly {
                at_s: nominal(r, start),
                what: format!(
                    "all {} nodes failed the LB's health check in the same probe round, each after passing: a cause on one node does not hit every node at once; the probes timed out together (after {} ms real), so the lab machine (the LB's runtime or the CPU) was too busy to answer in time",
                    nodes.len(),
                    hc.real_probe_timeout(r.time_scale).as_millis()
                ),
            });
        }
        i += round.len();
    }
    out.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
    out
}

/// Nodes in an `LbPool` event's pool that are healthy (0 when the LB fell back to
/// all nodes because none was).
fn healthy_in_pool(detail: &str) -> Option<usize> {
    if detail.starts_with("no healthy node") {
        return Some(0);
    }
    let list = detail.strip_prefix("new connections to ")?;
    Some(list.split(", ").filter(|s| !s.is_empty()).count())
}

/// The fewest healthy nodes the LB had in its pool between rollout start and end.
pub fn min_pool_during_rollout(r: &RunResult) -> Option<usize> {
    let mut current = None;
    let mut min: Option<usize> = None;
    for e in r.events.iter().filter(|e| e.kind == EventKind::LbPool) {
        let Some(n) = healthy_in_pool(&e.detail) else {
            continue;
        };
        if e.t_ms <= r.rollout_start_ms {
            current = Some(n);
            continue;
        }
        if e.t_ms > r.rollout_end_ms {
            break;
        }
        if min.is_none() {
            min = current;
        }
        min = Some(min.map_or(n, |m| m.min(n)));
    }
    min.or(current)
}

pub fn summarize(r: &RunResult) -> Summary {
    let sent = r.records.len();
    let ok = r
        .records
        .iter()
        .filter(|x| x.outcome == Outcome::Ok)
        .count();
    let mut by_kind = BTreeMap::new();
    let (mut before, mut during, mut after) = (0, 0, 0);
    for x in r.records.iter().filter(|x| !x.outcome.is_ok()) {
        *by_kind.entry(x.outcome.as_str().to_string()).or_insert(0) += 1;
        if x.start_ms < r.rollout_start_ms {
            before += 1;
        } else if x.start_ms <= r.rollout_end_ms {
            during += 1;
        } else {
            after += 1;
        }
    }
    let anomalies = anomalies(r);
    let bursts = bursts_of(&r.records, r.time_scale, 1.0)
        .into_iter()
        .map(|(s, e, v)| {
            let mut kinds = BTreeMap::new();
            for x in &v {
                *kinds.entry(x.outcome.as_str().to_string()).or_insert(0) += 1;
            }
            let (start_s, end_s) = (nominal(r, s), nominal(r, e));
            let mut cause = explain_burst(r, s, e, &v);
            // An anomaly up to one probe interval before the burst, or inside it, is
            // named with it: a late lab stretches every timing the cause depends on.
            let near: Vec<String> = anomalies
                .iter()
                .filter(|a| {
                    a.at_s >= start_s - r.health_check.interval_seconds.max(1.0) && a.at_s <= end_s
                })
                .map(|a| format!("at {:.2} s {}", a.at_s, a.what))
                .collect();
            if !near.is_empty() {
                let _ = write!(
                    cause,
                    "; the run shows an anomaly then: {}",
                    near.join("; ")
                );
            }
            Burst {
                start_s,
                end_s,
                failed: v.len(),
                kinds,
                cause,
            }
        })
        .collect();
    Summary {
        behaviour: r.behaviour.as_str().to_string(),
        control_plane: r.control_plane.as_str().to_string(),
        run: r.run + 1,
        sent,
        ok,
        failed: sent - ok,
        failed_by_kind: by_kind,
        longest_outage_s: nominal(r, longest_outage_ms(&r.records)),
        failed_before_rollout: before,
        failed_during_rollout: during,
        failed_after_rollout: after,
        bursts,
        anomalies,
    }
}

fn event_line(r: &RunResult, e: &Event) -> String {
    let who = match (&e.node, &e.pod) {
        (Some(n), Some(p)) => format!("{n} {p}"),
        (Some(n), None) => n.clone(),
        (None, Some(p)) => p.clone(),
        (None, None) => String::new(),
    };
    let kind = serde_json::to_value(&e.kind)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default();
    format!(
        "{:>8.2}s  {:<18} {:<20} {}",
        nominal(r, e.t_ms),
        kind,
        who,
        e.detail
    )
}

/// Events worth a line in the text timeline (kproxy syncs are many: only failures).
fn shown_in_timeline(e: &Event) -> bool {
    !matches!(
        e.kind,
        EventKind::KproxySynced | EventKind::Note | EventKind::SlicePublished
    )
}

/// The text report for a set of runs.
pub fn render_text(runs: &[RunResult], timeline: bool) -> String {
    let mut s = String::new();
    let sums: Vec<Summary> = runs.iter().map(summarize).collect();
    let w = sums
        .iter()
        .map(|m| label(m).len())
        .max()
        .unwrap_or(0)
        .max(9);
    let _ = writeln!(
        s,
        "\nSummary (times are nominal: real time / time scale {}; they count from the start of each run, the cluster's set-up, as the HTML report's axis does)",
        runs.first().map(|r| r.time_scale).unwrap_or(1.0)
    );
    let _ = writeln!(
        s,
        "{:<w$} {:>3} {:>7} {:>7} {:>7} {:>8} {:>6} {:>8} {:>6} {:>12}  {:>8} {:>8} {:>8}",
        "behaviour",
        "run",
        "sent",
        "ok",
        "failed",
        "refused",
        "reset",
        "timeout",
        "other",
        "longest out",
        "before",
        "rollout",
        "after"
    );
    for m in &sums {
        let k = |n: &str| m.failed_by_kind.get(n).copied().unwrap_or(0);
        let other = m.failed - k("refused") - k("reset") - k("timeout");
        let _ = writeln!(
            s,
            "{:<w$} {:>3} {:>7} {:>7} {:>7} {:>8} {:>6} {:>8} {:>6} {:>11.1}s  {:>8} {:>8} {:>8}",
            label(m),
            m.run,
            m.sent,
            m.ok,
            m.failed,
            k("refused"),
            k("reset"),
            k("timeout"),
            other,
            m.longest_outage_s,
            m.failed_before_rollout,
            m.failed_during_rollout,
            m.failed_after_rollout
        );
    }
    // Distribution per behaviour when there are several runs.
    let mut per: BTreeMap<String, Vec<&Summary>> = BTreeMap::new();
    for m in &sums {
        per.entry(label(m)).or_default().push(m);
    }
    if runs.len() > per.len() {
        let _ = writeln!(s);
        for (b, v) in &per {
            let total: usize = v.iter().map(|m| m.failed).sum();
            let sent: usize = v.iter().map(|m| m.sent).sum();
            let worst = v
                .iter()
                .max_by_key(|m| m.failed)
                .map(|m| (m.run, m.failed))
                .unwrap_or((0, 0));
            let with_loss = v.iter().filter(|m| m.failed > 0).count();
            let slowest = runs
                .iter()
                .filter(|r| label_of(r.behaviour.as_str(), r.control_plane.as_str()) == *b)
                .map(|r| {
                    (
                        r.run + 1,
                        (r.rollout_end_ms - r.rollout_start_ms) / 1000.0 / r.time_scale,
                    )
                })
                .max_by(|a, b| a.1.total_cmp(&b.1))
                .unwrap_or((0, 0.0));
            let _ = writeln!(
                s,
                "{b}: {} runs, {total} of {sent} requests failed in total; runs with loss: {with_loss}; worst run: #{} with {} failed; slowest rollout: #{} in {:.1} s",
                v.len(),
                worst.0,
                worst.1,
                slowest.0,
                slowest.1
            );
        }
    }
    for (r, m) in runs.iter().zip(&sums) {
        let _ = writeln!(
            s,
            "\n== {} run {}: {} failure burst(s); load from {:.2}s, {} {:.2}s..{:.2}s",
            label(m),
            m.run,
            m.bursts.len(),
            nominal(r, r.load_start_ms),
            if r.drain.is_some() {
                "node drain"
            } else {
                "rollout"
            },
            nominal(r, r.rollout_start_ms),
            nominal(r, r.rollout_end_ms)
        );
        for b in &m.bursts {
            let kinds: Vec<String> = b.kinds.iter().map(|(k, n)| format!("{n} {k}")).collect();
            let _ = writeln!(
                s,
                "  {:>7.2}s..{:>7.2}s  {} failed ({}): {}",
                b.start_s,
                b.end_s,
                b.failed,
                kinds.join(", "),
                b.cause
            );
        }
        for a in &m.anomalies {
            let _ = writeln!(s, "  anomaly at {:>7.2}s: {}", a.at_s, a.what);
        }
        if timeline {
            let _ = writeln!(s, "  timeline:");
            for e in r.events.iter().filter(|e| shown_in_timeline(e)) {
                let _ = writeln!(s, "  {}", event_line(r, e));
            }
            let syncs = r
                .events
                .iter()
                .filter(|e| e.kind == EventKind::KproxySynced)
                .count();
            let _ = writeln!(
                s,
                "  ({syncs} kproxy syncs across nodes, in the JSON output)"
            );
        }
    }
    s
}

/// The JSON document: `{"runs": [{"behaviour", "sent", "ok", "failed", ...}], "html"}`.
/// Times (`*_s`) are nominal seconds since the run started, as in the text report.
pub fn render_json(
    runs: &[RunResult],
    config: &crate::config::RolloutConfig,
    html: Option<&std::path::Path>,
) -> Value {
    let rs: Vec<Value> = runs
        .iter()
        .map(|r| {
            let m = summarize(r);
            let mut v = serde_json::to_value(&m).unwrap_or(Value::Null);
            if let Some(o) = v.as_object_mut() {
                o.insert("time_scale".into(), json!(r.time_scale));
                o.insert("load_start_s".into(), json!(nominal(r, r.load_start_ms)));
                o.insert(
                    "rollout_start_s".into(),
                    json!(nominal(r, r.rollout_start_ms)),
                );
                o.insert("rollout_end_s".into(), json!(nominal(r, r.rollout_end_ms)));
                o.insert(
                    "events".into(),
                    Value::Array(
                        r.events
                            .iter()
                            .map(|e| {
                                let mut ev = serde_json::to_value(e).unwrap_or(Value::Null);
                                if let Some(eo) = ev.as_object_mut() {
                                    eo.insert("t_s".into(), json!(nominal(r, e.t_ms)));
                                }
                                ev
                            })
                            .collect(),
                    ),
                );
                o.insert(
                    "records".into(),
                    serde_json::to_value(&r.records).unwrap_or(Value::Null),
                );
            }
            v
        })
        .collect();
    let comparison: Vec<Value> = crate::compare::pairs(runs)
        .into_iter()
        .map(|(e, k)| {
            json!({
                "behaviour": e.behaviour.as_str(),
                "run": e.run + 1,
                "rows": crate::compare::align(&crate::compare::milestones(e), &crate::compare::milestones(k)),
            })
        })
        .collect();
    let html = html.map(|p| p.display().to_string());
    json!({"runs": rs, "config": config, "html": html, "comparison": comparison})
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loadgen::ConnKind;

    fn rec(start: f64, outcome: Outcome) -> RequestRecord {
        RequestRecord {
            start_ms: start,
            end_ms: start + 1.0,
            outcome,
            conn: ConnKind::New,
            pod: None,
            reused: false,
            conn_pod: None,
        }
    }

    #[test]
    fn bursts_split_on_gaps() {
        let rs = vec![
            rec(0.0, Outcome::Ok),
            rec(10.0, Outcome::Timeout),
            rec(20.0, Outcome::Timeout),
            rec(500.0, Outcome::Refused),
        ];
        // scale 0.1, gap 1 s nominal = 100 ms real
        let b = bursts_of(&rs, 0.1, 1.0);
        assert_eq!(b.len(), 2);
        assert_eq!(b[0].2.len(), 2);
        assert_eq!(b[1].2.len(), 1);
    }

    /// A three-node run at time scale 0.1 with the gke health check (3 s interval:
    /// 300 ms real) and `events`.
    fn three_nodes(events: Vec<Event>, records: Vec<RequestRecord>) -> RunResult {
        RunResult {
            control_plane: crate::scenario::ControlPlaneKind::Emulated,
            behaviour: crate::scenario::Behaviour::Kproxy,
            run: 0,
            time_scale: 0.1,
            nodes: vec!["node-1".into(), "node-2".into(), "node-3".into()],
            health_check: crate::lb::LbPreset::Gke.health_check().unwrap(),
            records,
            events,
            load_start_ms: 0.0,
            rollout_start_ms: 0.0,
            rollout_end_ms: 6000.0,
            load_end_ms: 6000.0,
            drain: None,
        }
    }

    fn answer(t_ms: f64, node: &str, passes: bool) -> Event {
        Event {
            t_ms,
            kind: EventKind::HealthAnswer,
            node: Some(node.into()),
            pod: None,
            detail: if passes {
                "health check passes"
            } else {
                "health check fails"
            }
            .into(),
        }
    }

    /// Every node failing in one probe round after passing is an anomaly; every node
    /// failing its first probes (nothing ready yet), or one node failing, is not.
    #[test]
    fn all_nodes_failing_one_round_after_passing_is_an_anomaly() {
        let nodes = ["node-1", "node-2", "node-3"];
        let mut events: Vec<Event> = nodes.iter().map(|n| answer(10.0, n, false)).collect();
        events.extend(nodes.iter().map(|n| answer(400.0, n, true)));
        // One node fails alone: a node's own story, not an anomaly.
        events.push(answer(1000.0, "node-2", false));
        events.push(answer(1300.0, "node-2", true));
        // All three fail in the same round (answers recorded a few ms apart).
        events.extend(
            nodes
                .iter()
                .enumerate()
                .map(|(i, n)| answer(2000.0 + i as f64 * 20.0, n, false)),
        );
        let got = anomalies(&three_nodes(events, vec![]));
        assert_eq!(got.len(), 1, "{got:?}");
        assert!((got[0].at_s - 20.0).abs() < 1e-9, "{got:?}");
        assert!(got[0].what.contains("all 3 nodes"), "{got:?}");
        assert!(got[0].what.contains("150 ms real"), "{got:?}");
    }

    /// The lab's own lateness (a preStop longer than configured) is an anomaly, and a
    /// burst beside it names it in its cause.
    #[test]
    fn a_late_lab_is_an_anomaly_named_in_the_burst_beside_it() {
        let late = Event {
            t_ms: 3000.0,
            kind: EventKind::LabLate,
            node: Some("node-1".into()),
            pod: Some("web-r1-1".into()),
            detail: "preStop lasted 21.0 s, 10.0 s configured: the lab's timer fired 11.0 s late"
                .into(),
        };
        let r = three_nodes(
            vec![late],
            vec![rec(0.0, Outcome::Ok), rec(3100.0, Outcome::Timeout)],
        );
        let m = summarize(&r);
        assert_eq!(m.anomalies.len(), 1, "{:?}", m.anomalies);
        assert!(
            m.anomalies[0]
                .what
                .starts_with("web-r1-1 on node-1: preStop lasted 21.0 s"),
            "{:?}",
            m.anomalies
        );
        assert_eq!(m.bursts.len(), 1);
        assert!(
            m.bursts[0]
                .cause
                .contains("anomaly then: at 30.00 s web-r1-1"),
            "{}",
            m.bursts[0].cause
        );
        let text = render_text(std::slice::from_ref(&r), false);
        assert!(text.contains("anomaly at   30.00s: web-r1-1"), "{text}");
    }

    #[test]
    fn longest_outage_ends_at_a_success() {
        let rs = vec![
            rec(0.0, Outcome::Timeout),
            rec(100.0, Outcome::Timeout),
            rec(150.0, Outcome::Ok),
            rec(200.0, Outcome::Reset),
        ];
        assert_eq!(longest_outage_ms(&rs), 100.0);
    }

    #[test]
    fn keep_alive_failures_after_a_pod_exit_are_explained() {
        use crate::scenario::{Behaviour, RunResult};
        let mut failed = rec(1000.0, Outcome::Reset);
        failed.conn = ConnKind::KeepAlive;
        failed.conn_pod = Some("web-r1-1".into());
        let r = RunResult {
            control_plane: crate::scenario::ControlPlaneKind::Emulated,
            behaviour: Behaviour::Kproxy,
            run: 0,
            time_scale: 0.1,
            nodes: vec!["node-1".into()],
            health_check: crate::lb::LbPreset::Gke.health_check().unwrap(),
            records: vec![rec(0.0, Outcome::Ok), failed.clone()],
            events: vec![
                Event {
                    t_ms: 1.0,
                    kind: EventKind::PodCreated,
                    node: Some("node-1".into()),
                    pod: Some("web-r2-1".into()),
                    detail: String::new(),
                },
                Event {
                    t_ms: 2.0,
                    kind: EventKind::PodReady,
                    node: Some("node-1".into()),
                    pod: Some("web-r2-1".into()),
                    detail: String::new(),
                },
                Event {
                    t_ms: 1001.0,
                    kind: EventKind::PodExited,
                    node: Some("node-1".into()),
                    pod: Some("web-r1-1".into()),
                    detail: "process exited".into(),
                },
            ],
            load_start_ms: 0.0,
            rollout_start_ms: 0.0,
            rollout_end_ms: 2000.0,
            load_end_ms: 2000.0,
            drain: None,
        };
        let cause = explain_burst(&r, 1000.0, 1000.0, &[&failed]);
        assert!(
            cause.contains("keep-alive connections to web-r1-1"),
            "{cause}"
        );
    }

    /// The node-drain row's causes: new connections to a deleted node the LB still had
    /// in its pool (and whether /healthz had failed since the taint), and requests on
    /// keep-alive connections established through it.
    #[test]
    fn drain_bursts_name_the_deleted_node_and_the_health_story() {
        use crate::scenario::{Behaviour, NodeDrain, RunResult};
        let ev = |t_ms: f64, kind: EventKind, node: Option<&str>, detail: &str| Event {
            t_ms,
            kind,
            node: node.map(Into::into),
            pod: None,
            detail: detail.into(),
        };
        let mut kept = rec(4010.0, Outcome::Timeout);
        kept.conn = ConnKind::KeepAlive;
        kept.reused = true;
        let new = rec(4050.0, Outcome::Timeout);
        let all = "new connections to node-1, node-2, node-3";
        let without = "new connections to node-1, node-3";
        let run = |events: Vec<Event>| RunResult {
            control_plane: crate::scenario::ControlPlaneKind::Emulated,
            behaviour: Behaviour::Pre126,
            run: 0,
            time_scale: 0.1,
            nodes: vec!["node-1".into(), "node-2".into(), "node-3".into()],
            health_check: crate::lb::LbPreset::Gke.health_check().unwrap(),
            records: vec![kept.clone(), new.clone()],
            events,
            load_start_ms: 0.0,
            rollout_start_ms: 1000.0,
            rollout_end_ms: 5000.0,
            load_end_ms: 6000.0,
            drain: Some(NodeDrain {
                node: 2,
                delete_after_s: 3.0,
            }),
        };
        // pre-KEP-3836: /healthz kept passing until the node vanished.
        let r = run(vec![
            ev(10.0, EventKind::LbPool, None, all),
            ev(1000.0, EventKind::NodeTainted, Some("node-2"), ""),
            ev(4000.0, EventKind::NodeDeleted, Some("node-2"), ""),
            ev(
                4300.0,
                EventKind::HealthAnswer,
                Some("node-2"),
                "health check fails",
            ),
            ev(4600.0, EventKind::LbPool, None, without),
        ]);
        let cause = explain_burst(&r, 4010.0, 4050.0, &[&kept, &new]);
        assert!(cause.contains("node-2 was deleted at 40.0 s"), "{cause}");
        assert!(
            cause.contains("until it took node-2 out at 46.0 s"),
            "{cause}"
        );
        assert!(
            cause.contains("kept answering 200 for the 30.0 s"),
            "{cause}"
        );
        assert!(
            cause.contains("1 request(s) on keep-alive connections"),
            "{cause}"
        );
        assert!(!cause.contains("had no pod"), "no eTP-Local cause: {cause}");
        // KEP-3836 and a node deleted within the LB's detection window.
        let r = run(vec![
            ev(10.0, EventKind::LbPool, None, all),
            ev(1000.0, EventKind::NodeTainted, Some("node-2"), ""),
            ev(
                1300.0,
                EventKind::HealthAnswer,
                Some("node-2"),
                "health check fails",
            ),
            ev(1500.0, EventKind::NodeDeleted, Some("node-2"), ""),
            ev(1900.0, EventKind::LbPool, None, without),
        ]);
        let cause = explain_burst(&r, 1510.0, 1550.0, &[&new]);
        assert!(
            cause.contains("answered 503 (the taint) from 13.0 s"),
            "{cause}"
        );
        assert!(cause.contains("deleted 5.0 s after the taint"), "{cause}");
        // A burst well before the deletion is not the deletion's.
        let cause = explain_burst(&r, 100.0, 120.0, &[&new]);
        assert!(!cause.contains("was deleted"), "{cause}");
    }

    /// A burst on a node whose last pod's termination the EndpointSlice controller never
    /// published is the controller's; one in a flush's window is the flush's.
    #[test]
    fn unpublished_terminations_and_flushes_are_named() {
        use crate::scenario::{Behaviour, RunResult};
        let ev =
            |t_ms: f64, kind: EventKind, node: Option<&str>, pod: Option<&str>, detail: &str| {
                Event {
                    t_ms,
                    kind,
                    node: node.map(Into::into),
                    pod: pod.map(Into::into),
                    detail: detail.into(),
                }
            };
        let new = rec(1500.0, Outcome::Timeout);
        let run = |events: Vec<Event>| RunResult {
            control_plane: crate::scenario::ControlPlaneKind::K8sLab,
            behaviour: Behaviour::Kproxy,
            run: 0,
            time_scale: 0.1,
            nodes: vec!["node-1".into(), "node-2".into()],
            health_check: crate::lb::LbPreset::Gke.health_check().unwrap(),
            records: vec![new.clone()],
            events,
            load_start_ms: 0.0,
            rollout_start_ms: 100.0,
            rollout_end_ms: 3000.0,
            load_end_ms: 3000.0,
            drain: None,
        };
        let pod = |t: f64, kind: EventKind| ev(t, kind, Some("node-2"), Some("web-1"), "");
        let pods = vec![
            pod(10.0, EventKind::PodCreated),
            pod(20.0, EventKind::PodReady),
            ev(
                30.0,
                EventKind::SlicePublished,
                None,
                None,
                "web-1@node-2:RS-",
            ),
            pod(1000.0, EventKind::PodTerminating),
            pod(1400.0, EventKind::PodSigterm),
        ];
        let cause = explain_burst(&run(pods.clone()), 1500.0, 1500.0, &[&new]);
        assert!(
            cause.contains("no EndpointSlice change had shown web-1 terminating"),
            "{cause}"
        );
        let mut published = pods.clone();
        published.push(ev(
            1010.0,
            EventKind::SlicePublished,
            None,
            None,
            "web-1@node-2:-ST",
        ));
        let cause = explain_burst(&run(published), 1500.0, 1500.0, &[&new]);
        assert!(!cause.contains("no EndpointSlice change"), "{cause}");
        assert!(cause.contains("preStop ended"), "{cause}");

        let mut flushed = pods;
        flushed.extend([
            ev(
                1010.0,
                EventKind::SlicePublished,
                None,
                None,
                "web-1@node-2:-ST",
            ),
            ev(
                1490.0,
                EventKind::RulesetFlushed,
                Some("node-2"),
                None,
                "nft flush ruleset",
            ),
            ev(
                1520.0,
                EventKind::Note,
                Some("node-2"),
                None,
                "kproxy kernel_repaired {}",
            ),
        ]);
        let cause = explain_burst(&run(flushed.clone()), 1500.0, 1500.0, &[&new]);
        assert!(
            cause.contains(
                "flushed node-2's nftables ruleset at 14.90 s and kproxy restored them 30 ms after"
            ),
            "{cause}"
        );
        assert!(
            !cause.contains("preStop"),
            "the flush's node is explained by it: {cause}"
        );
        // Long after the repair, the flush is no cause.
        let cause = explain_burst(&run(flushed), 2500.0, 2500.0, &[&new]);
        assert!(!cause.contains("flushed"), "{cause}");
    }

    #[test]
    fn pool_sizes_from_events() {
        assert_eq!(
            healthy_in_pool("new connections to node-1, node-3"),
            Some(2)
        );
        assert_eq!(
            healthy_in_pool("no healthy node: new connections to all (node-1, node-2)"),
            Some(0)
        );
        assert_eq!(healthy_in_pool("pool update failed: x"), None);
    }

    #[test]
    fn pool_detail_parsing() {
        assert!(pool_contains("new connections to node-1, node-3", "node-3"));
        assert!(!pool_contains(
            "new connections to node-1, node-3",
            "node-2"
        ));
        assert!(!pool_contains("new connections to node-10", "node-1"));
    }
}
