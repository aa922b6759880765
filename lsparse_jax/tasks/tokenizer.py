"""Byte-level tokenizer: token id = byte value (vocab 256), UTF-8 text."""

import numpy as np

VOCAB_SIZE = 256


def encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


def decode(tokens) -> str:
    arr = np.asarray(tokens)
    if arr.size and (arr.min() < 0 or arr.max() >= VOCAB_SIZE):
        raise ValueError(f"decode: token ids must lie in [0, {VOCAB_SIZE}), "
                         f"got {arr.min()}..{arr.max()}")
    return bytes(arr.astype(np.uint8).tolist()).decode("utf-8", errors="replace")
