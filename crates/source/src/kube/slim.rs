//! Slim decoding of one API object: only the fields `kproxy_core::ingest` reads are
//! decoded; everything else (`managedFields`, annotations other than the endpoint
//! trigger time, owner references, a Node's images and its conditions' messages…) is skipped by serde
//! without allocating. The result is turned at once into the k8s-openapi object ingest
//! takes (one object at a time, never a list of them), so ingest's validation is shared
//! with the manifest source and nothing here re-implements it.
//!
//! Field types are as strict as k8s-openapi's for the fields kept (a port that is not
//! an integer fails the object, naming `.spec.ports[0].port`); fields not kept cannot
//! fail an object.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1 as corev1;
use k8s_openapi::api::discovery::v1 as discoveryv1;
use k8s_openapi::api::networking::v1 as networkingv1;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kproxy_core::ingest::{ANNOTATION_LAST_CHANGE_TRIGGER_TIME, Kind};
use kproxy_core::manifest::Object;
use serde::Deserialize;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, Visitor};

use super::fold::Key;

/// Why one object could not be decoded: the field path (`.spec.ports[0].port`) and the
/// decoder's reason.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodeError {
    pub field: String,
    pub reason: String,
}

/// The metadata ingest reads.
#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct Meta {
    name: Option<String>,
    namespace: Option<String>,
    labels: Option<BTreeMap<String, String>>,
    #[serde(deserialize_with = "trigger_time_only")]
    annotations: Option<BTreeMap<String, String>>,
    /// The older of two Services claiming one frontend keeps it.
    creation_timestamp: Option<Time>,
    deletion_timestamp: Option<Time>,
}

impl Meta {
    fn into_object_meta(self) -> ObjectMeta {
        ObjectMeta {
            name: self.name,
            namespace: self.namespace,
            labels: self.labels,
            annotations: self.annotations,
            creation_timestamp: self.creation_timestamp,
            deletion_timestamp: self.deletion_timestamp,
            ..ObjectMeta::default()
        }
    }
}

/// Keeps only the one annotation ingest reads; the others (kubectl's last-applied copy
/// of the whole object among them) are skipped unread.
fn trigger_time_only<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<BTreeMap<String, String>>, D::Error> {
    struct V;
    impl<'de> Visitor<'de> for V {
        type Value = Option<BTreeMap<String, String>>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a map of annotations")
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_map(self)
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut kept = BTreeMap::new();
            while let Some(k) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                if k == ANNOTATION_LAST_CHANGE_TRIGGER_TIME {
                    kept.insert(k.into_owned(), map.next_value::<String>()?);
                } else {
                    map.next_value::<IgnoredAny>()?;
                }
            }
            Ok(Some(kept))
        }
    }
    d.deserialize_option(V)
}

#[derive(Deserialize)]
struct Service {
    #[serde(default)]
    metadata: Meta,
    /// Small, and read almost whole: k8s-openapi's own type.
    spec: Option<corev1::ServiceSpec>,
    status: Option<ServiceStatus>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ServiceStatus {
    load_balancer: Option<corev1::LoadBalancerStatus>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct EndpointSlice {
    #[serde(default)]
    metadata: Meta,
    address_type: String,
    /// The API server writes a slice without endpoints (the placeholder the
    /// EndpointSlice controller keeps for a Service with no pods) as `"endpoints": null`;
    /// absent or null is no endpoints, as k8s-openapi reads it.
    #[serde(default)]
    endpoints: Option<Vec<discoveryv1::Endpoint>>,
    ports: Option<Vec<discoveryv1::EndpointPort>>,
}

#[derive(Deserialize)]
struct Node {
    #[serde(default)]
    metadata: Meta,
    spec: Option<corev1::NodeSpec>,
    status: Option<NodeStatus>,
}

/// Only the addresses and the conditions' type and status: a Node's status also lists
/// every image on the node, and each condition carries messages and times.
#[derive(Deserialize)]
struct NodeStatus {
    addresses: Option<Vec<corev1::NodeAddress>>,
    conditions: Option<Vec<NodeCondition>>,
}

/// What ingest reads of a condition (KEP-5683's `DrainInProgress`,
/// `GracefulNodeShutdownInProgress`).
#[derive(Deserialize)]
struct NodeCondition {
    #[serde(rename = "type")]
    type_: String,
    status: String,
}

/// Decodes `json` (one object of `kind`) into the object ingest takes, naming the
/// offending field on failure.
pub fn decode(kind: Kind, json: &str) -> Result<Object, DecodeError> {
    let mut d = serde_json::Deserializer::from_str(json);
    let r = match kind {
        Kind::Service => serde_path_to_error::deserialize::<_, Service>(&mut d).map(|s| {
            Object::Service(Box::new(corev1::Service {
                metadata: s.metadata.into_object_meta(),
                spec: s.spec,
                status: s.status.map(|st| corev1::ServiceStatus {
                    load_balancer: st.load_balancer,
                    conditions: None,
                }),
            }))
        }),
        Kind::EndpointSlice => {
            serde_path_to_error::deserialize::<_, EndpointSlice>(&mut d).map(|s| {
                Object::EndpointSlice(Box::new(discoveryv1::EndpointSlice {
                    metadata: s.metadata.into_object_meta(),
                    address_type: s.address_type,
                    endpoints: s.endpoints.unwrap_or_default(),
                    ports: s.ports,
                }))
            })
        }
        // Small and cluster-scoped (a handful per cluster): k8s-openapi's own type.
        Kind::ServiceCidr => {
            serde_path_to_error::deserialize::<_, networkingv1::ServiceCIDR>(&mut d)
                .map(|c| Object::ServiceCidr(Box::new(c)))
        }
        Kind::Node => serde_path_to_error::deserialize::<_, Node>(&mut d).map(|n| {
            Object::Node(Box::new(corev1::Node {
                metadata: n.metadata.into_object_meta(),
                spec: n.spec,
                status: n.status.map(|st| corev1::NodeStatus {
                    addresses: st.addresses,
                    conditions: st.conditions.map(|cs| {
                        cs.into_iter()
                            .map(|c| corev1::NodeCondition {
                                type_: c.type_,
                                status: c.status,
                                ..Default::default()
                            })
                            .collect()
                    }),
                    ..Default::default()
                }),
            }))
        }),
    };
    r.map_err(|e| {
        let path = e.path().to_string();
        let field = if path == "." {
            ".".to_string()
        } else {
            format!(".{path}")
        };
        DecodeError {
            field,
            reason: e.into_inner().to_string(),
        }
    })
}

/// What the watcher needs of any object, read leniently: a field of the wrong type
/// reads as absent, so even an object that fails [`decode`] has its key (to keep its
/// last good version) and its resourceVersion (to resume after it).
#[derive(Default)]
pub struct Coordinates {
    pub namespace: Option<String>,
    pub name: Option<String>,
    pub resource_version: Option<String>,
}

impl Coordinates {
    /// `None` when `json` is not a JSON object.
    pub fn of(json: &str) -> Option<Coordinates> {
        #[derive(Deserialize)]
        struct Outer {
            #[serde(default)]
            metadata: Lenient<MetaCoordinates>,
        }
        #[derive(Deserialize, Default)]
        #[serde(default, rename_all = "camelCase")]
        struct MetaCoordinates {
            namespace: Lenient<String>,
            name: Lenient<String>,
            resource_version: Lenient<String>,
        }
        let o: Outer = serde_json::from_str(json).ok()?;
        let m = o.metadata.0.unwrap_or_default();
        Some(Coordinates {
            namespace: m.namespace.0,
            name: m.name.0,
            resource_version: m.resource_version.0,
        })
    }

    pub fn key(&self) -> Key {
        (
            self.namespace.clone().unwrap_or_default(),
            self.name.clone().unwrap_or_default(),
        )
    }
}

/// A value of type `T`, or `None` when the JSON holds anything else (skipped unread).
struct Lenient<T>(Option<T>);

impl<T> Default for Lenient<T> {
    fn default() -> Self {
        Lenient(None)
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Lenient<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // Borrowed from the input: the raw text of this one field.
        let raw = <&serde_json::value::RawValue>::deserialize(d)?;
        Ok(Lenient(serde_json::from_str(raw.get()).ok()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn service(o: Object) -> corev1::Service {
        match o {
            Object::Service(s) => *s,
            _ => panic!("not a service"),
        }
    }

    #[test]
    fn a_bad_field_fails_the_object_and_names_the_field() {
        let v = json!({"metadata": {"name": "web", "namespace": "shop", "labels": {"a": 1}},
                       "spec": {"ports": [{"port": 80}]}});
        let e = decode(Kind::Service, &v.to_string()).unwrap_err();
        assert_eq!(e.field, ".metadata.labels.a");
        let v = json!({"metadata": {"name": "web"}, "spec": {"ports": [{"port": "eighty"}]}});
        let e = decode(Kind::Service, &v.to_string()).unwrap_err();
        assert_eq!(e.field, ".spec.ports[0].port");
        let v = json!({"metadata": {"name": "s"}, "addressType": "IPv4",
                       "endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": "maybe"}}]});
        let e = decode(Kind::EndpointSlice, &v.to_string()).unwrap_err();
        assert_eq!(e.field, ".endpoints[0].conditions.ready");
        assert!(decode(Kind::Service, "42").is_err());
    }

    #[test]
    fn unread_fields_are_skipped_whatever_they_hold() {
        let v = json!({"metadata": {"name": "web", "namespace": "shop", "resourceVersion": 7,
                         "managedFields": "not even a list", "ownerReferences": {"x": [1]},
                         "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{...}",
                                         "other": 5,
                                         ANNOTATION_LAST_CHANGE_TRIGGER_TIME: "t"}},
                       "spec": {"clusterIP": "10.96.0.1", "ports": [{"port": 80}]},
                       "status": {"conditions": "bogus", "loadBalancer": {"ingress": [{"ip": "1.2.3.4"}]}}});
        let s = service(decode(Kind::Service, &v.to_string()).unwrap());
        assert_eq!(s.metadata.name.as_deref(), Some("web"));
        assert_eq!(
            s.metadata.annotations,
            Some(BTreeMap::from([(
                ANNOTATION_LAST_CHANGE_TRIGGER_TIME.to_string(),
                "t".to_string()
            )]))
        );
        assert!(s.metadata.managed_fields.is_none());
        let ingress = s.status.unwrap().load_balancer.unwrap().ingress.unwrap();
        assert_eq!(ingress[0].ip.as_deref(), Some("1.2.3.4"));

        let n = json!({"metadata": {"name": "n", "labels": {"topology.kubernetes.io/zone": "z"},
                                    "deletionTimestamp": "2024-01-01T00:00:00Z"},
                       "spec": {"podCIDRs": ["10.244.0.0/24"], "taints": [{"key": "k", "effect": "NoSchedule"}]},
                       "status": {"images": [{"names": ["x"]}], "nodeInfo": 3,
                                  "addresses": [{"type": "InternalIP", "address": "10.0.0.1"}]}});
        let Object::Node(n) = decode(Kind::Node, &n.to_string()).unwrap() else {
            panic!("not a node")
        };
        assert!(n.metadata.deletion_timestamp.is_some());
        assert_eq!(n.status.unwrap().addresses.unwrap()[0].address, "10.0.0.1");
        assert_eq!(n.spec.unwrap().taints.unwrap()[0].key, "k");
    }

    /// KEP-5683's conditions reach ingest through the watch's slim decode: a decode that
    /// drops them (as it once dropped every condition) fails here.
    #[test]
    fn a_nodes_drain_conditions_survive_the_slim_decode() {
        let v = json!({"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": "n"},
            "status": {"addresses": [{"type": "InternalIP", "address": "10.0.0.1"}],
                       "conditions": [
                {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "ok",
                 "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z"},
                {"type": "DrainInProgress", "status": "True", "reason": "Drain"},
                {"type": "GracefulNodeShutdownInProgress", "status": "True"}]}});
        let full: corev1::Node = serde_json::from_value(v.clone()).unwrap();
        let Object::Node(slim) = decode(Kind::Node, &v.to_string()).unwrap() else {
            panic!("not a node")
        };
        let slim = kproxy_core::ingest::node(&slim).unwrap().value;
        assert!(slim.drain_in_progress && slim.graceful_node_shutdown_in_progress);
        assert_eq!(slim, kproxy_core::ingest::node(&full).unwrap().value);
    }

    #[test]
    fn the_slim_decode_matches_k8s_openapi_on_what_ingest_reads() {
        let v = json!({"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "web", "namespace": "shop", "labels": {"app": "web"}},
            "spec": {"type": "LoadBalancer", "clusterIP": "10.96.0.1", "clusterIPs": ["10.96.0.1"],
                     "ipFamilies": ["IPv4"], "externalTrafficPolicy": "Local", "healthCheckNodePort": 30000,
                     "ports": [{"name": "http", "port": 80, "nodePort": 30080, "protocol": "TCP"}],
                     "sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 60}}},
            "status": {"loadBalancer": {"ingress": [{"ip": "1.2.3.4", "ipMode": "VIP"}]}}});
        let full: corev1::Service = serde_json::from_value(v.clone()).unwrap();
        let slim = service(decode(Kind::Service, &v.to_string()).unwrap());
        let own = kproxy_core::ingest::Ownership::default();
        assert_eq!(
            kproxy_core::ingest::service(&slim, &own).unwrap(),
            kproxy_core::ingest::service(&full, &own).unwrap()
        );
    }

    /// How a real API server writes a slice with no endpoints (captured from
    /// kube-apiserver 1.36: `"endpoints": null`) must read as no endpoints, not fail the
    /// slice: failing it kept the slice's last endpoints when a Service lost its pods.
    #[test]
    fn a_slice_without_endpoints_is_empty_not_bad() {
        for endpoints in [json!(null), json!([])] {
            let v = json!({"metadata": {"name": "s", "namespace": "n",
                                        "labels": {"kubernetes.io/service-name": "web"}},
                           "addressType": "IPv4", "endpoints": endpoints});
            let Object::EndpointSlice(s) = decode(Kind::EndpointSlice, &v.to_string()).unwrap()
            else {
                panic!("not a slice")
            };
            assert!(s.endpoints.is_empty());
        }
        let v = json!({"metadata": {"name": "s"}, "addressType": "IPv4"});
        assert!(decode(Kind::EndpointSlice, &v.to_string()).is_ok());
    }

    #[test]
    fn coordinates_survive_a_bad_object() {
        let c = Coordinates::of(
            r#"{"metadata":{"name":"web","namespace":7,"resourceVersion":"9"},"spec":{"ports":1}}"#,
        )
        .unwrap();
        assert_eq!(c.key(), (String::new(), "web".to_string()));
        assert_eq!(c.resource_version.as_deref(), Some("9"));
        assert!(Coordinates::of("\"a string\"").is_none());
        assert!(
            Coordinates::of(r#"{"metadata":[]}"#)
                .unwrap()
                .name
                .is_none()
        );
    }
}
