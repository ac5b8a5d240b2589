//! Keeps a StateHandle in step with manifest files. Under construction.
