//! The k8s-lab's own control-plane processes (kube-apiserver, kube-controller-manager)
//! as the API-outage chaos handles them: found by their pid files, killed, and
//! started again with the same command line.

use std::path::PathBuf;
use std::time::Duration;

use super::K8sLab;
use crate::LabError;

/// A running control-plane process of the k8s-lab (kube-apiserver,
/// kube-controller-manager), found by the pid file `start.sh` writes: what the
/// API-outage chaos kills and starts again with the same command line.
pub struct LabProcess {
    name: &'static str,
    pid_file: PathBuf,
    log: PathBuf,
    argv: Vec<String>,
    pid: i32,
}

impl LabProcess {
    /// `name` is both `start.sh`'s name for it and its binary's.
    pub fn find(lab: &K8sLab, name: &'static str) -> Result<LabProcess, LabError> {
        let pid_file = lab.dir.join(format!("run/{name}.pid"));
        let io = |what: String| move |e| LabError::Io { what, source: e };
        let pid: i32 = std::fs::read_to_string(&pid_file)
            .map_err(io(format!("read {}", pid_file.display())))?
            .trim()
            .parse()
            .map_err(|_| LabError::Invalid(format!("{}: not a pid", pid_file.display())))?;
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).map_err(io(format!(
            "read the command line of {name} (pid {pid}); is it running?"
        )))?;
        let argv: Vec<String> = cmdline
            .split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if !argv.first().is_some_and(|a| a.ends_with(name)) {
            return Err(LabError::Invalid(format!(
                "pid {pid} of {} is not {name}",
                pid_file.display()
            )));
        }
        Ok(LabProcess {
            name,
            pid_file,
            log: lab.dir.join(format!("logs/{name}.log")),
            argv,
            pid,
        })
    }

    /// SIGKILL, and wait until it is gone.
    pub fn kill(&self) -> Result<(), LabError> {
        let pid = nix::unistd::Pid::from_raw(self.pid);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL)
            .map_err(|e| LabError::Invalid(format!("kill {} (pid {pid}): {e}", self.name)))?;
        while std::path::Path::new(&format!("/proc/{}", self.pid)).exists() {
            // A process an earlier run of this process started again is its child: reap
            // it, or it stays a zombie and this waits forever. Another parent's (start.sh's,
            // then init's) is reaped there: ECHILD here.
            let _ = nix::sys::wait::waitpid(pid, Some(nix::sys::wait::WaitPidFlag::WNOHANG));
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// The same command line again, in a session of its own, appending to its log as
    /// `start.sh` does, and its pid where `start.sh` looks for it. The child is
    /// returned so that a caller can tell when it exits (and reap it).
    pub fn start_again(&self) -> Result<std::process::Child, LabError> {
        let log = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(&self.log)
            .map_err(|e| LabError::Io {
                what: format!("open {}", self.log.display()),
                source: e,
            })?;
        let err = log.try_clone().map_err(|e| LabError::Io {
            what: "clone the log file".into(),
            source: e,
        })?;
        let child = std::process::Command::new("setsid")
            .args(&self.argv)
            .stdin(std::process::Stdio::null())
            .stdout(log)
            .stderr(err)
            .spawn()
            .map_err(|e| LabError::Io {
                what: format!("start {} again", self.name),
                source: e,
            })?;
        std::fs::write(&self.pid_file, format!("{}\n", child.id())).map_err(|e| LabError::Io {
            what: format!("write {}", self.pid_file.display()),
            source: e,
        })?;
        Ok(child)
    }
}
