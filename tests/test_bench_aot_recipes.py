"""benchmarks/aot_recipes.py's exit code is the recipes of this run's: a row kept in the results file
from an earlier run (a recipe that did not fit then) does not fail a run that compiled others."""

import importlib
import json
import os
import threading

from conftest import REPO


def test_exit_code_counts_only_the_recipes_of_this_run(monkeypatch, tmp_path, capsys):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    aot = importlib.import_module("aot_recipes")
    results = tmp_path / "aot_recipes.json"
    results.write_text(json.dumps({"rows": [{"recipe": "configs/tpu/v5p/256b.sh", "fits": False}]}))
    monkeypatch.setattr(aot, "RESULTS", results)
    monkeypatch.setattr(aot, "_version", lambda package: "0")
    fits = {"v5p/128b": True, "v5p/512b": False}
    monkeypatch.setattr(aot, "compile_recipe", lambda recipe, out: {
        "recipe": str(recipe.relative_to(REPO)), "fits": fits[str(recipe.relative_to(REPO / "configs/tpu"))[:-3]]})

    assert aot.main(["v5p/128b"]) == 0  # was 1: v5p/256b's old row does not fit
    rows = {r["recipe"]: r["fits"] for r in json.loads(results.read_text())["rows"]}
    assert rows == {"configs/tpu/v5p/128b.sh": True, "configs/tpu/v5p/256b.sh": False}  # kept
    assert aot.main(["v5p/512b"]) == 1
    capsys.readouterr()


def test_a_results_file_that_is_not_json_stops_the_run_before_it_compiles(monkeypatch, tmp_path, capsys):
    """A cut-off or conflicted results file (both scripts add their rows to it) is one line and exit 2
    before anything runs; it was a JSONDecodeError traceback after the first recipe's compile."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    for name in ("aot_recipes", "plan_recipes"):
        module = importlib.import_module(name)
        results = tmp_path / f"{name}.json"
        results.write_text('<<<<<<< HEAD\n{"rows": [\n')
        monkeypatch.setattr(module, "RESULTS", results)
        monkeypatch.setattr(module, "compile_recipe" if name == "aot_recipes" else "compare",
                            lambda *a: (_ for _ in ()).throw(AssertionError("ran")))
        try:
            module.main(["v5p/128b"])
        except SystemExit as e:
            assert e.code == 2, name
        else:
            raise AssertionError(f"{name} did not stop")
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"error: {results} is not valid JSON" in err[0], err
        assert results.read_text().startswith("<<<<<<<")  # left as it was


def test_results_are_written_whole_or_not_at_all(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from bench_cli import read_results, write_results

    path = tmp_path / "new" / "r.json"
    write_results(path, {"rows": [1]})
    assert read_results(path, {}) == {"rows": [1]}

    def full_disk(self, text):
        open(self, "w").write(text[:5])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(type(path), "write_text", full_disk)
    try:
        write_results(path, {"rows": [2]})
    except OSError:
        pass
    assert read_results(path, {}) == {"rows": [1]} and [p.name for p in path.parent.iterdir()] == ["r.json"]


def test_results_to_a_pipe_or_a_link_are_written_through_it(monkeypatch, tmp_path):
    """`--out /dev/stdout` (or a pipe) is written into, not replaced by a renamed file; a link keeps
    pointing at its target, which holds the results."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from bench_cli import write_results

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    write_results(fifo, {"a": 1})
    reader.join(10)
    assert json.loads(got[0]) == {"a": 1} and fifo.is_fifo() and os.listdir(tmp_path) == ["fifo"]

    target = tmp_path / "kept" / "r.json"
    target.parent.mkdir()
    (tmp_path / "link.json").symlink_to(target)
    write_results(tmp_path / "link.json", {"b": 2})
    assert (tmp_path / "link.json").is_symlink() and json.loads(target.read_text()) == {"b": 2}
