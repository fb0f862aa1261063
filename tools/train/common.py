"""Helpers shared by the training scripts (dfss_train.py, lm_train.py): the progress bar and atomic
checkpoint writes."""
from __future__ import annotations

import os
import sys
import time

import torch

BAR = 30  # characters of the progress bar


class Progress:
    """One-line progress bar with ETA and the caller's metrics (stderr, redrawn in place). A resumed
    run passes the step it starts from, so that the ETA counts only this process's steps."""

    def __init__(self, total: int, quiet: bool, start: int = 0):
        self.total, self.quiet, self.start, self.t0 = total, quiet, start, time.time()

    def update(self, step: int, metrics: str) -> None:
        if self.quiet:
            return
        done = step / self.total
        el = time.time() - self.t0
        eta = el / max(step - self.start, 1) * (self.total - step)
        bar = "#" * int(BAR * done) + "." * (BAR - int(BAR * done))
        sys.stderr.write(f"\r[{bar}] {step}/{self.total} {metrics} elapsed {el / 60:.1f} min ETA {eta / 60:.1f} min   ")
        sys.stderr.flush()

    def close(self) -> None:
        if not self.quiet:
            sys.stderr.write("\n")


def save_atomic(path: str, obj) -> None:
    """torch.save through a temporary file and a rename: an interrupted save never leaves a broken file."""
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)
