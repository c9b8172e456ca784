"""The transformers-sdist cache that the common tests read is filled once when two processes ask at once
(pytest -n 2 on an empty cache: both workers collect the common-test modules together)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# A download that takes a while and fails if its target already exists, as the real rename did (ENOTEMPTY).
WORKER = """
import sys, time
from pathlib import Path
sys.path.insert(0, {here!r})
from _transformers_tests import FILES, PACKAGE, ensure_cache

root = Path(sys.argv[1])

def download():
    with open(root.parent / "downloads.log", "a") as log:
        log.write("download\\n")
    staging = root.parent / ("staging-" + sys.argv[2])
    (staging / PACKAGE).mkdir(parents=True)
    (staging / PACKAGE / FILES[0]).write_text("# stand-in")
    time.sleep(1.0)  # the other process arrives meanwhile
    staging.rename(root)

open(root.parent / ("ready-" + sys.argv[2]), "w").close()
while not all((root.parent / f"ready-{{w}}").exists() for w in ("a", "b")):
    time.sleep(0.01)  # both start together
ensure_cache(root, download)
print((root / PACKAGE / FILES[0]).read_text())
"""


def test_two_processes_on_an_empty_cache_download_once_and_both_find_it(tmp_path):
    root = tmp_path / "cache" / "transformers-x-tests"
    root.parent.mkdir()
    script = WORKER.format(here=str(HERE))
    procs = [subprocess.Popen([sys.executable, "-c", script, str(root), w], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for w in ("a", "b")]
    results = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in results]
    assert all(out.strip() == "# stand-in" for out, _ in results)
    assert (root.parent / "downloads.log").read_text() == "download\n"
