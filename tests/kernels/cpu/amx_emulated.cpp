// prefill_attention_cpu.cpp with AMX's tile instructions emulated in plain C++ (tests/kernels/cpu/test_attention.py):
// its `Amx` path runs, and is checked against the twin, on CPUs without AMX. The tiles are 8 x 16 rows of 64 bytes
// per thread; _tile_dpbf16ps is C[m][n] += sum_k A[m][2k] B[k][2n] + A[m][2k+1] B[k][2n+1], in fp32. Built with
// -D__AMX_TILE__ -D__AMX_BF16__ on a CPU with AVX512-BF16 (the rest of the kernel needs it).
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

namespace emu {
thread_local unsigned char tile[8][16][64];
inline float bf16(uint16_t x) {
  const uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void loadconfig(const void*) {}
inline void release() {}
inline void zero(int t) { std::memset(tile[t], 0, sizeof tile[t]); }
inline void loadd(int t, const void* p, int64_t stride) {
  for (int r = 0; r < 16; ++r) std::memcpy(tile[t][r], static_cast<const char*>(p) + r * stride, 64);
}
inline void stored(int t, void* p, int64_t stride) {
  for (int r = 0; r < 16; ++r) std::memcpy(static_cast<char*>(p) + r * stride, tile[t][r], 64);
}
inline void dpbf16ps(int c, int a, int b) {
  for (int m = 0; m < 16; ++m) {
    float* C = reinterpret_cast<float*>(tile[c][m]);
    const uint16_t* A = reinterpret_cast<const uint16_t*>(tile[a][m]);
    for (int n = 0; n < 16; ++n)
      for (int k = 0; k < 16; ++k) {
        const uint16_t* B = reinterpret_cast<const uint16_t*>(tile[b][k]);
        C[n] += bf16(A[2 * k]) * bf16(B[2 * n]) + bf16(A[2 * k + 1]) * bf16(B[2 * n + 1]);
      }
  }
}
}  // namespace emu

#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#define _tile_loadconfig emu::loadconfig
#define _tile_release emu::release
#define _tile_loadd(t, p, s) emu::loadd(t, p, s)
#define _tile_stored(t, p, s) emu::stored(t, p, s)
#define _tile_zero(t) emu::zero(t)
#define _tile_dpbf16ps(c, a, b) emu::dpbf16ps(c, a, b)
#define syscall(...) 0L  // the tile state granted (amx_permitted)
#include "prefill_attention_cpu.cpp"
