"""benchmarks/aot_recipes.py's exit code is the recipes of this run's: a row kept in the results file
from an earlier run (a recipe that did not fit then) does not fail a run that compiled others."""

import importlib
import json

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
