"""Long-range classification tasks for the accuracy experiment (issue 7), generated from fixed seeds.

ListOps (Long Range Arena style): nested lists of MAX, MIN, MED and SUM_MOD over digits 0-9; the
label is the value of the whole expression (10 classes). The generator grows a random tree inside a
token budget so that lengths spread over [min_len, max_len] without rejection sampling.

Associative recall: a long sequence of key-value tokens (one token per pair: key k in 0..1023 bound
to value v in 0..9), keys distinct within a sequence, then a query token that names one of the keys
with the value slot "asked" (10); the label is that key's value (10 classes). Every value occurs
with many other keys, so the sequence's bag of tokens says nothing about the answer: the query must
attend to the one matching pair, anywhere in the sequence. A recall token is a (key, value-slot)
pair, so a model can embed it as key embedding + slot embedding (dfss_train.py does): the query and
its pair then share the key's embedding, and matching them is one content-based attention lookup.

Token ids are shared by both tasks: 0 = PAD, 1 = CLS, 2..11 = digits 0..9, 12..15 = the ListOps
operators, 16 = close bracket, 17 + 11 k + s = recall key k with value slot s (s = 10: the query).
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
NUM_CLASSES = 10
RECALL0 = 17
NUM_KEYS = 1024  # distinct keys per sequence: recall sequences reach NUM_KEYS + 2 tokens
SLOTS = NUM_CLASSES + 1  # value slots 0..9 and ASKED
ASKED = NUM_CLASSES
VOCAB = RECALL0 + SLOTS * NUM_KEYS


def recall_token(key: int, slot: int) -> int:
    return RECALL0 + SLOTS * key + slot


def recall_fields(token: int) -> Tuple[int, int]:
    """(key, value slot) of a recall token."""
    return divmod(token - RECALL0, SLOTS)


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
    """n recall examples: [CLS] (k1,v1) (k2,v2) ... (k, ASKED) with distinct keys; label: k's value.
    Lengths are capped at NUM_KEYS + 2 (one pair per key)."""
    rng = random.Random(seed)
    tokens, labels = [], []
    for _ in range(n):
        pairs = min(NUM_KEYS, max(1, rng.randint(min_len, max_len) - 2))
        keys = rng.sample(range(NUM_KEYS), pairs)
        values = [rng.randrange(NUM_CLASSES) for _ in keys]
        q = rng.randrange(pairs)
        tokens.append([CLS] + [recall_token(k, v) for k, v in zip(keys, values)] + [recall_token(keys[q], ASKED)])
        labels.append(values[q])
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
