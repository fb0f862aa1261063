"""What a mask given as a bias costs: dfss.attention with and without a key mask (left padding, as
dfss.transformers passes it: bool [B, 1, 1, Lk], -inf at the first keys of batch 0), calls
alternating in one process, medians, the masked / unmasked ratio. Causal prefill (B = 1, H = 12,
d = 64; fp32 and bf16) and decode (B = 2, one query row, d = 128, MHA 32:32 and GQA 32:8; fp32),
random inputs. The sdpa rows time torch's scaled_dot_product_attention alike: unmasked with
is_causal (prefill), masked with what transformers gives it for left padding (the causal and key
masks as one boolean mask; SDPA takes no is_causal beside a mask), enable_gqa for decode.

    PYTHONPATH=build-cpu/tests/python/work-torch2/site ~/.cache/dfss/torch2-venv/bin/python \\
        tools/bench/mask_bias.py [--rounds 11] [--pad 100]

(the site folder is where CTest python_transformers installs the package against the torch 2.x
venv; any environment where `import dfss` works will do).
"""
import argparse
import statistics
import time

import torch

import dfss


def timed(fn, rounds):
    """Medians over rounds of (fn(False), fn(True)), called alternately."""
    times = {False: [], True: []}
    for _ in range(rounds):
        for masked in (False, True):
            start = time.perf_counter()
            fn(masked)
            times[masked].append(time.perf_counter() - start)
    return statistics.median(times[False]), statistics.median(times[True])


def key_mask(batch, keys, pad):
    keep = torch.ones(batch, keys, dtype=torch.bool)
    keep[0, :pad] = False
    return keep[:, None, None, :]


def sdpa(q, k, v, key_keep, causal):
    """SDPA with @p key_keep (bool [B, 1, 1, Lk], or None) and the causal mask, as transformers passes
    a padded batch to it."""
    if key_keep is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    if causal:  # Lq = Lk here: bottom-right = top-left
        key_keep = key_keep & torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=key_keep, enable_gqa=True)


def run(q, k, v, mask, pattern, causal):
    if pattern == "sdpa":
        return sdpa(q, k, v, mask, causal)
    return dfss.attention(q, k, v, attn_mask=mask, pattern=pattern, is_causal=causal)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--pad", type=int, default=100, help="masked keys at the start of batch 0")
    args = ap.parse_args()
    torch.manual_seed(0)
    print("| case | pattern | no mask (ms) | key mask (ms) | masked / unmasked |")
    print("|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for length in (1024, 2048):
            q, k, v = (torch.randn(1, 12, length, 64).to(dtype) for _ in range(3))
            mask = key_mask(1, length, args.pad)
            for pattern in ("dense", "2:4", "sdpa"):
                plain, masked = timed(lambda m: run(q, k, v, mask if m else None, pattern, True), args.rounds)
                print(f"| causal prefill {str(dtype)[6:]} L = {length} | {pattern} | {plain * 1e3:.2f} | "
                      f"{masked * 1e3:.2f} | {masked / plain:.2f}x |", flush=True)
    for heads, heads_kv in ((32, 32), (32, 8)):
        for keys in (4096, 16384):
            q = torch.randn(2, heads, 1, 128)
            k, v = (torch.randn(2, heads_kv, keys, 128) for _ in range(2))
            mask = key_mask(2, keys, args.pad)
            for pattern in ("dense", "1:2", "sdpa"):
                plain, masked = timed(lambda m: run(q, k, v, mask if m else None, pattern, False), args.rounds)
                print(f"| decode {heads}:{heads_kv}, Lk = {keys} | {pattern} | {plain * 1e3:.2f} | "
                      f"{masked * 1e3:.2f} | {masked / plain:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
