"""The nine objectives of Kornblith et al. (2021), §2, Eq. 1–9, each owning the final layer.

Notation (paper §2): x ∈ R^M penultimate features, z = W x + b ∈ R^K logits, t one-hot targets.
Every objective is one :class:`Head` — an ``nn.Module`` holding ``weight`` (K, M) and ``bias`` (K,) —
built from three independent parts, so the combinations of Appendix Table C.4 are compositions:

* **logit map** (how features become the vector that enters the loss)
  ``linear``      z = W x + b
  ``logit_norm``  z / (τ ‖z‖)                                   (Eq. 6)
  ``cosine``      sim(W_k, x) / τ + b_k                         (Eq. 7)
* **loss** on that vector, per example, averaged over the batch
  ``softmax``        −Σ t_k z_k + log Σ e^{z_k}                  (Eq. 1)
  label smoothing α  −1/(1−α) Σ ((1−α) t_k + α/K) log softmax(z)_k   (Eq. 2)
  ``sigmoid``        −Σ t_k z_k + Σ log(e^{z_k} + 1)             (Eq. 8), biases initialised to −log K
  ``squared_error``  s · (1/K) Σ (κ t_k (z_k − M)² + (1 − t_k) z_k²)   (Eq. 9, Hui & Belkin; s = loss scale)
* **regularisers**
  dropout ρ        x̃ = x ⊙ ξ/ρ, ξ_i ~ Bernoulli(ρ), training mode only (Eq. 3)
  logit penalty β  + β ‖z‖² per example, z the vector entering the loss (Eq. 5)
  extra L2 λ       + λ ‖W‖²_F once per batch (Eq. 4)
  loss × τ         cosine softmax with ``scale_by_tau`` (main text, footnote 1 of Table 4)

``make_objective(name, in_features, num_classes, **hyper)`` accepts the nine objective names and
``+``-joined combinations such as ``"sigmoid+dropout"`` or ``"cosine_softmax+logit_penalty"``.
Hyperparameters default to the bold values of Appendix Table A.1 (ResNet-50, ImageNet).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import repsim.study.objectives as _registry

# The registry (names, roles, defaults, which loss and logit map each builds) is repsim.study.objectives,
# torch-free, shared with the analyses; here are the torch parts it names.
OBJECTIVES: tuple[str, ...] = _registry.OBJECTIVES
DEFAULTS: dict[str, dict[str, Any]] = {o.name: dict(o.defaults) for o in _registry.REGISTRY}  # Table A.1 bold values


def _up(t: torch.Tensor) -> torch.Tensor:
    """float16/bfloat16 (AMP) → float32 for the loss; float32/float64 unchanged."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


# -- the head's parts: one table each, keyed by the registry's ``loss`` / ``logit_map`` --------------------
def _linear(head: "Head", x: torch.Tensor) -> torch.Tensor:
    return _up(F.linear(x, head.weight, head.bias))


def _logit_norm(head: "Head", x: torch.Tensor) -> torch.Tensor:  # Eq. 6: z / (τ ‖z‖)
    z = _linear(head, x)
    return z / (head.tau * z.norm(dim=1, keepdim=True).clamp_min(1e-12))


def _cosine(head: "Head", x: torch.Tensor) -> torch.Tensor:  # Eq. 7: sim(W_k, x)/τ + b_k
    w = F.normalize(_up(head.weight), dim=1)
    return F.normalize(_up(x), dim=1) @ w.t() / head.tau + _up(head.bias)


# logit map -> (head, features) -> the vector entering the loss; every map but linear needs τ
LOGIT_MAPS: dict[str, Callable[["Head", torch.Tensor], torch.Tensor]] = {
    "linear": _linear, "logit_norm": _logit_norm, "cosine": _cosine,
}


def _softmax_loss(head: "Head", z: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # Eqs. 1, 2
    # F.cross_entropy's label_smoothing uses targets (1−α) t + α/K, i.e. Eq. 2 times (1−α).
    per = F.cross_entropy(z, targets, reduction="none", label_smoothing=head.alpha)
    return per / (1.0 - head.alpha) if head.alpha else per


def _sigmoid_loss(head: "Head", z: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # Eq. 8 summed over classes
    t = F.one_hot(targets, head.num_classes).to(z.dtype)
    return F.binary_cross_entropy_with_logits(z, t, reduction="none").sum(1)


def _squared_error_loss(head: "Head", z: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # Eq. 9
    t = F.one_hot(targets, head.num_classes).to(z.dtype)
    return (head.kappa * t * (z - head.M) ** 2 + (1 - t) * z**2).mean(1) * head.loss_scale


@dataclass(frozen=True)
class Loss:
    """A loss of the head: its per-example value at integer targets, what it adds to ``Head.hyper()``,
    its bias initialisation (None: nn.Linear's) and whether label smoothing applies to it."""

    per_example: Callable[["Head", torch.Tensor, torch.Tensor], torch.Tensor]
    hyper: tuple[str, ...] = ()
    bias_init: Callable[[int], float] | None = None  # number of classes -> initial bias
    smoothing: bool = False


LOSSES: dict[str, Loss] = {
    "softmax": Loss(_softmax_loss, smoothing=True),
    "sigmoid": Loss(_sigmoid_loss, bias_init=lambda K: -math.log(K)),  # paper §2, Eq. 8: biases start at −log K
    "squared_error": Loss(_squared_error_loss, hyper=("kappa", "M", "loss_scale")),
}


class Head(nn.Module):
    """Final layer plus loss. ``head(x)`` → the logits used for prediction (the vector entering the
    loss, without dropout in eval mode); ``head.loss(x, t)`` → batch-mean loss (a scalar tensor)."""

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        *,
        loss: str = "softmax",
        logit_map: str = "linear",
        alpha: float = 0.0,
        tau: float | None = None,
        scale_by_tau: bool = False,
        keep_prob: float = 1.0,
        beta: float = 0.0,
        lambda_final: float = 0.0,
        kappa: float = 1.0,
        M: float = 1.0,
        loss_scale: float = 1.0,
        name: str = "",
    ) -> None:
        super().__init__()
        if loss not in LOSSES:
            raise ValueError(f"unknown loss {loss!r}")
        if logit_map not in LOGIT_MAPS:
            raise ValueError(f"unknown logit map {logit_map!r}")
        if in_features < 1 or num_classes < 2:
            raise ValueError(f"need in_features >= 1 and num_classes >= 2, got {in_features}, {num_classes}")
        if not 0.0 <= alpha < 1.0:
            raise ValueError(f"label smoothing alpha must be in [0, 1), got {alpha}")
        if alpha and not LOSSES[loss].smoothing:
            raise ValueError(f"label smoothing applies to the softmax loss only, not {loss}")
        if logit_map != "linear" and (tau is None or tau <= 0):
            raise ValueError(f"{logit_map} needs a temperature tau > 0, got {tau}")
        if not 0.0 < keep_prob <= 1.0:
            raise ValueError(f"dropout keep_prob must be in (0, 1], got {keep_prob}")
        if beta < 0 or lambda_final < 0 or kappa <= 0 or loss_scale <= 0:
            raise ValueError("beta, lambda_final must be >= 0 and kappa, loss_scale > 0")
        self.in_features, self.num_classes = int(in_features), int(num_classes)
        self.loss_name, self.logit_map, self.name = loss, logit_map, name or loss
        self._loss, self._map = LOSSES[loss], LOGIT_MAPS[logit_map]
        self.alpha, self.tau, self.scale_by_tau = float(alpha), tau, bool(scale_by_tau)
        self.keep_prob, self.beta, self.lambda_final = float(keep_prob), float(beta), float(lambda_final)
        self.kappa, self.M, self.loss_scale = float(kappa), float(M), float(loss_scale)
        self.weight = nn.Parameter(torch.empty(num_classes, in_features))
        self.bias = nn.Parameter(torch.empty(num_classes))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's initialisation; sigmoid biases start at −log K (paper §2, Eq. 8)."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        bound = 1.0 / math.sqrt(self.in_features)
        nn.init.uniform_(self.bias, -bound, bound)
        if self._loss.bias_init is not None:
            nn.init.constant_(self.bias, self._loss.bias_init(self.num_classes))

    def extra_repr(self) -> str:
        return (f"{self.name}: in_features={self.in_features}, num_classes={self.num_classes}, "
                f"hyper={self.hyper()}")

    def hyper(self) -> dict[str, Any]:
        """The hyperparameters that differ from the plain softmax defaults."""
        out: dict[str, Any] = {}
        if self.alpha:
            out["alpha"] = self.alpha
        if self.tau is not None:
            out["tau"] = self.tau
        if self.scale_by_tau:
            out["scale_by_tau"] = True
        if self.keep_prob != 1.0:
            out["keep_prob"] = self.keep_prob
        if self.beta:
            out["beta"] = self.beta
        if self.lambda_final:
            out["lambda_final"] = self.lambda_final
        out.update({k: getattr(self, k) for k in self._loss.hyper})
        return out

    # -- logits ---------------------------------------------------------------------------------
    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        # the head runs in float32 (float64 if given) even under AMP: a bf16 cosine / τ = 0.05 would
        # carry ~0.05 absolute logit error
        with torch.autocast(x.device.type, enabled=False):
            return self._logits_fp(_up(x))

    def _logits_fp(self, x: torch.Tensor) -> torch.Tensor:
        if self.keep_prob < 1.0 and self.training:  # Eq. 3: x̃ = x ⊙ ξ / ρ
            x = F.dropout(x, p=1.0 - self.keep_prob, training=True)
        return self._map(self, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._logits(x)

    # -- loss -----------------------------------------------------------------------------------
    def loss_and_logits(self, x: torch.Tensor, targets: torch.Tensor,
                        mix: tuple[torch.Tensor, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch-mean loss and the logits it was computed from (one forward through the head).

        ``mix=(targets_b, lam)`` (Mixup, :mod:`repsim.train.augment`): the per-example loss is
        lam·L(z, targets) + (1 − lam)·L(z, targets_b) from one set of logits (one dropout mask), i.e. the
        loss at the mixed target, since every loss here is linear in the one-hot target.
        """
        z = self._logits(x)
        per = self._per_example(z, targets)
        if mix is not None:
            targets_b, lam = mix
            per = lam * per + (1.0 - lam) * self._per_example(z, targets_b)
        loss = per.mean()
        if self.scale_by_tau:
            loss = loss * self.tau
        if self.lambda_final:  # Eq. 4, once per batch
            loss = loss + self.lambda_final * (_up(self.weight) ** 2).sum()
        return loss, z

    def _per_example(self, z: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-example loss (Eqs. 1, 2, 8, 9, plus the logit penalty Eq. 5) at integer ``targets``."""
        per = self._loss.per_example(self, z, targets)
        if self.beta:  # Eq. 5
            per = per + self.beta * (z**2).sum(1)
        return per

    def loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_and_logits(x, targets)[0]


def parse_objective(name: str) -> list[str]:
    """Split ``"a+b"`` into validated components (one loss at most, one logit map at most)."""
    parts = [p.strip() for p in str(name).split("+") if p.strip()]
    if not parts:
        raise ValueError("empty objective name")
    for p in parts:
        if p not in _registry.BY_NAME:
            raise ValueError(f"unknown objective {p!r}; choose from {', '.join(_registry.BY_NAME)} (or join with '+')")
    if len(set(parts)) != len(parts):
        raise ValueError(f"objective {name!r} repeats a component")
    losses = [p for p in parts if _registry.BY_NAME[p].role == "loss"]
    maps = [p for p in parts if _registry.BY_NAME[p].role == "map"]
    if len(losses) > 1:
        raise ValueError(f"objective {name!r} combines two losses ({', '.join(losses)})")
    if len(maps) > 1:
        raise ValueError(f"objective {name!r} combines {' and '.join(maps)}")
    if "squared_error" in parts and maps:
        raise ValueError("squared_error cannot be combined with a normalised logit map")
    return parts


def objective_defaults(name: str) -> dict[str, Any]:
    """Default hyperparameters of an objective or combination (Table A.1 bold values)."""
    return _registry.with_defaults("+".join(parse_objective(name)))


def make_objective(name: str, in_features: int, num_classes: int, **hyper: Any) -> Head:
    """Build the head of objective ``name`` (one of :data:`OBJECTIVES` or a ``+`` combination).

    Unknown hyperparameters raise ``ValueError``; missing ones take the Table A.1 bold values.
    """
    parts = parse_objective(name)
    params = objective_defaults(name)
    unknown = sorted(set(hyper) - set(params))
    if unknown:
        allowed = ", ".join(sorted(params)) or "none"
        raise ValueError(f"unknown hyperparameter(s) {', '.join(unknown)} for objective {name!r} (allowed: {allowed})")
    params.update(hyper)
    entries = [_registry.BY_NAME[p] for p in parts]
    loss = next((o.loss for o in entries if o.loss), "softmax")
    logit_map = next((o.logit_map for o in entries if o.logit_map), "linear")
    return Head(in_features, num_classes, loss=loss, logit_map=logit_map, name="+".join(parts),
                **{k: v for k, v in params.items()})
