"""A stand-in for `gcloud` that the launcher tests put first on PATH.

It appends every call's arguments to $FAKE_GCLOUD_DIR/calls.jsonl and plays the parts the
launchers use on one machine: TPU VM workers are folders (workers/<node>/<w>, each a home
directory), `ssh --command` runs the command there with bash, `scp` copies into them, a GCS
bucket is the folder gcs/<bucket>, and creating a queued resource creates the nodes and runs
the start-up script on each of their workers. $FAKE_GCLOUD_WORKERS workers per node (default
2); a call whose arguments contain $FAKE_GCLOUD_FAIL_ON fails with exit code 1.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

STATE = Path(os.environ["FAKE_GCLOUD_DIR"])
NODES = STATE / "nodes.json"


def option(args: list[str], name: str, default: str | None = None) -> str | None:
    for a in args:
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
    return default


def nodes() -> list[dict]:
    return json.loads(NODES.read_text()) if NODES.exists() else []


def add_node(name: str) -> None:
    count = int(os.environ.get("FAKE_GCLOUD_WORKERS", "2"))
    endpoints = [{"ipAddress": f"10.0.{len(nodes())}.{w}", "accessConfig": {"externalIp": f"34.0.0.{w}"}}
                 for w in range(count)]
    NODES.write_text(json.dumps([*nodes(), {"name": f"projects/p/locations/z/nodes/{name}",
                                            "networkEndpoints": endpoints}]))


def worker_homes(name: str, worker: str) -> list[tuple[int, Path]]:
    node = next((n for n in nodes() if n["name"].endswith("/" + name)), None)
    if node is None:
        sys.exit(f"ERROR: (gcloud) NOT_FOUND: node {name}")
    count = len(node["networkEndpoints"])
    ids = range(count) if worker == "all" else [int(worker)]
    homes = [(w, STATE / "workers" / name / str(w)) for w in ids]
    for _, home in homes:
        home.mkdir(parents=True, exist_ok=True)
    return homes


def bucket_path(url: str) -> Path:
    return STATE / "gcs" / url.removeprefix("gs://")


def run_on(home: Path, command: str, env: dict) -> int:
    """Run `command` with bash in a worker's home; a SIGTERM to the fake stops it too (like ssh)."""
    child = subprocess.Popen(["bash", "-c", command], cwd=home, env={**os.environ, "HOME": str(home), **env})
    signal.signal(signal.SIGTERM, lambda *_: (child.kill(), sys.exit(143)))
    return child.wait()


def tpu_vm(args: list[str]) -> int:
    verb = args[0]
    if verb == "list":
        print(json.dumps(nodes()))
    elif verb == "describe":
        node = next((n for n in nodes() if n["name"].endswith("/" + args[1])), None)
        if node is None:
            sys.exit(f"ERROR: (gcloud) NOT_FOUND: node {args[1]}")
        print(json.dumps(node))
    elif verb == "scp":
        source, target = args[1], args[2]
        for _, home in worker_homes(target.split(":")[0], option(args, "worker", "0")):
            shutil.copy(source, home / Path(source).name)
    elif verb == "ssh":
        codes = [run_on(home, option(args, "command"), {"FAKE_SLICE": args[1], "FAKE_WORKER": str(w)})
                 for w, home in worker_homes(args[1], option(args, "worker", "0"))]
        return next((c for c in codes if c), 0)
    return 0


def storage(args: list[str]) -> int:
    verb, paths = args[0], [a for a in args[1:] if not a.startswith("-")]
    if verb == "cp":
        source, target = paths
        dest = bucket_path(target) if target.startswith("gs://") else Path(target)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(bucket_path(source) if source.startswith("gs://") else source, dest)
    elif verb == "ls":
        folder = bucket_path(paths[0])
        found = sorted(folder.iterdir()) if folder.is_dir() else []
        if not found:
            sys.exit("ERROR: (gcloud) One or more URLs matched no objects.")
        print("\n".join(paths[0].rstrip("/") + "/" + p.name for p in found))
    elif verb == "cat":
        print(bucket_path(paths[0]).read_text(), end="")
    return 0


def queued_resources(args: list[str]) -> int:
    verb, name = args[0], args[1]
    if verb == "create":
        count = option(args, "node-count")
        names = [option(args, "node-id")] if count is None else [f"{option(args, 'node-prefix')}-{i}" for i in
                                                                  range(int(count))]
        script = option(args, "metadata-from-file").split("=", 1)[1]
        for node in names:
            add_node(node)
        for node in names:  # boot: every worker runs the start-up script
            for w, home in worker_homes(node, "all"):
                run_on(home, f"bash {script}", {"TESSERA_HOST": f"{node}-w{w}"})
    elif verb == "describe":
        print(os.environ.get("FAKE_GCLOUD_QR_STATE", "ACTIVE"))
    return 0


def main(args: list[str]) -> int:
    STATE.mkdir(parents=True, exist_ok=True)
    with (STATE / "calls.jsonl").open("a") as log:
        log.write(json.dumps(args) + "\n")
    fail_on = os.environ.get("FAKE_GCLOUD_FAIL_ON")
    if fail_on and fail_on in " ".join(args):
        print(f"ERROR: (gcloud) injected failure for {fail_on!r}", file=sys.stderr)
        return 1
    if args[:3] == ["compute", "tpus", "tpu-vm"]:
        return tpu_vm(args[3:])
    if args[:1] == ["storage"]:
        return storage(args[1:])
    if args[:4] == ["alpha", "compute", "tpus", "queued-resources"]:
        return queued_resources(args[4:])
    print(f"fake gcloud: unsupported command {args}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
