#!/usr/bin/env bash
# Prints the path of a Python >= 3.12 interpreter, or explains and exits 1.
# Order: $PYTHON, python3.14 .. python3.12, python3, then pyenv-installed versions.
set -u
ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }
candidates=()
[ -n "${PYTHON:-}" ] && candidates+=("$PYTHON")
for v in 3.14 3.13 3.12; do candidates+=("python$v"); done
candidates+=(python3)
for d in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]*/bin/python3 /usr/local/bin/python3.1[2-9] /usr/bin/python3.1[2-9]; do
  [ -x "$d" ] && candidates+=("$d")
done
for c in "${candidates[@]}"; do
  p=$(command -v "$c" 2>/dev/null) || continue
  if ok "$p"; then
    # A pyenv shim may point elsewhere; report the real interpreter.
    "$p" -c 'import sys; print(sys.executable)'
    exit 0
  fi
done
echo "error: lsparse-jax needs Python >= 3.12 (jax >= 0.11 requires it); none found." >&2
echo "Tried: ${candidates[*]}. Install one, or set PYTHON=/path/to/python3.12." >&2
exit 1
