//! Time for the lab: one clock per run with a time scale (every nominal period is
//! multiplied by it before sleeping), and the event recorder every component writes
//! its timeline into. Times are stored in real milliseconds since the run started;
//! reports divide by the scale to show nominal time.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

#[derive(Clone, Debug)]
pub struct Clock {
    start: Instant,
    scale: f64,
}

impl Clock {
    pub fn new(scale: f64) -> Clock {
        Clock {
            start: Instant::now(),
            scale,
        }
    }
    pub fn scale(&self) -> f64 {
        self.scale
    }
    pub fn start(&self) -> Instant {
        self.start
    }
    /// The real duration of a nominal period given in seconds.
    pub fn real(&self, nominal_s: f64) -> Duration {
        Duration::from_secs_f64((nominal_s * self.scale).max(0.0))
    }
    /// Real milliseconds since the run started.
    pub fn now_ms(&self) -> f64 {
        self.start.elapsed().as_secs_f64() * 1000.0
    }
    /// Nominal seconds of a real timestamp in ms.
    pub fn nominal_s(&self, real_ms: f64) -> f64 {
        real_ms / 1000.0 / self.scale
    }
}

#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    PodCreated,
    PodReady,
    PodNotReady,
    /// The pod got a deletion timestamp (preStop starts).
    PodTerminating,
    PodSigterm,
    /// The process ended by itself after SIGTERM.
    PodExited,
    PodKilled,
    /// The control plane's EndpointSlice change reached the nodes' manifest dirs.
    SlicePublished,
    /// A node's health-check answer as seen by the load balancer changed.
    HealthAnswer,
    /// The load balancer's set of nodes for new connections changed.
    LbPool,
    /// The LB cut established flows of a node after its drain timeout.
    LbDrained,
    KproxySynced,
    KproxySyncFailed,
    /// The lab stopped a node's kproxy (SIGTERM) and started it again.
    KproxyRestarted,
    /// Another process flushed a node's whole nftables ruleset (`nft flush ruleset`).
    RulesetFlushed,
    /// The lab SIGKILLed a node's kproxy and started it again.
    KproxyKilled,
    /// The lab killed the API server (k8s-lab).
    ApiServerDown,
    /// The lab started the API server again.
    ApiServerUp,
    /// The lab reset every connection of a node's kproxy to the API server.
    ApiConnectionsCut,
    /// A node was told it is going (node drain): the cluster autoscaler's
    /// `ToBeDeletedByClusterAutoscaler` taint, or a KEP-5683 condition set "True".
    NodeTainted,
    /// A node's kproxy was stopped (SIGTERM) for a node shutdown, or exited after it.
    KproxyStopped,
    /// A drained node was deleted: its kproxy stopped, its link cut, its Node object
    /// removed.
    NodeDeleted,
    RolloutStarted,
    RolloutDone,
    LoadStarted,
    LoadStopped,
    /// The lab itself ran late: a timer of its runtime fired well after it was due
    /// (the machine or the runtime was busy), so every timing of the lab at that moment
    /// (probes, preStop, load) was late by as much. With a pod: that pod's preStop
    /// lasted longer than configured.
    LabLate,
    Note,
}

/// Real lateness of a lab timer worth an event: well above a timer's ordinary jitter,
/// and below the LB's 150 ms floor on a probe's timeout (lb.rs), so a stall that fails
/// probes is on the timeline.
pub const LATE: Duration = Duration::from_millis(100);

/// Watches the lab's runtime for stalls while it lives: a task that wakes every 50 ms
/// (real) and records [`EventKind::LabLate`] when it wakes [`LATE`] or more after it
/// was due. Dropped (end of the run), it stops.
pub struct LatenessWatch(tokio::task::JoinHandle<()>);

impl LatenessWatch {
    /// Starts the watch on the current tokio runtime.
    pub fn start(recorder: Recorder) -> LatenessWatch {
        LatenessWatch(tokio::spawn(async move {
            let tick = Duration::from_millis(50);
            loop {
                let due = tokio::time::Instant::now() + tick;
                tokio::time::sleep_until(due).await;
                let late = due.elapsed();
                if late >= LATE {
                    let clock = recorder.clock();
                    recorder.record(
                        EventKind::LabLate,
                        None,
                        None,
                        format!(
                            "the lab's runtime woke {:.1} s late ({} ms real): every lab timer then (LB probes, preStop, load) was late as much; the machine was busy",
                            clock.nominal_s(late.as_secs_f64() * 1000.0),
                            late.as_millis()
                        ),
                    );
                }
            }
        }))
    }
}

impl Drop for LatenessWatch {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Event {
    /// Real ms since the run started.
    pub t_ms: f64,
    pub kind: EventKind,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    pub detail: String,
}

#[derive(Clone, Debug)]
pub struct Recorder {
    clock: Clock,
    events: Arc<Mutex<Vec<Event>>>,
}

impl Recorder {
    pub fn new(clock: Clock) -> Recorder {
        Recorder {
            clock,
            events: Arc::new(Mutex::new(Vec::new())),
        }
    }
    pub fn clock(&self) -> &Clock {
        &self.clock
    }
    pub fn record(
        &self,
        kind: EventKind,
        node: Option<&str>,
        pod: Option<&str>,
        detail: impl Into<String>,
    ) {
        self.record_at(self.clock.now_ms(), kind, node, pod, detail)
    }
    pub fn record_at(
        &self,
        t_ms: f64,
        kind: EventKind,
        node: Option<&str>,
        pod: Option<&str>,
        detail: impl Into<String>,
    ) {
        let e = Event {
            t_ms,
            kind,
            node: node.map(str::to_string),
            pod: pod.map(str::to_string),
            detail: detail.into(),
        };
        self.events.lock().expect("event lock").push(e);
    }
    /// All events, sorted by time.
    pub fn events(&self) -> Vec<Event> {
        let mut v = self.events.lock().expect("event lock").clone();
        v.sort_by(|a, b| a.t_ms.total_cmp(&b.t_ms));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_applies_to_periods_and_back() {
        let c = Clock::new(0.1);
        assert_eq!(c.real(10.0), Duration::from_secs(1));
        assert!((c.nominal_s(1000.0) - 10.0).abs() < 1e-9);
    }

    /// A runtime blocked past [`LATE`] leaves a `LabLate` event.
    #[test]
    fn a_stalled_runtime_is_on_the_timeline() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let r = Recorder::new(Clock::new(0.1));
        rt.block_on(async {
            let _watch = LatenessWatch::start(r.clone());
            tokio::time::sleep(Duration::from_millis(60)).await;
            // Blocks the only worker: the watch's timer cannot fire on time.
            std::thread::sleep(LATE * 3);
            tokio::time::sleep(Duration::from_millis(60)).await;
        });
        let late: Vec<Event> = r
            .events()
            .into_iter()
            .filter(|e| e.kind == EventKind::LabLate)
            .collect();
        assert!(!late.is_empty(), "{:?}", r.events());
        assert!(late[0].detail.contains("late"), "{late:?}");
    }

    #[test]
    fn events_come_back_sorted() {
        let r = Recorder::new(Clock::new(1.0));
        r.record_at(5.0, EventKind::Note, None, None, "b");
        r.record_at(1.0, EventKind::Note, None, None, "a");
        let e = r.events();
        assert_eq!(e[0].detail, "a");
        assert_eq!(e[1].detail, "b");
    }
}
