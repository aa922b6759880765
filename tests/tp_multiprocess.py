"""One process of the two-process tensor-parallel check (the multi-host path on one machine).

Run as ``python -m tests.tp_multiprocess PROCESS_ID NUM_PROCESSES COORDINATOR_PORT``, one
process per "host", each with one CPU device: ``init_distributed`` joins them (gloo
collectives), then every process runs the same engine code with tp = NUM_PROCESSES over the
global mesh. Each process also serves the same prompt alone on its own device (tp = 1, before
joining; a tp = 1 engine never leaves the local device). Prints one JSON line: the greedy
tokens and logits of both, and the global device count.
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np

from lsparse_jax.config import CacheConfig, EngineConfig
from lsparse_jax.parallel import init_distributed
from lsparse_jax.serving.engine import Engine
from lsparse_jax.serving.request import Request
from tests.helpers import model_and_tokens, tiny

jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py
STEPS = 3


def serve(tp: int, params, cfg, prompt) -> tuple[list[int], list]:
    cache = CacheConfig(num_slots=1, prefill_chunk=32, page_size=8)
    engine = Engine(EngineConfig(model=cfg, cache=cache, tp=tp), params)
    engine.admit(Request(prompt, max_new_tokens=STEPS + 1))
    logits = [np.asarray(engine.step().logits).tolist() for _ in range(STEPS)]
    return engine.generated[0], logits


def main() -> None:
    pid, num, port = (int(a) for a in sys.argv[1:4])
    init_distributed(f"localhost:{port}", num, pid)
    cfg = tiny(max_len=128)
    params, prompt = model_and_tokens(cfg, 40, seed=5)
    alone = serve(1, params, cfg, prompt)  # this process's own device only
    together = serve(num, params, cfg, prompt)  # the global mesh over every process
    print(json.dumps({"process": pid, "devices": jax.device_count(),
                      "local_devices": jax.local_device_count(),
                      "tokens": [alone[0], together[0]], "logits": [alone[1], together[1]]}))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
