//! Helpers shared by the test suite: checksums, process resources, and running the real binaries.

#![forbid(unsafe_code)]
// Test support: a panic is how a broken precondition fails the test that hit it.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

pub mod bins;
pub mod checksum;
pub mod daemons;
pub mod helm;
pub mod konnectivity;
pub mod netns;
pub mod nginx;
pub mod proc;
