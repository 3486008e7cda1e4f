//! `deepinfer-node`: the offline job and the `logits` tool.

fn main() {
    println!("deepinfer-node {}", env!("CARGO_PKG_VERSION"));
}
