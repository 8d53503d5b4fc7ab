//! `tether-demo`: placeholder.
fn main() {}
