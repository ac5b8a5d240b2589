//! `kproxy cleanup`: remove every nftables object kproxy made (its own tables only);
//! with `--after-kube-proxy-synced`, only once a kube-proxy started on the node has
//! synced (the way back to kube-proxy, docs/migrate.md).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use kproxy_nft::DataplaneConfig;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub nft: crate::common::NftTableFlag,
    /// Wait until the kube-proxy whose /healthz listens on IP:PORT answers 200 (it has
    /// programmed its rules) before removing kproxy's tables. Stop `kproxy run` first:
    /// it holds the same port (10256) and would answer instead.
    #[arg(long, value_name = "IP:PORT", num_args = 0..=1, require_equals = true,
          default_missing_value = "127.0.0.1:10256")]
    pub after_kube_proxy_synced: Option<SocketAddr>,
    /// With --after-kube-proxy-synced: give up (exit 1, tables kept) after this long.
    #[arg(long, value_name = "DURATION", default_value = "5m", value_parser = kproxy_config::parse_go_duration)]
    pub wait_timeout: Duration,
}

#[expect(
    clippy::disallowed_types,
    reason = "a blocking wait for another process, no tokio runtime: wall time"
)]
pub fn run(args: Args) -> Result<ExitCode> {
    if let Some(addr) = args.after_kube_proxy_synced {
        let deadline = std::time::Instant::now() + args.wait_timeout;
        loop {
            let last = match kube_proxy_healthz(addr) {
                Ok(()) => break,
                Err(e) => format!("{e:#}"),
            };
            if std::time::Instant::now() >= deadline {
                bail!(
                    "kube-proxy at {addr} did not report healthy within {:?} ({last}); kproxy's tables kept",
                    args.wait_timeout
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        println!("kube-proxy at {addr} has synced");
    }
    let cfg = DataplaneConfig {
        table: args.nft.nft_table,
        ..Default::default()
    };
    kproxy_nft::cleanup(&cfg).context("removing kproxy's nftables tables")?;
    println!("removed kproxy's nftables tables ({})", cfg.table);
    Ok(ExitCode::SUCCESS)
}

/// Ok when `GET /healthz` answers 200 with kube-proxy's body (`lastUpdated`, which
/// upstream writes once its first sync is done).
fn kube_proxy_healthz(addr: SocketAddr) -> Result<()> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(1))
        .with_context(|| format!("connecting to {addr}"))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: kube-proxy\r\nConnection: close\r\n\r\n")?;
    let mut text = String::new();
    s.take(64 * 1024).read_to_string(&mut text)?;
    let status = text.split_whitespace().nth(1).unwrap_or_default();
    if status != "200" {
        bail!("/healthz answered {status}");
    }
    if !text.contains("lastUpdated") {
        bail!("/healthz answered 200 without kube-proxy's lastUpdated");
    }
    Ok(())
}
