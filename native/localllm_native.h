/* localllm's native kernels: plain C functions over raw buffers, called through ctypes
 * (localllm/runners/torch/native.py). Each has a pure-torch twin the tests compare it with. */
#ifndef LOCALLLM_NATIVE_H
#define LOCALLLM_NATIVE_H

#include <stdint.h>

#define LM_OK 0
#define LM_EINVAL 1
#define LM_ENOMEM 2
#define LM_MAX_THREADS 256

#define LM_ABI_VERSION 2

/* Weight block formats, numbered as GGML's types. */
#define LM_Q4_0 2
#define LM_Q5_0 6
#define LM_Q8_0 8

typedef void (*lm_task_fn)(void *arg, int part, int parts);
void lm_pool_run(lm_task_fn fn, void *arg, int parts);
void lm_pool_set_spin(int64_t ns);
void lm_pool_use_openmp(void *parallel, void *thread_num, void *num_threads);

int lm_abi_version(void);

int lm_paged_attention(const float *q, float *out, const void *k, const void *v, int kv_f16, int num_seqs,
                       const int32_t *q_start, const int32_t *q_len, const int32_t *ctx_len,
                       const int32_t *tables, const int32_t *table_start, int block_size, int n_head,
                       int n_kv, int head_dim, float scale, int n_swa, int n_threads);

int lm_block_bytes(int wtype);
int lm_qmatmul(const float *x, int M, int K, const uint8_t *w, int wtype, int N, float *y, int n_threads,
               int force_scalar);
int lm_dequantize(const uint8_t *w, int wtype, int N, int K, float *out);

#endif
