// Prefill-chunk attention in bf16: one sequence's n new queries against its whole context of L keys
// (the last n are the chunk itself, causal), read from the paged cache. bf16 in and out, fp32 softmax.
//
// The SDPA path it replaces gathers the context, runs CPU flash twice (context unmasked, chunk causal,
// because SDPA's causal mask is aligned top-left) and merges the two by their log-sum-exps; a 240-token
// chunk's attention cost ~1.5x its share of one whole-prompt pass that way. Here it is one pass:
//  1. Repack, per KV head, K and V into the layouts AMX multiplies (VNNI: pairs of bf16 along the
//     reduced dimension side by side), zero-padded to whole tiles. This replaces the gather.
//  2. A work item is one KV head and 64 query rows; the rows are its G query heads' queries, query-major,
//     so the rows of an item sit at a few adjacent positions and see almost the same keys, and each K or
//     V tile loaded feeds four tile multiplies. Per 128 keys: S = Q K^T in 16x16 fp32 tiles; the
//     online-softmax update in AVX-512, base 2 (masked beyond each row's position, P rounded to bf16 as
//     SDPA does); O += P V in tiles loaded from and stored to fp32 O. Key blocks past the item's last
//     visible key are never touched.
// Two ways to multiply the tiles (`Amx`, `Dpbf16`): AMX's tile instructions, or AVX512-BF16's vdpbf16ps,
// which takes the same VNNI layout one 16-column row of a tile at a time (a broadcast bf16 pair of A
// times a row of B pairs, into 16 fp32 lanes): the CPUs with AVX512-BF16 and no AMX (AMD Zen 4 and later,
// Intel Cooper Lake). Plain C ABI like the other kernels. Where the build has neither, or the asked-for
// one (AMX: the OS may refuse the tile state), it answers kUnsupported and the caller keeps the SDPA path.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_common.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define SLUICE_BF16 1
#include <immintrin.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define SLUICE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace {

constexpr int kBadBlock = 1, kBadShape = 2, kUnsupported = 3;  // kernels/cpu/binding.py ERRORS

#if SLUICE_BF16

using namespace sluice;

constexpr int64_t QB = 64;   // query rows per work item: four tiles of 16, so each K or V tile feeds 4 multiplies
constexpr int64_t KB = 128;  // keys per softmax step (S and P of an item then stay in L1)

#if SLUICE_AMX
bool amx_permitted() {  // Linux hands out the 8 KB tile state only on request, once per process
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3 accumulate the four 16-row tiles of an item (16 rows of 16 fp32); 4 and 5 take turns holding A
// (16 rows of 32 bf16), 6 and 7 holding B (16 rows of 16 bf16 pairs): a load need not wait for the
// multiply that reads the previous contents.
void config_tiles() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  _tile_loadconfig(&c);
}

// tiles 0..3 += (the A tiles at a, a + 16 rows, ...) x tile B. A macro: GCC's tile intrinsics paste
// their tile numbers into the assembly, so they must be literals.
#define SLUICE_DP_ROWS4(B, a, row_elems)                           \
  do {                                                             \
    const uint16_t* a_ = (a);                                      \
    const int64_t re_ = (row_elems), st_ = re_ * 2;                \
    _tile_loadd(4, a_, st_);                                       \
    _tile_dpbf16ps(0, 4, B);                                       \
    _tile_loadd(5, a_ + 16 * re_, st_);                            \
    _tile_dpbf16ps(1, 5, B);                                       \
    _tile_loadd(4, a_ + 32 * re_, st_);                            \
    _tile_dpbf16ps(2, 4, B);                                       \
    _tile_loadd(5, a_ + 48 * re_, st_);                            \
    _tile_dpbf16ps(3, 5, B);                                       \
  } while (0)

inline void store_rows4(float* c, int64_t row_elems) {
  const int64_t stride = row_elems * 4;
  _tile_stored(0, c, stride);
  _tile_stored(1, c + 16 * row_elems, stride);
  _tile_stored(2, c + 32 * row_elems, stride);
  _tile_stored(3, c + 48 * row_elems, stride);
}

inline void load_rows4(const float* c, int64_t row_elems) {
  const int64_t stride = row_elems * 4;
  _tile_loadd(0, c, stride);
  _tile_loadd(1, c + 16 * row_elems, stride);
  _tile_loadd(2, c + 32 * row_elems, stride);
  _tile_loadd(3, c + 48 * row_elems, stride);
}

// S (QB x 16 * nkt fp32, row stride KB) = the QB rows of Q at q (row stride D) times `nkt` packed K tiles from kt
// (each KS chunks of 16 pairs x 16 keys); O (QB x D fp32, row stride D) += the QB rows of P (bf16, row stride KB)
// times `nsl` packed 32-key V slabs from vt (each DT tiles of 16 key pairs x 16 columns).
struct Amx {
  static constexpr bool kWholeItems = true;
  static void begin() { config_tiles(); }
  static void end() { _tile_release(); }
  static void qk(float* s, const uint16_t* q, const uint16_t* kt, int64_t nkt, int64_t KS, int64_t D, int64_t) {
    for (int64_t t = 0; t < nkt; ++t) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      const uint16_t* tiles = kt + t * KS * 512;
      for (int64_t ks = 0; ks < KS; ks += 2) {  // KS is even: D is a multiple of 64
        _tile_loadd(6, tiles + ks * 512, 64);
        SLUICE_DP_ROWS4(6, q + ks * 32, D);
        _tile_loadd(7, tiles + (ks + 1) * 512, 64);
        SLUICE_DP_ROWS4(7, q + (ks + 1) * 32, D);
      }
      store_rows4(s + t * 16, KB);
    }
  }
  static void pv(float* o, const uint16_t* p, const uint16_t* vt, int64_t nsl, int64_t DT, int64_t D, int64_t) {
    for (int64_t dt = 0; dt < DT; ++dt) {  // one 16-column tile of O at a time for all 64 rows
      load_rows4(o + dt * 16, D);
      const uint16_t* v = vt + dt * 512;
      int64_t sl = 0;
      for (; sl + 2 <= nsl; sl += 2) {
        _tile_loadd(6, v + sl * DT * 512, 64);
        SLUICE_DP_ROWS4(6, p + sl * 32, KB);
        _tile_loadd(7, v + (sl + 1) * DT * 512, 64);
        SLUICE_DP_ROWS4(7, p + (sl + 1) * 32, KB);
      }
      if (sl < nsl) {
        _tile_loadd(6, v + sl * DT * 512, 64);
        SLUICE_DP_ROWS4(6, p + sl * 32, KB);
      }
      store_rows4(o + dt * 16, D);
    }
  }
};
#endif  // SLUICE_AMX

// The same products with vdpbf16ps: 16 rows at a time, each an accumulator of 16 fp32 lanes (a tile row); per
// row of B pairs (one load), every row's bf16 pair broadcast into it. Rows of an item past the last live one
// (`rows`: the padding of the last item) are skipped.
struct Dpbf16 {
  static constexpr bool kWholeItems = false;
  static void begin() {}
  static void end() {}
  static inline __m512bh pair(const uint16_t* x) {  // a bf16 pair broadcast to 16 lanes
    return reinterpret_cast<__m512bh>(_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x)));
  }
  // acc[r] += row r of A (16 bf16 pairs at a + r * stride) times B (16 rows of 16 pairs at b): one tile multiply
  static inline void dp16(__m512* acc, const uint16_t* a, int64_t stride, const uint16_t* b) {
    for (int64_t k = 0; k < 16; ++k) {
      const __m512bh bk = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + k * 32));
      for (int r = 0; r < 16; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], pair(a + r * stride + 2 * k), bk);
    }
  }
  static void qk(float* s, const uint16_t* q, const uint16_t* kt, int64_t nkt, int64_t KS, int64_t D,
                 int64_t rows) {
    for (int64_t r0 = 0; r0 < rows; r0 += 16)
      for (int64_t t = 0; t < nkt; ++t) {
        __m512 acc[16];
        for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
        for (int64_t ks = 0; ks < KS; ++ks) {
          const uint16_t* b = kt + (t * KS + ks) * 512;
          const uint16_t* a = q + r0 * D + ks * 32;
          dp16(acc, a, D, b);
        }
        for (int r = 0; r < 16; ++r) _mm512_storeu_ps(s + (r0 + r) * KB + t * 16, acc[r]);
      }
  }
  static void pv(float* o, const uint16_t* p, const uint16_t* vt, int64_t nsl, int64_t DT, int64_t D,
                 int64_t rows) {
    for (int64_t r0 = 0; r0 < rows; r0 += 16)
      for (int64_t dt = 0; dt < DT; ++dt) {
        __m512 acc[16];
        for (int r = 0; r < 16; ++r) acc[r] = _mm512_loadu_ps(o + (r0 + r) * D + dt * 16);
        for (int64_t sl = 0; sl < nsl; ++sl) {
          const uint16_t* b = vt + (sl * DT + dt) * 512;
          const uint16_t* a = p + r0 * KB + sl * 32;
          dp16(acc, a, KB, b);
        }
        for (int r = 0; r < 16; ++r) _mm512_storeu_ps(o + (r0 + r) * D + dt * 16, acc[r]);
      }
  }
};

// The first k of 16 lanes (all for k >= 16, none for k <= 0).
inline __mmask16 lanes(int64_t k) { return k >= 16 ? 0xffff : k > 0 ? __mmask16((1u << k) - 1) : 0; }

// 2^x for the lanes in `live` (0 elsewhere, and below 2^-126): 2^n 2^f with n = round(x), |f| <= 1/2,
// and 2^f = e^(f ln 2) by its degree-6 Taylor polynomial (rel. err < 2e-7; P is rounded to bf16 after).
inline __m512 exp2_16(__m512 x, __mmask16 live) {
  live &= _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
  x = _mm512_min_ps(x, _mm512_set1_ps(127.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5403530393e-4f);  // ln2^6 / 6!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108665e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650696e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(live, p, n);
}

alignas(64) const uint16_t kZeros[256] = {};  // a padding key past the context (head dims up to 256)

// In place: r[c] becomes column c of the 16 x 16 matrix of 32-bit elements whose rows are r[0..15].
inline void transpose16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane l: rows 2i, 2i+1 at columns 4l, 4l+1 | 4l+2, 4l+3
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + e], lane l: rows 4i..4i+3 at column 4l + e
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int e = 0; e < 4; ++e) {  // column 4l + e: lane l of u[e], u[4 + e], u[8 + e], u[12 + e]
    const __m512i x0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x44), x1 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xEE);
    const __m512i y0 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x44), y1 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xEE);
    r[e] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    r[4 + e] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    r[8 + e] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    r[12 + e] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
}

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

struct Scratch {
  std::vector<float> s, o, m, l;
  std::vector<uint16_t> p;
  std::vector<int64_t> vis;
  explicit Scratch(int64_t D) : s(QB * KB), o(QB * D), m(QB), l(QB), p(QB * KB), vis(QB) {}
};

// Per calling thread, reused across calls (a fresh 2 MB buffer per layer costs page faults).
thread_local std::vector<uint16_t> t_qp, t_kp, t_vp;

template <class B>
int attend(uint16_t* out, const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int32_t* table,
           int64_t n, int64_t L, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, int64_t nb, float scale,
           int threads) {
  const int64_t G = Hq / Hkv, rows = G * n, Rp = round_up(rows, QB), Lp = round_up(L, 64);
  const int64_t NKT = Lp / 16, NS = Lp / 32, KS = D / 32, DT = D / 16;
  const float scale2 = scale * 1.44269504088896341f;  // scores to base-2 exponents
  for (int64_t j = 0; j < (L + bs - 1) / bs; ++j)
    if (table[j] < 0 || table[j] >= nb) return kBadBlock;

  t_qp.resize(Hkv * Rp * D);
  t_kp.resize(Hkv * Lp * D);
  t_vp.resize(Hkv * Lp * D);
  uint16_t* qp = t_qp.data();
  uint32_t* kp = reinterpret_cast<uint32_t*>(t_kp.data());
  uint16_t* vp = t_vp.data();
  const int64_t nrb = Rp / QB;

#pragma omp parallel num_threads(threads)
  {
    // 1. Q rows per KV head, query-major; K and V into tile layouts
#pragma omp for schedule(static)
    for (int64_t h = 0; h < Hkv; ++h) {
      uint16_t* dst = qp + h * Rp * D;
      for (int64_t i = 0; i < n; ++i) std::memcpy(dst + i * G * D, q + (i * Hq + h * G) * D, G * D * 2);
      std::memset(dst + rows * D, 0, (Rp - rows) * D * 2);
    }
#pragma omp for schedule(static)
    for (int64_t item = 0; item < Hkv * NS; ++item) {  // 32 keys of one head: two K tiles, a V tile row block
      const int64_t h = item / NS, sl = item % NS;
      const uint16_t *krow[32], *vrow[32];
      for (int64_t jj = 0; jj < 32; ++jj) {
        const int64_t j = sl * 32 + jj;
        const int64_t off = j < L ? ((int64_t(table[j / bs]) * bs + j % bs) * Hkv + h) * D : -1;
        krow[jj] = off < 0 ? kZeros : kc + off;
        vrow[jj] = off < 0 ? kZeros : vc + off;
      }
      for (int64_t half = 0; half < 2; ++half)  // K: per 32 dims, a 16 keys x 16 pairs transpose
        for (int64_t ks = 0; ks < KS; ++ks) {
          __m512i r[16];
          for (int t = 0; t < 16; ++t) r[t] = _mm512_loadu_si512(krow[half * 16 + t] + ks * 32);
          transpose16(r);
          uint32_t* dst = kp + ((h * NKT + sl * 2 + half) * KS + ks) * 256;
          for (int t = 0; t < 16; ++t) _mm512_storeu_si512(dst + t * 16, r[t]);
        }
      const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                          37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
      const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
      for (int64_t kpair = 0; kpair < 16; ++kpair)  // V: two keys' rows interleaved
        for (int64_t c = 0; c < D / 32; ++c) {
          const __m512i a = _mm512_loadu_si512(vrow[2 * kpair] + c * 32), b = _mm512_loadu_si512(vrow[2 * kpair + 1] + c * 32);
          uint16_t* dst = vp + ((h * NS + sl) * DT + 2 * c) * 512 + kpair * 32;
          _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(a, lo, b));
          _mm512_storeu_si512(dst + 512, _mm512_permutex2var_epi16(a, hi, b));
        }
    }

    // 2. attention, head by head (a thread keeps one head's K and V in its cache); within a head the
    // last rows see the most keys, so they go first
    Scratch w(D);
    B::begin();
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < Hkv * nrb; ++item) {
      const int64_t h = item / nrb, R0 = (nrb - 1 - item % nrb) * QB;
      int64_t kend = 0;
      for (int64_t r = 0; r < QB; ++r) {  // keys row r sees: up to its own position L - n + i
        w.vis[r] = R0 + r < rows ? L - n + (R0 + r) / G + 1 : 1;
        kend = std::max(kend, w.vis[r]);
      }
      std::fill(w.m.begin(), w.m.end(), -std::numeric_limits<float>::infinity());
      std::fill(w.l.begin(), w.l.end(), 0.0f);
      std::fill(w.o.begin(), w.o.end(), 0.0f);
      const uint16_t* qh = qp + (h * Rp + R0) * D;
      // the rows to compute: those past the last live one are padding (AMX multiplies all 64 regardless)
      const int64_t live = B::kWholeItems ? QB : round_up(std::min(QB, rows - R0), 16);
      for (int64_t k0 = 0; k0 < kend; k0 += KB) {
        const int64_t nk = std::min(KB, kend - k0), nk32 = round_up(nk, 32);
        B::qk(w.s.data(), qh, reinterpret_cast<const uint16_t*>(kp + (h * NKT + k0 / 16) * KS * 256), nk32 / 16, KS,
              D, live);  // S = Q K^T
        // online softmax over this block's visible keys, 16 at a time, in base 2: u = s * scale * log2(e)
        for (int64_t r = 0; r < live; ++r) {
          const int64_t lim = std::clamp<int64_t>(w.vis[r] - k0, 0, nk);
          const float* s = w.s.data() + r * KB;
          uint16_t* p = w.p.data() + r * KB;
          if (lim == 0) {
            std::memset(p, 0, nk32 * 2);
            continue;
          }
          __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
          for (int64_t j = 0; j < lim; j += 16)
            vmax = _mm512_mask_max_ps(vmax, lanes(lim - j), vmax, _mm512_loadu_ps(s + j));
          const float m_new = std::max(w.m[r], _mm512_reduce_max_ps(vmax) * scale2);  // max u
          const float alpha = std::exp2(w.m[r] - m_new);  // 0 on the first block (m = -inf)
          const __m512 sc = _mm512_set1_ps(scale2), mn = _mm512_set1_ps(-m_new);
          __m512 vsum = _mm512_setzero_ps();
          for (int64_t j = 0; j < nk32; j += 16) {
            const __m512 e = exp2_16(_mm512_fmadd_ps(_mm512_loadu_ps(s + j), sc, mn), lanes(lim - j));
            vsum = _mm512_add_ps(vsum, e);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
          }
          w.l[r] = w.l[r] * alpha + _mm512_reduce_add_ps(vsum);
          w.m[r] = m_new;
          if (alpha != 1.0f)
            for (int64_t d = 0; d < D; ++d) w.o[r * D + d] *= alpha;
        }
        B::pv(w.o.data(), w.p.data(), vp + (h * NS + k0 / 32) * DT * 512, nk32 / 32, DT, D, live);  // O += P V
      }
      for (int64_t r = 0; r < QB && R0 + r < rows; ++r) {
        const int64_t i = (R0 + r) / G, g = (R0 + r) % G;
        const float inv = 1.0f / w.l[r];  // l >= 1: a query sees its own key
        uint16_t* o = out + (i * Hq + h * G + g) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = f32_to_bf16(w.o[r * D + d] * inv);
      }
    }
    B::end();
  }
  return 0;
}

#endif  // SLUICE_BF16

}  // namespace

extern "C" {

// Which tile multiply sluice_prefill_attention can use in this build and process: 2 AMX (and AVX512-BF16 too),
// 1 AVX512-BF16 only, 0 none.
int sluice_prefill_attention_available() {
#if SLUICE_AMX
  if (amx_permitted()) return 2;
#endif
#if SLUICE_BF16
  return 1;
#else
  return 0;
#endif
}

// out, q: [n, Hq, D] bf16; caches [num_blocks, block_size, Hkv, D] bf16; table: the sequence's block ids;
// use_amx: AMX tiles, else vdpbf16ps. Returns 0, kBadBlock (a table entry outside the cache), kBadShape (n > L, a
// context longer than the table, or a head dim that is not a multiple of 32 up to 256, of 64 with AMX), or
// kUnsupported (not in this build or process). Nothing is written on an error.
int sluice_prefill_attention(void* out, const void* q, const void* k_cache, const void* v_cache,
                             const int32_t* table, int64_t table_len, int64_t n, int64_t L, int64_t num_q_heads,
                             int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks,
                             float scale, int num_threads, int use_amx) {
  if (n <= 0 || n > L || (L + block_size - 1) / block_size > table_len || head_dim % (use_amx ? 64 : 32) ||
      head_dim > 256 || num_kv_heads <= 0 || num_q_heads % num_kv_heads)
    return kBadShape;
#if SLUICE_BF16
  auto* o = static_cast<uint16_t*>(out);
  const auto *qq = static_cast<const uint16_t*>(q), *kc = static_cast<const uint16_t*>(k_cache),
             *vc = static_cast<const uint16_t*>(v_cache);
  if (!use_amx)
    return attend<Dpbf16>(o, qq, kc, vc, table, n, L, num_q_heads, num_kv_heads, head_dim, block_size, num_blocks,
                          scale, num_threads);
#if SLUICE_AMX
  if (amx_permitted())
    return attend<Amx>(o, qq, kc, vc, table, n, L, num_q_heads, num_kv_heads, head_dim, block_size, num_blocks,
                       scale, num_threads);
#endif
#endif
  (void)out, (void)q, (void)k_cache, (void)v_cache, (void)table, (void)scale, (void)num_threads, (void)num_blocks;
  return kUnsupported;
}

}  // extern "C"
