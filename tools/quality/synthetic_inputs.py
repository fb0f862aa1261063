#!/usr/bin/env python3
"""Synthetic but structured attention inputs for `dfss quality` (until the trained model's real ones).

Uniform random Q and K give nearly uniform attention, where every method looks alike and nothing is
learned. Trained transformers show a few recurring head types instead; this script builds Q, K, V
[B, L, H, d] (float32) from three ingredients that give those types, mixed with per-head weights:

- locality: a rotary-style positional part, q_i . k_j += sum_f a_f cos(w_f (i - j)), which peaks at
  j = i (a "local" head, e.g. previous/next-token heads);
- content: every token has one of C topics; keys sit near their topic's centre and a query of topic
  t looks for the keys of topic pi(t) (a "content" head, e.g. coreference or syntax heads); values
  carry the key's topic as well, so that what is attended to matters for the output;
- a sink: the first tokens have a large component along one direction that every query shares (the
  "attention sink" on [CLS] / BOS seen in BERT and GPT models).

Heads cycle through four mixtures: 0 mostly local, 1 mostly content, 2 sink + content, 3 an even
mix (--mixture T gives every head mixture T). Every draw comes from numpy.random.default_rng(seed),
so a seed fixes the files.

Usage: synthetic_inputs.py OUT_DIR [--batch 1] [--length 512] [--heads 8] [--head-dim 64] [--seed 1]
[--mixture T] writes OUT_DIR/q.npy, OUT_DIR/k.npy, OUT_DIR/v.npy.
"""
import argparse
import os

import numpy as np

# (local, content, sink) weights of the four head types, in the order heads cycle through them.
HEAD_MIXTURES = [(1.0, 0.35, 0.2), (0.3, 1.0, 0.2), (0.2, 0.8, 1.0), (0.7, 0.7, 0.5)]
# Topics per sequence: enough that a content head attends to a small fraction of the keys (~L/C).
TOPICS = 16
# Leading sink tokens.
SINK_TOKENS = 2


def make(batch, length, heads, head_dim, seed, mixture=None):
    rng = np.random.default_rng(seed)
    d = head_dim
    n_freq = d // 4  # the positional part uses d/2 dimensions (a cos and a sin per frequency)
    q = np.zeros((batch, length, heads, d))
    k = np.zeros((batch, length, heads, d))
    v = np.zeros((batch, length, heads, d))
    pos = np.arange(length)
    for h in range(heads):
        local, content, sink = HEAD_MIXTURES[h % len(HEAD_MIXTURES) if mixture is None else mixture]
        # Positional part: the same rotary-style code for queries and keys, frequencies from 1/2 to
        # 1/256 radian per position (profiles a few to a few hundred tokens wide), so that
        # q_i . k_j = (9 local / n_freq) sum_f cos(w_f (i - j)): 9 * local score units at j = i,
        # falling smoothly with the distance.
        freqs = 0.5 * (1.0 / 128.0) ** (np.arange(n_freq) / max(n_freq - 1, 1))
        ang = pos[:, None] * freqs[None, :]
        pos_code = np.sqrt(local * 9.0 / n_freq) * np.concatenate([np.cos(ang), np.sin(ang)], axis=1)
        # Content part in the other d/2 dimensions: a matching topic scores 9 * content units, an
        # unrelated one about +-9 content / sqrt(d/2); sink tokens score 6 * sink with every query.
        dc = d - 2 * n_freq
        centres = rng.standard_normal((TOPICS, dc))
        centres /= np.linalg.norm(centres, axis=1, keepdims=True)
        value_centres = rng.standard_normal((TOPICS, d))
        partner = rng.permutation(TOPICS)
        sink_dir = rng.standard_normal(dc)
        sink_dir /= np.linalg.norm(sink_dir)
        for b in range(batch):
            topic = rng.integers(0, TOPICS, length)
            kc = centres[topic] + 0.35 * rng.standard_normal((length, dc)) / np.sqrt(dc)
            qc = centres[partner[topic]] + 0.35 * rng.standard_normal((length, dc)) / np.sqrt(dc)
            kc *= 3.0 * np.sqrt(content)
            qc *= 3.0 * np.sqrt(content)
            kc[:SINK_TOKENS] += 4.0 * np.sqrt(sink) * sink_dir
            qc += 1.5 * np.sqrt(sink) * sink_dir
            q[b, :, h, :2 * n_freq] = pos_code
            k[b, :, h, :2 * n_freq] = pos_code
            q[b, :, h, 2 * n_freq:] = qc
            k[b, :, h, 2 * n_freq:] = kc
            # A little isotropic noise everywhere, so that no score is exactly tied.
            q[b, :, h] += 0.1 * rng.standard_normal((length, d))
            k[b, :, h] += 0.1 * rng.standard_normal((length, d))
            v[b, :, h] = value_centres[topic] + 0.5 * rng.standard_normal((length, d))
    # Scores are q . k / sqrt(d) in the tool: scale Q so that the components above are score units.
    q *= np.sqrt(d) ** 0.5
    k *= np.sqrt(d) ** 0.5
    return q.astype(np.float32), k.astype(np.float32), v.astype(np.float32)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--mixture", type=int, choices=range(len(HEAD_MIXTURES)), help="one head type for all heads")
    a = ap.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    q, k, v = make(a.batch, a.length, a.heads, a.head_dim, a.seed, a.mixture)
    for name, x in (("q", q), ("k", k), ("v", v)):
        np.save(os.path.join(a.out_dir, name + ".npy"), x)


if __name__ == "__main__":
    main()
