"""Pairs of stores that must come from one network on different examples of one dataset (``repsim
probe``'s train and test stores, ``repsim calibrate``'s test and holdout stores).

Commands take such pairs positionally (``--train A B --test C D``), so a slip in the order pairs
network A's training features with network B's test features and reports a meaningless accuracy
under A's name, and a store given as both members scores a network on its own training examples.
:func:`check_pair` is the one rule every pairing command applies:

- **one network**: both stores' checkpoint digests (``model.checkpoint_sha256`` or
  ``model.weights_sha256``, recorded by ``repsim extract``) are equal; where either lacks one
  (stores written by :func:`repsim.save_store`), the ``model`` metadata both record agree on every
  key they share. Stores that record nothing comparable cannot be checked: a warning says so.
- **one dataset**: where both stores record ``dataset.name``, the names agree up to a size suffix
  ``@N`` (:func:`dataset_family`: ``fashion-target@2000`` is at most 2,000 training images per class of
  ``fashion-target``, the same examples' ids and classes). A probe fit on one dataset and scored on
  another (``digits`` and ``digits-source``, whose examples overlap; ``digits-source`` and
  ``digits-target``, other classes under the same label numbers) or a temperature fit on another
  dataset's labels measures nothing the results files say. ``mixed_datasets=True``
  (``--allow-mixed-datasets``) allows it on purpose and prints a warning that says so.
- **different examples**: not the same store, and where both stores hold the same split of the same
  dataset (both name it, or neither does), no example id in both. ``same_examples=True`` allows it
  on purpose (a training-set accuracy) and prints a warning that says so.
"""
from __future__ import annotations

import os
import re
import sys
import warnings
from typing import Any

import numpy as np

DIGESTS = ("checkpoint_sha256", "weights_sha256")
_SIZE_SUFFIX = re.compile(r"@\d+$")        # train.data's "at most N training images per class" (fashion-target@2000)
# what a pair across datasets would measure, by the pair's roles (check_pair's refusal says it)
_ACROSS = {("train", "test"): "a probe fit on one dataset and scored on another gives no held-out estimate of "
                              "either (their examples may overlap, their labels may number other classes)",
           ("test", "holdout"): "a temperature fit on another dataset's holdout calibrates nothing of this one "
                                "(its labels may number other classes)"}


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


def dataset_family(name: Any) -> str | None:
    """The dataset a recorded ``dataset.name`` denotes, for pairing: the name without a size suffix
    ``@N`` (``fashion-target@2000`` -> ``fashion-target``: a subset of that dataset's training
    examples, with its ids and classes); None when no name is recorded."""
    return None if name is None or name == "" else _SIZE_SUFFIX.sub("", str(name))


def dataset_mismatch(a: Any, b: Any) -> tuple[str, str] | None:
    """``(name of a, name of b)`` when stores ``a`` and ``b`` both record a dataset name and the names
    denote different datasets (:func:`dataset_family`), else None."""
    na, nb = (a.dataset or {}).get("name"), (b.dataset or {}).get("name")
    fa, fb = dataset_family(na), dataset_family(nb)
    return (str(na), str(nb)) if fa is not None and fb is not None and fa != fb else None


def shared_examples(a: Any, b: Any) -> int:
    """How many examples stores ``a`` and ``b`` both hold: all of them for one store given twice; 0 for
    stores of different datasets (:func:`dataset_family`) or splits; else the example ids in both."""
    if _same_store(a, b):
        return a.n
    da, db = a.dataset or {}, b.dataset or {}
    if dataset_family(da.get("name")) != dataset_family(db.get("name")) or da.get("split") != db.get("split"):
        return 0
    return int(np.intersect1d(a.example_ids, b.example_ids, assume_unique=True).size)


def check_pair(a: Any, b: Any, roles: tuple[str, str], *, same_examples: bool = False,
               mixed_datasets: bool = False) -> None:
    """Refuse (``ValueError``) a pair of opened stores ``a`` (role ``roles[0]``, e.g. ``"train"``) and
    ``b`` that come from different networks, hold different datasets (unless ``mixed_datasets``) or
    share examples (unless ``same_examples``); see the module docstring."""
    ra, rb = roles
    diff = network_difference(a, b)
    if diff:
        raise ValueError(f"{ra} store {a.name} and {rb} store {b.name} come from different networks: {diff}; "
                         f"--{ra} and --{rb} are paired in order, one pair per network")
    if diff == "":
        warnings.warn(f"{ra} store {a.name} and {rb} store {b.name} record no checkpoint digest or model metadata to "
                      "compare: that they come from one network is not verified", UserWarning, stacklevel=2)
    names = dataset_mismatch(a, b)
    if names:
        what = (f"{ra} store {a.name} (dataset {names[0]!r}) and {rb} store {b.name} (dataset {names[1]!r}) hold "
                "different datasets")
        if not mixed_datasets:
            why = _ACROSS.get(roles, f"their {rb} scores would measure another task than the {ra} store's")
            raise ValueError(f"{what}: {why}; give --{rb} a store of {names[0]!r}, or pass --allow-mixed-datasets "
                             "to pair them on purpose")
        print(f"WARNING: {what} (--allow-mixed-datasets): their examples are not compared, and their labels are "
              "taken to number the same classes", file=sys.stderr, flush=True)
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

