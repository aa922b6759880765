#!/usr/bin/env bash
# The four cells of configs/experiments/serve_capped.gin (issue 15): hisparse and adaptive,
# each plain and with the trained drafter, under one budget; results in $LSPARSE_RUNS/capped_*.
# Run from the repository root (GPU). Extra arguments are gin overrides for every cell.
set -uo pipefail
for method in hisparse adaptive; do
  for drafter in None "'checkpoints/drafter_small'"; do
    name=capped_$method; [ "$drafter" = None ] || name=${name}_spec
    python3 -m experiments.cli run configs/experiments/serve_capped.gin \
      "--gin.serve.method='$method'" "--gin.serve.drafter_checkpoint=$drafter" \
      "--gin.run.name='$name'" "$@" 2>&1 | tr '\r' '\n' | grep -v "req/s" | tail -3
  done
done
