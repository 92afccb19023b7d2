/* Paged attention over the torch runner's KV pool, reading the blocks in place.
 *
 * The pool of one layer is K and V of shape [num_blocks, block_size, n_kv, head_dim]: float32,
 * float16, or int8 (q8_0) with float16 scales [num_blocks, block_size, n_kv], one per token and
 * KV head, the value being q * scale (kv_type: LM_KV_F32 / LM_KV_F16 / LM_KV_Q8). A
 * sequence's position p lives in block tables[table_start[s] + p / block_size], row
 * p % block_size. A step's queries are flattened: sequence s has q_len[s] rows starting at
 * row q_start[s] of q [N, n_head, head_dim] (float32), the last q_len[s] of its ctx_len[s]
 * positions. A query at position p sees the keys at positions <= p, and with a window
 * (n_swa > 0) only those less than n_swa back: the mask of localllm.runners.torch.attention.
 *
 * One work item is one sequence's tile of query rows, one KV head and a run of that head's
 * query heads; it walks the context a block at a time with an online softmax (running
 * maximum and sum), so each K and V row is converted to float32 once per item (q * scale is
 * exact in float32, as the pure-torch reference computes it) and nothing the size of the
 * context is copied. Items are shared out to the thread pool (pool.c) when the step's
 * work is large enough to pay for waking it.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "localllm_native.h"

/* The generic work item is compiled three times on x86-64 (for x86-64-v4, v3 and the baseline)
 * and run in the copy that lm_isa() allows (isa.c), so a forced lower tier runs its own code. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LM_TIERED 1
#define LM_V4 __attribute__((target("arch=x86-64-v4")))
#define LM_V3 __attribute__((target("arch=x86-64-v3")))
#endif

#define TILE_ROWS 4
#define MIN_WORK_PER_THREAD 4096 /* query-head x key dot products before a second thread pays */

/* n float16 values to float32: eight at a time with the F16C instruction where the CPU has it
 * (compilers do not vectorize the scalar conversion without AVX512-FP16). */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define LM_HAVE_F16C 1
#define LM_HAVE_AVX512_ATTN 1
__attribute__((target("avx,f16c"))) static void halves_f16c(const uint16_t *src, float *dst, int n) {
    int t = 0;
    for (; t + 8 <= n; t += 8) _mm256_storeu_ps(dst + t, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + t))));
    for (; t < n; t++) dst[t] = lm_half_to_float(src[t]);
}
#endif

static int cpu_has_f16c = -1; /* lm_isa_f16c(), read once a call in lm_paged_attention */

static void halves_to_floats(const uint16_t *src, float *dst, int n) {
#ifdef LM_HAVE_F16C
    if (cpu_has_f16c > 0) {
        halves_f16c(src, dst, n);
        return;
    }
#endif
    for (int t = 0; t < n; t++) dst[t] = lm_half_to_float(src[t]);
}

/* exp(x) for x <= 0 (Cephes' single-precision polynomial, within 2 ulp); x below -87 gives
 * about 1e-38, not 0: callers zero masked entries themselves. Plain arithmetic, so loops over
 * it vectorize. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale = {((int32_t)n + 127) << 23};
    return y * scale.f;
}

typedef struct {
    const float *q;
    float *out;
    const void *k, *v;
    const uint16_t *k_scales, *v_scales; /* float16 bits; LM_KV_Q8 only */
    int kv_type;
    const int32_t *q_start, *q_len, *ctx_len, *tables, *table_start;
    int block_size, n_head, n_kv, head_dim, n_swa;
    float scale;
    int head_chunks; /* query heads of one KV head are split into this many items */
    int32_t *items;  /* (seq, kv head, head chunk, first row, end row) per item */
    int n_items;
    int next;   /* the next unclaimed item (atomic) */
    int failed; /* a part could not get its scratch memory (atomic) */
    int max_blocks; /* the most blocks of keys one item visits (the AVX-512 copy keeps their scores) */
    int tier;       /* the copy to run: 4 AVX-512 (x86-64-v4), 3 AVX2 (x86-64-v3), else the baseline */
} job_t;

/* Rows row0..row0+n-1 of the flattened pool (block * block_size + offset), KV head kvh, as
 * float32 into dst (n, d). Inlined into each tier's copy, so the int8 loop is
 * vectorized for that copy's instruction set. */
static inline __attribute__((always_inline)) void load_rows(const void *cache, const uint16_t *scales, int kv_type,
                                                            size_t row0, int kvh, int n_kv, int n, int d,
                                                            float *restrict dst) {
    const size_t stride = (size_t)n_kv * d;
    for (int j = 0; j < n; j++) {
        const size_t row = row0 + j, first = row * stride + (size_t)kvh * d;
        float *restrict dj = dst + (size_t)j * d;
        if (kv_type == LM_KV_Q8) {
            const int8_t *src = (const int8_t *)cache + first;
            const float s = lm_half_to_float(scales[row * n_kv + kvh]);
            for (int t = 0; t < d; t++) dj[t] = (float)src[t] * s;
        } else if (kv_type == LM_KV_F16) {
            halves_to_floats((const uint16_t *)cache + first, dj, d);
        } else {
            memcpy(dj, (const float *)cache + first, sizeof(float) * d);
        }
    }
}

/* One work item; D is the head size, a constant in the specialized copies below (so the
 * compiler keeps a query's accumulator in registers and unrolls its loops). */
static inline __attribute__((always_inline)) void item_body(const job_t *J, const int32_t *item, float *scratch,
                                                            const int D) {
    const int s = item[0], kvh = item[1], chunk = item[2], r0 = item[3], r1 = item[4];
    const int bs = J->block_size, group = J->n_head / J->n_kv;
    const int per = (group + J->head_chunks - 1) / J->head_chunks;
    const int h0 = chunk * per, h1 = h0 + per < group ? h0 + per : group;
    const int nh = h1 - h0, nq = (r1 - r0) * nh;
    if (nh <= 0) return;
    const int ql = J->q_len[s], first_pos = J->ctx_len[s] - ql;
    const int32_t *table = J->tables + J->table_start[s];

    float *qv = scratch, *acc = qv + (size_t)nq * D, *m = acc + (size_t)nq * D, *l = m + nq;
    float *kb = l + nq, *vb = kb + (size_t)bs * D, *sc = vb + (size_t)bs * D;
    int *pos = (int *)(sc + (size_t)bs);

    for (int i = 0; i < r1 - r0; i++)
        for (int h = 0; h < nh; h++) {
            const float *src = J->q + ((size_t)(J->q_start[s] + r0 + i) * J->n_head + kvh * group + h0 + h) * D;
            float *dst = qv + (size_t)(i * nh + h) * D;
            for (int t = 0; t < D; t++) dst[t] = src[t] * J->scale;
        }
    for (int x = 0; x < nq; x++) { m[x] = -INFINITY; l[x] = 0.0f; pos[x] = first_pos + r0 + x / nh; }
    memset(acc, 0, sizeof(float) * (size_t)nq * D);

    const int hi = first_pos + r1 - 1;
    int lo = 0;
    /* With a window, the walk starts at the block that holds the tile's first visible key and
     * reads every block whole, each query's keys out of its window masked: a key's place in its
     * block's lanes, and so the order of the sums, is then the same whatever rows share the
     * tile (it began at that key, and a position decoded alone differed from the same
     * position in a prompt's chunk: a restart's prefix hit changed Gemma 3's answer). */
    if (J->n_swa > 0) { lo = first_pos + r0 - J->n_swa + 1; if (lo < 0) lo = 0; }
    for (int b0 = (lo / bs) * bs; b0 <= hi; b0 += bs) {
        const int blk = table[b0 / bs];
        const int j0 = b0, j1 = b0 + bs - 1 < hi ? b0 + bs - 1 : hi, n = j1 - j0 + 1; /* whole blocks: see lo */
        const size_t row0 = (size_t)blk * bs + (j0 - b0);
        load_rows(J->k, J->k_scales, J->kv_type, row0, kvh, J->n_kv, n, D, kb);
        load_rows(J->v, J->v_scales, J->kv_type, row0, kvh, J->n_kv, n, D, vb);
        for (int x = 0; x < nq; x++) {
            const float *qx = qv + (size_t)x * D;
            const int p = pos[x], see_lo = J->n_swa > 0 ? p - J->n_swa + 1 : 0;
            float cm = -INFINITY;
            for (int j = 0; j < n; j++) {
                const float *kj = kb + (size_t)j * D;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int t = 0; t < D; t++) dot += qx[t] * kj[t];
                const int key = j0 + j;
                sc[j] = (key <= p && key >= see_lo) ? dot : -INFINITY;
                cm = sc[j] > cm ? sc[j] : cm;
            }
            if (cm == -INFINITY) continue;
            const float mx = m[x] > cm ? m[x] : cm;
            float *ax = acc + (size_t)x * D;
            if (mx > m[x] && m[x] != -INFINITY) {
                const float corr = exp_nonpositive(m[x] - mx);
                l[x] *= corr;
                for (int t = 0; t < D; t++) ax[t] *= corr;
            }
            m[x] = mx;
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int j = 0; j < n; j++) {
                const float raw = sc[j];
                const float e = exp_nonpositive(raw - mx);
                const float p = raw == -INFINITY ? 0.0f : e;
                sc[j] = p;
                sum += p;
            }
            l[x] += sum;
            for (int j = 0; j < n; j++) {
                const float pj = sc[j];
                const float *vj = vb + (size_t)j * D;
                for (int t = 0; t < D; t++) ax[t] += pj * vj[t];
            }
        }
    }
    for (int i = 0; i < r1 - r0; i++)
        for (int h = 0; h < nh; h++) {
            const int x = i * nh + h;
            float *dst = J->out + ((size_t)(J->q_start[s] + r0 + i) * J->n_head + kvh * group + h0 + h) * D;
            const float inv = 1.0f / l[x];
            for (int t = 0; t < D; t++) dst[t] = acc[(size_t)x * D + t] * inv;
        }
}

#ifdef LM_TIERED
#define ITEM_TIERS(NAME, D_)                                                                                   \
    static void NAME(const job_t *J, const int32_t *it, float *sc) { item_body(J, it, sc, D_); }              \
    LM_V3 static void NAME##_v3(const job_t *J, const int32_t *it, float *sc) { item_body(J, it, sc, D_); }   \
    LM_V4 static void NAME##_v4(const job_t *J, const int32_t *it, float *sc) { item_body(J, it, sc, D_); }
#else
#define ITEM_TIERS(NAME, D_) \
    static void NAME(const job_t *J, const int32_t *it, float *sc) { item_body(J, it, sc, D_); }
#endif
ITEM_TIERS(item_d64, 64)
ITEM_TIERS(item_d128, 128)
ITEM_TIERS(item_d256, 256)
ITEM_TIERS(item_any, J->head_dim)


/* The AVX-512 copy of a work item, for pools of 16-token blocks (the BlockManager's) and head
 * sizes that are multiples of 16: a block's 16 keys are the 16 lanes of a vector. K of the
 * block is converted to float32 and transposed (kt[t] holds dimension t of the 16 keys), so a
 * query's 16 scores are D multiply-adds of its broadcast dimensions, eight queries sharing each
 * load; the softmax runs on the 16 lanes; V is added row by row. Every query's arithmetic is
 * the same whatever the other queries of its item (the same fused multiply-adds in the same
 * order), so a position decoded alone and checked among drafts agree bit for bit. */
#ifdef LM_HAVE_AVX512_ATTN
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#define QGROUP 8 /* queries scored together against one block (a KV head's 7 query heads in Qwen2.5) */
#define PREFETCH_BLOCKS 4 /* how far ahead the next blocks' rows are asked for (1: 7 % slower out of memory) */

AVX512 static inline __m512 load16(const void *cache, int kv_type, size_t first, float scale) {
    if (kv_type == LM_KV_Q8) {
        const __m128i b = _mm_loadu_si128((const __m128i *)((const int8_t *)cache + first));
        return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), _mm512_set1_ps(scale));
    }
    if (kv_type == LM_KV_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)cache + first)));
    return _mm512_loadu_ps((const float *)cache + first);
}

/* r[i][j] -> r[j][i] for 16 vectors of 16 floats. */
AVX512 static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    }
    for (int h = 0; h < 16; h += 8)
        for (int i = 0; i < 4; i++) {
            t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
            t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xdd);
        }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
}

/* exp_nonpositive on 16 lanes, with the same polynomial. */
AVX512 static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

/* Scores of G (a constant at each call, so the sums stay in registers) queries against a
 * block's transposed keys kt: two running sums per query (even and odd dimensions), so the
 * adds of one query do not wait on each other. */
AVX512 static inline __attribute__((always_inline)) void block_scores(const float *q0, const float *kt, const int D,
                                                                      const int G, __m512 *out) {
    __m512 sc[QGROUP], so[QGROUP];
    for (int g = 0; g < G; g++) sc[g] = so[g] = _mm512_setzero_ps();
    for (int t = 0; t < D; t += 2) {
        const __m512 ke = _mm512_load_ps(kt + (size_t)t * 16), ko = _mm512_load_ps(kt + (size_t)(t + 1) * 16);
        for (int g = 0; g < G; g++) {
            sc[g] = _mm512_fmadd_ps(_mm512_set1_ps(q0[(size_t)g * D + t]), ke, sc[g]);
            so[g] = _mm512_fmadd_ps(_mm512_set1_ps(q0[(size_t)g * D + t + 1]), ko, so[g]);
        }
    }
    for (int g = 0; g < G; g++) out[g] = _mm512_add_ps(sc[g], so[g]);
}

/* acc[g] += sum_j p[g][j] v[j] for G queries (a constant at each call; query g's 16
 * probabilities at pb + g * pstride), a dimension chunk at a time, V read from the pool (key j's
 * row at element first + j * stride), even and odd keys in two sums so that the adds of one
 * query do not wait on each other. */
AVX512 static inline __attribute__((always_inline)) void block_pv(float *acc, const float *pb, size_t pstride,
                                                                  const void *v, int kv, size_t first, size_t stride,
                                                                  const float *vsc, const int n, const int D,
                                                                  const int G) {
    for (int c = 0; c < D / 16; c++) {
        __m512 a[QGROUP], b[QGROUP];
        for (int g = 0; g < G; g++) {
            a[g] = _mm512_load_ps(acc + (size_t)g * D + c * 16);
            b[g] = _mm512_setzero_ps();
        }
        int j = 0;
        for (; j + 1 < n; j += 2) {
            const __m512 v0 = load16(v, kv, first + (size_t)j * stride + c * 16, vsc[j]);
            const __m512 v1 = load16(v, kv, first + (size_t)(j + 1) * stride + c * 16, vsc[j + 1]);
            for (int g = 0; g < G; g++) {
                a[g] = _mm512_fmadd_ps(_mm512_set1_ps(pb[g * pstride + j]), v0, a[g]);
                b[g] = _mm512_fmadd_ps(_mm512_set1_ps(pb[g * pstride + j + 1]), v1, b[g]);
            }
        }
        if (j < n) {
            const __m512 v0 = load16(v, kv, first + (size_t)j * stride + c * 16, vsc[j]);
            for (int g = 0; g < G; g++) a[g] = _mm512_fmadd_ps(_mm512_set1_ps(pb[g * pstride + j]), v0, a[g]);
        }
        for (int g = 0; g < G; g++) _mm512_store_ps(acc + (size_t)g * D + c * 16, _mm512_add_ps(a[g], b[g]));
    }
}

#define BY_GROUP(G, CALL) \
    switch (G) {           \
    case 1: { const int G_ = 1; CALL; } break; \
    case 2: { const int G_ = 2; CALL; } break; \
    case 3: { const int G_ = 3; CALL; } break; \
    case 4: { const int G_ = 4; CALL; } break; \
    case 5: { const int G_ = 5; CALL; } break; \
    case 6: { const int G_ = 6; CALL; } break; \
    case 7: { const int G_ = 7; CALL; } break; \
    default: { const int G_ = QGROUP; CALL; } break; \
    }

/* Blocks lie anywhere in the pool, so the hardware cannot guess the next one: ask for a head's
 * rows (element ``head`` of each, D elements of ``elt`` bytes) of the block PREFETCH_BLOCKS
 * after the one at key b0, while this one is computed. */
AVX512 static inline void prefetch_ahead(const void *cache, const int32_t *table, int b0, int hi, size_t stride,
                                         size_t head, int D, size_t elt) {
    if (b0 + 16 * PREFETCH_BLOCKS > hi) return;
    const size_t next = (size_t)table[b0 / 16 + PREFETCH_BLOCKS] * 16;
    for (int j = 0; j < 16; j++) {
        const size_t at = ((next + j) * stride + head) * elt;
        for (size_t off = 0; off < (size_t)D * elt; off += 64) _mm_prefetch((const char *)cache + at + off, _MM_HINT_T0);
    }
}

AVX512 static inline __attribute__((always_inline)) void item_avx512(const job_t *J, const int32_t *item,
                                                                      float *scratch, const int D, const int KV) {
    const int s = item[0], kvh = item[1], chunk = item[2], r0 = item[3], r1 = item[4];
    const int group = J->n_head / J->n_kv;
    const int per = (group + J->head_chunks - 1) / J->head_chunks;
    const int h0 = chunk * per, h1 = h0 + per < group ? h0 + per : group;
    const int nh = h1 - h0, nq = (r1 - r0) * nh, DV = D / 16;
    if (nh <= 0) return;
    const int ql = J->q_len[s], first_pos = J->ctx_len[s] - ql;
    const int32_t *table = J->tables + J->table_start[s];
    const size_t stride = (size_t)J->n_kv * D;

    const int hi = first_pos + r1 - 1;
    int lo = 0;
    /* With a window, the walk starts at the block that holds the tile's first visible key and
     * reads every block whole, each query's keys out of its window masked: a key's place in its
     * block's lanes, and so the order of the sums, is then the same whatever rows share the
     * tile (it began at that key, and a position decoded alone differed from the same
     * position in a prompt's chunk: a restart's prefix hit changed Gemma 3's answer). */
    if (J->n_swa > 0) { lo = first_pos + r0 - J->n_swa + 1; if (lo < 0) lo = 0; }
    const int b_first = lo / 16, n_blocks = hi / 16 - b_first + 1;
    const size_t pst = (size_t)n_blocks * 16; /* one query's scores (then probabilities), all blocks */

    /* 64-byte aligned parts of the scratch (scratch_floats leaves room for the rounding). */
    float *base = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    float *qv = base, *acc = qv + (size_t)nq * D, *kt = acc + (size_t)nq * D, *vb = kt + (size_t)16 * D;
    float *mv = vb + (size_t)16 * D, *l = mv + (size_t)16 * nq, *pb = l + ((nq + 15) & ~15);
    int *pos = (int *)(pb + (size_t)nq * pst);

    for (int i = 0; i < r1 - r0; i++)
        for (int h = 0; h < nh; h++) {
            const float *src = J->q + ((size_t)(J->q_start[s] + r0 + i) * J->n_head + kvh * group + h0 + h) * D;
            float *dst = qv + (size_t)(i * nh + h) * D;
            for (int t = 0; t < D; t++) dst[t] = src[t] * J->scale;
        }
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    for (int x = 0; x < nq; x++) { _mm512_store_ps(mv + (size_t)x * 16, neg_inf); pos[x] = first_pos + r0 + x / nh; }
    memset(acc, 0, sizeof(float) * (size_t)nq * D);

    /* Three passes over the blocks, so the softmax needs no running corrections: every query's
     * scores and their lane-wise maximum; then its probabilities against the maximum; then V
     * weighted by them. Each query's arithmetic is its own, the same in any batch. */
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const size_t elt = KV == LM_KV_F32 ? 4 : KV == LM_KV_F16 ? 2 : 1;
    for (int bi = 0; bi < n_blocks; bi++) {
        const int b0 = (b_first + bi) * 16, blk = table[b0 / 16];
        const int j0 = b0, j1 = b0 + 15 < hi ? b0 + 15 : hi, n = j1 - j0 + 1; /* whole blocks: see lo */
        const size_t row0 = (size_t)blk * 16 + (j0 - b0);
        prefetch_ahead(J->k, table, b0, hi, stride, (size_t)kvh * D, D, elt);
        float ksc[16];
        for (int j = 0; j < 16; j++)
            ksc[j] = KV == LM_KV_Q8 && j < n ? lm_half_to_float(J->k_scales[(row0 + j) * J->n_kv + kvh]) : 1.0f;
        for (int c = 0; c < DV; c++) {
            __m512 r[16];
            for (int j = 0; j < 16; j++)
                r[j] = j < n ? load16(J->k, KV, (row0 + j) * stride + (size_t)kvh * D + c * 16, ksc[j])
                             : _mm512_setzero_ps();
            transpose16(r);
            for (int t = 0; t < 16; t++) _mm512_store_ps(kt + (size_t)(c * 16 + t) * 16, r[t]);
        }
        /* lanes are keys j0 - (j0 - b0) .. : key j0 + lane, for the n valid ones */
        const __m512i keys = _mm512_add_epi32(_mm512_set1_epi32(j0), iota);
        const __mmask16 valid = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
        for (int x0 = 0; x0 < nq; x0 += QGROUP) {
            const int G = nq - x0 < QGROUP ? nq - x0 : QGROUP;
            __m512 sc[QGROUP];
            BY_GROUP(G, block_scores(qv + (size_t)x0 * D, kt, D, G_, sc))
            for (int g = 0; g < G; g++) {
                const int x = x0 + g, p = pos[x];
                const int see_lo = J->n_swa > 0 ? p - J->n_swa + 1 : 0;
                const __mmask16 seen = valid & _mm512_cmple_epi32_mask(keys, _mm512_set1_epi32(p)) &
                                       _mm512_cmpge_epi32_mask(keys, _mm512_set1_epi32(see_lo));
                const __m512 sv = _mm512_mask_mov_ps(neg_inf, seen, sc[g]);
                _mm512_store_ps(pb + x * pst + (size_t)bi * 16, sv);
                _mm512_store_ps(mv + (size_t)x * 16, _mm512_max_ps(_mm512_load_ps(mv + (size_t)x * 16), sv));
            }
        }
    }
    for (int x = 0; x < nq; x++) {
        const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_load_ps(mv + (size_t)x * 16)));
        __m512 sum = _mm512_setzero_ps();
        float *px = pb + x * pst;
        for (int bi = 0; bi < n_blocks; bi++) {
            const __m512 sv = _mm512_load_ps(px + (size_t)bi * 16);
            const __mmask16 seen = _mm512_cmp_ps_mask(sv, neg_inf, _CMP_NEQ_OQ);
            const __m512 e = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(sv, mx)));
            sum = _mm512_add_ps(sum, e);
            _mm512_store_ps(px + (size_t)bi * 16, e);
        }
        l[x] = _mm512_reduce_add_ps(sum);
    }
    for (int bi = 0; bi < n_blocks; bi++) {
        const int b0 = (b_first + bi) * 16, blk = table[b0 / 16];
        const int j0 = b0, j1 = b0 + 15 < hi ? b0 + 15 : hi, n = j1 - j0 + 1; /* whole blocks: see lo */
        const size_t row0 = (size_t)blk * 16 + (j0 - b0);
        prefetch_ahead(J->v, table, b0, hi, stride, (size_t)kvh * D, D, elt);
        float vsc[16];
        for (int j = 0; j < n; j++)
            vsc[j] = KV == LM_KV_Q8 ? lm_half_to_float(J->v_scales[(row0 + j) * J->n_kv + kvh]) : 1.0f;
        for (int x0 = 0; x0 < nq; x0 += QGROUP) {
            const int G = nq - x0 < QGROUP ? nq - x0 : QGROUP;
            BY_GROUP(G, block_pv(acc + (size_t)x0 * D, pb + x0 * pst + (size_t)bi * 16, pst, J->v, KV,
                                 row0 * stride + (size_t)kvh * D, stride, vsc, n, D, G_))
        }
    }
    for (int i = 0; i < r1 - r0; i++)
        for (int h = 0; h < nh; h++) {
            const int x = i * nh + h;
            float *dst = J->out + ((size_t)(J->q_start[s] + r0 + i) * J->n_head + kvh * group + h0 + h) * D;
            const float inv = 1.0f / l[x];
            for (int t = 0; t < D; t++) dst[t] = acc[(size_t)x * D + t] * inv;
        }
}

/* Copies for the common head sizes and each pool type, so that the inner loops know both. */
#define ITEM_COPIES(D_, NAME)                                                                               \
    AVX512 static void NAME(const job_t *J, const int32_t *it, float *sc) {                                   \
        switch (J->kv_type) {                                                                             \
        case LM_KV_F16: item_avx512(J, it, sc, D_, LM_KV_F16); return;                                    \
        case LM_KV_Q8: item_avx512(J, it, sc, D_, LM_KV_Q8); return;                                      \
        default: item_avx512(J, it, sc, D_, LM_KV_F32); return;                                           \
        }                                                                                                 \
    }
ITEM_COPIES(64, item_avx512_d64)
ITEM_COPIES(128, item_avx512_d128)
ITEM_COPIES(J->head_dim, item_avx512_any)
#endif

/* The AVX2 copy of the AVX-512 one (above), for the same pools (16-token blocks) and head sizes
 * that are multiples of 8: a block's 16 keys are two vectors of 8 lanes, K transposed through
 * 8 x 8 tiles, up to QGROUP8 queries sharing each load of the transposed keys and of V. Three
 * passes as there; each query's arithmetic is its own (its two halves of lanes, the same fmas
 * in the same order), so a position decoded alone and checked among drafts agree bit for bit.
 * (The generic copy computed a query's dot with each key alone, then V row by row through
 * memory: attention was a fifth of a 512-token Gemma 3 prefill on an AVX2-only EPYC.) */
#ifdef LM_HAVE_AVX512_ATTN
#define AVX2A __attribute__((target("avx2,fma,f16c")))
#define QGROUP8 6 /* queries scored together: 12 accumulators, two key vectors, a broadcast */

AVX2A static inline __m256 load8(const void *cache, int kv_type, size_t first, float scale) {
    if (kv_type == LM_KV_Q8) {
        const __m128i b = _mm_loadl_epi64((const __m128i *)((const int8_t *)cache + first));
        return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_set1_ps(scale));
    }
    if (kv_type == LM_KV_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)cache + first)));
    return _mm256_loadu_ps((const float *)cache + first);
}

/* r[i][j] -> r[j][i] for 8 vectors of 8 floats. */
AVX2A static inline void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

/* exp_nonpositive on 8 lanes, with the AVX-512 copy's steps. */
AVX2A static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)),
                                     _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

AVX2A static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

AVX2A static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Scores of G queries (a constant at each call) against a block's transposed keys: lanes 0-7
 * keys 0-7, lanes 8-15 keys 8-15. */
AVX2A static inline __attribute__((always_inline)) void block_scores8(const float *q0, const float *kt, const int D,
                                                                     const int G, __m256 *lo, __m256 *hi) {
    __m256 a[QGROUP8], b[QGROUP8];
    for (int g = 0; g < G; g++) a[g] = b[g] = _mm256_setzero_ps();
    for (int t = 0; t < D; t++) {
        const __m256 kl = _mm256_load_ps(kt + (size_t)t * 16), kh = _mm256_load_ps(kt + (size_t)t * 16 + 8);
        for (int g = 0; g < G; g++) {
            const __m256 qb = _mm256_broadcast_ss(q0 + (size_t)g * D + t);
            a[g] = _mm256_fmadd_ps(qb, kl, a[g]);
            b[g] = _mm256_fmadd_ps(qb, kh, b[g]);
        }
    }
    for (int g = 0; g < G; g++) lo[g] = a[g], hi[g] = b[g];
}

/* acc[g] += sum_j p[g][j] v[j] for G queries, 8 dimensions at a time, even and odd keys in two
 * sums (as the AVX-512 copy). */
AVX2A static inline __attribute__((always_inline)) void block_pv8(float *acc, const float *pb, size_t pstride,
                                                                 const void *v, int kv, size_t first, size_t stride,
                                                                 const float *vsc, const int n, const int D,
                                                                 const int G) {
    for (int c = 0; c < D / 8; c++) {
        __m256 a[QGROUP8], b[QGROUP8];
        for (int g = 0; g < G; g++) {
            a[g] = _mm256_load_ps(acc + (size_t)g * D + c * 8);
            b[g] = _mm256_setzero_ps();
        }
        int j = 0;
        for (; j + 1 < n; j += 2) {
            const __m256 v0 = load8(v, kv, first + (size_t)j * stride + c * 8, vsc[j]);
            const __m256 v1 = load8(v, kv, first + (size_t)(j + 1) * stride + c * 8, vsc[j + 1]);
            for (int g = 0; g < G; g++) {
                a[g] = _mm256_fmadd_ps(_mm256_broadcast_ss(pb + g * pstride + j), v0, a[g]);
                b[g] = _mm256_fmadd_ps(_mm256_broadcast_ss(pb + g * pstride + j + 1), v1, b[g]);
            }
        }
        if (j < n) {
            const __m256 v0 = load8(v, kv, first + (size_t)j * stride + c * 8, vsc[j]);
            for (int g = 0; g < G; g++) a[g] = _mm256_fmadd_ps(_mm256_broadcast_ss(pb + g * pstride + j), v0, a[g]);
        }
        for (int g = 0; g < G; g++) _mm256_store_ps(acc + (size_t)g * D + c * 8, _mm256_add_ps(a[g], b[g]));
    }
}

#define BY_GROUP8(G, CALL) \
    switch (G) {            \
    case 1: { const int G_ = 1; CALL; } break; \
    case 2: { const int G_ = 2; CALL; } break; \
    case 3: { const int G_ = 3; CALL; } break; \
    case 4: { const int G_ = 4; CALL; } break; \
    case 5: { const int G_ = 5; CALL; } break; \
    default: { const int G_ = QGROUP8; CALL; } break; \
    }

AVX2A static inline void prefetch_ahead8(const void *cache, const int32_t *table, int b0, int hi, size_t stride,
                                         size_t head, int D, size_t elt) {
    if (b0 + 16 * PREFETCH_BLOCKS > hi) return;
    const size_t next = (size_t)table[b0 / 16 + PREFETCH_BLOCKS] * 16;
    for (int j = 0; j < 16; j++) {
        const size_t at = ((next + j) * stride + head) * elt;
        for (size_t off = 0; off < (size_t)D * elt; off += 64) _mm_prefetch((const char *)cache + at + off, _MM_HINT_T0);
    }
}

AVX2A static inline __attribute__((always_inline)) void item_avx2(const job_t *J, const int32_t *item, float *scratch,
                                                                 const int D, const int KV) {
    const int s = item[0], kvh = item[1], chunk = item[2], r0 = item[3], r1 = item[4];
    const int group = J->n_head / J->n_kv;
    const int per = (group + J->head_chunks - 1) / J->head_chunks;
    const int h0 = chunk * per, h1 = h0 + per < group ? h0 + per : group;
    const int nh = h1 - h0, nq = (r1 - r0) * nh, DV = D / 8;
    if (nh <= 0) return;
    const int ql = J->q_len[s], first_pos = J->ctx_len[s] - ql;
    const int32_t *table = J->tables + J->table_start[s];
    const size_t stride = (size_t)J->n_kv * D;

    const int hi = first_pos + r1 - 1;
    int lo = 0;
    /* With a window, the walk starts at the block that holds the tile's first visible key and
     * reads every block whole, each query's keys out of its window masked: a key's place in its
     * block's lanes, and so the order of the sums, is then the same whatever rows share the
     * tile (it began at that key, and a position decoded alone differed from the same
     * position in a prompt's chunk: a restart's prefix hit changed Gemma 3's answer). */
    if (J->n_swa > 0) { lo = first_pos + r0 - J->n_swa + 1; if (lo < 0) lo = 0; }
    const int b_first = lo / 16, n_blocks = hi / 16 - b_first + 1;
    const size_t pst = (size_t)n_blocks * 16;

    float *base = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63); /* the AVX-512 copy's layout */
    float *qv = base, *acc = qv + (size_t)nq * D, *kt = acc + (size_t)nq * D, *vb = kt + (size_t)16 * D;
    float *mv = vb + (size_t)16 * D, *l = mv + (size_t)16 * nq, *pb = l + ((nq + 15) & ~15);
    int *pos = (int *)(pb + (size_t)nq * pst);

    for (int i = 0; i < r1 - r0; i++)
        for (int h = 0; h < nh; h++) {
            const float *src = J->q + ((size_t)(J->q_start[s] + r0 + i) * J->n_head + kvh * group + h0 + h) * D;
            float *dst = qv + (size_t)(i * nh + h) * D;
            for (int t = 0; t < D; t++) dst[t] = src[t] * J->scale;
        }
    const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
    for (int x = 0; x < nq; x++) {
        _mm256_store_ps(mv + (size_t)x * 16, neg_inf);
        _mm256_store_ps(mv + (size_t)x * 16 + 8, neg_inf);
        pos[x] = first_pos + r0 + x / nh;
    }
    memset(acc, 0, sizeof(float) * (size_t)nq * D);

    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const size_t elt = KV == LM_KV_F32 ? 4 : KV == LM_KV_F16 ? 2 : 1;
    for (int bi = 0; bi < n_blocks; bi++) {
        const int b0 = (b_first + bi) * 16, blk = table[b0 / 16];
        const int j0 = b0, j1 = b0 + 15 < hi ? b0 + 15 : hi, n = j1 - j0 + 1; /* whole blocks: see lo */
        const size_t row0 = (size_t)blk * 16 + (j0 - b0);
        prefetch_ahead8(J->k, table, b0, hi, stride, (size_t)kvh * D, D, elt);
        float ksc[16];
        for (int j = 0; j < 16; j++)
            ksc[j] = KV == LM_KV_Q8 && j < n ? lm_half_to_float(J->k_scales[(row0 + j) * J->n_kv + kvh]) : 1.0f;
        for (int c = 0; c < DV; c++)
            for (int half = 0; half < 2; half++) {
                __m256 r[8];
                for (int j = 0; j < 8; j++) {
                    const int key = 8 * half + j;
                    r[j] = key < n ? load8(J->k, KV, (row0 + key) * stride + (size_t)kvh * D + c * 8, ksc[key])
                                   : _mm256_setzero_ps();
                }
                transpose8(r);
                for (int t = 0; t < 8; t++) _mm256_store_ps(kt + (size_t)(c * 8 + t) * 16 + 8 * half, r[t]);
            }
        /* lanes are keys j0 + lane (lanes 8-15: j0 + 8 + lane), for the n valid ones */
        const __m256i keys_lo = _mm256_add_epi32(_mm256_set1_epi32(j0), iota);
        const __m256i keys_hi = _mm256_add_epi32(keys_lo, _mm256_set1_epi32(8));
        for (int x0 = 0; x0 < nq; x0 += QGROUP8) {
            const int G = nq - x0 < QGROUP8 ? nq - x0 : QGROUP8;
            __m256 sl[QGROUP8], sh[QGROUP8];
            BY_GROUP8(G, block_scores8(qv + (size_t)x0 * D, kt, D, G_, sl, sh))
            for (int g = 0; g < G; g++) {
                const int x = x0 + g, p = pos[x];
                const int see_lo = J->n_swa > 0 ? p - J->n_swa + 1 : 0;
                const __m256i top = _mm256_set1_epi32(p < j0 + n - 1 ? p : j0 + n - 1), bottom = _mm256_set1_epi32(see_lo - 1);
                /* seen: see_lo <= key <= min(p, the last valid key) */
                const __m256 ml = _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_cmpgt_epi32(keys_lo, top),
                                                                          _mm256_cmpgt_epi32(keys_lo, bottom)));
                const __m256 mh = _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_cmpgt_epi32(keys_hi, top),
                                                                          _mm256_cmpgt_epi32(keys_hi, bottom)));
                const __m256 vl = _mm256_blendv_ps(neg_inf, sl[g], ml), vh = _mm256_blendv_ps(neg_inf, sh[g], mh);
                float *px = pb + x * pst + (size_t)bi * 16, *mx = mv + (size_t)x * 16;
                _mm256_store_ps(px, vl);
                _mm256_store_ps(px + 8, vh);
                _mm256_store_ps(mx, _mm256_max_ps(_mm256_load_ps(mx), vl));
                _mm256_store_ps(mx + 8, _mm256_max_ps(_mm256_load_ps(mx + 8), vh));
            }
        }
    }
    for (int x = 0; x < nq; x++) {
        const __m256 mx = _mm256_set1_ps(hmax8(_mm256_max_ps(_mm256_load_ps(mv + (size_t)x * 16),
                                                              _mm256_load_ps(mv + (size_t)x * 16 + 8))));
        __m256 sum_lo = _mm256_setzero_ps(), sum_hi = _mm256_setzero_ps();
        float *px = pb + x * pst;
        for (int bi = 0; bi < n_blocks; bi++)
            for (int half = 0; half < 2; half++) {
                float *at = px + (size_t)bi * 16 + 8 * half;
                const __m256 sv = _mm256_load_ps(at);
                const __m256 seen = _mm256_cmp_ps(sv, neg_inf, _CMP_NEQ_OQ);
                const __m256 e = _mm256_and_ps(seen, exp8(_mm256_sub_ps(sv, mx)));
                if (half) sum_hi = _mm256_add_ps(sum_hi, e);
                else sum_lo = _mm256_add_ps(sum_lo, e);
                _mm256_store_ps(at, e);
            }
        l[x] = hsum8(_mm256_add_ps(sum_lo, sum_hi));
    }
    for (int bi = 0; bi < n_blocks; bi++) {
        const int b0 = (b_first + bi) * 16, blk = table[b0 / 16];
        const int j0 = b0, j1 = b0 + 15 < hi ? b0 + 15 : hi, n = j1 - j0 + 1; /* whole blocks: see lo */
        const size_t row0 = (size_t)blk * 16 + (j0 - b0);
        prefetch_ahead8(J->v, table, b0, hi, stride, (size_t)kvh * D, D, elt);
        float vsc[16];
        for (int j = 0; j < n; j++)
            vsc[j] = KV == LM_KV_Q8 ? lm_half_to_float(J->v_scales[(row0 + j) * J->n_kv + kvh]) : 1.0f;
        for (int x0 = 0; x0 < nq; x0 += QGROUP8) {
            const int G = nq - x0 < QGROUP8 ? nq - x0 : QGROUP8;
            BY_GROUP8(G, block_pv8(acc + (size_t)x0 * D, pb + x0 * pst + (size_t)bi * 16, pst, J->v, KV,
                                   row0 * stride + (size_t)kvh * D, stride, vsc, n, D, G_))
        }
    }
    for (int i = 0; i < r1 - r0; i++)
        for (int h = 0; h < nh; h++) {
            const int x = i * nh + h;
            float *dst = J->out + ((size_t)(J->q_start[s] + r0 + i) * J->n_head + kvh * group + h0 + h) * D;
            const float inv = 1.0f / l[x];
            for (int t = 0; t < D; t++) dst[t] = acc[(size_t)x * D + t] * inv;
        }
}

#define ITEM_COPIES8(D_, NAME)                                                                              \
    AVX2A static void NAME(const job_t *J, const int32_t *it, float *sc) {                                   \
        switch (J->kv_type) {                                                                             \
        case LM_KV_F16: item_avx2(J, it, sc, D_, LM_KV_F16); return;                                      \
        case LM_KV_Q8: item_avx2(J, it, sc, D_, LM_KV_Q8); return;                                        \
        default: item_avx2(J, it, sc, D_, LM_KV_F32); return;                                             \
        }                                                                                                 \
    }
ITEM_COPIES8(64, item_avx2_d64)
ITEM_COPIES8(128, item_avx2_d128)
ITEM_COPIES8(256, item_avx2_d256)
ITEM_COPIES8(J->head_dim, item_avx2_any)
#endif

static void run_item(const job_t *J, const int32_t *item, float *scratch) {
#ifdef LM_HAVE_AVX512_ATTN
    if (J->tier == 4 && J->block_size == 16 && J->head_dim % 16 == 0) {
        switch (J->head_dim) {
        case 64: item_avx512_d64(J, item, scratch); return;
        case 128: item_avx512_d128(J, item, scratch); return;
        default: item_avx512_any(J, item, scratch); return;
        }
    }
#endif
#ifdef LM_HAVE_AVX512_ATTN
    if (J->tier == 3 && J->block_size == 16 && J->head_dim % 8 == 0) {
        switch (J->head_dim) {
        case 64: item_avx2_d64(J, item, scratch); return;
        case 128: item_avx2_d128(J, item, scratch); return;
        case 256: item_avx2_d256(J, item, scratch); return;
        default: item_avx2_any(J, item, scratch); return;
        }
    }
#endif
#ifdef LM_TIERED
#define BY_TIER(NAME) (J->tier == 4 ? NAME##_v4 : J->tier == 3 ? NAME##_v3 : NAME)(J, item, scratch)
#else
#define BY_TIER(NAME) NAME(J, item, scratch)
#endif
    switch (J->head_dim) {
    case 64: BY_TIER(item_d64); break;
    case 128: BY_TIER(item_d128); break;
    case 256: BY_TIER(item_d256); break;
    default: BY_TIER(item_any);
    }
#undef BY_TIER
}

static size_t scratch_floats(const job_t *J) {
    const int group = J->n_head / J->n_kv, per = (group + J->head_chunks - 1) / J->head_chunks;
    const size_t nq = (size_t)TILE_ROWS * per;
    /* the AVX-512 copy also keeps each query's lane maxima and its scores of every block it
     * visits, and aligns its parts to 64 bytes */
    return 2 * nq * J->head_dim + 19 * nq + 2 * (size_t)J->block_size * J->head_dim + J->block_size + 32 +
           32 * (size_t)J->head_dim + 16 * nq + 16 + nq * (size_t)J->max_blocks * 16;
}

static void attend_part(void *arg, int part, int parts) {
    job_t *J = (job_t *)arg;
    (void)part;
    (void)parts;
    float *scratch = malloc(sizeof(float) * scratch_floats(J));
    if (scratch == NULL) {
        __atomic_store_n(&J->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    for (;;) {
        const int i = __atomic_fetch_add(&J->next, 1, __ATOMIC_RELAXED);
        if (i >= J->n_items) break;
        run_item(J, J->items + 5 * (size_t)i, scratch);
    }
    free(scratch);
}

int lm_paged_attention(const float *q, float *out, const void *k, const void *v, const uint16_t *k_scales,
                       const uint16_t *v_scales, int kv_type, int num_seqs, const int32_t *q_start,
                       const int32_t *q_len, const int32_t *ctx_len, const int32_t *tables,
                       const int32_t *table_start, int block_size, int n_head, int n_kv, int head_dim, float scale,
                       int n_swa, int n_threads) {
    if (n_kv <= 0 || n_head % n_kv != 0 || block_size <= 0 || head_dim <= 0) return LM_EINVAL;
    if (kv_type != LM_KV_F32 && kv_type != LM_KV_F16 && kv_type != LM_KV_Q8) return LM_EINVAL;
    if (kv_type == LM_KV_Q8 && (k_scales == NULL || v_scales == NULL)) return LM_EINVAL;
    cpu_has_f16c = lm_isa_f16c();
    job_t J = {q, out, k, v, k_scales, v_scales, kv_type, q_start, q_len, ctx_len, tables, table_start,
               block_size, n_head, n_kv, head_dim, n_swa, scale, 1, NULL, 0, 0, 0, 0};
    J.tier = lm_isa_avx512() ? 4 : lm_isa() >= LM_ISA_AVX2 ? 3 : 1;
    const int group = n_head / n_kv;
    long tiles = 0;
    double work = 0;
    for (int s = 0; s < num_seqs; s++) {
        if (q_len[s] > ctx_len[s] || q_len[s] < 0) return LM_EINVAL;
        tiles += (q_len[s] + TILE_ROWS - 1) / TILE_ROWS;
        if ((ctx_len[s] + 15) / 16 + 1 > J.max_blocks) J.max_blocks = (ctx_len[s] + 15) / 16 + 1;
        work += (double)q_len[s] * ctx_len[s] * n_head;
    }
    int threads = n_threads < 1 ? 1 : n_threads;
    if (work < (double)MIN_WORK_PER_THREAD * 2) threads = 1;
    else if (work < (double)MIN_WORK_PER_THREAD * threads) threads = (int)(work / MIN_WORK_PER_THREAD);
    /* Fewer items than threads (a single decoding sequence of a model with one KV head): split
     * the query heads of each KV head so every thread has work (each part reads the blocks). */
    while (J.head_chunks < group && tiles * n_kv * J.head_chunks < threads) J.head_chunks *= 2;
    if (J.head_chunks > group) J.head_chunks = group;
    J.items = malloc(sizeof(int32_t) * 5 * (size_t)(tiles * n_kv * J.head_chunks));
    if (J.items == NULL) return LM_ENOMEM;
    for (int s = 0; s < num_seqs; s++)
        for (int r0 = 0; r0 < q_len[s]; r0 += TILE_ROWS)
            for (int h = 0; h < n_kv; h++)
                for (int c = 0; c < J.head_chunks; c++) {
                    int32_t *it = J.items + 5 * (size_t)J.n_items++;
                    it[0] = s; it[1] = h; it[2] = c; it[3] = r0;
                    it[4] = r0 + TILE_ROWS < q_len[s] ? r0 + TILE_ROWS : q_len[s];
                }
    lm_pool_run(attend_part, &J, threads, threads); /* each part claims items */
    free(J.items);
    return J.failed ? LM_ENOMEM : LM_OK;
}
