//! The NVIDIA GPUs this process can use, and the CUDA backend on one of them.
//!
//! Owns: counting the devices for the topology's `NotEnoughGpus` check (0 without the `cuda`
//! feature or without a driver, with the reason), a device's memory for the memory plan and its
//! free memory for the state budget (`free_memory_of`), and opening a `CudaBackend` on a rank's
//! device (as one EP rank of several, with expert parallelism: `experts::device`, its rows moved
//! by device copies or NCCL, whose library is probed here and whose unique id node 0 of several
//! creates here).
//! The engine's path chooses by the `cuda` feature here and nowhere else. Never panics: cudarc's
//! dynamic loading panics on a missing `libcuda`, so the library is probed first and the first
//! call into it runs under `catch_unwind`.

use std::sync::Arc;
use std::time::Duration;

use deepinfer_model::any_model::AnyModel;
use deepinfer_model::backend::Backend;
use deepinfer_topology::{Backend as DeviceBackend, ExpertPlacement, NodeConfig, Numerics};

use crate::comm::bootstrap::UniqueId;
use crate::experts::cuda_layout::{NodeLinks, RankLinks};
use crate::experts::device::DeviceExperts;
use crate::rank::factory::OpenBackend;
use crate::rank::memory::FreeMemory;

/// The devices found, and why there are none when there are none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInventory {
    /// Usable devices (0 without the `cuda` feature or without a driver).
    pub count: usize,
    /// Why no device can be used (no CUDA support in this build, no driver, a driver error).
    pub unavailable: Option<String>,
}

/// The topology needs more GPUs than this machine offers.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{shortage}{}", reason_suffix(.reason))]
pub struct GpuShortage {
    /// The topology's `NotEnoughGpus` message (origin, required, available).
    pub shortage: String,
    /// Why fewer devices are visible, when known (e.g. no CUDA driver).
    pub reason: Option<String>,
}

fn reason_suffix(reason: &Option<String>) -> String {
    reason
        .as_ref()
        .map_or_else(String::new, |reason| format!("; {reason}"))
}

/// Fails unless this machine has the GPUs `node` needs; the CPU backend always fits.
pub fn check_node(node: &NodeConfig) -> Result<(), GpuShortage> {
    if node.device.backend == DeviceBackend::Cpu {
        return Ok(());
    }
    check_node_with(node, &inventory())
}

/// [`check_node`] against a given inventory.
pub fn check_node_with(node: &NodeConfig, gpus: &GpuInventory) -> Result<(), GpuShortage> {
    node.can_run_here(gpus.count).map_err(|e| GpuShortage {
        shortage: e.to_string(),
        reason: gpus.unavailable.clone(),
    })
}

/// Counts the devices this process can use.
#[cfg(feature = "cuda")]
pub fn inventory() -> GpuInventory {
    use deepinfer_kernels::cudarc::driver::CudaContext;

    if let Err(err) = deepinfer_kernels::runtime::driver_available() {
        return GpuInventory {
            count: 0,
            unavailable: Some(err.to_string()),
        };
    }
    match std::panic::catch_unwind(CudaContext::device_count) {
        Ok(Ok(count)) => GpuInventory {
            count: usize::try_from(count).unwrap_or(0),
            unavailable: None,
        },
        Ok(Err(err)) => GpuInventory {
            count: 0,
            unavailable: Some(format!("the CUDA driver found no usable device: {err}")),
        },
        Err(_) => GpuInventory {
            count: 0,
            unavailable: Some("the CUDA driver library failed while counting devices".to_string()),
        },
    }
}

/// Counts the devices this process can use: none in a build without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
pub fn inventory() -> GpuInventory {
    GpuInventory {
        count: 0,
        unavailable: Some(NO_CUDA_BUILD.to_string()),
    }
}

#[cfg(not(feature = "cuda"))]
const NO_CUDA_BUILD: &str = "this build has no CUDA support (rebuild with --features cuda)";

/// The memory of device `ordinal` (bytes), for the memory plan checked at start.
#[cfg(feature = "cuda")]
pub fn device_memory(ordinal: usize) -> Result<u64, String> {
    use deepinfer_kernels::cudarc::driver::CudaContext;

    deepinfer_kernels::runtime::driver_available().map_err(|e| e.to_string())?;
    std::panic::catch_unwind(|| CudaContext::new(ordinal).and_then(|ctx| ctx.total_mem()))
        .map_err(|_| format!("device {ordinal}: the CUDA driver failed reading its memory"))?
        .map(|bytes| bytes as u64)
        .map_err(|e| format!("device {ordinal}: {e}"))
}

/// The memory of device `ordinal`: an error in a build without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
pub fn device_memory(ordinal: usize) -> Result<u64, String> {
    Err(format!("device {ordinal}: {NO_CUDA_BUILD}"))
}

/// The CUDA backend on device `ordinal` with `numerics` (compiles or loads the kernels; call it
/// on the thread that will use it). A clear error, never a panic, without a driver or without the
/// feature.
#[cfg(feature = "cuda")]
pub fn open_cuda_backend(ordinal: usize, numerics: Numerics) -> Result<Box<dyn Backend>, String> {
    deepinfer_model::backend::cuda::CudaBackend::open(ordinal, numerics)
        .map(|backend| Box::new(backend) as Box<dyn Backend>)
        .map_err(|e| e.to_string())
}

/// The CUDA backend on device `ordinal`: an error in a build without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
pub fn open_cuda_backend(ordinal: usize, _numerics: Numerics) -> Result<Box<dyn Backend>, String> {
    Err(format!("device {ordinal}: {NO_CUDA_BUILD}"))
}

/// How to read the free memory of `backend`'s device: a `CudaBackend`'s memory probe (the
/// driver's count once its stream is idle, its pool's reusable memory handed back first);
/// `None` for a host backend.
#[cfg(feature = "cuda")]
pub fn free_memory_of(backend: &dyn Backend) -> Option<Arc<dyn FreeMemory>> {
    use deepinfer_model::backend::cuda::{CudaBackend, DeviceMemoryProbe};

    struct Probe(DeviceMemoryProbe);

    impl FreeMemory for Probe {
        fn free_bytes(&self) -> Result<u64, String> {
            self.0
                .free_and_total()
                .map(|(free, _)| free)
                .map_err(|e| e.to_string())
        }
    }

    let cuda = backend.as_any().downcast_ref::<CudaBackend>()?;
    Some(Arc::new(Probe(cuda.memory_probe())))
}

/// How to read the free memory of `backend`'s device: never in a build without the `cuda`
/// feature (every backend is a host one).
#[cfg(not(feature = "cuda"))]
pub fn free_memory_of(_backend: &dyn Backend) -> Option<Arc<dyn FreeMemory>> {
    None
}

/// Whether the NCCL library loads (EP ranks on several GPUs need it), checked before anything
/// loads; never panics.
#[cfg(feature = "cuda")]
pub fn nccl_available() -> Result<(), String> {
    deepinfer_model::backend::cuda::nccl::library_available()
}

/// Whether the NCCL library loads: never in a build without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
pub fn nccl_available() -> Result<(), String> {
    Err(NO_CUDA_BUILD.to_string())
}

/// NCCL's unique id for the nodes of a deployment (`ncclGetUniqueId`, on node 0 at the node
/// bootstrap, `experts::cuda_layout::join_nodes`); a missing `libnccl.so` is an error naming it.
#[cfg(feature = "cuda")]
pub fn nccl_unique_id() -> Result<UniqueId, String> {
    deepinfer_model::backend::cuda::nccl::unique_id()
        .map(|id| id.map(|c| c as u8))
        .map_err(|e| e.to_string())
}

/// NCCL's unique id: an error in a build without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
pub fn nccl_unique_id() -> Result<UniqueId, String> {
    Err(NO_CUDA_BUILD.to_string())
}

/// How DP = EP ranks on CUDA open their backends (`experts::device`): this process's DP rank r
/// opens its device with `numerics` and serves as EP rank r of `placement` (epoch 0; across
/// nodes, global EP rank `nodes.first_rank + r` of `nodes.ranks`), its slots' experts of
/// `model` uploaded there and nothing else of the routed experts, registered in `group`
/// (which swaps its placements); the ranks move rows through `links` (device copies, or NCCL
/// communicators created by the last rank to open, across nodes joined through node 0's unique
/// id): every collective's wait lasts at most `timeout`, creating the NCCL communicators (every
/// rank of every node joining) at most `join`.
#[cfg(feature = "cuda")]
pub fn cuda_expert_ranks(
    model: AnyModel,
    numerics: Numerics,
    placement: Arc<ExpertPlacement>,
    group: Arc<DeviceExperts>,
    links: RankLinks,
    nodes: Option<&NodeLinks>,
    timeout: Duration,
    join: Duration,
) -> OpenBackend {
    use deepinfer_model::backend::cuda::CudaBackend;
    use deepinfer_model::backend::cuda::ep::ExpertRank;
    use deepinfer_model::backend::cuda::ep_transport::{RowTransport, SharedDevice};
    use deepinfer_model::backend::cuda::nccl::{NcclDevices, NcclTimeouts, NcclWorld};

    enum Transport {
        Shared(Arc<dyn RowTransport>),
        Nccl(Arc<NcclDevices>),
    }
    let local = group.lockstep().ranks();
    let (first, ranks) = nodes.map_or((0, local), |n| (n.first_rank, n.ranks));
    let world = nodes.map(|n| NcclWorld {
        id: n.unique_id.map(|b| b as std::ffi::c_char),
        first: n.first_rank,
        ranks: n.ranks,
    });
    let transport = match links {
        RankLinks::SharedDevice => Transport::Shared(SharedDevice::new(local, timeout)),
        RankLinks::Nccl => {
            let timeouts = NcclTimeouts {
                exchange: timeout,
                join,
            };
            Transport::Nccl(NcclDevices::new(local, timeouts, world))
        }
    };
    Arc::new(move |dp, ordinal| {
        let backend = CudaBackend::open(ordinal, numerics).map_err(|e| e.to_string())?;
        let ep = first + dp;
        let transport = match &transport {
            Transport::Shared(transport) => transport.clone(),
            Transport::Nccl(devices) => devices
                .open_rank(dp, backend.runtime().stream().clone())
                .map_err(|e| {
                    format!(
                        "EP rank {ep} of {ranks} on GPU {ordinal} (one rank per GPU, {local} \
                         on this node: rows move through NCCL): {e}"
                    )
                })? as Arc<dyn RowTransport>,
        };
        let rank = ExpertRank::new(
            &backend,
            &model.experts().expert_lists(),
            placement.clone(),
            0,
            ep,
            ep,
            transport,
        )
        .map_err(|e| format!("EP rank {ep} of {ranks}: {e}"))?;
        let rank = Arc::new(rank);
        let slot = backend.expert_slot();
        slot.set(Some(rank.clone()));
        group.register(
            dp,
            Arc::new(cuda_rank::CudaRank::new(model.clone(), slot, rank)),
        );
        Ok(Box::new(backend) as Box<dyn Backend>)
    })
}

/// DP = EP ranks on CUDA: every rank fails to open in a build without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
pub fn cuda_expert_ranks(
    _model: AnyModel,
    _numerics: Numerics,
    _placement: Arc<ExpertPlacement>,
    _group: Arc<DeviceExperts>,
    _links: RankLinks,
    _nodes: Option<&NodeLinks>,
    _timeout: Duration,
    _join: Duration,
) -> OpenBackend {
    Arc::new(|_dp, ordinal| Err(format!("device {ordinal}: {NO_CUDA_BUILD}")))
}

/// A CUDA `ExpertRank` as the engine's `DeviceRank`: the rank in use (in its backend's slot) and
/// the one staged for the next epoch.
#[cfg(feature = "cuda")]
mod cuda_rank {
    use std::sync::{Arc, Mutex, MutexGuard};

    use deepinfer_model::any_model::AnyModel;
    use deepinfer_model::backend::Backend;
    use deepinfer_model::backend::cuda::CudaBackend;
    use deepinfer_model::backend::cuda::ep::{ExpertRank, ExpertSlot};
    use deepinfer_topology::{EpRank, ExpertPlacement, PlacementEpoch};

    use crate::experts::device::DeviceRank;
    use crate::messages::experts::ShardLoads;

    pub struct CudaRank {
        model: AnyModel,
        slot: Arc<ExpertSlot>,
        /// `(in use, staged)`.
        ranks: Mutex<(Arc<ExpertRank>, Option<ExpertRank>)>,
    }

    impl CudaRank {
        pub fn new(model: AnyModel, slot: Arc<ExpertSlot>, rank: Arc<ExpertRank>) -> CudaRank {
            CudaRank {
                model,
                slot,
                ranks: Mutex::new((rank, None)),
            }
        }

        fn ranks(&self) -> MutexGuard<'_, (Arc<ExpertRank>, Option<ExpertRank>)> {
            self.ranks.lock().unwrap_or_else(|p| p.into_inner())
        }
    }

    fn cuda(backend: &dyn Backend) -> Result<&CudaBackend, String> {
        backend
            .as_any()
            .downcast_ref::<CudaBackend>()
            .ok_or_else(|| format!("an EP rank on a {} backend, not CUDA", backend.name()))
    }

    impl DeviceRank for CudaRank {
        fn epoch(&self) -> PlacementEpoch {
            PlacementEpoch(self.ranks().0.epoch())
        }

        fn take_loads(&self) -> ShardLoads {
            let current = self.ranks().0.clone();
            ShardLoads {
                epoch: PlacementEpoch(current.epoch()),
                per_slot: current.take_loads(),
            }
        }

        fn stage(
            &self,
            backend: &dyn Backend,
            placement: Arc<ExpertPlacement>,
            epoch: PlacementEpoch,
        ) -> Result<usize, String> {
            let current = self.ranks().0.clone();
            let rank = EpRank(current.rank() as u16);
            let uploaded = placement.released_by(current.placement(), rank).len();
            let next = current
                .next_epoch(
                    cuda(backend)?,
                    &self.model.experts().expert_lists(),
                    placement,
                    epoch.get(),
                )
                .map_err(|e| format!("staging {epoch} on EP rank {}: {e}", current.rank()))?;
            self.ranks().1 = Some(next);
            Ok(uploaded)
        }

        fn adopt(&self, backend: &dyn Backend, epoch: PlacementEpoch) -> Result<usize, String> {
            let mut ranks = self.ranks();
            let next = match ranks.1.take() {
                Some(next) if next.epoch() == epoch.get() => Arc::new(next),
                other => {
                    return Err(format!(
                        "EP rank {}: {epoch} committed, but the staged rank is {:?}",
                        ranks.0.rank(),
                        other.map(|r| r.epoch())
                    ));
                }
            };
            let previous = std::mem::replace(&mut ranks.0, next.clone());
            self.slot.set(Some(next.clone()));
            Ok(next.release_moved(
                cuda(backend)?,
                &self.model.experts().expert_lists(),
                &previous,
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cuda_node(gpus_per_node: u16) -> NodeConfig {
        let text = format!(
            "[model]\nsource = \"demo\"\n[device]\nbackend = \"cuda\"\ngpus_per_node = {gpus_per_node}\n\
             [parallel]\ndp = {gpus_per_node}\nep = {gpus_per_node}\n"
        );
        NodeConfig::from_toml_str(&text, "gpu test topology").unwrap()
    }

    #[test]
    fn a_shortage_names_the_topology_the_count_and_the_reason() {
        let none = GpuInventory {
            count: 0,
            unavailable: Some("no CUDA driver".to_string()),
        };
        let err = check_node_with(&cuda_node(1), &none).unwrap_err();
        let text = err.to_string();
        assert!(
            text.starts_with("gpu test topology: needs 1 GPUs"),
            "{text}"
        );
        assert!(text.contains("only 0 are available"), "{text}");
        assert!(text.ends_with("available here; no CUDA driver"), "{text}");
        assert!(!text.contains('\n'), "{text}");

        let one = GpuInventory {
            count: 1,
            unavailable: None,
        };
        assert_eq!(check_node_with(&cuda_node(1), &one), Ok(()));
        let short = check_node_with(&cuda_node(2), &one).unwrap_err();
        assert_eq!(short.reason, None);
        assert!(short.to_string().contains("needs 2 GPUs"), "{short}");
    }

    #[test]
    fn the_cpu_backend_needs_no_gpu() {
        let node = NodeConfig::embedded_default().unwrap();
        assert_eq!(check_node(&node), Ok(()));
    }

    /// On a machine without a driver (or a build without `cuda`) the inventory is empty with a
    /// reason, and opening a backend is an error, not a panic.
    #[test]
    fn no_device_is_a_reason_not_a_panic() {
        let gpus = std::panic::catch_unwind(inventory).expect("counting never panics");
        if gpus.count == 0 {
            let reason = gpus.unavailable.expect("a reason for no device");
            assert!(
                reason.contains("CUDA support") || reason.contains("CUDA driver"),
                "{reason}"
            );
            let opened =
                std::panic::catch_unwind(|| open_cuda_backend(0, Numerics::Exact).map(|_| ()))
                    .expect("opening never panics");
            assert!(opened.is_err());
        }
    }
}
