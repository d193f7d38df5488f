// What every AMX kernel needs: the process's permission to use the tile registers, and the one
// tile configuration the kernels share. KVTIER_HAS_AMX is defined where the compiler targets
// AMX (the build uses -march=native, so: where this machine has it).

#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define KVTIER_HAS_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace {

// Linux lends the AMX tile registers to a process only once it asks (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); a kernel without AMX support says no.
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

// Every tile register 16 rows of 64 bytes: 16 x 16 fp32 or 16 x 32 bf16. The configuration
// is per thread, so each task loads it.
void load_amx_config() {
  struct alignas(64) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } config{};
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}

}  // namespace

#endif  // __AMX_TILE__ && __AMX_BF16__
