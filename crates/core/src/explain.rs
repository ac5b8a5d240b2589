//! Explanations (in progress).
