//! The test suite: in-process integration tests and end-to-end tests with the real binaries.

mod auth;
mod binaries;
mod resilience;
mod support;
mod tunnel;
