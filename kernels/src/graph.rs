//! Captured launch sequences (CUDA graphs) on a runtime's stream: [`KernelRuntime::capture`]
//! records what a closure enqueues — launches, stream-ordered allocations and frees — into a
//! [`Graph`], and [`Graph::replay`] enqueues all of it again with one call. A replay reads and
//! writes the buffers the capture saw, at their addresses, and launches with the captured
//! parameters: what changes between replays must be in device memory the graph reads.
//!
//! While a capture is under way the runtime refuses what would break or falsify it: a
//! host-to-device copy through [`KernelRuntime::htod`] (a replay would copy the host bytes again
//! from memory the caller may have freed) and a wait for the stream. The refusal is the driver's
//! own `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`, returned before the driver sees the call, so the
//! capture stays valid. The per-kernel timer must be off (its events would become graph nodes).
//! Dependent launches ([`KernelRuntime::dependent_launch`]) are captured as programmatic edges
//! where the driver supports them ([`Graph::programmatic_edges`]).

use std::sync::atomic::Ordering;

use cudarc::driver::{CudaGraph, DriverError, sys};

use crate::error::KernelError;
use crate::runtime::KernelRuntime;

/// The error a guarded call returns while its runtime captures.
pub(crate) fn capture_refusal() -> DriverError {
    DriverError(sys::cudaError_enum::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
}

/// A captured, instantiated launch sequence of one runtime's stream.
pub struct Graph {
    graph: CudaGraph,
    kernels: usize,
    programmatic_edges: usize,
}

impl KernelRuntime {
    /// Captures what `body` enqueues on the runtime's stream into a [`Graph`], without running
    /// it, and returns the graph with `body`'s value. Buffers `body` allocates and frees become
    /// the graph's own memory; a buffer allocated inside and kept past the capture makes every
    /// replay after the first fail (the graph is instantiated without auto-free, so the mistake
    /// is loud). An error of `body`, or a capture the driver invalidated, ends the capture and is
    /// returned; the stream is usable afterwards.
    pub fn capture<T>(
        &self,
        body: impl FnOnce() -> Result<T, KernelError>,
    ) -> Result<(Graph, T), KernelError> {
        if self.kernel_timer().enabled() {
            return Err(KernelError::Capture {
                message: "the per-kernel timer is on, and its events cannot be captured",
            });
        }
        let stream = self.stream();
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(KernelError::driver("beginning a stream capture"))?;
        self.capturing.store(true, Ordering::Relaxed);
        let value = body();
        self.capturing.store(false, Ordering::Relaxed);
        let ended = stream.end_capture(sys::CUgraphInstantiate_flags(0));
        let value = value?;
        let graph = ended
            .map_err(KernelError::driver("ending a stream capture"))?
            .ok_or(KernelError::Capture {
                message: "the driver invalidated the capture",
            })?;
        let (kernels, programmatic_edges) = census(&graph)?;
        Ok((
            Graph {
                graph,
                kernels,
                programmatic_edges,
            },
            value,
        ))
    }

    /// Whether a capture is under way (the guarded calls refuse).
    pub fn capturing(&self) -> bool {
        self.capturing.load(Ordering::Relaxed)
    }
}

impl Graph {
    /// Enqueues the captured sequence on the stream it was captured from.
    pub fn replay(&self) -> Result<(), KernelError> {
        self.graph
            .launch()
            .map_err(KernelError::driver("replaying a captured graph"))
    }

    /// The captured kernel launches.
    pub fn kernels(&self) -> usize {
        self.kernels
    }

    /// The edges between kernels that are programmatic (a dependent launch that overlaps its
    /// predecessor's end), as opposed to full serialisation.
    pub fn programmatic_edges(&self) -> usize {
        self.programmatic_edges
    }
}

/// The graph's kernel nodes and programmatic edges.
fn census(graph: &CudaGraph) -> Result<(usize, usize), KernelError> {
    let cu_graph = graph.cu_graph();
    let mut count = 0usize;
    // SAFETY: the graph is alive (owned by `graph`); a null array asks for the count only.
    unsafe { sys::cuGraphGetNodes(cu_graph, std::ptr::null_mut(), &mut count) }
        .result()
        .map_err(KernelError::driver("counting a graph's nodes"))?;
    let mut nodes = vec![std::ptr::null_mut(); count];
    // SAFETY: `nodes` holds `count` entries.
    unsafe { sys::cuGraphGetNodes(cu_graph, nodes.as_mut_ptr(), &mut count) }
        .result()
        .map_err(KernelError::driver("listing a graph's nodes"))?;
    let mut kernels = 0;
    for &node in &nodes[..count] {
        let mut kind = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: `node` is one of the live graph's nodes.
        unsafe { sys::cuGraphNodeGetType(node, &mut kind) }
            .result()
            .map_err(KernelError::driver("reading a graph node's type"))?;
        kernels += usize::from(kind == sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL);
    }
    let mut edges = 0usize;
    // SAFETY: null arrays ask for the count only.
    unsafe {
        sys::cuGraphGetEdges_v2(
            cu_graph,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            &mut edges,
        )
    }
    .result()
    .map_err(KernelError::driver("counting a graph's edges"))?;
    let mut from = vec![std::ptr::null_mut(); edges];
    let mut to = vec![std::ptr::null_mut(); edges];
    // SAFETY: zero is a valid value of every field of the edge data.
    let mut data: Vec<sys::CUgraphEdgeData> = vec![unsafe { std::mem::zeroed() }; edges];
    // SAFETY: each array holds `edges` entries.
    unsafe {
        sys::cuGraphGetEdges_v2(
            cu_graph,
            from.as_mut_ptr(),
            to.as_mut_ptr(),
            data.as_mut_ptr(),
            &mut edges,
        )
    }
    .result()
    .map_err(KernelError::driver("listing a graph's edges"))?;
    let programmatic = data[..edges]
        .iter()
        .filter(|edge| {
            edge.type_
                == sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8
        })
        .count();
    Ok((kernels, programmatic))
}
