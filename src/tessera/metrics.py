"""FLOPs model, per-step metrics writers and the end-of-run report (device peaks: `tessera.hardware`).

The FLOPs formula (`training_flops_per_step`) is the one used for every TFLOP/s and MFU number
Tessera prints. It counts matrix multiplications only, forward + backward (3 x forward),
and not the recomputation that rematerialization adds (model FLOPs, as in the PaLM paper's
MFU). Causal attention counts the half of the score matrix that is not masked, and a
sliding-window layer only the scores inside its window; pass `causal=False` to count the full
matrix, which is what the reference dot-product kernel executes (the unit test compares that
variant with XLA's own count).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from array import array
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tessera.config import ModelConfig
from tessera.config.layers import dense_layers, layer_attention, linear_attention_layers

log = logging.getLogger(__name__)


def matmul_params(cfg: ModelConfig) -> int:
    """Weights that take part in a matmul for every token: blocks plus the output projection.
    With experts (num_experts > 1) a token passes through num_experts_per_tok of them, the shared
    experts and the router; deepseek's first layers are dense and its attention is MLA. Each
    multi-token-prediction depth adds a block, its [2D, D] projection and the output projection
    again (and, with the iota embedding, the embedding's matmul). Llama 4's layers between its
    expert layers are dense too."""
    d, n, k, h, f = cfg.emb_dim, cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
    gated = len(cfg.mlp_activations) + 1
    attention = mla_matmul_params(cfg) if cfg.decoder_block == "deepseek" else d * n * h * 2 + d * k * h * 2
    linear = linear_attention_layers(cfg)
    if cfg.decoder_block == "qwen3_next":  # the output gate's projection; the Gated DeltaNets' (averaged per layer)
        attention += d * n * h
        layers = cfg.num_decoder_layers
        attention = ((layers - linear) * attention + linear * gated_deltanet_matmul_params(cfg)) // layers
    dense_mlp = d * f * gated
    mlp = dense_mlp
    if cfg.num_experts > 1:
        expert = d * cfg.expert_mlp_dim * gated
        mlp = expert * (cfg.num_experts_per_tok + cfg.shared_experts) + d * cfg.num_experts
    dense = dense_layers(cfg)
    logits = d * cfg.vocab_size * (2 if cfg.use_iota_embed else 1)  # iota embedding is a matmul too
    mtp = cfg.mtp_num_layers * (attention + mlp + 2 * d * d + logits)
    return (cfg.num_decoder_layers - dense) * (attention + mlp) + dense * (attention + dense_mlp) + logits + mtp


def gated_deltanet_matmul_params(cfg: ModelConfig) -> int:
    """A Gated DeltaNet layer's projection weights (tessera.models.gated_deltanet): q, k, v, z, b, a in and out."""
    d, kh, vh = cfg.emb_dim, cfg.gdn_num_key_heads, cfg.gdn_num_value_heads
    return d * (2 * kh * cfg.gdn_key_head_dim + 2 * vh * cfg.gdn_value_head_dim + 2 * vh) + vh * cfg.gdn_value_head_dim * d


def delta_rule_flops_per_token(cfg: ModelConfig, length: int) -> float:
    """Forward FLOPs of the chunked gated delta rule per token and layer, all value heads (an estimate of the
    chunked algorithm's matmuls): within its chunk of C tokens, the key-key and query-key products (2 C dk each),
    the triangular solve (C (dk + dv)) and the scores times the corrected values (2 C dv); with the carried
    state, the state's reach and read and the update (2 dk dv each)."""
    c, dk, dv = min(cfg.gdn_chunk_size, length), cfg.gdn_key_head_dim, cfg.gdn_value_head_dim
    return cfg.gdn_num_value_heads * (4 * c * dk + c * (dk + dv) + 2 * c * dv + 6 * dk * dv)


def mla_matmul_params(cfg: ModelConfig) -> int:
    """Multi-head latent attention's projection weights (tessera.models.mla), norms left out."""
    d, n, hq, hv, r, rq = cfg.emb_dim, cfg.num_query_heads, cfg.head_dim, cfg.v_head_dim, cfg.kv_lora_rank, \
        cfg.q_lora_rank
    query = d * rq + rq * n * hq if rq else d * n * hq
    return query + d * (r + cfg.qk_rope_head_dim) + r * n * (cfg.qk_nope_head_dim + hv) + n * hv * d


def keys_per_query(length: int, window: int, causal: bool = True, chunk: int = 0) -> float:
    """Keys a query attends to, averaged over a sequence of `length`: length / 2 under the causal
    mask (the convention of counting half the score matrix), window - window^2 / (2 length) for a
    sliding window shorter than the sequence (the same convention: the scores inside the band),
    chunk / 2 for attention within chunks shorter than it (half of each chunk's square), `length`
    without a mask."""
    if not causal:
        return float(length)
    if chunk and chunk < length:
        return chunk / 2
    if window and window < length:
        return window - window * window / (2 * length)
    return length / 2


def training_flops_per_step(cfg: ModelConfig, batch: int, length: int, causal: bool = True) -> float:
    """Model FLOPs of one training step (forward + backward) on `batch` sequences of `length`."""
    tokens = batch * length
    dense = 2 * matmul_params(cfg) * tokens
    # scores q.k and the weighted sum p.v: 2*H FLOPs each per query token, head and key (H: the
    # query/key width, then the value width, which MLA makes narrower)
    value_dim = cfg.v_head_dim if cfg.decoder_block == "deepseek" else cfg.head_dim
    keys = sum(layers * keys_per_query(length, window, causal, chunk) for window, chunk, layers in layer_attention(cfg))
    keys += cfg.mtp_num_layers * keys_per_query(length, cfg.sliding_window_size, causal)  # an MTP depth attends once more
    attention = 2 * cfg.num_query_heads * (cfg.head_dim + value_dim) * keys * tokens
    attention += linear_attention_layers(cfg) * delta_rule_flops_per_token(cfg, length) * tokens
    return 3.0 * (dense + attention)


UPLOAD_EVERY = 100  # gcs_metrics: records per uploaded file


def to_json(value: Any, indent: int | None = None) -> str:
    """`value` as strict JSON: a non-finite float (a NaN loss, an infinite gradient norm) becomes
    null. json.dumps writes NaN and Infinity, which are not JSON: strict readers (JavaScript's
    JSON.parse, Go, DuckDB, serde) refuse the whole file."""
    def finite(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: finite(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [finite(x) for x in v]
        return v
    return json.dumps(finite(value), indent=indent, allow_nan=False)


class MetricsWriteError(OSError):
    """metrics.jsonl or the TensorBoard file could not be written (a full disk): the run stops
    (exit code 6, as for a checkpoint that cannot be saved) rather than train on without records."""


class _TensorBoardFile:
    """A TensorBoard event file written in this thread, a record's scalars per event batch, and
    flushed after each record (as metrics.jsonl is). tensorboardX's SummaryWriter writes from a
    thread of its own through a queue of 10 events and flushes every 120 s: when that thread
    died of a full disk, the next `add_scalar` blocked the training loop for ever, and a killed
    run lost up to two minutes of events. The summaries are made here too: tensorboardX's `scalar`
    logged "NaN or Inf found in input tensor." for every non-finite value, a line per skipped step
    (on_nonfinite_loss=skip_step) that the run's own log already explains; TensorBoard shows NaN."""

    def __init__(self, folder: Path, first_step: int = 1):
        """A restart marker at `first_step` opens the file: TensorBoard then drops the events of
        that step and later from the files before it (steps an earlier attempt logged, lost and
        this one trains again), as metrics.jsonl's readers take its later record of a step; without
        it TensorBoard drew both, its curves going back to `first_step` and forward again."""
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog
        from tensorboardX.proto.summary_pb2 import Summary

        folder.mkdir(parents=True, exist_ok=True)
        self._writer, self._event, self._summary = EventsWriter(str(folder / "events")), Event, Summary
        self._writer.write_event(Event(step=first_step, wall_time=time.time(),
                                       session_log=SessionLog(status=SessionLog.START)))  # flushed with step 1's

    def add_scalars(self, values: dict[str, float], step: int) -> None:
        now = time.time()
        for tag, value in values.items():
            summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=float(value))])
            self._writer.write_event(self._event(summary=summary, step=step, wall_time=now))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _drop_cut_line(path: Path, window: int = 1 << 20) -> None:
    """Remove a last line without its newline from the metrics file an earlier attempt of the run
    left (a full disk or a kill in the middle of a record): this attempt's first record would be
    appended to it, and the two make one line that no JSON reader can parse. Only a regular file
    is read back: metrics_file=/dev/stdout (a pipe) cannot seek, and /dev/full reads zeros for ever."""
    if not path.is_file():  # missing, or a pipe or device
        return
    try:
        with open(path, "rb+") as f:
            end = f.seek(0, 2)
            f.seek(max(0, end - window))
            tail = f.read()
            if not tail or tail.endswith(b"\n"):
                return
            newline = tail.rfind(b"\n")
            if newline < 0 and end > window:  # no line of ours is that long: keep it, start a line of our own
                f.write(b"\n")
                return
            f.truncate(end - len(tail) + newline + 1)
    except FileNotFoundError:
        return
    log.warning("%s ended in a record cut off by the end of an earlier attempt (%d bytes without a newline): it is "
                "removed, so that this attempt's records start on a line of their own", path, len(tail) - newline - 1)


class MetricsWriter:
    """Writes each step's record to stdout (every `log_period`), a JSONL file and TensorBoard,
    and with `upload_dir` (gcs_metrics) also to a bucket."""

    def __init__(self, metrics_file: Path, tensorboard_dir: Path | None, log_period: int, write_files: bool = True,
                 upload_dir: str = "", last_step: int = 0, first_step: int = 1):
        """`write_files=False` (processes other than 0 in a multi-process job) logs to stdout only.
        `upload_dir` (a URL, e.g. gs://bucket/runs/r1/metrics): every UPLOAD_EVERY records, and at
        `close`, the records since the last upload are written there as one new file,
        metrics_<first step>_<last step>.jsonl, through etils' file layer (the one Orbax uses).
        Object stores cannot append, so each file is written once; a failed upload is logged and
        its records go with the next one (the local file has them all the while)."""
        self._upload_dir = upload_dir if write_files else ""
        self._pending: list[dict[str, Any]] = []
        self._jsonl, self._tb = None, None
        self._metrics_file, self._tensorboard_dir = metrics_file, tensorboard_dir
        what = f"the metrics file {metrics_file}"
        try:  # checked before compiling (output_folders.check_output_folders); a change since is one line too
            if write_files:
                metrics_file.parent.mkdir(parents=True, exist_ok=True)
                _drop_cut_line(metrics_file)
                self._jsonl = metrics_file.open("a")
            if tensorboard_dir is not None and write_files:
                what = f"the TensorBoard folder {tensorboard_dir}"
                self._tb = _TensorBoardFile(tensorboard_dir, first_step)
        except OSError as e:
            raise MetricsWriteError(f"{what} could not be opened for writing ({e.strerror or e}); make it writable "
                                    "(or free some space) and run the same command again") from None
        # the first step this attempt trains (a resumed run's too) and the run's last step are logged too
        self.log_period, self.first_step, self.last_step = log_period, first_step, last_step
        self.steps = StepTotals()  # what the report needs of the steps; their records are not kept
        self.last_record: dict[str, Any] | None = None
        self.last_eval: dict[str, Any] | None = None  # the report's final eval figures (the records are not kept)

    def write(self, record: dict[str, Any]) -> None:
        """A training step's record: JSONL, TensorBoard `train/*`, stdout every log_period steps (and
        the first this attempt trains, and the run's last).
        MetricsWriteError when a file cannot be written."""
        self.steps.add(record)
        self.last_record = record
        step = record["step"]
        self._append(record, {f"train/{name}": value for name, value in record.items()
                              if name != "step" and isinstance(value, (int, float))})
        if self._printed(step):
            log.info(format_record(record))

    def _printed(self, step: int) -> bool:
        return step % self.log_period == 0 or step in (self.first_step, self.last_step)

    def ends_at(self, step: int) -> None:
        """The run ends after `step`, before `last_step` (target_eval_loss reached, a stop signal): its
        line is printed if log_period left it out, as the last step's is."""
        printed = self._printed(step)
        self.last_step = step  # the run's last step now (a signal with the target reached: printed once)
        if self.last_record is not None and self.last_record["step"] == step and not printed:
            log.info(format_record(self.last_record))

    def write_eval(self, record: dict[str, Any]) -> None:
        """An evaluation record (eval_loss, eval_perplexity, ...): JSONL, TensorBoard `eval/*`, stdout."""
        self.last_eval = record
        self._append(record, {f"eval/{name.removeprefix('eval_')}": value for name, value in record.items()
                              if name != "step" and isinstance(value, (int, float))})
        log.info(format_eval(record))

    def _append(self, record: dict[str, Any], scalars: dict[str, float]) -> None:
        what, path = "metrics", self._metrics_file
        try:
            if self._jsonl is not None:
                self._jsonl.write(to_json(record) + "\n")
                self._jsonl.flush()
            if self._tb is not None:
                what, path = "TensorBoard events", self._tensorboard_dir
                self._tb.add_scalars(scalars, record["step"])
        except OSError as e:
            raise MetricsWriteError(f"the {what} of step {record['step']} could not be written to {path} "
                                    f"({e.strerror or e}); free some space (or fix the folder's permissions) and run "
                                    "the same command again: it resumes from the last checkpoint") from None
        if self._upload_dir:
            self._pending.append(record)
            if len(self._pending) >= UPLOAD_EVERY:
                self._upload()

    def _upload(self) -> None:
        if not self._pending:
            return
        from etils import epath

        steps = [r["step"] for r in self._pending]
        target = f"{self._upload_dir}/metrics_{min(steps):08d}_{max(steps):08d}.jsonl"
        try:  # epath.Path raises KeyError for a scheme it has no client for (file://)
            target = epath.Path(target)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text("".join(to_json(r) + "\n" for r in self._pending))
        except Exception as e:  # noqa: BLE001 - any storage error: keep the records, retry with the next upload
            log.warning("gcs_metrics: could not write %s (%s); its records go with the next upload", target, e)
            return
        self._pending = []

    def close(self) -> None:
        """Flush and close the files. A file that cannot be written any more (a full disk) gets a
        warning instead of an exception: close runs as a run ends, often while a save's error (the
        same full disk) is on its way out, which an exception here would replace with a traceback."""
        self._upload()
        for what, f in (("metrics.jsonl", self._jsonl), ("the TensorBoard files", self._tb)):
            if f is None:
                continue
            try:
                f.close()
            except OSError as e:
                log.warning("%s could not be flushed (%s); the records of the last steps may be missing from it",
                            what, e.strerror or e)


def format_eval(r: dict[str, Any]) -> str:
    """One evaluation as a log line (with MTP: its loss, and the acceptance rate when measured)."""
    mtp = f" (MTP {r['eval_mtp_loss']:.4f})" if "eval_mtp_loss" in r else ""
    if "eval_mtp_acceptance_rate_percent" in r:
        mtp += f" | MTP acceptance {r['eval_mtp_acceptance_rate_percent']:.1f}%"
    return (f"eval  {r['step']:5d} | loss {r['eval_loss']:.4f}{mtp} | perplexity {r['eval_perplexity']:.2f} | "
            f"{r['eval_tokens']} tokens in {r['eval_batches']} batches | {r['eval_seconds']:.1f} s")


def format_record(r: dict[str, Any]) -> str:
    mfu = "MFU n/a" if r.get("mfu") is None else f"MFU {100 * r['mfu']:.1f}%"
    moe = ""
    if "moe_dropped_fraction" in r:
        moe = f" | router loss {r['moe_load_balance_loss']:.3f} | dropped {100 * r['moe_dropped_fraction']:.1f}% tokens"
    if "moe_max_expert_load" in r:  # routed_bias: the balancing the bias updates aim at
        moe += f" | busiest expert {r['moe_max_expert_load']:.2f}x its share"
    mtp = f" (MTP {r['mtp_loss']:.4f})" if "mtp_loss" in r else ""  # multi-token prediction, unscaled
    if "z_loss" in r:  # z_loss_multiplier x the mean log(Z)^2: what the objective adds to the loss
        mtp += f" (z-loss {r['z_loss']:.3g})"
    return (
        f"step {r['step']:>5} | loss {r['loss']:.4f}{mtp} | {r['step_seconds']:.3f} s | "
        f"{r['tflops_per_sec_per_device']:.2f} TFLOP/s/dev | {r['tokens_per_sec_per_device']:,.0f} tok/s/dev | {mfu}"
        + moe
    )


class StepTotals:
    """What the run report needs of a run's step records, without the records: a million steps'
    dicts (about 420 bytes each) held 0.4 GB of host memory by the end of the run. It keeps the
    counts, the last loss with target tokens, and each median's values as float64 (8 bytes a step;
    the medians stay exact)."""

    MEDIANS = ("step_seconds", "tflops_per_sec_per_device", "tokens_per_sec_per_device", "mfu")

    def __init__(self, records: Iterable[dict[str, Any]] = ()):
        self.count, self.skipped, self.spikes, self.final_loss = 0, 0, 0, None
        self.values = {name: array("d") for name in self.MEDIANS}  # mfu None (no peak) is kept as NaN
        for record in records:
            self.add(record)

    def add(self, record: dict[str, Any]) -> None:
        self.count += 1
        self.skipped += bool(record.get("skipped"))
        self.spikes += bool(record.get("spike"))
        if not record.get("no_targets"):
            self.final_loss = record["loss"]
        for name, values in self.values.items():
            value = record.get(name)
            values.append(math.nan if value is None else value)

    def medians(self, warmup_steps: int) -> tuple[int, dict[str, float | None]]:
        """The number of steps after warm-up (all steps if the run was shorter) and their medians."""
        start = warmup_steps if self.count > warmup_steps else 0
        medians = {}
        for name, values in self.values.items():
            kept = [v for v in values[start:] if not math.isnan(v)] if name == "mfu" else values[start:]
            medians[name] = statistics.median(kept) if kept else None
        return self.count - start, medians


def run_report(steps: StepTotals | list[dict[str, Any]], warmup_steps: int, **extra: Any) -> dict[str, Any]:
    """Medians over the steps after warm-up (all steps if the run was shorter), and how many steps'
    updates were dropped for a non-finite loss or gradient or a spike (`steps_skipped`; the spikes,
    skip_step_on_spikes, also in `steps_skipped_spikes`). `final_loss` is the
    last step with target tokens' (a step without any reports loss 0 and makes no update; None if
    no step had any). `steps`: the writer's `StepTotals`, or the step records."""
    if not isinstance(steps, StepTotals):
        steps = StepTotals(steps)
    in_medians, medians = steps.medians(warmup_steps)
    return {
        "steps": steps.count,
        "steps_in_medians": in_medians,
        "steps_skipped": steps.skipped,
        "steps_skipped_spikes": steps.spikes,
        "final_loss": steps.final_loss,
        **medians,
        **extra,
    }
