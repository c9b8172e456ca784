"""The loss a plan predicts, against the laws computed by hand: dense, MoE, MoD, repeated data, bands, files."""

from __future__ import annotations

import json
import math

import pytest

from adaptive.errors import AdaptiveError
from adaptive.plan import count_params, fit, make_request, preset_spec
from adaptive.plan.estimate.throughput import model_flops_per_token
from adaptive.plan.quality.law_file import arch_dict, file_dict, law_dict, load, refit_dict
from adaptive.plan.quality.laws import CHINCHILLA, EPOCH, JOINT_MOE
from adaptive.plan.quality.predict import mod_compute_fraction, predict, resolve_law


def _epoch_by_hand(n: float, d: float) -> float:
    return 1.8172 + 482.01 / n**0.3478 + 2085.43 / d**0.3658


def test_a_dense_plan_predicts_the_default_law_at_its_parameters_and_tokens():
    plan = fit(make_request(model="b1", gpu="a100-80gb", tokens=20e9))
    q = plan.quality
    assert q.predicted_loss == pytest.approx(_epoch_by_hand(plan.counts.total, 20e9), rel=1e-12)
    assert q.band[0] < q.predicted_loss < q.band[1]
    assert q.perplexity == pytest.approx(math.exp(q.predicted_loss))
    assert "Besiroglu" in q.source and q.law == "epoch"


def test_chinchilla_on_request_and_the_band_spans_both_published_fits():
    spec = preset_spec("b1")
    c = count_params(spec)
    chin = predict(spec, c, 20e9, resolve_law("chinchilla"))
    epoch = predict(spec, c, 20e9, resolve_law("epoch"))
    assert chin.predicted_loss == pytest.approx(CHINCHILLA.loss(c.total, 20e9))
    for q in (chin, epoch):  # each band holds both fits of the same runs
        assert q.band[0] <= min(chin.predicted_loss, epoch.predicted_loss)
        assert q.band[1] >= max(chin.predicted_loss, epoch.predicted_loss)


def test_more_tokens_and_more_parameters_lower_the_loss():
    spec, big = preset_spec("b1"), preset_spec("b7")
    losses = [predict(spec, count_params(spec), d).predicted_loss for d in (1e9, 1e10, 1e11)]
    assert losses == sorted(losses, reverse=True)
    assert predict(big, count_params(big), 1e10).predicted_loss < losses[1]


def test_moe_multiplies_the_reducible_loss_by_the_joint_laws_ratio():
    spec = preset_spec("b1", "moe")  # top-2 of 8: four top-1 experts' worth
    c = count_params(spec)
    q = predict(spec, c, 20e9)
    ratio = (JOINT_MOE.loss(c.active, 20e9, 4) - JOINT_MOE.c) / (JOINT_MOE.loss(c.active, 20e9, 1) - JOINT_MOE.c)
    assert 0 < ratio < 1
    assert q.predicted_loss == pytest.approx(EPOCH.E + (_epoch_by_hand(c.active, 20e9) - EPOCH.E) * ratio)
    dense_same_active = _epoch_by_hand(c.active, 20e9)
    assert q.predicted_loss < dense_same_active  # experts help at the same active size
    assert q.band[0] < q.predicted_loss < q.band[1]


def test_mod_is_its_dense_twin_on_the_tokens_the_same_flops_buy():
    spec, twin = preset_spec("b1", "mod"), preset_spec("b1")
    r = model_flops_per_token(spec, 2048) / model_flops_per_token(twin, 2048)
    assert 0.5 < r < 1 and mod_compute_fraction(spec, 2048) == pytest.approx(r)
    c = count_params(spec)
    q = predict(spec, c, 20e9)
    assert q.predicted_loss == pytest.approx(_epoch_by_hand(c.total, r * 20e9))
    assert "stated effect" in q.kind and any("Raposo" in s for s in q.source.split(";"))
    hybrid = predict(preset_spec("b1", "hybrid"), count_params(preset_spec("b1", "hybrid")), 20e9)
    assert "extrapolation" in hybrid.kind


def test_repeated_data_costs_loss_only_past_one_epoch():
    spec = preset_spec("b1")
    c = count_params(spec)
    fresh = predict(spec, c, 20e9).predicted_loss
    assert predict(spec, c, 20e9, unique_tokens=20e9).predicted_loss == fresh
    three = predict(spec, c, 20e9, unique_tokens=20e9 / 3)
    assert three.predicted_loss > fresh
    # three epochs are nearly as good as fresh data (Muennighoff et al.: an 8.7B model on four epochs of 44B tokens
    # ends 0.5% above one epoch; here the 1B model is also larger than 6.7B unique tokens support)
    assert (three.predicted_loss - fresh) / fresh < 0.015
    assert predict(spec, c, 20e9, unique_tokens=20e9 / 40).predicted_loss - fresh > 0.05
    assert any("epochs" in n for n in three.notes)


def test_outside_the_fitted_range_it_warns_and_widens_the_band():
    spec = preset_spec("b70")
    c = count_params(spec)
    inside = predict(preset_spec("b7"), count_params(preset_spec("b7")), 140e9)
    outside = predict(spec, c, 1.4e12)
    assert not any(n.startswith("extrapolated") for n in inside.notes)
    assert any(n.startswith("extrapolated") for n in outside.notes)
    width = lambda q: (q.band[1] - q.band[0]) / q.predicted_loss  # noqa: E731
    assert width(outside) > width(inside)


def _law_file(tmp_path, multipliers: dict[str, float], refits: list[tuple[tuple, dict]]) -> str:
    """A law.json of the joint form: E 2, A 300, B 900, alpha = beta = 0.3, the given multipliers and refits."""
    path = tmp_path / "law.json"
    archs = {a: arch_dict(k, (1e5, 2e9), (1e6, 1e11), 9) for a, k in multipliers.items()}
    path.write_text(json.dumps(file_dict("mine", "adaptive scale test", "builtin corpus", "dense",
                                         law_dict((2.0, 300.0, 900.0, 0.3, 0.3), "active", 18, 0.01), archs,
                                         [refit_dict(c, m) for c, m in refits])))
    return str(path)


def test_a_fitted_law_file_predicts_with_its_own_coefficients_and_bootstrap_band(tmp_path):
    refits = [((2.0 + 0.01 * i, 300.0, 900.0, 0.3, 0.3), {"dense": 1.0, "moe": 2.0}) for i in range(-10, 11)]
    path = _law_file(tmp_path, {"dense": 1.0, "moe": 2.0}, refits)
    spec = preset_spec("b1")
    c = count_params(spec)
    q = predict(spec, c, 2e10, resolve_law(path))
    assert q.predicted_loss == pytest.approx(2.0 + 300 / c.active**0.3 + 900 / 2e10**0.3)
    assert q.band[0] == pytest.approx(q.predicted_loss - 0.09, abs=1e-9)  # the 5th-95th bootstrap percentiles
    assert q.band[1] == pytest.approx(q.predicted_loss + 0.09, abs=1e-9)
    assert q.kind == "fitted on your data" and q.fitted_on == "builtin corpus"
    assert len(q.samples) == 21 and q.samples[0] == pytest.approx(q.predicted_loss - 0.1)  # in refit order
    b7 = predict(preset_spec("b7"), count_params(preset_spec("b7")), 2e10, resolve_law(path))
    assert any(n.startswith("extrapolated") for n in b7.notes)  # above the fitted 2e9 params: said, not refused
    assert b7.band[1] - b7.predicted_loss == pytest.approx(2 * 0.09, abs=1e-9)  # and the band doubled
    moe_spec = preset_spec("b1", "moe")
    mc = count_params(moe_spec)
    moe = predict(moe_spec, mc, 2e10, resolve_law(path))  # its N counts twice: A / (2 N)^alpha
    assert moe.predicted_loss == pytest.approx(2.0 + 300 / (2 * mc.active)**0.3 + 900 / 2e10**0.3)
    assert any("moe's N counts 2.00x" in n for n in moe.notes)
    mod = predict(preset_spec("b1", "mod"), count_params(preset_spec("b1", "mod")), 2e10, resolve_law(path))
    assert any("was not fitted on 'mod'" in n for n in mod.notes) and len(mod.samples) == 21


V2 = ('{"format": "adaptive-loss-law", "version": 2, "name": "x", "source": "s", "fitted_on": "f", '
      '"reference": "dense", ')
ARCHS = '"archs": {"dense": {"multiplier": 1.0, "params_range": [1, 2], "tokens_range": [1, 2]}}'


@pytest.mark.parametrize("content,message", [
    ("{", "not a readable JSON file"),
    ("[]", "must hold a JSON object"),
    ('{"format": "adaptive-loss-law", "version": 1, "name": "x", "source": "s", "fitted_on": "f", "laws": '
     '{"dense": {"E": 1.0, "A": 1.0, "B": 1.0, "alpha": 0.3, "beta": 0.3, "params_range": [1, 2], '
     '"tokens_range": [1, 2]}}}', "version-1 file of separate per-arch laws.*rerun `adaptive scale`"),
    (V2 + '"law": {"E": 1.0, "A": 1.0, "B": 1.0, "alpha": 0.3}, ' + ARCHS + "}", "lacks 'law.beta'"),
    (V2 + '"law": {"E": 1.0, "A": -1.0, "B": 1.0, "alpha": 0.3, "beta": 0.3}, ' + ARCHS + "}", "law.A"),
    (V2 + '"law": {"E": 1.0, "A": 1.0, "B": 1.0, "alpha": 0.3, "beta": 0.3}, "archs": {}}', "archs"),
    (V2.replace('"dense"', '"moe"') + '"law": {"E": 1.0, "A": 1.0, "B": 1.0, "alpha": 0.3, "beta": 0.3}, ' + ARCHS
     + "}", "reference 'moe' is not one of archs"),
])
def test_a_malformed_law_file_is_one_line(tmp_path, content, message):
    path = tmp_path / "law.json"
    path.write_text(content)
    with pytest.raises(AdaptiveError, match=message) as err:
        load(path)
    assert "\n" not in str(err.value)


def test_an_unknown_law_name_suggests_the_nearest():
    with pytest.raises(AdaptiveError, match="did you mean chinchilla"):
        resolve_law("chinchila")
    with pytest.raises(AdaptiveError, match="no such file"):
        resolve_law("/nonexistent/law.json")


def test_more_experts_than_the_moe_law_saw_is_said_and_widens_the_band():
    from dataclasses import replace

    spec = preset_spec("b1", "moe")
    wide = replace(spec, num_local_experts=128, num_experts_per_tok=2)  # 64 top-1 experts' worth; fitted on 1-32
    inside, outside = predict(spec, count_params(spec), 20e9), predict(wide, count_params(wide), 20e9)
    assert not any("experts" in n and n.startswith("extrapolated") for n in inside.notes)
    assert any("fitted on 1-32 experts" in n for n in outside.notes)
    width = lambda q: (q.band[1] - q.band[0]) / q.predicted_loss  # noqa: E731
    assert width(outside) > width(inside)


def test_a_law_fitted_on_a_repeated_corpus_discounts_a_planned_run_s_repeats_with_its_own_decay(tmp_path):
    from adaptive.plan.quality import repeated_data

    path = tmp_path / "law.json"
    archs = {"dense": arch_dict(1.0, (1e5, 2e9), (1e6, 1e11), 9)}
    law = law_dict((2.0, 300.0, 900.0, 0.3, 0.3), "active", 9, 0.01, unique_tokens=1e6, repeat_decay=2.0)
    path.write_text(json.dumps(file_dict("mine", "s", "f", "dense", law, archs, [])))
    spec = preset_spec("b1")
    c = count_params(spec)
    q = predict(spec, c, 2e10, resolve_law(str(path)), unique_tokens=2e9)  # 10 epochs of 2B tokens
    fitted_decay = 2e9 * (1 + 2.0 * (1 - math.exp(-9 / 2.0)))
    assert q.effective_tokens == pytest.approx(fitted_decay)  # not the published decay's
    assert fitted_decay < repeated_data.effective_tokens(2e10, 2e9)
    n = repeated_data.effective_params(resolve_law(str(path)).dense, c.active, 2e9)
    assert q.predicted_loss == pytest.approx(2.0 + 300 / n**0.3 + 900 / fitted_decay**0.3)
