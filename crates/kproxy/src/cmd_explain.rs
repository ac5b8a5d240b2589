//! `kproxy explain`: for one Service, per port and per kind of traffic, which endpoints
//! are used and why every other endpoint is not.

use std::process::ExitCode;

use anyhow::{Result, bail};
use kproxy_core::model::ServiceName;

use crate::common::ManifestArgs;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub source: ManifestArgs,
    /// The Service, as `namespace/name`, or `name` with `-n namespace`.
    pub service: String,
    #[arg(short = 'n', long = "namespace", default_value = "default")]
    pub namespace: String,
}

pub fn run(args: Args) -> Result<ExitCode> {
    let name = match ServiceName::parse(&args.service) {
        Some(n) => n,
        None if !args.service.contains('/') => {
            ServiceName::new(args.namespace.as_str(), args.service.as_str())
        }
        None => bail!(
            "SERVICE must be namespace/name or name, got {:?}",
            args.service
        ),
    };
    let (plan, strict_failed) = args.source.plan(&args.source.plan_config()?)?;
    let Some(svc) = plan.services.get(&name) else {
        bail!(
            "Service {name} is not proxied on node {} (unknown, headless, ExternalName, or another proxy's)",
            plan.node
        );
    };
    print!("{}", kproxy_core::explain::explain_service(&plan, svc));
    crate::common::print_conflicts(&plan, Some(&name));
    Ok(if strict_failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}
