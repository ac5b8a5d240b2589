//! `kproxy trace`: the fate of one new connection on this node, computed from the
//! plan alone (of manifests or of one read of the API server, `crate::cluster`)
//! (`kproxy_core::trace`). The dataplane tests hold the kernel to exactly this answer;
//! `--kernel` sets the fate under the tables this kernel holds beside it
//! (`crate::kernel_trace`).

use std::net::IpAddr;
use std::process::ExitCode;

use anyhow::{Result, bail};
use clap::ValueEnum;
use kproxy_core::model::{IpFamily, Protocol};
use kproxy_core::trace::{Packet, Trace, TraceVerdict, trace};

use crate::cluster::ClusterArgs;
use crate::common::{NftTableFlag, Output, print_structured};
use crate::kernel_trace;

#[derive(Clone, Copy, Debug, ValueEnum)]
#[value(rename_all = "UPPER")]
pub enum Proto {
    Tcp,
    Udp,
    Sctp,
}

impl Proto {
    pub fn protocol(self) -> Protocol {
        match self {
            Proto::Tcp => Protocol::TCP,
            Proto::Udp => Protocol::UDP,
            Proto::Sctp => Protocol::SCTP,
        }
    }
}

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub source: ClusterArgs,
    /// This node's own addresses (for NodePorts and "from this node"); defaults to the
    /// Node object's addresses.
    #[arg(long, value_name = "IP,...", value_delimiter = ',')]
    pub node_addresses: Vec<IpAddr>,
    /// Source address of the new connection.
    #[arg(long)]
    pub src: IpAddr,
    /// Destination address (a cluster IP, node address, external IP or LB IP).
    #[arg(long)]
    pub dst: IpAddr,
    #[arg(long)]
    pub dport: u16,
    #[arg(long, value_enum, ignore_case = true, default_value = "TCP")]
    pub proto: Proto,
    /// Interface the packet arrives on (for interface-based local-traffic detectors).
    #[arg(long, value_name = "NAME")]
    pub in_interface: Option<String>,
    #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
    pub output: Output,
    /// Also evaluate the packet against kproxy's tables as this machine's kernel holds
    /// them (read back over netlink; needs CAP_NET_ADMIN, so run it on the node), and
    /// name what differs from the plan. Exits 1 when the kernel's fate or the objects
    /// the packet touches differ.
    #[arg(long)]
    pub kernel: bool,
    #[command(flatten)]
    pub nft: NftTableFlag,
}

pub fn run(args: Args) -> Result<ExitCode> {
    if args.kernel && crate::cluster::invoked_as_kubectl_plugin() {
        bail!("{}", from_kubectl(&args));
    }
    let cluster = args.source.read()?;
    let mut config = cluster.config.plan.clone();
    if !args.node_addresses.is_empty() {
        config.node_ips = args.node_addresses.clone();
    }
    let plan = cluster.plan_with(&config);
    let strict_failed = cluster.report.strict_failed;
    let pkt = Packet {
        src: args.src,
        dst: args.dst,
        dport: args.dport,
        proto: args.proto.protocol(),
        in_interface: args.in_interface.clone(),
    };
    let t = trace(&plan, &pkt, &args.node_addresses);
    if args.kernel {
        // `fib … type local` sees the addresses trace takes as this node's.
        let locals: Vec<IpAddr> = if args.node_addresses.is_empty() {
            IpFamily::ALL
                .iter()
                .flat_map(|f| plan.family(*f).node_ips.iter().copied())
                .collect()
        } else {
            args.node_addresses.clone()
        };
        // The tables hold traffic counters when the daemon (or `sync`) runs with
        // `--traffic-metrics` other than `off`: compare the kernel with the plan rendered
        // the same way (the node-level counter exists whenever they are on).
        let counters = kproxy_nft::read_counters(&args.nft.nft_table).is_ok_and(|c| !c.is_empty());
        let dp = args.nft.dataplane(cluster.config.masquerade_bit, counters);
        let k = kernel_trace::kernel_trace(&plan, &dp, &pkt, &locals, t)?;
        if !print_structured(&k, args.output)? {
            print_plan(&k.plan);
            kernel_trace::print(&k);
        }
        let differs = !k.agrees || !k.differs.is_empty();
        return Ok(if strict_failed || differs {
            ExitCode::from(1)
        } else {
            ExitCode::SUCCESS
        });
    }
    if !print_structured(&t, args.output)? {
        print_plan(&t);
    }
    Ok(if strict_failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

/// The plan's fate as sentences (`-o table`).
fn print_plan(t: &Trace) {
    let verdict = match t.verdict {
        TraceVerdict::Dnat => "DNAT",
        TraceVerdict::Drop => "DROP",
        TraceVerdict::Reject => "REJECT",
        TraceVerdict::None => "NONE",
    };
    println!("verdict:    {verdict}");
    if t.verdict == TraceVerdict::Dnat {
        let eps: Vec<String> = t.endpoints.iter().map(ToString::to_string).collect();
        println!(
            "endpoints:  {} (one chosen at random per connection)",
            eps.join(", ")
        );
        println!(
            "masquerade: {}",
            if t.masquerade {
                "yes (source NATed to the node)"
            } else {
                "no (client address kept)"
            }
        );
    }
    println!("reason:     {}", t.reason);
}

/// Why `kubectl kproxy trace --kernel` refuses, and the command that answers on the
/// node (kproxy's pod there, which deploy/ labels and configures).
fn from_kubectl(args: &Args) -> String {
    let node = args.source.node.as_deref().unwrap_or("NODE");
    let mut packet = format!(
        "--src {} --dst {} --dport {}",
        args.src, args.dst, args.dport
    );
    if let Some(i) = &args.in_interface {
        packet += &format!(" --in-interface {i}");
    }
    format!(
        "`kubectl kproxy trace --kernel` runs on this workstation and cannot read node {node}'s kernel; \
         run it in kproxy's pod on that node:\n  \
         kubectl -n kube-system exec \"$(kubectl -n kube-system get pod -l app.kubernetes.io/name=kproxy \
         --field-selector spec.nodeName={node} -o name)\" -- kproxy trace --kernel --config /var/lib/kproxy/config.yaml \
         {packet} --proto {}",
        args.proto.protocol().as_str()
    )
}
