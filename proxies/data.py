"""Training data without downloads: seeded synthetic token streams, or a text file as bytes.

A source maps a global sample index to ``seq_len + 1`` tokens, a pure function of (seed,
index). The loader hands rank r of W the samples ``[p + r*B, p + (r+1)*B)`` at position p and
advances p by ``W*B``. So the data position is one integer, a resumed run sees exactly the
samples it would have seen, and a world of W ranks with batch B sees the same global batch as
one rank with batch W*B.
"""

from __future__ import annotations

import math
import os

import torch

from .common import seed_of


class ByteTokenizer:
    """Bytes 0..255 are their own ids; 256 is BOS and 257 EOS (vocabulary 258)."""

    BOS, EOS = 256, 257
    vocab_size = 258

    def encode(self, text: str | bytes, bos: bool = True, eos: bool = True) -> list[int]:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return ([self.BOS] if bos else []) + list(data) + ([self.EOS] if eos else [])

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class SyntheticTokens:
    """A seeded Markov chain: each token has ``branching`` successors, taken uniformly at random.

    The successor table is drawn once from ``seed``; a sample starts at a random token and
    walks the table. A model that learns the table reaches a loss of about ``ln(branching)``
    (``entropy_floor``; a little less where a token's successors coincide), from ``ln(vocab)``
    at the start, so the loss falls visibly within tens of steps on a tiny proxy.
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int = 0, branching: int = 4) -> None:
        if vocab_size < 2 or branching < 1:
            raise ValueError(f"need vocab_size >= 2 and branching >= 1, got {vocab_size}, {branching}")
        self.vocab_size, self.seq_len, self.seed, self.branching = vocab_size, seq_len, seed, branching
        gen = torch.Generator().manual_seed(seed_of(seed, "markov-table"))
        self._table = torch.randint(vocab_size, (vocab_size * branching,), generator=gen).tolist()

    @property
    def entropy_floor(self) -> float:
        return math.log(self.branching)

    def sample(self, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed_of(self.seed, "markov-sample", index))
        choices = torch.randint(self.branching, (self.seq_len,), generator=gen).tolist()
        token = int(torch.randint(self.vocab_size, (1,), generator=gen))
        table, b = self._table, self.branching
        out = [token]
        for c in choices:
            token = table[token * b + c]
            out.append(token)
        return torch.tensor(out, dtype=torch.int64)

    def describe(self) -> str:
        return (f"synthetic Markov tokens (vocab {self.vocab_size}, {self.branching} successors per token, "
                f"loss floor ~ln({self.branching}) = {self.entropy_floor:.3f})")


class TextFileTokens:
    """A UTF-8 (or any) text file as one byte stream ``[BOS] + bytes + [EOS]``; samples are
    windows of ``seq_len + 1`` tokens at seeded random offsets."""

    def __init__(self, path: str, seq_len: int, seed: int = 0) -> None:
        if not os.path.isfile(path):
            raise ValueError(f"text file not found: {path!r}")
        with open(path, "rb") as fh:
            data = fh.read()
        self.tokenizer = ByteTokenizer()
        self.vocab_size = self.tokenizer.vocab_size
        self.path, self.seq_len, self.seed = path, seq_len, seed
        self._stream = torch.tensor(self.tokenizer.encode(data), dtype=torch.int64)
        if self._stream.numel() < seq_len + 1:
            raise ValueError(
                f"text file {path!r} has {len(data)} bytes: too short for seq_len {seq_len} "
                f"(needs at least {seq_len - 1} bytes)"
            )
        self.entropy_floor = None

    def sample(self, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed_of(self.seed, "text-window", index))
        start = int(torch.randint(self._stream.numel() - self.seq_len, (1,), generator=gen))
        return self._stream[start:start + self.seq_len + 1].clone()

    def describe(self) -> str:
        return f"bytes of {self.path} ({self._stream.numel() - 2} bytes, vocab {self.vocab_size} incl. BOS/EOS)"


class Loader:
    """Batches ``(inputs [B, S], targets [B, S])`` of one rank; ``position`` counts global samples."""

    def __init__(self, source, batch_size: int, rank: int = 0, world_size: int = 1, device=None) -> None:
        self.source, self.batch_size, self.rank, self.world_size = source, batch_size, rank, world_size
        self.device = device
        self.position = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        first = self.position + self.rank * self.batch_size
        rows = torch.stack([self.source.sample(first + i) for i in range(self.batch_size)])
        self.position += self.world_size * self.batch_size
        rows = rows.to(self.device, non_blocking=True) if self.device is not None else rows
        return rows[:, :-1], rows[:, 1:]

    def state_dict(self) -> dict:
        return {"position": self.position, "batch_size": self.batch_size, "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
