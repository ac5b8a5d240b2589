//! kube-proxy-compatible configuration: a KubeProxyConfiguration file plus flags,
//! resolved into one `ProxyConfig`. Under construction (issue 5).
