//! What several subcommands share: logging set-up and loading manifests for one node.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use kproxy_core::ingest::Ownership;
use kproxy_core::{ClusterState, NodePlan, PlanConfig};
use kproxy_source::manifests;

pub fn init_logging() {
    let filter =
        tracing_subscriber::EnvFilter::try_from_env("KPROXY_LOG").unwrap_or_else(|_| "info".into());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// `--manifests PATH --node NAME [--strict]`, shared by the offline subcommands.
#[derive(Args, Clone, Debug)]
pub struct ManifestArgs {
    /// A manifest file or directory (recursive; .yaml, .yml, .json).
    #[arg(long, value_name = "PATH")]
    pub manifests: PathBuf,
    /// This node's name (its Node object supplies zone, addresses and pod CIDRs).
    #[arg(long, value_name = "NAME")]
    pub node: String,
    /// Exit with status 1 if any object or file had to be skipped or trimmed.
    #[arg(long)]
    pub strict: bool,
    /// Only proxy Services labelled service.kubernetes.io/service-proxy-name=NAME.
    #[arg(long, value_name = "NAME")]
    pub service_proxy_name: Option<String>,
    /// A KubeProxyConfiguration file whose planner settings apply (detectLocal,
    /// nodePortAddresses, masqueradeAll, feature gates).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
}

impl ManifestArgs {
    /// The planner settings: upstream defaults, or those of `--config`.
    pub fn plan_config(&self) -> Result<PlanConfig> {
        let Some(path) = &self.config else {
            return Ok(PlanConfig::default());
        };
        let flags = kproxy_config::ConfigFlags {
            config: Some(path.clone()),
            ..Default::default()
        };
        let (cfg, warnings) = kproxy_config::load(&flags)?;
        for w in warnings {
            eprintln!("kproxy: warning: {}: {}", w.path, w.message);
        }
        Ok(cfg.plan)
    }

    pub fn ownership(&self) -> Ownership {
        Ownership {
            service_proxy_name: self.service_proxy_name.clone(),
        }
    }

    /// Loads the manifests, prints every problem to stderr, and returns the state and
    /// whether `--strict` turned problems into failure.
    pub fn load(&self) -> Result<(ClusterState, bool)> {
        let loaded = manifests::load(&self.manifests, &self.node, &self.ownership());
        for p in &loaded.problems {
            eprintln!(
                "kproxy: {}: {p}",
                if p.skipped_object() {
                    "skipped"
                } else {
                    "warning"
                }
            );
        }
        if loaded.files.is_empty() && !loaded.problems.is_empty() {
            anyhow::bail!(
                "no manifests could be read from {}",
                self.manifests.display()
            );
        }
        Ok((loaded.state, self.strict && !loaded.problems.is_empty()))
    }

    pub fn plan(&self, config: &PlanConfig) -> Result<(NodePlan, bool)> {
        let (state, strict_failed) = self.load()?;
        if state.node().is_none() {
            eprintln!(
                "kproxy: warning: no Node object named {:?} in the manifests: no zone, no node addresses",
                self.node
            );
        }
        Ok((kproxy_core::plan(&state, &self.node, config), strict_failed))
    }
}
