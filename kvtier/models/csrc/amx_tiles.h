// Intel AMX tile registers, shared by the decode and prefill kernels: whether this process may
// use them, the switch tests turn them off with, and the tile shapes a kernel loads.

#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define KVTIER_HAS_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>

namespace kvtier {

// Linux lends the AMX tile registers to a process only once it asks (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); a kernel without AMX support says no.
inline bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

// Tests turn the AMX tiles off to hold the vdpbf16ps paths to the reference on the same CPU.
// One flag for every kernel of the library (an inline variable: one object across its sources).
inline std::atomic<bool> amx_enabled{true};

inline bool use_amx() {
  return amx_enabled.load(std::memory_order_relaxed) && amx_permitted();
}

// Configures the eight tile registers as rows[t] rows of 64 bytes (16 fp32 or 32 bf16). The
// configuration is per thread: each task loads it.
inline void load_amx_config(const uint8_t (&rows)[8]) {
  struct alignas(64) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } config{};
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = rows[t];
  }
  // GCC 12 takes ldtilecfg for an instruction that does not read its operand and drops the
  // stores above as dead (the tiles then got whatever the stack held): a memory barrier keeps
  // them.
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

// Every tile 16 x 64 bytes.
inline void load_amx_config() { load_amx_config({16, 16, 16, 16, 16, 16, 16, 16}); }

}  // namespace kvtier

#endif  // __AMX_TILE__ && __AMX_BF16__
