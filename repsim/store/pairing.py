"""Pairs of stores that must come from one network on different examples of one dataset (``repsim
probe``'s train and test stores, ``repsim calibrate``'s test and holdout stores), and a store whose
labels a network's own head is scored on (``repsim accuracy``, ``repsim calibrate``, ``repsim probe --relearn``).

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
- **different examples**: not the same store, and where both stores hold splits of the same dataset
  that may have a part in common (the same split; ``train+holdout`` and ``holdout`` or ``train``:
  :func:`split_parts`; or a split or dataset name one of them does not record, which is unknown, not
  another one), no example id in both. ``same_examples=True`` allows it
  on purpose (a training-set accuracy) and prints a warning that says so.

:func:`label_space_difference` is the rule for scoring a network's own head (its logits, or its stored
``head``) on a store's labels: it says when the store's recorded metadata prove that its labels number
other classes than the head's K outputs (see there). Stores record the class names of image datasets
only for the network's training set (``model.train_dataset.classes``), not for the data they hold
(``dataset.classes`` is written for multi-label and text datasets only), so for images the rule rests
on the class count and on the names of ``repsim.train.data``'s class-subset specs.
"""
from __future__ import annotations

import os
import re
import sys
import warnings
from typing import Any

import numpy as np

DIGESTS = ("checkpoint_sha256", "weights_sha256")
_SIZE_SUFFIX = re.compile(r"@\d+$")        # repsim.train.data's "at most N training images per class" (fashion-target@2000)
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


def split_parts(split: Any) -> frozenset:
    """The splits a recorded ``dataset.split`` is made of: ``train+holdout`` (``repsim.train.data``'s retraining
    set, App. A.1) is ``{train, holdout}``; any other split itself (None when none is recorded)."""
    return frozenset(str(split).split("+")) if split not in (None, "") else frozenset([None])


def shared_examples(a: Any, b: Any) -> int:
    """How many examples stores ``a`` and ``b`` both hold: all of them for one store given twice; 0 for
    stores that record different datasets (:func:`dataset_family`) or splits with no part in common
    (another split may number its examples from 0 too); else — an unrecorded name or split included —
    the example ids in both (``train+holdout`` and ``holdout`` share the holdout's ids,
    :func:`split_parts`)."""
    if _same_store(a, b):
        return a.n
    da, db = a.dataset or {}, b.dataset or {}
    fa, fb = dataset_family(da.get("name")), dataset_family(db.get("name"))
    if fa is not None and fb is not None and fa != fb:
        return 0
    pa, pb = split_parts(da.get("split")), split_parts(db.get("split"))
    if None not in pa and None not in pb and not pa & pb:  # both recorded, no part in common
        return 0
    # an unrecorded name or split is unknown, not "another one": the example ids decide (a test store
    # without a split holding the training store's examples scored the training set as the test set)
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
    sa, sb = split_parts((a.dataset or {}).get("split")), split_parts((b.dataset or {}).get("split"))
    if rb in sa and ra in sb and ra not in sa:  # each holds the other role's split
        print(f"WARNING: {ra} store {a.name} holds the {'+'.join(sorted(map(str, sa)))} split and {rb} store {b.name} "
              f"the {'+'.join(sorted(map(str, sb)))} split: did you swap --{ra} and --{rb}? (the results record "
              "each store's split as given)", file=sys.stderr, flush=True)
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


# ------------------------------------------------------------------------------------------------
# a store's labels and its network's own head

_SUBSET = re.compile(r"^(?P<family>.+?)(?:-(?P<role>source|target)|:(?P<classes>[^:]+))$")


def class_subset(name: Any) -> tuple[str, str] | None:
    """``(family, subset)`` when a dataset name says it is one class subset of a family, by the
    convention of ``repsim.train.data``'s specs: ``F-source`` / ``F-target`` (a transfer study's pretraining
    classes and the disjoint transfer classes, each numbered from 0: ``digits-source`` is digits 0–4,
    ``digits-target`` digits 5–9 as labels 0–4) or ``F:C,C,...`` (those classes of F, numbered in that
    order); None for any other name. Two names of one family with different subsets number other
    classes with the same labels."""
    family = dataset_family(name)
    m = _SUBSET.match(family) if family else None
    if m is None:
        return None
    subset = m["role"] or ",".join(c.strip() for c in m["classes"].split(","))
    return m["family"], subset


def head_outputs(store: Any) -> int | None:
    """K, the number of outputs of the store's network head: the width of its ``logits``, else the rows
    of its stored ``head/weight``; None when it has neither."""
    if store.has_logits:
        return int(store.zarr_array("/logits").shape[1])
    head = store.head
    return None if head is None else int(head[0].shape[0])


def label_space_difference(store: Any) -> str | None:
    """How ``store``'s recorded metadata prove that its labels number other classes than its network's
    head outputs, so that the head's scores on them (``repsim accuracy``, ``repsim calibrate``, the original
    head of ``repsim probe --relearn``) measure nothing; None when nothing recorded proves it. The rules:

    - the store's ``dataset.num_classes`` differs from K, the head's outputs (:func:`head_outputs`):
      e.g. ImageNet-A/-R folders, 200 classes numbered 0..199, not as a 1000-way head's outputs, or the
      10 classes of ``digits`` under a 5-class ``digits-source`` head;
    - the store's ``dataset.classes`` and the network's ``model.train_dataset.classes`` are both
      recorded and differ;
    - the store's dataset and the network's training dataset (``model.train_dataset.name``) are class
      subsets of one family that differ (:func:`class_subset`: ``digits-target`` data under a
      ``digits-source`` network, both 5 classes numbered 0–4).

    Names that merely differ prove nothing: an ImageNet network on ImageNet-V2, which holds the same
    classes under the same numbers, is the paper's robustness analysis. Labels outside ``[0, K)`` are
    :func:`check_label_space`'s first, unconditional refusal."""
    K = head_outputs(store)
    if K is None:
        return None
    data, train = store.dataset or {}, (store.model or {}).get("train_dataset") or {}
    name, trained_on = data.get("name"), train.get("name") or train.get("spec")
    n_classes = data.get("num_classes")
    if n_classes is not None and int(n_classes) != K:
        return f"its dataset {name!r} records {int(n_classes)} classes but the network's head has {K} outputs"
    classes, trained_classes = data.get("classes"), train.get("classes")
    if classes and trained_classes and list(map(str, classes)) != list(map(str, trained_classes)):
        return (f"its dataset {name!r} records the classes {_short(classes)} but the network was trained on "
                f"{_short(trained_classes)}")
    sa, sb = class_subset(name), class_subset(trained_on)
    if sa and sb and sa[0] == sb[0] and sa[1] != sb[1]:
        return (f"it holds dataset {name!r} but its network was trained on {trained_on!r}, another class subset "
                f"of {sa[0]!r} ({sa[1]!r} vs {sb[1]!r}) numbered with the same labels")
    return None


def _short(classes: Any, k: int = 5) -> str:
    items = [str(c) for c in classes]
    return "[" + ", ".join(items[:k]) + (f", … ({len(items)} in all)" if len(items) > k else "") + "]"


def check_label_space(store: Any, *, allow: bool = False, flag: str = "--allow-other-classes") -> None:
    """Refuse (``ValueError``) scoring ``store``'s network head on its labels: always when a label lies
    outside ``[0, K)`` (K: :func:`head_outputs`; ``-1``, unlabelled, included), and when
    :func:`label_space_difference` finds they number other classes unless ``allow`` (``flag``), which
    proceeds with a warning on stderr."""
    K = head_outputs(store)
    labels = np.asarray(store.labels)
    if K is not None and labels.ndim == 1 and labels.size and (labels.min() < 0 or labels.max() >= K):
        unlabelled = "; -1 marks an unlabelled example" if labels.min() < 0 else ""
        raise ValueError(f"store {store.name}: labels must lie in [0, {K}) (its network's head has {K} outputs), "
                         f"got range [{labels.min()}, {labels.max()}]{unlabelled}: give a store of labelled "
                         "examples of the network's classes")
    diff = label_space_difference(store)
    if diff is None:
        return
    if not allow:
        raise ValueError(f"store {store.name}: {diff}, so its network's own head cannot be scored on these labels; "
                         f"give a store of the classes the network was trained on, or pass {flag} if its labels "
                         "are numbered as the head's outputs")
    print(f"WARNING: store {store.name}: {diff} ({flag}): the head is scored on these labels as given",
          file=sys.stderr, flush=True)
