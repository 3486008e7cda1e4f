//! [`ModelFactory`]: the one `ExecutorFactory` over a loaded model of either family
//! ([`AnyModel`]). Each DP rank gets a `ModelExecutor` over the shared weights: on the loaded
//! model's own backend (the CPU), or, with [`RankDevices`], rebound (`Model::on_backend`) to a
//! backend opened on the rank's own device, on the rank's thread (with expert parallelism on
//! CUDA, a backend serving as the rank's EP rank, the ranks stepping through `DeviceExperts`);
//! a device backend's free memory is read through its probe (`gpu::free_memory_of`) for the
//! rank's state budget (`RankExecutor::state_memory`).

use std::sync::Arc;

use deepinfer_model::any_model::AnyModel;
use deepinfer_model::backend::Backend;
use deepinfer_model::config::ModelFamily;
use deepinfer_model::state_bytes::StateBytes;

use crate::experts::cuda_layout::device_of;
use crate::experts::device::DeviceExperts;
use crate::gpu;
use crate::prefix_cache::PrefixGeometry;
use crate::rank::executor::{ExecError, ExecutorFactory, RankExecutor};
use crate::rank::memory::DeviceMemory;
use crate::rank::model_executor::ModelExecutor;

/// Opens the backend of DP rank `dp` (first argument) on device ordinal `device` (second);
/// called on the rank thread that will use it.
pub type OpenBackend = Arc<dyn Fn(usize, usize) -> Result<Box<dyn Backend>, String> + Send + Sync>;

/// Where the ranks run when each has a device of its own: DP rank `r` on device
/// `r % per_node` of its node (`experts::cuda_layout::device_of`).
#[derive(Clone)]
pub struct RankDevices {
    /// Devices of one node (`[device] gpus_per_node`), at least 1.
    pub per_node: usize,
    pub open: OpenBackend,
    /// The backends are EP ranks whose MoE layers are collectives: the ranks step together
    /// (and swap placements) through this group.
    pub experts: Option<Arc<DeviceExperts>>,
}

/// Hands every DP rank an executor over the shared loaded weights.
#[derive(Clone)]
pub struct ModelFactory {
    pub model: AnyModel,
    pub description: String,
    /// `None`: every rank runs the loaded model on its own backend.
    pub devices: Option<RankDevices>,
}

impl ModelFactory {
    /// Every rank runs `model` on the backend it was loaded with.
    pub fn new(model: impl Into<AnyModel>, description: impl Into<String>) -> ModelFactory {
        ModelFactory {
            model: model.into(),
            description: description.into(),
            devices: None,
        }
    }

    /// Each rank runs `model`'s weights on a backend of its own device.
    pub fn per_device(
        model: impl Into<AnyModel>,
        description: impl Into<String>,
        devices: RankDevices,
    ) -> ModelFactory {
        ModelFactory {
            devices: Some(devices),
            ..ModelFactory::new(model, description)
        }
    }
}

impl std::fmt::Debug for ModelFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelFactory")
            .field("description", &self.description)
            .field(
                "devices_per_node",
                &self.devices.as_ref().map(|d| d.per_node),
            )
            .finish()
    }
}

impl ExecutorFactory for ModelFactory {
    fn build(&self, dp: usize) -> Result<Box<dyn RankExecutor>, ExecError> {
        let Some(devices) = &self.devices else {
            return Ok(Box::new(ModelExecutor::new(self.model.clone())));
        };
        let device = device_of(dp, devices.per_node);
        let backend = (devices.open)(dp, device)
            .map_err(|e| ExecError::Backend(format!("DP rank {dp} on device {device}: {e}")))?;
        tracing::info!(dp, backend = backend.name(), "rank model on its device");
        let experts = devices.experts.clone().map(|experts| (experts, dp));
        let memory =
            gpu::free_memory_of(backend.as_ref()).map(|probe| DeviceMemory { device, probe });
        Ok(Box::new(
            ModelExecutor::new(self.model.on_backend(backend))
                .with_device_experts(experts)
                .with_device_memory(memory),
        ))
    }

    fn describe(&self) -> String {
        self.description.clone()
    }

    /// V4.1's decoder window (bounded replay); V4 has no decoder bounded replay.
    fn sliding_window(&self) -> Option<usize> {
        self.model.decoder_window()
    }

    fn family(&self) -> ModelFamily {
        self.model.config().family
    }

    fn state_bytes(&self) -> Option<StateBytes> {
        Some(StateBytes::of(self.model.config()))
    }

    fn device_experts(&self) -> Option<Arc<DeviceExperts>> {
        self.devices.as_ref().and_then(|d| d.experts.clone())
    }

    /// Either family's executors keep prefix blocks (`ModelExecutor`).
    fn prefix_geometry(&self) -> Option<PrefixGeometry> {
        Some(PrefixGeometry::of(self.model.config()))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use deepinfer_model::backend::CpuBackend;
    use deepinfer_model::checkpoint::write_random_checkpoint;
    use deepinfer_model::config::ModelConfig;
    use deepinfer_topology::RequestId;

    use super::*;
    use crate::experts::tiny_test_model;
    use crate::rank::executor::{SeqTokens, execute_rows};

    /// Prefill then one decode step; the concatenated last rows.
    fn run(executor: &mut dyn RankExecutor, prompt: &[u32]) -> Vec<f32> {
        let id = RequestId(1);
        executor.new_sequence(id).expect("new sequence");
        let entry = |tokens| SeqTokens {
            id,
            tokens,
            all_rows: false,
        };
        let mut rows = execute_rows(executor, &[entry(prompt)]).expect("prefill");
        rows.extend(execute_rows(executor, &[entry(&[7])]).expect("decode"));
        rows.concat()
    }

    /// The (DP rank, device ordinal) of each backend opened.
    type Opened = Arc<Mutex<Vec<(usize, usize)>>>;

    /// Per-rank CPU backends that record what they open.
    fn recording_devices(per_node: usize) -> (RankDevices, Opened) {
        let opened = Arc::new(Mutex::new(Vec::new()));
        let log = opened.clone();
        let devices = RankDevices {
            per_node,
            open: Arc::new(move |dp, device| {
                log.lock().expect("not poisoned").push((dp, device));
                Ok(Box::new(CpuBackend::new()) as Box<dyn Backend>)
            }),
            experts: None,
        };
        (devices, opened)
    }

    /// Each rank opens its own device (rank r -> device r % per node) and runs the shared
    /// weights there: on CPU backends the numbers equal the shared model's bit for bit, for
    /// either family, and the family's facts are reported.
    #[test]
    fn each_rank_runs_the_shared_weights_on_its_own_device() {
        let (_v41_dir, v41) = tiny_test_model();
        let v4_dir = tempfile::tempdir().expect("temp dir");
        write_random_checkpoint(&ModelConfig::tiny_v4(), 3, v4_dir.path(), 1).expect("written");
        let v4 = Arc::new(deepinfer_model::v4::Model::load(v4_dir.path()).expect("loads"));
        let window = v41.config().window_size;
        for (model, family, sliding_window) in [
            (AnyModel::from(v41), ModelFamily::V41, Some(window)),
            (AnyModel::from(v4), ModelFamily::V4, None),
        ] {
            let (devices, opened) = recording_devices(2);
            let factory = ModelFactory::per_device(model.clone(), "per-rank CPU backends", devices);
            let plain = ModelFactory::new(model, "shared");
            let prompt = [3, 14, 15, 92, 65];
            let expected = run(plain.build(0).expect("plain").as_mut(), &prompt);
            assert_eq!(expected.len(), 2 * plain.model.config().vocab_size);
            for dp in 0..3 {
                let got = run(factory.build(dp).expect("per device").as_mut(), &prompt);
                assert_eq!(got, expected, "{family:?} rank {dp}");
            }
            assert_eq!(
                *opened.lock().expect("not poisoned"),
                vec![(0, 0), (1, 1), (2, 0)]
            );
            for f in [&plain, &factory] {
                assert_eq!(f.family(), family);
                assert_eq!(f.sliding_window(), sliding_window);
            }
        }
    }

    #[test]
    fn a_device_that_does_not_open_fails_the_rank_with_its_reason() {
        let (_dir, model) = tiny_test_model();
        let devices = RankDevices {
            per_node: 4,
            open: Arc::new(|_dp, device| Err(format!("no CUDA driver for device {device}"))),
            experts: None,
        };
        let factory = ModelFactory::per_device(model, "no device", devices);
        let err = factory.build(5).err().expect("the device does not open");
        assert_eq!(
            err,
            ExecError::Backend("DP rank 5 on device 1: no CUDA driver for device 1".into())
        );
    }
}
