//! The protobuf path cannot lose a field silently (issue 51): one Service and one
//! EndpointSlice with every field k8s-openapi knows set (a completeness check holds the
//! objects to k8s-openapi's field lists), and every one-field change of them (each leaf
//! changed, each key removed), must ingest the same through the protobuf decoder
//! ([`super::decode`]), the JSON decoder ([`crate::kube::slim::decode`]) and the whole
//! object (the manifest path). A field ingest reads that a decoder's messages do not
//! carry makes its change vanish on that path only, and this test names it.
//!
//! The protobuf bytes are encoded from the whole object with the decoder's own prost
//! messages ([`encode`]): a field they lack is dropped on the way, as a real API
//! server's bytes for it are skipped unread. The tag numbers themselves are held to a
//! real API server's bytes by the captured lists and watches in `super::tests`.

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1 as corev1;
use k8s_openapi::api::discovery::v1 as discoveryv1;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kproxy_core::ingest::{Kind, Ownership};
use kproxy_core::manifest::Object;
use kproxy_core::state::Update;
use prost::Message;
use serde::de::{self, DeserializeOwned, Visitor};
use serde_json::{Value, json};

use super::*;

// ---- The whole object into the decoder's messages.

fn timestamp(t: &Time) -> Timestamp {
    Timestamp {
        seconds: Some(t.0.as_second()),
        nanos: Some(t.0.subsec_nanosecond()),
    }
}

fn meta(m: &ObjectMeta) -> Meta {
    Meta {
        name: m.name.clone(),
        namespace: m.namespace.clone(),
        creation_timestamp: m.creation_timestamp.as_ref().map(timestamp),
        deletion_timestamp: m.deletion_timestamp.as_ref().map(timestamp),
        labels: m.labels.clone().unwrap_or_default(),
        annotations: m.annotations.clone().unwrap_or_default(),
    }
}

fn service_port(p: &corev1::ServicePort) -> ServicePort {
    ServicePort {
        name: p.name.clone(),
        protocol: p.protocol.clone(),
        port: Some(p.port),
        target_port: p.target_port.as_ref().map(|t| match t {
            IntOrString::Int(i) => IntOrStr {
                type_: Some(0),
                int_val: Some(*i),
                str_val: None,
            },
            IntOrString::String(s) => IntOrStr {
                type_: Some(1),
                int_val: None,
                str_val: Some(s.clone()),
            },
        }),
        node_port: p.node_port,
        app_protocol: p.app_protocol.clone(),
    }
}

fn service_spec(s: &corev1::ServiceSpec) -> ServiceSpec {
    ServiceSpec {
        ports: s.ports.iter().flatten().map(service_port).collect(),
        selector: s.selector.clone().unwrap_or_default(),
        cluster_ip: s.cluster_ip.clone(),
        type_: s.type_.clone(),
        external_ips: s.external_ips.clone().unwrap_or_default(),
        session_affinity: s.session_affinity.clone(),
        load_balancer_ip: s.load_balancer_ip.clone(),
        load_balancer_source_ranges: s.load_balancer_source_ranges.clone().unwrap_or_default(),
        external_name: s.external_name.clone(),
        external_traffic_policy: s.external_traffic_policy.clone(),
        health_check_node_port: s.health_check_node_port,
        publish_not_ready_addresses: s.publish_not_ready_addresses,
        session_affinity_config: s.session_affinity_config.as_ref().map(|c| {
            SessionAffinityConfig {
                client_ip: c.client_ip.as_ref().map(|ip| ClientIpConfig {
                    timeout_seconds: ip.timeout_seconds,
                }),
            }
        }),
        ip_family_policy: s.ip_family_policy.clone(),
        cluster_ips: s.cluster_ips.clone().unwrap_or_default(),
        ip_families: s.ip_families.clone().unwrap_or_default(),
        allocate_load_balancer_node_ports: s.allocate_load_balancer_node_ports,
        load_balancer_class: s.load_balancer_class.clone(),
        internal_traffic_policy: s.internal_traffic_policy.clone(),
        traffic_distribution: s.traffic_distribution.clone(),
    }
}

fn endpoint(e: &discoveryv1::Endpoint) -> Endpoint {
    let named = |n: &str| Named {
        name: Some(n.to_string()),
    };
    Endpoint {
        addresses: e.addresses.clone(),
        conditions: e.conditions.as_ref().map(|c| EndpointConditions {
            ready: c.ready,
            serving: c.serving,
            terminating: c.terminating,
        }),
        hostname: e.hostname.clone(),
        node_name: e.node_name.clone(),
        zone: e.zone.clone(),
        hints: e.hints.as_ref().map(|h| EndpointHints {
            for_zones: h
                .for_zones
                .iter()
                .flatten()
                .map(|z| named(&z.name))
                .collect(),
            for_nodes: h
                .for_nodes
                .iter()
                .flatten()
                .map(|n| named(&n.name))
                .collect(),
        }),
    }
}

/// `object` as the bytes of a protobuf list item, through the decoder's messages.
fn encode(object: &Object) -> Vec<u8> {
    match object {
        Object::Service(s) => Service {
            metadata: Some(meta(&s.metadata)),
            spec: s.spec.as_ref().map(service_spec),
            status: s.status.as_ref().map(|st| ServiceStatus {
                load_balancer: st.load_balancer.as_ref().map(|lb| LoadBalancerStatus {
                    ingress: lb
                        .ingress
                        .iter()
                        .flatten()
                        .map(|i| LoadBalancerIngress {
                            ip: i.ip.clone(),
                            hostname: i.hostname.clone(),
                            ip_mode: i.ip_mode.clone(),
                        })
                        .collect(),
                }),
            }),
        }
        .encode_to_vec(),
        Object::EndpointSlice(s) => EndpointSlice {
            metadata: Some(meta(&s.metadata)),
            endpoints: s.endpoints.iter().map(endpoint).collect(),
            ports: s
                .ports
                .iter()
                .flatten()
                .map(|p| EndpointPort {
                    name: p.name.clone(),
                    protocol: p.protocol.clone(),
                    port: p.port,
                    app_protocol: p.app_protocol.clone(),
                })
                .collect(),
            address_type: Some(s.address_type.clone()),
        }
        .encode_to_vec(),
        _ => unreachable!("only Services and EndpointSlices go in protobuf"),
    }
}

// ---- k8s-openapi's field lists, for the completeness check.

/// A deserializer that records the field names a struct's `Deserialize` asks for.
struct Recorder<'a>(&'a mut Vec<&'static str>);

impl<'de> de::Deserializer<'de> for Recorder<'_> {
    type Error = de::value::Error;
    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
        Err(de::Error::custom("not a struct"))
    }
    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        fields: &'static [&'static str],
        _: V,
    ) -> Result<V::Value, Self::Error> {
        self.0.extend(fields);
        Err(de::Error::custom("recorded"))
    }
    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
        byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map enum
        identifier ignored_any
    }
}

fn fields_of<T: DeserializeOwned>() -> Vec<&'static str> {
    let mut fields = Vec::new();
    let _ = T::deserialize(Recorder(&mut fields));
    fields
}

/// Every key of `v`, at any depth.
fn keys(v: &Value, out: &mut BTreeSet<String>) {
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                out.insert(k.clone());
                keys(v, out);
            }
        }
        Value::Array(a) => a.iter().for_each(|v| keys(v, out)),
        _ => {}
    }
}

// ---- The objects, every field set.

const TIME: &str = "2026-11-22T10:00:00Z";

fn meta_json(name: &str, labels: Value) -> Value {
    json!({
        "name": name, "namespace": "shop", "generateName": "w-", "selfLink": "/x",
        "uid": "u-1", "resourceVersion": "5", "generation": 2,
        "creationTimestamp": TIME, "deletionTimestamp": TIME, "deletionGracePeriodSeconds": 30,
        "labels": labels,
        "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": TIME, "other": "x"},
        "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "u-2",
                             "controller": true, "blockOwnerDeletion": true}],
        "finalizers": ["example.com/f"],
        "managedFields": [{"manager": "kubectl", "operation": "Update", "apiVersion": "v1",
                           "time": TIME, "fieldsType": "FieldsV1", "fieldsV1": {},
                           "subresource": ""}]
    })
}

fn service_json() -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": meta_json("web", json!({"app": "web"})),
        "spec": {
            "type": "LoadBalancer", "clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10", "fd00::10"],
            "ipFamilies": ["IPv4", "IPv6"], "ipFamilyPolicy": "PreferDualStack",
            "ports": [
                {"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080,
                 "nodePort": 30080, "appProtocol": "http"},
                {"name": "dns", "protocol": "UDP", "port": 53, "targetPort": "dns", "nodePort": 30053}
            ],
            "selector": {"app": "web"}, "externalIPs": ["192.0.2.10"],
            "sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 600}},
            "loadBalancerIP": "192.0.2.20", "loadBalancerSourceRanges": ["198.51.100.0/24"],
            "externalName": "x.example.com", "externalTrafficPolicy": "Local",
            "healthCheckNodePort": 30999, "publishNotReadyAddresses": true,
            "allocateLoadBalancerNodePorts": true, "loadBalancerClass": "example.com/lb",
            "internalTrafficPolicy": "Local", "trafficDistribution": "PreferClose"
        },
        "status": {
            "loadBalancer": {"ingress": [{"ip": "192.0.2.30", "hostname": "lb.example.com", "ipMode": "VIP",
                                          "ports": [{"port": 80, "protocol": "TCP", "error": "x"}]}]},
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": TIME,
                            "reason": "R", "message": "m", "observedGeneration": 2}]
        }
    })
}

fn slice_json() -> Value {
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": meta_json("web-1", json!({"kubernetes.io/service-name": "web"})),
        "addressType": "IPv4",
        "endpoints": [
            {"addresses": ["10.244.0.5"], "conditions": {"ready": true, "serving": true, "terminating": false},
             "hostname": "h", "nodeName": "node-a", "zone": "z1",
             "hints": {"forZones": [{"name": "z1"}], "forNodes": [{"name": "node-a"}]},
             "targetRef": {"kind": "Pod", "namespace": "shop", "name": "p"},
             "deprecatedTopology": {"k": "v"}},
            {"addresses": ["10.244.0.6"], "conditions": {"ready": false, "serving": true, "terminating": true},
             "nodeName": "node-b", "zone": "z2"}
        ],
        "ports": [{"name": "http", "protocol": "TCP", "port": 8080, "appProtocol": "http"}]
    })
}

// ---- One-field changes.

/// Another valid value for the leaf `v`, as far as one can be made.
fn changed(v: &Value) -> Option<Value> {
    Some(match v {
        Value::Bool(b) => Value::Bool(!b),
        Value::Number(n) => json!(n.as_i64()? + 1),
        Value::String(s) => {
            let s = s.as_str();
            let swap = [
                ("TCP", "UDP"),
                ("LoadBalancer", "NodePort"),
                ("Local", "Cluster"),
                ("ClientIP", "None"),
                ("PreferDualStack", "SingleStack"),
                ("IPv4", "IPv6"),
                ("VIP", "Proxy"),
                ("PreferClose", "PreferSameNode"),
                (TIME, "2026-11-22T10:00:01Z"),
            ];
            if let Some((_, to)) = swap.iter().find(|(from, _)| *from == s) {
                return Some(json!(to));
            }
            if let Some((ip, bits)) = s.split_once('/')
                && let Ok(ip) = ip.parse::<std::net::IpAddr>()
            {
                let ip = match ip {
                    std::net::IpAddr::V4(a) => {
                        std::net::IpAddr::V4((u32::from(a) + (1 << 8)).into())
                    }
                    std::net::IpAddr::V6(a) => {
                        std::net::IpAddr::V6((u128::from(a) + (1 << 16)).into())
                    }
                };
                return Some(json!(format!("{ip}/{bits}")));
            }
            match s.parse::<std::net::IpAddr>() {
                Ok(std::net::IpAddr::V4(a)) => json!(std::net::Ipv4Addr::from(u32::from(a) + 1)),
                Ok(std::net::IpAddr::V6(a)) => json!(std::net::Ipv6Addr::from(u128::from(a) + 1)),
                Err(_) => json!(format!("{s}x")),
            }
        }
        _ => return None,
    })
}

/// `v` with every one-field change: each leaf changed, each key removed.
fn one_field_changes(v: &Value, path: &str, out: &mut Vec<(String, Value)>) {
    match v {
        Value::Object(m) => {
            for (k, child) in m {
                let here = format!("{path}.{k}");
                let mut without = m.clone();
                without.remove(k);
                out.push((format!("{here} removed"), Value::Object(without)));
                let mut inner = Vec::new();
                one_field_changes(child, &here, &mut inner);
                for (what, c) in inner {
                    let mut m = m.clone();
                    m.insert(k.clone(), c);
                    out.push((what, Value::Object(m)));
                }
            }
        }
        Value::Array(a) => {
            for (i, child) in a.iter().enumerate() {
                let mut inner = Vec::new();
                one_field_changes(child, &format!("{path}[{i}]"), &mut inner);
                for (what, c) in inner {
                    let mut a = a.clone();
                    a[i] = c;
                    out.push((what, Value::Array(a)));
                }
            }
        }
        leaf => {
            if let Some(c) = changed(leaf) {
                out.push((format!("{path} = {c}"), c));
            }
        }
    }
}

/// What ingest makes of an object: its update and warnings, or its refusal, as text
/// where the types hold no equality.
fn ingested(o: &Object) -> Result<(Update, Vec<String>), String> {
    Update::of(o, &Ownership::default(), "node-a")
        .map(|(u, w)| (u, w.iter().map(ToString::to_string).collect()))
        .map_err(|e| e.to_string())
}

fn whole(kind: Kind, v: &Value) -> Option<Object> {
    match kind {
        Kind::Service => serde_json::from_value(v.clone())
            .ok()
            .map(|s| Object::Service(Box::new(s))),
        Kind::EndpointSlice => serde_json::from_value(v.clone())
            .ok()
            .map(|s| Object::EndpointSlice(Box::new(s))),
        _ => None,
    }
}

/// Every one-field change of `base` ingests the same through both decoders as whole.
fn same_on_every_path(kind: Kind, base: &Value) {
    let mut cases = vec![("as it is".to_string(), base.clone())];
    one_field_changes(base, "", &mut cases);
    let reference = ingested(&whole(kind, base).expect("the base object deserializes"));
    assert!(
        reference.is_ok(),
        "{kind}: the base object is refused: {reference:?}"
    );
    let mut read = 0;
    for (what, v) in &cases {
        // A change k8s-openapi itself refuses (a required field removed) has no whole
        // object to compare with.
        let Some(o) = whole(kind, v) else { continue };
        let want = ingested(&o);
        read += usize::from(want != reference);
        let from_pb = decode(kind, &encode(&o));
        let from_json = crate::kube::slim::decode(kind, &v.to_string());
        for (path, got) in [("protobuf", from_pb), ("JSON", from_json)] {
            let got = got
                .map_err(|e| format!("{}: {}", e.field, e.reason))
                .and_then(|d| ingested(&d));
            match (&want, &got) {
                // Refused either way: by the decoder or by ingest.
                (Err(_), Err(_)) => {}
                _ => assert_eq!(
                    got, want,
                    "{kind} {what}: the {path} decoder loses what ingest reads"
                ),
            }
        }
    }
    // The changes reach ingest (a test of nothing would pass too).
    assert!(
        read > 20,
        "{kind}: only {read} changes change what ingest makes"
    );
}

#[test]
fn every_field_ingest_reads_is_carried_by_both_decoders() {
    same_on_every_path(Kind::Service, &service_json());
    same_on_every_path(Kind::EndpointSlice, &slice_json());
}

/// The objects above set every field k8s-openapi knows of these types: a field added
/// to k8s-openapi (a new Kubernetes version) fails here until it is set above, and then
/// the test above says whether the decoders carry it.
#[test]
fn the_objects_set_every_field_k8s_openapi_knows() {
    let mut service = BTreeSet::new();
    keys(&service_json(), &mut service);
    let mut slice = BTreeSet::new();
    keys(&slice_json(), &mut slice);
    let types: [(&str, Vec<&str>, &BTreeSet<String>); 19] = [
        ("Service", fields_of::<corev1::Service>(), &service),
        ("ObjectMeta", fields_of::<ObjectMeta>(), &service),
        ("ServiceSpec", fields_of::<corev1::ServiceSpec>(), &service),
        ("ServicePort", fields_of::<corev1::ServicePort>(), &service),
        (
            "SessionAffinityConfig",
            fields_of::<corev1::SessionAffinityConfig>(),
            &service,
        ),
        (
            "ClientIPConfig",
            fields_of::<corev1::ClientIPConfig>(),
            &service,
        ),
        (
            "ServiceStatus",
            fields_of::<corev1::ServiceStatus>(),
            &service,
        ),
        (
            "LoadBalancerStatus",
            fields_of::<corev1::LoadBalancerStatus>(),
            &service,
        ),
        (
            "LoadBalancerIngress",
            fields_of::<corev1::LoadBalancerIngress>(),
            &service,
        ),
        ("PortStatus", fields_of::<corev1::PortStatus>(), &service),
        (
            "Condition",
            fields_of::<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition>(),
            &service,
        ),
        (
            "EndpointSlice",
            fields_of::<discoveryv1::EndpointSlice>(),
            &slice,
        ),
        ("ObjectMeta", fields_of::<ObjectMeta>(), &slice),
        ("Endpoint", fields_of::<discoveryv1::Endpoint>(), &slice),
        (
            "EndpointConditions",
            fields_of::<discoveryv1::EndpointConditions>(),
            &slice,
        ),
        (
            "EndpointHints",
            fields_of::<discoveryv1::EndpointHints>(),
            &slice,
        ),
        ("ForZone", fields_of::<discoveryv1::ForZone>(), &slice),
        ("ForNode", fields_of::<discoveryv1::ForNode>(), &slice),
        (
            "EndpointPort",
            fields_of::<discoveryv1::EndpointPort>(),
            &slice,
        ),
    ];
    for (name, fields, set) in types {
        assert!(!fields.is_empty(), "{name}: no field list recorded");
        for f in fields {
            assert!(set.contains(f), "{name}.{f} is not set in the test object");
        }
    }
}
