"""Pairs of stores that must come from one network on different examples (``repsim probe``'s train
and test stores, ``repsim calibrate``'s test and holdout stores).

Commands take such pairs positionally (``--train A B --test C D``), so a slip in the order pairs
network A's training features with network B's test features and reports a meaningless accuracy
under A's name, and a store given as both members scores a network on its own training examples.
:func:`check_pair` is the one rule every pairing command applies:

- **one network**: both stores' checkpoint digests (``model.checkpoint_sha256`` or
  ``model.weights_sha256``, recorded by ``repsim extract``) are equal; where either lacks one
  (stores written by :func:`repsim.save_store`), the ``model`` metadata both record agree on every
  key they share. Stores that record nothing comparable cannot be checked: a warning says so.
- **different examples**: not the same store, and where both stores hold the same split of the same
  dataset (both name it, or neither does), no example id in both. ``same_examples=True`` allows it
  on purpose (a training-set accuracy) and prints a warning that says so.
"""
from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import numpy as np

DIGESTS = ("checkpoint_sha256", "weights_sha256")


def network_difference(a: Any, b: Any) -> str | None:
    """How the ``model`` metadata of stores ``a`` and ``b`` say they come from different networks
    (``"checkpoint digests differ (1f2e… vs 9a0b…)"``), ``""`` when nothing comparable is recorded,
    None when they agree."""
    ma, mb = a.model or {}, b.model or {}
    for key in DIGESTS:
        if ma.get(key) and mb.get(key):
            return None if ma[key] == mb[key] else f"checkpoint digests differ ({str(ma[key])[:12]}… vs {str(mb[key])[:12]}…)"
    shared = [k for k in sorted(set(ma) & set(mb)) if k not in DIGESTS and ma[k] is not None and mb[k] is not None]
    if not shared:
        return ""
    diffs = [f"{k} {ma[k]!r} vs {mb[k]!r}" for k in shared if ma[k] != mb[k]]
    return f"their model metadata differ ({'; '.join(diffs)})" if diffs else None


def _same_store(a: Any, b: Any) -> bool:
    if a.attrs.get("store_uuid") and a.attrs.get("store_uuid") == b.attrs.get("store_uuid"):
        return True
    try:
        return os.path.samefile(a.path, b.path)
    except OSError:
        return os.path.abspath(a.path) == os.path.abspath(b.path)


def shared_examples(a: Any, b: Any) -> int:
    """How many examples stores ``a`` and ``b`` both hold: all of them for one store given twice; 0 for
    stores of different datasets or splits (both recorded and unequal); else the example ids in both."""
    if _same_store(a, b):
        return a.n
    da, db = a.dataset or {}, b.dataset or {}
    if any(da.get(k) != db.get(k) for k in ("name", "split")):
        return 0
    return int(np.intersect1d(a.example_ids, b.example_ids, assume_unique=True).size)


def check_pair(a: Any, b: Any, roles: tuple[str, str], *, same_examples: bool = False) -> None:
    """Refuse (``ValueError``) a pair of opened stores ``a`` (role ``roles[0]``, e.g. ``"train"``) and
    ``b`` that come from different networks or share examples (see the module docstring)."""
    ra, rb = roles
    diff = network_difference(a, b)
    if diff:
        raise ValueError(f"{ra} store {a.name} and {rb} store {b.name} come from different networks: {diff}; "
                         f"--{ra} and --{rb} are paired in order, one pair per network")
    if diff == "":
        warnings.warn(f"{ra} store {a.name} and {rb} store {b.name} record no checkpoint digest or model metadata to "
                      "compare: that they come from one network is not verified", UserWarning, stacklevel=2)
    shared = shared_examples(a, b)
    if not shared:
        return
    what = (f"{ra} store {a.name} and {rb} store {b.name} are the same store" if _same_store(a, b) else
            f"{shared} of the {b.n} examples of {rb} store {b.name} are also in {ra} store {a.name}")
    if not same_examples:
        raise ValueError(f"{what}: a {rb} score on them is not a held-out estimate; give a store of other "
                         "examples, or pass --same-examples to do this on purpose")
    print(f"WARNING: {what} (--same-examples): the {rb} scores are measured on examples the {ra} store "
          "also holds, not held out", file=sys.stderr, flush=True)
