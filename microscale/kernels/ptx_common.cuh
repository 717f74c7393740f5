// PTX helpers shared by the hand-written kernels (sm100/tcgen05_gemm.cuh, sm90/wgmma_ws.cuh):
// nvrtc.compile_kernels compiles every kernel source after this one (NVRTC gets no include paths).

typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned short u16;

__device__ __forceinline__ u32 shared_address(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ u32 cluster_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// Address of the same shared-memory object in CTA `rank` of the cluster.
__device__ __forceinline__ u32 map_to_rank(u32 addr, u32 rank) {
  u32 out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(addr), "r"(rank));
  return out;
}

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// A cluster barrier in two halves: arrive (relaxed: orders nothing but itself, e.g. right after the mbarriers'
// init and its fence) and, later, wait for every thread of the cluster to have arrived.
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

// Stores into the shared memory of a CTA of the cluster (`addr` and `bar` mapped to it by map_to_rank) that
// complete their bytes on that CTA's mbarrier `bar`, as a TMA copy does: the receiver waits on its own barrier
// and nobody waits on a cluster barrier.
__device__ __forceinline__ void st_async_v4(u32 addr, float a, float b, float c, float d, u32 bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];"
               :: "r"(addr), "f"(a), "f"(b), "f"(c), "f"(d), "r"(bar) : "memory");
}
__device__ __forceinline__ void st_async_f32(u32 addr, float a, u32 bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];"
               :: "r"(addr), "f"(a), "r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}

// Waits for the barrier's phase `parity` to complete. The default acquire is CTA-scoped (TMA copies, this CTA's
// arrivals); mbar_wait_cluster acquires at cluster scope, for bytes another CTA of the cluster stored (st.async,
// whose complete-tx releases at cluster scope).
#define MS_MBAR_WAIT(SEM)                                                                      \
  asm volatile("{\n .reg .pred P;\n WAIT_%=:\n"                                              \
               " mbarrier.try_wait.parity" SEM ".shared::cta.b64 P, [%0], %1;\n"               \
               " @!P bra WAIT_%=;\n}" :: "r"(bar), "r"(parity) : "memory")
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) { MS_MBAR_WAIT(""); }
__device__ __forceinline__ void mbar_wait_cluster(u32 bar, u32 parity) { MS_MBAR_WAIT(".acquire.cluster"); }
#undef MS_MBAR_WAIT

// A CUtensorMap passed by value (nvrtc.pack_params): as a `const __grid_constant__` kernel parameter it lives
// in the constant bank, the TMA reads it there by its generic address, and a CUDA graph's launch node holds
// it, so no map has to be kept written in global memory.
struct alignas(64) TensorMap {
  u64 bits[16];
};

// Fetch a tensor map into the TMA unit's descriptor cache ahead of its first copy.
__device__ __forceinline__ void prefetch_tensormap(const TensorMap* tmap) {
  asm volatile("prefetch.tensormap [%0];" :: "l"(tmap) : "memory");
}

// Programmatic dependent launch (griddepcontrol). A kernel launched with it may start while the kernel before
// it in the stream still runs: wait_prior_grid() returns once that kernel has completed and its writes are
// visible, so nothing it writes or reads may be touched before it. release_dependents() lets the next kernel
// launch before this one ends. Both are no-ops in a kernel launched without the attribute.
__device__ __forceinline__ void wait_prior_grid() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void release_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// One TMA box of a 2-D tensor map into this CTA's shared memory, completing on `bar`.
__device__ __forceinline__ void tma_load_2d_cta(u32 dst, const TensorMap* tmap, int x, int y, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];" :: "r"(dst), "l"(tmap), "r"(x), "r"(y), "r"(bar) : "memory");
}
