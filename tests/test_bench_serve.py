"""`mea-bench-serve`'s arithmetic without a server: the KV pool that holds a given number of the
original's requests, `/metrics` parsing, and the medians and MEA / original ratios of the report
(the serving itself is tested end to end in tests/vllm/test_bench_serve.py)."""

import json
import math

from megatron_mea.apps.bench import serve_exports, serve_report
from megatron_mea.apps.bench.serve_rounds import parse_metrics


def test_pool_holds_the_asked_requests_of_the_original_in_whole_blocks():
    sizes, prompt, output = serve_exports.SHAPES["hd128"]
    # 4 layers x K and V x 4 groups x 128 channels x fp32
    assert serve_exports.kv_bytes_per_token(sizes) == 4 * 2 * 4 * 128 * 4
    pool = serve_exports.pool_bytes(sizes, prompt + output, 4.25)
    blocks = pool // (serve_exports.BLOCK_SIZE * serve_exports.kv_bytes_per_token(sizes))
    per_request = math.ceil((prompt + output) / serve_exports.BLOCK_SIZE)  # 9 of 128 tokens
    assert blocks == math.ceil(4.25 * per_request) + 1  # vLLM keeps one block back
    assert (blocks - 1) // per_request == 4
    # MEA nc = ng/2 caches half the bytes per token: twice the blocks, 8 requests.
    assert (2 * blocks - 1) // per_request == 8
    # head_dim defaults to hidden / heads where the config has none.
    plain = dict(sizes, head_dim=None)
    assert serve_exports.kv_bytes_per_token(plain) == serve_exports.kv_bytes_per_token(sizes)


def test_metrics_are_summed_over_label_sets_and_the_cache_config_read():
    page = "\n".join([
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
        'vllm:num_requests_running{engine="1",model_name="m"} 2.0',
        'vllm:iteration_tokens_total_count{engine="0",model_name="m"} 17.0',
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="272"} 1.0',
    ])
    values, info = parse_metrics(page)
    assert values["vllm:num_requests_running"] == 5.0
    assert values["vllm:iteration_tokens_total_count"] == 17.0
    assert (info["num_gpu_blocks"], info["block_size"]) == ("272", "16")


def _round(tokens_per_s, steps):
    return dict(tokens_per_s=tokens_per_s, tokens_per_cpu_s=tokens_per_s / 2, running_max=4,
                running_mean=3.5, engine_steps=steps, preemptions=0, output_tokens=64,
                generated_tokens=64, wall_s=64 / tokens_per_s, cpu_s=128 / tokens_per_s)


def test_report_gives_medians_over_rounds_and_mea_over_original(tmp_path):
    case = dict(name="hd128-llama", exports=dict(
        original=dict(kv_tokens=4624, rounds=[_round(10, 260), _round(30, 258), _round(20, 259)]),
        mea=dict(kv_tokens=9248, rounds=[_round(25, 130), _round(5, 134), _round(40, 133)])))
    serve_report.compare(case)
    original, mea = case["exports"]["original"]["summary"], case["exports"]["mea"]["summary"]
    assert (original["tokens_per_s"], mea["tokens_per_s"]) == (20, 25)
    assert (original["engine_steps"], mea["engine_steps"]) == (259, 133)
    assert original["output_tokens"] == 3 * 64
    assert case["ratios"]["kv_tokens"] == 2.0
    assert case["ratios"]["tokens_per_s"] == 1.25
    assert case["ratios"]["tokens_per_cpu_s"] == 1.25
    assert case["ratios"]["engine_steps"] == 133 / 259
    # The rounds' own ratios 2.5, 1/6, 2: their median.
    assert case["paired_ratios"]["tokens_per_s"] == 2.0
    rows = serve_report.table([case])
    assert len(rows) == 4 and "9,248 (2.00x)" in rows[3] and "25.00 (1.25x)" in rows[3]
    assert "| hd128-llama | 3 | 1.25x | 2.00x | 1.25x | 2.00x |" in serve_report.paired_table(
        [dict(case, exports={k: dict(v, rounds=[dict(r, load=3.0) for r in v["rounds"]])
                             for k, v in case["exports"].items()})])[2]
    json.dumps(case)  # the report is written as JSON
    if serve_report.plot([case], str(tmp_path / "report.png")):
        assert (tmp_path / "report.png").stat().st_size > 0
