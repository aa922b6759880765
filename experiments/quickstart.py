"""Quickstart: a synthetic needle-in-a-haystack prompt, prefill, decode, a table per method.

Gin header -- must be set: quickstart.model (a ModelConfig, e.g. @model_preset()).
Writes runs/<name>/{config.gin, results.json, quickstart.png}.
"""

from __future__ import annotations

import gin
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from experiments.common import fit_max_len, run_dir, write_results  # noqa: E402
from lsparse_jax.config import CacheConfig, EngineConfig, SamplingConfig  # noqa: E402
from lsparse_jax.model import init_params  # noqa: E402
from lsparse_jax.serving.engine import Engine  # noqa: E402
from lsparse_jax.tasks import niah_example, score_exact, tokenizer  # noqa: E402

COLUMNS = ("method", "prefill_s", "decode_tok_s", "device_MB_per_req", "eligible", "selected",
           "reuse")


@gin.configurable
def quickstart(name: str, model=gin.REQUIRED, methods=("resident",), prompt_tokens: int = 8192,
               decode_steps: int = 64, prefill_chunk: int = 512, num_needles: int = 4,
               seed: int = 0, temperature: float = 0.0):
    cfg = fit_max_len(model, prompt_tokens + decode_steps + 1)
    example = niah_example(prompt_tokens, num_needles=num_needles, seed=seed)
    params = init_params(cfg, seed)
    rows = []
    for method in methods:
        engine = Engine(EngineConfig(model=cfg, cache=CacheConfig(1, prefill_chunk),
                                     sampling=SamplingConfig(temperature, seed), method=method),
                        params)
        engine.warmup()
        with tqdm(total=prompt_tokens, desc=f"{method} prefill", unit="tok") as bar:
            slot = engine.admit(example.prompt, bar)
        for _ in tqdm(range(decode_steps), desc=f"{method} decode", unit="step"):
            engine.step()
        text = tokenizer.decode(engine.release(slot))
        m = engine.metrics()
        m.update(generated=text, niah_exact=score_exact(text, example.answer))
        rows.append(m)

    table = format_table(rows)
    print(table)
    out = run_dir(name)
    results = {"model": cfg.__dict__ | {"indexer": cfg.indexer.__dict__},
               "prompt_tokens": prompt_tokens, "decode_steps": decode_steps,
               "answer": example.answer, "methods": rows, "table": table,
               "note": "random weights: generated text and niah_exact are not meaningful"}
    path = write_results(out, results)
    plot(rows, out / "quickstart.png")
    print(f"wrote {path} and {out / 'quickstart.png'}")
    return results


def format_table(rows: list[dict]) -> str:
    cells = [COLUMNS] + [(
        r["method"], f"{r['prefill_seconds']:.2f}", f"{r['decode_tokens_per_second']:.1f}",
        f"{r['device_bytes_per_request'] / 2**20:.3f}", f"{r['selection']['eligible']:.0f}",
        f"{r['selection']['selected']:.1f}", f"{r['selection']['reuse_fraction']:.3f}")
        for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c[i].rjust(widths[i]) for i in range(len(c))) for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(rows: list[dict], path):
    names = [r["method"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    axes[0].bar(names, [r["decode_tokens_per_second"] for r in rows])
    axes[0].set_ylabel("decode tokens/s")
    axes[1].bar(names, [r["device_bytes_per_request"] / 2**20 for r in rows])
    axes[1].set_ylabel("device MB per request")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
