//! The fake API server's store of the objects a tool creates (namespaces, Services,
//! pods, …), for tests of commands that write to the cluster (`kproxy
//! connectivity-test`): `POST` to a collection (with `generateName`), `GET` of an
//! object, of a collection (`labelSelector` of `key=value` terms) and of a pod's `log`
//! (text the test set), `DELETE` of an object (a namespace takes its objects with it; a
//! pod bound to a node, unless `gracePeriodSeconds` is 0, only gets its
//! `deletionTimestamp`, as the API server leaves it to its kubelet to end).
//! It runs no controller and no kubelet: a test plays them through [`Objects::update`],
//! [`Objects::set_log`] and the hook [`Objects::on_create`]. Every call is recorded.

use std::collections::BTreeMap;
use std::sync::Mutex;

use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::{lock, status};

/// A hook given each object as it is created, with its collection's path.
type OnCreate = Box<dyn Fn(&str, &mut Value) + Send + Sync>;

/// The store: objects by path (`/api/v1/namespaces/NS/pods/NAME`).
#[derive(Default)]
pub struct Objects {
    objects: Mutex<BTreeMap<String, Value>>,
    logs: Mutex<BTreeMap<String, String>>,
    calls: Mutex<Vec<(Method, String)>>,
    on_create: Mutex<Option<OnCreate>>,
    serial: Mutex<u64>,
}

/// What a path names, by its segments after `/api/v1/` or `/apis/GROUP/VERSION/`.
enum Target {
    Collection,
    Object,
    /// A pod's log: the pod's path.
    Log(String),
}

fn target(path: &str) -> Option<Target> {
    let rest = if let Some(r) = path.strip_prefix("/api/v1/") {
        r
    } else {
        let r = path.strip_prefix("/apis/")?;
        let mut parts = r.splitn(3, '/');
        let (_group, _version, rest) = (parts.next()?, parts.next()?, parts.next()?);
        rest
    };
    let segments = rest.split('/').count();
    Some(
        if let Some(pod) = path.strip_suffix("/log").filter(|_| segments == 5) {
            Target::Log(pod.to_string())
        } else if segments % 2 == 1 {
            Target::Collection
        } else {
            Target::Object
        },
    )
}

/// Whether `object`'s labels hold every `key=value` (or `key`) term of `selector`.
fn selected(object: &Value, selector: Option<&str>) -> bool {
    let labels = &object["metadata"]["labels"];
    selector.is_none_or(|s| {
        s.split(',')
            .filter(|t| !t.is_empty())
            .all(|term| match term.split_once('=') {
                Some((k, v)) => labels[k].as_str() == Some(v),
                None => !labels[term].is_null(),
            })
    })
}

/// Now, as the API server writes a timestamp.
fn now() -> String {
    let now = k8s_openapi::jiff::Timestamp::now();
    now.round(k8s_openapi::jiff::Unit::Second)
        .unwrap_or(now)
        .to_string()
}

fn error(code: StatusCode, reason: &str) -> Response {
    (code, axum::Json(status(code, reason))).into_response()
}

impl Objects {
    /// Every object under `prefix` (a collection's path, or a namespace's), by path.
    pub fn under(&self, prefix: &str) -> Vec<(String, Value)> {
        lock(&self.objects)
            .range(prefix.to_string()..)
            .take_while(|(p, _)| p.starts_with(prefix))
            .map(|(p, v)| (p.clone(), v.clone()))
            .collect()
    }

    /// The object at `path`.
    pub fn get(&self, path: &str) -> Option<Value> {
        lock(&self.objects).get(path).cloned()
    }

    /// Puts `object` at `path` as it is (a test's fixture: creationTimestamp and all).
    pub fn insert(&self, path: &str, object: Value) {
        lock(&self.objects).insert(path.to_string(), object);
    }

    /// Removes the object at `path` (a test's fixture gone), as it was.
    pub fn remove(&self, path: &str) -> Option<Value> {
        lock(&self.objects).remove(path)
    }

    /// Changes the object at `path` (a controller or kubelet at work); false: none.
    pub fn update(&self, path: &str, change: impl FnOnce(&mut Value)) -> bool {
        match lock(&self.objects).get_mut(path) {
            Some(object) => {
                change(object);
                true
            }
            None => false,
        }
    }

    /// The text a `GET …/log` of the pod at `path` answers.
    pub fn set_log(&self, path: &str, text: &str) {
        lock(&self.logs).insert(path.to_string(), text.to_string());
    }

    /// Calls `hook` with every object created from now on (before it is stored and
    /// answered): an API server's allocations (cluster IPs, node ports).
    pub fn on_create(&self, hook: impl Fn(&str, &mut Value) + Send + Sync + 'static) {
        *lock(&self.on_create) = Some(Box::new(hook));
    }

    /// Every call, in order: method and path.
    pub fn calls(&self) -> Vec<(Method, String)> {
        lock(&self.calls).clone()
    }

    /// Answers a call to `path`, or `None` when it is no path of this store.
    pub fn serve(
        &self,
        method: &Method,
        path: &str,
        query: &BTreeMap<String, String>,
        body: &[u8],
    ) -> Option<Response> {
        let target = target(path)?;
        lock(&self.calls).push((method.clone(), path.to_string()));
        Some(match (method, target) {
            (&Method::POST, Target::Collection) => self.create(path, body),
            (&Method::GET, Target::Collection) => {
                let items: Vec<Value> = self
                    .under(&format!("{path}/"))
                    .into_iter()
                    // Directly in the collection, not in a namespace it holds.
                    .filter(|(p, _)| !p[path.len() + 1..].contains('/'))
                    .map(|(_, v)| v)
                    .filter(|v| selected(v, query.get("labelSelector").map(String::as_str)))
                    .collect();
                axum::Json(json!({"kind": "List", "apiVersion": "v1",
                    "metadata": {"resourceVersion": "1"}, "items": items}))
                .into_response()
            }
            (&Method::GET, Target::Object) => match self.get(path) {
                Some(v) => axum::Json(v).into_response(),
                None => error(StatusCode::NOT_FOUND, "NotFound"),
            },
            (&Method::GET, Target::Log(pod)) => {
                match (self.get(&pod), lock(&self.logs).get(&pod)) {
                    (Some(_), Some(text)) => text.clone().into_response(),
                    (Some(_), None) => String::new().into_response(),
                    (None, _) => error(StatusCode::NOT_FOUND, "NotFound"),
                }
            }
            (&Method::DELETE, Target::Object) => {
                let options: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
                let graceful = |o: &Value| {
                    o["kind"] == "Pod"
                        && o["spec"]["nodeName"].is_string()
                        && options["gracePeriodSeconds"] != 0
                };
                if let Some(o) = lock(&self.objects).get_mut(path).filter(|o| graceful(o)) {
                    if o["metadata"]["deletionTimestamp"].is_null() {
                        o["metadata"]["deletionTimestamp"] = json!(now());
                    }
                    return Some(axum::Json(o.clone()).into_response());
                }
                let removed = {
                    let mut objects = lock(&self.objects);
                    let removed = objects.remove(path);
                    if removed.is_some() {
                        // A namespace's objects go with it.
                        objects.retain(|p, _| !p.starts_with(&format!("{path}/")));
                    }
                    removed
                };
                match removed {
                    Some(v) => axum::Json(v).into_response(),
                    None => error(StatusCode::NOT_FOUND, "NotFound"),
                }
            }
            _ => error(StatusCode::METHOD_NOT_ALLOWED, "MethodNotAllowed"),
        })
    }

    fn create(&self, collection: &str, body: &[u8]) -> Response {
        let Ok(mut object) = serde_json::from_slice::<Value>(body) else {
            return error(StatusCode::BAD_REQUEST, "BadRequest");
        };
        let serial = {
            let mut s = lock(&self.serial);
            *s += 1;
            *s
        };
        let meta = &mut object["metadata"];
        if meta["name"].as_str().is_none_or(str::is_empty) {
            match meta["generateName"].as_str() {
                Some(prefix) => meta["name"] = json!(format!("{prefix}{serial:05x}")),
                None => return error(StatusCode::UNPROCESSABLE_ENTITY, "Invalid"),
            }
        }
        if let Some(ns) = collection
            .strip_prefix("/api/v1/namespaces/")
            .and_then(|r| r.split('/').next())
        {
            meta["namespace"] = json!(ns);
        }
        meta["uid"] = json!(format!("uid-{serial}"));
        meta["resourceVersion"] = json!(serial.to_string());
        meta["creationTimestamp"] = json!(now());
        let name = meta["name"].as_str().unwrap_or_default().to_string();
        let path = format!("{collection}/{name}");
        if let Some(hook) = lock(&self.on_create).as_ref() {
            hook(collection, &mut object);
        }
        {
            let mut objects = lock(&self.objects);
            if objects.contains_key(&path) {
                return error(StatusCode::CONFLICT, "AlreadyExists");
            }
            objects.insert(path, object.clone());
        }
        (StatusCode::CREATED, axum::Json(object)).into_response()
    }
}
