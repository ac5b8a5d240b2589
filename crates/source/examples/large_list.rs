//! Loads one `kubectl get svc,endpointslices -A -o yaml|json` dump of N Services (each
//! with one EndpointSlice) through the manifest source and prints time and peak memory.
//!
//! ```sh
//! cargo run --release -p kproxy-source --example large_list -- 50000 yaml /tmp/d.yaml  # writes
//! cargo run --release -p kproxy-source --example large_list -- 50000 yaml /tmp/d.yaml  # loads
//! ```
//!
//! With a path that does not exist, the dump is written there and the program exits (so
//! generating it costs the measuring process nothing); with one that exists, it is loaded
//! and measured: wall time of `manifests::load`, and the process's peak RSS (VmHWM)
//! minus the RSS before loading. Without a path, both in one process (the peak is then
//! reset before loading, but memory the generator freed may still count).

#![expect(clippy::disallowed_types, reason = "a measurement: wall time")]

use std::io::Write;
use std::time::Instant;

use kproxy_core::ingest::Ownership;
use kproxy_source::manifests;

fn rss_kib(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn yaml_item(i: usize, out: &mut String) {
    let (a, b) = (i / 250, i % 250);
    out.push_str(&format!(
        "- apiVersion: v1\n  kind: Service\n  metadata:\n    creationTimestamp: \"2026-01-01T00:00:00Z\"\n    labels:\n      app: svc-{i}\n    name: svc-{i}\n    namespace: ns-{}\n    resourceVersion: \"{i}\"\n    uid: 00000000-0000-0000-0000-{i:012}\n  spec:\n    clusterIP: 10.96.{a}.{b}\n    clusterIPs:\n    - 10.96.{a}.{b}\n    internalTrafficPolicy: Cluster\n    ipFamilies:\n    - IPv4\n    ipFamilyPolicy: SingleStack\n    ports:\n    - name: http\n      port: 80\n      protocol: TCP\n      targetPort: 8080\n    selector:\n      app: svc-{i}\n    sessionAffinity: None\n    type: ClusterIP\n  status:\n    loadBalancer: {{}}\n- addressType: IPv4\n  apiVersion: discovery.k8s.io/v1\n  endpoints:\n  - addresses:\n    - 10.244.{a}.{b}\n    conditions:\n      ready: true\n      serving: true\n      terminating: false\n    nodeName: node-{}\n    targetRef:\n      kind: Pod\n      name: svc-{i}-pod\n      namespace: ns-{}\n  kind: EndpointSlice\n  metadata:\n    labels:\n      endpointslice.kubernetes.io/managed-by: endpointslice-controller.k8s.io\n      kubernetes.io/service-name: svc-{i}\n    name: svc-{i}-abcde\n    namespace: ns-{}\n  ports:\n  - name: http\n    port: 8080\n    protocol: TCP\n",
        i % 100,
        i % 10,
        i % 100,
        i % 100
    ));
}

fn main() {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(10_000);
    let format = args.next().unwrap_or_else(|| "yaml".into());
    let dir = tempfile::tempdir().expect("temp dir");
    let given = args.next().map(std::path::PathBuf::from);
    let path = given
        .clone()
        .unwrap_or_else(|| dir.path().join(format!("dump.{format}")));
    if !path.exists() {
        let mut text = String::from("apiVersion: v1\nitems:\n");
        for i in 0..n {
            yaml_item(i, &mut text);
        }
        text.push_str("kind: List\nmetadata:\n  resourceVersion: \"\"\n");
        let bytes = if format == "json" {
            let v: serde_json::Value = serde_saphyr_free_parse(&text);
            serde_json::to_vec_pretty(&v).expect("json")
        } else {
            text.into_bytes()
        };
        let mut f = std::fs::File::create(&path).expect("create");
        f.write_all(&bytes).expect("write");
        if given.is_some() {
            println!("wrote {}", path.display());
            return;
        }
    }
    let size = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
    // Reset the peak to now: generating the dump used far more than loading it.
    std::fs::write("/proc/self/clear_refs", "5").expect("resetting VmHWM (Linux)");
    let before = rss_kib("VmRSS:");
    let t = Instant::now();
    let loaded = manifests::load(&path, "node-1", &Ownership::default());
    let secs = t.elapsed().as_secs_f64();
    let peak = rss_kib("VmHWM:");
    let after = rss_kib("VmRSS:");
    assert!(loaded.problems.is_empty(), "{:?}", &loaded.problems[..1]);
    assert_eq!(loaded.state.service_count(), n);
    let per10k = 10_000.0 / n as f64;
    println!(
        "{n} Services + {n} EndpointSlices, {format}, {:.1} MiB file: {secs:.2} s ({:.2} s per 10k Services), peak RSS {:.1} MiB over the {:.1} MiB before loading ({:.1} MiB per 10k), {:.1} MiB held after",
        size as f64 / 1048576.0,
        secs * per10k,
        peak.saturating_sub(before) as f64 / 1024.0,
        before as f64 / 1024.0,
        peak.saturating_sub(before) as f64 / 1024.0 * per10k,
        after.saturating_sub(before) as f64 / 1024.0,
    );
}

/// The JSON form of the same dump, via the YAML reader kproxy itself uses.
fn serde_saphyr_free_parse(text: &str) -> serde_json::Value {
    let (values, errors) = kproxy_core::manifest::documents("dump.yaml", text);
    assert!(errors.is_empty());
    serde_json::json!({
        "apiVersion": "v1",
        "items": values.into_iter().map(|(_, v)| v).collect::<Vec<_>>(),
        "kind": "List",
        "metadata": {"resourceVersion": ""},
    })
}
