"""`fit --calibrate FILE` with files that are not calibrations: one-line errors, never a plan or a traceback."""

import json
import math

import pytest

from adaptive.errors import AdaptiveError
from adaptive.plan import make_request
from adaptive.plan.estimate.calibration import Calibration, signature, to_json


def good(tmp_path, **change):
    spec = make_request(model="debug", gpu="t4").spec
    data = json.loads(to_json(Calibration(signature(spec), 512, (100.0, 10.0), (200.0, 20.0), "by hand")))
    for key, value in change.items():
        if "." in key:
            outer, inner = key.split(".")
            data[outer][inner] = value
        else:
            data[key] = value
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_a_good_file_is_read(tmp_path):
    c = make_request(model="debug", gpu="t4", calibrate=good(tmp_path)).calibration
    assert c.activation_bytes(1000, False) == 100_000 and c.backward_bytes(1000, True) == 20_000


@pytest.mark.parametrize("change,words", [
    ({"activation_bytes_per_token.no_checkpointing": -5}, "must be positive"),
    ({"backward_bytes_per_token.checkpointing": math.nan}, "must be positive"),
    ({"seq_len": 0}, "must be positive"),
    ({"activation_bytes_per_token": "x"}, "malformed"),
    ({"kind": "something-else"}, "malformed"),
])
def test_nonsense_figures_are_refused(tmp_path, change, words):
    with pytest.raises(AdaptiveError, match=words):
        make_request(model="debug", gpu="t4", calibrate=good(tmp_path, **change))


@pytest.mark.parametrize("content", ["[1, 2]", '{"kind": "adaptive-calibration"', "\udcff"])
def test_files_that_are_not_calibrations_are_refused(tmp_path, content):
    path = tmp_path / "c.json"
    path.write_bytes(content.encode("utf-8", "surrogateescape"))
    with pytest.raises(AdaptiveError, match="malformed calibration file"):
        make_request(model="debug", gpu="t4", calibrate=str(path))


def test_a_directory_without_run_metrics_is_refused(tmp_path):
    # a folder is now read as a run folder (--calibrate RUN_DIR); without metrics.jsonl it is refused
    with pytest.raises(AdaptiveError, match="no metrics.jsonl in that folder"):
        make_request(model="debug", gpu="t4", calibrate=str(tmp_path))
