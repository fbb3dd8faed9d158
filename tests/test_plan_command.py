"""tofu-plan: plans a builder's model, writes JSON, HTML and PNG, reuses cached plans, and
refuses bad input in one line."""

import html.parser
import io
import json
import logging
import os
import re
import subprocess
import sys

import pytest
from absl import flags

import tofu_tf.search
from tofu_tf import plan_command
from tofu_tf.plan import Plan

TINY_MLP = {"input_dim": 16, "width": 32, "depth": 2, "num_classes": 8}
TINY_GPT = {"num_layers": 1, "d_model": 16, "num_heads": 2, "seq_len": 8, "vocab_size": 32}


@pytest.fixture
def searches(monkeypatch):
    """The plan_graph calls made, in order (each one is a search)."""
    calls = []
    real = tofu_tf.search.plan_graph

    def counted(graph, **options):
        calls.append(options["method"])
        return real(graph, **options)
    monkeypatch.setattr(tofu_tf.search, "plan_graph", counted)
    return calls


def _request(tmp_path, **changes):
    fields = dict(model="tofu_tf.models:mlp", model_kwargs=TINY_MLP, num_devices=4, hardware="cpu-virtual",
                  cache_dir=str(tmp_path / "cache"))
    return plan_command.PlanRequest(**{**fields, **changes})


def _page_text(path) -> list[str]:
    text = []
    parser = html.parser.HTMLParser()
    parser.handle_data = lambda data: text.append(data.strip())
    parser.feed(path.read_text(encoding="utf-8"))
    parser.close()
    return text


def test_a_second_run_takes_every_plan_from_the_cache(tmp_path, searches):
    outputs = dict(json_path=str(tmp_path / "plan.json"), html_path=str(tmp_path / "plan.html"),
                   png_path=str(tmp_path / "plan.png"))
    request = _request(tmp_path, compare=("data_parallel", "megatron"), **outputs)
    out = io.StringIO()
    first = plan_command.run(request, out)
    assert searches == ["tofu", "data_parallel", "megatron"] and not first.from_cache
    assert "kept in the plan cache" in out.getvalue() and "Side by side:" in out.getvalue()
    plan = Plan.from_file(tmp_path / "plan.json")
    assert plan == first.plan
    assert set(plan.variable_layouts) <= set(_page_text(tmp_path / "plan.html"))
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    out = io.StringIO()
    again = plan_command.run(_request(tmp_path, compare=("data_parallel", "megatron")), out)
    assert searches == ["tofu", "data_parallel", "megatron"]          # no new search
    assert again.from_cache and again.plan == first.plan and again.comparison == first.comparison
    assert "Plan taken from the plan cache (no search)." in out.getvalue()


def test_no_cache_searches_every_time_and_leaves_the_cache_alone(tmp_path, searches):
    for _ in range(2):
        outcome = plan_command.run(_request(tmp_path, use_cache=False), io.StringIO())
        assert not outcome.from_cache
    assert searches == ["tofu", "tofu"] and not (tmp_path / "cache").exists()


def test_the_side_by_side_table_keeps_its_columns_apart(tmp_path):
    outcome = plan_command.run(_request(tmp_path, compare=("megatron",), use_cache=False), io.StringIO())
    lines = plan_command.comparison_table(outcome).splitlines()
    assert lines[0].split() == ["method", "mesh", "step", "ms", "comm", "MiB", "peak", "MiB", "fits"]
    assert [line.split()[0] for line in lines[1:]] == ["tofu", "megatron"]
    rows = [re.fullmatch(r"  (\S+) {2,}(\S.*?) {2,}(\S+) +(\S+) +(\S+) {2,}(yes|no)", line) for line in lines[1:]]
    assert all(rows), lines
    assert rows[0].group(1, 2) == ("tofu", " x ".join(f"{n}={s}" for n, s in outcome.plan.mesh_axes))
    header = lines[0]
    ends = tuple(header.index(head) + len(head) for head in ("step ms", "comm MiB", "peak MiB", "fits"))
    assert all(tuple(row.end(i) for i in (3, 4, 5, 6)) == ends for row in rows)      # cells under their heads


def test_a_method_that_gives_no_plan_is_listed_with_its_reason(tmp_path, monkeypatch):
    from tofu_tf.search.baselines import BaselineNotApplicableError
    real = tofu_tf.search.plan_graph

    def no_megatron(graph, **options):
        if options["method"] == "megatron":
            raise BaselineNotApplicableError("no Dense chain to split\n(as a test says)")
        return real(graph, **options)
    monkeypatch.setattr(tofu_tf.search, "plan_graph", no_megatron)
    out = io.StringIO()
    outcome = plan_command.run(_request(tmp_path, compare=("megatron",), use_cache=False,
                                        html_path=str(tmp_path / "plan.html")), out)
    assert outcome.comparison == {"megatron": "no Dense chain to split (as a test says)"}
    assert "  megatron  no plan: no Dense chain to split (as a test says)" in out.getvalue().splitlines()
    assert "no plan: no Dense chain to split (as a test says)" in _page_text(tmp_path / "plan.html")


def _execute(*argv):
    flag_values = flags.FlagValues()
    plan_command.define_flags(flag_values)
    flag_values(["tofu-plan", *argv])
    out, err = io.StringIO(), io.StringIO()
    status = plan_command.execute(flag_values, out, err)
    return status, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("argv, message", [
    (["--model=no_such_module:build"], r"no module named 'no_such_module': give an importable module"),
    (["--model=tofu_tf.models:nope"], r"module 'tofu_tf.models' has no function 'nope'; its functions are .*gpt"),
    (["--model=tofu_tf.models"], r"--model='tofu_tf.models' is not MODULE:FUNCTION"),
    (["--model=tofu_tf.models:mlp", "--model_kwargs={\"depth\": \"two\"}"],
     r"tofu_tf.models:mlp\(\*\*\{'depth': 'two'\}\) failed: TypeError: .* Fix --model_kwargs or the builder"),
    (["--model=tofu_tf.models:mlp", "--model_kwargs=[1]"], r"--model_kwargs is a JSON list; pass an object"),
    (["--model=tofu_tf.models:_keras", "--model_kwargs={\"keras\": null}"],
     r"tofu_tf.models:_keras returned a module, not a Keras model"),
    (["--model=tofu_tf.models:mlp", "--mesh=2xfour"], r"--mesh='2xfour' does not read"),
    (["--model=tofu_tf.models:mlp", "--compare=zero"], r"--compare names zero; the methods are tofu, ilp"),
    (["--model=tofu_tf.models:mlp", "--hardware=tpu"], r"unknown hardware profile 'tpu'"),
    ([], r"--model is required"),
])
def test_bad_input_is_one_line_and_exit_status_2(argv, message, tmp_path):
    status, out, err = _execute(*argv, f"--cache_dir={tmp_path}")
    assert status == plan_command.EXIT_BAD_INPUT and out == ""
    assert err.count("\n") == 1 and err.startswith("tofu-plan: error: ")
    assert re.search(message, err), err


def test_a_budget_no_plan_meets_is_one_line_naming_the_remedy(tmp_path):
    status, _, err = _execute("--model=tofu_tf.models:mlp", f"--model_kwargs={json.dumps(TINY_MLP)}",
                              "--num_devices=2", "--memory_budget_gib=0.000001", "--no_cache")
    assert status == plan_command.EXIT_BAD_INPUT and err.count("\n") == 1
    assert "no plan fits the memory budget of 1.05 KiB per device" in err and "larger budget" in err


def test_a_long_search_says_how_much_is_left(caplog):
    from tofu_tf.search.progress import SearchProgress
    now = [0.0]
    progress = SearchProgress(4, quiet_seconds=5.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="absl"):
        for seconds in (6.0, 12.0, 18.0, 24.0):
            now[0] = seconds
            progress.axis_solved("a0=2 x a1=4", 1, 2, 4, 12, True, 6.0)
    messages = [r.getMessage() for r in caplog.records if "tofu_tf planner" in r.getMessage()]
    assert "1 of 4 axis problems solved, about 18 s to go, 6.0 s so far" in messages[0]
    assert "3 of 4 axis problems solved, about 6 s to go" in messages[2]
    assert "4 of 4 axis problems solved, 24.0 s so far" in messages[3]


# -- the installed command, as a user runs it: a fresh process in another directory ----------

def _tofu_plan(tmp_path, *argv):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TOFU_PLAN_CACHE"] = str(tmp_path / "cache")
    return subprocess.run([sys.executable, "-m", "tofu_tf.plan_command", *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.slow   # runs tofu-plan in a fresh Python
def test_the_command_writes_json_html_png_and_reuses_its_plan(tmp_path):
    argv = ["--model=tofu_tf.models:gpt", f"--model_kwargs={json.dumps(TINY_GPT)}", "--num_devices=4",
            "--batch_size=8", "--hardware=cpu-virtual", "--compare=megatron", "--json=plan.json",
            "--html=plan.html", "--png=plan.png"]
    done = _tofu_plan(tmp_path, *argv)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Plan (tofu, objective time) on mesh" in done.stdout and "kept in the plan cache" in done.stdout
    assert "tofu_tf plan cache: plan searched in" in done.stderr          # INFO shows by default
    plan = Plan.from_file(tmp_path / "plan.json")
    text = _page_text(tmp_path / "plan.html")
    assert all(path in text for path in plan.variable_layouts)
    assert "Adam/v/block_0_attn/query/kernel" in text
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    again = _tofu_plan(tmp_path, *argv[:-3], "--json=again.json")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Plan taken from the plan cache (no search)." in again.stdout
    assert Plan.from_file(tmp_path / "again.json") == plan


@pytest.mark.slow   # runs tofu-plan in a fresh Python
def test_the_command_exits_2_on_a_module_it_cannot_import(tmp_path):
    done = _tofu_plan(tmp_path, "--model=my_missing_models:build")
    assert done.returncode == plan_command.EXIT_BAD_INPUT
    assert done.stderr.strip().splitlines()[-1] == (
        "tofu-plan: error: no module named 'my_missing_models': give an importable module (run from its "
        "directory, or set PYTHONPATH) or a .py file's path.")


@pytest.mark.slow   # plans, then trains two steps in a measuring child process
def test_measure_shows_what_dtensor_executed_beside_the_model(tmp_path, monkeypatch):
    """``--measure`` trains the plan's step (a tf-keras GPT, data parallel on 8 virtual CPUs)
    and reads DTensor's program: each collective kind's executed bytes beside the modeled ones,
    the collectives after lowering and the state as placed, in the summary, the JSON and the page.
    The GPT's embedding gradient is gathered (tf-keras deduplicates it with ``tf.unique``), so the
    step has an all-gather as well as all-reduces, each executed as modeled."""
    # The measuring run is a fresh process: as a user's, with DTensor's all-reduce combining on
    # (tests/conftest.py switches it off for this process's pipeline tests).
    monkeypatch.delenv("DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION", raising=False)
    out = io.StringIO()
    request = _request(tmp_path, model="tofu_tf.models:gpt", model_kwargs={"num_layers": 2, "seq_len": 32,
                                                                         "vocab_size": 256},
                       num_devices=8, batch_size=16,
                       use_cache=False, measure=True, json_path=str(tmp_path / "plan.json"),
                       html_path=str(tmp_path / "plan.html"))
    plan = plan_command.run(request, out).plan
    assert plan.mesh_shape == {"batch": 8}, plan.summary()        # the premise: bench/executed.py's GPT plan
    figures = plan.executed
    assert figures is not None and set(figures.collectives) == {"all-reduce", "all-gather"}, figures
    for kind, (count, nbytes) in figures.collectives.items():
        assert count > 0 and nbytes == pytest.approx(plan.comm_by_collective[kind].bytes, rel=0.02), kind
    assert 0 < figures.lowered_count < figures.collectives["all-reduce"][0]       # DTensor combined them
    assert figures.state_bytes == plan.memory.weight_bytes + plan.memory.optimizer_slot_bytes
    lines = out.getvalue().splitlines()
    assert any(line.split()[:2] == ["executed", "(measured)"] for line in lines), out.getvalue()
    assert any(line.split()[0] == "all-gather" and line.split()[-1] == "0%" for line in lines
               if line.startswith("  all-gather") and len(line.split()) == 5), out.getvalue()
    assert Plan.from_file(tmp_path / "plan.json").executed == figures
    assert "executed (measured): DTensor's program against the model" in _page_text(tmp_path / "plan.html")


def test_a_measuring_run_that_fails_is_one_line_naming_the_model(tmp_path, monkeypatch):
    """A model the measuring run cannot train ends in the command's one-line error, exit 2."""
    from tofu_tf import executed

    def failed(plan, request, **kwargs):
        raise executed.MeasurementError(f"the measuring run of {request['model']} failed (exit 1); the end of "
                                        "its log:\nTraceback ...\nValueError: as a test says")
    monkeypatch.setattr(executed, "measure", failed)
    status, out, err = _execute("--model=tofu_tf.models:mlp", f"--model_kwargs={json.dumps(TINY_MLP)}",
                                "--num_devices=4", "--hardware=cpu-virtual", "--measure", f"--cache_dir={tmp_path}")
    assert status == plan_command.EXIT_BAD_INPUT and out == ""
    assert err.count("\n") == 1 and "the measuring run of tofu_tf.models:mlp failed" in err
