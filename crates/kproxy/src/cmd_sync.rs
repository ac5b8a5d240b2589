//! `kproxy sync --once`: plan from manifests and program nftables once, for scripts
//! and first-boot set-ups. Prints what it did; the rules stay.
//!
//! Exit status: 0 when every object was used; 1 when objects were skipped, or a
//! frontend conflict dropped a frontend (the rest is programmed: each skipped object and
//! each conflict's loser is named on stderr); 2, with nothing programmed,
//! when a file or document could not be read or parsed, because the rules it would
//! replace may hold objects that this state lost without a name (a List that
//! failed to parse wiped every Service). `--allow-partial` programs anyway. Also 2,
//! with nothing programmed, when the input holds no Service while kproxy's tables in
//! the kernel hold more than an empty input leaves (an emptied directory or a
//! 0-byte file wiped every rule); `--allow-empty` programs anyway.

use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use kproxy_core::planner::PlanUpdate;
use kproxy_nft::Dataplane;

use crate::common::ManifestArgs;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub source: ManifestArgs,
    /// Program once and exit. `kproxy sync` needs this or `--dry-run`, so a script
    /// says which it means (the daemon is `kproxy run`).
    #[arg(long)]
    pub once: bool,
    /// Print the transaction `--once` would apply now, as `nft -f` text, and change
    /// nothing: the delta that adopts kproxy's tables when they exist (reading them
    /// needs root), else each family's table replaced in one transaction.
    #[arg(long)]
    pub dry_run: bool,
    #[command(flatten)]
    pub nft: crate::common::NftTableFlag,
    /// Program the state even when a file or document could not be read or parsed.
    #[arg(long)]
    pub allow_partial: bool,
    /// Program the state even when it has no Service and kproxy's tables in the kernel
    /// hold Services (their rules are then removed).
    #[arg(long)]
    pub allow_empty: bool,
    /// The traffic counters, as `kproxy run --traffic-metrics` (only `off`, the default,
    /// differs: no counters in the tables). The same value as the daemon's, or a sync removes the
    /// daemon's counters (or adds them).
    #[arg(long, value_name = "LEVEL", default_value = "off")]
    pub traffic_metrics: crate::traffic::Level,
}

pub fn run(args: Args) -> Result<ExitCode> {
    if !args.once && !args.dry_run {
        bail!("`kproxy sync` needs --once or --dry-run (the daemon is `kproxy run`)");
    }
    let config = args.source.proxy_config()?;
    let (plan, input) = args.source.plan_report(&config.plan)?;
    let allow = kproxy_core::input_guard::Allow {
        empty: args.allow_empty,
        partial: args.allow_partial,
    };
    let manifests = format!("the manifests in {}", args.source.manifests.display());
    let refuse = |r: kproxy_core::input_guard::Refusal| {
        eprintln!(
            "kproxy: not programming: {}",
            r.message(&manifests, &args.nft.nft_table)
        );
        Ok(ExitCode::from(2))
    };
    let lost = kproxy_core::input_guard::Input {
        empty: false,
        lost: input.lost,
    };
    if !args.dry_run
        && let Some(r) = kproxy_core::input_guard::refusal(lost, Default::default(), allow, false)
    {
        return refuse(r);
    }
    // A frontend conflict dropped a frontend of the loser: as good as a skipped piece of
    // it, and named, since manifests without creationTimestamp decide by name order.
    let locations = crate::common::conflict_locations(&plan, &input.files);
    for c in &plan.conflicts {
        eprintln!(
            "kproxy: conflict: {}",
            crate::common::conflict_line(&c.service, c, &locations)
        );
    }
    // Programmed as upstream programs them: named, but no reason to fail.
    for w in &plan.cluster_ip_warnings {
        eprintln!(
            "kproxy: warning: {}",
            crate::common::conflict_line(&w.service, w, &locations)
        );
    }
    if !plan.cluster_ip_warnings.is_empty() && plan.conflicts.is_empty() {
        eprintln!(
            "kproxy: {} cluster IP warning(s), each programmed: they do not change the exit status",
            plan.cluster_ip_warnings.len()
        );
    }
    let failed = input.strict_failed || input.skipped || !plan.conflicts.is_empty();
    let dp_config = args.nft.dataplane(
        config.masquerade_bit,
        args.traffic_metrics != crate::traffic::Level::Off,
    );
    if args.dry_run {
        kproxy_nft::validate_plan(&plan).context("checking the plan")?;
        let (tx, adopted) = kproxy_nft::first_sync_transaction(&plan, &dp_config);
        eprintln!(
            "kproxy: {}",
            if adopted {
                "kproxy's tables exist: `sync --once` would adopt them with this delta"
            } else {
                "`sync --once` would replace kproxy's tables with these (the kernel's tables are absent, unreadable or not adoptable)"
            }
        );
        tx.write_nft_to(&mut std::io::stdout().lock())
            .context("writing the transaction to stdout")?;
        return Ok(if failed {
            ExitCode::from(1)
        } else {
            ExitCode::SUCCESS
        });
    }
    if plan.services.is_empty()
        && !args.allow_empty
        && let Some(r) = kproxy_core::input_guard::refusal(
            kproxy_core::input_guard::Input {
                empty: true,
                lost: false,
            },
            kproxy_core::input_guard::Kernel {
                more: crate::input_guard::kernel_holds_more(&plan, &dp_config),
                same: false,
            },
            allow,
            false,
        )
    {
        return refuse(r);
    }
    let mut dp = Dataplane::new(dp_config).context("setting up the nftables dataplane")?;
    // One process, one sync: a full one (there is no record yet).
    let report = dp
        .sync(&plan, &PlanUpdate::WHOLE)
        .context("programming nftables")?;
    println!(
        "synced {} service ports of {} Services in {:.1} ms (conntrack entries deleted: {})",
        plan.service_ports().count(),
        plan.services.len(),
        report.elapsed.as_secs_f64() * 1e3,
        report.conntrack_deleted
    );
    Ok(if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}
