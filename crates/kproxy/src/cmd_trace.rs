//! `kproxy trace`: the fate of one new connection on this node, computed from the
//! plan alone (of manifests or of one read of the API server, `crate::cluster`) (`kproxy_core::trace`). The dataplane tests hold the kernel to exactly
//! this answer.

use std::net::IpAddr;
use std::process::ExitCode;

use anyhow::Result;
use clap::ValueEnum;
use kproxy_core::model::Protocol;
use kproxy_core::trace::{Packet, TraceVerdict, trace};

use crate::cluster::ClusterArgs;
use crate::common::{Output, print_structured};

#[derive(Clone, Copy, Debug, ValueEnum)]
#[value(rename_all = "UPPER")]
pub enum Proto {
    Tcp,
    Udp,
    Sctp,
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
}

pub fn run(args: Args) -> Result<ExitCode> {
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
        proto: match args.proto {
            Proto::Tcp => Protocol::TCP,
            Proto::Udp => Protocol::UDP,
            Proto::Sctp => Protocol::SCTP,
        },
        in_interface: args.in_interface.clone(),
    };
    let t = trace(&plan, &pkt, &args.node_addresses);
    if !print_structured(&t, args.output)? {
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
    Ok(if strict_failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}
