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
}

pub fn run(args: Args) -> Result<ExitCode> {
    let cluster = args.source.read()?;
    let plan = cluster.plan_with(&cluster.config.plan);
    if !print_structured(&plan, args.output)? {
        print!("{}", kproxy_core::explain::plan_table(&plan));
        crate::common::print_conflicts(&plan, None, &cluster.report.files);
    }
    Ok(if cluster.report.strict_failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}
