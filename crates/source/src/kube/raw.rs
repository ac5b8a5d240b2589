//! `Raw<K>`: an API object of kind `K` kept as JSON until kproxy judges it.
//!
//! kube-rs decodes a whole LIST page (and each watch event) into `K` in one go, so a
//! typed `Api<Service>` would fail the entire list because of one object with a field
//! the typed model refuses, and the watcher would relist that same page forever. The
//! watcher therefore runs over `Raw<K>`, whose decoding never fails on a JSON object:
//! it keeps the JSON and reads only what the watcher needs (name, namespace,
//! resourceVersion). Each object is then decoded into `K` on its own (see
//! [`Raw::typed`]), so a bad object is skipped alone, with the path of the bad field.

use std::borrow::Cow;
use std::marker::PhantomData;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::de::{Deserialize, DeserializeOwned, Deserializer};
use serde_json::Value;

/// An object of kind `K` as the API server sent it.
pub struct Raw<K> {
    meta: ObjectMeta,
    value: Value,
    kind: PhantomData<fn() -> K>,
}

impl<K> Clone for Raw<K> {
    fn clone(&self) -> Self {
        Raw {
            meta: self.meta.clone(),
            value: self.value.clone(),
            kind: PhantomData,
        }
    }
}

impl<K> std::fmt::Debug for Raw<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Raw")
            .field("namespace", &self.meta.namespace)
            .field("name", &self.meta.name)
            .field("resource_version", &self.meta.resource_version)
            .finish_non_exhaustive()
    }
}

/// A string field of `metadata`, or `None` when absent or not a string.
fn meta_str(value: &Value, key: &str) -> Option<String> {
    value
        .get("metadata")?
        .get(key)?
        .as_str()
        .map(str::to_string)
}

/// Annotation kubectl keeps a full copy of the object in; never read by kproxy.
const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

impl<K> Raw<K> {
    pub fn from_value(mut value: Value) -> Self {
        // managedFields and kubectl's last-applied copy are often larger than the rest of
        // the object and never read: drop them before the typed decode copies them.
        if let Some(Value::Object(meta)) = value.get_mut("metadata") {
            meta.remove("managedFields");
            if let Some(Value::Object(annotations)) = meta.get_mut("annotations") {
                annotations.remove(LAST_APPLIED);
            }
        }
        // Only what the watcher and the reports need; the rest of metadata is judged
        // by the typed decode, where a bad label map fails this object alone.
        let meta = ObjectMeta {
            name: meta_str(&value, "name"),
            namespace: meta_str(&value, "namespace"),
            resource_version: meta_str(&value, "resourceVersion"),
            ..ObjectMeta::default()
        };
        Raw {
            meta,
            value,
            kind: PhantomData,
        }
    }

    pub fn namespace(&self) -> Option<&str> {
        self.meta.namespace.as_deref()
    }

    pub fn name(&self) -> Option<&str> {
        self.meta.name.as_deref()
    }

    pub fn into_value(self) -> Value {
        self.value
    }
}

/// Why one object could not be decoded: the field path (`.spec.ports[0].port`) and the
/// decoder's reason.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodeError {
    pub field: String,
    pub reason: String,
}

impl<K: DeserializeOwned> Raw<K> {
    /// Decodes the JSON into `K`, naming the offending field on failure.
    pub fn typed(self) -> Result<K, DecodeError> {
        serde_path_to_error::deserialize::<_, K>(self.value).map_err(|e| {
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
}

impl<'de, K> Deserialize<'de> for Raw<K> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // Any JSON value is accepted here; a non-object is refused later by `typed`.
        Value::deserialize(d).map(Raw::from_value)
    }
}

/// Same API coordinates as `K` (so `Api<Raw<Service>>` lists and watches services).
impl<K> kube::Resource for Raw<K>
where
    K: kube::Resource<DynamicType = ()>,
{
    type DynamicType = ();
    type Scope = K::Scope;

    fn kind(dt: &()) -> Cow<'_, str> {
        K::kind(dt)
    }

    fn group(dt: &()) -> Cow<'_, str> {
        K::group(dt)
    }

    fn version(dt: &()) -> Cow<'_, str> {
        K::version(dt)
    }

    fn api_version(dt: &()) -> Cow<'_, str> {
        K::api_version(dt)
    }

    fn plural(dt: &()) -> Cow<'_, str> {
        K::plural(dt)
    }

    fn meta(&self) -> &ObjectMeta {
        &self.meta
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.meta
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Service;
    use serde_json::json;

    #[test]
    fn a_bad_field_fails_only_the_typed_decode_and_names_the_field() {
        let v = json!({"metadata": {"name": "web", "namespace": "shop", "resourceVersion": "7",
                        "labels": {"a": 1}}, "spec": {"ports": "nope"}});
        let raw: Raw<Service> =
            serde_json::from_value(v).expect("raw decode never fails on an object");
        assert_eq!((raw.namespace(), raw.name()), (Some("shop"), Some("web")));
        assert_eq!(
            kube::Resource::meta(&raw).resource_version.as_deref(),
            Some("7")
        );
        let e = raw.typed().expect_err("labels.a is not a string");
        assert_eq!(e.field, ".metadata.labels.a");
    }

    #[test]
    fn bulky_metadata_is_dropped_and_the_rest_kept() {
        let v = json!({"metadata": {"name": "web", "managedFields": [{"manager": "kubectl"}],
                        "annotations": {LAST_APPLIED: "{...}", "endpoints.kubernetes.io/last-change-trigger-time": "t"}}});
        let raw: Raw<Service> = serde_json::from_value(v).unwrap();
        let meta = &raw.into_value()["metadata"];
        assert!(meta.get("managedFields").is_none());
        assert_eq!(
            meta["annotations"],
            json!({"endpoints.kubernetes.io/last-change-trigger-time": "t"})
        );
    }

    #[test]
    fn raw_has_the_coordinates_of_its_kind() {
        assert_eq!(
            <Raw<Service> as kube::Resource>::url_path(&(), None),
            "/api/v1/services"
        );
        assert_eq!(
            <Raw<k8s_openapi::api::discovery::v1::EndpointSlice> as kube::Resource>::url_path(
                &(),
                None
            ),
            "/apis/discovery.k8s.io/v1/endpointslices"
        );
    }

    #[test]
    fn non_object_json_is_accepted_then_refused_by_the_typed_decode() {
        let raw: Raw<Service> = serde_json::from_str("42").expect("any JSON value");
        assert_eq!(raw.name(), None);
        assert!(raw.typed().is_err());
    }
}
