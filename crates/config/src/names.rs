//! Values of kproxy's own flags that reach the kernel or ingestion: the nftables table
//! name (its rule is core's, shared with the dataplane's own check) and the node-port
//! range. Checked when the flag is parsed, so a bad value is a usage error naming the
//! flag, never a half-applied nft script.

use std::ops::RangeInclusive;

/// `--nft-table`: the rule of [`kproxy_core::config::check_nft_table_name`], checked
/// when the flag is parsed.
pub fn parse_nft_table_name(s: &str) -> Result<String, String> {
    kproxy_core::config::check_nft_table_name(s).map(|()| s.to_string())
}

/// A node-port range as the apiserver's `--service-node-port-range` spells it:
/// `30000-32767` (or `30000+2767`).
pub fn parse_port_range(s: &str) -> Result<RangeInclusive<u16>, String> {
    let bad = || format!("port range {s:?}: want FIRST-LAST (e.g. 30000-32767), 1-65535");
    let port = |p: &str| p.trim().parse::<u16>().ok().filter(|p| *p != 0);
    let range = if let Some((a, b)) = s.split_once('-') {
        port(a).zip(port(b)).map(|(a, b)| a..=b)
    } else if let Some((a, n)) = s.split_once('+') {
        port(a)
            .zip(n.trim().parse::<u16>().ok())
            .and_then(|(a, n)| a.checked_add(n).map(|b| a..=b))
    } else {
        None
    };
    range.filter(|r| r.start() <= r.end()).ok_or_else(bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_are_identifiers_and_not_keywords() {
        for ok in [
            "kproxy",
            "kproxy_test-1",
            "K",
            "kube-proxyish",
            "kube_proxy",
        ] {
            assert_eq!(parse_nft_table_name(ok).as_deref(), Ok(ok));
        }
        for bad in [
            "ip",
            "inet",
            "IP6",
            "table",
            "",
            "1x",
            "a b",
            "a;b",
            &"x".repeat(33),
            "kube-proxy",
            "Kube-Proxy",
            "kube-proxy-canary",
        ] {
            assert!(parse_nft_table_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn port_ranges_as_the_apiserver_spells_them() {
        assert_eq!(parse_port_range("30000-32767"), Ok(30000..=32767));
        assert_eq!(parse_port_range("30000+2767"), Ok(30000..=32767));
        for bad in ["", "0-10", "10-5", "1-65536", "x-y", "30000"] {
            assert!(parse_port_range(bad).is_err(), "{bad:?}");
        }
    }
}
