//! deepinfer-topology: the leaf crate. It owns the node/cluster topology (TOML -> raw serde
//! structs -> validated immutable config), the id newtypes every crate shares, and expert
//! placement planning. It depends on serde, config and thiserror only: no tokio, no cudarc,
//! no ractor.
