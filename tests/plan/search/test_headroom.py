"""search/tight.py's headroom: derived from under-predictions, parsed from --headroom, and kept free by the search."""

from dataclasses import replace

import pytest

from adaptive.errors import AdaptiveError
from adaptive.plan.request import make_request
from adaptive.plan.search.planner import fit
from adaptive.plan.search.tight import (DEFAULT_HEADROOM, NO_HEADROOM, Headroom, headroom_from_underpredictions,
                                       parse_headroom)

GiB = 2**30


def test_headroom_is_the_worst_underprediction_rounded_up_to_a_percent():
    assert headroom_from_underpredictions([0.05, -0.1271, -0.02]) == 0.13
    assert headroom_from_underpredictions([-0.12]) == 0.12  # exactly a percent stays there
    assert headroom_from_underpredictions([0.1, 0.38]) == 0.0  # only over-predictions: nothing to keep
    assert headroom_from_underpredictions([]) == 0.0


def test_parse_headroom_reads_gib_and_percentages():
    assert parse_headroom(None) == DEFAULT_HEADROOM
    assert parse_headroom("2").bytes_of(40 * GiB) == 2 * GiB
    assert parse_headroom("2GiB").bytes_of(80 * GiB) == 2 * GiB
    assert parse_headroom("10%").bytes_of(40 * GiB) == 4 * GiB
    assert parse_headroom("0").bytes_of(40 * GiB) == 0 and parse_headroom("0%").given
    assert parse_headroom("10%").words(40 * GiB) == "10% (4.00 GiB)"
    for bad in ("100%", "x", "2 MB", "-1"):
        with pytest.raises(AdaptiveError, match="--headroom"):
            parse_headroom(bad)


def test_every_candidate_the_search_keeps_leaves_the_headroom_free():
    req = make_request(model="b1", gpu="rtx4090")
    cap = req.gpu.memory_bytes
    for h in (NO_HEADROOM, Headroom(gib=4.0), Headroom(fraction=0.2)):
        p = fit(replace(req, headroom=h), suggest=False)
        assert p.fits and p.best.memory.peak_gpu_bytes <= cap - h.bytes_of(cap)
        assert p.headroom_bytes == h.bytes_of(cap)
        assert all(cap - h.bytes_of(cap) < c.memory.peak_gpu_bytes <= cap for c in p.ruled_out)
        # the OOM playbook's rungs are held to the same capacity
        for step in p.ladder:
            assert step.fits_gpu == (step.peak_gpu_bytes <= cap - h.bytes_of(cap))


def test_the_headroom_flags_help_states_the_default_it_plans_with():
    import dataclasses

    from adaptive.config.run import HardwareOptions
    from adaptive.plan.search.tight import DEFAULT_HEADROOM_FRACTION

    flag = next(f for f in dataclasses.fields(HardwareOptions) if f.name == "headroom").metadata["flag"]
    assert f"Default {DEFAULT_HEADROOM_FRACTION:.0%}:" in flag.help


def test_the_fine_tune_corpus_checks_its_predictions_against_the_whole_gpu():
    """Its fit/OOM calls test the prediction, not the margin: runs that ran within 13% of their GPU (LitGPT's 13B LoRA
    on an A100-40GB, Mistral-7B LoRA on an A10G) would be refused with the default kept free."""
    from adaptive.plan.evidence.finetune_corpus import predictions

    found = predictions()
    assert all(p.plan.request.headroom == NO_HEADROOM for p in found)
    close = [p.id for p in found if p.entry["outcome"].get("ran") and p.fits
             and p.memory.peak_gpu_bytes > (1 - DEFAULT_HEADROOM.fraction) * p.plan.request.gpu.memory_bytes]
    assert "litgpt-llama2-13b-lora-mb1-1xa100-40gb" in close
