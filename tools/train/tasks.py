"""Long-range classification tasks for the accuracy experiment (issue 7), generated from fixed seeds.

ListOps (Long Range Arena style): nested lists of MAX, MIN, MED and SUM_MOD over digits 0-9; the
label is the value of the whole expression (10 classes). The generator grows a random tree inside a
token budget so that lengths spread over [min_len, max_len] without rejection sampling.

Associative recall: a long sequence of (key, value) pairs, keys drawn from 26 letters with
repetition and values from 10 digits, then a query key; the label is the value of the LAST
occurrence of the query key (10 classes). Distractor pairs make a bag-of-tokens model fail: only
attention to the matching key (and its successor) solves it.

Token ids are shared by both tasks: 0 = PAD, 1 = CLS, 2..11 = digits 0..9, 12..15 = the ListOps
operators, 16 = close bracket, 17 = query marker, 18..43 = letters.
"""
from __future__ import annotations

import dataclasses
import random
from typing import List, Sequence, Tuple

PAD, CLS = 0, 1
DIGIT0 = 2
OPS = ("MAX", "MIN", "MED", "SM")
OP0 = 12
CLOSE = 16
QUERY = 17
LETTER0 = 18
VOCAB = LETTER0 + 26
NUM_CLASSES = 10


@dataclasses.dataclass(frozen=True)
class Split:
    tokens: List[List[int]]
    labels: List[int]


def _apply(op: str, args: Sequence[int]) -> int:
    if op == "MAX":
        return max(args)
    if op == "MIN":
        return min(args)
    if op == "MED":
        s = sorted(args)
        return s[len(s) // 2]
    return sum(args) % 10


def _listops_tree(rng: random.Random, budget: int, depth: int, max_depth: int, max_args: int) -> Tuple[List[int], int]:
    """A random expression of at most `budget` tokens (at least 4: op, 2 digits, close)."""
    op = rng.randrange(len(OPS))
    inner = budget - 2  # op token and close bracket
    n_args = rng.randint(2, max(2, min(max_args, inner)))
    # Split the inner budget over the arguments; an argument with a share of 4+ tokens may nest.
    cuts = sorted(rng.sample(range(1, inner), n_args - 1)) if inner > n_args else list(range(1, n_args))
    shares = [b - a for a, b in zip([0] + cuts, cuts + [inner])]
    tokens, values = [OP0 + op], []
    for share in shares:
        if share >= 4 and depth < max_depth:
            sub, val = _listops_tree(rng, share, depth + 1, max_depth, max_args)
        else:
            val = rng.randrange(10)
            sub = [DIGIT0 + val]
        tokens += sub
        values.append(val)
    tokens.append(CLOSE)
    return tokens, _apply(OPS[op], values)


def listops(n: int, seed: int, min_len: int = 64, max_len: int = 512, max_depth: int = 10, max_args: int = 10) -> Split:
    """n ListOps examples of [CLS] + expression, lengths (with CLS) in [min_len, max_len]."""
    rng = random.Random(seed)
    tokens, labels = [], []
    while len(tokens) < n:
        budget = rng.randint(min_len - 1, max_len - 1)
        expr, value = _listops_tree(rng, budget, 1, max_depth, max_args)
        if len(expr) + 1 < min_len:
            continue
        tokens.append([CLS] + expr)
        labels.append(value)
    return Split(tokens, labels)


def associative_recall(n: int, seed: int, min_len: int = 64, max_len: int = 512) -> Split:
    """n recall examples: [CLS] k1 v1 k2 v2 ... [QUERY] k; label: the value last paired with k."""
    rng = random.Random(seed)
    tokens, labels = [], []
    for _ in range(n):
        pairs = (rng.randint(min_len, max_len) - 3) // 2
        seq, last = [CLS], {}
        for _ in range(pairs):
            k, v = rng.randrange(26), rng.randrange(10)
            seq += [LETTER0 + k, DIGIT0 + v]
            last[k] = v
        key = rng.choice(sorted(last))
        seq += [QUERY, LETTER0 + key]
        tokens.append(seq)
        labels.append(last[key])
    return Split(tokens, labels)


TASKS = {"listops": listops, "recall": associative_recall}


def make_splits(task: str, seed: int, sizes: Tuple[int, int, int], min_len: int, max_len: int) -> Tuple[Split, Split, Split]:
    """Train, validation and test splits from seeds derived from `seed` (disjoint streams)."""
    gen = TASKS[task]
    return tuple(gen(n, seed * 1000 + i, min_len=min_len, max_len=max_len) for i, n in enumerate(sizes))  # type: ignore


def evaluate_listops(tokens: Sequence[int]) -> int:
    """Independent evaluator of a ListOps token sequence (for tests): a stack machine."""
    stack: List[list] = []
    result = None
    for t in tokens:
        if t == CLS:
            continue
        if OP0 <= t < OP0 + len(OPS):
            stack.append([OPS[t - OP0]])
        elif DIGIT0 <= t < DIGIT0 + 10:
            stack[-1].append(t - DIGIT0)
        elif t == CLOSE:
            frame = stack.pop()
            value = _apply(frame[0], frame[1:])
            if stack:
                stack[-1].append(value)
            else:
                result = value
    assert result is not None and not stack
    return result
