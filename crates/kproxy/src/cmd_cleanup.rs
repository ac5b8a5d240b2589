//! `kproxy cleanup`: remove every nftables object kproxy made (its own tables only).

use std::process::ExitCode;

use anyhow::{Context, Result};
use kproxy_nft::DataplaneConfig;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Name of kproxy's nftables tables (`ip NAME`, `ip6 NAME`).
    #[arg(long, value_name = "NAME", default_value = "kproxy", value_parser = kproxy_config::parse_nft_table_name)]
    pub nft_table: String,
}

pub fn run(args: Args) -> Result<ExitCode> {
    let cfg = DataplaneConfig {
        table: args.nft_table,
        ..Default::default()
    };
    kproxy_nft::cleanup(&cfg).context("removing kproxy's nftables tables")?;
    println!("removed kproxy's nftables tables ({})", cfg.table);
    Ok(ExitCode::SUCCESS)
}
