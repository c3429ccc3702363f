/* Decode attention read straight from the paged KV cache (float32, CPU).
 *
 * One (sequence, KV head) per work item: the query heads of its group score every
 * key through the block table, softmax, then accumulate V. Reading K and V once, in
 * place, is what the torch path (gather, then SDPA) cannot do. Built on first use by
 * asyncllm/models/native.py with the OpenMP runtime torch already loaded. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                      int64_t cache_stride_token, const int64_t *tables, int64_t table_stride,
                      const int64_t *seq_lens, float *out, int64_t num_seqs, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                      int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
#pragma omp parallel for schedule(dynamic, 4) num_threads(num_threads)
    for (int64_t w = 0; w < num_seqs * num_kv_heads; w++) {
        const int64_t b = w / num_kv_heads, h = w % num_kv_heads, len = seq_lens[b];
        const int64_t *table = tables + b * table_stride;
        float *scores = (float *)malloc(sizeof(float) * (size_t)(group * len));
        float acc[group * head_dim];
        float maxs[group], sums[group];
        const float *qh = q + (b * num_heads + h * group) * head_dim;
        for (int64_t gi = 0; gi < group; gi++) maxs[gi] = -INFINITY;
        for (int64_t t = 0; t < len; t++) {
            const int64_t slot = table[t / block_size] * block_size + t % block_size;
            const float *k = k_cache + slot * cache_stride_token + h * head_dim;
            for (int64_t gi = 0; gi < group; gi++) {
                const float *qq = qh + gi * head_dim;
                float s = 0.f;
                for (int64_t d = 0; d < head_dim; d++) s += qq[d] * k[d];
                s *= scale;
                scores[gi * len + t] = s;
                if (s > maxs[gi]) maxs[gi] = s;
            }
        }
        for (int64_t gi = 0; gi < group; gi++) {
            float sum = 0.f;
            float *sc = scores + gi * len;
            for (int64_t t = 0; t < len; t++) {
                sc[t] = expf(sc[t] - maxs[gi]);
                sum += sc[t];
            }
            sums[gi] = sum;
        }
        memset(acc, 0, sizeof(acc));
        for (int64_t t = 0; t < len; t++) {
            const int64_t slot = table[t / block_size] * block_size + t % block_size;
            const float *v = v_cache + slot * cache_stride_token + h * head_dim;
            for (int64_t gi = 0; gi < group; gi++) {
                const float p = scores[gi * len + t];
                float *a = acc + gi * head_dim;
                for (int64_t d = 0; d < head_dim; d++) a[d] += p * v[d];
            }
        }
        for (int64_t gi = 0; gi < group; gi++) {
            float *o = out + (b * num_heads + h * group + gi) * head_dim;
            const float inv = 1.f / sums[gi];
            for (int64_t d = 0; d < head_dim; d++) o[d] = acc[gi * head_dim + d] * inv;
        }
        free(scores);
    }
}
