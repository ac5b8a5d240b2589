//! Packet fate under a plan (in progress).
