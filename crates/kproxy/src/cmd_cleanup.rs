//! `kproxy cleanup`: remove every nftables object kproxy made (its own tables only).

use std::process::ExitCode;

use anyhow::{Context, Result};
use kproxy_nft::DataplaneConfig;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub nft: crate::common::NftTableFlag,
}

pub fn run(args: Args) -> Result<ExitCode> {
    let cfg = DataplaneConfig {
        table: args.nft.nft_table,
        ..Default::default()
    };
    kproxy_nft::cleanup(&cfg).context("removing kproxy's nftables tables")?;
    println!("removed kproxy's nftables tables ({})", cfg.table);
    Ok(ExitCode::SUCCESS)
}
