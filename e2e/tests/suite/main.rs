//! The test suite: in-process integration tests and end-to-end tests with the real binaries.
// A test helper that panics is reporting a failed precondition of the test that called it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod auth;
mod binaries;
mod charts;
mod forward;
mod grpc;
mod ha;
mod loadtest;
mod oidc;
mod paths;
mod resilience;
mod support;
mod tenancy;
mod topology;
mod tunnel;
