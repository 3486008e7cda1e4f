//! deepinfer-topology: the leaf crate. It owns the node/cluster topology (TOML -> raw serde
//! structs -> validated immutable config), the id newtypes every crate shares, and expert
//! placement planning (DeepSeek EPLB). It depends on serde, serde_json, config and thiserror
//! only: no tokio, no cudarc, no ractor.

pub mod eplb;
pub mod error;
pub mod ids;
pub mod load;
pub mod raw;
mod strict;
pub mod validate;

pub use eplb::{
    EplbPolicy, ExpertPlacement, LayerPlacement, PlacementShape, eplb_plan_json, rebalance_experts,
};
pub use error::{PlacementError, TopologyError};
pub use ids::{
    BlockId, DpRank, EpRank, ExpertId, LayerId, PlacementEpoch, RequestId, StepId, TokenId,
};
pub use validate::{
    Arch, Backend, ClusterConfig, ContextParallel, DEFAULT_SERVER_LISTEN, DSparkConfig,
    DeviceConfig, EplbConfig, JobConfig, MemoryConfig, MetricsConfig, ModelConfig, ModelDims,
    ModelSource, NodeConfig, Numerics, ParallelConfig, PrefixCacheConfig, PrefixReplay,
    ReplayConfig, SamplingConfig, SchedulerConfig, ServerConfig, parse_listen_address,
};
