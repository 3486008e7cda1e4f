// Programmatic dependent launch (sm_90+): KernelRuntime launches every kernel as a programmatic
// dependent of the kernel before it on the stream. grid_dependency_sync(), the first statement of
// every kernel, waits until the previous kernel has completed and its memory is visible — before
// this kernel reads or writes any global memory, so nothing can race. A kernel launched without
// the attribute passes the wait at once.
//
// No kernel calls griddepcontrol.launch_dependents: the next kernel is then launched as this
// one's blocks exit (the implicit trigger), its launch overlapping the end of this one, and its
// blocks are placed on a device this kernel has left. An early trigger (right after the wait, as
// before) had the next kernel's blocks resident while this one ran, packed onto the
// multiprocessors it left free: a one-wave kernel after a 64-block one ran on about half the
// device. Measured on the V4-Flash block at B = 64 (H100): 2.51 / 2.55 ms a step with the early
// trigger, 2.02 / 2.00 without, and 0.67 → 0.64 ms at B = 1 (bench/README.md, session 28).
#pragma once

__device__ __forceinline__ void grid_dependency_sync() {
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
}
