//! Reading a daemon's `/metrics` text (the Prometheus / OpenMetrics text format kproxy
//! serves, `crate::metrics::encode`): the value of one series, the sum of a family's
//! series, a label of a series. What the one-shot tools need from a daemon they reach
//! over HTTP (`kproxy explain --server`, `kproxy status`, and the traffic counters'
//! families in `crate::traffic::samples_from_metrics`).

/// One sample line: its metric name, its labels (between the braces, as written; empty
/// without), its value. Comments, blank lines and values that are not numbers are
/// left out.
pub fn samples(text: &str) -> impl Iterator<Item = (&str, &str, f64)> {
    text.lines().filter_map(|line| {
        if line.starts_with('#') {
            return None;
        }
        // Label values may hold spaces: the series ends at the closing brace.
        let (series, rest) = match line.find('{') {
            Some(open) => {
                let close = open + line[open..].find('}')?;
                (&line[..=close], &line[close + 1..])
            }
            None => line.split_once(' ')?,
        };
        let value = rest.split_whitespace().next()?.parse::<f64>().ok()?;
        let (name, labels) = match series.split_once('{') {
            Some((name, labels)) => (name, labels.strip_suffix('}')?),
            None => (series, ""),
        };
        Some((name, labels, value))
    })
}

/// The value of the series `series` (its name and labels exactly as exposed, e.g.
/// `kproxy_conntrack_entries` or `kproxy_kube_proxy_rules_present{mode="nftables"}`).
pub fn value(text: &str, series: &str) -> Option<f64> {
    let (name, labels) = match series.split_once('{') {
        Some((name, labels)) => (name, labels.strip_suffix('}').unwrap_or(labels)),
        None => (series, ""),
    };
    samples(text)
        .find(|(n, l, _)| *n == name && *l == labels)
        .map(|(_, _, v)| v)
}

/// The sum of every series of the metric `name`; `None` when it has none.
pub fn sum(text: &str, name: &str) -> Option<f64> {
    samples(text)
        .filter(|(n, _, _)| *n == name)
        .map(|(_, _, v)| v)
        .reduce(|a, b| a + b)
}

/// The value of label `key` in `labels` (as [`samples`] gives them).
pub fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    let mut rest = labels;
    while !rest.is_empty() {
        let (k, after) = rest.split_once("=\"")?;
        let end = after.find('"')?;
        if k.trim_start_matches(',').trim() == key {
            return Some(&after[..end]);
        }
        rest = &after[end + 1..];
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# HELP kproxy_conntrack_entries Conntrack entries\n\
# TYPE kproxy_conntrack_entries gauge\n\
kproxy_conntrack_entries 12\n\
kproxy_kernel_interference_total{what=\"rule\"} 3\n\
kproxy_kernel_interference_total{what=\"table\"} 1\n\
kproxy_kube_proxy_rules_present{mode=\"nftables\"} 1\n\
kproxy_kube_proxy_rules_present{mode=\"iptables\"} 0\n\
kproxy_service_rejected_total{namespace=\"a b\",service=\"s\"} 7 1700000000\n\
kubeproxy_sync_proxy_rules_last_timestamp_seconds 1.7e9\n\
# EOF\n";

    #[test]
    fn series_values_sums_and_labels_are_read_as_exposed() {
        assert_eq!(value(TEXT, "kproxy_conntrack_entries"), Some(12.0));
        assert_eq!(
            value(TEXT, "kproxy_kube_proxy_rules_present{mode=\"iptables\"}"),
            Some(0.0)
        );
        assert_eq!(
            value(TEXT, "kproxy_conntrack"),
            None,
            "a prefix is not a name"
        );
        assert_eq!(
            value(TEXT, "kubeproxy_sync_proxy_rules_last_timestamp_seconds"),
            Some(1.7e9)
        );
        assert_eq!(sum(TEXT, "kproxy_kernel_interference_total"), Some(4.0));
        assert_eq!(sum(TEXT, "kproxy_service_rejected_total"), Some(7.0));
        assert_eq!(sum(TEXT, "kproxy_absent_total"), None);
        let (_, labels, _) = samples(TEXT)
            .find(|(n, _, _)| *n == "kproxy_service_rejected_total")
            .unwrap();
        assert_eq!(label(labels, "namespace"), Some("a b"));
        assert_eq!(label(labels, "service"), Some("s"));
        assert_eq!(label(labels, "port"), None);
        assert_eq!(samples(TEXT).count(), 7, "comments are not samples");
    }
}
