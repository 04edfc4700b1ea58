"""Multi-process jobs on localhost: start-up, same losses as one process, resume, failures."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from conftest import FAST_COMPILE, HELD_LINE, REPO, TINY, held_before, tiny_config
from tessera.distributed import DistributedError, job_from_env
from tessera.job_sync import wait_for_all
from tessera.hang_watchdog import HangWatchdog
from tessera.train import run

TINY_ARGS = [f"{k}={v}" for k, v in TINY.items() if k not in ("per_device_batch_size", "steps")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_env(rank, port, nodes=2, extra_env=None) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count=4 {FAST_COMPILE}",
               JAX_COORDINATOR_IP="127.0.0.1", JAX_COORDINATOR_PORT=str(port), NNODES=str(nodes), NODE_RANK=str(rank),
               JAX_DISTRIBUTED_INITIALIZATION_TIMEOUT_SECONDS="60")
    env.update(extra_env or {})
    return env


def _start_command(out, *args) -> list[str]:
    return [sys.executable, str(REPO / "train.py"), str(REPO / "configs" / "base.yml"), "run_name=mp",
            f"base_output_directory={out}", "per_device_batch_size=1", *TINY_ARGS, *args]


def _start(rank, port, out, *args, nodes=2, extra_env=None):
    return subprocess.Popen(_start_command(out, *args), env=_start_env(rank, port, nodes, extra_env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(procs, timeout=300):
    results = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=timeout)
            results.append((p.returncode, err))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
            p.communicate()
        pytest.fail(f"the job's processes were still running after {timeout} s")
    return results


def test_a_node_rank_without_nnodes_or_coordinator_is_refused():
    """NODE_RANK=1 alone (NNODES and JAX_COORDINATOR_IP left out of a launch script) trained as a single process,
    without a word, beside process 0's run."""
    for env, nnodes in [({"NODE_RANK": "1"}, "NNODES"), ({"NODE_RANK": "1", "NNODES": "1"}, "NNODES=1")]:
        with pytest.raises(DistributedError, match=f"^NODE_RANK=1 names process 1 of a job, but {nnodes} and "
                                                   "JAX_COORDINATOR_IP do not: it would train alone"):
            job_from_env(env)
    assert job_from_env({"NODE_RANK": "0"}).mode == "single"


def test_job_layout_from_environment():
    assert job_from_env({}).mode == "single"
    assert job_from_env({"JAX_COORDINATOR_IP": "10.0.0.1", "NNODES": "1", "NODE_RANK": "0"}).mode == "single"
    spec = job_from_env({"JAX_COORDINATOR_IP": "10.0.0.1", "JAX_COORDINATOR_PORT": "1234", "NNODES": "4",
                         "NODE_RANK": "2", "JAX_DISTRIBUTED_INITIALIZATION_TIMEOUT_SECONDS": "7"})
    assert (spec.mode, spec.coordinator, spec.num_processes, spec.process_id, spec.init_timeout) == (
        "env", "10.0.0.1:1234", 4, 2, 7)
    assert job_from_env({"SLURM_NTASKS": "8", "SLURM_PROCID": "3"}).mode == "slurm"
    assert job_from_env({"TPU_WORKER_HOSTNAMES": "a,b,c,d", "TPU_WORKER_ID": "1"}).num_processes == 4
    assert job_from_env({"TPU_WORKER_HOSTNAMES": "localhost"}).mode == "single"
    # slices of one host each (xpk, 2 x v5e-8): each was a single process, and every slice trained alone
    spec = job_from_env({"TPU_WORKER_HOSTNAMES": "h0", "TPU_WORKER_ID": "0", "MEGASCALE_NUM_SLICES": "2",
                         "MEGASCALE_SLICE_ID": "1"})
    assert (spec.mode, spec.num_processes, spec.process_id) == ("tpu", 2, 1)
    spec = job_from_env({"TPU_WORKER_HOSTNAMES": "a,b,c,d", "TPU_WORKER_ID": "2", "MEGASCALE_NUM_SLICES": "3",
                         "MEGASCALE_SLICE_ID": "2"})  # JAX's count and id: 4 hosts x 3 slices, 2 x 4 + 2
    assert (spec.num_processes, spec.process_id) == (12, 10)


def test_a_coordinator_address_that_is_no_host_is_refused():
    """A JAX_COORDINATOR_IP that no process could ever reach (a URL, a network, a list, spaces) made every
    process wait out the start-up timeout, 300 s by default, and then call the coordinator unreachable; it
    is refused at once now (exit 4). Host names and IPv4/IPv6 addresses (with a zone, in brackets) pass."""
    job = {"NNODES": "2", "NODE_RANK": "1"}
    for ip in (" ", "http://10.0.0.2", "10.0.0.0/24", "10.0.0.2,10.0.0.3", "host 0", "[host-0]", "a..b"):
        with pytest.raises(DistributedError, match=rf"^JAX_COORDINATOR_IP={re.escape(repr(ip))} is not a host name or "
                                                   r"an IP address: give the address of the host of NODE_RANK=0 alone"):
            job_from_env({**job, "JAX_COORDINATOR_IP": ip})
    for ip, address in (("10.0.0.2", "10.0.0.2:8476"), ("tpu-vm-0.us-central2-b.c.my-project.internal", None),
                        ("localhost", None), ("my_host", None), ("fe80::1%eth0", "[fe80::1%eth0]:8476"),
                        ("[fd00::1]", "[fd00::1]:8476"), (" 10.0.0.2 ", "10.0.0.2:8476")):
        assert job_from_env({**job, "JAX_COORDINATOR_IP": ip}).coordinator == (address or f"{ip}:8476")
    assert job_from_env({"JAX_COORDINATOR_IP": "<changeme>", "NNODES": "1"}).mode == "single"  # never read


def test_a_job_timeout_below_one_second_is_refused():
    """JAX_DISTRIBUTED_HEARTBEAT_TIMEOUT_SECONDS=0 formed the job, and JAX's runtime called every process dead
    ("stopped sending heartbeats") and aborted both in C++ 3 s later (SIGABRT, exit 134); a start-up timeout of 0
    gave up before joining and blamed the coordinator. Both are refused at once (exit 4); one process reads neither."""
    job = {"JAX_COORDINATOR_IP": "127.0.0.1", "NNODES": "2", "NODE_RANK": "1"}
    for name, what, default in (("JAX_DISTRIBUTED_HEARTBEAT_TIMEOUT_SECONDS", "how long a silent process is waited "
                                 "for before JAX's runtime ends the job", 100),
                                ("JAX_DISTRIBUTED_INITIALIZATION_TIMEOUT_SECONDS", "how long a process waits for "
                                 "the job to form", 300)):
        for value in ("0", "-5"):
            with pytest.raises(DistributedError, match=rf"^{name}={value} is {re.escape(what)}, in seconds: give 1 or "
                                                       rf"more \(default {default}\), or unset it$"):
                job_from_env({**job, name: value})
        assert job_from_env({name: "0"}).mode == "single"
    assert job_from_env({**job, "JAX_DISTRIBUTED_HEARTBEAT_TIMEOUT_SECONDS": "1"}).heartbeat_timeout == 1


def test_tpu_hosts_are_read_where_jax_reads_them(tmp_path):
    """Newer GKE gives a slice's hosts as TPU_PROCESS_ADDRESSES (or a file, TPU_PROCESS_ADDRESSES_PATH), which JAX's
    TPU detection reads before TPU_WORKER_HOSTNAMES: with those alone a 4-host slice was 4 single processes."""
    spec = job_from_env({"TPU_PROCESS_ADDRESSES": "a:8471,b:8471,c:8471,d:8471", "TPU_WORKER_ID": "3"})
    assert (spec.mode, spec.num_processes, spec.process_id) == ("tpu", 4, 3)
    (tmp_path / "hosts").write_text("a:8471,b:8471\n")
    spec = job_from_env({"TPU_PROCESS_ADDRESSES_PATH": str(tmp_path / "hosts"), "TPU_WORKER_HOSTNAMES": "a",
                         "TPU_WORKER_ID": "1"})
    assert (spec.mode, spec.num_processes, spec.process_id) == ("tpu", 2, 1)
    with pytest.raises(DistributedError, match=r"^TPU_PROCESS_ADDRESSES_PATH=\S+/none cannot be read \(No such file"):
        job_from_env({"TPU_PROCESS_ADDRESSES_PATH": str(tmp_path / "none")})
    with pytest.raises(DistributedError, match="NODE_RANK=2 must be in"):
        job_from_env({"JAX_COORDINATOR_IP": "x", "NNODES": "2", "NODE_RANK": "2"})
    with pytest.raises(DistributedError, match=r"^NNODES=0 is the number of processes of the job: give 1 or more"):
        job_from_env({"JAX_COORDINATOR_IP": "x", "NNODES": "0", "NODE_RANK": "0"})  # was "NODE_RANK=0 must be in"
    with pytest.raises(DistributedError, match="NNODES='two' must be a whole number"):
        job_from_env({"JAX_COORDINATOR_IP": "x", "NNODES": "two"})
    # an address with its port waited the whole start-up timeout (300 s) for host "10.0.0.1:8476:8476"
    with pytest.raises(DistributedError, match=r"JAX_COORDINATOR_IP=10.0.0.1:8476 holds a port: give the address "
                                               r"alone, JAX_COORDINATOR_IP=10.0.0.1, and the port as "
                                               r"JAX_COORDINATOR_PORT=8476"):
        job_from_env({"JAX_COORDINATOR_IP": "10.0.0.1:8476", "NNODES": "2", "NODE_RANK": "0"})
    # IPv6: colons, no port; in brackets for JAX ("fd00::1:8476" never formed the job: every process waited it out)
    assert job_from_env({"JAX_COORDINATOR_IP": "fd00::1", "NNODES": "2"}).coordinator == "[fd00::1]:8476"
    assert job_from_env({"JAX_COORDINATOR_IP": "[fd00::1]", "NNODES": "2"}).coordinator == "[fd00::1]:8476"
    with pytest.raises(DistributedError, match=r"JAX_COORDINATOR_IP=\[fd00::1\]:9 holds a port: give the address alone, "
                                               r"JAX_COORDINATOR_IP=\[fd00::1\], and the port as JAX_COORDINATOR_PORT=9"):
        job_from_env({"JAX_COORDINATOR_IP": "[fd00::1]:9", "NNODES": "2", "NODE_RANK": "0"})
    # NNODES without the coordinator's address (or with JAX's own variable for it) ran every process alone, silently
    assert job_from_env({"NNODES": "1", "NODE_RANK": "0"}).mode == "single"
    assert job_from_env({"JAX_COORDINATOR_IP": "10.0.0.1"}).mode == "single"
    for rank in (0, 1):  # NUM_NODES=2 for NNODES: process 0 trained alone, process 1 was told NODE_RANK=1 >= NNODES=1
        with pytest.raises(DistributedError, match=rf"^JAX_COORDINATOR_IP and NODE_RANK={rank} are set but NNODES is "
                                                   r"not: set NNODES to the number of processes of the job"):
            job_from_env({"JAX_COORDINATOR_IP": "10.0.0.1", "NUM_NODES": "2", "NODE_RANK": str(rank)})
    with pytest.raises(DistributedError, match=r"^JAX_COORDINATOR_PORT=99999 is not a TCP port: give one from 1 to "
                                               r"65535 \(default 8476\)"):  # waited out the start-up timeout
        job_from_env({"JAX_COORDINATOR_IP": "10.0.0.1", "JAX_COORDINATOR_PORT": "99999", "NNODES": "2"})
    with pytest.raises(DistributedError, match=r"^NNODES=4 asks for a 4-process job, but JAX_COORDINATOR_IP is not "
                                               r"set; set JAX_COORDINATOR_IP to the address of the host of NODE_RANK=0"):
        job_from_env({"NNODES": "4", "NODE_RANK": "2"})
    with pytest.raises(DistributedError, match=r"JAX_COORDINATOR_IP is not set \(JAX_COORDINATOR_ADDRESS, JAX's own "
                                               r"name for it, is set but not read\)"):
        job_from_env({"NNODES": "2", "NODE_RANK": "1", "JAX_COORDINATOR_ADDRESS": "host-0:1234"})


def test_processes_started_with_different_configs_stop_naming_the_keys(tmp_path):
    """Another per_device_batch_size on process 1 aborted it in C++ at the first collective ("Received data
    size doesn't match expected size", exit 134) and process 0 blamed a lost network (exit 5)."""
    port = _free_port()
    results = _finish([_start(0, port, tmp_path), _start(1, port, tmp_path, "per_device_batch_size=2")])
    for rank, (code, err) in enumerate(results):
        other = 1 - rank
        assert code == 4 and "Traceback" not in err, err[-3000:]
        mine, theirs = ("1.0", "2.0") if rank == 0 else ("2.0", "1.0")
        assert (f"distributed start-up error: process {rank} was started with another config than process {other}: "
                f"per_device_batch_size={mine} (process {other}: {theirs})") in err, err[-3000:]
    assert not (tmp_path / "mp").exists()  # stopped before the run folder was made


def test_a_job_on_a_mesh_xla_cpu_miscompiles_is_refused_on_every_process(tmp_path):
    """data 2 x fsdp 2 x tensor 2 over two processes: the CPU miscompile check read its result whole on each process,
    which a process cannot (the other's shards), and both stopped with JAX's RuntimeError traceback (exit 1) instead
    of the refusal one process gives; the check gathers the result first now. Either both refuse it (exit 2), or, on
    a jax that computes it right, both train."""
    port = _free_port()
    mesh = ("ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", "per_device_batch_size=0.5")
    results = _finish([_start(rank, port, tmp_path, *mesh) for rank in (0, 1)])
    for code, err in results:
        assert "Traceback" not in err, err[-3000:]
        assert code == 0 or (code == 2 and re.search(r"config error: on CPU, this jax \(.*\) computes wrong results on a "
                                                     r"mesh with data 2, fsdp 2, tensor 2", err)), err[-3000:]
    assert len({code for code, _ in results}) == 1


@pytest.mark.parametrize("key, values, start_1", [
    ("NNODES", (2, 3), dict(nodes=3)),
    ("devices of the process", (4, 2), dict(extra_env={
        "XLA_FLAGS": f"--xla_force_host_platform_device_count=2 {FAST_COMPILE}"})),
])
def test_processes_started_with_another_job_size_stop_naming_it(tmp_path, key, values, start_1):
    """The coordinator's NNODES makes the job: process 1 started with NNODES=3 joined a job of 2 and trained
    on (exit 0), while a third host told to join would fail. Process 1 seeing 2 devices where process 0 sees 4
    (a GPU missing on one VM) failed in Orbax's first save with a traceback, exit 1. Both now stop, naming it."""
    port = _free_port()
    results = _finish([_start(0, port, tmp_path), _start(1, port, tmp_path, **start_1)])
    for rank, (code, err) in enumerate(results):
        mine, theirs = values if rank == 0 else values[::-1]
        assert code == 4 and "Traceback" not in err, err[-3000:]
        assert (f"distributed start-up error: process {rank} was started with another config than process "
                f"{1 - rank}: {key}={mine} (process {1 - rank}: {theirs})") in err, err[-3000:]
        assert ("Every process must see as many devices" in err) == (key != "NNODES"), err[-3000:]


def test_a_coordinator_port_taken_by_another_program_is_a_clear_error(tmp_path):
    """Process 0 hosts the coordinator: with the port taken (an earlier job still running, another server) JAX
    crashed it in C++ (segmentation fault, exit 139) after one gRPC log line. It now says so, exit code 4."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        (code, err), = _finish([_start(0, port, tmp_path)], timeout=120)
    assert code == 4 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        f"distributed start-up error: JAX_COORDINATOR_PORT={port} cannot be used on this host, where process 0 runs "
        "the job's coordinator (Address already in use): another program listens on it, perhaps an earlier job still "
        "running or a second process started with NODE_RANK=0. Stop it, or start every process with another "
        "JAX_COORDINATOR_PORT"), err[-3000:]


def test_a_job_with_jax_cache_dir_joins_before_its_cache_folder_is_checked(tmp_path):
    """The jax_cache_dir check asked JAX for this process's index before the job was joined, which starts
    JAX's backends, and jax.distributed.initialize then refused to run: every such job failed at start. It
    joins first now (the config comparison, which needs the joined job, is what both processes report)."""
    port = _free_port()
    cache = f"jax_cache_dir={tmp_path / 'cache'}"
    results = _finish([_start(0, port, tmp_path, cache), _start(1, port, tmp_path, cache, "per_device_batch_size=2")])
    for rank, (code, err) in enumerate(results):
        assert code == 4 and "Traceback" not in err, err[-3000:]
        assert f"distributed start-up error: process {rank} was started with another config" in err, err[-3000:]
    (tmp_path / "file").write_text("")  # a cache folder that cannot be written: process 0 refuses it once joined
    cache = f"jax_cache_dir={tmp_path / 'file' / 'cache'}"
    port = _free_port()
    results = _finish([_start(rank, port, tmp_path, cache) for rank in (0, 1)])
    for code, err in results:
        assert code == 2 and "Traceback" not in err, err[-3000:]
        assert f"config error: jax_cache_dir={tmp_path / 'file' / 'cache'} cannot be written" in err, err[-3000:]
    assert "Warning" not in results[0][1] and "job error: process 0 stopped with: config error" in results[1][1]


def _saved_arrays(folder) -> dict:
    """Every array of a checkpoint's saved train state, read back whole as numpy, by its path in the tree."""
    import orbax.checkpoint as ocp

    with ocp.PyTreeCheckpointer() as reader:
        tree = reader.metadata(folder)
        tree = getattr(getattr(tree, "item_metadata", tree), "tree", tree)
        state = reader.restore(folder, restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
                                                                  tree))
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(state)[0]}


@pytest.mark.slow
def test_two_processes_match_one_process_and_resume(tmp_path):
    reference = run(tiny_config(tmp_path / "one", steps=3, per_device_batch_size=1))
    ref = [json.loads(line)["loss"] for line in (tmp_path / "one" / "test" / "metrics.jsonl").read_text().splitlines()]
    port = _free_port()
    results = _finish([_start(rank, port, tmp_path / "mp", "steps=3") for rank in (0, 1)])
    for code, err in results:
        assert code == 0, err[-3000:]
    got = [json.loads(line)["loss"] for line in (tmp_path / "mp" / "mp" / "metrics.jsonl").read_text().splitlines()]
    assert len(got) == 3 and reference["steps"] == 3
    # same weights, batch and math; only where the cross-process sums happen differs
    assert got == pytest.approx(ref, rel=1e-4)
    one, two = (_saved_arrays(tmp_path / d / "checkpoints" / "3" / "state") for d in ("one/test", "mp/mp"))
    assert sorted(one) == sorted(two) and len(one) > 20  # parameters, both Adam moments, the step
    for path, value in one.items():  # each process wrote its shards; together they are the one process's state
        np.testing.assert_allclose(two[path], value, rtol=1e-4, atol=1e-6, err_msg=path)
    port = _free_port()
    results = _finish([_start(rank, port, tmp_path / "mp", "steps=5") for rank in (0, 1)])
    for code, err in results:
        assert code == 0 and "resuming from step 3" in err, err[-3000:]
    # each process listed the array files it wrote, and process 0 merged the lists into the step's
    step = tmp_path / "mp" / "mp" / "checkpoints" / "5"
    names = sorted(json.loads((step / "tessera_checksums.json").read_text())["files"])
    assert all(any(n.startswith(f"state/ocdbt.process_{i}/d/") for n in names) for i in (0, 1))
    assert not list(step.glob(".tessera_checksums.process_*"))
    # each process verifies half of the files; a change only process 1 reads stops both, with the same line
    victim = max((n for n in names[1::2]), key=lambda n: (step / n).stat().st_size)
    data = bytearray((step / victim).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (step / victim).write_bytes(bytes(data))
    port = _free_port()
    results = _finish([_start(rank, port, tmp_path / "mp", "steps=6") for rank in (0, 1)])
    for code, err in results:
        assert code == 2 and "Traceback" not in err, err[-3000:]
        assert f"checkpoint {step} is damaged: its file {victim} has changed since it was saved" in err


def _token_docs(path, docs: int, length: int | tuple[int, int], seed: int) -> str:
    """A JSON-lines file of `docs` documents of token ids, `length` tokens each (or a random length in [lo, hi))."""
    rng = np.random.default_rng(seed)
    lengths = [length] * docs if isinstance(length, int) else rng.integers(*length, docs)
    path.write_text("".join(json.dumps({"text": rng.integers(1, 96, n).tolist()}) + "\n" for n in lengths))
    return str(path)


@pytest.mark.slow
def test_each_process_resumes_its_own_share_of_the_files(tmp_path):
    """Each process reads its own share of the files, so each has its own data position; the
    checkpoint kept process 0's alone (Orbax writes JSON from process 0), and process 1 resumed
    at process 0's position in its own share: the losses after a resume differed from those of
    the run that went straight on."""
    data = ["dataset_type=hf", "hf_path=json", f"hf_train_files={_token_docs(tmp_path / 't.jsonl', 40, (5, 30), 2)}",
            "steps=4", "checkpoint_period=2", "learning_rate_schedule_steps=4"]
    port = _free_port()
    for code, err in _finish([_start(rank, port, tmp_path / "a", *data) for rank in (0, 1)]):
        assert code == 0, err[-3000:]
    straight = [json.loads(line) for line in (tmp_path / "a" / "mp" / "metrics.jsonl").read_text().splitlines()]
    saved = json.loads((tmp_path / "a" / "mp" / "checkpoints" / "2" / "data" / "metadata").read_text())
    assert [s["type"] for s in saved["processes"]] == ["hf", "hf"] and saved["processes"][0] != saved["processes"][1]
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "mp" / "checkpoints" / "4")
    port = _free_port()
    for code, err in _finish([_start(rank, port, tmp_path / "b", *data) for rank in (0, 1)]):
        assert code == 0 and "resuming from step 2" in err, err[-3000:]
    resumed = [json.loads(line) for line in (tmp_path / "b" / "mp" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed[-2:]] == [3, 4]
    assert [r["loss"] for r in resumed[-2:]] == pytest.approx([r["loss"] for r in straight[2:4]], rel=1e-6)


@pytest.mark.slow
def test_processes_whose_devices_hold_the_whole_batch_each_read_all_of_it(tmp_path):
    """ici_sequence_parallelism=8 over two processes: each process's devices hold every row of the batch
    (split along the sequence), but each process read half of the rows from the files, and the first step
    failed in make_array_from_process_local_data with a traceback, exit 1 on both. Both now read the whole
    batch, and the losses are those of one process with the same mesh."""
    data = ["dataset_type=hf", "hf_path=json", f"hf_train_files={_token_docs(tmp_path / 't.jsonl', 30, 25, 3)}",
            "max_target_length=16", "ici_fsdp_parallelism=1", "ici_sequence_parallelism=8", "steps=2"]
    reference = run(tiny_config(tmp_path / "one", per_device_batch_size=1, **dict(a.split("=", 1) for a in data)))
    assert reference["steps"] == 2
    one = [json.loads(line)["loss"] for line in (tmp_path / "one" / "test" / "metrics.jsonl").read_text().splitlines()]
    port = _free_port()
    for code, err in _finish([_start(rank, port, tmp_path / "mp", *data) for rank in (0, 1)]):
        assert code == 0 and "Traceback" not in err, err[-3000:]
    two = [json.loads(line)["loss"] for line in (tmp_path / "mp" / "mp" / "metrics.jsonl").read_text().splitlines()]
    assert len(two) == 2 and two == pytest.approx(one, rel=1e-4)
    saved = json.loads((tmp_path / "mp" / "mp" / "checkpoints" / "2" / "data" / "metadata").read_text())
    assert saved["shares"] == [[0, 1], [0, 1]] and saved["processes"][0] == saved["processes"][1]


_MISSES_A_FILE = """
import runpy, sys
sys.path.insert(0, {src!r})
from tessera.data import hf
expand = hf.expand_files
hf.expand_files = lambda *args: expand(*args)[:-1]  # this host lacks the last file (a copy not finished)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_processes_that_see_other_files_stop_naming_them(tmp_path):
    """Each process reads its share of the files it sees: with a file missing on one host (a copy not finished),
    process 0 kept whole files 0 and 2 of 3 and process 1 every other document of files 0 and 1, so records
    were read twice and others never, and both trained on (exit 0) without a word. Both now stop, exit 2,
    naming the file."""
    files = [_token_docs(tmp_path / f"{name}.jsonl", 6, 20, seed) for seed, name in enumerate("abc")]
    data = ["dataset_type=hf", "hf_path=json", f"hf_train_files={tmp_path / '*.jsonl'}", "steps=2"]
    port = _free_port()
    missing = subprocess.Popen([sys.executable, "-c", _MISSES_A_FILE.format(src=str(REPO / "src")),
                                *_start_command(tmp_path / "mp", *data)[1:]], env=_start_env(1, port),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = _finish([_start(0, port, tmp_path / "mp", *data), missing])
    size = f"{os.path.getsize(files[2]):,} bytes"
    said = {0: f"process 0 sees other data than process 1: {files[2]} ({size} here, missing on process 1)",
            1: f"process 1 sees other data than process 0: {files[2]} (missing here, {size} on process 0)"}
    for code, err in results:  # each says its own line, or follows the other's ("job error: process 1 stopped ...")
        assert code == 2 and "Traceback" not in err, err[-3000:]
        assert any(s in err.strip().splitlines()[-1] for s in said.values()), err[-3000:]
    assert any(line.startswith(f"data error: hf_train_files='{tmp_path / '*.jsonl'}': {said[rank]}")
               for rank, (_, err) in enumerate(results) for line in err.splitlines()), results
    assert not (tmp_path / "mp" / "mp").exists()  # nothing trained


@pytest.mark.slow
def test_eval_shares_of_different_lengths_end_together_with_the_one_process_loss(tmp_path):
    """Each process reads its own share of the eval files; 5 documents split 3 + 2, 12 and 8 rows of
    13 tokens, 3 batches of 4 rows on process 0 and 2 on process 1. Process 1 used to leave the eval
    loop alone while process 0 waited in the third batch's collectives, until the hang watchdog
    ended both (exit 5). Now the processes go on with padding rows until every share has ended, and
    the loss is the one of a single process over the same rows (learning_rate=0: the initial
    parameters in both runs; packing=false: the same rows however the documents are shared)."""
    data = ["dataset_type=hf", "hf_path=json", f"hf_train_files={_token_docs(tmp_path / 't.jsonl', 20, 40, 0)}",
            f"hf_eval_files={_token_docs(tmp_path / 'e.jsonl', 5, 40, 1)}", "packing=false", "learning_rate=0",
            "eval_interval=2", "steps=2"]
    reference = run(tiny_config(tmp_path / "one", per_device_batch_size=1,
                                **dict(a.split("=", 1) for a in data)))
    assert reference["steps"] == 2
    one = [json.loads(line) for line in (tmp_path / "one" / "test" / "metrics.jsonl").read_text().splitlines()
           if "eval_loss" in line]
    port = _free_port()
    results = _finish([_start(rank, port, tmp_path / "mp", *data, "step_timeout_seconds=120") for rank in (0, 1)])
    for code, err in results:
        assert code == 0, err[-3000:]
    two = [json.loads(line) for line in (tmp_path / "mp" / "mp" / "metrics.jsonl").read_text().splitlines()
           if "eval_loss" in line]
    assert len(one) == len(two) == 1
    assert two[0]["eval_tokens"] == one[0]["eval_tokens"] == 5 * 3 * 12  # 3 rows of 12 targets a document
    assert two[0]["eval_batches"] == 3 and one[0]["eval_batches"] == 3  # 20 rows / 8 (one), the longer share (two)
    assert two[0]["eval_loss"] == pytest.approx(one[0]["eval_loss"], rel=1e-5)


@pytest.mark.slow
def test_an_error_of_one_process_ends_every_process_at_once_with_its_exit_code(tmp_path):
    """A data error reaching one process only (its share of the file is empty, or holds a bad
    token id) left that process in JAX's shutdown barrier and the others in the next barrier or
    collective, until the barrier's timeout aborted the job in C++ after 5 minutes (no exit code
    of ours). Now the failing process publishes its error and leaves, and the others leave within
    seconds with its exit code, naming it. Process 0 hosts the coordinator: it waits for the
    others to read its error before it leaves."""
    mid_run = [list(range(1, 21)) for _ in range(12)]
    mid_run[7][5] = -3  # process 1 reads documents 1, 3, 5, 7, ...: its fourth, in the loop, while process 0 waits
    for docs, failing, bad in (([[1, 2, 3, 4, 5]], 1, "process 1 of 2 gets no records from these files"),
                               ([[1, 2, -3, 4, 5], [1, 2, 3, 4, 5]], 0, "hold token id -3"),
                               (mid_run, 1, "hold token id -3")):
        files = tmp_path / f"p{failing}_{len(docs)}.jsonl"
        files.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        port = _free_port()
        start = time.monotonic()
        results = _finish([_start(rank, port, tmp_path / f"out{failing}_{len(docs)}", "dataset_type=hf",
                                  "hf_path=json", f"hf_train_files={files}", "steps=6") for rank in (0, 1)], timeout=150)
        assert time.monotonic() - start < 120
        for rank, (code, err) in enumerate(results):
            assert code == 2 and "Traceback" not in err and "Check failure" not in err, err[-3000:]
            line = err.strip().splitlines()[-1]
            assert bad in line and "data error: hf_train_files=" in line, line
            if rank != failing:
                assert line.startswith(f"job error: process {failing} stopped with: data error: "), line
                assert line.endswith("; this process stops too (exit code 2)"), line
            else:
                assert line.startswith("data error: "), line


@pytest.mark.slow
def test_sigterm_to_one_process_while_it_compiles_stops_the_job(tmp_path):
    """JAX's preemption service took SIGTERM over once the process joined the job: a preempted VM's
    signal during start-up or compiling was logged as "SIGTERM caught" and training went on to the
    end (exit 0 on both). Now the signalled process stops (143) and the other follows at once."""
    port = _free_port()
    other = _start(0, port, tmp_path)
    proc = subprocess.Popen(held_before(_start_command(tmp_path), "tessera.step.compile_step"), env=_start_env(1, port),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if HELD_LINE in line:  # set up, about to compile (held there)
            break
    proc.send_signal(signal.SIGTERM)
    _, rest = proc.communicate(timeout=120)
    err = "".join(seen) + rest
    assert proc.returncode == 143 and "stopped by SIGTERM outside the training loop" in err, err[-3000:]
    [(code, other_err)] = _finish([other], timeout=120)
    assert code == 143 and "Traceback" not in other_err, other_err[-3000:]
    assert other_err.strip().splitlines()[-1].startswith("job error: process 1 stopped with: stopped by SIGTERM "
                                                         "outside the training loop")
    assert not (tmp_path / "mp" / "checkpoints").exists()


def test_unreachable_coordinator_fails_clearly(tmp_path):
    start = time.time()
    proc = _start(1, _free_port(), tmp_path, "steps=2", extra_env={"JAX_DISTRIBUTED_INITIALIZATION_TIMEOUT_SECONDS": "5"})
    (code, err), = _finish([proc], timeout=120)
    assert code == 4, err[-3000:]
    assert "could not join the job" in err and "process 1 of 2" in err and "Traceback" not in err
    assert "the same NNODES (a process given NNODES=1 trains alone and never joins)" in err
    assert time.time() - start < 90


def test_a_coordinator_name_that_does_not_resolve_is_said_at_once(caplog):
    """A misspelled JAX_COORDINATOR_IP host name was named only after the start-up timeout (300 s); it is still
    waited for (a Kubernetes service's name can appear late) but a warning says so at once."""
    from tessera.distributed import _warn_if_unresolved

    with caplog.at_level("WARNING", logger="tessera"):
        _warn_if_unresolved("coordinator.invalid:8476", 300)  # .invalid never resolves (RFC 6761)
        assert "the coordinator's host coordinator.invalid does not resolve here (" in caplog.text
        assert "waiting up to 300 s for it" in caplog.text
        caplog.clear()
        _warn_if_unresolved("127.0.0.1:8476", 300)
        _warn_if_unresolved("[::1]:8476", 300)
    assert caplog.text == ""


def test_a_process_given_nnodes_1_with_a_coordinator_says_it_trains_alone(monkeypatch, caplog):
    """NNODES=1 on one host and 2 on the other: the first trained alone without a word, while the second waited
    out its start-up timeout for it; the first now says it joins no job."""
    from tessera.distributed import initialize

    monkeypatch.setenv("JAX_COORDINATOR_IP", "10.0.0.1")
    monkeypatch.setenv("NNODES", "1")
    with caplog.at_level("INFO", logger="tessera"):
        assert initialize().mode == "single"
    assert ("NNODES=1: this process trains alone and joins no job (JAX_COORDINATOR_IP=10.0.0.1 is not used); for a "
            "job of several processes set NNODES to their count on every one") in caplog.text
    caplog.clear()
    monkeypatch.delenv("JAX_COORDINATOR_IP")
    with caplog.at_level("INFO", logger="tessera"):
        assert initialize().mode == "single"
    assert "NNODES" not in caplog.text  # no coordinator: a plain one-process run


def _kill_process_1_after_two_steps(tmp_path, step_timeout: int, extra_env=None) -> tuple[int, str, float]:
    """Start a 2-process job, SIGKILL process 1 once two steps are logged; process 0's exit code,
    stderr and seconds from the kill to its exit."""
    port = _free_port()
    procs = [_start(rank, port, tmp_path, "steps=100000", f"step_timeout_seconds={step_timeout}",
                    "enable_checkpointing=false", extra_env=extra_env) for rank in (0, 1)]
    metrics = tmp_path / "mp" / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        time.sleep(0.2)
    assert metrics.exists(), procs[0].communicate(timeout=5)[1][-3000:]
    procs[1].send_signal(signal.SIGKILL)
    start = time.time()
    (code, err), _ = _finish(procs, timeout=150)
    return code, err, time.time() - start


@pytest.mark.slow
def test_lost_peer_ends_the_survivor_with_the_watchdog_code(tmp_path):
    code, err, seconds = _kill_process_1_after_two_steps(tmp_path, step_timeout=10)
    assert code == 5, err[-3000:]
    assert "hang watchdog" in err and seconds < 60


_DIES_IN_ITS_SAVE = """
import os, runpy, signal, sys, time
sys.path.insert(0, {src!r})
import jax
from tessera.checkpointing import manager
save = manager.Checkpointer.save
def dies(self, step, state, *args, **kwargs):  # process 1 is killed inside the save of step 2
    if step == 2:
        jax.block_until_ready(state)
        time.sleep(1)  # process 0 is in the save's collectives by now
        os.kill(os.getpid(), signal.SIGKILL)
    return save(self, step, state, *args, **kwargs)
manager.Checkpointer.save = dies
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_a_peer_killed_during_a_save_ends_the_survivor_with_the_watchdog_code(tmp_path):
    """Process 1 killed (kill -9, the OOM killer) while the job saved a checkpoint: process 0's save failed in
    a collective ("Gloo AllGather failed: Connection closed by peer"), which was reported as a save error
    ("free some space", exit 6); the partial save was then moved aside under Orbax's writer threads, whose
    errors came out of the checkpoint manager's close: a traceback, exit 1. It ends as a failed step of a job
    does now: one hang watchdog line, exit 5; the job resumes from the last complete checkpoint."""
    port = _free_port()
    flags = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4 --xla_cpu_collective_timeout_seconds=5 "
                          f"{FAST_COMPILE}"}
    args = ("steps=100000", "checkpoint_period=1", "step_timeout_seconds=90")
    dying = subprocess.Popen([sys.executable, "-c", _DIES_IN_ITS_SAVE.format(src=str(REPO / "src")),
                              *_start_command(tmp_path, *args)[1:]], env=_start_env(1, port, extra_env=flags),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    (code, err), (dead, _) = _finish([_start(0, port, tmp_path, *args, extra_env=flags), dying], timeout=200)
    assert dead == -signal.SIGKILL
    assert code == 5 and "Traceback" not in err and "free some space" not in err, err[-3000:]
    line = next(line for line in err.splitlines() if line.startswith("hang watchdog:"))
    # the save of step 2 failed, not step 2 itself: the line said "step 2 ... failed on the device or in a collective"
    assert re.search(r"the checkpoint save of step 2 of this 2-process job failed in a collective \(JAX said: .+\)",
                     line)
    assert sorted(p.name for p in (tmp_path / "mp" / "checkpoints").iterdir() if p.name.isdigit()) == ["1"]
    port = _free_port()
    for code, err in _finish([_start(rank, port, tmp_path, "steps=3") for rank in (0, 1)]):
        assert code == 0 and "resuming from step 1" in err, err[-3000:]


@pytest.mark.slow
def test_a_collective_that_raises_after_a_lost_peer_ends_the_survivor_with_the_watchdog_code(tmp_path):
    # A collective whose peer is killed blocks on most runs (the test above) and raises on others
    # (gloo: "Connection reset by peer"). XLA:CPU's collective timeout makes it raise on every run.
    # Leaving normally would then wait in JAX's shutdown barrier for the dead process until the
    # heartbeat timeout (100 s) and abort (SIGABRT, exit -6): what CI once saw in the test above.
    flags = {"XLA_FLAGS": f"--xla_force_host_platform_device_count=4 --xla_cpu_collective_timeout_seconds=3 {FAST_COMPILE}"}
    code, err, seconds = _kill_process_1_after_two_steps(tmp_path, step_timeout=90, extra_env=flags)
    assert code == 5, err[-3000:]
    line = next(line for line in err.splitlines() if line.startswith("hang watchdog:"))
    assert re.search(r"step \d+ of this 2-process job failed on the device or in a collective \(JAX said: .+\)", line)
    assert line.endswith("exit code 5") and "Traceback" not in err
    assert seconds < 60  # well before the watchdog's 90 s: the error ended it


def test_watchdog_dumps_stacks_and_exits(tmp_path):
    script = (f"import sys, time; sys.path.insert(0, {str(REPO / 'src')!r})\n"
              "from tessera.hang_watchdog import HangWatchdog\n"
              "with HangWatchdog(0.2) as w:\n    w.beat()\n    time.sleep(30)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    first = proc.stderr.split("\n")[0]
    assert proc.returncode == 5 and "hang watchdog" in first and "time.sleep" not in first
    # the real time waited (0.2 s timeout, checked every 0.05 s), not a rounded "0 s"
    waited = float(re.search(r"no training step finished in ([0-9.]+) s \(step_timeout_seconds=0.2\)", first)[1])
    assert 0.2 <= waited < 5, first
    assert "File" in proc.stderr  # the Python stack dump
    # a timeout shorter than the steps (step_timeout_seconds=0.05 on the CPU demo) is named with its fix
    assert "(step_timeout_seconds=0.2): raise step_timeout_seconds if a step, or a batch of the input pipeline, " \
        "takes that long; Python stacks of every thread follow, then exit code 5" in first
    with HangWatchdog(0):  # 0 disables it
        time.sleep(0.1)


def test_watchdog_allows_a_blocking_save_its_own_time_and_names_it_when_that_runs_out():
    """Inside `allowing`, the loop may wait that much longer than the timeout (a checkpoint save):
    a 1 s wait under a 0.2 s timeout with 3 s allowed passes; beyond the allowance the watchdog
    ends the process naming what did not finish, and outside it the plain timeout is back."""
    head = (f"import sys, time; sys.path.insert(0, {str(REPO / 'src')!r})\n"
            "from tessera.hang_watchdog import HangWatchdog\n"
            "with HangWatchdog(0.2) as w:\n"
            "    with w.allowing('checkpoint save of step 7', 3.0):\n        time.sleep(1.0)\n"
            "    print('saved', flush=True)\n")
    cases = {"over": "    with w.allowing('checkpoint save of step 8', 0.5):\n        time.sleep(30)\n",
             "after": "    time.sleep(30)\n"}
    procs = {k: subprocess.Popen([sys.executable, "-c", head + tail], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True) for k, tail in cases.items()}
    out = {k: p.communicate(timeout=60) for k, p in procs.items()}
    assert all(p.returncode == 5 and out[k][0] == "saved\n" for k, p in procs.items()), out
    over = out["over"][1].split("\n")[0]
    waited = re.search(r"^hang watchdog: checkpoint save of step 8 did not finish in ([0-9.]+) s "
                       r"\(step_timeout_seconds=0.2 plus 0.5 s allowed for it\); .* exit code 5$", over)
    assert waited and 0.7 <= float(waited[1]) < 5, over
    after = out["after"][1].split("\n")[0]
    assert re.search(r"no training step finished in 0\.[2-9] s|no training step finished in [1-4]\.\d s", after), after


@pytest.mark.slow
def test_sigterm_to_one_process_stops_the_whole_job_at_the_same_step(tmp_path):
    port = _free_port()
    procs = [_start(rank, port, tmp_path, "steps=100000", "checkpoint_period=100000", "step_timeout_seconds=60")
             for rank in (0, 1)]
    metrics = tmp_path / "mp" / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.1)
    assert metrics.exists(), procs[0].communicate(timeout=5)[1][-3000:]
    procs[1].send_signal(signal.SIGTERM)  # only process 1, as when one VM of a job is preempted
    start = time.time()
    results = _finish(procs, timeout=120)
    seconds = time.time() - start
    steps = []
    for rank, (code, err) in enumerate(results):
        assert code == 143, err[-3000:]
        assert "Traceback" not in err
        steps.append(int(re.search(r"stopped by SIGTERM.* after step (\d+); checkpoint", err)[1]))
    assert "sent to another process" in results[0][1] and "sent to another process" not in results[1][1]
    assert steps[0] == steps[1] and (tmp_path / "mp" / "checkpoints" / str(steps[0])).is_dir()
    assert seconds < 60
    print(f"SIGTERM to process 1: both saved step {steps[0]}, stopped in {seconds:.1f} s")
    port = _free_port()
    for code, err in _finish([_start(rank, port, tmp_path, f"steps={steps[0] + 1}") for rank in (0, 1)]):
        assert code == 0 and f"resuming from step {steps[0]}" in err, err[-3000:]


@pytest.mark.slow
def test_sigterm_to_one_process_during_an_evaluation_stops_the_job_at_that_step(tmp_path):
    """A stop during an evaluation of a job ran the evaluation to its end (the processes' batches
    meet in collectives, so one could not leave alone), then trained on until the agreed later step
    before saving. Now every process leaves the evaluation after the same batch and the evaluated
    step is saved, as with one process."""
    port = _free_port()
    procs = [_start(rank, port, tmp_path, "steps=100000", "checkpoint_period=100000", "eval_interval=3",
                    "eval_steps=3000", "step_timeout_seconds=60") for rank in (0, 1)]
    metrics = tmp_path / "mp" / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.05)  # the lines of steps 1-3 are written before step 3's evaluation starts
    assert metrics.exists(), procs[0].communicate(timeout=5)[1][-3000:]
    time.sleep(1)
    procs[1].send_signal(signal.SIGTERM)
    start = time.time()
    results = _finish(procs, timeout=120)
    seconds = time.time() - start
    for rank, (code, err) in enumerate(results):
        assert code == 143 and "Traceback" not in err, err[-3000:]
        assert re.search(r"evaluation of step 3 stopped after \d+ batch\(es\) by the stop signal", err), err[-3000:]
        assert re.search(r"stopped by SIGTERM.* after step 3; checkpoint", err), err[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and not any("eval_loss" in r for r in records)
    assert sorted(p.name for p in (tmp_path / "mp" / "checkpoints").iterdir() if p.name.isdigit()) == ["3"]
    assert seconds < 30
    print(f"SIGTERM to process 1 during an evaluation: both saved step 3, stopped in {seconds:.1f} s")


_STALLED_PUBLISHER = """
import runpy, sys, time
sys.path.insert(0, {src!r})
import tessera.stop_signals as stop_signals
publish = stop_signals.request_stop
def stalled(*args, **kwargs):  # the host stalls between starting a step and publishing the stop
    time.sleep(1.5)
    return publish(*args, **kwargs)
stop_signals.request_stop = stalled
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_a_stop_published_late_by_a_stalled_host_still_stops_every_process_after_the_same_step(tmp_path):
    """The loop checks for a stop after step T having read only step T-1's stats (METRICS_LAG). With
    one step of slack, a signalled process whose host stalled between starting step S and publishing
    "stop after S+1" (here 1.5 s) let process 0 pass its check of step S+1 unaware: it went on to step
    S+2 alone and waited in its collectives while process 1 saved step S+1, until the hang watchdog
    ended both (exit 5, nothing saved). Two steps of slack: both save the same step."""
    port = _free_port()
    args = ("steps=100000", "checkpoint_period=100000", "step_timeout_seconds=40")
    stalled = subprocess.Popen([sys.executable, "-c", _STALLED_PUBLISHER.format(src=str(REPO / "src")),
                                *_start_command(tmp_path, *args)[1:]], env=_start_env(1, port),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs = [_start(0, port, tmp_path, *args), stalled]
    metrics = tmp_path / "mp" / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.05)
    assert metrics.exists(), procs[0].communicate(timeout=5)[1][-3000:]
    stalled.send_signal(signal.SIGTERM)
    results = _finish(procs, timeout=150)
    steps = []
    for code, err in results:
        assert code == 143 and "Traceback" not in err, err[-3000:]
        steps.append(int(re.search(r"stopped by SIGTERM.* after step (\d+); checkpoint", err)[1]))
    assert steps[0] == steps[1] and (tmp_path / "mp" / "checkpoints" / str(steps[0])).is_dir()


@pytest.mark.slow
def test_a_second_sigterm_during_an_evaluation_ends_every_process_with_its_code(tmp_path):
    """A second signal stops the signalled process at once. In a job the others were left inside an
    evaluation batch or the save with a peer gone: the save failed on "Connection reset by peer" and
    process 0 exited 6 saying "free some space", or a collective failed (exit 5). Now the signalled
    process publishes its line as an error does and waits for the others to read it: every process
    exits 143 within seconds, the others naming process 1's second signal."""
    port = _free_port()
    args = ("steps=100000", "checkpoint_period=100000", "eval_interval=3", "eval_steps=3000",
            "step_timeout_seconds=60")
    procs = [_start(rank, port, tmp_path, *args) for rank in (0, 1)]
    metrics = tmp_path / "mp" / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.05)
    assert metrics.exists(), procs[0].communicate(timeout=5)[1][-3000:]
    time.sleep(1)  # in step 3's evaluation
    procs[1].send_signal(signal.SIGTERM)
    seen = []
    for line in procs[1].stderr:
        seen.append(line)
        if "SIGTERM received" in line:  # handled: the next one is a second signal
            break
    procs[1].send_signal(signal.SIGTERM)
    start = time.time()
    (code0, err0), (code1, err1) = _finish(procs, timeout=120)
    err1 = "".join(seen) + err1
    assert code1 == 143 and "SIGTERM received again: stopping now" in err1, err1[-3000:]
    assert code0 == 143 and "Traceback" not in err0, err0[-3000:]
    assert err0.strip().splitlines()[-1].startswith("job error: process 1 stopped with: SIGTERM received again"), \
        err0[-3000:]
    assert time.time() - start < 30


def test_an_evaluation_is_left_too_when_the_job_agreed_to_stop_at_a_later_step(monkeypatch):
    """A signal while step 6 ran makes the job agree to stop after step 8; step 6's evaluation, a long
    one, used to run to its end (eating into a preemption's grace period) because only a stop at the
    evaluated step itself ended it. Now it is left after the same batch on every process: the one
    that knows of the stop publishes the batch, one that does not yet reads it after each batch."""
    from tessera import stop_signals

    published = {}
    monkeypatch.setattr(stop_signals.jax, "process_count", lambda: 2)
    monkeypatch.setattr(stop_signals, "request_eval_stop", lambda step, batches: published.setdefault(step, batches + 1))
    monkeypatch.setattr(stop_signals, "eval_stop_requested", lambda step: published.get(step))
    signalled, unaware = stop_signals.StopSignal(), stop_signals.StopSignal()
    signalled.signum, signalled.stop_at = signal.SIGTERM, (8, signal.SIGTERM)
    stops = [signalled.interrupts_evaluation(6), unaware.interrupts_evaluation(6)]
    left = [next((b for b in range(1, 50) if stop(b)), None) for stop in stops]
    assert left == [2, 2] and published == {6: 2}
    assert unaware.stop_at is None and signalled.stop_at == (8, signal.SIGTERM)  # the agreed step is kept


def test_an_error_after_another_process_failed_leaves_with_that_process_code(monkeypatch, capsys):
    """Process 1 left at once on a second SIGTERM (exit 143); process 0's save then failed on
    "Connection reset by peer" and it left with its own code, 6, and "free some space". An error
    that comes after another process published its failure now follows that one, as the watch
    thread would: its code and line; process 0 (the coordinator) still waits for the others."""
    from tessera import job_failure

    class Store:  # the coordinator's key-value store, process 1's failure in it
        def __init__(self):
            self.kv = {job_failure.FAILED_KEY: "143 1 SIGTERM received again: stopping now",
                       job_failure.ACK_PREFIX + "1": "1"}

        def key_value_set(self, key, value):
            if key in self.kv:
                raise RuntimeError("ALREADY_EXISTS")
            self.kv[key] = value

        def key_value_try_get(self, key):
            return self.kv[key]

        def blocking_key_value_get(self, key, wait_ms):
            return self.kv[key]

    store, left = Store(), []
    monkeypatch.setattr(job_failure, "_client", lambda: (store, 0, 2))
    monkeypatch.setattr(job_failure, "_leave", left.append)
    job_failure.end_job(6, "checkpoint save error: ... Connection reset by peer")
    assert left == [143] and store.kv[job_failure.ACK_PREFIX + "0"] == "1"
    assert ("job error: process 1 stopped with: SIGTERM received again: stopping now; this process stops too "
            "(exit code 143)") in capsys.readouterr().err


def test_process_0_gives_the_others_time_to_leave_after_they_read_its_error(monkeypatch):
    """Process 0 hosts the coordination service, which stops when it leaves: a process that had
    acknowledged the error but not yet exited (a loaded host) was aborted by JAX's error poll in
    C++ (SIGABRT, exit -6 instead of the job's 4; seen in CI on processes started with different
    configs). After the acknowledgements process 0 now waits LEAVE_GRACE_SECONDS; with none, not."""
    from tessera import job_failure

    class Store:  # the coordinator's key-value store; `acked`: the other processes that read the error
        def __init__(self, acked):
            self.kv = {job_failure.ACK_PREFIX + str(p): "1" for p in acked}

        def key_value_set(self, key, value):
            self.kv[key] = value

        def blocking_key_value_get(self, key, wait_ms):
            if key not in self.kv:
                raise RuntimeError("DEADLINE_EXCEEDED")
            return self.kv[key]

    for acked, slept in (([1, 2], [job_failure.LEAVE_GRACE_SECONDS]), ([], [])):
        store, left, sleeps = Store(acked), [], []
        monkeypatch.setattr(job_failure, "_client", lambda: (store, 0, 3))
        monkeypatch.setattr(job_failure, "_leave", left.append)
        monkeypatch.setattr(job_failure.time, "sleep", sleeps.append)
        job_failure.end_job(4, "distributed start-up error: ...")
        assert left == [4] and sleeps == slept and job_failure.LEAVE_GRACE_SECONDS >= 1.0



def test_process_0_that_follows_another_process_failure_still_leaves_last(monkeypatch):
    """Process 1 left on a second SIGTERM, waiting first for process 0 to read its line; process 0 read it
    and left at once, which stopped the coordination service before process 1 was gone: process 1 was
    aborted by JAX's error poll (exit -6, not 143; seen in a full CI run). Process 0 following another's
    failure now waits for the acknowledgement of every process still alive, then LEAVE_GRACE_SECONDS, as when
    it fails itself: the failing process only when it said it waits (a second signal; any other failing
    process left at once), and every other follower. Any process but 0 follows at once."""
    from tessera import job_failure

    class Store:  # the coordinator's key-value store: process 1's failure, acknowledged by the others
        def __init__(self, count, waits):
            self.kv = {job_failure.FAILED_KEY: "143 1 SIGTERM received again: stopping now"}
            self.kv.update({job_failure.ACK_PREFIX + str(p): "1" for p in range(1, count)})
            if waits:
                self.kv[job_failure.WAITS_PREFIX + "1"] = "1"
            self.waited = []

        def key_value_set(self, key, value):
            self.kv[key] = value

        def key_value_try_get(self, key):
            return self.kv[key]

        def blocking_key_value_get(self, key, wait_ms):
            self.waited.append(key[len(job_failure.ACK_PREFIX):])
            return self.kv[key]

    grace = [job_failure.LEAVE_GRACE_SECONDS]
    for me, count, waits, waited, slept in ((0, 3, True, ["1", "2"], grace), (0, 3, False, ["2"], grace),
                                            (0, 2, True, ["1"], grace), (0, 2, False, [], []), (2, 3, True, [], [])):
        store, left, sleeps = Store(count, waits), [], []
        monkeypatch.setattr(job_failure, "_client", lambda: (store, me, count))
        monkeypatch.setattr(job_failure, "_leave", left.append)
        monkeypatch.setattr(job_failure.time, "sleep", sleeps.append)
        job_failure.follow_earlier_failure()
        assert left == [143] and store.kv[job_failure.ACK_PREFIX + str(me)] == "1"
        assert (store.waited, sleeps) == (waited, slept), (me, count, waits)


def test_a_process_that_waits_for_the_others_says_so_before_its_failure_is_public(monkeypatch):
    """Process 0 reads whether the failing process waits (and is still alive) once the failure is public: the
    mark must be in the store first."""
    from tessera import job_failure

    class Store:
        def __init__(self):
            self.order = []

        def key_value_set(self, key, value):
            self.order.append(key)

        def blocking_key_value_get(self, key, wait_ms):
            return "1"

    for wait, marked in ((True, [job_failure.WAITS_PREFIX + "1"]), (False, [])):
        store = Store()
        monkeypatch.setattr(job_failure, "_client", lambda: (store, 1, 2))
        monkeypatch.setattr(job_failure, "_leave", lambda code: None)
        job_failure.end_job(143, "SIGTERM received again", wait_for_others=wait)
        assert store.order == [*marked, job_failure.FAILED_KEY, job_failure.ACK_PREFIX + "1"]


_MEET = """
import os, sys, time
sys.path.insert(0, {src!r})
import jax
from tessera.distributed import DistributedError
from tessera.job_sync import wait_for_all
jax.distributed.initialize("127.0.0.1:{port}", num_processes=2, process_id={rank}, initialization_timeout=60)
if {rank} == 1:
    time.sleep(8)  # does not reach the barrier in time
    os._exit(0)
try:
    wait_for_all("nobody", 2, "a point process 1 never reaches")
except DistributedError as e:
    print(e, file=sys.stderr, flush=True)
    os._exit(3)
os._exit(0)
"""


def test_a_process_that_never_arrives_is_a_clear_distributed_error():
    wait_for_all("single", 0.01, "anything")  # one process: returns at once
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count=1 {FAST_COMPILE}")
    procs = [subprocess.Popen([sys.executable, "-c", _MEET.format(src=str(REPO / "src"), port=port, rank=rank)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    (code, err), _ = _finish(procs, timeout=120)
    assert code == 3 and "process 0 of 2 waited 2 s for the other processes to reach a point " \
        "process 1 never reaches" in err, err[-3000:]
