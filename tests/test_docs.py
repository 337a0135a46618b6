"""
The docs stay true: every `python grpo.py ...` / `torchrun ... grpo.py ...` command in README.md and docs/*.md
parses with the real flags and passes the whole-config checks, and every relative link points at a file.
"""
import ast
import glob
import os
import re
import shlex
import subprocess
import sys

import pytest

import grpo
from conftest import ROOT

DOCS = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
SHELL_VARIABLES = {"seed": "0", "algo": "grpo", "run": "single", "attempts": "3"}  # the values the docs' loops take


def commands(path):
    """-> [(line number, command)]: grpo.py command lines in code blocks, and in inline code (which may wrap)."""
    pieces, prose, in_block, pending = [], [], False, ""
    for number, line in enumerate(open(path, encoding="utf-8"), 1):
        if line.lstrip().startswith("```"):
            in_block = not in_block
        elif in_block:
            line = pending + line.split(" #")[0].strip()
            pending = line[:-1] + " " if line.endswith("\\") else ""  # a command continued on the next line
            if not pending:
                pieces.append((number, line))
        else:
            prose.append((number, line))
    text = "".join(line for _, line in prose)
    starts = [0]
    for _, line in prose:
        starts.append(starts[-1] + len(line))
    for span in re.finditer(r"`([^`]+)`", text):
        number = prose[max(i for i, start in enumerate(starts[:-1]) if start <= span.start())][0]
        pieces.append((number, span[1].replace("\n", " ")))
    found = []
    for number, piece in pieces:
        for part in re.split(r";|&&|\|", piece):
            command = re.search(r"\b(python3? |torchrun ).*\bgrpo\.py\b.*", part)
            if command:
                found.append((number, command[0].strip()))
    return sorted(found)


def grpo_argv(command):
    """The flags a command gives grpo.py: shell variables set, <placeholders> filled, `...` (more flags) dropped."""
    command = re.sub(r"\$(\w+)", lambda m: SHELL_VARIABLES[m[1]], command)
    command = re.sub(r"<[^<>]*>", "X", command)
    words = [w for w in shlex.split(command) if w != "..."]
    return words[words.index("grpo.py") + 1:]


def check(command):
    """Raise AssertionError when grpo.py refuses the command's flags."""
    try:
        grpo.resolve_config(grpo_argv(command))
    except SystemExit as e:
        if e.code == 0:  # --help
            return
        raise AssertionError(f"grpo.py refuses `{command}` (exit {e.code})") from None


ALL = [(os.path.relpath(path, ROOT), number, command) for path in DOCS for number, command in commands(path)]


def test_the_docs_hold_commands():
    assert len(ALL) > 15 and any(path == "README.md" and "torchrun" in command for path, _, command in ALL)


@pytest.mark.parametrize("path,line,command", ALL, ids=[f"{p}:{n}" for p, n, _ in ALL])
def test_a_documented_command_parses_and_passes_the_config_checks(path, line, command):
    check(command)


def test_the_example_files_the_docs_name_ship_with_the_repository():
    # the docs' own-task commands run as written from the repository's folder: the task file and grader function
    # they name are in docs/examples/ (tests/test_own_tasks.py runs the README's on them)
    named = {(path, re.sub(r"\.py:\w+$", ".py", word)) for path, _, command in ALL
             for word in re.findall(r"docs/examples/[\w./:-]+", command)}
    assert {"README.md", os.path.join("docs", "tasks.md")} <= {path for path, _ in named}
    missing = [(path, word) for path, word in named if not os.path.isfile(os.path.join(ROOT, word))]
    assert not missing


def test_a_misspelt_or_inconsistent_flag_fails_the_check():
    check("python grpo.py --demo --num-steps 3")
    for bad in ("python grpo.py --demo --num-stepz 3", "torchrun --nproc_per_node=8 grpo.py --kl-estimator k4",
                "python grpo.py --lora-rank 4 --init scratch"):
        with pytest.raises(AssertionError, match="refuses"):
            check(bad)


@pytest.mark.parametrize("path", DOCS, ids=[os.path.relpath(p, ROOT) for p in DOCS])
def test_relative_links_point_at_files(path):
    text = open(path, encoding="utf-8").read()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        assert os.path.exists(os.path.join(os.path.dirname(path), target.split("#")[0])), f"{path}: {target}"


def test_no_line_of_the_trainer_is_over_120_characters():
    sources = [os.path.join(ROOT, name) for name in ("grpo.py", "model.py")] + glob.glob(os.path.join(ROOT, "tasks",
                                                                                                      "*.py"))
    long_lines = [f"{os.path.relpath(path, ROOT)}:{number}" for path in sources
                  for number, line in enumerate(open(path, encoding="utf-8"), 1) if len(line.rstrip("\n")) > 120]
    assert not long_lines


def test_no_prose_line_of_the_readme_is_over_120_characters():
    # tables and code blocks aside: a table row is one line, a command is copied whole
    lines, in_code, long_lines = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read().splitlines(), False, []
    for number, line in enumerate(lines, 1):
        in_code ^= line.startswith("```")
        if not in_code and not line.startswith(("|", "```")) and len(line) > 120:
            long_lines.append(number)
    assert not long_lines


def test_help_shows_each_flags_own_default():
    text = grpo.parser.format_help()
    assert "replies per question (the group size G) (default: 16)" in text and "(default: None)" not in text


def words(text):
    """The help's text, whatever the width it was laid out in (a terminal's, a Python version's): argparse breaks
    lines at spaces and after hyphens."""
    return "".join(text.split())


def test_the_flags_text_is_what_help_prints():
    # `python grpo.py --help` prints docs/flags.txt before torch loads: it must be the parser's own text
    with open(os.path.join(ROOT, "docs", "flags.txt"), encoding="utf-8") as f:
        assert words(f.read()) == words(grpo.parser.format_help()), (
            "docs/flags.txt is not --help's text: write it anew with COLUMNS=102 python -c \"import grpo; "
            "open('docs/flags.txt', 'w').write(grpo.parser.format_help())\"")


def test_help_prints_the_flags_without_importing_torch():
    done = subprocess.run([sys.executable, "-X", "importtime", "grpo.py", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time")]
    assert done.returncode == 0 and words(done.stdout) == words(grpo.parser.format_help())
    assert imported and not any(name.split(".")[0] == "torch" for name in imported)


def help_of(flag):
    """The help text of one flag, as --help prints it (whitespace joined)."""
    action = next(a for a in grpo.parser._actions if flag in a.option_strings)
    return " ".join(grpo.HelpFormatter("grpo.py")._get_help_string(action).split()) % vars(action)


@pytest.mark.parametrize("flag", ["--seed", "--entropy-coef", "--weight-decay", "--grad-clip", "--warmup-steps",
                                  "--min-lr-frac", "--lora-rank"])
def test_help_shows_a_default_of_zero(flag):
    assert help_of(flag).endswith(("(default: 0)", "(default: 0.0)")), help_of(flag)


def test_help_says_what_the_seed_seeds_and_what_the_kl_in_the_reward_does_to_equal_groups():
    seed = help_of("--seed")
    assert "sampling" in seed and "every epoch but the first" in seed and "fixed order" in seed
    placement = help_of("--kl-placement")
    assert "all-equal group" in placement and all(kind in placement for kind in ("mean", "rloo", "batch", "zscore"))


def test_the_algorithm_section_stays_one_read():
    # grpo.py above its banner is what a learner reads first: at most 350 lines of code (docstrings, comments and
    # blank lines not counted), the update loop at most 60 lines, setting a run up in steps of at most 85
    source = open(os.path.join(ROOT, "grpo.py"), encoding="utf-8").read()
    lines, tree = source.splitlines(), ast.parse(source)
    docstrings = {n for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.Module)) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
                  for n in range(node.body[0].lineno - 1, node.body[0].end_lineno)}
    start = next(i for i, line in enumerate(lines) if line.startswith("def group_advantages"))
    banner = next(i for i, line in enumerate(lines) if line.startswith("# ====="))
    code = [i for i in range(start, banner) if lines[i].strip() and not lines[i].lstrip().startswith("#")
            and i not in docstrings]
    assert len(code) <= 350
    assert start < 120 and not any(line.startswith("arg(") for line in lines[:banner])  # it opens with the algorithm
    # a file that handles OS signals has one `signal`: the module
    assert not [node for node in ast.walk(tree) if isinstance(node, (ast.arg, ast.keyword)) and node.arg == "signal"
                or isinstance(node, ast.Name) and node.id == "signal" and not isinstance(node.ctx, ast.Load)]
    length = {node.name: node.end_lineno - node.lineno + 1 for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert length["policy_update"] <= 60
    # a learner reaches the update loop early: the core terms, a step in the order it runs, then the variants
    where = {node.name: node.lineno for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert where["policy_update"] <= 400
    assert all(where[name] > where["train"] for name in ("term_advantages", "std_over_ranks", "cispo_policy_loss",
                                                          "sapo_policy_loss", "sampled_teacher_advantages",
                                                          "forward_kl", "kl_reward_penalty", "pass_normalisers"))
    assert all(length[name] <= 85 for name in ("start_run", "start_process", "read_tasks", "build_models",
                                               "record_inputs"))


def imported_modules(path):
    tree = ast.parse(open(path, encoding="utf-8").read())
    return {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
            for alias in node.names} | {node.module.split(".")[0] for node in ast.walk(tree)
                                        if isinstance(node, ast.ImportFrom) and node.module}


def test_the_boundary_model_is_nanochat_grpo_is_what_grpo_adds_tasks_are_tasks():
    # model.py imports nothing of the project; tasks/ may import model.py, never grpo.py; nanochat's optimizers live
    # beside its GPT: no optimizer class in grpo.py
    project = {"grpo", "model", "tasks"}
    assert not imported_modules(os.path.join(ROOT, "model.py")) & project
    for path in glob.glob(os.path.join(ROOT, "tasks", "*.py")):
        assert "grpo" not in imported_modules(path), path
    tree = ast.parse(open(os.path.join(ROOT, "grpo.py"), encoding="utf-8").read())
    classes = [node for node in tree.body if isinstance(node, ast.ClassDef)]
    assert not [c.name for c in classes if any("Optimizer" in ast.unparse(base) for base in c.bases)]


def test_a_flag_is_declared_once_with_its_role():
    # every flag goes through declare (its role and idle conditions with its type, default and help), and no table
    # of flag names stands beside the parser: resume's, evaluation's and --compare's sets are derived (flags_with)
    dests = {a.dest for a in grpo.parser._actions if a.option_strings and a.dest != "help"}
    assert dests == set(grpo.ROLES) == set(grpo.IDLE)
    tree = ast.parse(open(os.path.join(ROOT, "grpo.py"), encoding="utf-8").read())
    tables = [node.targets[0].id for node in tree.body if isinstance(node, ast.Assign)
              and isinstance(node.targets[0], ast.Name) and isinstance(node.value, (ast.Tuple, ast.List))
              and len(node.value.elts) > 1 and all(isinstance(e, ast.Constant) and e.value in dests
                                                   for e in node.value.elts)]
    assert not tables
    assert grpo.flags_with("sampling") == ("num_samples", "max_new_tokens", "temperature", "top_k", "seed")
    # what config.json leaves out is a role too, not a list beside start_run
    assert set(grpo.flags_with("unrecorded")) == {"resume", "eval_only", "ask", "wandb", "compare", "compare_out",
                                                  "show_config"}
    assert "compare_out" not in ast.unparse(next(node for node in tree.body if isinstance(node, ast.FunctionDef)
                                                 and node.name == "start_run"))


def test_the_readmes_two_install_commands_give_the_plots_and_ci_installs_what_they_install():
    # every output the README shows, curves.png and --compare's figure included, from its install block alone
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    block = text[text.index("## Install"):].split("```")[1]
    installs = [line.split() for line in block.strip().splitlines() if line.startswith("pip ")]
    assert len(installs) <= 2 and all(words[:2] == ["pip", "install"] for words in installs)
    packages = {word for words in installs for word in words[2:] if not word.startswith("-") and "://" not in word}
    assert {"torch", "requirements.txt", "matplotlib", "pytest", "pytest-xdist"} <= packages
    ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
    assert all(package in ci for package in packages - {"torch"})  # CI: the CPU torch it pins, and the rest


def test_help_says_its_defaults_are_a_gsm8k_runs_and_where_the_demos_are(capsys):
    with pytest.raises(SystemExit):
        grpo.resolve_config(["--help"])
    assert "python grpo.py --demo --help shows the demo's" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        grpo.resolve_config(["--demo", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "--num-samples NUM_SAMPLES replies per question (the group size G) (default: 8)" in shown  # not GSM8K's 16


def test_each_file_stays_within_its_size():
    # nano: grpo.py within 3,000 lines, model.py within 2,000, tasks/ within 1,300 (comments and docstrings counted);
    # no function of grpo.py over 70 lines, model.py's generate within 100
    def lines(path):
        return sum(1 for _ in open(os.path.join(ROOT, path), encoding="utf-8"))
    assert lines("grpo.py") <= 3000 and lines("model.py") <= 2000
    assert sum(lines(os.path.relpath(p, ROOT)) for p in glob.glob(os.path.join(ROOT, "tasks", "*.py"))) <= 1300
    for path, most in (("grpo.py", 70), ("model.py", None)):
        tree = ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read())
        length = {n.name: n.end_lineno - n.lineno + 1 for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert most is None or max(length.values()) <= most, sorted(length.items(), key=lambda kv: -kv[1])[:3]
    assert length["generate"] <= 100


def test_a_misspelt_role_is_refused_where_the_flag_is_declared():
    arg = grpo.declare(grpo.argparse.ArgumentParser().add_argument_group("g"))
    with pytest.raises(AssertionError, match="--foo-coef: role 'observe'"):
        arg("--foo-coef", type=float, role="observe")
