// The per-token ops of a layer, fused, for CPUs: rms_norm (with the residual add), rotary embedding,
// store_kv and silu_and_mul; and gather_kv, a prefill chunk's context for SDPA. Same contracts and roundings as their torch twins in kernels/reference.py
// (docs/architecture.md §8); each replaces 4-25 small torch ops, whose dispatch is most of a small decode step.
// Rows are split over OpenMP threads only when there are enough of them to pay for waking the threads.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_common.h"

namespace {

using namespace sluice;

constexpr int64_t kParallelElements = 1 << 16;  // below this, one thread

// Rounds to the element type and back: the twins store intermediate results in the tensor dtype.
template <class E>
inline float round_to(float x) {
  return E::to(E::from(x));
}

template <class E>
void rms_norm(void* out_, const void* x_, const void* res_, void* res_out_, const void* w_, int64_t T, int64_t H,
              float eps, int threads) {
  using T_ = typename E::T;
  T_* out = static_cast<T_*>(out_);
  const T_* x = static_cast<const T_*>(x_);
  const T_* res = static_cast<const T_*>(res_);
  T_* res_out = static_cast<T_*>(res_out_);
  const T_* w = static_cast<const T_*>(w_);
#pragma omp parallel for num_threads(threads) if (T * H >= kParallelElements)
  for (int64_t t = 0; t < T; ++t) {
    const T_* xr = x + t * H;
    T_* o = out + t * H;
    float ss = 0.0f;
    if (res) {  // x + residual, rounded to the dtype, is both the new residual and what is normalized
      const T_* rr = res + t * H;
      T_* ro = res_out + t * H;
      for (int64_t i = 0; i < H; ++i) ro[i] = E::from(E::to(xr[i]) + E::to(rr[i]));
      xr = ro;
    }
    for (int64_t i = 0; i < H; ++i) {
      const float v = E::to(xr[i]);
      ss += v * v;
    }
    const float inv = 1.0f / std::sqrt(ss / float(H) + eps);
    for (int64_t i = 0; i < H; ++i) o[i] = E::from(round_to<E>(E::to(xr[i]) * inv) * E::to(w[i]));
  }
}

// In place on the first rot_dim dims of every head of q [T, Hq, D] and k [T, Hkv, D].
template <class E>
int rotary(const int64_t* pos, void* q_, void* k_, const float* cos_sin, int64_t max_pos, int64_t T, int64_t Hq,
           int64_t Hkv, int64_t D, int64_t rot_dim, bool neox, int threads) {
  using T_ = typename E::T;
  const int64_t half = rot_dim / 2;
  for (int64_t t = 0; t < T; ++t)
    if (pos[t] < 0 || pos[t] >= max_pos) return 1;  // before anything is rotated
#pragma omp parallel for num_threads(threads) if (T * (Hq + Hkv) * D >= kParallelElements)
  for (int64_t t = 0; t < T; ++t) {
    const float* cs = cos_sin + pos[t] * rot_dim;  // cos (half), then sin (half)
    for (int which = 0; which < 2; ++which) {
      const int64_t H = which ? Hkv : Hq;
      T_* x = static_cast<T_*>(which ? k_ : q_) + t * H * D;
      for (int64_t h = 0; h < H; ++h, x += D) {
        for (int64_t i = 0; i < half; ++i) {
          // neox: (i, i + half) rotate together; GPT-J: (2i, 2i + 1)
          const int64_t a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
          const float x1 = E::to(x[a]), x2 = E::to(x[b]), c = cs[i], s = cs[half + i];
          x[a] = E::from(x1 * c - x2 * s);
          x[b] = E::from(x2 * c + x1 * s);
        }
      }
    }
  }
  return 0;
}

template <class E>
void silu_and_mul(void* out_, const void* x_, int64_t N, int64_t d, int threads) {
  using T_ = typename E::T;
  T_* out = static_cast<T_*>(out_);
  const T_* x = static_cast<const T_*>(x_);
#pragma omp parallel for num_threads(threads) if (N * d >= kParallelElements)
  for (int64_t n = 0; n < N; ++n) {
    const T_* a = x + n * 2 * d;
    const T_* b = a + d;
    T_* o = out + n * d;
    for (int64_t i = 0; i < d; ++i) {
      const float v = E::to(a[i]);
      o[i] = E::from(round_to<E>(v / (1.0f + fast_exp(-v))) * E::to(b[i]));
    }
  }
}

template <template <class> class F, class... A>
auto by_dtype(int dtype, A... args) {
  switch (dtype) {
    case kBF16: return F<BF16>::run(args...);
    case kF16: return F<F16>::run(args...);
    default: return F<F32>::run(args...);
  }
}

// Rows of x ([T, H, D] of E) into a quantized cache of C, one scale per token and head, exactly as
// kernels/reference.py quantize does: no multiply-add contraction, which would round differently.
template <class E, class C>
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
void quantize_rows(const typename E::T* x, typename C::T* cache, float* scales, const int64_t* slots, int64_t T,
                   int64_t H, int64_t D) {
  for (int64_t t = 0; t < T; ++t) {
    if (slots[t] < 0) continue;
    for (int64_t h = 0; h < H; ++h) {
      const typename E::T* row = x + (t * H + h) * D;
      typename C::T* dst = cache + (slots[t] * H + h) * D;
      float amax = 0.0f;
      for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(E::to(row[d])));
      const float inv = amax > 0.0f ? C::kMax / amax : 0.0f;
      for (int64_t d = 0; d < D; ++d) dst[d] = C::from(E::to(row[d]) * inv);
      scales[slots[t] * H + h] = amax / C::kMax;
    }
  }
}

template <class E, class C>
void quantize_kv(const void* k, const void* v, void* k_cache, void* v_cache, float* k_scales, float* v_scales,
                 const int64_t* slots, int64_t T, int64_t H, int64_t D) {
  using T_ = typename E::T;
  using CT = typename C::T;
  quantize_rows<E, C>(static_cast<const T_*>(k), static_cast<CT*>(k_cache), k_scales, slots, T, H, D);
  quantize_rows<E, C>(static_cast<const T_*>(v), static_cast<CT*>(v_cache), v_scales, slots, T, H, D);
}

template <class E> struct Quantize {
  template <class... A> static int run(int cache_dtype, A... a) {
    if (cache_dtype == kFP8) quantize_kv<E, FP8>(a...);
    else quantize_kv<E, I8>(a...);
    return 0;
  }
};
template <class E> struct RmsNorm { template <class... A> static int run(A... a) { rms_norm<E>(a...); return 0; } };
template <class E> struct Rotary { template <class... A> static int run(A... a) { return rotary<E>(a...); } };
template <class E> struct SiluAndMul { template <class... A> static int run(A... a) { silu_and_mul<E>(a...); return 0; } };

}  // namespace

extern "C" {

// residual may be null; then residual_out is unused.
int sluice_rms_norm(void* out, const void* x, const void* residual, void* residual_out, const void* weight, int dtype,
                    int64_t T, int64_t H, float eps, int threads) {
  return by_dtype<RmsNorm>(dtype, out, x, residual, residual_out, weight, T, H, eps, threads);
}

// Returns 1, having rotated nothing, if a position is outside the cos/sin cache; else 0.
int sluice_rotary(const int64_t* positions, void* q, void* k, const float* cos_sin, int64_t max_pos, int dtype,
                  int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t rot_dim, int neox, int threads) {
  return by_dtype<Rotary>(dtype, positions, q, k, cos_sin, max_pos, T, Hq, Hkv, D, rot_dim, neox != 0, threads);
}

// Copies row t of k and v ([T, row] elements each) to slot slots[t] of the caches; -1 skips. Returns 1
// (having copied nothing) if a slot is outside [-1, num_slots).
int sluice_store_kv(const void* k, const void* v, void* k_cache, void* v_cache, const int64_t* slots, int64_t T,
                    int64_t row_bytes, int64_t num_slots) {
  for (int64_t t = 0; t < T; ++t)
    if (slots[t] < -1 || slots[t] >= num_slots) return 1;
  const char* kb = static_cast<const char*>(k);
  const char* vb = static_cast<const char*>(v);
  char* kc = static_cast<char*>(k_cache);
  char* vc = static_cast<char*>(v_cache);
  for (int64_t t = 0; t < T; ++t) {
    if (slots[t] < 0) continue;
    std::memcpy(kc + slots[t] * row_bytes, kb + t * row_bytes, row_bytes);
    std::memcpy(vc + slots[t] * row_bytes, vb + t * row_bytes, row_bytes);
  }
  return 0;
}

// Quantizes row t of k and v ([T, H, D] of `dtype`) into slot slots[t] of int8 or fp8 caches (`cache_dtype`),
// their scales into k_scales / v_scales [num_slots, H]; -1 skips. Returns 1 (having written nothing) if a slot
// is outside [-1, num_slots).
int sluice_store_kv_quant(const void* k, const void* v, void* k_cache, void* v_cache, float* k_scales,
                          float* v_scales, const int64_t* slots, int64_t T, int64_t H, int64_t D, int dtype,
                          int cache_dtype, int64_t num_slots) {
  for (int64_t t = 0; t < T; ++t)
    if (slots[t] < -1 || slots[t] >= num_slots) return 1;
  return by_dtype<Quantize>(dtype, cache_dtype, k, v, k_cache, v_cache, k_scales, v_scales, slots, T, H, D);
}

// A prefill chunk's context, copied out of the paged caches head-major: k_out, v_out [Hkv, L, D] (what
// SDPA's flash kernel reads fastest). Returns 1, having copied nothing, if a block id is outside the cache.
int sluice_gather_kv(const void* k_cache, const void* v_cache, void* k_out, void* v_out, const int32_t* table,
                     int64_t L, int64_t block_size, int64_t Hkv, int64_t D, int64_t elem_bytes, int64_t num_blocks,
                     int threads) {
  const int64_t nblk = (L + block_size - 1) / block_size;
  for (int64_t j = 0; j < nblk; ++j)
    if (table[j] < 0 || table[j] >= num_blocks) return 1;
  const int64_t row = D * elem_bytes;  // one head of one token
#pragma omp parallel for num_threads(threads) if (L * Hkv * D >= kParallelElements)
  for (int64_t t = 0; t < L; ++t) {
    const int64_t src = ((int64_t(table[t / block_size]) * block_size + t % block_size) * Hkv) * row;
    for (int64_t h = 0; h < Hkv; ++h) {
      const int64_t dst = (h * L + t) * row;
      std::memcpy(static_cast<char*>(k_out) + dst, static_cast<const char*>(k_cache) + src + h * row, row);
      std::memcpy(static_cast<char*>(v_out) + dst, static_cast<const char*>(v_cache) + src + h * row, row);
    }
  }
  return 0;
}

int sluice_silu_and_mul(void* out, const void* x, int dtype, int64_t N, int64_t d, int threads) {
  return by_dtype<SiluAndMul>(dtype, out, x, N, d, threads);
}

}  // extern "C"
