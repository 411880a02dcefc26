// Per-ISA entry point of csrc/cpu/isa/vec_exp_probe.cpp (a test hook of csrc/cpu/vec_exp.h).
#pragma once

#include <cstdint>

#include "cpu/isa_dispatch.h"

#define LOPD_FAST_EXP_DECLARE(ISA)                                      \
  namespace lopd::cpu::ISA {                                            \
  void fast_exp_array(const float* in, float* out, int64_t n);          \
  void fast_exp2_array(const float* in, float* out, int64_t n);         \
  }
LOPD_FOR_EACH_CPU_ISA(LOPD_FAST_EXP_DECLARE)
#undef LOPD_FAST_EXP_DECLARE
