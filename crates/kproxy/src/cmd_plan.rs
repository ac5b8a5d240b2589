//! `kproxy plan`: print the NodePlan as a table for people (with a legend of its
//! columns), or as JSON or YAML (the contract in docs/plan-json.md).

use std::process::ExitCode;

use anyhow::Result;

use crate::cluster::ClusterArgs;
use crate::common::{Output, print_structured};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub source: ClusterArgs,
    #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
    pub output: Output,
    /// A running `kproxy run`'s metrics address (`HOST:PORT` or `http://HOST:PORT`): also
    /// list the endpoints that daemon holds for warm-up and until when (a plan made
    /// here is a first view of the cluster and holds none; docs/warmup.md).
    #[arg(long, value_name = "URL")]
    pub server: Option<String>,
}

pub fn run(args: Args) -> Result<ExitCode> {
    if args.server.is_some() && args.output != Output::Table {
        anyhow::bail!("--server adds to the table: it needs -o table");
    }
    let cluster = args.source.read()?;
    let plan = cluster.plan_with(&cluster.config.plan);
    if !print_structured(&plan, args.output)? {
        print!("{}", kproxy_core::explain::plan_table(&plan));
        if let Some(server) = &args.server {
            let held = crate::cmd_explain::fetch_json(server, crate::warmup::ENDPOINT_WARMUP_PATH)?;
            print!("\n{}", crate::warmup::held_lines(&held, None, server));
        }
        crate::common::print_conflicts(&plan, None, &cluster.report.files);
    }
    Ok(if cluster.report.strict_failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}
