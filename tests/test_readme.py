"""README's quickstart holds exactly two set-up commands, and CI runs the test command verbatim; the sample output
is what the command prints; every example command runs and exits as the README says."""

import json
import re
import shlex
import subprocess
import sys

from tests.conftest import REPO_ROOT, subprocess_env


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


def test_the_quickstart_runs_the_quick_subset():
    assert quickstart_commands()[1].endswith('pytest -q -n 2 --dist loadfile -m "not slow"')


SLOW_REST = ".venv/bin/python -m pytest -q -n 2 --dist loadfile -m slow"


def test_ci_runs_the_readme_test_command_and_then_the_rest_of_the_full_suite():
    lines = [line for line in (REPO_ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    quick = lines.index(quickstart_commands()[1])
    assert lines[quick + 1] == SLOW_REST  # "not slow", then "slow": every test once
    assert "`-m slow`" in readme_text()


# --- every example command in the README runs as documented ---------------------------------------------------------

SAMPLE_BLOCK = re.compile(r"```console\n\$ (adaptive [^\n]*)\n(.*?)\n```", flags=re.S)
TRAINING_COMMANDS = ("measure", "report", "scale")  # they need the training install: here checked through --help


def readme_text() -> str:
    return (REPO_ROOT / "README.md").read_text()


def example_lines(prefix: str) -> list[str]:
    """Lines of the README's bash blocks that start with `prefix`, outside the Quickstart (tested above);
    a line ending in backslash is joined with the next."""
    text = readme_text()
    quick = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    lines = []
    for block in re.findall(r"```bash\n(.*?)\n```", text.replace(quick, ""), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.startswith(prefix):
                lines.append(line)
    return lines


def split_comment(line: str) -> tuple[list[str], int]:
    """The command's arguments and its documented exit code (a comment saying `exits N`, else 0)."""
    command, _, comment = line.partition("#")
    exits = re.search(r"\bexits (\d)", comment)
    return shlex.split(command), int(exits.group(1)) if exits else 0


def test_the_sample_outputs_are_what_the_commands_print():
    """The first sample does not fit (exit 1, as README says under it); the budget's answer exits 0; the 4090's full
    fine-tune does not fit (exit 1) and offers LoRA and QLoRA."""
    samples = SAMPLE_BLOCK.findall(readme_text())
    assert [c.split()[1:3] for c, _ in samples] == [["fit", "--model"], ["fit", "--budget-usd"], ["fit", "--model"]]
    assert "--finetune full" in samples[2][0]
    for (command, shown), code in zip(samples, (1, 0, 1)):
        done = subprocess.run([sys.executable, "-m", "cli", *shlex.split(command)[1:]], capture_output=True,
                              text=True, env=subprocess_env(), timeout=120, cwd=REPO_ROOT)
        assert done.returncode == code, done.stderr
        printed = "\n".join(line.rstrip() for line in done.stdout.rstrip("\n").splitlines())
        assert printed == shown, f"README's sample of {command!r} is out of date: paste the command's output again"


def test_every_adaptive_command_in_the_readme_exits_as_documented(tmp_path, monkeypatch, capsys):
    from cli.main import run

    lines = example_lines("adaptive ")
    assert len(lines) >= 12 and {split_comment(line)[0][1] for line in lines} >= {
        "fit", "compare", "models", "gpus", "launch", "export", "measure", "report"}
    monkeypatch.chdir(tmp_path)  # runs/, plans/ and the hostfile land here
    (tmp_path / "recipes").symlink_to(REPO_ROOT / "recipes")
    (tmp_path / "examples").symlink_to(REPO_ROOT / "examples")  # config.json files of downloaded checkpoints
    (tmp_path / "hosts").write_text("node-a slots=8\nnode-b slots=8\n")
    for line in lines:
        args, exits = split_comment(line)
        args = args[1:]
        if args[0] in TRAINING_COMMANDS:
            args = [args[0], "--help"]
        elif args[0] == "launch" and "--dry-run" not in args:
            args.append("--dry-run")  # plan, write and print the command; start nothing
        assert run(args) == exits, (line, capsys.readouterr())
        capsys.readouterr()


def test_every_training_command_in_the_readme_names_a_recipe_and_valid_flags():
    from adaptive.config.commandline import parse
    from adaptive.config.run import TRAIN

    lines = example_lines("accelerate launch") + example_lines("python recipes/")
    assert len(lines) >= 6
    for line in lines:
        args, _ = split_comment(line)
        recipe = next(a for a in args if a.startswith("recipes/") and a.endswith(".py"))
        assert (REPO_ROOT / recipe).is_file(), line
        flags = [a for a in args[args.index(recipe) + 1:] if a != "--dry-run"]  # --dry-run: the recipe's own
        parse(TRAIN, flags)  # every flag exists and its value is valid


def test_a_recipes_dry_run_in_the_readme_prints_its_plan():
    line, = example_lines("python recipes/")
    args, exits = split_comment(line)
    done = subprocess.run([sys.executable, *args[1:]], capture_output=True, text=True, env=subprocess_env(),
                          timeout=300, cwd=REPO_ROOT)
    assert done.returncode == exits, done.stderr
    assert json.loads(done.stdout)["plan"]["fits"] is True


def test_the_use_the_trained_model_example_runs_on_a_runs_export(tmp_path, monkeypatch, capsys):
    """README's "Use the trained model" code, as written, on the export a debug MoE run leaves (mixtral format,
    with the built-in tokenizer)."""
    import torch

    from adaptive.models import AdaptiveConfig, AdaptiveForCausalLM
    from adaptive.models.export import export_pretrained
    from adaptive.train.data.tokenizer import load_tokenizer

    section = readme_text().split("### Use the trained model", 1)[1].split("\n### ", 1)[0]
    code, = re.findall(r"```python\n(.*?)\n```", section, flags=re.S)
    monkeypatch.setenv("ADAPTIVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    folder = tmp_path / "runs" / "debug_moe" / "hf"
    export_pretrained(AdaptiveForCausalLM(AdaptiveConfig.from_preset("debug", arch="moe")), folder, "mixtral")
    load_tokenizer(None).save_pretrained(folder)
    (tmp_path / "my_text.txt").write_text("Patience, n. A minor form of despair, disguised as a virtue. " * 40)

    exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})
    generated, perplexity = capsys.readouterr().out.strip().splitlines()[-2:]
    assert generated.startswith("The devil is") and len(generated) > len("The devil is")
    words = perplexity.split()
    assert words[0] == "perplexity" and 1 < float(words[1]) < 10 * 2048, perplexity  # untrained: about the vocab


def test_readme_documents_every_option_of_launchs_own():
    """Launch's Slurm options (never handed to a recipe) are in the table of README's `adaptive launch` section."""
    from adaptive.config.run import LAUNCH_ONLY, run_fields

    section = readme_text().split("### `adaptive launch`", 1)[1].split("\n### ", 1)[0]
    options = {flag.name for _, _, flag in run_fields() if flag.commands == LAUNCH_ONLY}
    assert {"--scheduler", "--submit", "--time", "--requeue"} <= options
    missing = {o for o in options if f"| `{o}" not in section and f", `{o}`" not in section}
    assert not missing, f"README's launch options table misses {sorted(missing)}"


def finetune_table_rows() -> list[str]:
    """README's table of what each fine-tuning method costs on one RTX 4090, planned again."""
    from adaptive.plan import fit, make_request
    from adaptive.plan.compare import why_not
    from adaptive.plan.search.planner import describe

    rows = []
    for method in ("full", "lora", "qlora"):
        p = fit(make_request(model=str(REPO_ROOT / "examples" / "llama-3.1-8b" / "config.json"), gpu="rtx4090",
                             finetune=method), suggest=False)
        kind, _ = why_not(p)
        fits = "yes" if p.fits else {"host_ram": "no (host RAM)", "gpu_memory": "no"}.get(kind, "no")
        plan = describe(p.shown).rsplit(", peak", 1)[0]
        t = p.shown.throughput
        rows.append(f"| {method} | {fits} | {p.shown.memory.peak_gpu_bytes / 2**30:.2f} GiB | {plan} | "
                    f"{t.tokens_per_second:,.0f} | {p.hours:.1f} h | ${p.cost:,.2f} |")
    return rows


def test_the_finetune_cost_table_is_what_fit_plans():
    section = readme_text().split("### Fine-tune a model you downloaded", 1)[1].split("\n### ", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("| full |") or line.startswith("| lora |")
             or line.startswith("| qlora |")]
    assert table == finetune_table_rows(), "README's fine-tune table is out of date: paste finetune_table_rows()"
