//! `kproxy lint`: checks workloads' rollout settings against the load balancer in
//! front of them. Under construction (issue 8).

pub mod cli {
    //! The `kproxy lint` command line.
    use std::process::ExitCode;

    #[derive(clap::Args, Debug)]
    pub struct LintArgs {}

    pub fn run(_args: LintArgs) -> anyhow::Result<ExitCode> {
        anyhow::bail!("kproxy lint is not built yet (issue 8)")
    }
}
