//! The event log (`--event-log FILE`): one JSON object per line per sync, warm-up hold
//! and other event the daemon and its observers record. A module of its own so that the
//! observers (`crate::warmup`) and the loop (`crate::daemon`) both write to it without
//! pointing at each other.

use std::io::Write;
use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use serde_json::json;

/// Appends one JSON object per line; a write failure is logged, never fatal.
pub struct EventLog(Option<std::fs::File>);

impl EventLog {
    pub fn open(path: Option<&PathBuf>) -> Result<EventLog> {
        let file = path
            .map(|p| {
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)
                    .with_context(|| format!("opening the event log {}", p.display()))
            })
            .transpose()?;
        Ok(EventLog(file))
    }

    pub fn emit(&mut self, event: &str, mut fields: serde_json::Value) {
        let Some(f) = self.0.as_mut() else { return };
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        if let Some(obj) = fields.as_object_mut() {
            obj.insert("t_unix_ms".into(), json!(now.as_millis() as u64));
            obj.insert("event".into(), json!(event));
        }
        let mut line = fields.to_string();
        line.push('\n');
        if let Err(e) = f.write_all(line.as_bytes()) {
            tracing::warn!(error = %e, "cannot write the event log");
        }
    }
}
