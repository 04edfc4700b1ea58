"""The validation suite's node commands (`tessera.tools.validate`): one train.py per node with its
environment (the file's env_dict, the job's layout, this shell's XLA_FLAGS for local nodes), here,
over ssh under a signal relay, or in a container when the file names an image and an engine
answers. `validate_nodes` runs and follows them."""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from tessera.config.maxtext import maxtext_keys
from tessera.config.schema import all_fields

if TYPE_CHECKING:
    from tessera.tools.validate import Plan

REPO = Path(__file__).resolve().parents[3]
ENGINE_SECONDS = 30.0  # how long `docker info` (or podman's) may take to say the engine answers


JOB_KEYS = ("JAX_COORDINATOR_IP", "JAX_COORDINATOR_PORT", "NNODES", "NODE_RANK")  # a multi-node job's layout


def node_env(plan: Plan, rank: int, nnodes: int, coordinator: str, port: str) -> dict[str, str]:
    """The environment of node `rank`: the file's env_dict with the job's layout; a one-node run gets
    none (an env_dict NNODES=2 made it wait for a second node that never came)."""
    env = {k: v for k, v in plan.env.items() if nnodes > 1 or k not in JOB_KEYS}
    if nnodes > 1:
        env.update(JAX_COORDINATOR_IP=coordinator, JAX_COORDINATOR_PORT=port, NNODES=str(nnodes), NODE_RANK=str(rank))
    return env


def free_port() -> str:
    """A TCP port no program listens on here now, for the coordinator of a job whose nodes all run here."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return str(s.getsockname()[1])


def train_variables(environ) -> dict[str, str]:
    """The M_<KEY> variables of `environ` that train.py reads as train keys, over its command line."""
    fields = {*all_fields(), *maxtext_keys()}
    return {k: v for k, v in environ.items() if k.startswith("M_") and k[2:].lower() in fields}


def environment_here() -> dict[str, str]:
    """This process's environment as a node started here gets it, under the file's: without its M_<KEY> train
    variables, which train.py reads over its command line, so an M_STEPS=5 or M_RUN_NAME=x left in the shell
    ran another job than the file's (5 steps, without a word) or put its report.json where the suite did not
    look. The file's env_dict may still set them."""
    skipped = train_variables(os.environ)
    return {k: v for k, v in os.environ.items() if k not in skipped}


def with_local_xla_flags(env: dict[str, str]) -> dict[str, str]:
    """`env` for a node started here, not in a container, which runs with this process's environment under the
    file's: this process's XLA_FLAGS (fake CPU devices, an operator's flag) go before the file's, which win
    where a flag repeats (XLA reads the last). The file's replaced them whole, so any xla_flags in the file
    took away, say, --xla_force_host_platform_device_count=4 (the run had 1 device, not 4); without one,
    every flag here applied."""
    here = os.environ.get("XLA_FLAGS", "").strip()
    if not here or "XLA_FLAGS" not in env or env["XLA_FLAGS"].strip() == here:
        return env
    return {**env, "XLA_FLAGS": f"{here} {env['XLA_FLAGS']}".strip()}


def node_setting_lines(plan: Plan, nodes: list[str]) -> list[str]:
    """What the suite prints about the file's node settings it does not use as written: those `--nodes`
    replaces, the env_dict's job layout a one-node run leaves out (see node_env), and without --nodes the
    env_dict's NNODES and JAX_COORDINATOR_IP that config.nnodes and coordinator_ip replace (without a word
    before) and this environment's M_<KEY> train variables, which are not passed on (environment_here)."""
    lines, count = replaced_by_nodes(plan, nodes), len(nodes or ["local"] * max(plan.nnodes, 1))
    if count == 1 and (unused := [f"{k}={plan.env[k]}" for k in JOB_KEYS if k in plan.env]):
        lines.append(f"one node: config.container_config.env_dict {', '.join(unused)} not passed on (a one-node "
                     "run joins no job)")
    if not nodes and count > 1:  # config's node count and coordinator set every node's variables, over env_dict's
        for variable, key, used in (("NNODES", "nnodes", str(plan.nnodes)),
                                    ("JAX_COORDINATOR_IP", "coordinator_ip", plan.coordinator)):
            if variable in plan.env and plan.env[variable].strip() != used:
                lines.append(f"config.{key}={used} replaces config.container_config.env_dict.{variable}="
                             f"{plan.env[variable]}")
    if not nodes and (skipped := sorted(f"{k}={v}" for k, v in train_variables(os.environ).items()
                                        if k not in plan.env)):
        lines.append(f"not passed on from this environment: {', '.join(skipped)} (train.py would read them over the "
                     f"file's train keys; set train keys in model_params.{plan.name})")
    return lines


def replaced_by_nodes(plan: Plan, nodes: list[str]) -> list[str]:
    """One line per setting of the file that `--nodes` replaces (printed, never dropped silently): the
    node count, and with several nodes the coordinator, the first host (`validate_nodes.node_env`)."""
    if not nodes:
        return []
    count, first = f"{len(nodes)} ({', '.join(nodes)})", f"{coordinator_host(nodes)} (the first host)"
    env_dict = "config.container_config.env_dict"
    settings = [("config.nnodes", plan.container.get("nnodes"), count)]
    if len(nodes) > 1:  # every node's NNODES and JAX_COORDINATOR_IP come from --nodes
        settings += [(f"{env_dict}.NNODES", plan.env.get("NNODES"), count),
                     ("config.coordinator_ip", plan.container.get("coordinator_ip"), first),
                     (f"{env_dict}.JAX_COORDINATOR_IP", plan.env.get("JAX_COORDINATOR_IP"), first)]
    lines = []
    for where, value, new in settings:
        text = "" if value is None else str(value).strip()
        if where.endswith(("nnodes", "NNODES")) and value is not None:
            text = text or "1"  # an empty node count is one node
        if text and text != new.split()[0]:
            lines.append(f"--nodes replaces {where}={value if str(value).strip() else repr(value)} with {new}")
    return lines


def coordinator_host(nodes: list[str]) -> str:
    """The first host of --nodes as the other nodes reach it: `alice@h1` is ssh's user@host, and
    JAX_COORDINATOR_IP=alice@h1 is no address."""
    return nodes[0].rpartition("@")[2]


def train_argv(plan: Plan, run_name: str) -> list[str]:
    overrides = {**plan.overrides, "run_name": run_name}
    overrides.setdefault("base_output_directory", str(REPO / "outputs"))
    return [sys.executable, str(REPO / "train.py"), str(REPO / "configs" / "base.yml"),
            *(f"{k}={v}" for k, v in overrides.items())]


def container_engine() -> str | None:
    """docker or podman when one is installed and its engine answers within ENGINE_SECONDS, else None
    (a daemon that hung kept `docker info`, and the suite, waiting forever)."""
    for engine in ("docker", "podman"):
        try:
            if shutil.which(engine) and subprocess.run([engine, "info"], capture_output=True,
                                                       timeout=ENGINE_SECONDS).returncode == 0:
                return engine
        except subprocess.TimeoutExpired:
            print(f"{engine} info did not answer within {ENGINE_SECONDS:g} s: {engine} is not used", flush=True)
    return None


def wrap_in_container(engine: str, plan: Plan, env: dict[str, str], argv: list[str]) -> list[str]:
    c = plan.container
    cmd = [engine, "run", "--rm", "--network=host", "--ipc=host", f"--shm-size={c.get('shm_size', '16G')}",
           "-v", f"{REPO}:{REPO}", "-w", str(REPO)]
    for device in c.get("device_list", []):
        cmd += ["--device", device]
    for host, inside in c.get("volume_dict", {}).items():
        cmd += ["-v", f"{host}:{inside}"]
    for k, v in env.items():
        cmd += ["-e", f"{k}={v}"]
    return cmd + [c["container_image"], "python3", *argv[1:]]


# ssh without a terminal passes no signal on: a signal to the local ssh ended it and left the remote
# trainer running. So the remote command runs under a relay that reads signal names from ssh's input
# ("TERM" lines, written by run_nodes) and sends them to the trainer, and sends it SIGTERM when the
# input ends (the local ssh was killed, or the connection dropped): the trainer saves and stops.
# `set -m` starts the trainer with SIGINT at its default (a background command would ignore it); the
# relay is waited for once stopped, so that it never outlives the command as an unreaped process.
RELAY = ('set -m; {command} </dev/null & child=$!; '
         '{{ while read -r sig; do kill -s "$sig" "$child"; done; kill -s TERM "$child"; }} >/dev/null 2>&1 & '
         'relay=$!; set +m; wait "$child"; code=$?; kill "$relay" 2>/dev/null; wait "$relay"; exit "$code"')


def over_ssh(host: str, env: dict[str, str], argv: list[str]) -> list[str]:
    """ssh argv running `argv` on `host` from the repository's folder (the same path as here), under
    the signal relay (RELAY); when argv[0] (the interpreter, or the container engine) is missing
    there, the node's log says so."""
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    missing = (f"tessera.validate: {argv[0]} is missing on {host}; every host needs the repository at {REPO} "
               "set up as on the host that runs the suite (bash setup.sh)")
    script = (f"cd {shlex.quote(str(REPO))} || exit 2; "
              f"command -v {shlex.quote(argv[0])} >/dev/null || {{ echo {shlex.quote(missing)} >&2; exit 2; }}; "
              + RELAY.format(command=f"env {exports} {shlex.join(argv)}"))
    return ["ssh", host, script]


def node_commands(plan: Plan, nodes: list[str], run_name: str, engine: str | None) -> list[tuple[str, list[str], dict]]:
    """(host, argv, env) per node; host 'local' runs here. Every node runs this interpreter (sys.executable)."""
    hosts = nodes or ["local"] * max(plan.nnodes, 1)
    coordinator = coordinator_host(nodes) if nodes else plan.coordinator
    # nodes all run here, with no port in the file: 8476 was every such suite's, so a second suite on this host
    # failed, and its node 1 joined the first suite's job, which aborted
    port = free_port() if not nodes and len(hosts) > 1 and "JAX_COORDINATOR_PORT" not in plan.env else plan.port
    in_container = bool(engine and plan.container.get("container_image"))
    out = []
    for rank, host in enumerate(hosts):
        env = node_env(plan, rank, len(hosts), coordinator, port)
        argv = train_argv(plan, run_name)
        if in_container:
            argv = wrap_in_container(engine, plan, env, argv)
        elif host == "local":
            env = with_local_xla_flags(env)
        if host != "local":
            argv = over_ssh(host, env, argv)
        out.append((host, argv, env))
    return out
