// Programmatic dependent launch (sm_90+): KernelRuntime launches every kernel so that it may start
// while the kernel before it on the stream is still running (its blocks resident and set up when
// that kernel ends, not launched after it). grid_dependency_sync(), the first statement of every
// kernel, waits until the previous kernel has completed and its memory is visible — before this
// kernel reads or writes any global memory, so nothing can race — then lets the next kernel launch
// early in turn. A kernel launched without the attribute passes the wait at once.
#pragma once

__device__ __forceinline__ void grid_dependency_sync() {
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}
