//! Running the scenario matrix: every selected cell (`scenario::matrix`) one real rollout
//! after the other, each judged beside lint's verdict (`report::matrix`) as it ends.

use std::path::Path;

use crate::LabError;
use crate::report::RunResult;
use crate::report::matrix::{CellResult, cell_result, judge_against_recommended, lint_cell};
use crate::runs::{Progress, rollout};
use crate::scenario::matrix::{Selection, config_for, node_drain};
use crate::scenario::rollout::RolloutConfig;
use crate::scenario::run::{Chaos, ControlPlaneKind, RunOptions};

/// Run every selected cell, one after the other. `on_cell` sees each result as it
/// comes (progress lines, partial reports); the runs are returned for plots.
pub fn run_matrix(
    sel: &Selection,
    base: &RolloutConfig,
    kproxy: &Path,
    control_plane: ControlPlaneKind,
    progress: Progress,
    on_cell: &mut dyn FnMut(&CellResult, &RunResult),
) -> Result<Vec<CellResult>, LabError> {
    let cells = sel.cells();
    let mut out = Vec::new();
    for (i, cell) in cells.iter().enumerate() {
        if cell.setting.chaos().is_some_and(Chaos::needs_real_api)
            && control_plane == ControlPlaneKind::Emulated
        {
            progress(&format!(
                "[matrix {}/{}] {}: skipped, needs --control-plane k8s-lab",
                i + 1,
                cells.len(),
                cell.id()
            ));
            continue;
        }
        let cfg = config_for(cell, base)?;
        let lint = lint_cell(&cfg, cell.setting.etp_local())?;
        progress(&format!("[matrix {}/{}] {}", i + 1, cells.len(), cell.id()));
        let opts = RunOptions {
            chaos: cell.setting.chaos(),
            drain: cell.setting.drain_by().map(|by| node_drain(&cfg, by)),
            etp_cluster: !cell.setting.etp_local(),
            control_plane,
        };
        let run = rollout::run_with(&cfg, cell.behaviour, 0, kproxy, opts, progress)
            .map_err(|e| LabError::Invalid(format!("matrix cell {}: {e}", cell.id())))?;
        let r = cell_result(cell, &cfg, &run, lint);
        on_cell(&r, &run);
        out.push(r);
    }
    judge_against_recommended(&mut out);
    Ok(out)
}
