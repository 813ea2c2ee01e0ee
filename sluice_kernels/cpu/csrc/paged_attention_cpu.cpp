// Paged attention for CPUs: reads K and V from the paged cache in place, one pass, fp32 online softmax.
//
// Same contract as `kernels.reference.paged_attention` (docs/architecture.md §8), for the sequences whose query
// length is at most `max_q_len` (the Python wrapper sends longer prefill chunks to SDPA). Plain C ABI,
// called through ctypes: no torch headers, so it builds in seconds with any g++.
//
// Decode attention on a CPU is bound by reading the cache, so a work item is one sequence and a group
// of its KV heads (all of them unless the batch is too small to keep every thread busy): a block's
// rows are then read front to back. Each query row walks the blocks once: scores, online-softmax
// update, weighted sum of V. With AVX-512 (or AVX2) and a head dim of 32, 64 or 128, a row's accumulator stays
// in registers and the scores of 16 (8) keys come out of one transpose-and-add instead of a horizontal sum per
// key; elsewhere the same loops are plain C++ that the compiler vectorizes. Items are scheduled
// dynamically, as context lengths differ. (Software prefetch of the next block measured slower.)
//
// A quantized cache (int8 or fp8 e4m3, one fp32 scale per token and KV head) is read as is: a key's scale
// multiplies its score, a value's scale its softmax weight, so no row is dequantized into memory.
#include <omp.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_common.h"

namespace {

using namespace sluice;

// Sixteen independent partial sums: vectorizes without reassociating a single float sum.
inline float dot(const float* __restrict__ a, const float* __restrict__ b, int64_t n) {
  float acc[16] = {};
  const int64_t body = n / 16 * 16;
  for (int64_t i = 0; i < body; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += a[i + j] * b[i + j];
  float s = 0.0f;
  for (int64_t i = body; i < n; ++i) s += a[i] * b[i];
  for (int j = 0; j < 16; ++j) s += acc[j];
  return s;
}

// One query row against one block's visible keys. `k`, `v`: the block's first row for this KV head;
// rows are `stride` elements apart. Generic version: any head dim.
template <class E, int DC>
struct RowOps {
  using T = typename E::T;
  // s[t] = q . k_t for t < n
  static void scores(const float* q, const T* k, int64_t stride, int64_t n, int64_t D, float* row, float* s) {
    for (int64_t t = 0; t < n; ++t) {
      to_f32<E>(k + t * stride, row, D);
      s[t] = dot(q, row, D);
    }
  }
  // acc = acc * alpha + sum_t p[t] * v_t
  static void weighted_sum(float* acc, float alpha, const float* p, const T* v, int64_t stride, int64_t n,
                           int64_t D, float* row) {
    for (int64_t d = 0; d < D; ++d) acc[d] *= alpha;
    for (int64_t t = 0; t < n; ++t) {
      to_f32<E>(v + t * stride, row, D);
      for (int64_t d = 0; d < D; ++d) acc[d] += p[t] * row[d];
    }
  }
};

#if defined(__AVX512F__)
template <class E> __m512 load16(const typename E::T* p);
template <> inline __m512 load16<F32>(const float* p) { return _mm512_loadu_ps(p); }
template <> inline __m512 load16<BF16>(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
template <> inline __m512 load16<F16>(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
template <> inline __m512 load16<I8>(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
template <> inline __m512 load16<FP8>(const uint8_t* p) {  // as cpu_common.h fp8_to_f32: through a half
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                    _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
}

// Lane t of the result is the sum of the 16 lanes of v[t]: four levels of pairwise interleave-and-add.
inline __m512 transpose_sum16(const __m512* v) {
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: v[2i] partials at 0, 2; v[2i+1] at 1, 3
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: one partial of each of 4 consecutive rows
    const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)  // add 128-bit lanes pairwise: 0x88 picks lanes 0, 2 of each; 0xDD lanes 1, 3
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88), _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
}

template <class E, int DC>
  requires(DC > 0 && DC % 16 == 0)
struct RowOps<E, DC> {
  using T = typename E::T;
  static constexpr int C = DC / 16;  // 16-float chunks of a row
  static void scores(const float* q, const T* k, int64_t stride, int64_t n, int64_t, float*, float* s) {
    __m512 qv[C];
    for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
      const int m = int(std::min<int64_t>(16, n - t0));
      __m512 v[16];
      for (int t = 0; t < 16; ++t) {
        if (t < m) {
          const T* kt = k + (t0 + t) * stride;
          __m512 a = _mm512_mul_ps(qv[0], load16<E>(kt));
          for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(qv[c], load16<E>(kt + 16 * c), a);
          v[t] = a;
        } else {
          v[t] = _mm512_setzero_ps();
        }
      }
      _mm512_mask_storeu_ps(s + t0, __mmask16((1u << m) - 1), transpose_sum16(v));
    }
  }
  static void weighted_sum(float* acc, float alpha, const float* p, const T* v, int64_t stride, int64_t n,
                           int64_t, float*) {
    __m512 a[C];
    const __m512 al = _mm512_set1_ps(alpha);
    for (int c = 0; c < C; ++c) a[c] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * c), al);
    for (int64_t t = 0; t < n; ++t) {
      const __m512 pt = _mm512_set1_ps(p[t]);
      const T* vt = v + t * stride;
      for (int c = 0; c < C; ++c) a[c] = _mm512_fmadd_ps(pt, load16<E>(vt + 16 * c), a[c]);
    }
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + 16 * c, a[c]);
  }
};
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// AVX2 (most x86 CPUs without AVX-512): the same shape, eight floats a register. The plain loops reduce each
// key's score horizontally (16 partial sums, one at a time); here eight keys' scores come out of one
// transpose-and-add, and a row's accumulator stays in registers across a block's values.
template <class E> __m256 load8(const typename E::T* p);
template <> inline __m256 load8<F32>(const float* p) { return _mm256_loadu_ps(p); }
template <> inline __m256 load8<BF16>(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
template <> inline __m256 load8<F16>(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
template <> inline __m256 load8<I8>(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
template <> inline __m256 load8<FP8>(const uint8_t* p) {  // as cpu_common.h fp8_to_f32: through a half
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                 _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
}

// Lane t of the result is the sum of the 8 lanes of v[t]: two levels of horizontal adds give each 128-bit
// half's sums of four rows, then the halves are added.
inline __m256 transpose_sum8(const __m256* v) {
  const __m256 y0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));  // rows 0-3, per half
  const __m256 y1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));  // rows 4-7
  return _mm256_add_ps(_mm256_permute2f128_ps(y0, y1, 0x20), _mm256_permute2f128_ps(y0, y1, 0x31));
}

template <class E, int DC>
  requires(DC > 0 && DC % 8 == 0)
struct RowOps<E, DC> {
  using T = typename E::T;
  static constexpr int C = DC / 8;  // 8-float chunks of a row
  static void scores(const float* q, const T* k, int64_t stride, int64_t n, int64_t, float*, float* s) {
    __m256 qv[C];
    for (int c = 0; c < C; ++c) qv[c] = _mm256_loadu_ps(q + 8 * c);
    for (int64_t t0 = 0; t0 < n; t0 += 8) {
      const int m = int(std::min<int64_t>(8, n - t0));
      __m256 v[8];
      for (int t = 0; t < 8; ++t) {
        if (t < m) {
          const T* kt = k + (t0 + t) * stride;
          __m256 a = _mm256_mul_ps(qv[0], load8<E>(kt));
          for (int c = 1; c < C; ++c) a = _mm256_fmadd_ps(qv[c], load8<E>(kt + 8 * c), a);
          v[t] = a;
        } else {
          v[t] = _mm256_setzero_ps();
        }
      }
      alignas(32) float out[8];
      _mm256_store_ps(out, transpose_sum8(v));
      std::memcpy(s + t0, out, m * sizeof(float));
    }
  }
  static void weighted_sum(float* acc, float alpha, const float* p, const T* v, int64_t stride, int64_t n,
                           int64_t, float*) {
    __m256 a[C];
    const __m256 al = _mm256_set1_ps(alpha);
    for (int c = 0; c < C; ++c) a[c] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * c), al);
    for (int64_t t = 0; t < n; ++t) {
      const __m256 pt = _mm256_set1_ps(p[t]);
      const T* vt = v + t * stride;
      for (int c = 0; c < C; ++c) a[c] = _mm256_fmadd_ps(pt, load8<E>(vt + 8 * c), a[c]);
    }
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + 8 * c, a[c]);
  }
};
#endif

struct Scratch {
  std::vector<float> q, acc, m, l, row, s;
  void reserve(int64_t rows, int64_t D, int64_t bs) {
    if (int64_t(q.size()) < rows * D) { q.resize(rows * D); acc.resize(rows * D); }
    if (int64_t(m.size()) < rows) { m.resize(rows); l.resize(rows); }
    if (int64_t(row.size()) < D) row.resize(D);
    if (int64_t(s.size()) < bs) s.resize(bs);
  }
};

struct Args {
  void* out;
  const void *q, *k_cache, *v_cache;
  const float *k_scales, *v_scales;  // [num_blocks, bs, Hkv] for a quantized cache, else null
  const int32_t *block_tables, *cu_seqlens_q, *seq_lens;
  int64_t bt_stride, max_blocks, num_seqs, Hq, Hkv, D, bs, num_blocks, max_q_len;
  float scale;
  int num_threads;
};

// E: the element of q and out; C: of the cache (E, or a quantized one). DC: the head dim when known at compile
// time (32, 64 and 128: small models' and the common ones), else 0.
template <class E, class C, int DC>
int attend(const Args& a) {
  using T = typename E::T;
  using CT = typename C::T;
  using Ops = RowOps<C, DC>;
  const int64_t D = DC ? DC : a.D, bs = a.bs, Hkv = a.Hkv, Hq = a.Hq, G = Hq / Hkv;
  const int64_t tok_stride = Hkv * D;  // elements between two tokens of one block in the cache
  const int64_t blk_stride = bs * tok_stride;
  // heads per item: all of a sequence's, halved while there are fewer than 4 items per thread
  int64_t hpi = Hkv;
  while (hpi % 2 == 0 && a.num_seqs * (Hkv / hpi) < 4 * int64_t(a.num_threads)) hpi /= 2;
  const int64_t groups = Hkv / hpi;
  const int64_t items = a.num_seqs * groups;
  const T* q = static_cast<const T*>(a.q);
  const CT* kc = static_cast<const CT*>(a.k_cache);
  const CT* vc = static_cast<const CT*>(a.v_cache);
  T* out = static_cast<T*>(a.out);
  std::atomic<int> error{0};

#pragma omp parallel num_threads(a.num_threads)
  {
    Scratch w;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t b = item / groups, h0 = item % groups * hpi;
      const int64_t q0 = a.cu_seqlens_q[b], nq = a.cu_seqlens_q[b + 1] - q0, L = a.seq_lens[b];
      if (nq <= 0 || nq > a.max_q_len) continue;
      const int64_t nblk = (L + bs - 1) / bs;
      const int32_t* table = a.block_tables + b * a.bt_stride;
      if (nq > L || nblk > a.max_blocks) { error = 2; continue; }
      bool ok = true;
      for (int64_t j = 0; j < nblk; ++j) ok &= table[j] >= 0 && table[j] < a.num_blocks;
      if (!ok) { error = 1; continue; }

      // row r = (i * hpi + hh) * G + g: query i, KV head h0 + hh, query head (h0 + hh) * G + g; the
      // query heads of one item are adjacent in q and out
      const int64_t R = nq * hpi * G;
      w.reserve(R, D, bs);
      float* qf = w.q.data();
      float* acc = w.acc.data();
      float* m = w.m.data();
      float* l = w.l.data();
      float* s = w.s.data();
      for (int64_t i = 0; i < nq; ++i) {
        float* qi = qf + i * hpi * G * D;
        to_f32<E>(q + ((q0 + i) * Hq + h0 * G) * D, qi, hpi * G * D);
        for (int64_t d = 0; d < hpi * G * D; ++d) qi[d] *= a.scale;
      }
      std::fill(m, m + R, -std::numeric_limits<float>::infinity());
      std::fill(l, l + R, 0.0f);
      std::fill(acc, acc + R * D, 0.0f);

      for (int64_t j = 0; j < nblk; ++j) {
        const int64_t ntok = std::min(bs, L - j * bs);
        const int64_t base = int64_t(table[j]) * blk_stride;
        for (int64_t r = 0; r < R; ++r) {
          const int64_t i = r / (hpi * G), hh = r / G % hpi;
          // query i sits at position L - nq + i and sees keys at positions <= its own
          const int64_t nvis = std::min(ntok, L - nq + i - j * bs + 1);
          if (nvis <= 0) continue;
          const int64_t off = base + (h0 + hh) * D;
          const int64_t soff = int64_t(table[j]) * bs * Hkv + h0 + hh;  // scale of (block, token 0, head)
          Ops::scores(qf + r * D, kc + off, tok_stride, nvis, D, w.row.data(), s);
          if (a.k_scales)
            for (int64_t t = 0; t < nvis; ++t) s[t] *= a.k_scales[soff + t * Hkv];
          float bmax = s[0];
          for (int64_t t = 1; t < nvis; ++t) bmax = s[t] > bmax ? s[t] : bmax;
          const float m_new = std::max(m[r], bmax);
          const float alpha = std::exp(m[r] - m_new);  // 0 on the first visible block (m = -inf)
          for (int64_t t = 0; t < nvis; ++t) s[t] = fast_exp(s[t] - m_new);
          float sum = 0.0f;
          for (int64_t t = 0; t < nvis; ++t) sum += s[t];
          l[r] = l[r] * alpha + sum;
          m[r] = m_new;
          if (a.v_scales)
            for (int64_t t = 0; t < nvis; ++t) s[t] *= a.v_scales[soff + t * Hkv];
          Ops::weighted_sum(acc + r * D, alpha, s, vc + off, tok_stride, nvis, D, w.row.data());
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        const float inv = 1.0f / l[r];  // l >= 1: every query sees at least its own key
        const float* ar = acc + r * D;
        const int64_t i = r / (hpi * G), hg = r % (hpi * G);  // hg: query head h0 * G + hg
        T* o = out + ((q0 + i) * Hq + h0 * G + hg) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = E::from(ar[d] * inv);
      }
    }
  }
  return error.load();
}

template <class E, class C>
int attend_any_dim(const Args& a) {
  switch (a.D) {
    case 32:  // (small models': not quantized, whose instances would only add build time)
      if constexpr (std::is_same_v<E, C>) return attend<E, C, 32>(a);
      return attend<E, C, 0>(a);
    case 64: return attend<E, C, 64>(a);
    case 128: return attend<E, C, 128>(a);
    default: return attend<E, C, 0>(a);
  }
}

template <class E>
int attend_any_cache(const Args& a, int cache_dtype) {
  switch (cache_dtype) {
    case kI8: return attend_any_dim<E, I8>(a);
    case kFP8: return attend_any_dim<E, FP8>(a);
    default: return attend_any_dim<E, E>(a);  // the wrapper checked it is q's dtype
  }
}

}  // namespace

extern "C" {

// Returns 0, or: 1 a block id outside [0, num_blocks), 2 a sequence whose blocks or query length do not
// fit its context (q_len > seq_len or seq_len > max_blocks * block_size). Nothing is read out of bounds:
// an item checks its sequence before touching memory, and a failed item writes no output. `cache_dtype`: the
// caches' element, `dtype` or kI8 / kFP8 with their scales (null otherwise).
int sluice_paged_attention(
    void* out, const void* q, const void* k_cache, const void* v_cache, int dtype,
    int cache_dtype, const float* k_scales, const float* v_scales,
    const int32_t* block_tables, int64_t bt_stride, int64_t max_blocks,
    const int32_t* cu_seqlens_q, const int32_t* seq_lens, int64_t num_seqs,
    int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks,
    float scale, int64_t max_q_len, int num_threads) {
  const Args a{out, q, k_cache, v_cache, k_scales, v_scales, block_tables, cu_seqlens_q, seq_lens, bt_stride, max_blocks, num_seqs,
               num_q_heads, num_kv_heads, head_dim, block_size, num_blocks, max_q_len, scale, num_threads};
  switch (dtype) {
    case kBF16: return attend_any_cache<BF16>(a, cache_dtype);
    case kF16: return attend_any_cache<F16>(a, cache_dtype);
    default: return attend_any_cache<F32>(a, cache_dtype);
  }
}

}  // extern "C"
