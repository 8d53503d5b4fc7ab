//! Agent authentication: JWTs checked against each tenant's issuer keys.

pub mod keys;
pub mod token;
