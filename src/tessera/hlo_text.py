"""Reading compiled HLO text (`compiled.as_text()`): what the AOT compile report counts in a
program (collectives, TPU kernels, quantized matmuls, pipeline hand-overs hidden behind compute) and the
computations a program is made of, for tools that need more (benchmarks/cpu_llama_ceiling.py)."""

from __future__ import annotations

import re

# element types of quantized matmul operands in HLO text (int8 and smaller, float8)
_LOW_PRECISION = ("s8", "u8", "s4", "u4", "f8e4m3fn", "f8e5m2", "f8e4m3", "f8e4m3b11fnuz", "f8e4m3fnuz", "f8e5m2fnuz")


def low_precision_dots(hlo: str) -> dict[str, int]:
    """{operand type: count} of the dot and convolution instructions of an HLO text whose first
    operand is an 8-bit or smaller type (int8, float8): the quantized matmuls the program runs."""
    types, counts = {}, {}
    for line in hlo.splitlines():
        head = re.match(r"^\s*(?:ROOT )?%([\w.-]+) = (\w+)\[", line)
        if not head:
            continue
        types[head.group(1)] = head.group(2)
        op = re.search(r"\s(dot|convolution)\(%([\w.-]+)", line)
        if op and types.get(op.group(2)) in _LOW_PRECISION:
            kind = types[op.group(2)]
            counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items()))


def hlo_computations(hlo: str) -> dict[str, list[str]]:
    """{computation name: its instruction lines} of an HLO module's text (ENTRY included)."""
    computations: dict[str, list[str]] = {}
    current = None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%([\w.-]+) \(", line)
        if head:
            current = computations.setdefault(head.group(1), [])
        elif line == "}":  # (a multi-line attribute's own closing braces are indented or followed by more)
            current = None
        elif current is not None:
            current.append(line)
    return computations


_MATMUL = re.compile(r"\s(dot|convolution)\(")
_CALLED = re.compile(r"(?:calls|body|to_apply)=%([\w.-]+)")


def stage_transfers(hlo: str) -> tuple[int, int]:
    """(transfers, overlapped) in a compiled program: the pipeline's hand-overs between stages
    (the asynchronous collective permutes of its `ppermute`; across slices, the receives XLA
    makes of them) and how many of those have a matmul running between their start and their
    completion, i.e. are hidden behind compute (`pipeline_delay_activation_forwarding`)."""
    computations = hlo_computations(hlo)
    has_matmul: dict[str, bool] = {}

    def computes(name: str) -> bool:  # the computation (or one it calls) multiplies matrices
        if name not in has_matmul:
            has_matmul[name] = False  # (no recursion through a cycle)
            body = computations.get(name, [])
            has_matmul[name] = any(_MATMUL.search(x) or any(computes(c) for c in _CALLED.findall(x)) for x in body)
        return has_matmul[name]

    transfers = overlapped = 0
    for body in computations.values():
        for i, line in enumerate(body):
            start = re.match(r"\s*%([\w.-]+) = .*? (collective-permute-start|recv)\(", line)
            if not start or "ppermute" not in line:
                continue
            done = f"{'recv' if start.group(2) == 'recv' else 'collective-permute'}-done(%{start.group(1)})"
            end = next((j for j in range(i + 1, len(body)) if done in body[j]), None)
            if end is None:
                continue
            transfers += 1
            overlapped += any(_MATMUL.search(x) or any(computes(c) for c in _CALLED.findall(x))
                              for x in body[i + 1:end])
    return transfers, overlapped


def tpu_kernels(hlo: str) -> dict[str, int]:
    """{kernel: count} of the Mosaic kernels a TPU program runs (its `tpu_custom_call` instructions):
    Pallas kernels, named after their function (gmm, tgmm, splash_mha_fwd, ...), and XLA's own
    (ragged-dot-..., XLA's grouped matmul)."""
    names = [re.sub(r"(\.(\d+|clone))+$", "", name) for name in
             re.findall(r"^\s*(?:ROOT )?%([\w.-]+) = .*custom_call_target=\"tpu_custom_call\"", hlo, re.MULTILINE)]
    return {name: names.count(name) for name in sorted(set(names))}


# a collective instruction in compiled HLO text: `... = bf16[..] all-to-all(...)`, async ones as `-start`
COLLECTIVE_OP = re.compile(r" (ragged-all-to-all|all-to-all|all-reduce|all-gather|reduce-scatter|collective-permute)"
                           r"(?:-start)?\(")


def collectives_in_loops(hlo: str) -> dict[str, int]:
    """{collective: count} of the collectives a program runs inside its while loops (the bodies
    and what they call): each runs once per trip, where one outside a loop runs once per step.
    A pipeline with fsdp gathers each weight in every iteration (an all-gather; on TPU often an
    all-reduce of the shards placed in zeros) unless `pipeline_fsdp_ag_once` gathers it before."""
    computations = hlo_computations(hlo)
    inside: set[str] = set()
    todo = [name for lines in computations.values() for line in lines for name in re.findall(r"body=%([\w.-]+)", line)]
    while todo:
        name = todo.pop()
        if name not in inside:
            inside.add(name)
            todo.extend(c for line in computations.get(name, []) for c in _CALLED.findall(line))
    ops = [op for name in inside for line in computations.get(name, []) for op in COLLECTIVE_OP.findall(line)]
    return {op: ops.count(op) for op in sorted(set(ops))}
