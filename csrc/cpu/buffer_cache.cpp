// Recycled CPU output buffers (see buffer_cache.h).
#include "cpu/buffer_cache.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>

namespace lopd::cpu {
namespace {

constexpr size_t kHuge = size_t{2} << 20;
constexpr size_t kMaxBlocks = 2;
constexpr size_t kMaxBytes = size_t{4} << 30;
// Smaller buffers come from at::empty: glibc serves them from memory it keeps mapped (its mmap
// threshold adapts up to 32 MiB), so there are no fresh pages to avoid.
constexpr size_t kMinBytes = size_t{4} << 20;

// On unless the variable is "0".
bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr || std::strcmp(v, "0") != 0;
}

// Off unless the variable is "1".
bool env_is_one(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, "1") == 0;
}

struct Block {
  void* ptr;
  size_t bytes;
};

class BufferCache {
 public:
  static BufferCache& get() {
    // Leaked on purpose: tensors may be freed during static destruction at exit.
    static BufferCache* cache = new BufferCache();
    return *cache;
  }

  // A block of at least `bytes` (rounded up to whole huge pages), from the cache when one of at
  // most twice that size is free.
  Block take(size_t bytes) {
    bytes = (bytes + kHuge - 1) / kHuge * kHuge;
    if (enabled_) {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        if (it->bytes >= bytes && it->bytes <= 2 * bytes) {
          const Block b = *it;
          free_.erase(it);
          cached_bytes_ -= b.bytes;
          ++hits_;
          return b;
        }
      }
      ++misses_;
    }
    return map_new(bytes);
  }

  void give_back(Block b) {
    if (enabled_ && b.bytes <= kMaxBytes) {
      std::lock_guard<std::mutex> lock(mu_);
      free_.push_back(b);
      cached_bytes_ += b.bytes;
      // Keep the most recently freed blocks within both limits.
      while (free_.size() > kMaxBlocks || cached_bytes_ > kMaxBytes) {
        const Block old = free_.front();
        free_.pop_front();
        cached_bytes_ -= old.bytes;
        std::free(old.ptr);
      }
      return;
    }
    std::free(b.ptr);
  }

  void release() {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Block& b : free_) std::free(b.ptr);
    free_.clear();
    cached_bytes_ = 0;
  }

  BufferCacheStats stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return BufferCacheStats{static_cast<int64_t>(free_.size()),
                            static_cast<int64_t>(cached_bytes_), hits_, misses_, enabled_};
  }

 private:
  BufferCache()
      : enabled_(env_flag("LOPD_CPU_BUFFER_CACHE")),
        huge_pages_(env_is_one("LOPD_CPU_HUGEPAGES")) {}

  // `bytes` (a multiple of 2 MiB), 2 MiB aligned, so that transparent huge pages can back all of
  // it where the system (THP "always") or LOPD_CPU_HUGEPAGES=1 (MADV_HUGEPAGE) asks for them.
  // Advice only: failures are ignored.
  Block map_new(size_t bytes) const {
    void* ptr = nullptr;
    TORCH_CHECK(posix_memalign(&ptr, kHuge, bytes) == 0 && ptr != nullptr,
                "lopd_kernels: out of CPU memory allocating ", bytes, " bytes");
#ifdef MADV_HUGEPAGE
    if (huge_pages_) madvise(ptr, bytes, MADV_HUGEPAGE);
#endif
    populate(static_cast<char*>(ptr), bytes);
    return Block{ptr, bytes};
  }

  // Maps the new block's pages now, on all of the op's threads, with MADV_POPULATE_WRITE
  // (Linux >= 5.14): the kernel then allocates and zeroes them in a loop instead of taking one
  // page fault per 4 KiB page inside the kernel's stores, single-threaded per row. Advice only:
  // without it (older kernels) the stores fault the pages in as before.
  static void populate(char* ptr, size_t bytes) {
#ifndef MADV_POPULATE_WRITE
    constexpr int MADV_POPULATE_WRITE = 23;
#endif
    const int64_t chunks = static_cast<int64_t>(bytes / kHuge);
    at::parallel_for(0, chunks, 8, [&](int64_t begin, int64_t end) {
      madvise(ptr + begin * kHuge, (end - begin) * kHuge, MADV_POPULATE_WRITE);
    });
  }

  std::mutex mu_;
  std::deque<Block> free_;
  size_t cached_bytes_ = 0;
  int64_t hits_ = 0;
  int64_t misses_ = 0;
  const bool enabled_;
  const bool huge_pages_;
};

}  // namespace

at::Tensor empty_recycled(at::IntArrayRef sizes, const at::TensorOptions& options) {
  int64_t numel = 1;
  for (const int64_t s : sizes) numel *= s;
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(numel, 1)) *
                       options.dtype().itemsize();
  if (bytes < kMinBytes) return at::empty(sizes, options.device(at::kCPU));
  Block* block = new Block(BufferCache::get().take(bytes));
  return at::from_blob(
      block->ptr, sizes,
      [block](void*) {
        BufferCache::get().give_back(*block);
        delete block;
      },
      options.device(at::kCPU));
}

BufferCacheStats cpu_buffer_cache_stats() { return BufferCache::get().stats(); }

void release_cpu_buffer_cache() { BufferCache::get().release(); }

}  // namespace lopd::cpu
