//! `kproxy plan`: print the NodePlan as JSON (the contract in docs/plan-json.md) or as
//! a table for people.

use std::process::ExitCode;

use anyhow::Result;
use clap::ValueEnum;

use crate::common::ManifestArgs;

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Format {
    Json,
    Table,
}

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub source: ManifestArgs,
    #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
    pub output: Format,
}

pub fn run(args: Args) -> Result<ExitCode> {
    let (plan, strict_failed) = args.source.plan(&args.source.plan_config()?)?;
    match args.output {
        Format::Json => println!("{}", serde_json::to_string_pretty(&plan)?),
        Format::Table => {
            print!("{}", kproxy_core::explain::plan_table(&plan));
            crate::common::print_conflicts(&plan, None);
        }
    }
    Ok(if strict_failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}
