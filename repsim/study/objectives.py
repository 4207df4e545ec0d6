"""The nine objectives of Kornblith et al. (2021), §2: the one registry (torch-free).

One :class:`Objective` per name, in the paper's order (Table 1): its display label (figures, tables),
its role in a ``+`` combination (one loss, at most one logit map, any regularisers), the head it
builds (``loss`` and ``logit_map``: keys of ``repsim.train.objectives.LOSSES`` / ``LOGIT_MAPS``, the torch side),
its hyperparameters' defaults (the bold values of App. Table A.1, ResNet-50 on ImageNet) and its
row of Table 3 (ImageNet top-1, penultimate R²: what the findings compare a run's ordering with).
``repsim.train.objectives`` builds heads from it; ``analyses`` orders and labels results by it. Adding an
objective is one entry here (and a loss or logit map there if it brings a new one).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

ROLES = ("loss", "map", "regulariser")


@dataclass(frozen=True)
class Objective:
    name: str
    label: str                      # display name
    role: str                       # one of ROLES
    defaults: Mapping[str, Any] = field(default_factory=dict)
    loss: str | None = None         # the head's loss (role "loss")
    logit_map: str | None = None    # the head's logit map (role "map")
    table3: tuple[float, float] | None = None  # the paper's Table 3 (8 ResNet-50s, ImageNet): top-1 %, R²


REGISTRY: tuple[Objective, ...] = (
    Objective("softmax", "Softmax", "loss", {}, loss="softmax", table3=(77.0, 0.349)),
    Objective("label_smoothing", "Label smoothing", "loss", {"alpha": 0.1}, loss="softmax", table3=(77.6, 0.420)),
    Objective("sigmoid", "Sigmoid", "loss", {}, loss="sigmoid", table3=(77.9, 0.427)),
    Objective("extra_l2", "More final layer L²", "regulariser", {"lambda_final": 8e-4}, table3=(77.7, 0.572)),
    Objective("dropout", "Dropout", "regulariser", {"keep_prob": 0.7}, table3=(77.5, 0.461)),
    Objective("logit_penalty", "Logit penalty", "regulariser", {"beta": 6e-4}, table3=(77.7, 0.601)),
    Objective("logit_norm", "Logit normalization", "map", {"tau": 0.04}, logit_map="logit_norm", table3=(77.8, 0.517)),
    Objective("cosine_softmax", "Cosine softmax", "map", {"tau": 0.05, "scale_by_tau": False}, logit_map="cosine",
              table3=(77.9, 0.641)),
    Objective("squared_error", "Squared error", "loss", {"kappa": 9.0, "M": 60.0, "loss_scale": 10.0},
              loss="squared_error", table3=(77.2, 0.845)),
)
BY_NAME: dict[str, Objective] = {o.name: o for o in REGISTRY}
OBJECTIVES: tuple[str, ...] = tuple(BY_NAME)  # paper order (Table 1)
# display names: the objectives', and the random-initialisation baseline's of the figures
DISPLAY: dict[str, str] = {**{o.name: o.label for o in REGISTRY}, "init": "Initialization"}


def with_defaults(objective: str, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The hyperparameters of ``objective`` (a name or an ``a+b`` combination): the Table A.1 defaults
    of its known components, overridden by ``given``.  Unknown components add nothing (validation
    is ``repsim.train.objectives.parse_objective``'s)."""
    out: dict[str, Any] = {}
    for part in str(objective or "").split("+"):
        entry = BY_NAME.get(part.strip())
        if entry is not None:
            out.update(entry.defaults)
    out.update(given or {})
    return out


def logit_map(objective: str | None) -> str:
    """The logit map of ``objective`` (a name or an ``a+b`` combination): its map component's
    (``logit_norm``, ``cosine``), else ``linear``."""
    for part in str(objective or "").split("+"):
        entry = BY_NAME.get(part.strip())
        if entry is not None and entry.logit_map:
            return entry.logit_map
    return "linear"


def classifier_weights(objective: str | None, W: Any) -> Any:
    """The class directions a network's logits depend on, from its final layer's weights ``W`` (K, P):
    for a cosine head (Eq. 7, logits sim(W_k, x)/τ + b_k) the rows normalised, W_k / ‖W_k‖, since their
    norms never reach the output (the paper's Table E.2 gives cosine softmax Std‖w‖/Avg‖w‖ = 0); else
    ``W`` itself. What Table E.2's weight statistics and Fig. E.2's weight spectrum are computed on."""
    if logit_map(objective) != "cosine":
        return W
    import numpy as np

    W = np.asarray(W, dtype=np.float64)
    norms = np.linalg.norm(W, axis=1, keepdims=True)
    return W / np.where(norms > 0, norms, 1.0)

