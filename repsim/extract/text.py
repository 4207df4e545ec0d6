"""Text datasets for Hugging Face text models: a text file or a CSV, tokenised with the model's tokenizer.

``--data FILE``:

* ``*.txt``: one example per non-empty line; no labels (stored as -1).
* ``*.csv`` / ``*.tsv``: a header row with a ``text`` column and optionally a ``label`` column
  (integers are kept; any other labels are numbered in sorted order, recorded as
  ``dataset.classes``); rows without a label column are stored with label -1.

Every example is tokenised on its own with truncation and padding to ``max_length`` tokens
(default 128), so all rows have the same token count (token layers are ``(N, T, D)`` before
reduction) and a row's values never depend on what else is in its batch. The model gets
``input_ids``, ``attention_mask`` (and whatever else the tokenizer returns); the attention mask
keeps padding out of ``--tokens mean`` and ``last`` and zeroes padded positions under ``flatten``.
"""
from __future__ import annotations

import csv
import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

TEXT_SUFFIXES = (".txt", ".csv", ".tsv")
NO_LABEL = -1
DEFAULT_MAX_LENGTH = 128


def is_text_spec(spec: Any) -> bool:
    """True for a path to an existing ``.txt``/``.csv``/``.tsv`` file."""
    if not isinstance(spec, (str, Path)):
        return False
    p = Path(spec)
    return p.suffix.lower() in TEXT_SUFFIXES and p.is_file()


def read_texts(path: str | Path) -> tuple[list[str], np.ndarray, list[str] | None]:
    """(texts, int labels (-1 = none), class names or None) from a text file or CSV/TSV."""
    p = Path(path)
    if p.suffix.lower() == ".txt":
        texts = [line.rstrip("\n") for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
        return texts, np.full(len(texts), NO_LABEL, np.int64), None
    with p.open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f, delimiter="\t" if p.suffix.lower() == ".tsv" else ","))
    if not rows or "text" not in rows[0]:
        raise ValueError(f"extract: {p} needs a header row with a 'text' column (and optionally 'label')")
    texts = [r["text"] or "" for r in rows]
    if "label" not in rows[0]:
        return texts, np.full(len(texts), NO_LABEL, np.int64), None
    raw = [(r["label"] or "").strip() for r in rows]
    try:
        return texts, np.array([int(v) for v in raw], np.int64), None
    except ValueError:
        classes = sorted(set(raw))
        index = {c: i for i, c in enumerate(classes)}
        return texts, np.array([index[v] for v in raw], np.int64), classes


class TextDataset(Dataset):
    """Rows of a text file/CSV as ``({input_ids, attention_mask, ...}, label)``, tokenised per item."""

    def __init__(self, path: str | Path, tokenizer: Any, max_length: int = DEFAULT_MAX_LENGTH):
        if max_length < 1:
            raise ValueError(f"extract: --max-length must be >= 1, got {max_length}")
        self.path = Path(path)
        self.texts, self.targets, self.classes = read_texts(self.path)
        if not self.texts:
            raise ValueError(f"extract: {self.path} holds no text")
        if tokenizer.pad_token is None:  # decoder tokenizers (GPT-2, ...) ship without one
            tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
        self.tokenizer, self.max_length = tokenizer, int(max_length)
        self.example_ids = np.arange(len(self.texts), dtype=np.int64)
        labelled = self.targets[self.targets >= 0]
        self.num_classes = len(self.classes) if self.classes else (int(labelled.max()) + 1 if labelled.size else None)
        self.name = self.path.name
        digest = hashlib.sha256(self.path.read_bytes()).hexdigest()[:16]
        self.transform_desc = (f"{type(tokenizer).__name__}({getattr(tokenizer, 'name_or_path', '')}), "
                               f"truncation + padding to {self.max_length} tokens "
                               f"(padding side {tokenizer.padding_side}); file sha256 {digest}...")

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, i: int):
        enc = self.tokenizer(self.texts[i], truncation=True, max_length=self.max_length,
                             padding="max_length", return_tensors="pt")
        return {k: v[0] for k, v in enc.items() if isinstance(v, torch.Tensor)}, int(self.targets[i])
