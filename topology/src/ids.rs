//! Id newtypes shared by every crate: requests, steps, ranks, layers, experts, placement
//! epochs, tokens and KV blocks. Bare integers never cross a module boundary.

use std::fmt;

use serde::{Deserialize, Serialize};

macro_rules! id_newtype {
    ($(#[$doc:meta])* $name:ident($inner:ty), $prefix:literal) => {
        $(#[$doc])*
        #[derive(
            Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize,
        )]
        #[serde(transparent)]
        pub struct $name(pub $inner);

        impl $name {
            /// The raw value.
            pub const fn get(self) -> $inner {
                self.0
            }

            /// The value as an index into a per-id table.
            pub const fn index(self) -> usize {
                self.0 as usize
            }
        }

        impl From<$inner> for $name {
            fn from(value: $inner) -> Self {
                Self(value)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }
    };
}

id_newtype!(
    /// One generation request, unique within an `Engine`. Displays as `req-7`.
    RequestId(u64), "req-"
);
id_newtype!(
    /// One engine step (one forward of every DP rank). Displays as `step-12`.
    StepId(u64), "step-"
);
id_newtype!(
    /// An attention data-parallel rank (one `SchedulerActor` + `RankActor`). Displays as `dp3`.
    DpRank(u16), "dp"
);
id_newtype!(
    /// An expert-parallel rank (one `ExpertGroupActor`). Displays as `ep5`.
    EpRank(u16), "ep"
);
id_newtype!(
    /// A transformer layer index (0-based, as in the checkpoint). Displays as `layer-20`.
    LayerId(u16), "layer-"
);
id_newtype!(
    /// A logical routed expert of one MoE layer (0-based, as in the checkpoint). Displays as
    /// `expert-17`.
    ExpertId(u16), "expert-"
);
id_newtype!(
    /// The version of the expert placement; a new placement commits with the next epoch at a
    /// step boundary. Displays as `epoch-4`.
    PlacementEpoch(u32), "epoch-"
);
id_newtype!(
    /// A vocabulary token id. Displays as `token-100`.
    TokenId(u32), "token-"
);
id_newtype!(
    /// A KV-cache block of the paged allocator. Displays as `block-9`.
    BlockId(u32), "block-"
);

impl StepId {
    /// The step after this one.
    pub const fn next(self) -> Self {
        Self(self.0 + 1)
    }
}

impl PlacementEpoch {
    /// The epoch after this one.
    pub const fn next(self) -> Self {
        Self(self.0 + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_display_with_their_role() {
        assert_eq!(RequestId(7).to_string(), "req-7");
        assert_eq!(StepId(12).to_string(), "step-12");
        assert_eq!(DpRank(3).to_string(), "dp3");
        assert_eq!(EpRank(5).to_string(), "ep5");
        assert_eq!(LayerId(20).to_string(), "layer-20");
        assert_eq!(ExpertId(17).to_string(), "expert-17");
        assert_eq!(PlacementEpoch(4).to_string(), "epoch-4");
        assert_eq!(TokenId(100).to_string(), "token-100");
        assert_eq!(BlockId(9).to_string(), "block-9");
    }

    #[test]
    fn ids_serialize_as_bare_numbers() {
        assert_eq!(
            serde_json::to_string(&RequestId(42)).ok().as_deref(),
            Some("42")
        );
        let back: Result<DpRank, _> = serde_json::from_str("3");
        assert_eq!(back.ok(), Some(DpRank(3)));
    }

    #[test]
    fn step_and_epoch_advance_by_one() {
        assert_eq!(StepId(9).next(), StepId(10));
        assert_eq!(PlacementEpoch(0).next(), PlacementEpoch(1));
        assert_eq!(DpRank(63).index(), 63);
    }
}
