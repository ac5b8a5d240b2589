//! The load a scenario puts on the lab Service.

use serde::{Deserialize, Serialize};

/// Load settings. Rates are real (not scaled): they are what the machine does.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LoadSpec {
    /// Requests per second, each on a new connection.
    pub new_connection_rate: f64,
    /// Number of keep-alive connections.
    pub keepalive_connections: u32,
    /// Requests per second on each keep-alive connection.
    pub keepalive_rate: f64,
    /// Real milliseconds before a request counts as timed out.
    pub request_timeout_ms: u64,
}

impl Default for LoadSpec {
    fn default() -> Self {
        LoadSpec {
            new_connection_rate: 100.0,
            keepalive_connections: 4,
            keepalive_rate: 20.0,
            request_timeout_ms: 2000,
        }
    }
}
