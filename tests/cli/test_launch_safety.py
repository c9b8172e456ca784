"""`adaptive launch` on hostile or malformed input: hostfiles in DeepSpeed's grammar with RFC 1123 host
names, addresses and paths that could reach pdsh's remote shell, and dry runs that leave an existing run
folder alone. Each case: exit 2, one line, and nothing written or changed."""

from __future__ import annotations

import hashlib

import pytest

from adaptive.errors import AdaptiveError
from adaptive.launch import check_host, read_hostfile
from tests.cli.test_launch import RECIPE, adaptive


def _snapshot(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("name", ["node-a", "gpu07.cluster.example.org", "10.0.0.1", "fe80::1", "N1"])
def test_host_names_and_addresses_pass(name):
    assert check_host(name, "host") == name


@pytest.mark.parametrize("name", ["node-a;touch${IFS}/tmp/x;", "$(id)", "a b", "-node", "node-", "node_a",
                                  "`reboot`", "a" * 64, "x.." , "10.0.0.1;id", "node-a&&id"])
def test_hostile_host_names_are_refused(name):
    with pytest.raises(AdaptiveError, match="is not a host name"):
        check_host(name, "host")


@pytest.mark.parametrize("text, message", [
    ("node-a slots=abc\n", "is not `HOST slots=N`"),
    ("node-a\n", "is not `HOST slots=N`"),
    ("node-a slots=8 extra\n", "is not `HOST slots=N`"),
    ("node-a slots=0\n", "slots must be >= 1"),
    ("node-a slots=8\nnode-a slots=8\n", "lists node-a twice"),
    ("# only a comment\n\n", "lists no hosts"),
    ("node;rm slots=8\n", "is not a host name"),
])
def test_malformed_hostfiles_are_one_line_errors(tmp_path, text, message):
    path = tmp_path / "hosts"
    path.write_text(text)
    with pytest.raises(AdaptiveError, match=message):
        read_hostfile(str(path))


def test_a_hostfile_in_deepspeeds_grammar_is_read(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# two nodes\nnode-a slots=8\n\n10.0.0.2   slots=8\n")
    assert read_hostfile(str(path)) == [("node-a", 8), ("10.0.0.2", 8)]


def test_a_binary_hostfile_is_one_line(tmp_path):
    path = tmp_path / "hosts"
    path.write_bytes(b"\xff\xfe\x00node")
    with pytest.raises(AdaptiveError, match="cannot be read as text"):
        read_hostfile(str(path))


@pytest.mark.parametrize("extra", [
    ["--main-process-ip", "10.0.0.1;touch${IFS}/tmp/x"],
    ["--hostfile", "HOSTS", "--run-dir", "RUN;touch${IFS}/tmp/x"],
    ["--hostfile", "HOSTS", "--orchestrator-config", '{"guard": {"bad_steps": 2}}'],
])
def test_hostile_addresses_and_paths_never_reach_a_command(tmp_path, extra):
    hosts = tmp_path / "hosts"
    hosts.write_text("node-a slots=2\nnode-b slots=2\n")
    extra = [a.replace("HOSTS", str(hosts)).replace("RUN", str(tmp_path / "run")) for a in extra]
    before = _snapshot(tmp_path)
    done = adaptive("launch", RECIPE, "--gpu", "a100", "--gpus", "2", "--nodes", "2", "--dry-run",
                    *(["--run-dir", str(tmp_path / "run")] if "--run-dir" not in extra else []), *extra)
    assert done.returncode == 2, done.stdout + done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "accelerate launch" not in done.stdout
    assert _snapshot(tmp_path) == before, "nothing was written"


def test_a_dry_run_leaves_an_existing_run_folder_alone_unless_asked(tmp_path):
    run = tmp_path / "run"
    assert adaptive("launch", RECIPE, "--gpu", "a100", "--dry-run", "--run-dir", str(run)).returncode == 0
    before = _snapshot(run)
    again = adaptive("launch", RECIPE, "--gpu", "h100", "--micro-batch", "1", "--dry-run", "--run-dir", str(run))
    assert again.returncode == 0 and "kept " in again.stdout and "--overwrite" in again.stdout
    assert _snapshot(run) == before, "a dry run rewrote the run folder's configs"
    forced = adaptive("launch", RECIPE, "--gpu", "h100", "--micro-batch", "1", "--dry-run", "--overwrite",
                      "--run-dir", str(run))
    assert forced.returncode == 0 and _snapshot(run) != before


@pytest.mark.parametrize("extra, line", [
    (["--exclusive"],  # an sbatch flag, not one of launch's Slurm options
     "error: --exclusive is an option of neither adaptive launch nor recipes/b1_mod.py (adaptive launch --help lists "
     "them)"),
    (["--", "--max-step", "4"],
     "error: --max-step is an option of neither adaptive launch nor recipes/b1_mod.py (nearest: --max-steps)"),
    (["--hostfiel", "hosts"],
     "error: --hostfiel is an option of neither adaptive launch nor recipes/b1_mod.py (nearest: --hostfile)"),
    (["--", "--max-steps", "many"], "error: Invalid value for '--max-steps': 'many' is not a valid int."),
])
@pytest.mark.parametrize("dry_run", [True, False])
def test_an_option_the_recipe_does_not_take_is_refused_before_anything_is_written(tmp_path, extra, line, dry_run):
    done = adaptive("launch", RECIPE, "--gpu", "a100", "--run-dir", str(tmp_path / "run"),
                    *(["--dry-run"] if dry_run else []), *extra)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip() == line
    assert done.stdout == "" and not (tmp_path / "run").exists(), "nothing was written or launched"


def test_options_the_recipe_takes_pass_after_the_separator(tmp_path):
    done = adaptive("launch", RECIPE, "--gpu", "a100", "--run-dir", str(tmp_path), "--dry-run", "--",
                    "--dry-run", "--max-steps", "5", "--resume")
    assert done.returncode == 0, done.stderr
    assert "--dry-run --max-steps 5 --resume" in done.stdout  # as given, at the end of the recipe's command
