use super::*;

/// Fails `backoff` `n` times in a row without waiting (virtual time stands still
/// while it sleeps in a task of its own): its next delay is then base·2ⁿ or more.
fn failed_before(backoff: &mut Backoff, n: u32) {
    backoff.failures = n;
    backoff.since = Some(Instant::now());
}

/// After an outage every reflector of the API server is backing off; the first to
/// be answered again brings the others back at that moment, not at the end of their
/// own (longer) backoff. Virtual time: the instants are exact.
#[tokio::test(start_paused = true)]
async fn a_sibling_answered_again_cuts_the_backoff_short() {
    let siblings = Siblings::new();
    let mut services = Backoff::among(&siblings);
    let mut slices = Backoff::among(&siblings);
    failed_before(&mut services, 0);
    failed_before(&mut slices, 4);
    slices.attempt();
    let start = Instant::now();
    let waiting = tokio::spawn(async move {
        slices
            .failed(Kind::EndpointSlice, "watch", "connection refused")
            .await;
        Instant::now()
    });
    services.attempt();
    services
        .failed(Kind::Service, "watch", "connection refused")
        .await;
    services.attempt();
    services.succeeded(Kind::Service);
    let answered = Instant::now();
    let woke = waiting.await.expect("the slices' backoff ends");
    assert_eq!(
        woke, answered,
        "the slices retry when the services are answered"
    );
    assert!(
        woke - start < Backoff::delay(5, 0.0),
        "{:?} is the slices' own backoff",
        woke - start
    );
    // Its own return cuts no backoff of its own.
    services.attempt();
    let before = Instant::now();
    services.failed(Kind::Service, "watch", "refused").await;
    assert!(Instant::now() - before >= Backoff::delay(1, 0.0));
}

/// A sibling answered while this reflector's request was out: its failure is not
/// waited out (the API is back); answers before the request went out do not count.
#[tokio::test(start_paused = true)]
async fn an_answer_during_a_failing_attempt_retries_at_once() {
    let siblings = Siblings::new();
    let mut node = Backoff::among(&siblings);
    let mut services = Backoff::among(&siblings);
    failed_before(&mut services, 2);
    services.succeeded(Kind::Service);
    // Before the node's attempt: waited out.
    node.attempt();
    let before = Instant::now();
    node.failed(Kind::Node, "list", "refused").await;
    assert!(Instant::now() - before >= Backoff::delay(1, 0.0));
    // During it: not.
    node.attempt();
    failed_before(&mut services, 2);
    services.succeeded(Kind::Service);
    let before = Instant::now();
    node.failed(Kind::Node, "list", "refused").await;
    assert_eq!(Instant::now(), before);
    // A reflector of its own waits its backoff out.
    let mut alone = Backoff::new();
    failed_before(&mut alone, 3);
    alone.attempt();
    let before = Instant::now();
    alone.failed(Kind::Node, "list", "refused").await;
    assert!(Instant::now() - before >= Backoff::delay(4, 0.0));
}

#[test]
fn retry_after_is_seconds_and_garbage_is_none() {
    for (value, expect) in [
        ("1", Some(1)),
        (" 7 ", Some(7)),
        ("0", Some(0)),
        ("3600", Some(3600)),
        ("1000000000", Some(1_000_000_000)),
        ("Wed, 21 Oct 2026 07:28:00 GMT", None),
        ("-1", None),
        ("", None),
    ] {
        assert_eq!(
            retry_after(value),
            expect.map(Duration::from_secs),
            "{value:?}"
        );
    }
}

/// One `Retry-After: 120` held a change 119 s, `3600` past 140 s, `1000000000`
/// for good (kube's retry layer slept it as given). Every server-given delay is now
/// at least what was asked and up to twice that, never over the cap; one over the
/// cap is spread over its last quarter, so a fleet told the same does not return
/// in the same second.
#[test]
fn a_server_given_delay_is_capped_and_jittered() {
    let s = Duration::from_secs;
    for (asked, jitter, want) in [
        (s(5), 0.0, s(5)),
        (s(5), 0.5, Duration::from_millis(7500)),
        (s(40), 0.5, s(50)),
        (s(40), 1.0, s(60)),
        (s(60), 0.0, s(45)),
        (s(120), 0.0, s(45)),
        (s(120), 1.0, s(60)),
        (s(3600), 0.5, Duration::from_millis(52_500)),
        (s(1_000_000_000), 0.99, Duration::from_millis(59_850)),
        (s(u64::MAX), 0.5, Duration::from_millis(52_500)),
    ] {
        assert_eq!(server_delay(asked, jitter), want, "{asked:?} {jitter}");
    }
    for failures in [1, 5, 30] {
        for jitter in [0.0, 0.5, 0.999] {
            let d = Backoff::throttled_delay(failures, Some(s(u64::MAX)), jitter);
            assert!(d <= MAX_SERVER_DELAY, "{d:?}");
        }
    }
}

/// A warning that can repeat per event is one line per interval, each saying how
/// many it stands for (one WARN per malformed event was 2 M lines in 22 s).
#[tokio::test(start_paused = true)]
async fn repeated_warnings_are_one_line_per_interval() {
    let mut quiet = Quiet::default();
    let start = Instant::now();
    let logged: Vec<u64> = (0..200_000u32)
        .filter_map(|i| quiet.note(start + Duration::from_micros(u64::from(i) * 100)))
        .collect();
    // 20 s of events, one every 100 µs: the first line, and one per interval after.
    assert_eq!(logged, [0, 99_999]);
    assert_eq!(quiet.note(start + Duration::from_secs(30)), Some(99_999));
    assert_eq!(quiet.note(start + Duration::from_secs(40)), Some(0));
}

/// A refusal for load waits at least what the server asked for, spread over up to
/// twice that by the jitter, and never less than the failure backoff.
#[test]
fn a_throttled_request_waits_what_the_server_asked_spread_by_the_jitter() {
    let asked = Some(Duration::from_secs(5));
    assert_eq!(
        Backoff::throttled_delay(1, asked, 0.0),
        Duration::from_secs(5)
    );
    assert_eq!(
        Backoff::throttled_delay(1, asked, 0.5),
        Duration::from_millis(7500)
    );
    // A short Retry-After after many refusals: what the server asked, not the
    // grown backoff (kproxy's own retry was three times slower back than kube's
    // after a restart of 200 nodes for that).
    assert_eq!(
        Backoff::throttled_delay(10, Some(Duration::from_secs(1)), 0.0),
        Duration::from_secs(1)
    );
    assert_eq!(
        Backoff::throttled_delay(1, None, 0.0),
        Backoff::delay(1, 0.0)
    );
}

/// JSON watch lines cut anywhere by the chunks give the same events; blank lines
/// and malformed ones are skipped.
#[test]
fn json_watch_lines_cut_anywhere_give_the_same_events() {
    let body = b"{\"type\":\"ADDED\",\"object\":{\"a\":1}}\n\n garbage\n{\"type\":\"BOOKMARK\",\"object\":{}}\n";
    let decoder = Decoder::new(Ownership::default(), "n".into());
    for cut in 0..body.len() {
        let mut stream = Stream::Json(Vec::new());
        let mut seen = Vec::new();
        for chunk in [&body[..cut], &body[cut..]] {
            stream
                .feed(&decoder, Kind::Service, chunk, |e| {
                    if let RawEvent::Json(e) = e {
                        seen.push((e.kind.to_string(), e.object.get().to_string()));
                    }
                    true
                })
                .unwrap();
        }
        assert_eq!(
            seen,
            [
                ("ADDED".to_string(), "{\"a\":1}".to_string()),
                ("BOOKMARK".to_string(), "{}".to_string())
            ],
            "cut at {cut}"
        );
    }
}

/// The JSON twin of the recorded streamed list: only its last event, the bookmark,
/// ends the initial events.
#[test]
fn the_json_bookmark_that_ends_the_initial_events() {
    let body = include_str!("../testdata/watch-initial-services.json");
    let ends: Vec<bool> = body
        .lines()
        .map(|l| {
            let e: Event<'_> = serde_json::from_str(l).unwrap();
            json_ends_initial_events(e.object.get())
        })
        .collect();
    assert!(ends.len() > 1);
    assert_eq!(ends.iter().filter(|e| **e).count(), 1);
    assert_eq!(ends.last(), Some(&true));
}

#[test]
fn a_broken_watch_resumes_at_once_only_when_it_had_been_running() {
    for (lasted_ms, at_once) in [(0, false), (999, false), (1000, true), (600_000, true)] {
        let stop = stream_broke("reset".into(), Duration::from_millis(lasted_ms));
        assert_eq!(
            matches!(stop, Stop::Broken(_)),
            at_once,
            "{lasted_ms} ms: {stop:?}"
        );
        assert_eq!(matches!(stop, Stop::Failed(_)), !at_once);
    }
}
