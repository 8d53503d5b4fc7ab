//! `tether-loadtest`: placeholder until the scenarios land.
fn main() {}
