"""The draft vocabulary of a drafter: the tokens it drafts from, chosen by frequency in its training data.

The drafter's marginals are scored with the target's `lm_head`, a `[V, H]` product per drafted depth; on a CPU the
whole head does not stay in the cache (SmolLM2: 56 MB in bfloat16), so one drafted row costs a full read of it.
Scoring only the most frequent tokens' rows (FR-Spec, EAGLE-3's draft vocabulary) makes that product several times
cheaper; a token outside them is never drafted, which costs acceptance only where the target emits a rare token
the drafter would have guessed. The target still verifies with its full head: the output is unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch


def frequent_tokens(sequences: Iterable[Sequence[int]], size: int, vocab_size: int,
                    required: Sequence[int] = ()) -> tuple[torch.LongTensor, float]:
    """The `size` most frequent token ids of `sequences` (ties: the smaller id first), after the `required` ones
    (e.g. the end-of-turn token), as `[min(size, vocab_size)]` long ids; and the share of the counted tokens they
    cover."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for sequence in sequences:
        counts += np.bincount(np.asarray(sequence, dtype=np.int64), minlength=vocab_size)[:vocab_size]
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count, descending; then by id
    required = list(dict.fromkeys(int(token) for token in required))
    rest = order[~np.isin(order, required)]
    chosen = np.concatenate([np.asarray(required, dtype=np.int64), rest])[: min(size, vocab_size)]
    total = int(counts.sum())
    coverage = float(counts[chosen].sum() / total) if total else 1.0
    return torch.from_numpy(chosen.copy()), coverage
