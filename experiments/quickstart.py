"""Quickstart: a synthetic needle-in-a-haystack prompt, prefill, decode, a table per method.

Gin header -- must be set: quickstart.model (a ModelConfig, e.g. @model_preset()).
Writes runs/<name>/{config.gin, results.json, quickstart.png}.
"""

from __future__ import annotations

import gin
import numpy as np
from tqdm.auto import tqdm

from experiments import validate as v
from experiments.common import pyplot, run_dir, selection_recall, write_results
from lsparse_jax.config import (
    CacheConfig,
    EngineConfig,
    LeanSparseConfig,
    SamplingConfig,
    method_names,
    method_storage,
)
from lsparse_jax.memory.accounting import request_bytes
from lsparse_jax.methods.leansparse import calibrate_codebooks
from lsparse_jax.model import init_params
from lsparse_jax.serving.engine import Engine
from lsparse_jax.tasks import niah_example, score_exact, tokenizer

IMPLEMENTATIONS = ("xla", "triton", "jax_triton", "mosaic", None)

COLUMNS = ("method", "prefill_s", "decode_tok_s", "gpu_MB/req", "host_MB/req", "recall",
           "reuse", "kv_tail/hot/host%", "key_cache%", "host_KB/tok")


@gin.configurable
def quickstart(name: str, model=gin.REQUIRED, methods=("resident",), prompt_tokens: int = 8192,
               decode_steps: int = 64, prefill_chunk: int = 512, num_needles: int = 4,
               seed: int = 0, temperature: float = 0.0, hot_cache_rows: int = 64,
               page_size: int = 64, leansparse=None, calibration_tokens: int = 4096,
               optional_pages: int = 64, refill_pages: int = 4, host_pages: int | None = None,
               implementation: str | None = "xla", streamed_prefill: bool = False):
    """Runs each method on the same prompt. ``resident`` runs first; the other methods are fed
    its tokens (teacher forcing), so their selections are compared on identical contexts:
    recall is the fraction of resident's selected positions they also selected (n/a without
    resident). optional_pages, refill_pages: the ``adaptive`` method's device pages per CSA
    layer (shared by slots, lent to prompt history) and pages refilled per step. host_pages:
    CacheConfig.host_pages (None = enough). implementation: the decode step's kernels.
    streamed_prefill: CacheConfig.streamed_prefill (layer-streamed prefill, LeanSparse's)."""
    cfg = check_settings(model, methods, prompt_tokens, decode_steps, prefill_chunk, num_needles,
                         seed, temperature, hot_cache_rows, page_size, leansparse,
                         calibration_tokens, optional_pages, refill_pages, host_pages,
                         implementation, streamed_prefill)
    example = niah_example(prompt_tokens, num_needles=num_needles, seed=seed)
    params = init_params(cfg, seed)
    lean = leansparse or LeanSparseConfig()
    codebooks = None
    if any(method_storage(m).keys_on_host for m in methods):  # PQ codebooks, trained offline
        #   on text the run never sees
        calib = niah_example(calibration_tokens, num_needles=num_needles, seed=seed + 1000)
        codebooks = calibrate_codebooks(params, cfg, calib.prompt,
                                        subspace_dim=lean.pq_subspace_dim, seed=seed)
    rows, reference = [], None
    for method in sorted(methods, key=lambda m: m != "resident"):  # the reference first
        storage = method_storage(method)
        cache = CacheConfig(1, prefill_chunk, hot_cache_rows if storage.kv_on_host else None,
                            page_size, host_pages=host_pages if storage.kv_on_host else None,
                            optional_pages=optional_pages if storage.lent_pages else None,
                            refill_pages=refill_pages, streamed_prefill=streamed_prefill)
        config = EngineConfig(model=cfg, cache=cache, sampling=SamplingConfig(temperature, seed),
                              method=method, leansparse=lean, implementation=implementation)
        engine = Engine(config, params, codebooks)
        engine.warmup()
        with tqdm(total=prompt_tokens, desc=f"{method} prefill", unit="tok") as bar:
            slot = engine.admit(example.prompt, decode_steps, bar)
        inputs, selections = [], []
        for i in tqdm(range(decode_steps), desc=f"{method} decode", unit="step"):
            forced = None if reference is None else reference["inputs"][i]
            inputs.append(engine.next_token.copy() if forced is None else forced)
            selections.append(np.asarray(engine.step(forced).selected[slot]))
        text = tokenizer.decode(engine.release(slot))
        recall = None if reference is None else \
            selection_recall(np.stack(selections), np.stack(reference["selections"]))
        if method == "resident":
            reference = {"inputs": inputs, "selections": selections}
        m = engine.metrics()
        acc = request_bytes(config, prompt_tokens + decode_steps)
        m.update(generated=text, niah_exact=score_exact(text, example.answer),
                 gpu_bytes=acc.gpu, host_bytes=acc.host, host_bytes_per_request=acc.host_total,
                 recall=recall)
        rows.append(m)

    rows.sort(key=lambda r: methods.index(r["method"]))  # the order asked for
    table = format_table(rows)
    print(table)
    out = run_dir(name)
    results = {"model": cfg.__dict__ | {"indexer": cfg.indexer.__dict__},
               "leansparse": lean.__dict__, "prompt_tokens": prompt_tokens,
               "decode_steps": decode_steps, "answer": example.answer, "methods": rows,
               "table": table,
               "note": "random weights: generated text and niah_exact are not meaningful; "
                       "methods after resident are teacher-forced with resident's tokens"}
    path = write_results(out, results)
    plot(rows, out / "quickstart.png")
    print(f"wrote {path} and {out / 'quickstart.png'}")
    return results


def check_settings(model, methods, prompt_tokens, decode_steps, prefill_chunk, num_needles,
                   seed, temperature, hot_cache_rows, page_size, leansparse, calibration_tokens,
                   optional_pages, refill_pages, host_pages, implementation, streamed_prefill):
    """Validates every setting before any work; returns the model with its max_len fitted
    (or the bound model_preset.max_len when it is large enough)."""
    methods = v.names("quickstart.methods", methods, method_names())
    for setting, value in (("prompt_tokens", prompt_tokens), ("decode_steps", decode_steps),
                           ("prefill_chunk", prefill_chunk), ("num_needles", num_needles),
                           ("page_size", page_size), ("calibration_tokens", calibration_tokens),
                           ("optional_pages", optional_pages), ("refill_pages", refill_pages)):
        v.integer(f"quickstart.{setting}", value)
    v.integer("quickstart.seed", seed, lo=0)
    v.number("quickstart.temperature", temperature, lo=0.0)
    v.choice("quickstart.implementation", implementation, IMPLEMENTATIONS)
    v.flag("quickstart.streamed_prefill", streamed_prefill)
    cfg = v.fit_model(model, prompt_tokens + decode_steps + 1,
                      "quickstart.prompt_tokens + decode_steps + 1")
    top_k = cfg.indexer.top_k
    if any(method_storage(m).kv_on_host for m in methods):
        v.integer("quickstart.hot_cache_rows", hot_cache_rows, lo=top_k)
        v.host_pages("quickstart.host_pages", host_pages, cfg, prompt_tokens + decode_steps,
                     page_size)
    if any(method_storage(m).keys_on_host for m in methods):
        lean = leansparse or LeanSparseConfig()
        v.instance("quickstart.leansparse", lean, LeanSparseConfig, "@LeanSparseConfig()")
        if lean.num_candidates < top_k:
            v.fail("LeanSparseConfig.num_candidates", lean.num_candidates,
                   f"must be >= the model's indexer top_k={top_k}")
        if cfg.indexer.head_dim % lean.pq_subspace_dim:
            v.fail("LeanSparseConfig.pq_subspace_dim", lean.pq_subspace_dim,
                   f"must divide the indexer head_dim={cfg.indexer.head_dim}")
    return cfg


def format_table(rows: list[dict]) -> str:
    def row(r):
        sel = r["selection"]
        kv, keys = sel["resolved_fraction"], sel["key_resolved_fraction"]
        recall = "ref" if r["method"] == "resident" else \
            "n/a" if r["recall"] is None else f"{r['recall']:.3f}"
        return (r["method"], f"{r['prefill_seconds']:.2f}", f"{r['decode_tokens_per_second']:.1f}",
                f"{r['device_bytes_per_request'] / 2**20:.3f}",
                f"{r['host_bytes_per_request'] / 2**20:.3f}", recall,
                f"{sel['reuse_fraction']:.3f}",
                "/".join(f"{100 * kv[k]:.0f}" for k in ("tail_or_resident", "hot_cache",
                                                         "host_copy")),
                f"{100 * keys['key_cache']:.0f}", f"{r['host_bytes_per_token'] / 1024:.2f}")

    cells = [COLUMNS] + [row(r) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c[i].rjust(widths[i]) for i in range(len(c))) for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(rows: list[dict], path):
    plt = pyplot()
    names = [r["method"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    axes[0].bar(names, [r["decode_tokens_per_second"] for r in rows])
    axes[0].set_ylabel("decode tokens/s")
    gpu = [r["device_bytes_per_request"] / 2**20 for r in rows]
    host = [r["host_bytes_per_request"] / 2**20 for r in rows]
    axes[1].bar(names, gpu, label="GPU")
    axes[1].bar(names, host, bottom=gpu, label="host")
    axes[1].set_ylabel("MB per request")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
