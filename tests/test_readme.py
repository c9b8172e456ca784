"""README's quickstart holds exactly two set-up commands, and CI runs the test command verbatim; the samples in the README
and the docs pages are what the commands print; every example command runs and exits as the pages say; the times
they quote are the one table of them (docs/BENCHMARKS.md, "Expected times").

When an output changes on purpose, `python -m tests.test_readme --update` (from the repository root) writes every
console sample and the RTX 4090 fine-tune table again (docs/testing.md, "The documented samples").
"""

import functools
import json
import re
import shlex
import subprocess
import sys

from tests.conftest import REPO_ROOT, subprocess_env


def quickstart_commands() -> list[str]:
    return re.findall(r"```bash\n(.*?)\n```", section(readme_text(), "Quickstart"), flags=re.S)


def test_quickstart_has_two_commands_fit_and_tests():
    commands = quickstart_commands()
    assert len(commands) == 2 and all("\n" not in c for c in commands)
    assert commands[0].endswith("adaptive fit --model b7 --gpu a100-40gb")
    assert "pytest" in commands[1] and "torch==2.13.0" in commands[1]
    # torch is installed before anything that would pull a CUDA build of it
    assert commands[1].index("torch==2.13.0") < commands[1].index(".[test]")


def test_the_quickstart_runs_the_quick_subset():
    assert quickstart_commands()[1].endswith('pytest -q -n 2 --dist loadfile -m "not slow"')


def test_the_quickstart_comes_first_and_says_once_how_to_activate_the_venv():
    text = readme_text()
    assert text.index("## Quickstart") == text.index("\n## ") + 1, "the Quickstart is the README's first section"
    assert "`source .venv/bin/activate`" in section(text, "Quickstart")
    after = text.split("## Quickstart", 1)[1].split("\n## ", 1)[1]
    assert ".venv/bin/" not in after, "after the Quickstart the README writes commands bare (the venv is active)"


def test_the_docs_home_page_shows_the_quickstarts_commands():
    assert re.findall(r"```bash\n(.*?)\n```", section(page_text("docs/index.md"), "Quickstart"), flags=re.S) == (
        quickstart_commands())
    assert re.findall(r"```bash\n(.*?)\n```", page_text("docs/testing.md"), flags=re.S)[0] == quickstart_commands()[1]


SLOW_REST = ".venv/bin/python -m pytest -q -n 2 --dist loadfile -m slow"


def test_ci_runs_the_readme_test_command_and_then_the_rest_of_the_full_suite():
    lines = [line for line in (REPO_ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    quick = lines.index(quickstart_commands()[1])
    assert lines[quick + 1] == SLOW_REST  # "not slow", then "slow": every test once
    assert "`-m slow`" in readme_text()


# --- the pages: README.md and docs/ ----------------------------------------------------------------------------------

HISTORY = ("docs/BENCHMARKS.md", "docs/DESIGN.md")  # measurements and reasons, dated: no user commands of ours


def pages() -> list[str]:
    """README.md and the docs pages a user reads for commands, relative to the repository root."""
    docs = sorted(f"docs/{p.name}" for p in (REPO_ROOT / "docs").glob("*.md"))
    return ["README.md", *(p for p in docs if p not in HISTORY)]


def page_text(page: str) -> str:
    return (REPO_ROOT / page).read_text()


def readme_text() -> str:
    return page_text("README.md")


def prose_lines(text: str) -> list[tuple[bool, str]]:
    """Each line with whether it is inside a fenced code block (its fences count as inside)."""
    out, code = [], False
    for line in text.splitlines():
        fence = line.startswith("```")
        out.append((code or fence, line))
        code ^= fence
    return out


def section(text: str, title: str) -> str:
    """The body of the section whose heading (any level) is `title`, up to the next heading of that level or above;
    a `#` line inside a code block is no heading."""
    lines = prose_lines(text)
    for i, (code, line) in enumerate(lines):
        heading = re.match(r"(#+) (.*)", line)
        if not code and heading and heading.group(2) == title:
            level = len(heading.group(1))
            end = next((j for j in range(i + 1, len(lines)) if not lines[j][0]
                        and re.match(rf"#{{1,{level}}} ", lines[j][1])), len(lines))
            return "\n".join(line for _, line in lines[i + 1:end])
    raise AssertionError(f"no section {title!r}")


def slug(heading: str) -> str:
    """The #anchor GitHub and mkdocs give a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readmes_links_resolve_on_github():
    """mkdocs checks the links between docs pages; the README's into docs/ and to its own sections are checked here."""
    headings = {page: {slug(line.lstrip("#")) for code, line in prose_lines(page_text(page))
                       if not code and line.startswith("#")} for page in ["README.md", *pages(), *HISTORY]}
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", readme_text()):
        if target.startswith("http"):
            continue
        file, _, anchor = target.partition("#")
        file = file or "README.md"
        if not (REPO_ROOT / file).exists() or (anchor and anchor not in headings.get(file, set())):
            broken.append(target)
    assert not broken, f"README links that do not resolve: {broken}"


# --- the samples: what the commands print ----------------------------------------------------------------------------

SAMPLE_BLOCK = re.compile(r"```console\n\$ (adaptive [^\n]*)\n(.*?)\n```", flags=re.S)
# every sample's command and its exit code: b7 does not fit one A100-40GB (as the README says under it), the budget's
# answer exits 0, the 4090's full fine-tune does not fit and offers LoRA and QLoRA
SAMPLE_EXITS = {
    "adaptive fit --model b7 --gpu a100-40gb": 1,
    "adaptive fit --budget-usd 2000 --gpu h100 --gpus 8": 0,
    "adaptive fit --model examples/llama-3.1-8b/config.json --gpu rtx4090 --finetune full": 1,
}
EXCERPT = "..."  # a sample whose last line is this shows the head of the output
EXCERPT_LINES = 12  # the head's length when a new excerpt holds only the marker


@functools.cache
def printed(command: str) -> tuple[int, str, str]:
    """What `command` prints (trailing spaces dropped), its exit code and stderr."""
    done = subprocess.run([sys.executable, "-m", "cli", *shlex.split(command)[1:]], capture_output=True, text=True,
                          env=subprocess_env(), timeout=120, cwd=REPO_ROOT)
    return done.returncode, "\n".join(line.rstrip() for line in done.stdout.rstrip("\n").splitlines()), done.stderr


def samples() -> list[tuple[str, str, str]]:
    return [(page, command, shown) for page in pages() for command, shown in SAMPLE_BLOCK.findall(page_text(page))]


def test_the_sample_outputs_are_what_the_commands_print():
    found = samples()
    assert {(page, command) for page, command, _ in found} >= {
        ("README.md", "adaptive fit --model b7 --gpu a100-40gb"),
        ("docs/planner.md", "adaptive fit --model b7 --gpu a100-40gb"),
        ("docs/planner.md", "adaptive fit --budget-usd 2000 --gpu h100 --gpus 8"),
        ("docs/finetune.md", "adaptive fit --model examples/llama-3.1-8b/config.json --gpu rtx4090 --finetune full")}
    for page, command, shown in found:
        assert command in SAMPLE_EXITS, f"{page}: a sample of {command!r}, whose exit code SAMPLE_EXITS does not give"
        code, out, err = printed(command)
        assert code == SAMPLE_EXITS[command], err
        lines = shown.splitlines()
        if lines[-1] == EXCERPT:
            shown, out = "\n".join(lines[:-1]), "\n".join(out.splitlines()[:len(lines) - 1])
        assert out == shown, f"{page}'s sample of {command!r} is out of date: python -m tests.test_readme --update"


def updated_samples(text: str) -> str:
    def fresh(match: re.Match) -> str:
        command, shown = match.groups()
        out = printed(command)[1]
        lines = shown.splitlines()
        if lines[-1] == EXCERPT:
            out = "\n".join([*out.splitlines()[:len(lines) - 1 or EXCERPT_LINES], EXCERPT])
        return f"```console\n$ {command}\n{out}\n```"
    return SAMPLE_BLOCK.sub(fresh, text)


# --- every example command in the pages runs as documented -----------------------------------------------------------

TRAINING_COMMANDS = ("measure", "report", "scale")  # they need the training install: here checked through --help


def example_lines(prefix: str) -> list[str]:
    """Lines of the pages' bash blocks that start with `prefix`, outside the Quickstart (tested above); a line
    ending in backslash is joined with the next."""
    lines = []
    for page in pages():
        text = page_text(page)
        if "## Quickstart" in text:
            text = text.replace(section(text, "Quickstart"), "")
        for block in re.findall(r"```bash\n(.*?)\n```", text, flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                if line.startswith(prefix):
                    lines.append(line)
    return lines


def split_comment(line: str) -> tuple[list[str], int]:
    """The command's arguments and its documented exit code (a comment saying `exits N`, else 0)."""
    command, _, comment = line.partition("#")
    exits = re.search(r"\bexits (\d)", comment)
    return shlex.split(command), int(exits.group(1)) if exits else 0


def test_every_adaptive_command_in_the_pages_exits_as_documented(tmp_path, monkeypatch, capsys):
    from cli.main import run

    lines = list(dict.fromkeys(example_lines("adaptive ")))  # each once
    assert len(lines) >= 12 and {split_comment(line)[0][1] for line in lines} >= {
        "fit", "compare", "models", "gpus", "launch", "export", "measure", "report", "scale"}
    monkeypatch.chdir(tmp_path)  # runs/, plans/ and the hostfile land here
    (tmp_path / "recipes").symlink_to(REPO_ROOT / "recipes")
    (tmp_path / "examples").symlink_to(REPO_ROOT / "examples")  # config.json files of downloaded checkpoints
    (tmp_path / "hosts").write_text("node-a slots=8\nnode-b slots=8\n")
    for line in lines:  # a fine-tune's download folder: a tiny Llama with the same name
        args = split_comment(line)[0]
        if "--init-from" in args and not (tmp_path / args[args.index("--init-from") + 1]).exists():
            from tests.train.finetune._checkpoints import write_llama

            write_llama(tmp_path / args[args.index("--init-from") + 1])
    for line in lines:
        args, exits = split_comment(line)
        args = args[1:]
        if args[0] in TRAINING_COMMANDS:
            args = [args[0], "--help"]
        elif args[0] == "launch" and "--dry-run" not in args:
            args.append("--dry-run")  # plan, write and print the command; start nothing
        assert run(args) == exits, (line, capsys.readouterr())
        capsys.readouterr()


def test_every_training_command_in_the_pages_names_a_recipe_and_valid_flags():
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


def test_a_recipes_dry_run_in_the_pages_prints_its_plan():
    line, = set(example_lines("python recipes/"))
    args, exits = split_comment(line)
    done = subprocess.run([sys.executable, *args[1:]], capture_output=True, text=True, env=subprocess_env(),
                          timeout=300, cwd=REPO_ROOT)
    assert done.returncode == exits, done.stderr
    assert json.loads(done.stdout)["plan"]["fits"] is True


def test_the_use_the_trained_model_example_runs_on_a_runs_export(tmp_path, monkeypatch, capsys):
    """docs/training.md's "Use the trained model" code, as written, on the export a debug MoE run leaves (mixtral
    format, with the built-in tokenizer)."""
    import torch

    from adaptive.models import AdaptiveConfig, AdaptiveForCausalLM
    from adaptive.models.export import export_pretrained
    from adaptive.train.data.tokenizer import load_tokenizer

    code, = re.findall(r"```python\n(.*?)\n```", section(page_text("docs/training.md"), "Use the trained model"),
                       flags=re.S)
    monkeypatch.setenv("ADAPTIVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    folder = tmp_path / "runs" / "debug_moe" / "hf"
    export_pretrained(AdaptiveForCausalLM(AdaptiveConfig.from_preset("debug", arch="moe")), folder, "mixtral")
    load_tokenizer(None).save_pretrained(folder)
    (tmp_path / "my_text.txt").write_text("Patience, n. A minor form of despair, disguised as a virtue. " * 40)

    exec(compile(code, "docs/training.md", "exec"), {"__name__": "readme_example"})
    generated, perplexity = capsys.readouterr().out.strip().splitlines()[-2:]
    assert generated.startswith("The devil is") and len(generated) > len("The devil is")
    words = perplexity.split()
    assert words[0] == "perplexity" and 1 < float(words[1]) < 10 * 2048, perplexity  # untrained: about the vocab


def test_the_launch_page_documents_every_option_of_launchs_own():
    """Launch's Slurm options (never handed to a recipe) are in the table of docs/launch.md."""
    from adaptive.config.run import LAUNCH_ONLY, run_fields

    text = page_text("docs/launch.md")
    options = {flag.name for _, _, flag in run_fields() if flag.commands == LAUNCH_ONLY}
    assert {"--scheduler", "--submit", "--time", "--requeue"} <= options
    missing = {o for o in options if f"| `{o}" not in text and f", `{o}`" not in text}
    assert not missing, f"docs/launch.md's options table misses {sorted(missing)}"


# --- the RTX 4090 fine-tune table ------------------------------------------------------------------------------------

FINETUNE_TABLE_PAGES = ("README.md", "docs/finetune.md")


def finetune_table_rows() -> list[str]:
    """The table of what each fine-tuning method costs on one RTX 4090, planned again."""
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


FINETUNE_ROW = re.compile(r"^\| (?:full|lora|qlora) \|.*$", flags=re.M)


def test_the_finetune_cost_table_is_what_fit_plans():
    rows = finetune_table_rows()
    for page in FINETUNE_TABLE_PAGES:
        table = FINETUNE_ROW.findall(section(page_text(page), "Fine-tune a model you downloaded"))
        assert table == rows, f"{page}'s fine-tune table is out of date: python -m tests.test_readme --update"


def updated_finetune_table(text: str, rows: list[str]) -> str:
    body = section(text, "Fine-tune a model you downloaded")
    assert len(FINETUNE_ROW.findall(body)) == len(rows)
    new = iter(rows)
    return text.replace(body, FINETUNE_ROW.sub(lambda _: next(new), body))


# --- the times: one table, quoted nowhere else -----------------------------------------------------------------------

TIMES_PAGE = "docs/BENCHMARKS.md"
# a sentence about one of these (outside code) that states a time must state the table's: (the sentence's subject,
# the table rows it is about)
SUBJECTS = {
    r"quick (subset|suite|tests)|not slow": r"quick subset",
    r"slow (tests|rest|part|ones)|-m slow|full suite": r"slow tests",
    r"adaptive fit": r"^`adaptive fit` \(",
    r"budget-usd|budget search": r"^`adaptive fit --budget-usd",
    r"adaptive scale|default sweep": r"^`adaptive scale",
    r"first (training )?run": r"first training run",
}
# a time, and the word before it that makes it a bound rather than a measurement
DURATION = re.compile(r"(?:\b(at most|under|more than(?: about)?|about) )?"
                      r"(\d[\d,.]*(?:-\d[\d,.]*)? (?:ms|s|min|minutes?|seconds?|h|hours?))\b")


def expected_times() -> list[tuple[str, str]]:
    """docs/BENCHMARKS.md's "Expected times" table: (what, time) per row."""
    rows = [line.split(" | ") for line in section(page_text(TIMES_PAGE), "Expected times").splitlines()
            if line.startswith("| ") and not line.startswith("| what")]
    assert len(rows) >= 6 and all(len(r) == 4 for r in rows)
    return [(r[0].removeprefix("| "), r[1]) for r in rows]


def seconds(figure: str) -> float:
    """The longest time a figure such as "3 min 40 s to 4 min 15 s", "7-15 min" or "140-190 ms" can mean, in seconds."""
    unit_s = {"ms": 1e-3, "s": 1, "min": 60, "h": 3600}

    def longest(part: str) -> float:  # "3 min 40 s": the pieces add up; "7-15 min": the range's end
        return sum(max(float(n.replace(",", "")) for n in number.split("-")) * unit_s[unit]
                   for number, unit in re.findall(r"(\d[\d,.]*(?:-\d[\d,.]*)?) ?(ms|s|min|h)(?:utes?|econds?|ours?)?\b",
                                                  part))
    return max(longest(part) for part in figure.split(" to "))


def stated_times() -> list[tuple[str, str, str, str]]:
    """(page, subject pattern, bound word, figure) for each time a prose sentence of a page states, the subject being
    the one the sentence names last before the time (or first after it)."""
    found = []
    for page in pages() + ["docs/DESIGN.md"]:
        prose = " ".join(line for code, line in prose_lines(page_text(page)) if not code)
        for sentence in re.split(r"(?<=[.;:])\s+(?=[A-Z(`])", prose):
            named = sorted((m.start(), subject) for subject in SUBJECTS
                           for m in re.finditer(subject, sentence, flags=re.I))
            for time in DURATION.finditer(sentence) if named else ():
                before = [subject for at, subject in named if at < time.start()]
                found.append((page, before[-1] if before else named[0][1], time.group(1) or "", time.group(2)))
    return found


def test_the_times_are_one_table_and_the_pages_quote_it():
    table = expected_times()
    wrong = []
    for page, subject, bound, figure in stated_times():
        cells = [time for what, time in table if re.search(SUBJECTS[subject], what, flags=re.I)]
        assert cells, f"no row of {TIMES_PAGE}'s Expected times for {subject!r}"
        if bound.startswith("more than"):  # a threshold, such as the slow marker's
            ok = True
        elif bound in ("at most", "under"):  # a limit the measured times must keep
            ok = max(seconds(c) for c in cells) <= seconds(figure)
        else:
            ok = any(figure in c for c in cells)
        if not ok:
            wrong.append((page, figure, cells))
    assert not wrong, f"times that are not {TIMES_PAGE}'s Expected times (link to it instead): {wrong}"


def test_the_pages_link_the_times_table():
    assert "(docs/BENCHMARKS.md#expected-times)" in readme_text()
    assert "(BENCHMARKS.md#expected-times)" in page_text("docs/testing.md")


def update() -> None:
    """Write the console samples and the RTX 4090 table again, from what the commands print and plan now."""
    rows = finetune_table_rows()
    for page in pages():
        text = page_text(page)
        new = updated_samples(text)
        if page in FINETUNE_TABLE_PAGES:
            new = updated_finetune_table(new, rows)
        if new != text:
            (REPO_ROOT / page).write_text(new)
            print(f"updated {page}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit("usage: python -m tests.test_readme --update   (from the repository root)")
    update()
