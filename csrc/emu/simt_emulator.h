// A SIMT emulator that runs the CUDA kernels of csrc/cuda/ on the CPU, for tests on machines
// without a GPU. It is not a simulator of the hardware: it checks the *logic* of a kernel (its
// indexing, its per-thread arithmetic, its use of barriers and warp collectives), not its
// performance or its memory model.
//
// How it runs a launch: blocks run one after another; the threads of a block are fibers
// (ucontext) on the calling OS thread, switched cooperatively at every synchronisation point
// (__syncthreads, warp shuffles, __syncwarp, nvcuda::wmma calls, atomics). Between two such
// points a thread runs alone, so a kernel whose correctness depends on an unsynchronised
// interleaving can still pass; the random schedule (set_schedule_seed) varies the order in which
// runnable threads resume to shake out the common cases. What it reports as errors, with the
// threads and source lines:
//   * divergent barriers: the threads of a block meet at different __syncthreads() calls (or some
//     exited while others wait), which is undefined behaviour on the GPU;
//   * divergent warp collectives (a shuffle or WMMA call reached by only part of a warp, or
//     partial masks, which it does not emulate);
//   * a C++ exception thrown inside the kernel (e.g. by LOPD_SIMT_ASSERT).
// Shared memory: dynamic shared memory is a per-launch buffer filled with 0xff bytes (NaN as
// floats, the largest key as integers) so reads of unwritten shared memory show up in results;
// static __shared__ variables are function-local statics (shared by all threads of the block,
// kept between blocks: run the blocks of a grid one at a time, which this emulator does).
//
// Include it (instead of the CUDA headers) after the ATen headers, with LOPD_SIMT_EMULATION
// defined; csrc/cuda/simt.cuh does both.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <ucontext.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <source_location>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>
#include <algorithm>

namespace lopd::simt_emu {

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
  Dim3() = default;
  Dim3(unsigned x_, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}  // NOLINT
};

constexpr unsigned kWarpSize = 32;
// Dynamic shared memory per block on sm_90 (H100/H200) after cudaFuncSetAttribute opt-in.
constexpr size_t kMaxDynamicSmemBytes = 227 * 1024;
// Per-thread stack: the kernels keep a few arrays of 8 floats and call small functions.
constexpr size_t kFiberStackBytes = 64 * 1024;

struct SyncSite {
  const char* file = "";
  unsigned line = 0;
  const char* what = "";
};

// A barrier among `expected` threads; `gen` counts completed phases.
struct Barrier {
  unsigned expected = 0;
  unsigned arrived = 0;
  uint64_t gen = 0;
  SyncSite site;
};

struct Fiber {
  ucontext_t ctx{};
  std::vector<char> stack;
  Dim3 thread_idx;
  unsigned linear = 0;
  bool started = false;
  bool done = false;
  Barrier* waiting_on = nullptr;  // null: runnable
  uint64_t wait_gen = 0;
  SyncSite site;  // where it waits (for error messages)
};

struct BlockState {
  std::vector<Fiber> fibers;
  unsigned n_threads = 0;
  Dim3 block_idx, block_dim, grid_dim;
  Barrier block_barrier;
  std::vector<Barrier> warp_barriers;
  std::vector<uint64_t> exchange;  // one 64-bit slot per thread for warp shuffles
  // Dynamic shared memory, 128-byte aligned like the kernels' LOPD_EXTERN_SHARED declaration.
  std::unique_ptr<unsigned char, void (*)(void*)> dynamic_smem{nullptr, &std::free};
  ucontext_t scheduler{};
  Fiber* current = nullptr;
  std::function<void()> body;
  std::string error;
  std::mt19937_64 rng;
  uint64_t seed = 0;
};

// The launch being run on this OS thread (fibers never migrate between OS threads).
inline thread_local BlockState* g_block = nullptr;
// 0: round-robin from the thread after the one that yielded; otherwise a seeded random choice
// among the runnable threads at every switch.
inline uint64_t g_schedule_seed = 0;
// Static __shared__ variables are process-wide statics: one launch at a time.
inline std::mutex g_launch_mutex;

inline void set_schedule_seed(uint64_t seed) { g_schedule_seed = seed; }

inline std::string where(const SyncSite& s) {
  std::ostringstream os;
  os << s.what << " at " << s.file << ":" << s.line;
  return os.str();
}

[[noreturn]] inline void fail(const std::string& msg) {
  BlockState& b = *g_block;
  std::ostringstream os;
  os << "SIMT emulator: block (" << b.block_idx.x << "," << b.block_idx.y << "," << b.block_idx.z
     << "), thread " << (b.current ? b.current->linear : 0u) << ": " << msg;
  throw std::runtime_error(os.str());
}

// Hands control back to the scheduler; returns when this fiber is resumed.
inline void switch_to_scheduler() {
  BlockState& b = *g_block;
  swapcontext(&b.current->ctx, &b.scheduler);
}

// A scheduling point with nothing to wait for (atomics): other threads may run first.
inline void yield() {
  g_block->current->waiting_on = nullptr;
  switch_to_scheduler();
}

inline void arrive_and_wait(Barrier& bar, const SyncSite& site) {
  BlockState& b = *g_block;
  Fiber& me = *b.current;
  if (bar.arrived == 0) {
    bar.site = site;
  } else if (bar.site.line != site.line || std::strcmp(bar.site.file, site.file) != 0 ||
             std::strcmp(bar.site.what, site.what) != 0) {
    fail("divergent synchronisation: this thread reached " + where(site) + " while " +
         std::to_string(bar.arrived) + " other thread(s) wait at " + where(bar.site));
  }
  ++bar.arrived;
  if (bar.arrived == bar.expected) {
    bar.arrived = 0;
    ++bar.gen;  // releases everyone waiting on this phase
    yield();
    return;
  }
  me.waiting_on = &bar;
  me.wait_gen = bar.gen;
  me.site = site;
  switch_to_scheduler();
}

inline void syncthreads(SyncSite site) { arrive_and_wait(g_block->block_barrier, site); }

inline unsigned lane_count(unsigned warp) {
  const unsigned n = g_block->n_threads;
  return std::min(kWarpSize, n - warp * kWarpSize);
}

inline void check_full_warp(unsigned mask, const SyncSite& site) {
  const unsigned warp = g_block->current->linear / kWarpSize;
  const unsigned lanes = lane_count(warp);
  const unsigned full = lanes == kWarpSize ? 0xffffffffu : ((1u << lanes) - 1u);
  if (mask != full) {
    std::ostringstream os;
    os << "warp collective with mask 0x" << std::hex << mask << " (" << where(site)
       << "): only the full-warp mask 0x" << full << " is emulated";
    fail(os.str());
  }
}

inline void syncwarp(unsigned mask, SyncSite site) {
  check_full_warp(mask, site);
  arrive_and_wait(g_block->warp_barriers[g_block->current->linear / kWarpSize], site);
}

// Warp shuffle: every lane publishes its value, waits for the warp, reads its source lane's
// value, and waits again so that no lane overwrites a slot before every lane has read it.
template <typename T, typename SrcLane>
T shuffle_impl(unsigned mask, T value, SrcLane src_of, const SyncSite& site) {
  static_assert(sizeof(T) <= sizeof(uint64_t) && std::is_trivially_copyable_v<T>);
  check_full_warp(mask, site);
  BlockState& b = *g_block;
  const unsigned me = b.current->linear;
  const unsigned warp = me / kWarpSize;
  const unsigned lane = me % kWarpSize;
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  b.exchange[me] = bits;
  Barrier& bar = b.warp_barriers[warp];
  arrive_and_wait(bar, site);
  const unsigned src = src_of(lane);
  T out = value;  // a source lane outside the warp returns the caller's own value, as on the GPU
  if (src < lane_count(warp)) std::memcpy(&out, &b.exchange[warp * kWarpSize + src], sizeof(T));
  arrive_and_wait(bar, site);
  return out;
}

template <typename T>
T shfl_xor_sync(unsigned mask, T value, int lane_mask, SyncSite site) {
  return shuffle_impl(mask, value, [&](unsigned lane) { return lane ^ unsigned(lane_mask); },
                      site);
}

template <typename T>
T shfl_down_sync(unsigned mask, T value, unsigned delta, SyncSite site) {
  return shuffle_impl(mask, value, [&](unsigned lane) { return lane + delta; }, site);
}

template <typename T>
T shfl_sync(unsigned mask, T value, int src_lane, SyncSite site) {
  return shuffle_impl(mask, value, [&](unsigned) { return unsigned(src_lane) % kWarpSize; },
                      site);
}

template <typename T, typename U>
T atomic_add(T* address, U value) {
  const T old = *address;
  *address = old + static_cast<T>(value);
  yield();  // the update is atomic; the point after it is where other threads may interleave
  return old;
}

template <typename T, typename U>
T atomic_max(T* address, U value) {
  const T old = *address;
  if (static_cast<T>(value) > old) *address = static_cast<T>(value);
  yield();
  return old;
}

inline void fiber_entry() {
  BlockState& b = *g_block;
  try {
    b.body();
  } catch (const std::exception& e) {
    if (b.error.empty()) b.error = e.what();
  } catch (...) {
    if (b.error.empty()) b.error = "SIMT emulator: unknown exception in a kernel thread";
  }
  b.current->done = true;
  // Returning resumes uc_link: the scheduler.
}

inline bool runnable(const Fiber& f) {
  return !f.done && (f.waiting_on == nullptr || f.waiting_on->gen != f.wait_gen);
}

inline std::string describe_deadlock(const BlockState& b) {
  std::ostringstream os;
  os << "deadlock in block (" << b.block_idx.x << "," << b.block_idx.y << "," << b.block_idx.z
     << "): ";
  unsigned exited = 0;
  std::vector<std::pair<std::string, unsigned>> sites;
  for (const Fiber& f : b.fibers) {
    if (f.done) {
      ++exited;
      continue;
    }
    const std::string w = where(f.site);
    bool found = false;
    for (auto& [s, n] : sites) {
      if (s == w) {
        ++n;
        found = true;
      }
    }
    if (!found) sites.emplace_back(w, 1);
  }
  for (const auto& [s, n] : sites) os << n << " thread(s) wait in " << s << "; ";
  os << exited << " thread(s) have exited (a barrier after a non-uniform return, or a warp "
     << "collective not reached by the whole warp)";
  return os.str();
}

// Runs one block to completion on the current OS thread; throws on any reported error.
inline void run_block(BlockState& b) {
  for (unsigned i = 0; i < b.n_threads; ++i) {
    Fiber& f = b.fibers[i];
    f.linear = i;
    f.thread_idx = Dim3(i % b.block_dim.x, (i / b.block_dim.x) % b.block_dim.y,
                        i / (b.block_dim.x * b.block_dim.y));
    f.started = true;
    f.done = false;
    f.waiting_on = nullptr;
    if (f.stack.empty()) f.stack.resize(kFiberStackBytes);
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc_stack.ss_size = f.stack.size();
    f.ctx.uc_link = &b.scheduler;
    makecontext(&f.ctx, &fiber_entry, 0);
  }
  b.block_barrier = Barrier{b.n_threads};
  const unsigned n_warps = (b.n_threads + kWarpSize - 1) / kWarpSize;
  b.warp_barriers.assign(n_warps, Barrier{});
  for (unsigned w = 0; w < n_warps; ++w) b.warp_barriers[w].expected = lane_count(w);
  b.exchange.assign(b.n_threads, 0);

  unsigned next = 0;
  std::vector<unsigned> ready;
  while (true) {
    if (!b.error.empty()) throw std::runtime_error(b.error);
    int pick = -1;
    if (b.seed == 0) {
      for (unsigned k = 0; k < b.n_threads; ++k) {
        const unsigned i = (next + k) % b.n_threads;
        if (runnable(b.fibers[i])) {
          pick = int(i);
          break;
        }
      }
    } else {
      ready.clear();
      for (unsigned i = 0; i < b.n_threads; ++i) {
        if (runnable(b.fibers[i])) ready.push_back(i);
      }
      if (!ready.empty()) pick = int(ready[b.rng() % ready.size()]);
    }
    if (pick < 0) {
      bool all_done = true;
      for (const Fiber& f : b.fibers) all_done &= f.done;
      if (all_done) break;
      throw std::runtime_error("SIMT emulator: " + describe_deadlock(b));
    }
    Fiber& f = b.fibers[pick];
    f.waiting_on = nullptr;
    b.current = &f;
    swapcontext(&b.scheduler, &f.ctx);
    b.current = nullptr;
    next = unsigned(pick) + 1;
  }
}

// kernel<<<grid, block, dynamic_smem_bytes>>>(args...), run on the CPU.
template <typename Kernel, typename... Args>
void launch(Kernel kernel, Dim3 grid, Dim3 block, size_t dynamic_smem_bytes, Args... args) {
  const unsigned n_threads = block.x * block.y * block.z;
  if (n_threads == 0 || n_threads > 1024) {
    throw std::runtime_error("SIMT emulator: block size must be in [1, 1024], got " +
                             std::to_string(n_threads));
  }
  // The launch limits of the GPUs these kernels target (sm_80 / sm_90): a launch past them
  // fails there with "invalid argument", so it fails here too.
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 2147483647u || grid.y > 65535u ||
      grid.z > 65535u) {
    throw std::runtime_error("SIMT emulator: grid (" + std::to_string(grid.x) + ", " +
                             std::to_string(grid.y) + ", " + std::to_string(grid.z) +
                             ") is outside CUDA's limits (x < 2^31, y and z <= 65535, none 0)");
  }
  if (dynamic_smem_bytes > kMaxDynamicSmemBytes) {
    throw std::runtime_error("SIMT emulator: " + std::to_string(dynamic_smem_bytes) +
                             " bytes of dynamic shared memory per block; an sm_90 GPU allows " +
                             std::to_string(kMaxDynamicSmemBytes));
  }
  std::lock_guard<std::mutex> lock(g_launch_mutex);
  BlockState b;
  b.n_threads = n_threads;
  b.block_dim = block;
  b.grid_dim = grid;
  b.fibers.resize(n_threads);
  if (dynamic_smem_bytes > 0) {
    const size_t bytes = (dynamic_smem_bytes + 127) / 128 * 128;
    b.dynamic_smem.reset(static_cast<unsigned char*>(std::aligned_alloc(128, bytes)));
    std::memset(b.dynamic_smem.get(), 0xff, dynamic_smem_bytes);
  }
  b.body = [&]() { kernel(args...); };
  b.seed = g_schedule_seed;
  b.rng.seed(g_schedule_seed);
  BlockState* const saved = g_block;
  g_block = &b;
  try {
    for (unsigned z = 0; z < grid.z; ++z) {
      for (unsigned y = 0; y < grid.y; ++y) {
        for (unsigned x = 0; x < grid.x; ++x) {
          b.block_idx = Dim3(x, y, z);
          run_block(b);
        }
      }
    }
  } catch (...) {
    g_block = saved;
    throw;
  }
  g_block = saved;
}

template <typename T>
T* dynamic_shared() {
  return reinterpret_cast<T*>(g_block->dynamic_smem.get());
}

// ---- CUDA vector types and intrinsics used by the kernels -------------------------------------

struct alignas(8) Float2 {
  float x, y;
};
struct alignas(16) Float4 {
  float x, y, z, w;
};
struct alignas(16) Uint4 {
  unsigned x, y, z, w;
};

}  // namespace lopd::simt_emu

// nvcuda::wmma on the state above.
#include "emu/simt_wmma.h"

// CUDA's dim3 (grid / block sizes built by the host launchers).
using dim3 = ::lopd::simt_emu::Dim3;
using float2 = ::lopd::simt_emu::Float2;
using float4 = ::lopd::simt_emu::Float4;
using uint4 = ::lopd::simt_emu::Uint4;
using __half = c10::Half;
using __nv_bfloat16 = c10::BFloat16;

inline float2 make_float2(float x, float y) { return float2{x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline float __half2float(__half x) { return static_cast<float>(x); }
inline float __bfloat162float(__nv_bfloat16 x) { return static_cast<float>(x); }
inline __half __float2half_rn(float x) { return __half(x); }
inline __nv_bfloat16 __float2bfloat16_rn(float x) { return __nv_bfloat16(x); }
inline unsigned __float_as_uint(float x) { return std::bit_cast<unsigned>(x); }
inline float __uint_as_float(unsigned x) { return std::bit_cast<float>(x); }
inline float __expf(float x) { return std::exp(x); }

namespace lopd::simt_emu {
// PTX ex2.approx.ftz.f32 as far as its documented behaviour goes: 2 ulp of error, modelled as a
// relative perturbation of -2, 0 or +2 ulp chosen by the input's bits (deterministic, and biased
// in neither direction over many inputs), results below FLT_MIN flushed to +0, 2^-inf = 0,
// 2^+inf = inf, NaN stays NaN.
inline float approx_exp2(float x) {
  const float y = std::exp2(x);
  if (!(y >= 1.17549435e-38f)) return y != y ? y : 0.0f;  // FTZ (NaN passes)
  if (y == INFINITY) return y;
  const uint32_t h = (std::bit_cast<uint32_t>(x) * 2654435761u) >> 30;  // 0..3
  const float ulps = h == 0 ? -2.0f : (h == 1 ? 2.0f : 0.0f);
  return y * (1.0f + ulps * 0x1p-23f);
}
}  // namespace lopd::simt_emu
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
template <typename T, typename U>
T atomicAdd(T* address, U value) {
  return ::lopd::simt_emu::atomic_add(address, value);
}
template <typename T, typename U>
T atomicMax(T* address, U value) {
  return ::lopd::simt_emu::atomic_max(address, value);
}

#define LOPD_SIMT_SITE(what)                                                                  \
  ::lopd::simt_emu::SyncSite {                                                                \
    std::source_location::current().file_name(), std::source_location::current().line(), what \
  }
#define __syncthreads() ::lopd::simt_emu::syncthreads(LOPD_SIMT_SITE("__syncthreads()"))
#define __syncwarp(mask) ::lopd::simt_emu::syncwarp(mask, LOPD_SIMT_SITE("__syncwarp()"))
#define __shfl_xor_sync(mask, v, m) \
  ::lopd::simt_emu::shfl_xor_sync(mask, v, m, LOPD_SIMT_SITE("__shfl_xor_sync()"))
#define __shfl_down_sync(mask, v, d) \
  ::lopd::simt_emu::shfl_down_sync(mask, v, d, LOPD_SIMT_SITE("__shfl_down_sync()"))
#define __shfl_sync(mask, v, s) \
  ::lopd::simt_emu::shfl_sync(mask, v, s, LOPD_SIMT_SITE("__shfl_sync()"))
// nvcuda::wmma collectives: warp synchronisation points named by their source line.
#define load_matrix_sync(...) \
  load_matrix_sync_impl(__VA_ARGS__, LOPD_SIMT_SITE("wmma::load_matrix_sync()"))
#define store_matrix_sync(...) \
  store_matrix_sync_impl(__VA_ARGS__, LOPD_SIMT_SITE("wmma::store_matrix_sync()"))
#define mma_sync(...) mma_sync_impl(__VA_ARGS__, LOPD_SIMT_SITE("wmma::mma_sync()"))
#define threadIdx (::lopd::simt_emu::g_block->current->thread_idx)
#define blockIdx (::lopd::simt_emu::g_block->block_idx)
#define blockDim (::lopd::simt_emu::g_block->block_dim)
#define gridDim (::lopd::simt_emu::g_block->grid_dim)
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __shared__ static
