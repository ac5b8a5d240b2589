//! Health servers: one HTTP server per healthCheckNodePort and the proxy's own
//! /healthz and /livez. Under construction (issue 4).
