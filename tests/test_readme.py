"""README's quickstart holds exactly two set-up commands, and CI runs the test command verbatim."""

import re

from tests.conftest import REPO_ROOT


def quickstart_commands() -> list[str]:
    text = (REPO_ROOT / "README.md").read_text()
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", section, flags=re.S)


def test_quickstart_has_two_commands_fit_and_tests():
    commands = quickstart_commands()
    assert len(commands) == 2 and all("\n" not in c for c in commands)
    assert commands[0].endswith("adaptive fit --model b7 --gpu a100-40gb")
    assert "pytest" in commands[1] and "torch==2.13.0" in commands[1]
    # torch is installed before anything that would pull a CUDA build of it
    assert commands[1].index("torch==2.13.0") < commands[1].index(".[test]")


def test_ci_runs_the_readme_test_command():
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert quickstart_commands()[1] in ci.splitlines()
