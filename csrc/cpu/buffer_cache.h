// Recycled CPU output buffers for the ops' largest outputs (topk_tail_kl's two [N, V] logit
// gradients): a freed buffer is kept and handed to the next request of a similar size instead
// of going back to the OS.
//
// Why: an [N, V] fp32 gradient is far above glibc's mmap threshold (32 MiB at most), so every
// backward gets fresh pages from the kernel, which zeroes them on first touch (clear_page) before
// the kernel writes them again: on 2 cores that zeroing was a quarter of topk_tail_kl's time.
// In training those gradients are intermediates (freed by the LM-head backward within the same
// step), so the next step's backward reuses the memory, already mapped. The cache holds at most
// kMaxBlocks freed blocks and kMaxBytes in all; a request takes a cached block of at least its
// size and at most twice it; requests under 4 MiB go to at::empty. LOPD_CPU_BUFFER_CACHE=0 turns
// it off (read once); release_cpu_buffer_cache() returns the cached blocks to the OS
// (lopd_kernels._C exposes both it and cpu_buffer_cache_stats()).
//
// New blocks (a process's first calls) are mapped at once on all of the op's threads
// (MADV_POPULATE_WRITE), 2 MiB aligned. They get no MADV_HUGEPAGE advice unless
// LOPD_CPU_HUGEPAGES=1: the system's THP policy decides. Measured on a 2-vCPU Firecracker VM
// with free page reporting (2026-12-02, 311 MB of gradients, first topk_tail_kl call of a
// process): huge pages 410-530 ms, because the host must re-back each 2 MiB page the guest had
// reported free; 4 KiB pages populated on both threads 98-106 ms (warm: 33-41 ms). On bare metal
// huge pages save a part of a one-time ~30-60 ms, so the default is the robust one.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace lopd::cpu {

// An uninitialized contiguous tensor of `sizes` and `options` (CPU), backed by a recycled block
// when one fits.
at::Tensor empty_recycled(at::IntArrayRef sizes, const at::TensorOptions& options);

struct BufferCacheStats {
  int64_t cached_blocks;
  int64_t cached_bytes;
  int64_t hits;    // requests served from the cache
  int64_t misses;  // requests that mapped new memory
  bool enabled;
};

BufferCacheStats cpu_buffer_cache_stats();

// Frees every cached (not in use) block.
void release_cpu_buffer_cache();

}  // namespace lopd::cpu
