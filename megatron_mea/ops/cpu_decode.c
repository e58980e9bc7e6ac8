/* Decode over MEA's scaled-components cache on the CPU: one pass over each request's rows.
 *
 * The math is `paged_decode`'s torch path (megatron_mea/integrations/vllm/paged_decode.py), the
 * reference the tests hold this to: for request r, query head h of group g = h / (np / ng),
 * component c and cached position t,
 *
 *     q~_h       = [A_k[h, 0] q_h ... A_k[h, nc-1] q_h]               (W = nc * hn)
 *     logit_h(t) = scale * r_g(t) * (q~_h . K(t))
 *     o_h        = sum_c A_v[h, c] (sum_t softmax_t(logit_h) V_c(t))  (hn)
 *
 * over the rows `[K (W) | r (ng) | V (W)]` that the block table names, with `A_k`, `A_v` the
 * mixing weights of each head's group. A request's positions go in tiles of TILE tokens; each
 * tile's rows are read once for every head of the request (the cache is the bytes that
 * matter), with an online softmax per head in fp32: the running maximum, sum and output are
 * rescaled once per tile, and only when the tile beats the maximum. Positions at or past a
 * request's length are never read.
 *
 * The requests are shared out over the process's OpenMP threads (one parallel region per call;
 * torch's ops are each one, about ten per tile in the torch path). The dots are blocked 4 heads
 * x 2 tokens (8 independent accumulators: a single dot of W would wait on its own FMA chain) and
 * the value updates 2 heads at a time, in GCC's vector extension (8 floats, which GCC lowers to
 * the CPU's own vectors: AVX here, the only kind it has run on; W a multiple of 8). Built by
 * megatron_mea/ops/cpu_decode.py with `-O3 -march=native -fopenmp` and called through ctypes; no
 * Python or torch headers, so it compiles in 1-3 s.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 8
#define TILE 32
/* Tiles ahead whose rows are prefetched. */
#define PREFETCH_TILES 2

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef float unaligned_vec __attribute__((vector_size(LANES * sizeof(float)), aligned(4)));

/* Row element types: the cache's dtype. */
enum { ROW_FLOAT32 = 0, ROW_BFLOAT16 = 1 };

static inline vec load(const float *p) { return *(const unaligned_vec *)p; }
static inline void store(float *p, vec v) { *(unaligned_vec *)p = v; }

static inline float lane_sum(vec v) {
    float sum = 0.0f;
    for (int i = 0; i < LANES; ++i) sum += v[i];
    return sum;
}

/* exp(x) for x <= 0 to a few fp32 ulp, branch-free so that the loops calling it vectorise
 * (glibc's expf does not): 2^n exp(f) with n = round(x / ln 2), |f| <= ln 2 / 2, and Cephes'
 * expf polynomial for exp(f). Below -86 it returns about exp(-86) (4e-38) rather than a denormal:
 * next to the softmax's largest weight, 1, it is nothing. */
static inline float exp_nonpositive(float x) {
    const float shift = 12582912.0f;  /* 1.5 * 2^23: adding it rounds to an integer */
    x = x < -86.0f ? -86.0f : x;
    float rounded = x * 1.44269504f + shift;
    int32_t n;
    memcpy(&n, &rounded, sizeof n);
    n -= 0x4B400000;  /* the bits of `shift` */
    float whole = rounded - shift;
    float f = x - whole * 0.693359375f + whole * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * f + 1.3981999507e-3f;
    p = p * f + 8.3334519073e-3f;
    p = p * f + 4.1665795894e-2f;
    p = p * f + 1.6666665459e-1f;
    p = p * f + 5.0000001201e-1f;
    float y = p * f * f + f + 1.0f;
    int32_t bits;
    memcpy(&bits, &y, sizeof bits);
    bits += n * (1 << 23);
    memcpy(&y, &bits, sizeof y);
    return y;
}

/* Where the cache's rows are: block b's token j at base + b * block_bytes + j * token_bytes. */
struct layout {
    const void *base;
    int64_t block_bytes, token_bytes, block_size, row_bytes;
};

/* The row of a request's `position`, through its block table `table`. */
static inline const char *row_address(const struct layout *layout, const int32_t *table,
                                      int64_t position) {
    return (const char *)layout->base + table[position / layout->block_size] * layout->block_bytes
           + (position % layout->block_size) * layout->token_bytes;
}

/* Asks the CPU to fetch the rows of positions [from, min(to, length)). */
static inline __attribute__((always_inline)) void prefetch_rows(
        const struct layout *layout, const int32_t *table, int64_t from, int64_t to,
        int64_t length) {
    for (int64_t position = from; position < to && position < length; ++position) {
        const char *row = row_address(layout, table, position);
        for (int64_t byte = 0; byte < layout->row_bytes; byte += 64) __builtin_prefetch(row + byte);
    }
}

/* `count` bfloat16 values as float: a bfloat16 is the high half of a float32. */
static void widen(const uint16_t *half, int64_t count, float *out) {
    for (int64_t i = 0; i < count; ++i) {
        uint32_t bits = (uint32_t)half[i] << 16;
        memcpy(out + i, &bits, sizeof bits);
    }
}

/* dots[h * TILE + t] = q_h . keys[t] for `heads` (1-4) consecutive heads and `tokens` (1-2)
 * keys; inlined with constant counts, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void dot_block(
        const float *q, int64_t width, const float *const *keys, int heads, int tokens,
        float *dots) {
    vec acc[4][2];
    for (int h = 0; h < heads; ++h)
        for (int t = 0; t < tokens; ++t) acc[h][t] = (vec){0};
    for (int64_t i = 0; i < width; i += LANES) {
        vec key[2];
        for (int t = 0; t < tokens; ++t) key[t] = load(keys[t] + i);
        for (int h = 0; h < heads; ++h) {
            vec qh = load(q + h * width + i);
            for (int t = 0; t < tokens; ++t) acc[h][t] += qh * key[t];
        }
    }
    for (int h = 0; h < heads; ++h)
        for (int t = 0; t < tokens; ++t) dots[h * TILE + t] = lane_sum(acc[h][t]);
}

/* dots [heads, TILE] of every head's query with a tile's `tokens` keys. */
static void tile_dots(const float *q, int64_t heads, int64_t width, const float *const *keys,
                      int64_t tokens, float *dots) {
    int64_t h = 0;
    for (; h + 4 <= heads; h += 4) {
        int64_t t = 0;
        for (; t + 2 <= tokens; t += 2)
            dot_block(q + h * width, width, keys + t, 4, 2, dots + h * TILE + t);
        if (t < tokens) dot_block(q + h * width, width, keys + t, 4, 1, dots + h * TILE + t);
    }
    for (; h < heads; ++h) {
        int64_t t = 0;
        for (; t + 2 <= tokens; t += 2)
            dot_block(q + h * width, width, keys + t, 1, 2, dots + h * TILE + t);
        if (t < tokens) dot_block(q + h * width, width, keys + t, 1, 1, dots + h * TILE + t);
    }
}

/* acc_h += sum_t weights[h * TILE + t] * values[t] for `heads` (1-2) consecutive heads. */
static inline __attribute__((always_inline)) void value_block(
        float *acc, int64_t width, const float *const *values, int64_t tokens,
        const float *weights, int heads) {
    for (int64_t i = 0; i < width; i += LANES) {
        vec sum[2];
        for (int h = 0; h < heads; ++h) sum[h] = load(acc + h * width + i);
        for (int64_t t = 0; t < tokens; ++t) {
            vec value = load(values[t] + i);
            for (int h = 0; h < heads; ++h) sum[h] += weights[h * TILE + t] * value;
        }
        for (int h = 0; h < heads; ++h) store(acc + h * width + i, sum[h]);
    }
}

/* One request: `query [heads, hn]` over its `length` positions through its block `table` into
 * `output [heads, hn]`, with the mixing weights `key_mix`, `value_mix [heads, components]`;
 * scratch of `scratch_floats` floats. */
static void decode_request(const float *query, const float *key_mix, const float *value_mix,
                           int64_t components, const struct layout *layout,
                           const int32_t *table, int64_t length, int kind, int64_t heads,
                           int64_t scales, int64_t width, float scale, float *output,
                           float *scratch) {
    int64_t heads_per_group = heads / scales;
    float *widened = scratch;  /* bfloat16 rows of a tile as float: [TILE, 2 * width + scales] */
    float *maximum = widened + TILE * (2 * width + scales);
    float *total = maximum + heads;
    float *logits = total + heads;           /* [heads, TILE] */
    float *weights = logits + heads * TILE;  /* [heads, TILE] */
    float *q = weights + heads * TILE;       /* the mixed queries q~ [heads, width] */
    float *acc = q + heads * width;          /* per-component outputs [heads, width] */
    const float *keys[TILE], *values[TILE], *row_scales[TILE];
    int64_t head_dim = width / components;
    for (int64_t h = 0; h < heads; ++h)
        for (int64_t c = 0; c < components; ++c)
            for (int64_t d = 0; d < head_dim; ++d)
                q[h * width + c * head_dim + d] = key_mix[h * components + c]
                                                  * query[h * head_dim + d];
    memset(acc, 0, (size_t)(heads * width) * sizeof(float));
    for (int64_t h = 0; h < heads; ++h) {
        maximum[h] = -INFINITY;
        total[h] = 0.0f;
    }
    for (int64_t first = 0; first < length; first += TILE) {
        int64_t tokens = length - first < TILE ? length - first : TILE;
        for (int64_t t = 0; t < tokens; ++t) {
            const char *row = row_address(layout, table, first + t);
            if (kind == ROW_FLOAT32) {
                keys[t] = (const float *)row;
            } else {
                float *into = widened + t * (2 * width + scales);
                widen((const uint16_t *)row, 2 * width + scales, into);
                keys[t] = into;
            }
            row_scales[t] = keys[t] + width;
            values[t] = keys[t] + width + scales;
        }
        /* The rows of the tile PREFETCH_TILES ahead are on their way while this one computes
         * (the first tile asks for the ones between too): each row is read once, and without
         * this the dots wait on memory. 16 requests x 640 positions at W = 128, one core, rows
         * in the CPU's cache: 1.5 ms against 2.3 without; 7 x 600 over a 200 MB pool, two
         * threads: about 0.48 ms against 0.55 with 16-token tiles and one tile ahead. */
        prefetch_rows(layout, table, first + PREFETCH_TILES * TILE,
                      first + (PREFETCH_TILES + 1) * TILE, length);
        if (first == 0) prefetch_rows(layout, table, TILE, PREFETCH_TILES * TILE, length);
        tile_dots(q, heads, width, keys, tokens, logits);
        for (int64_t h = 0; h < heads; ++h) {
            float *logit = logits + h * TILE, *weight = weights + h * TILE;
            int64_t group = h / heads_per_group;
            float top = maximum[h];
            for (int64_t t = 0; t < tokens; ++t) {
                logit[t] *= scale * row_scales[t][group];
                if (logit[t] > top) top = logit[t];
            }
            if (top > maximum[h]) {
                /* A new maximum: what came before shrinks by exp(old - new). */
                float shrink = expf(maximum[h] - top);
                total[h] *= shrink;
                for (int64_t i = 0; i < width; ++i) acc[h * width + i] *= shrink;
                maximum[h] = top;
            }
            for (int64_t t = 0; t < TILE; ++t) weight[t] = exp_nonpositive(logit[t] - top);
            for (int64_t t = 0; t < tokens; ++t) total[h] += weight[t];
        }
        int64_t h = 0;
        for (; h + 2 <= heads; h += 2)
            value_block(acc + h * width, width, values, tokens, weights + h * TILE, 2);
        if (h < heads) value_block(acc + h * width, width, values, tokens, weights + h * TILE, 1);
    }
    for (int64_t h = 0; h < heads; ++h) {
        float *out = output + h * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) out[d] = 0.0f;
        for (int64_t c = 0; c < components; ++c) {
            float weight = value_mix[h * components + c] / total[h];
            for (int64_t d = 0; d < head_dim; ++d)
                out[d] += weight * acc[h * width + c * head_dim + d];
        }
    }
}

/* The floats of `decode_request`'s scratch. */
static int64_t scratch_floats(int64_t heads, int64_t scales, int64_t width) {
    return TILE * (2 * width + scales) + (2 + 2 * TILE + 2 * width) * heads;
}

/* query [requests, heads, hn] fp32; key_mix, value_mix [heads, components] fp32 (hn = width /
 * components); rows: the cache, block b's token j at rows + (b * block_stride + j *
 * token_stride) elements; block_table [requests, table_width] int32; seq_lens [requests] int32
 * (each at least 1, within the table); output [requests, heads, hn] fp32. The requests are
 * shared out over OpenMP's threads (the process's runtime: torch's libgomp, whose team and
 * thread count `torch.set_num_threads` sets), one request at a time. Returns 0, or -1 where a
 * thread's scratch could not be allocated. */
int mea_scaled_decode(const float *query, const float *key_mix, const float *value_mix,
                      int64_t components, const void *rows, int kind, int64_t block_stride,
                      int64_t token_stride, int64_t block_size, const int32_t *block_table,
                      int64_t table_width, const int32_t *seq_lens, int64_t requests,
                      int64_t heads, int64_t scales, int64_t width, float scale,
                      float *output) {
    int64_t element = kind == ROW_FLOAT32 ? 4 : 2;
    struct layout layout = {rows, block_stride * element, token_stride * element, block_size,
                            (2 * width + scales) * element};
    int failed = 0;
#pragma omp parallel
    {
        float *scratch = malloc((size_t)scratch_floats(heads, scales, width) * sizeof(float));
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < requests; ++r) {
            if (scratch == NULL) continue;
            int64_t head_dim = width / components;
            decode_request(query + r * heads * head_dim, key_mix, value_mix, components,
                           &layout, block_table + r * table_width, seq_lens[r], kind, heads,
                           scales, width, scale, output + r * heads * head_dim, scratch);
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}
