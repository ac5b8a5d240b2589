//! The lab: a Kubernetes-like cluster built from network namespaces, an emulated
//! cloud load balancer, pods with lifecycles and a load generator. Under
//! construction (issues 6 and 7).

pub mod cli {
    //! The `kproxy lab` command line.
    use std::process::ExitCode;

    #[derive(clap::Args, Debug)]
    pub struct LabArgs {}

    pub fn run(_args: LabArgs) -> anyhow::Result<ExitCode> {
        anyhow::bail!("kproxy lab is not built yet (issues 6, 7)")
    }
}
