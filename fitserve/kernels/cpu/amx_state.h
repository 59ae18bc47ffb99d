// The AMX tile state every AMX kernel shares: whether the process may use the tile registers
// (Linux hands out the 8 KB tile state only on request: ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA;
// without it the first tile instruction faults) and the tile configuration block. Asked once per
// process and extension; FITSERVE_AMX=0 starts it off (the AVX-512 paths run instead).
//
// NOTE: each AMX kernel loads its own configuration at the start of its work on a thread and
// releases the tiles at the end (_tile_release), so kernels of different extensions never see
// each other's configuration.
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>

namespace fitserve {

inline std::atomic<int>& amx_mode() {
  static std::atomic<int> mode{[] {
    const char* e = std::getenv("FITSERVE_AMX");
    if (e && e[0] == '0' && e[1] == 0) return 0;
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : 0;
  }()};
  return mode;
}
inline bool amx_usable() { return amx_mode().load(std::memory_order_relaxed) == 1; }

// Turns the tiles on (if the OS grants them) or off for later calls; returns whether they are on.
inline bool amx_set(bool on) {
  if (!on) amx_mode().store(0);
  else amx_mode().store(syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : 0);
  return amx_usable();
}

// LDTILECFG's 64-byte block (palette 1).
struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// LDTILECFG of c. NOTE: not _tile_loadconfig: GCC 12's macro hands the asm only the block's first
// 8 bytes as its memory operand, so the compiler may drop the stores to rows / colsb as dead
// (it did, for a config built in an inlined function: every tile instruction after it faulted
// with SIGILL, tiles unconfigured). Here the operand is the whole 64-byte block.
inline void amx_load_config(const AmxConfig& c) { __asm__ volatile("ldtilecfg %0" ::"m"(c)); }

}  // namespace fitserve
