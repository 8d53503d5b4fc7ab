//! Helpers shared by the test suite: checksums, process resources, and running the real binaries.

#![forbid(unsafe_code)]

pub mod bins;
pub mod checksum;
pub mod proc;
