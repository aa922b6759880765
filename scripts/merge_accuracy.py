"""Merge runs of one accuracy study into one table (e.g. lengths run in separate device calls).

python scripts/merge_accuracy.py OUT_DIR RUN1/results.json RUN2/results.json ...
(runs of other lengths or methods, or of the next seed range: more examples of a cell)
Writes OUT_DIR/{results.json, table.md, accuracy.png}; refuses runs whose settings (apart
from the engine's max_len) or checkpoint differ, whose seed ranges leave a gap, or that hold
the same example twice (``experiments.accuracy.merge_results``).
"""

import sys

from experiments.accuracy import write_merged

if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    print(write_merged(sys.argv[2:], sys.argv[1])["table"])
