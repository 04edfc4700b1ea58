"""The guides work as printed on a fresh machine: every command names the project's interpreter
(`.venv/bin/python`, `.venv/bin/tensorboard`, run from the repository root, no activation
needed) unless it is one of the few listed exceptions, every relative link points at a file of
the repository (and at a heading that exists), and no document cites material that lives
outside the repository."""

import ast
import re
import sys
from pathlib import Path

import pytest

from conftest import REPO

DOCS = sorted({REPO / "README.md", *(REPO / "getting_started").glob("*.md"), *(REPO / "configs").rglob("README.md")})

# Commands that may start with a bare interpreter, and why. (Commands for a TPU VM or the container sit
# inside --COMMAND="..." / --command "..." strings, never at the start of a line, and recipes
# run as `bash configs/...sh`, which picks .venv/bin/python itself: neither needs an entry.)
EXCEPTIONS = (
    "python3 multihost_runner.py",  # standard library only (checked below): any Python 3.8+ on a workstation
    "python3 multihost_job.py",  # the same
    "python3 -m MaxText.train",  # MaxText's own commands, quoted for comparison in Coming_from_MaxText.md
    "python3 -m MaxText.train_compile",
    "python3 -m MaxText.decode",
)
BARE = re.compile(r"(python3?|tensorboard)\s+\S")
ENV_PREFIX = re.compile(r"""^(?:[A-Za-z_][A-Za-z0-9_]*=(?:"[^"]*"|'[^']*'|\S*)\s+)+""")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)((?:(?!\n\n).)+?)\1", re.S)  # never across paragraphs
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _split(doc: Path) -> tuple[list[tuple[int, str]], str]:
    """(numbered lines inside fenced code blocks, the prose with those blocks blanked out)."""
    code, prose, fence = [], [], None
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        marker = FENCE.match(line)
        if fence is None and marker:
            fence = marker.group(1)
            prose.append("")
        elif fence is not None:
            if marker and marker.group(1) == fence:
                fence = None
            else:
                code.append((number, line))
            prose.append("")
        else:
            prose.append(line)
    return code, "\n".join(prose)


def _bare_command(text: str) -> str | None:
    """The command if `text` starts one with a bare python/tensorboard that is not an exception."""
    command = ENV_PREFIX.sub("", text.strip().removeprefix("$ ").strip())
    if BARE.match(command) and not any(command == e or command.startswith(e + " ") for e in EXCEPTIONS):
        return command
    return None


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_commands_name_the_project_interpreter(doc):
    code, prose = _split(doc)
    found = [f"line {n}: {cmd}" for n, line in code if (cmd := _bare_command(line))]
    for span in INLINE_CODE.finditer(prose):
        if cmd := _bare_command(" ".join(span.group(2).split())):
            found.append(f"line {prose.count(chr(10), 0, span.start()) + 1}: `{cmd}`")
    assert not found, (
        f"{doc.relative_to(REPO)} prints commands that fail without an activated venv; write "
        f"`.venv/bin/python ...` / `.venv/bin/tensorboard ...` (see README.md, Quick start):\n  " + "\n  ".join(found))


def _module_file(name: str) -> Path | None:
    base = REPO / "src" / Path(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def test_exempt_launchers_need_only_the_standard_library():
    """The exceptions above hold only while the launchers (and the tessera modules they import)
    import nothing outside Python's standard library."""
    todo, seen, outside = [REPO / "multihost_runner.py", REPO / "multihost_job.py"], set(), set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path.name}: relative import; make it absolute"
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top == "tessera":
                    parts = name.split(".")
                    todo += [f for i in range(1, len(parts) + 1) if (f := _module_file(".".join(parts[:i])))]
                elif top not in sys.stdlib_module_names:
                    outside.add(f"{path.relative_to(REPO)} imports {name}")
    assert any(p.name == "tpu_vm.py" for p in seen), "the launchers no longer import tessera.tpu_vm: update this test"
    assert not outside, ("the launchers need more than the standard library, so `python3 multihost_*.py` in the "
                         "guides will fail: write `.venv/bin/python` there and drop the exceptions:\n  "
                         + "\n  ".join(sorted(outside)))


def _anchors(doc: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    _, prose = _split(doc)
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", prose, re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_point_into_the_repository(doc):
    _, prose = _split(doc)
    prose = INLINE_CODE.sub(lambda m: " " * len(m.group(0)), prose)  # `[a](b)` in code is not a link
    bad = []
    for link in LINK.findall(prose):
        if re.match(r"[a-z][a-z0-9+.-]*:", link):  # https:, mailto:
            continue
        path, _, anchor = link.partition("#")
        target = (doc.parent / path).resolve() if path else doc
        if not target.is_relative_to(REPO.resolve()):
            bad.append(f"{link}: outside the repository")
        elif not target.exists():
            bad.append(f"{link}: {target.relative_to(REPO.resolve())} does not exist")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            bad.append(f"{link}: no heading #{anchor} in {target.name}")
    assert not bad, f"{doc.relative_to(REPO)}: broken links\n  " + "\n  ".join(bad)


OUTSIDE_MATERIAL = re.compile(r"\bseeds? \d{3}\b|\.\./shared/", re.I)


def test_no_document_cites_material_outside_the_repository():
    """Workspace-internal names ("seed 004", ../shared/...) mean nothing to a user: name the public
    source in words instead (getting_started/Architecture.md, "Where the figures come from")."""
    files = [*DOCS, *(REPO / "src").rglob("*.py"), *(REPO / "tests").glob("*.py"), REPO / "train.py", REPO / "decode.py"]
    found = [f"{f.relative_to(REPO)}:{n}: {line.strip()}" for f in files if f != Path(__file__).resolve()
             for n, line in enumerate(f.read_text().splitlines(), 1) if OUTSIDE_MATERIAL.search(line)]
    assert not found, "\n".join(found)


ARCHITECTURE = REPO / "getting_started" / "Architecture.md"
SRC = REPO / "src" / "tessera"
# what the call tree names that is JAX's or Python's, not ours
NOT_OURS = {"jit", "lower", "compile", "next", "step_fn", "TensorBoard"}


def _defined_names() -> set[str]:
    names = set()
    for path in [*SRC.rglob("*.py"), REPO / "train.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
    return names


def test_architecture_module_table_lists_every_module():
    """'The package, module by module': every path in the table exists, and every module is in it."""
    text = ARCHITECTURE.read_text().split("## The package, module by module", 1)[1].split("\n## ", 1)[0]
    listed = {p for row in re.findall(r"^\| (.+?) \|", text, re.M) for p in re.findall(r"`([\w/]+\.py|\w+/)`", row)}
    missing = sorted(p for p in listed if not (SRC / p).exists())
    assert not missing, f"Architecture.md lists modules that do not exist: {missing}"
    covered = {SRC / p for p in listed}
    unlisted = sorted(str(f.relative_to(SRC)) for f in SRC.rglob("*.py")
                      if f.name != "__init__.py" and f not in covered and f.parent not in covered)
    assert not unlisted, f"Architecture.md's module table leaves out: {unlisted}"


def test_architecture_call_tree_names_functions_that_exist():
    """Every function and class the training step's call tree names is defined in the code."""
    text = ARCHITECTURE.read_text().split("## One training step, through the code", 1)[1]
    tree = re.search(r"```\n(.*?)```", text, re.S).group(1)
    named = set(re.findall(r"([A-Za-z_]\w*)\(", tree)) | set(re.findall(r"\b(_?[A-Z][a-z]\w*|_[a-z]\w+)\b", tree))
    unknown = sorted(named - NOT_OURS - _defined_names())
    assert not unknown, f"Architecture.md's call tree names what the code does not define: {unknown}"


def _model_names(text: str) -> set[str]:
    """The backticked model names of `text`, `llama2-7b/13b` standing for llama2-7b and llama2-13b."""
    names = set()
    for written in re.findall(r"`([a-z0-9][a-z0-9.-]*(?:/[a-z0-9.-]+)*)`", text):
        first, *others = written.split("/")
        names |= {first, *(f"{first.rsplit('-', 1)[0]}-{other}" for other in others)}
    return names


def test_the_model_lists_name_every_model_file():
    """README's list of models and Coming_from_MaxText.md's "Model names" name exactly the files of configs/models."""
    files = {p.stem for p in (REPO / "configs" / "models").glob("*.yml")}
    readme = " ".join((REPO / "README.md").read_text().split())
    listed = readme.split("Models (`configs/models/`;", 1)[1].split("what each family adds", 1)[0]
    listed = listed.split("means `llama2-7b` and `llama2-13b`)", 1)[1]  # after the note on the shorthand
    assert _model_names(listed) == files, ("README.md's model list", sorted(_model_names(listed) ^ files))
    guide = (REPO / "getting_started" / "Coming_from_MaxText.md").read_text()
    section = guide.split("## Model names", 1)[1].split("\n## ", 1)[0].split("The families\nMaxText has", 1)[0]
    named = _model_names(section.split("the names are MaxText's:", 1)[1]) - {"deepseek3-671b", "olmo3_32b"}  # MaxText's names
    assert named == files, ("Coming_from_MaxText.md's model names", sorted(named ^ files))


def test_every_base_yml_key_is_named_in_a_guide():
    """configs/base.yml comments every key; the README and the guides also name each where it is used, so that a
    reader of a guide learns every key there is (enable_tensorboard, param_replication_warn_mib,
    normalization_layer_epsilon and use_iota_embed were named in base.yml alone). A pattern such as
    `dcn_<axis>_parallelism` names the keys it matches."""
    import yaml

    text = "\n".join(doc.read_text() for doc in DOCS)
    patterns = [re.sub(r"<[a-z]+>|\\\*", "[a-z_]+", re.escape(p))
                for p in re.findall(r"`([a-z][a-z_]*_(?:<[a-z]+>|\*)[a-z_]*)`", text)]
    keys = yaml.safe_load((REPO / "configs" / "base.yml").read_text())
    unnamed = [k for k in keys if not re.search(rf"(?<!\w){re.escape(k)}(?!\w)", text)
               and not any(re.fullmatch(p, k) for p in patterns)]
    assert not unnamed, f"keys of configs/base.yml that no guide names (say where each is used): {unnamed}"
