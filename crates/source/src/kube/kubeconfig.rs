//! Reading kubeconfig files and running their exec credential plugins, each with a
//! bound: a kubeconfig that is a FIFO nobody writes, or a plugin that never returns,
//! ends with an error that names it instead of a silent hang. Owns kubectl's merge of
//! several files (`$KUBECONFIG`: the first file to set a value wins).

use std::path::{Path, PathBuf};
use std::time::Duration;

use kube::config::Kubeconfig;
use serde::Deserialize;

use super::SourceError;

/// A kubeconfig larger than this is not one (kubectl's own have a few KB; one with a
/// thousand clusters, a few MB).
pub const MAX_KUBECONFIG_BYTES: u64 = 16 << 20;

fn read_error(path: &Path, why: impl Into<String>) -> SourceError {
    SourceError::KubeconfigRead {
        path: path.to_path_buf(),
        why: why.into(),
    }
}

/// One kubeconfig file. A regular file is read as kube reads it (relative paths in it
/// made absolute); anything else (a FIFO, `/dev/fd/N` of a shell's `<(…)`) is read on
/// a thread, waiting at most `wait` for it to end and reading at most
/// [`MAX_KUBECONFIG_BYTES`].
pub fn read(path: &Path, wait: Option<Duration>) -> Result<Kubeconfig, SourceError> {
    let meta = std::fs::metadata(path).map_err(|e| read_error(path, e.to_string()))?;
    let parse_error = |source| SourceError::Kubeconfig {
        path: path.to_path_buf(),
        source,
    };
    if meta.is_file() {
        if meta.len() > MAX_KUBECONFIG_BYTES {
            return Err(read_error(
                path,
                format!(
                    "{} bytes, more than a kubeconfig holds ({MAX_KUBECONFIG_BYTES})",
                    meta.len()
                ),
            ));
        }
        return Kubeconfig::read_from(path).map_err(parse_error);
    }
    if meta.is_dir() {
        return Err(read_error(path, "a directory, not a kubeconfig file"));
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let owned = path.to_path_buf();
    // Not joined: a reader blocked on a FIFO with no writer ends with the process.
    std::thread::spawn(move || {
        use std::io::Read;
        let mut text = Vec::new();
        let read = std::fs::File::open(&owned)
            .and_then(|f| f.take(MAX_KUBECONFIG_BYTES + 1).read_to_end(&mut text));
        let _ = tx.send(read.map(|_| text));
    });
    let text = match wait {
        Some(wait) => rx.recv_timeout(wait).map_err(|_| {
            read_error(
                path,
                format!(
                    "not a regular file, and it did not end within {wait:?} (--connect-timeout): a FIFO nobody writes to?"
                ),
            )
        })?,
        None => rx
            .recv()
            .map_err(|_| read_error(path, "the reader thread ended"))?,
    }
    .map_err(|e| read_error(path, e.to_string()))?;
    if text.len() as u64 > MAX_KUBECONFIG_BYTES {
        return Err(read_error(
            path,
            format!("more than a kubeconfig holds ({MAX_KUBECONFIG_BYTES} bytes)"),
        ));
    }
    let text = String::from_utf8(text).map_err(|_| read_error(path, "not UTF-8 text"))?;
    Kubeconfig::from_yaml(&text).map_err(parse_error)
}

/// `files` merged as kubectl merges `$KUBECONFIG`'s: in order, the first file to set a
/// value or map key wins.
pub fn read_merged(files: &[PathBuf], wait: Option<Duration>) -> Result<Kubeconfig, SourceError> {
    let mut merged: Option<Kubeconfig> = None;
    for path in files {
        let next = read(path, wait)?;
        merged = Some(match merged {
            None => next,
            Some(m) => m.merge(next).map_err(|source| SourceError::Kubeconfig {
                path: path.clone(),
                source,
            })?,
        });
    }
    Ok(merged.unwrap_or_default())
}

/// What an exec plugin prints (client.authentication.k8s.io ExecCredential), the part
/// used.
#[derive(Deserialize)]
struct ExecCredential {
    status: Option<ExecStatus>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ExecStatus {
    token: Option<String>,
    client_certificate_data: Option<String>,
    client_key_data: Option<String>,
}

fn exec_error(command: &str, why: impl Into<String>) -> SourceError {
    SourceError::ExecPlugin {
        command: command.to_string(),
        why: why.into(),
    }
}

/// Runs the exec credential plugin of `config`'s user, if it has one, once and for at
/// most `wait` (killed after it), and puts the credentials it prints in its place. The
/// tools read the cluster once: the token does not need kube's refresh, and kube would
/// run the plugin with no bound (and more than once while building the client).
pub async fn run_exec_plugin(
    config: &mut kube::config::Config,
    wait: Option<Duration>,
) -> Result<(), SourceError> {
    use base64::Engine;
    let Some(exec) = config.auth_info.exec.take() else {
        return Ok(());
    };
    let command = exec.command.clone().unwrap_or_default();
    if command.is_empty() {
        return Err(exec_error(
            "",
            "the kubeconfig's exec plugin has no command",
        ));
    }
    let interactive = !matches!(
        exec.interactive_mode,
        Some(kube::config::ExecInteractiveMode::Never)
    );
    let cluster = if exec.provide_cluster_info {
        exec.cluster
            .as_ref()
            .and_then(|c| serde_json::to_value(c).ok())
    } else {
        None
    };
    let info = serde_json::json!({
        "apiVersion": exec.api_version,
        "kind": "ExecCredential",
        "spec": { "interactive": interactive, "cluster": cluster },
    });
    let mut cmd = tokio::process::Command::new(&command);
    cmd.args(exec.args.iter().flatten())
        .envs(
            exec.env
                .iter()
                .flatten()
                .filter_map(|e| Some((e.get("name")?.clone(), e.get("value")?.clone()))),
        )
        .env("KUBERNETES_EXEC_INFO", info.to_string())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .stdin(if interactive {
            std::process::Stdio::inherit()
        } else {
            std::process::Stdio::null()
        })
        .kill_on_drop(true);
    let run = cmd.output();
    let out = match wait {
        Some(wait) => tokio::time::timeout(wait, run).await.map_err(|_| {
            exec_error(
                &command,
                format!("did not finish within {wait:?} (--exec-timeout); killed"),
            )
        })?,
        None => run.await,
    }
    .map_err(|e| {
        let hint = exec.install_hint.as_deref().unwrap_or("");
        exec_error(
            &command,
            format!("cannot start it: {e} {hint}")
                .trim_end()
                .to_string(),
        )
    })?;
    if !out.status.success() {
        return Err(exec_error(&command, format!("exited with {}", out.status)));
    }
    let credential: ExecCredential = serde_json::from_slice(&out.stdout).map_err(|e| {
        exec_error(
            &command,
            format!("its output is not an ExecCredential: {e}"),
        )
    })?;
    let status = credential
        .status
        .ok_or_else(|| exec_error(&command, "its ExecCredential has no status"))?;
    // AuthInfo's secret fields can only be built through serde.
    let mut user =
        serde_json::to_value(&config.auth_info).map_err(|e| exec_error(&command, e.to_string()))?;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    match status {
        ExecStatus {
            token: Some(token), ..
        } => user["token"] = token.into(),
        ExecStatus {
            client_certificate_data: Some(cert),
            client_key_data: Some(key),
            ..
        } => {
            user["client-certificate-data"] = b64(&cert).into();
            user["client-key-data"] = b64(&key).into();
        }
        _ => {
            return Err(exec_error(
                &command,
                "its ExecCredential has neither a token nor a client certificate and key",
            ));
        }
    }
    config.auth_info =
        serde_json::from_value(user).map_err(|e| exec_error(&command, e.to_string()))?;
    Ok(())
}
