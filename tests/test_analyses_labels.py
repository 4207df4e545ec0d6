"""Labels of runs and results rows: objective parameters with their defaults filled in on both sides
(stores record them, `repsim train`'s training.csv only those given), and a sweep labelled by what varies."""
from __future__ import annotations

import json

from repsim.analyses.data import _params_text, _shown_params, _varying, compose_label, groups_text


def test_a_store_and_its_training_run_carry_the_same_parameter_text():
    store = _params_text({"tau": 0.025, "scale_by_tau": False}, "cosine_softmax")  # extract fills defaults
    run = _params_text(json.dumps({"tau": 0.025}), "cosine_softmax")  # training.csv: only what was given
    old_store = _params_text({}, "cosine_softmax")  # a store written before defaults were recorded
    assert store == run == "scale_by_tau=False, tau=0.025"
    assert old_store == "scale_by_tau=False, tau=0.05"
    assert _params_text({}, "softmax") == "" and _params_text("not json", "softmax") == "not json"


def test_a_sweep_is_labelled_by_the_parameter_that_varies():
    texts = [_params_text({"tau": t}, "cosine_softmax") for t in (0.025, 0.1, 0.4)]
    keys = _varying(texts)
    assert keys == {"tau"}
    labels = [compose_label("cosine_softmax", _shown_params(t, keys), "", len(texts)) for t in texts]
    assert labels == ["cosine_softmax (tau=0.025)", "cosine_softmax (tau=0.1)", "cosine_softmax (tau=0.4)"]
    assert _varying(["a=1, b=2", "a=1"]) == {"b"}  # absent counts as a value
    assert groups_text(labels) == "3 settings of 1 objective"
    assert groups_text(["softmax", "sigmoid"]) == "2 objectives"
