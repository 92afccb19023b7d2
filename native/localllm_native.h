/* localllm's native kernels: plain C functions over raw buffers, called through ctypes
 * (localllm/runners/torch/native.py). Each has a pure-torch twin the tests compare it with. */
#ifndef LOCALLLM_NATIVE_H
#define LOCALLLM_NATIVE_H

#include <stdint.h>
#include <string.h>

/* A float16 (its bits) as a float32: the compiler's _Float16 where it has one. */
static inline float lm_half_to_float(uint16_t h) {
#ifdef __FLT16_MAX__
    _Float16 f;
    memcpy(&f, &h, 2);
    return (float)f;
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalize */
        exp = 113;
        while (!(man & 0x400)) { man <<= 1; exp--; }
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* Weight rows are streamed once a step, front to back: the vector loops ask for the bytes
 * LM_PREFETCH_BYTES ahead of the block they read, so the next lines are on their way from memory
 * while this block is multiplied (the hardware prefetcher alone left a one-thread decode
 * waiting on memory). A hint: no effect on results. */
#ifndef LM_PREFETCH_BYTES
#define LM_PREFETCH_BYTES 2048
#endif
#define LM_PREFETCH(p) __builtin_prefetch((const char *)(p) + LM_PREFETCH_BYTES, 0, 3)

#define LM_OK 0
#define LM_EINVAL 1
#define LM_ENOMEM 2
#define LM_MAX_THREADS 256

/* Bumped when a call changes and when a kernel's results change (the torch runner's prefix
 * cache fingerprint carries it: stored K/V are the bits these kernels computed). */
#define LM_ABI_VERSION 12 /* 3: lm_paged_attention takes kv_type and the q8_0 scales; 4: lm_repack, lm_cpu_level; 5: rows.c;
                            6: isa.c (lm_isa, lm_set_isa) in place of lm_cpu_level; 7: kquant.c (Q4_K, Q5_K,
                            Q6_K on every tier), tier 2 is AVX-VNNI; 8: Q5_0X, lm_repack takes the layout made;
                            9: layer.c (lm_layers_forward); 10: attention's AVX2 copy; 11: Q4_0R, Q5_0R,
                            Q8_0R (8 rows interleaved, one float sum a row); 12: Q4_KR, Q6_KR likewise,
                            lm_kquant_repack */

/* What a KV pool holds (lm_paged_attention's kv_type). */
#define LM_KV_F32 0
#define LM_KV_F16 1
#define LM_KV_Q8 2 /* int8 values, a float16 scale per token and KV head */

/* Weight block formats, numbered as GGML's types. */
#define LM_Q4_0 2
#define LM_Q5_0 6
#define LM_Q8_0 8
#define LM_Q4_K 12
#define LM_Q5_K 13
#define LM_Q6_K 14
#define LM_Q5_0P 106 /* Q5_0 repacked in pairs of blocks for AVX-512 (qmatmul.c); not a GGML type */
#define LM_Q4_0P 102 /* Q4_0 likewise */
#define LM_Q5_0X 116 /* Q5_0 in pairs with the high bits laid out for 256-bit vectors (qmatmul.c) */
#define LM_Q4_0R 122 /* Q4_0 / Q5_0 / Q8_0 with 8 rows interleaved, a block at a time (qmatmul.c) */
#define LM_Q5_0R 126
#define LM_Q8_0R 128
#define LM_Q4_KR 112 /* Q4_K / Q6_K with 8 rows interleaved, a super-block at a time (kquant.c) */
#define LM_Q6_KR 114

typedef void (*lm_task_fn)(void *arg, int part, int parts);
void lm_pool_run(lm_task_fn fn, void *arg, int parts, int threads);
int lm_pool_parts(int units, int threads); /* how many parts to cut `units` of work into for `threads` */

int lm_abi_version(void);

int lm_paged_attention(const float *q, float *out, const void *k, const void *v, const uint16_t *k_scales,
                       const uint16_t *v_scales, int kv_type, int num_seqs, const int32_t *q_start,
                       const int32_t *q_len, const int32_t *ctx_len, const int32_t *tables,
                       const int32_t *table_start, int block_size, int n_head, int n_kv, int head_dim, float scale,
                       int n_swa, int n_threads);

int lm_block_bytes(int wtype);
int lm_kquant_bytes(int wtype);
/* rows8.c: W's blocks interleaved 8 rows at a time (LM_Q4_0R, LM_Q5_0R, LM_Q8_0R) against x's
 * 8-bit blocks (xq: M * nb blocks of 32 bytes, xd their scales), on tier ``level``. */
int lm_rows8_type(int wtype);
int lm_rows8_matmul(int level, int wtype, const uint8_t *w, int N, int nb, const int8_t *xq, const float *xd,
                    int M, float *y, int n_threads);
int lm_rows8_repack(const uint8_t *w, int packed, int N, int K, uint8_t *out, int reverse, int n_threads);
/* kquant.c: Q4_K / Q6_K with 8 rows interleaved (LM_Q4_KR, LM_Q6_KR), made by lm_kquant_repack */
int lm_kquant_rows8_type(int wtype);
int lm_kquant_repack(const uint8_t *w, int packed, int N, int K, uint8_t *out, int reverse, int n_threads);
int lm_qmatmul_k(const float *x, int M, int K, const uint8_t *w, int wtype, int N, float *y, int n_threads,
                 int level);
int lm_qmatmul(const float *x, int M, int K, const uint8_t *w, int wtype, int N, float *y, int n_threads,
               int force_scalar);
int lm_dequantize(const uint8_t *w, int wtype, int N, int K, float *out);
int lm_repack(const uint8_t *w, int packed, int N, int K, uint8_t *out, int reverse, int n_threads);

int lm_rms_norm(const float *x, const float *w, float *y, int rows, int n, float eps);
int lm_rope(const float *x, float *out, const float *cs, const float *sn, int rows, int heads, int hd, int neox);
int lm_silu_mul(const float *gate, const float *up, float *out, int rows, int n, int ld_gate, int ld_up);

/* Instruction-set tiers (isa.c), lowest first: the kernels run the highest one that both the
 * CPU has and lm_set_isa allows. */
#define LM_ISA_SCALAR 0
#define LM_ISA_AVX2 1 /* AVX2, FMA, F16C */
#define LM_ISA_AVXVNNI 2 /* AVX2 with AVX-VNNI (VEX vpdpbusd on 256-bit vectors: Intel's laptop chips since Alder Lake) */
#define LM_ISA_AVX512VNNI 3
int lm_isa(void);
int lm_isa_detected(void);
int lm_isa_tiers(void); /* bit t: the CPU has tier t */
int lm_set_isa(int level);
int lm_isa_f16c(void);   /* float16 conversions with F16C */
int lm_isa_avx512(void); /* attention's AVX-512 copy (F, BW, VL, DQ; no VNNI needed), unless a lower tier is forced */

/* The transpose of an 8 x 8 bit matrix (byte L bit k to byte k bit L), its own inverse: three
 * exchanges of bit blocks (Hacker's Delight, transpose8), where a loop over the 64 bits made a
 * fifth of a model's load (the high bits of Q5_0X and Q5_0R). */
static inline uint64_t lm_transpose_bits(uint64_t x) {
    uint64_t t = (x ^ (x >> 7)) & 0x00AA00AA00AA00AAull;
    x ^= t ^ (t << 7);
    t = (x ^ (x >> 14)) & 0x0000CCCC0000CCCCull;
    x ^= t ^ (t << 14);
    t = (x ^ (x >> 28)) & 0x00000000F0F0F0F0ull;
    return x ^ t ^ (t << 28);
}

/* The one order in which every tier adds the float lanes of a dot product (the AVX2 copy: the
 * upper half onto the lower, then the upper two onto the lower two, then the two), so that the
 * result does not depend on the tier. lm_sum16: lane i with lane i + 8 first. */
static inline float lm_sum8(const float v[8]) {
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}
static inline float lm_sum16(const float v[16]) {
    float t[8];
    for (int i = 0; i < 8; i++) t[i] = v[i] + v[i + 8];
    return lm_sum8(t);
}

#endif
