// What the CUDA kernels of csrc/cuda/ need from their surroundings, in two builds:
//   * nvcc (the real thing): CUDA headers, `extern __shared__`, <<<...>>> launches on the current
//     stream, a device guard, errors checked after every launch;
//   * LOPD_SIMT_EMULATION (g++, tests on machines without a GPU): the same kernel source runs on
//     the CPU under csrc/emu/simt_emulator.h, on CPU tensors.
// Kernel files use only the macros below for the parts that differ, so the emulated build
// compiles exactly the device code that nvcc compiles.
#pragma once

#include <ATen/ATen.h>

#ifdef LOPD_SIMT_EMULATION

#include "emu/simt_emulator.h"

// `T* name` pointing at the block's dynamic shared memory.
#define LOPD_EXTERN_SHARED(T, name) T* name = ::lopd::simt_emu::dynamic_shared<T>()
#define LOPD_LAUNCH(kernel, grid, block, smem_bytes, ...) \
  ::lopd::simt_emu::launch(kernel, grid, block, smem_bytes, __VA_ARGS__)
#define LOPD_DEVICE_GUARD(device)
// Where the op's tensors live and how messages name the implementation.
#define LOPD_SIMT_DEVICE_TYPE c10::DeviceType::CPU
#define LOPD_SIMT_BACKEND "CUDA-emulated"

namespace lopd::simt {
// The most dynamic shared memory one block may opt in to on the current device; the emulated
// build has no device and answers an H100's / H200's 227 KB.
inline size_t max_dynamic_smem_bytes() { return ::lopd::simt_emu::kMaxDynamicSmemBytes; }
}  // namespace lopd::simt

#else

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>  // nvcuda::wmma (the emulated build: simt_emulator.h)

// 128-byte aligned: WMMA tiles need 32-byte aligned pointers, and the emulator allocates the same.
#define LOPD_EXTERN_SHARED(T, name) extern __shared__ __align__(128) T name[]
// Raises the dynamic shared memory limit to what this launch asks for (above 48 KB needs an
// explicit opt-in), launches on the current stream and checks the launch.
#define LOPD_LAUNCH(kernel, grid, block, smem_bytes, ...)                                     \
  do {                                                                                        \
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, \
                                        int(smem_bytes)));                                    \
    kernel<<<grid, block, smem_bytes, c10::cuda::getCurrentCUDAStream()>>>(__VA_ARGS__);      \
    C10_CUDA_KERNEL_LAUNCH_CHECK();                                                           \
  } while (0)
#define LOPD_DEVICE_GUARD(device) const c10::cuda::CUDAGuard lopd_device_guard_(device)
#define LOPD_SIMT_DEVICE_TYPE c10::DeviceType::CUDA
#define LOPD_SIMT_BACKEND "CUDA"

namespace lopd::simt {
// The most dynamic shared memory one block may opt in to on the current device (e.g. 227 KB on
// sm_90, 163 KB on sm_80, 99 KB on sm_86 / sm_89).
inline size_t max_dynamic_smem_bytes() {
  int device = 0, bytes = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(
      cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return size_t(bytes);
}
}  // namespace lopd::simt

#endif

namespace lopd::simt {

// 2^x by the special function unit: PTX ex2.approx.ftz.f32 (MUFU.EX2, one instruction; CUDA's
// documented error for it is 2 ulp, denormal results flush to 0, 2^-inf = 0). The emulated build
// models exactly that error: std::exp2 perturbed by up to 2 ulp, denormals flushed
// (simt_emulator.h), so CPU tests see the precision the GPU will have.
__device__ __forceinline__ float fast_exp2(float x) {
#ifdef LOPD_SIMT_EMULATION
  return ::lopd::simt_emu::approx_exp2(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

// fp32 <-> element conversions of the kernels' input/output dtypes (fp32, fp16, bf16).
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

}  // namespace lopd::simt
