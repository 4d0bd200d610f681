//! Snapshots: the `Persist` trait each stateful component implements, next
//! to the component in its own folder.

pub mod persist;
