"""Plain numpy attention (scaled dot product, optional bottom-right causal
mask) to check answers against, and golden case loading."""
import glob
import json
import os

import numpy as np

from server_fixture import GOLDEN_DIR

_DTYPES = {"f32": np.float32, "bool": np.bool_, "i64": np.int64}


def attention(q, k, v, causal_bottom_right=False):
    """q [B, H, L, D], k [B, H, S, D], v [B, H, S, Dv] -> [B, H, L, Dv], in float64."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if causal_bottom_right:
        L, S = scores.shape[-2:]
        scores = np.where(np.arange(S)[None, :] > np.arange(L)[:, None] + (S - L), -np.inf, scores)
    scores -= scores.max(-1, keepdims=True)
    w = np.exp(scores)
    return (w / w.sum(-1, keepdims=True)) @ v


def golden_tensor(t):
    return np.array(t["data"], dtype=_DTYPES[t["dtype"]]).reshape(t["shape"])


def golden_cases():
    cases = []
    for path in sorted(glob.glob(os.path.join(GOLDEN_DIR, "*.json"))):
        with open(path) as f:
            cases.append(json.load(f))
    return cases
