//! File-descriptor headroom of `kproxy run`: raising RLIMIT_NOFILE's soft limit to the
//! hard one at start, and the rule for when the limit is still too low for the servers
//! the process runs. When descriptors run out, every accept, manifest read, netlink
//! socket and conntrack cleanup fails at once, so the check is made up front and
//! reported (log + `kproxy_process_nofile_limit`) rather than discovered under load.

use nix::sys::resource::{Resource, getrlimit, setrlimit};
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Descriptors the process needs besides its HTTP servers' connections: listeners,
/// netlink and nft sockets, the manifest watcher, files being read, the runtime.
pub const BASE_FDS: u64 = 256;

/// Health-check node port servers counted in the headroom: each may hold
/// `max_connections` under a flood; there may be more ports than this, and their
/// connections are bounded per server, so the rule budgets for a few flooded at once.
pub const FLOODED_HEALTH_PORTS: u64 = 4;

/// The soft limit below which a warning is due: base needs plus every bounded server
/// (the metrics server, `/healthz`+`/livez`, [`FLOODED_HEALTH_PORTS`] health-check
/// node ports) holding its maximum of connections.
pub fn wanted(
    metrics_conns: Option<usize>,
    healthz_conns: Option<usize>,
    health_port_conns: usize,
) -> u64 {
    let conns = |c: Option<usize>| c.map_or(0, |c| c as u64);
    BASE_FDS
        + conns(metrics_conns)
        + conns(healthz_conns)
        + FLOODED_HEALTH_PORTS * health_port_conns as u64
}

/// [`wanted`] for `kproxy run` with `cfg`: its metrics and healthz servers when
/// configured, and the health-check node ports, at their connection limits.
pub fn wanted_for(cfg: &kproxy_config::ProxyConfig) -> u64 {
    let health_limits = kproxy_health::http::Limits::default();
    wanted(
        cfg.metrics_bind_address
            .map(|_| crate::metrics::SERVER_LIMITS.max_connections),
        cfg.healthz_bind_address
            .map(|_| health_limits.max_connections),
        health_limits.max_connections,
    )
}

/// What start-up did about the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Headroom {
    pub before: u64,
    pub soft: u64,
    pub hard: u64,
    pub wanted: u64,
}

impl Headroom {
    pub fn low(&self) -> bool {
        self.soft < self.wanted
    }
}

/// Raises the soft limit to the hard one (always allowed for an unprivileged process
/// too), then reports the result against `wanted`, logs a warning when it is low and
/// registers the gauge.
pub fn raise_and_check(wanted: u64, registry: &mut Registry) -> std::io::Result<Headroom> {
    let (before, hard) = getrlimit(Resource::RLIMIT_NOFILE).map_err(std::io::Error::from)?;
    if before < hard
        && let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard)
    {
        tracing::warn!(error = %e, soft = before, hard, "cannot raise RLIMIT_NOFILE");
    }
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).map_err(std::io::Error::from)?;
    let h = Headroom {
        before,
        soft,
        hard,
        wanted,
    };
    if h.low() {
        tracing::warn!(
            soft,
            hard,
            wanted,
            "RLIMIT_NOFILE is low for the configured servers: a connection flood could exhaust file descriptors (raise LimitNOFILE / ulimit -n)"
        );
    } else if soft != before {
        tracing::info!(
            before,
            soft,
            "raised RLIMIT_NOFILE soft limit to the hard limit"
        );
    }
    let gauge: Gauge = Gauge::default();
    gauge.set(i64::try_from(soft).unwrap_or(i64::MAX));
    registry.register(
        "kproxy_process_nofile_limit",
        "Soft RLIMIT_NOFILE after start-up raised it to the hard limit; kproxy warns when it is below what its bounded servers can hold (docs/deploy.md)",
        gauge,
    );
    Ok(h)
}

/// The connections `/healthz` and all health-check node ports may hold together: nine
/// tenths of what the soft limit leaves after the base needs and the metrics server's
/// bound, so that no flood, however spread over ports, takes the process to its limit
///. The tenth kept back is for evicted connections still closing, which the
/// budget lets reach a tenth of itself ([`kproxy_health::http::ConnectionBudget`]).
pub fn health_connection_budget(soft: u64, metrics_conns: Option<usize>) -> usize {
    let reserved = BASE_FDS + metrics_conns.map_or(0, |c| c as u64);
    let left = soft.saturating_sub(reserved);
    usize::try_from(left - left / 10)
        .unwrap_or(usize::MAX)
        .max(1)
}

/// Scrape-time gauges of descriptors and health connections: `kproxy_process_open_fds`
/// (entries of /proc/self/fd) and, when the health servers share a budget,
/// `kproxy_health_connections`, `kproxy_health_connection_budget` and
/// `kproxy_health_connections_evicted_total`.
#[derive(Debug)]
pub struct FdCollector {
    pub budget: Option<std::sync::Arc<kproxy_health::http::ConnectionBudget>>,
}

/// Open descriptors of this process (`None` when /proc cannot be read).
pub fn open_fds() -> Option<usize> {
    std::fs::read_dir("/proc/self/fd").ok().map(|d| d.count())
}

impl prometheus_client::collector::Collector for FdCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::gauge::ConstGauge;
        let mut gauge = |name: &str, help: &str, v: usize| {
            let g = ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX));
            let m = encoder.encode_descriptor(name, help, None, g.metric_type())?;
            g.encode(m)
        };
        if let Some(n) = open_fds() {
            gauge(
                "kproxy_process_open_fds",
                "File descriptors open in the kproxy process",
                n,
            )?;
        }
        if let Some(b) = &self.budget {
            gauge(
                "kproxy_health_connections",
                "Connections open on /healthz and every health-check node port together",
                b.open(),
            )?;
            gauge(
                "kproxy_health_connection_budget",
                "Connections /healthz and the health-check node ports may hold together (RLIMIT_NOFILE less the process's other needs); beyond it the least recently active is closed",
                b.max(),
            )?;
            let c = ConstCounter::new(b.evicted());
            let m = encoder.encode_descriptor(
                "kproxy_health_connections_evicted",
                "Health connections closed to keep within the shared budget",
                None,
                c.metric_type(),
            )?;
            c.encode(m)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wanted_counts_each_configured_server_at_its_bound() {
        for (metrics, healthz, port, want) in [
            (Some(64), Some(512), 512, 256 + 64 + 512 + 4 * 512),
            (None, Some(512), 512, 256 + 512 + 4 * 512),
            (None, None, 512, 256 + 4 * 512),
            (Some(64), None, 0, 256 + 64),
        ] {
            assert_eq!(
                wanted(metrics, healthz, port),
                want,
                "{metrics:?} {healthz:?} {port}"
            );
        }
        let h = Headroom {
            before: 1024,
            soft: 1024,
            hard: 1024,
            wanted: 2880,
        };
        assert!(h.low());
        assert!(!Headroom { soft: 4096, ..h }.low());
    }

    #[test]
    fn the_health_budget_is_what_the_soft_limit_leaves() {
        assert_eq!(health_connection_budget(20_000, Some(64)), 17_712);
        assert_eq!(health_connection_budget(1024, None), 692);
        assert_eq!(health_connection_budget(100, Some(64)), 1);
    }
}
