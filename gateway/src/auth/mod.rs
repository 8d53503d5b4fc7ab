//! Agent authentication: JWTs checked against each tenant's issuer keys (a file, a URL or OIDC
//! discovery, cached and refreshed), or by the tenant's kube-apiserver (TokenReview).

pub mod key_store;
pub mod keys;
pub mod token;
pub mod token_review;
