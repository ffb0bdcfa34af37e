//! Placeholder, replaced by the wake-up work.
fn main() {}
