//! Helpers shared by the test suite: checksums, process resources, and running the real binaries.

#![forbid(unsafe_code)]

pub mod proc;
pub mod checksum;
